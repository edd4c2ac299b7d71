"""Pass costs: how long each pass and each communication takes, and what each rank keeps in memory.

Two sources of pass times with one interface (`pass_time`, `p2p_time`, `collective_time`):
- `CostModel`: from a model shape (FLOPs of docs/design.md §1 at a sustained fraction of peak, plus the
  memory-bound softmax work on the logits) and link bandwidths;
- `MeasuredCosts`: from a JSON of measured per-pass times per rank (what the runtime records).
Memory and FLOPs always come from a shape (`CostModel`); MeasuredCosts may carry one for them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from vp_accelerate.schedule.ir import Op
from vp_accelerate.schedule.registry import Method, method as method_entry

from .shape import ModelShape


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. Defaults: A100-80GB SXM with NVLink (the paper's machine)."""

    peak_flops: float = 312e12
    """Dense bf16 peak FLOP/s of one device (MFU's denominator)."""
    efficiency: float = 0.55
    """Fraction of peak the matmuls sustain; scales absolute MFU, hardly the ratios between methods."""
    mem_bandwidth: float = 1.6e12
    """HBM bytes/s, for memory-bound work (softmax over the logits, embedding gathers)."""
    logit_bytes: float = 12.0
    """HBM bytes moved per logit per direction by the softmax/cross-entropy elementwise work."""
    p2p_bandwidth: float = 100e9
    """Bytes/s of one point-to-point activation transfer between neighbouring stages."""
    collective_bandwidth: float = 100e9
    """Bus bytes/s of the vocabulary collectives over the pipeline group."""
    latency: float = 20e-6
    """Seconds of fixed cost per communication call."""


@dataclass(frozen=True)
class CostModel:
    """Pass times and memory from a model shape, for one schedule's layout and method."""

    shape: ModelShape
    """The model and microbatch."""
    method: str
    """A key of schedule.registry.METHODS ("baseline", "redis", "vocab-1", "vocab-2")."""
    chunk_rank: tuple[int, ...]
    """Owner rank of each chunk (from the schedule)."""
    chunk_layers: tuple[int, ...]
    """Transformer layers in each chunk, model order."""
    hw: Hardware = field(default_factory=Hardware)
    """Device and link speeds."""
    grad_bytes: int = 4
    """Bytes per gradient element (fp32 accumulation)."""
    optimizer_bytes: int = 12
    """Bytes of optimizer state per parameter: fp32 master copy + Adam m and v."""
    split_backward: bool = False
    """The schedule splits B (input grads) from W (weight grads)."""

    @property
    def num_ranks(self) -> int:
        return max(self.chunk_rank) + 1

    @property
    def spec(self) -> Method:
        """The registry entry of `method`."""
        return method_entry(self.method)

    @property
    def vocab_parallel(self) -> bool:
        return self.spec.vocab_parallel

    @property
    def shard_rows(self) -> int:
        """Vocabulary rows per rank in VP (V padded to a multiple of p)."""
        return math.ceil(self.shape.vocab / self.num_ranks)

    # ---- times -------------------------------------------------------------------------------
    def _flops_time(self, flops: float) -> float:
        return flops / (self.hw.peak_flops * self.hw.efficiency)

    def _logit_time(self, rows: int) -> float:
        return self.shape.tokens * rows * self.hw.logit_bytes / self.hw.mem_bandwidth

    def _gather_time(self) -> float:
        return 2 * self.shape.hidden_bytes() / self.hw.mem_bandwidth

    def pass_time(self, rank: int, op: Op, chunk: int) -> float:
        s = self.shape
        last = len(self.chunk_rank) - 1
        if op in (Op.F, Op.B, Op.W):
            f, b, w = s.layer_flops()
            n = self.chunk_layers[chunk]
            if op is Op.B and not self.split_backward:
                b += w  # an unsplit backward computes the weight gradients too
            t = self._flops_time(n * {Op.F: f, Op.B: b, Op.W: w}[op])
            if not self.vocab_parallel:
                if chunk == last:  # the whole output layer and loss ride on the last chunk
                    head = s.output_matmul_flops()
                    if op is Op.F:
                        t += self._flops_time(head) + self._logit_time(s.vocab)
                    elif op is Op.B:
                        t += self._flops_time(head if self.split_backward else 2 * head) + self._logit_time(s.vocab)
                    else:
                        t += self._flops_time(head)
                if chunk == 0 and op is not Op.W:
                    t += self._gather_time()
            return t
        rows = self.shard_rows
        mm = s.output_matmul_flops(rows)
        if op is Op.S:  # logits (+ a_i = p_i W_i for vocab-2) and the local softmax statistics
            return self._flops_time(mm * (1 if self.spec.input_grad_in_t else 2)) + self._logit_time(rows)
        if op is Op.T:  # weight gradient (+ local input gradient for vocab-1)
            return self._flops_time(mm * (2 if self.spec.input_grad_in_t else 1)) + self._logit_time(rows)
        if op in (Op.IF, Op.IB):
            return self._gather_time()
        raise ValueError(f"no compute time for {op}")

    def p2p_time(self) -> float:
        return self.shape.hidden_bytes() / self.hw.p2p_bandwidth + self.hw.latency

    def collective_time(self, op: Op) -> float:
        s, p = self.shape, self.num_ranks
        ring = 2 * (p - 1) / p  # all-reduce moves this many times the buffer over the bus
        x = s.hidden_bytes()
        stats = 3 * s.tokens * 4  # max, sum, target logit per token, fp32
        nbytes = {
            Op.C0: x,
            Op.IF_REDUCE: x,
            Op.IB_BCAST: x,
            Op.C1: ring * (stats + (s.tokens * s.hidden * 4 if self.spec.grad_barrier is Op.C1 else 0)),
            Op.C2: ring * s.tokens * s.hidden * 4,
        }[op]
        return nbytes / self.hw.collective_bandwidth + self.hw.latency

    # ---- memory ------------------------------------------------------------------------------
    def activation_bytes(self, chunk: int) -> float:
        """What one microbatch keeps on the chunk's rank from its F to its B (W when split)."""
        s, last = self.shape, chunk == len(self.chunk_rank) - 1
        b = self.chunk_layers[chunk] * s.layer_activation_bytes() + s.chunk_extra_bytes(last)
        if not self.vocab_parallel and last:
            b += s.tokens * s.vocab * s.stat_bytes  # log-probabilities of the loss (at least fp32)
            if s.attention == "flash":
                b += s.hidden_bytes()  # X (the HF count has it in the final norm's)
        return b

    def stash_bytes(self) -> float:
        """VP: what one microbatch keeps on every rank from S to T: the shard's softmax p_i (at least fp32),
        X, and for vocab-1 the local input gradient until C2."""
        if not self.vocab_parallel:
            return 0.0
        s = self.shape
        b = s.tokens * self.shard_rows * s.stat_bytes + s.hidden_bytes()
        if self.spec.input_grad_in_t:
            b += s.tokens * s.hidden * s.stat_bytes
        return b

    def rank_params(self, rank: int) -> float:
        """Parameters held by `rank`: its layers, plus the embedding / output weight (whole on the first /
        last chunk's owner for baseline and redis, one 1/p shard of each on every rank for VP)."""
        s = self.shape
        n = sum(l for c, l in enumerate(self.chunk_layers) if self.chunk_rank[c] == rank) * s.layer_params()
        vocab_tensors = 1 if s.tied else 2
        if self.vocab_parallel:
            return n + vocab_tensors * self.shard_rows * s.hidden
        if rank == self.chunk_rank[0]:
            n += s.vocab * s.hidden
        if rank == self.chunk_rank[-1] and not (s.tied and self.chunk_rank[0] == rank):
            n += s.vocab * s.hidden
        return n

    def static_bytes(self, rank: int) -> float:
        """Parameters + gradients + optimizer state of `rank` in bytes."""
        return self.rank_params(rank) * (self.shape.dtype_bytes + self.grad_bytes + self.optimizer_bytes)

    def model_flops(self) -> float:
        """Paper-counted training FLOPs of one microbatch (MFU numerator)."""
        return self.shape.model_flops()


