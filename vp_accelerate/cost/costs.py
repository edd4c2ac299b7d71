"""Pass costs: how long each pass and each communication takes, and what each rank keeps in memory.

Two sources of pass times with one interface (`pass_time`, `p2p_time`, `collective_time`):
- `CostModel`: from a model shape (FLOPs of docs/design.md §1 at a sustained fraction of peak, plus the
  memory-bound softmax work on the logits) and link bandwidths;
- `MeasuredCosts`: from a JSON of measured per-pass times per rank (what the runtime records).
Memory and FLOPs always come from a shape (`CostModel`); MeasuredCosts may carry one for them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from vp_accelerate import modes
from vp_accelerate.schedule.ir import Op
from vp_accelerate.schedule.registry import Method
from vp_accelerate.schedule.registry import method as method_entry

from . import efficiency as eff
from .data_parallel import SHARDED_BYTES, assign_owners
from .efficiency import GemmModel
from .shape import ModelShape


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. Defaults: A100-80GB SXM with NVLink (the paper's machine)."""

    peak_flops: float = 312e12
    """Dense bf16 peak FLOP/s of one device (MFU's denominator)."""
    efficiency: float = 0.62
    """Fraction of peak a large, well-tiled GEMM sustains; smaller and oddly shaped GEMMs run below it
    (cost.efficiency.GemmModel). Scales absolute MFU, hardly the ratios between methods."""
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
    sms: int = 108
    """Streaming multiprocessors, for the GEMM efficiency model's wave quantisation (A100: 108, H100: 132)."""
    comm_sm_fraction: float = 0.0
    """Fraction of the SMs a rank's collective kernels hold from its issue of a collective to the
    collective's completion (NCCL: one thread block per channel); compute overlapping that window runs on
    the rest (sim/simulate.py). 0: collectives cost compute nothing."""


CPU_HARDWARE = Hardware(
    peak_flops=100e9, efficiency=0.5, mem_bandwidth=3e9, p2p_bandwidth=1e9, collective_bandwidth=1e9, latency=200e-6
)
"""One CPU core per rank with gloo between processes, for ordering a CPU run's passes (only the ratios
matter; used with the plain FLOP model, `CostModel(gemm=None)`: a core runs every GEMM at about one
rate, whatever its shape). Against the passes the benchmark measures (h = 256, seq 256, V = 32k, fp32)
it gives F : B : W : S : T = 1 : 1.1 : 0.9 : 4.2 : 2.5 for one layer, measured 1 : 0.9 : 0.6 : 2.9 : 2.1;
the A100 model gives 1 : 1.9 : 0.5 : 4.0 : 0.3 (its T is cheap because the GPU's softmax is)."""

