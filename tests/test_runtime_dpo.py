"""Preference training (DPO, IPO, hinge) is exact under every schedule x method, on 2 and 4 ranks.

The reference is TRL's formula written out here (trl is not a dependency) on the single-process HF model
in float64: log π(row) = Σ over the completion's label tokens of log p, m = [log π(y_w) − log π_ref(y_w)]
− [log π(y_l) − log π_ref(y_l)], loss = mean over pairs of −log σ(βm) / max(0, 1 − βm) / (m − 1/(2β))²
(IPO on length-normalised log-probabilities, as TRL). Every rank computes one step's loss, every gradient
(gathered into HF names), the reward metrics and the forward-only log-probabilities; the reference log-
probabilities fed to the step are the model's own plus noise, so the margins are not 0. The output layer's
naive algorithm (no runtime method uses it) is checked on the vocabulary group directly.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from helpers.grads import gathered_grads as _gathered_grads
from helpers.tiny import tiny_llama
from vp_accelerate.distributed import spawn
from vp_accelerate.runtime.preference import REWARD_METRICS
from vp_accelerate.schedule.registry import supported_pairs

CONFIGS = [(s, m, 1) for s, m in supported_pairs()]  # (schedule, method, dp_size)
BETA = 0.3
LOSS_TYPES = ("sigmoid", "ipo", "hinge")  # the others: test_runtime_preference_losses.py
SEQ = 10


def _pairs(seed: int, vocab: int, pairs: int):
    """Rows 2k / 2k + 1: one prompt, a chosen and a rejected completion; prompt labels and right padding
    ignored; reference log-probabilities drawn around the model's own later."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2 * pairs, SEQ), generator=g)
    labels = ids.clone()
    for k in range(pairs):
        prompt = int(torch.randint(1, SEQ // 2, (1,), generator=g))
        ids[2 * k + 1, :prompt] = ids[2 * k, :prompt]
        labels[2 * k : 2 * k + 2, :prompt] = -100
        for r in (2 * k, 2 * k + 1):
            end = int(torch.randint(prompt + 2, SEQ + 1, (1,), generator=g))
            labels[r, end:] = -100
    noise = torch.randn(2 * pairs, generator=g, dtype=torch.float64) * 2.0
    return ids, labels, noise


def _hf_logps(model, ids, labels, mean_logits: bool = False):
    """(Σ over label tokens of log p, label-token count) per row, with the graph; with `mean_logits` also Σ over
    those positions of the logits' mean over the vocabulary (TRL's logits/* metrics)."""
    logits = model(input_ids=ids).logits[:, :-1].to(torch.float64)
    target = labels[:, 1:]
    valid = target != -100
    lp = torch.log_softmax(logits, dim=-1).gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
    out = (lp * valid).sum(dim=1), valid.sum(dim=1).to(torch.float64)
    return (*out, (logits.detach().mean(dim=-1) * valid).sum(dim=1)) if mean_logits else out


def _trl(logps, ref, tokens, beta, loss_type, logit_sums=None):
    """TRL's DPO loss and logged rewards from per-row log-probabilities (rows interleave chosen/rejected); its
    rewards and logps are of the summed log-probabilities whatever the loss (IPO normalises its loss only)."""
    sums, ref_sums = logps, ref
    if loss_type == "ipo":
        logps, ref = logps / tokens, ref / tokens
    m = (logps[0::2] - ref[0::2]) - (logps[1::2] - ref[1::2])
    losses = {
        "sigmoid": lambda: -F.logsigmoid(beta * m),
        "hinge": lambda: torch.relu(1 - beta * m),
        "ipo": lambda: (m - 1 / (2 * beta)) ** 2,
    }[loss_type]()
    ratio = (sums - ref_sums).detach()
    chosen, rejected = beta * ratio[0::2], beta * ratio[1::2]
    rewards = {
        "rewards/chosen": chosen.mean().item(),
        "rewards/rejected": rejected.mean().item(),
        "rewards/accuracies": (chosen > rejected).double().mean().item(),
        "rewards/margins": (chosen - rejected).mean().item(),
        "logps/chosen": sums[0::2].detach().mean().item(),
        "logps/rejected": sums[1::2].detach().mean().item(),
    }
    if logit_sums is not None:  # Σ over the completions' tokens of the mean logit / their count, per side
        rewards["logits/chosen"] = (logit_sums[0::2].sum() / tokens[0::2].sum()).item()
        rewards["logits/rejected"] = (logit_sums[1::2].sum() / tokens[1::2].sum()).item()
    return losses.mean(), rewards


def _reference(ckpt: str, ids, labels, noise):
    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float64)
    with torch.no_grad():
        own, _ = _hf_logps(model, ids, labels)
    ref = own + noise
    out = {}
    for loss_type in LOSS_TYPES:
        model.zero_grad()
        logps, tokens, logit_sums = _hf_logps(model, ids, labels, mean_logits=True)
        loss, rewards = _trl(logps, ref, tokens, BETA, loss_type, logit_sums)
        loss.backward()
        out[loss_type] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, rewards)
    return own, ref, out


