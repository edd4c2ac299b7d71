"""The peer: torch.distributed.pipelining's Schedule1F1B on the usual split, as torchtitan does it.

Stage 0 holds the input embedding, the last stage the final norm + lm_head (the loss runs in the
schedule's loss_fn), and the decoder layers are split evenly. Every rank builds the full HF model
from the same seed (so the weights equal a single-process reference) and keeps only its part.

Loss scaling (how it matches ours): PipelineSchedule calls loss_fn once per microbatch and, with
scale_grads=True, divides the gradients by the number of microbatches — a mean of per-microbatch
means. Ours is the token mean of the whole step. So the loss_fn returns (sum of the microbatch's token
losses) / (valid tokens in the whole step), set before each step, and scale_grads=False: the sum of
the per-microbatch losses is then exactly the step's token-mean cross entropy, and so are the grads.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from transformers import AutoModelForCausalLM

from vp_accelerate.bench.timeline import Pass
from vp_accelerate.vocab.labels import shift_labels


class PeerStage(nn.Module):
    """One pipeline stage of a Llama-style HF model: [embedding] -> decoder layers[start:end] -> [norm, lm_head].

    forward takes only the activation tensor (token ids on stage 0) because PipelineStage passes
    activations positionally; position ids and the rotary tables are rebuilt here from its shape.
    """

    def __init__(self, model: nn.Module, start: int, end: int, first: bool, last: bool):
        super().__init__()
        base = model.model
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = nn.ModuleList(base.layers[start:end])
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        pos_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0).expand(x.shape[0], -1)
        pe = self.rotary_emb(x, pos_ids)
        # attention_mask=None makes SDPA causal; no padding in these batches.
        for layer in self.layers:
            x = layer(x, position_embeddings=pe, position_ids=pos_ids)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


def even_split(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """Decoder-layer range [start, end) of `stage` when layers are split as evenly as possible."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


class TokenMeanLoss:
    """Per-microbatch loss_fn: sum of token cross entropies / valid tokens of the whole step.

    `n_valid` must be set before each step (it is known before the step starts: count labels != -100).
    """

    def __init__(self, ignore_index: int = -100):
        self.ignore_index = ignore_index
        self.n_valid = 1

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss_sum = F.cross_entropy(
            logits.flatten(0, -2).float(), target.flatten(), ignore_index=self.ignore_index, reduction="sum"
        )
        return loss_sum / self.n_valid


def build_peer_model(model_config, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The full HF causal LM from a config, with weights fixed by `seed` (identical on every rank)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    return model.train()


class PeerRunner:
    """This rank's stage of the peer plus its Schedule1F1B; records a pass timeline per step.

    Must be constructed on every rank of the default process group (world size = number of stages).
    """

    def __init__(self, model_config, microbatches: int, seed: int = 0, group=None):
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.microbatches = microbatches
        model = build_peer_model(model_config, seed)
        start, end = even_split(model_config.num_hidden_layers, self.world, self.rank)
        self.module = PeerStage(model, start, end, first=self.rank == 0, last=self.rank == self.world - 1)
        del model  # the parts this rank does not hold are freed with it
        self.stage = PipelineStage(self.module, self.rank, self.world, torch.device("cpu"), group=group)
        self.loss_fn = TokenMeanLoss()
        self.schedule = Schedule1F1B(self.stage, microbatches, loss_fn=self.loss_fn, scale_grads=False)
        self.passes: list[Pass] = []
        self._instrument()

    def _instrument(self) -> None:
        """Wrap the stage's forward/backward (and the last stage's loss) to time each pass.

        The loss is computed by the schedule right after the last stage's forward; its time is
        folded into that forward pass, as our runtime's head+loss is part of the last stage's F.
        """
        stage, sched, passes, rank = self.stage, self.schedule, self.passes, self.rank
        fwd, bwd, loss = stage.forward_one_chunk, stage.backward_one_chunk, sched._maybe_compute_loss

        def timed_fwd(mb, *args, **kwargs):
            t0 = time.perf_counter()
            out = fwd(mb, *args, **kwargs)
            passes.append(Pass(rank, "F", mb, 0, t0, time.perf_counter()))
            return out

        def timed_bwd(mb, *args, **kwargs):
            t0 = time.perf_counter()
            out = bwd(mb, *args, **kwargs)
            passes.append(Pass(rank, "B", mb, 0, t0, time.perf_counter()))
            return out

        def timed_loss(st, output, target_mbs, mb_index, *args, **kwargs):
            out = loss(st, output, target_mbs, mb_index, *args, **kwargs)
            if st.is_last and passes and passes[-1].op == "F" and passes[-1].mb == mb_index:
                passes[-1] = dataclasses.replace(passes[-1], end=time.perf_counter())
            return out

        stage.forward_one_chunk = timed_fwd
        stage.backward_one_chunk = timed_bwd
        sched._maybe_compute_loss = timed_loss

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, list[Pass]]:
        """One training step (forward + backward of all microbatches; no optimizer).

        `labels` follow HF's convention (aligned with input_ids; shifted here), as our runtime's.
        Returns (the step's token-mean loss, the same on every rank; this rank's passes).
        """
        self.passes.clear()
        labels = shift_labels(labels)
        self.loss_fn.n_valid = max(1, int((labels != self.loss_fn.ignore_index).sum()))
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(input_ids, target=labels, losses=losses, return_outputs=False)
        elif self.rank == self.world - 1:
            self.schedule.step(target=labels, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        total = torch.stack(losses).sum().detach() if losses else torch.zeros(())
        # Only the last stage sees the loss; share it so every rank reports the same number.
        dist.broadcast(total, src=self.world - 1)
        return float(total), list(self.passes)

    def zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())