# Presets of `vp-accelerate plan --gpu` (SXM parts): dense bf16 peak, HBM bandwidth, NVLink bandwidth per
# direction (A100 NVLink 3: 600 GB/s both ways; H100 / H200 NVLink 4: 900 GB/s), SMs; and memory per GPU
# in GB. The sustained GEMM fraction stays the A100-fitted default (an assumption the planner states).
GPU_PRESETS: dict[str, tuple[Hardware, float]] = {
    "a100": (
        Hardware(peak_flops=312e12, mem_bandwidth=2.039e12, p2p_bandwidth=300e9, collective_bandwidth=300e9, sms=108),
        80.0,
    ),
    "h100": (
        Hardware(peak_flops=989e12, mem_bandwidth=3.35e12, p2p_bandwidth=450e9, collective_bandwidth=450e9, sms=132),
        80.0,
    ),
    "h200": (
        Hardware(peak_flops=989e12, mem_bandwidth=4.8e12, p2p_bandwidth=450e9, collective_bandwidth=450e9, sms=132),
        141.0,
    ),
}


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
    """Bytes of optimizer state per parameter: fp32 master copy + Adam m and v. With the runtime's mixed
    precision (fp32 parameters, bf16/fp16 compute) the fp32 parameters are the master copy and the
    16-bit `shape.dtype_bytes` is the one low-precision copy of the weights each step holds, shared by
    every microbatch (runtime/precision.py): 2 + 4 + 12 = 18 bytes per parameter either way."""
    optimizer_shards: int = 1
    """Ranks Adam's m and v (8 of the `optimizer_bytes`) are sharded over: the data-parallel size under
    ZeRO-1 (cost/data_parallel.py, runtime/zero.py), 1 without it. The 16-bit weight copy, the fp32
    gradients and the fp32 parameters (the master copy) stay whole on every replica, so a parameter costs
    2 + 4 + 4 + 8/d = 10 + 8/d bytes."""
    split_backward: bool = False
    """The schedule splits B (input grads) from W (weight grads)."""
    output_memory: str = "store"
    """VP output layer's S->T state: "store" keeps the shard's logits, "recompute" redoes X W_iᵀ in T."""
    gemm: GemmModel | None = field(default_factory=GemmModel)
    """GEMM efficiency by shape (wave quantisation, short reductions) and memory-bound elementwise work;
    None = every FLOP at `hw.efficiency` of peak (the plain FLOP model)."""
    activation_checkpointing: str = "none"
    """Decoder layers recomputed in backward, as PipelineConfig.activation_checkpointing: "none", "full"
    (every layer keeps only its input and reruns its forward in B) or "selective" (every other layer of
    a chunk: the 1st, 3rd, ...)."""
    tp_bandwidth: float | None = None
    """Bus bytes/s of the tensor-parallel collectives inside a layer (`shape.tp` > 1): the links of the node
    a stage's TP ranks share; None = `hw.collective_bandwidth`."""

    def checkpoints_first_layer(self, chunk: int) -> bool:
        """The chunk's first layer recomputes (full and selective checkpointing: selective takes the 1st, 3rd, ...)."""
        return 0 in modes.checkpointing(self.activation_checkpointing).layers(self.chunk_layers[chunk])

    def checkpointed_layers(self, chunk: int) -> int:
        """Layers of `chunk` whose activations are recomputed."""
        return len(modes.checkpointing(self.activation_checkpointing).layers(self.chunk_layers[chunk]))

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
        """Vocabulary rows per rank in VP: V over the replica's pp x tp ranks (padded to a multiple of them)."""
        return math.ceil(self.shape.vocab / (self.num_ranks * self.shape.tp))

    @property
    def end_rows(self) -> int:
        """Baseline / redis: vocabulary rows of the end stages' embedding and output layer on one TP rank: the whole V,
        or under tensor parallelism V/tp (padded to tp shards: `VocabPartition(V, tp)`, models/build.py `_end_layers`,
        Megatron's vocab-parallel embedding and column-parallel output layer)."""
        return math.ceil(self.shape.vocab / self.shape.tp)

    @property
    def vocab_ranks(self) -> int:
        """Ranks the vocabulary collectives run over: the replica's pp x tp."""
        return self.num_ranks * self.shape.tp

    # ---- times -------------------------------------------------------------------------------
    def _flops_time(self, flops: float) -> float:
        return flops / (self.hw.peak_flops * self.hw.efficiency)

    def _logit_time(self, rows: int) -> float:
        return self.shape.tokens * rows * self.hw.logit_bytes / self.hw.mem_bandwidth

    def _gather_time(self) -> float:
        return 2 * self.shape.hidden_bytes() / self.hw.mem_bandwidth

    def _rate(self) -> float:
        return self.hw.peak_flops * self.hw.efficiency

    def _layer_time(self, op: str) -> float:
        if op == "W" and self.shape.frozen_weights:
            return 0.0  # a frozen layer computes no weight gradient (LoRA's adapters: negligible)
        tp = self.tp_time(op) if op in ("F", "B") else 0.0
        if self.gemm is None:
            return self._flops_time(dict(zip("FBW", self.shape.layer_flops()))[op]) / self.shape.tp + tp
        return eff.layer_time(self.shape, op, self._rate(), self.hw.mem_bandwidth, self.gemm) + tp

    def tp_time(self, op: str = "F") -> float:
        """Seconds of one layer's tensor-parallel collectives in pass `op` ("F" or "B": the conjugate operators),
        on the node's links and not overlapped with compute (efficiency.tp_collective_time); 0 without TP."""
        if self.shape.tp == 1:
            return 0.0
        bandwidth = self.tp_bandwidth or self.hw.collective_bandwidth
        return eff.tp_collective_time(self.shape, bandwidth, self.hw.latency, op)

    def end_tp_time(self, op: str, chunk: int) -> float:
        """Seconds of the TP collectives of the baseline's end layers split over a stage's TP ranks (models/stage.py
        `TPEmbedding`, `TPHead`; models/tensor_parallel.py), in pass `op` of `chunk`, on the node's links and not
        overlapped: chunk 0's F reduce-scatters the fp32 embedding output to the rank's 1/tp of the sequence (an
        all-reduce without sequence parallelism), its B all-gathers that gradient; the last chunk's F all-gathers
        the sequence before the final norm, then the vocabulary-parallel cross-entropy all-reduces the row maxima
        (max) and [sum of exp, target logit, sum of logits] (sum), [N] and [N, 3] fp32; its B all-reduces X's
        fp32 gradient (each rank's columns give a part of it). 0 without TP or for VP (its chains: `chain_steps`)."""
        s = self.shape
        t = s.tp
        if t == 1 or self.vocab_parallel or op == "W":
            return 0.0
        bw, lat = self.tp_bandwidth or self.hw.collective_bandwidth, self.hw.latency
        x = s.tokens * s.hidden * s.stat_bytes  # the fp32 embedding output, X and their gradients

        def gather(nbytes: float) -> float:  # an all-gather or a reduce-scatter: (t - 1)/t of the buffer
            return (t - 1) / t * nbytes / bw + lat

        def all_reduce(nbytes: float) -> float:
            return 2 * gather(nbytes) - lat

        seconds = 0.0
        if chunk == 0:
            sp = s.sequence_parallel
            seconds += (gather(x) if sp else all_reduce(x)) if op == "F" else (gather(x) if sp else 0.0)
        if chunk == len(self.chunk_rank) - 1:
            if op == "F":
                seconds += gather(s.tokens * s.hidden * s.dtype_bytes) if s.sequence_parallel else 0.0
                seconds += all_reduce(s.tokens * 4) + all_reduce(3 * s.tokens * 4)
            else:
                seconds += all_reduce(x)
        return seconds

    def _out_time(self, rows: int, *parts: str) -> float:
        """Output-layer products over `rows` vocabulary rows (see efficiency.output_gemm_time)."""
        if self.shape.frozen_weights:  # a frozen output layer computes no weight gradient
            parts = tuple(p for p in parts if p != "weight_grad")
        if self.gemm is None:
            return self._flops_time(len(parts) * self.shape.output_matmul_flops(rows))
        return sum(eff.output_gemm_time(self.shape, rows, part, self._rate(), self.gemm) for part in parts)

    def pass_time(self, rank: int, op: Op, chunk: int) -> float:
        last = len(self.chunk_rank) - 1
        if op in (Op.F, Op.B, Op.W):
            t = self._layer_time(op.value)
            if op is Op.B and not self.split_backward:
                t += self._layer_time("W")  # an unsplit backward computes the weight gradients too
            t *= self.chunk_layers[chunk]
            if op is Op.B:  # checkpointed layers rerun their forward first
                t += self.checkpointed_layers(chunk) * self._layer_time("F")
            if not self.vocab_parallel:
                if chunk == last:  # the whole output layer and loss ride on the last chunk (V/tp rows a TP rank)
                    V = self.end_rows
                    if op is Op.F:
                        t += self._out_time(V, "logits") + self._logit_time(V)
                    elif op is Op.B:
                        parts = ("input_grad",) if self.split_backward else ("input_grad", "weight_grad")
                        t += self._out_time(V, *parts) + self._logit_time(V)
                    else:
                        t += self._out_time(V, "weight_grad")
                if chunk == 0 and op is not Op.W:
                    t += self._gather_time()
                t += self.end_tp_time(op.value, chunk)
            return t
        rows = self.shard_rows
        one = self.spec.input_grad_in_t
        if op is Op.S:  # logits (+ a_i = softmax_i W_i for vocab-2) and the local softmax statistics
            return self._out_time(rows, "logits", *(() if one else ("input_grad",))) + self._logit_time(rows)
        if op is Op.T:  # weight gradient (+ local input gradient for vocab-1; + the logits again in recompute)
            parts = (
                ("weight_grad",)
                + (("input_grad",) if one else ())
                + (("logits",) if not modes.memory_mode(self.output_memory).keeps_logits else ())
            )
            return self._out_time(rows, *parts) + self._logit_time(rows)
        if op in (Op.IF, Op.IB):
            return self._gather_time()
        raise ValueError(f"no compute time for {op}")

    def p2p_time(self) -> float:
        """One stage-to-stage transfer: the [b, s, h] activation, or under sequence parallelism each TP rank's 1/tp
        of it to its counterpart (runtime/executor.py)."""
        s = self.shape
        return s.stream_tokens * s.hidden * s.dtype_bytes / self.hw.p2p_bandwidth + self.hw.latency

    def chain_steps(self, op: Op) -> list[tuple[str, float]]:
        """(step, seconds) of collective `op`'s chain (C1: max all-reduce, rescale, sums all-reduce)."""
        return eff.chain_steps(
            self.shape,
            self.vocab_ranks,
            op.value,
            self.spec.barriers,
            self.hw.collective_bandwidth,
            self.hw.latency,
            self.hw.mem_bandwidth,
        )

    def collective_time(self, op: Op) -> float:
        return sum(seconds for _, seconds in self.chain_steps(op))

    # ---- memory ------------------------------------------------------------------------------
    def activation_bytes(self, chunk: int) -> float:
        """What one microbatch keeps on the chunk's rank from its F to its B (W when split)."""
        s, last = self.shape, chunk == len(self.chunk_rank) - 1
        ckpt = self.checkpointed_layers(chunk)  # these keep only their input hidden state
        kept = self.chunk_layers[chunk] - ckpt
        # the rotary cos/sin are saved by the layers that keep their activations (none when all recompute)
        stream = s.stream_tokens * s.hidden * s.dtype_bytes  # a layer's input (1/tp of it under sequence parallelism)
        b = kept * self.layer_bytes() + ckpt * stream + s.chunk_extra_bytes(last, rotary=kept > 0)
        # the executor holds what no layer saves: a received input until its gradient leaves (with checkpointing
        # it is the first layer's saved input, counted above; chunk 0's is input_bytes; one from this rank's
        # previous chunk is that chunk's output, below) and the output until B runs backward from it
        # under sequence parallelism stages exchange each TP rank's 1/tp of the sequence (runtime/executor.py): what
        # is received and sent is the stream's slice; chunk 0 slices the fp32 embedding output, a new fp32 tensor
        # its checkpointed first layer keeps (measured: 405B, V-Half, pp 32 x tp 4, full checkpointing)
        if chunk > 0 and ckpt == 0 and self.chunk_rank[chunk - 1] != self.chunk_rank[chunk]:
            b += stream
        if chunk == 0 and s.tp > 1 and s.sequence_parallel and self.checkpoints_first_layer(chunk):
            b += s.stream_tokens * s.hidden * (s.stat_bytes - s.dtype_bytes) if self.vocab_parallel else 0.0
        if not last:
            b += stream
        if not self.vocab_parallel and last:
            b += s.tokens * self.end_rows * s.stat_bytes  # log-probabilities of the loss (at least fp32)
            if s.frozen_weights and s.dtype_bytes < 4:
                # LoRA: the frozen fp32 head is cast per call (autocast caches only the casts of weights that train),
                # and its 16-bit copy is what the product saves for X's gradient
                b += self.end_rows * s.hidden * s.dtype_bytes
            if s.attention == "flash":
                b += s.hidden_bytes()  # X (the HF count has it in the final norm's)
        return b

    def _frozen_vocab(self) -> bool:
        """A LoRA run's frozen vocabulary shards priced as frozen (fp32 only, no weight gradient in T): measured so
        under an unsplit backward (8B, 1F1B/vocab-2: the dry run within 0.4%); under a split backward (V-Half) the
        dry run holds as much as full training's pricing says (22M Llama, V-Half/vocab-1: within 0.3%), for a
        reason not yet found, so it keeps that pricing. The baseline's frozen end layers are frozen under either
        (8B shape, pp 2 x tp 2, V-Half/baseline: no step copy of them in the dry run; the planner within 2.7%)."""
        return self.shape.frozen_weights and not (self.split_backward and self.vocab_parallel)

    def layer_bytes(self) -> float:
        """One layer's kept activations per microbatch (`ModelShape.layer_activation_bytes`). A split backward
        keeps every linear's input for its W pass, frozen (LoRA) or not: full training's count (measured: a 22M
        Llama under LoRA r16, V-Half/vocab-1, within 0.3% of the dry run with it, 18-24% under without)."""
        s = self.shape
        if self.split_backward and s.frozen_weights and not s.adapted_mlp:
            # and each adapter's A casts the norm's fp32 output once more (q and v)
            casts = 2 * s.tokens * s.hidden * s.dtype_bytes if s.dtype_bytes < s.stat_bytes else 0.0
            return dataclasses.replace(s, adapted_mlp=True).layer_activation_bytes() + casts
        return s.layer_activation_bytes()

    def weight_grad_queue_bytes(self, chunk: int) -> float:
        """Split backward: what a microbatch keeps on the chunk's rank from its B to its W instead of its
        activations (B frees those; the W queue holds each linear's input and output gradient)."""
        if not self.split_backward or self.shape.frozen_weights:  # LoRA: only the small adapters' (left out)
            return 0.0
        return self.chunk_layers[chunk] * self.shape.weight_grad_queue_bytes()

    def input_bytes(self) -> float:
        """VP: the embedding output of one microbatch, [N, h] in the parameters' fp32 (the IF partials are
        sums of one shard's rows): the first stage's rank holds it from its IF reduce (up to
        `list_schedule.IF_AHEAD` ahead of F) through F, where it is the chunk's input, to B, which takes its
        gradient for IB. Other ranks hold their partial only while its reduce runs (`transient_bytes`)."""
        return self.shape.tokens * self.shape.hidden * self.shape.stat_bytes if self.vocab_parallel else 0.0

    def transient_bytes(self, op: str, chunk: int) -> float:
        """What a pass allocates and frees within itself, above what its rank holds when it starts; the
        planner's peak is the larger of what is held between passes and that plus this during one.

        B: when layers recompute, one layer's activations rebuilt; under mixed precision one weight's 16-bit
        gradient at a time (the step's weight copies are leaves whose gradient goes into the fp32 .grad as
        soon as it is complete: runtime/step_casts.py `trainable`; split backward: the weight gradients wait
        for W instead). F: a recomputing layer's activations before it drops them. S (VP):
        the baseline's last chunk: the cross-entropy's backward makes [N, V] gradients (fp32 of the
        log-probabilities, 16-bit of the logits; under TP two fp32 [N, V/tp]). S (VP): the shard's logits once more in fp32 beside the ones S keeps (recompute mode: twice, none kept).
        T (VP): the logits' 16-bit gradient, the shard weight's 16-bit gradient and its fp32 copy (recompute
        mode: and the logits again). IF (VP): the partial embedding until its reduce ran. A split backward
        under mixed precision also casts one linear's weight at a time in F and B, and W makes one 16-bit
        weight gradient at a time (`largest_cast_bytes`)."""
        s = self.shape
        ckpt = self.checkpointed_layers(chunk) if chunk is not None else 0
        layer = self.layer_bytes() if ckpt else 0.0
        cast = self.largest_cast_bytes() if chunk is not None and self.chunk_layers[chunk] else 0.0
        if op == "F":
            return layer + (cast if s.dtype_bytes < self.grad_bytes else 0.0)
        if op == "W":
            return cast
        if op == "B":
            loss = 0.0
            if not self.vocab_parallel and chunk == len(self.chunk_rank) - 1:
                # the loss's backward: the log-softmax's backward holds the fp32 gradient of the log-probabilities
                # and the one it makes for the fp32 logits at once (then the 16-bit logits' gradient, smaller); the
                # head's matmul backward then makes its 16-bit weight gradient [V, h] beside the logits' 16-bit
                # gradient, until the step cast's hook adds it into the fp32 .grad (runtime/step_casts.py).
                # Measured on a 2-layer, V 65536, h 64 model's last rank: exact at seq 64 and 256 (the count of
                # (fp32 + 16-bit) [N, V] was 1.5 N x V x 4 bytes under at seq 256; Qwen3-0.6B 5.8% under at seq 1024).
                # Under TP the vocabulary-parallel cross-entropy's backward (models/tensor_parallel.py
                # `_VocabParallelCE`) makes as many fp32 [N, V/tp] beside its saved softmax (a copy to subtract the
                # one-hot from, the padded gradient), and its forward as many beside it (8B shape, pp 2 x tp 2: the
                # dry run within 0.6% on the last rank). A frozen (LoRA) head makes no weight gradient.
                logits = s.tokens * self.end_rows
                weight_grad = logits * s.dtype_bytes + (
                    0.0 if s.frozen_weights else self.end_rows * s.hidden * s.dtype_bytes
                )
                loss = max(2 * logits * s.stat_bytes, 0.0 if self.split_backward else weight_grad)
            work = layer
            if s.frozen_weights and chunk is not None and self.chunk_layers[chunk]:
                # LoRA: a frozen MLP's backward makes its input gradients ([N, ffn/tp] 16-bit: of down's input, of the
                # gate and of up) while the layer's saved tensors are still held (measured: 8B shape, pp 2, 1F1B/
                # baseline rank 0, tp 1 and 2: the step's peak, 0.39 / 0.16 GB above the held activations; V-Half
                # with full checkpointing, rank 2 at tp 2: 0.14 GB low without it)
                work += s.mlp_matrices * s.tokens * s.ffn / s.tp * s.dtype_bytes
            # the loss's backward ends before the last layer's (and its recomputation) starts: the larger of the two
            return max(loss, work) + (cast if s.dtype_bytes < self.grad_bytes else 0.0)
        if not self.vocab_parallel:
            return 0.0
        keeps = modes.memory_mode(self.output_memory).keeps_logits
        logits = s.tokens * self.shard_rows * s.stat_bytes
        if op == "S":
            cast = s.tokens * self.shard_rows * s.dtype_bytes if self.spec.barriers == 1 and s.dtype_bytes < 4 else 0
            if self._frozen_vocab() and s.dtype_bytes < 4:  # LoRA: autocast's per-call copy of the fp32 shard
                cast += self.shard_rows * s.hidden * s.dtype_bytes
            return logits * (1 if keeps else 2) + cast  # vocab-2 (∂X in S): the 16-bit softmax that ∂X's matmul reads
        if op == "T":
            grads = s.tokens * self.shard_rows * s.dtype_bytes
            if not self._frozen_vocab():
                grads += self.shard_rows * s.hidden * (s.dtype_bytes + 4)
            elif s.dtype_bytes < 4:  # a frozen (LoRA) shard: no weight gradient; autocast's per-call copy of it
                grads += self.shard_rows * s.hidden * s.dtype_bytes
            return grads + (0.0 if keeps else logits)
        if op == "IF":
            return self.input_bytes()
        return 0.0

    def regrad_bytes(self, op: str, chunk: int) -> float:
        """What pass `op` of `chunk` makes beside a gradient it already holds, in a B after the step's first one:
        the baseline's embedding lookup has no step cast, so its backward makes a dense fp32 [V, h] gradient that
        autograd adds into the held .grad (the step's first B keeps it as the .grad: `grad_arrivals`). The lookup's
        backward runs last in the chunk's B, when the microbatch's activations are freed: the peak takes the
        larger of this less those and the pass's `transient_bytes` (sim/simulate.py). Measured:
        Qwen3-8B, 1f1b/baseline, rank 0 5.2% under the dry run without it (and without the 16-bit embedding copy
        that `copied_params` priced and the run does not make); a 2-layer, V 65536, h 64 model's rank 0 within 0.2%
        with both. 0 elsewhere (VP's shards: T's `transient_bytes`)."""
        s = self.shape
        if chunk != 0 or op != "B" or s.frozen_weights:
            return 0.0
        rows = s.positions + (0 if self.vocab_parallel else self.end_rows)  # GPT-2's wpe: a dense [P, h] one too
        return rows * s.hidden * self.grad_bytes

    def stash_bytes(self) -> float:
        """VP: what one microbatch keeps on every rank from S to T: the shard's softmax p_i (at least fp32),
        X (fp32 under mixed precision: the parameters' dtype), and for vocab-1 the local input gradient until C2."""
        if not self.vocab_parallel:
            return 0.0
        s = self.shape
        x = s.tokens * s.hidden * s.stat_bytes  # X: the last chunk's output, in the parameters' fp32 (executor)
        if not modes.memory_mode(
            self.output_memory
        ).keeps_logits:  # X and three statistics per token; T recomputes the logits
            b = 3 * s.tokens * s.stat_bytes + x
        else:
            b = s.tokens * self.shard_rows * s.stat_bytes + x
        if self.spec.input_grad_in_t:
            b += s.tokens * s.hidden * s.stat_bytes
        return b

    def rank_params(self, rank: int) -> float:
        """Parameters held by `rank`: its layers, plus the embedding / output weight (whole on the first /
        last chunk's owner for baseline and redis, one 1/p shard of each on every rank for VP)."""
        s = self.shape
        n = sum(l for c, l in enumerate(self.chunk_layers) if self.chunk_rank[c] == rank) * s.rank_layer_params()
        if rank == self.chunk_rank[0]:
            n += s.positions * s.hidden  # a learned position embedding sits with the first chunk (GPT-2's wpe)
        vocab_tensors = 1 if s.tied else 2
        if self.vocab_parallel:
            return n + vocab_tensors * self.shard_rows * s.hidden
        if rank == self.chunk_rank[0]:
            n += self.end_rows * s.hidden
        if rank == self.chunk_rank[-1] and not (s.tied and self.chunk_rank[0] == rank):
            n += self.end_rows * s.hidden
        return n

    def grad_arrivals(self, rank: int) -> dict[tuple[str, int], float]:
        """(pass, chunk) -> the gradient bytes that pass allocates the first time it runs in a step: the
        runtime frees every gradient after the optimizer step (`PipelineModel.zero_grad` sets them to None),
        so a chunk's appear at its first B (W when the backward is split), VP's vocabulary shards at the
        first T, the baseline's embedding and head with the B of their chunk. The values sum to the rank's
        `rank_params` x `grad_bytes`."""
        s, g = self.shape, self.grad_bytes
        out: dict[tuple[str, int], float] = {}
        weight_op = "W" if self.split_backward else "B"
        for c, r in enumerate(self.chunk_rank):
            if r == rank:
                out[weight_op, c] = out.get((weight_op, c), 0.0) + self.chunk_layers[c] * s.rank_layer_params() * g
        if rank == self.chunk_rank[0] and s.positions:  # the position embedding's, with chunk 0's B
            out["B", 0] = out.get(("B", 0), 0.0) + s.positions * s.hidden * g
        if self.vocab_parallel:
            out["T", 0] = (1 if s.tied else 2) * self.shard_rows * s.hidden * g
            return out
        first, last = 0, len(self.chunk_rank) - 1
        if rank == self.chunk_rank[first]:
            out[weight_op, first] = out.get((weight_op, first), 0.0) + self.end_rows * s.hidden * g
        if rank == self.chunk_rank[last] and not (s.tied and self.chunk_rank[first] == rank):
            out[weight_op, last] = out.get((weight_op, last), 0.0) + self.end_rows * s.hidden * g
        return out

    def static_bytes(self, rank: int) -> float:
        """Parameters + gradients + optimizer state of `rank` in bytes (under mixed precision: the step's
        low-precision weight copy, fp32 gradients, fp32 parameters and Adam's m and v; see optimizer_bytes)."""
        n = self.rank_params(rank)
        sharded = min(SHARDED_BYTES, self.optimizer_bytes)
        whole = self.optimizer_bytes - sharded
        copies = self.copied_params(rank) * self.shape.dtype_bytes
        return n * (self.grad_bytes + whole) + self.sharded_params(rank) * sharded + copies

    def sharded_params(self, rank: int) -> float:
        """Parameters whose Adam m and v the fullest of `rank`'s data-parallel replicas keeps: all of them without
        ZeRO-1; under it each whole parameter has one owner, largest first to the least loaded replica
        (runtime/zero.py `assign_owners`), so a share is at least the largest matrix: the baseline's V/tp x h end
        layers are one replica's (8B widths, pp 2 x tp 2 x dp 2, redis's last rank: 1/dp of the rank read 8.4% low)."""
        if self.optimizer_shards == 1:
            return self.rank_params(rank)
        s = self.shape
        h, q, kv, f, t = s.hidden, s.q_width(), s.kv_width(), s.ffn, s.tp
        layer = (h * q / t, h * kv / t, h * kv / t, h * q / t) + (h * f / t,) * s.mlp_matrices
        layers = sum(n for c, n in enumerate(self.chunk_layers) if self.chunk_rank[c] == rank)
        extra = (s.positions * h,) if rank == self.chunk_rank[0] and s.positions else ()
        if self.vocab_parallel:
            extra += (self.shard_rows * h,) * (1 if s.tied else 2)
        else:
            first, last = rank == self.chunk_rank[0], rank == self.chunk_rank[-1]
            extra += (self.end_rows * h,) * (first + (last and not (s.tied and first)))
        return fullest_share(layer, layers, extra, self.optimizer_shards)

    def copied_params(self, rank: int) -> float:
        """Parameters of `rank` whose low-precision copy the step holds: all of them (autocast caches each
        weight's cast for the step), except a split backward's decoder layers under mixed precision, whose
        linears cast their weight at each call and drop it (runtime/weight_grad.py `_DeferredLinear`); the
        vocabulary matrices keep their step copy (runtime/step_casts.py). In fp32 the term is the parameter."""
        n = self.rank_params(rank)
        if self.split_backward and self.shape.dtype_bytes < self.grad_bytes:
            n -= (
                sum(c for i, c in enumerate(self.chunk_layers) if self.chunk_rank[i] == rank)
                * self.shape.rank_layer_params()
            )
        s = self.shape
        if rank == self.chunk_rank[0]:
            n -= s.positions * s.hidden  # a lookup, no autocast op: no 16-bit copy
        if not self.vocab_parallel and rank == self.chunk_rank[0] and s.dtype_bytes < self.grad_bytes:
            # the baseline's whole embedding is looked up in fp32 (F.embedding is no autocast op, and it is no
            # matmul weight the step casts): no 16-bit copy, unless the tied head on this rank casts the one tensor
            if not (s.tied and self.chunk_rank[-1] == rank):
                n -= self.end_rows * s.hidden  # V/tp rows under TP
        return n

    def largest_cast_bytes(self) -> float:
        """A split backward's transient under mixed precision: one linear's weight cast (F, B) or its 16-bit
        weight gradient before W adds it into the fp32 grad; the largest is an MLP matrix."""
        s = self.shape
        return s.hidden * max(s.hidden, s.ffn) / s.tp * s.dtype_bytes if self.split_backward else 0.0

    def bytes_per_param(self) -> float:
        """Static bytes per parameter: 16-bit weights + fp32 gradient + fp32 master + Adam's m and v (sharded
        over `optimizer_shards` replicas under ZeRO-1)."""
        sharded = min(SHARDED_BYTES, self.optimizer_bytes)
        whole = self.optimizer_bytes - sharded
        return self.shape.dtype_bytes + self.grad_bytes + whole + sharded / self.optimizer_shards

    def model_flops(self) -> float:
        """Paper-counted training FLOPs of one microbatch (MFU numerator)."""
        return self.shape.model_flops()