def _loss_types(i: int) -> list[str]:
    """DPO's sigmoid loss under every configuration, IPO and hinge in turn (steps cost, configurations
    share the code path: the loss enters only through g)."""
    return ["sigmoid", ("ipo", "hinge")[i % 2]]


def _on_ranks(ckpt: str, ids, labels, noise, configs, world: int):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.preference import Preference

    results = {}
    for i, (schedule, method, dp) in enumerate(configs):
        pipe = PipelineModel(
            ckpt,
            PipelineConfig(
                schedule=schedule,
                method=method,
                microbatches=2 * (world // dp),
                dp_size=dp,
                attn_implementation="eager",
            ),
            dtype=torch.float64,
        )
        rows = ids.shape[0] // dp
        sl = slice(pipe.dp_rank * rows, (pipe.dp_rank + 1) * rows)
        own = pipe.sequence_logps(ids[sl], labels[sl])
        ref = own + noise[sl]
        per_type = {}
        for loss_type in _loss_types(i):
            pref = Preference(ref_logps=ref, beta=BETA, loss_type=loss_type)
            res = pipe.train_step(ids[sl], labels[sl], preference=pref)
            eval_loss = pipe.eval_step(ids[sl], labels[sl], preference=pref) if loss_type == "sigmoid" else None
            per_type[loss_type] = (res.loss, _gathered_grads(pipe), res.rewards, eval_loss)
            pipe.zero_grad()
        results[(schedule, method, dp)] = (pipe.dp_rank, own, per_type)
        pipe.close()
    results["output_layer"] = _output_layer_errors(ids, labels, noise)
    if world == 2:
        results["lora"] = _lora_reference(ckpt, ids, labels)
    return results


def _lora_reference(ckpt: str, ids, labels):
    """(adapter off, adapter on) log-probabilities of LoRA with non-zero adapters: the reference under LoRA is
    the base model, the adapters switched off for the pass and back on after it."""
    from vp_accelerate.runtime import AdapterConfig, PipelineConfig, PipelineModel

    pipe = PipelineModel(
        ckpt,
        PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=4, attn_implementation="eager"),
        dtype=torch.float64,
        adapter=AdapterConfig(type="lora", r=4, alpha=8),
    )
    with torch.no_grad():
        for name, p in pipe.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    off = pipe.sequence_logps(ids, labels, adapter_off=True)
    on = pipe.sequence_logps(ids, labels)
    trainable = all(p.requires_grad for n, p in pipe.named_parameters() if "lora_" in n)
    pipe.close()
    return off, on, trainable


