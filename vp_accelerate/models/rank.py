"""`RankModules`: everything one pipeline rank holds of the model, named like the HF model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from .adapter import PartNames
from .layout import StageLayout, layer_span
from .stage import FullEmbedding, FullHead, StageChunk

PLACEMENTS = ("baseline", "vocab")


@dataclass
class RankModules:
    """One rank's stage chunks and its part of the vocabulary layers."""

    rank: int
    """Pipeline rank these modules belong to."""
    layout: StageLayout
    """The layout the model was split with."""
    placement: str
    """"baseline" (full embedding on chunk 0's owner, full head on the last chunk's owner) or "vocab" (shards)."""
    config: object
    """The HF config of the whole model (vocab_size after any resize); what export saves."""
    names: PartNames
    """HF module paths of embedding, layers, norm, lm_head, ..."""
    chunks: dict[int, StageChunk]
    """chunk index -> module, for the chunks `layout` puts on this rank."""
    tied: bool
    """lm_head shares the embedding weight (one tensor; both gradient contributions add into it)."""
    vocab_size: int
    """Real vocabulary rows V (padded rows of shards are not tokens)."""
    partition: object | None = None
    """`vocab.VocabPartition` of the shards ("vocab" placement), else None."""
    embed_weight: nn.Parameter | None = None
    """"vocab": this rank's embedding shard [shard_size, h], padded rows zero."""
    head_weight: nn.Parameter | None = None
    """"vocab": this rank's lm_head shard [shard_size, h]; the same Parameter as embed_weight when tied."""
    head_bias: nn.Parameter | None = None
    """"vocab", families with an output bias (Phi): this rank's shard [shard_size] of it, padded entries zero."""
    embed: FullEmbedding | None = None
    """"baseline", on chunk 0's owner: full lookup ids -> E[ids] (chunk 0 applies scale / positions)."""
    head: FullHead | None = None
    """"baseline", on the last chunk's owner: X -> logits with logit_scale and softcap applied."""
    final_softcap: float | None = None
    """Final-logit softcapping cap (Gemma-2), or None; give it to the output layer."""
    logit_scale: float = 1.0
    """Logit multiplier (Cohere logit_scale, Granite 1/logits_scaling); give it to the output layer."""
    padding_idx: int | None = None
    """HF embedding padding_idx: HF's lookup gives that row no gradient (baseline `embed` does the same)."""
    tp_rank: int = 0
    """Position in the stage's tensor-parallel group (models/tensor_parallel.py); 0 without TP."""
    tp_size: int = 1
    """Tensor-parallel ranks per stage: the chunks' planned linear layers hold 1/tp_size slices."""
    trained_rows: dict = field(default_factory=dict)
    """LoRA with adapter.trainable_tokens: id(vocabulary weight) -> (weight, mask of its rows that train)."""
    container: nn.ModuleDict = field(init=False, repr=False)
    """Owns every module and parameter above, for .to() / .train() / state handling."""

    def __repr__(self) -> str:
        chunks = ", ".join(f"{c}: {layer_span(*self.layout.chunk_layers[c])}" for c in sorted(self.chunks))
        vocab = (
            f"shard rows {self.partition.shard_range(self.vocab_rank)} of {self.partition.padded_size} padded"
            if self.placement == "vocab"
            else f"embedding {'yes' if self.embed else 'no'}, head {'yes' if self.head else 'no'}"
        )
        return (
            f"RankModules(rank={self.rank}, {self.config.model_type}, placement={self.placement!r}, "
            f"chunks {{{chunks}}}, {vocab}, tied={self.tied}, {self.param_bytes()} parameter bytes)"
        )

    def __post_init__(self) -> None:
        self.container = nn.ModuleDict({f"chunk{c}": m for c, m in self.chunks.items()})
        if self.embed is not None:
            self.container["embed"] = self.embed
        if self.head is not None:
            self.container["head"] = self.head
        shards = nn.ParameterDict()
        if self.embed_weight is not None:
            shards["embed"] = self.embed_weight
        if self.head_weight is not None and not self.tied:
            shards["head"] = self.head_weight
        if self.head_bias is not None:
            shards["head_bias"] = self.head_bias
        self.container["shards"] = shards

    # ---- naming ------------------------------------------------------------------------------

    @property
    def vocab_rank(self) -> int:
        """This rank's vocabulary shard index: rank * tp_size + tp_rank."""
        return self.rank * self.tp_size + self.tp_rank

    @property
    def tp_sliced(self) -> dict[str, int]:
        """HF name -> the dim along which this rank holds a 1/tp_size slice of it (tensor parallelism); the
        baseline's end-stage vocabulary layers are sliced along their rows (`tp_vocab_names`)."""
        out = {}
        for c in sorted(self.chunks):
            chunk = self.chunks[c]
            out.update({chunk.hf_name(n): d for n, d in chunk.tp_sliced.items()})
        out.update({n: 0 for n in self.tp_vocab_names})
        return out

    @property
    def tp_vocab_names(self) -> frozenset[str]:
        """Baseline placement under tensor parallelism: the HF names of the end-stage vocabulary tensors this rank
        holds a row block of (the padded matrix's rows [tp_rank * S, (tp_rank + 1) * S), zero padding at the
        end: joined, they are cut to `vocab_size` rows)."""
        if self.tp_size == 1 or self.placement != "baseline":
            return frozenset()
        names = set()
        if self.embed is not None:
            names.add(self.embed_name)
        if self.head is not None:
            names.add(self.head_name)
            if self.head.bias is not None:
                names.add(self.head_bias_name)
        return frozenset(names)

    @property
    def tp_packed(self) -> dict[str, list[int]]:
        """HF name -> the parts' whole sizes of a fused projection sliced one part at a time (Phi-3's qkv_proj)."""
        out = {}
        for c in sorted(self.chunks):
            chunk = self.chunks[c]
            out.update({chunk.hf_name(n): parts for n, parts in chunk.tp_packed.items()})
        return out

    def tp_partial_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradient this TP rank holds only a part of (summed over TP after the backward)."""
        out = []
        for c in sorted(self.chunks):
            chunk = self.chunks[c]
            out += [chunk.get_parameter(n) for n in chunk.tp_partial]
        return out

    @property
    def embed_name(self) -> str:
        return f"{self.names.embed}.weight"

    @property
    def head_name(self) -> str:
        """HF name of the output weight; the embedding's name when tied (HF stores it once)."""
        return self.embed_name if self.tied else f"{self.names.lm_head}.weight"

    @property
    def head_bias_name(self) -> str:
        """HF name of the output bias (families that have one)."""
        return f"{self.names.lm_head}.bias"

    @property
    def output_bias(self) -> nn.Parameter | None:
        """The output bias this rank holds: its shard ("vocab"), the full bias (baseline, last rank), or None."""
        if self.head_bias is not None:
            return self.head_bias
        return self.head.bias if self.head is not None else None

    @property
    def sharded_names(self) -> frozenset[str]:
        """HF names whose tensor here is a row shard of the padded vocabulary ("vocab" placement)."""
        if self.placement != "vocab":
            return frozenset()
        names = {self.embed_name, self.head_name}
        if self.head_bias is not None:
            names.add(self.head_bias_name)
        return frozenset(names)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(HF name, parameter) for every parameter on this rank, each tensor once.

        Vocabulary shards carry the full matrix's name (see `sharded_names`); a tied weight appears
        once, under the embedding's name.
        """
        seen: set[int] = set()
        for c in sorted(self.chunks):
            for name, p in self.chunks[c].hf_named_parameters():
                seen.add(id(p))
                yield name, p
        for name, p in (
            (self.embed_name, self.embed_weight),
            (self.head_name, self.head_weight),
            (self.embed_name, self.embed.weight if self.embed else None),
            (self.head_name, self.head.weight if self.head else None),
            (self.head_bias_name, self.output_bias),
        ):
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def is_duplicate(self, name: str) -> bool:
        """True when another rank holds the same logical tensor and counts it (global norms, export).

        Only the baseline placement of a tied model duplicates anything: the last chunk's owner holds a
        copy of the embedding for its head (its gradient must be summed with the first rank's).
        """
        if self.tp_rank > 0 and self._tp_replicated(name):  # its TP rank 0 counts it
            return True
        return (
            self.placement == "baseline"
            and self.tied
            and name == self.embed_name
            and self.rank != self.layout.first_rank
        )

    def _tp_replicated(self, name: str) -> bool:
        """A decoder-chunk parameter every TP rank of the stage holds whole (a norm): not a slice, not a shard."""
        if self.tp_size == 1 or name in self.sharded_names:
            return False
        if not hasattr(self, "_tp_whole"):
            sliced = self.tp_sliced
            self._tp_whole = {n for c in self.chunks.values() for n, _ in c.hf_named_parameters() if n not in sliced}
        return name in self._tp_whole

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Baseline: E[ids] on chunk 0's owner (chunk 0 applies the scale / position pieces)."""
        if self.embed is None:
            raise RuntimeError(f"rank {self.rank} holds no full embedding (placement {self.placement!r})")
        return self.embed(ids)

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Baseline: logits (scaled, softcapped) from X on the last chunk's owner."""
        if self.head is None:
            raise RuntimeError(f"rank {self.rank} holds no full lm_head (placement {self.placement!r})")
        return self.head(x)

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF name -> detached tensor (shards as shards): the parameters and the layers' persistent buffers
        (e.g. Apertus' activation constants), everything an HF checkpoint of these parts holds."""
        out = {name: p.detach() for name, p in self.named_parameters()}
        for c in sorted(self.chunks):
            out.update({name: b.detach() for name, b in self.chunks[c].hf_named_buffers()})
        return out

    def param_bytes(self) -> int:
        """Resident parameter bytes on this rank."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    # ---- module plumbing ---------------------------------------------------------------------

    def to(self, *args, **kwargs) -> "RankModules":
        """Move / cast everything; refreshes the shard fields (a device move may replace Parameters)."""
        self.container.to(*args, **kwargs)
        shards = self.container["shards"]
        if "embed" in shards:
            self.embed_weight = shards["embed"]
            self.head_weight = shards["head"] if "head" in shards else self.embed_weight
        if "head_bias" in shards:
            self.head_bias = shards["head_bias"]
        if self.embed is not None and self.head is not None and self.tied and self.head.weight is not self.embed.weight:
            self.head.weight = self.embed.weight
        return self

    def train(self, mode: bool = True) -> "RankModules":
        self.container.train(mode)
        return self

    def eval(self) -> "RankModules":
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None