@functools.lru_cache(maxsize=4096)
def fullest_share(layer: tuple, layers: int, extra: tuple, replicas: int) -> float:
    """The largest per-replica sum when `layers` x the `layer` sizes and the `extra` sizes are given owners by
    `assign_owners`, as runtime/zero.py gives them (largest first to the least loaded replica)."""
    sizes = layer * layers + extra
    loads = [0.0] * replicas
    for size, owner in zip(sizes, assign_owners(list(sizes), replicas)):
        loads[owner] += size
    return max(loads)


def even_layer_split(num_layers: int, num_chunks: int) -> tuple[int, ...]:
    """Layers per chunk as the runtime splits them (`models.layout.split_counts`: the first
    `num_layers % num_chunks` chunks get one more). Written out here because importing the models
    package loads torch, seconds the planner need not spend; tests/test_cost_layout.py checks the two
    agree. ValueError when a chunk would get no layer."""
    if not 1 <= num_chunks <= num_layers:
        raise ValueError(f"cannot split {num_layers} decoder layers into {num_chunks} chunks of at least one layer")
    base, extra = divmod(num_layers, num_chunks)
    return tuple(base + (1 if c < extra else 0) for c in range(num_chunks))


@dataclass(frozen=True)
class MeasuredCosts:
    """Pass times measured on real hardware, per rank, in seconds.

    JSON: {"passes": [{"F": s, "B": s, "W": s, "S": s, "T": s, "IF": s, "IB": s}, ...one per rank],
           "p2p": s, "collectives": {"C0": s, "C1": s, "C2": s, "IF_REDUCE": s, "IB_BCAST": s},
           "issue": {"SEND_ACT": s, "RECV_ACT": s, ..., "C1": s}}  (issue: optional, host time per post)
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
    issue: dict = field(default_factory=dict)
    """Op name -> seconds of the compute thread's time to post a transfer or hand a collective over."""

    @staticmethod
    def from_json(path, model: CostModel | None = None) -> "MeasuredCosts":
        d = json.loads(Path(path).read_text())
        return MeasuredCosts(
            tuple(d["passes"]),
            float(d.get("p2p", 0.0)),
            dict(d.get("collectives", {})),
            issue=dict(d.get("issue", {})),
            model=model,
        )

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

    def issue_time(self, op: Op) -> float:
        return float(self.issue.get(op.value, 0.0))