def _output_layer_errors(ids, labels, noise) -> dict:
    """Every algorithm of the output layer alone (naive included) on this group, with a preference loss:
    relative errors of the loss, ∂X and this rank's ∂W rows against autograd over the full float64 logits."""
    import torch.distributed as dist

    from vp_accelerate.runtime.preference import PairLoss, Preference
    from vp_accelerate.vocab.labels import shift_labels
    from vp_accelerate.vocab.output_layer import ALGORITHMS, OutputLayerOptions, run_output_layer
    from vp_accelerate.vocab.partition import VocabPartition, shard_tensor

    rank, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(int(ids.sum()))
    V, h, rows = 37, 16, ids.shape[0]
    x = torch.randn(rows * SEQ, h, generator=g, dtype=torch.float64)
    weight = torch.randn(V, h, generator=g, dtype=torch.float64) * 0.5
    target = shift_labels(torch.where(labels >= 0, labels % V, -100))  # a smaller vocabulary, same masks
    part = VocabPartition(V, p, 1)
    errors = {}
    for loss_type in LOSS_TYPES:
        xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
        ce = F.cross_entropy(xr @ wr.t(), target.reshape(-1), reduction="none").reshape(rows, SEQ)
        tokens = (target != -100).sum(dim=1).to(torch.float64)
        ref_loss, _ = _trl(-ce.sum(dim=1), noise, tokens, BETA, loss_type)
        ref_loss.backward()
        for algo in ALGORITHMS:
            w = shard_tensor(weight, part, rank)
            w_grad = torch.zeros_like(w)
            pref = Preference(ref_logps=noise, beta=BETA, loss_type=loss_type)
            fn = PairLoss(labels=target, ref_logps=noise, preference=pref, pairs=rows // 2)
            st = run_output_layer(
                x,
                target.reshape(-1),
                torch.zeros(rows * SEQ),
                w,
                w_grad,
                part,
                rank,
                OutputLayerOptions(algo),
                loss_fn=fn,
            )
            start, _ = part.shard_range(rank)
            n = part.valid_rows(rank)
            # relative to the reference, or absolute where it is exactly 0 (hinge: every pair past its margin, which
            # random data sometimes gives: then the loss and every gradient are 0 on both sides)
            rel = lambda a, b: ((a - b).abs().max() / (b.abs().max() if b.abs().max() > 0 else 1.0)).item()  # noqa: E731
            logits = x @ weight.t()
            mean_logits = logits.mean(dim=-1).reshape(rows, SEQ)  # the whole vocabulary's, per token
            logp = torch.log_softmax(logits, dim=-1)
            entropy = -(logp.exp() * logp).sum(dim=-1).reshape(rows, SEQ)
            valid = target != -100
            top1 = (logits.argmax(dim=-1).reshape(rows, SEQ) == target) & valid
            errors[(algo, loss_type, "top1")] = float(not torch.equal(fn.top1 & valid, top1))
            errors[(algo, loss_type)] = max(
                rel(fn.entropy, entropy),  # Σ e^(z−m) z beside Σ e^(z−m) in C1's second all-reduce
                rel(st.loss_sum.detach().reshape(()), ref_loss.detach()),
                rel(st.grad_x, xr.grad),
                rel(w_grad[:n], wr.grad[start : start + n]) if n else 0.0,
                rel(fn.mean_logits, mean_logits),  # summed over the shards in C1's first all-reduce
            )
    return errors


def _check(world: int, vocab: int, tied: bool, configs, tmp_path):
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_llama(vocab, tied=tied, attn_implementation="eager"))
    ckpt = str(tmp_path / "ckpt")
    model.save_pretrained(ckpt)
    # 2 x pipeline ranks microbatches of 2 rows (one pair) per replica
    ids, labels, noise = _pairs(seed, vocab, pairs=2 * world)
    per_rank = spawn(_on_ranks, world, ckpt, ids, labels, noise, configs, world, timeout_s=600)
    own, _, ref = _reference(ckpt, ids, labels, noise)
    for r in range(world):
        errors = per_rank[r]["output_layer"]
        assert max(errors.values()) < 1e-12, (r, errors, seed)
        if "lora" in per_rank[r]:
            off, on, trainable = per_rank[r]["lora"]
            torch.testing.assert_close(off, own, rtol=1e-9, atol=1e-10)  # the base model's own
            assert (on - own).abs().max() > 1e-3 and trainable, (r, seed)  # the adapters are back on
    for key in configs:
        rows = ids.shape[0] // key[2]
        for r in range(world):
            dp_rank, got_own, per_type = per_rank[r][key]
            # the forward-only log-probabilities of this replica's rows, on every rank
            torch.testing.assert_close(got_own, own[dp_rank * rows : (dp_rank + 1) * rows], rtol=1e-9, atol=1e-10)
            for loss_type, (loss, grads, rewards, eval_loss) in per_type.items():
                ref_loss, ref_grads, ref_rewards = ref[loss_type]
                what = (key, loss_type, r, seed)
                assert loss == pytest.approx(ref_loss, rel=1e-9, abs=1e-12), what
                if eval_loss is not None:
                    assert eval_loss == pytest.approx(ref_loss, rel=1e-9, abs=1e-12), what
                assert set(rewards) == set(REWARD_METRICS) | {"entropy", "mean_token_accuracy"}, what
                for name in REWARD_METRICS:
                    assert rewards[name] == pytest.approx(ref_rewards[name], rel=1e-9, abs=1e-12), (*what, name)
                if grads is not None:  # gathered on pipeline rank 0 of each replica
                    assert set(grads) == set(ref_grads), what
                    for name, g in ref_grads.items():
                        err = (grads[name] - g).abs().max().item() / g.abs().max().item()
                        assert err < 1e-9, (*what, name, err)  # float64 throughout: ~1e-15 seen


def test_dpo_every_schedule_and_method_on_2_ranks_untied(tmp_path):
    _check(2, vocab=101, tied=False, configs=CONFIGS, tmp_path=tmp_path)


# 4 processes on a 2-core machine are slow: every method and schedule once, and pp2 x dp2; all pairs: slow
FOUR = [("1f1b", "vocab-1", 1), ("interleaved", "vocab-2", 1), ("vhalf", "baseline", 1), ("1f1b", "redis", 1)]
DP = [("1f1b", "vocab-2", 2), ("1f1b", "baseline", 2)]


@pytest.mark.slow  # 4 processes; the 2-rank test covers every schedule and method in the suite
def test_dpo_methods_and_schedules_on_4_ranks_tied_and_dp(tmp_path):
    _check(4, vocab=103, tied=True, configs=FOUR + DP, tmp_path=tmp_path)


@pytest.mark.slow
def test_dpo_every_schedule_and_method_on_4_ranks_tied(tmp_path):
    _check(4, vocab=103, tied=True, configs=CONFIGS, tmp_path=tmp_path)