def even_layer_split(num_layers: int, num_chunks: int) -> tuple[int, ...]:
    """Layers per chunk, the first num_layers % num_chunks chunks one more (as models.layout does)."""
    if num_chunks > num_layers:
        raise ValueError(f"{num_layers} layers cannot fill {num_chunks} chunks (each needs one)")
    base, extra = divmod(num_layers, num_chunks)
    return tuple(base + (1 if c < extra else 0) for c in range(num_chunks))


@dataclass(frozen=True)
class MeasuredCosts:
    """Pass times measured on real hardware, per rank, in seconds.

    JSON: {"passes": [{"F": s, "B": s, "W": s, "S": s, "T": s, "IF": s, "IB": s}, ...one per rank],
           "p2p": s, "collectives": {"C0": s, "C1": s, "C2": s, "IF_REDUCE": s, "IB_BCAST": s}}
    A per-chunk time may be given as "F:3" (chunk 3); it overrides the rank's "F".
    """

    passes: tuple[dict, ...]
    """Per rank: op name (or "op:chunk") -> seconds."""
    p2p: float = 0.0
    """Seconds per activation/gradient transfer."""
    collectives: dict = field(default_factory=dict)
    """Collective op name -> seconds."""
    model: CostModel | None = None
    """Shape-based model for memory and FLOPs (optional)."""

    @staticmethod
    def from_json(path, model: CostModel | None = None) -> "MeasuredCosts":
        d = json.loads(Path(path).read_text())
        return MeasuredCosts(tuple(d["passes"]), float(d.get("p2p", 0.0)), dict(d.get("collectives", {})), model)

    def pass_time(self, rank: int, op: Op, chunk: int) -> float:
        times = self.passes[rank]
        key = f"{op.value}:{chunk}"
        if key in times:
            return float(times[key])
        if op.value not in times:
            raise KeyError(f"measured costs give no {op.value} time for rank {rank}")
        return float(times[op.value])

    def p2p_time(self) -> float:
        return self.p2p

    def collective_time(self, op: Op) -> float:
        return float(self.collectives.get(op.value, 0.0))
