"""Pass and collective times from the shapes of the work — nothing fitted per model or per method.

GEMMs. C[M, N] = A[M, K] B[K, N] is cut into output tiles that the streaming multiprocessors (SMs)
run in waves. Two effects make a GEMM slower than its FLOPs at the sustained rate say:

- wave quantisation: ceil(M/tile_m) x ceil(N/tile_n) tiles (batched GEMMs: times the batch) run in
  waves of `sms`; the last wave is partly idle, so the efficiency is tiles / (waves x sms). A
  vocabulary shard of V/p rows gives fewer tiles as p grows, and a decoder layer's [N, h] outputs few
  tiles at all: this is why small shards and small hidden sizes run below the large-GEMM rate;
- short reductions: each tile pays a fixed prologue and epilogue worth `k_overhead` steps of K, so
  the efficiency is K / (K + k_overhead). Attention (K = the head dimension) pays this most.

The attention core is timed as the FLOP formula counts it (4·b·s²·h forward, the full s × s product),
its backward as the kernel runs it (the scores recomputed, then dV, dP, dQ, dK: five products).

Elementwise work is memory-bound: bytes / memory bandwidth. A decoder layer's forward moves two norms
(read + write [N, h] each), two residual adds (two reads and a write) and the MLP activation (reads
the gate/up outputs, writes [N, f]); its input-gradient pass moves twice that. The output layer's
softmax moves `logit_bytes` per logit per pass.

Collectives: a chain (schedule.ir.chain_collectives) is timed step by step from its bytes — ring
all-reduce 2(p−1)/p times the buffer, broadcast and reduce once — plus a latency per collective and
the elementwise rescale between C1's two all-reduces, as vocab/output_layer.py runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GemmModel:
    """Tiling of the device's GEMM kernels. Defaults: A100 (108 SMs), cuBLAS's 128 x 256 bf16 tiles."""

    sms: int = 108
    """Streaming multiprocessors running output tiles in parallel."""
    tile_m: int = 128
    """Rows of one output tile (the smaller output dimension is tiled by it)."""
    tile_n: int = 256
    """Columns of one output tile (the larger output dimension)."""
    k_overhead: int = 32
    """Fixed cost of one tile (loads, prologue, epilogue) in steps of the reduction dimension K."""

    def efficiency(self, m: int, n: int, k: int, batch: int = 1) -> float:
        """Fraction of the sustained large-GEMM rate `batch` [m, k] x [k, n] products reach."""
        tiles = math.ceil(min(m, n) / self.tile_m) * math.ceil(max(m, n) / self.tile_n) * batch
        wave = tiles / (math.ceil(tiles / self.sms) * self.sms)
        return wave * k / (k + self.k_overhead)

    def time(self, m: int, n: int, k: int, rate: float, batch: int = 1) -> float:
        """Seconds of `batch` [m, k] x [k, n] products at `rate` sustained FLOP/s."""
        return 2.0 * m * n * k * batch / (rate * self.efficiency(m, n, k, batch))


def layer_gemms(shape) -> dict[str, list[tuple[int, int, int, int]]]:
    """(m, n, k, batch) of one decoder layer's GEMMs in F, B (input gradients + attention backward) and W
    (weight gradients) on one TP rank. Grouped-query attention shrinks the k/v projections; tensor parallelism
    (`shape.tp`) gives a rank 1/tp of q, k, v, gate and up's outputs, of o and down's inputs and of the heads,
    on every token (the sequence is gathered before the sliced linears)."""
    t = shape.tp
    n, h, f = shape.tokens, shape.hidden, shape.ffn // t
    kv = shape.kv_heads or shape.heads
    d = max(1, shape.head_size())
    qkv = (shape.heads * d + 2 * kv * d) // t
    o = shape.heads * d // t  # o_proj's input columns on this rank
    up = f * (shape.mlp_matrices - 1)  # gate and up of a gated MLP
    s, bh = shape.seq, shape.microbatch_size * shape.heads // t
    scores, values = (s, s, d, bh), (s, d, s, bh)
    fwd = [(n, qkv, h, 1), (n, h, o, 1), (n, up, h, 1), (n, h, f, 1), scores, values]
    bwd = [(n, h, qkv, 1), (n, o, h, 1), (n, h, up, 1), (n, f, h, 1), scores, values, scores, values, values]
    wgt = [(qkv, h, n, 1), (h, o, n, 1), (up, h, n, 1), (h, f, n, 1)]
    return {"F": fwd, "B": bwd, "W": wgt}


def layer_elementwise_bytes(shape) -> dict[str, float]:
    """HBM bytes of one decoder layer's memory-bound work per pass (see the module docstring), on one TP rank:
    the norms and residual adds on the stream's tokens (1/tp under sequence parallelism), the MLP activation on
    the rank's 1/tp of its columns."""
    nh = shape.stream_tokens * shape.hidden * shape.dtype_bytes
    nf = shape.tokens * shape.ffn / shape.tp * shape.dtype_bytes
    fwd = 2 * 2 * nh + 2 * 3 * nh + shape.mlp_matrices * nf
    return {"F": fwd, "B": 2 * fwd, "W": 0.0}


def tp_collectives(shape, op: str = "F") -> list[tuple[str, float]]:
    """(kind, bytes) of the TP collectives one decoder layer's pass `op` ("F" or "B") runs on one rank
    (models/tensor_parallel.py's f where the attention and the MLP start, g after their row-split linears): under
    sequence parallelism F all-gathers each region's input and reduce-scatters its output, B reduce-scatters the
    input's gradient and all-gathers the output's; without it F all-reduces the two outputs, B the two input
    gradients. Each moves one [b, s, h] activation in the compute dtype, except f's gradient: fp32 under mixed
    precision, as HF's RMSNorm returns its output in fp32 (f's all-gather moves the 16-bit cast the linears read:
    models/tensor_parallel.py `_gathered`; measured in the dry run's recorded collectives). None without tensor
    parallelism."""
    if shape.tp == 1:
        return []
    n = shape.tokens * shape.hidden
    f_grad_bytes = n * (shape.stat_bytes if shape.dtype_bytes < 4 else shape.dtype_bytes)
    g_bytes = n * shape.dtype_bytes
    if shape.sequence_parallel:
        pair = [("all_gather", g_bytes), ("reduce_scatter", g_bytes)] if op == "F" else [
            ("reduce_scatter", f_grad_bytes), ("all_gather", g_bytes)]  # fmt: skip
        return pair * 2
    return [("all_reduce", g_bytes if op == "F" else f_grad_bytes)] * 2


def tp_collective_time(shape, bandwidth: float, latency: float, op: str = "F") -> float:
    """Seconds of one layer's TP collectives in pass `op` at `bandwidth` bus bytes/s (the node's links): a ring
    all-reduce moves 2(t-1)/t of the buffer per rank, an all-gather or a reduce-scatter (t-1)/t; each call pays
    `latency`. Not overlapped with the layer's compute (the runtime runs them synchronously in the pass)."""
    t = shape.tp
    share = {"all_reduce": 2 * (t - 1) / t, "all_gather": (t - 1) / t, "reduce_scatter": (t - 1) / t}
    return sum(share[kind] * nbytes / bandwidth + latency for kind, nbytes in tp_collectives(shape, op))


def layer_time(shape, op: str, rate: float, mem_bandwidth: float, gemm: GemmModel) -> float:
    """Seconds of one decoder layer's pass `op` ("F", "B" input gradients, "W" weight gradients) on one TP rank,
    its TP collectives not included (`tp_collective_time`)."""
    t = sum(gemm.time(m, n, k, rate, b) for m, n, k, b in layer_gemms(shape)[op])
    return t + layer_elementwise_bytes(shape)[op] / mem_bandwidth


def output_gemm_time(shape, rows: int, part: str, rate: float, gemm: GemmModel) -> float:
    """Seconds of one output-layer product over `rows` vocabulary rows: "logits" (X Wᵀ, or vocab-2's
    softmax · W, the same shape transposed), "input_grad" (G W) or "weight_grad" (Gᵀ X)."""
    n, h = shape.tokens, shape.hidden
    m, nn, k = {"logits": (n, rows, h), "input_grad": (n, h, rows), "weight_grad": (rows, h, n)}[part]
    return gemm.time(m, nn, k, rate)


def chain_steps(
    shape, p: int, op: str, method_barriers: int, bandwidth: float, latency: float, mem_bandwidth: float
) -> list[tuple[str, float]]:
    """(step, seconds) of one collective chain over p ranks, as the runtime runs it (fp32 statistics)."""
    n, h = shape.tokens, shape.hidden
    ring = 2 * (p - 1) / p
    x = shape.hidden_bytes()

    def allreduce(nbytes: float) -> float:
        return ring * nbytes / bandwidth + latency

    if op == "C1":
        if method_barriers == 1:  # vocab-2: max with [Σc_i, Σt_i] riding along, rescale, [s_i, a_i]
            rows = n * (h + 1) * 4
            return [
                ("all_reduce max m_i", allreduce(n * 4)),
                ("all_reduce sum [c_i, t_i]", allreduce(rows)),
                ("rescale", 3 * rows / mem_bandwidth),
                ("all_reduce sum [s_i, a_i] rescaled", allreduce(rows)),
            ]
        return [
            ("all_reduce max m_i", allreduce(n * 4)),
            ("all_reduce sum t_i", allreduce(n * 4)),
            ("rescale", 3 * n * 4 / mem_bandwidth),
            ("all_reduce sum s_i rescaled", allreduce(n * 4)),
        ]
    if op == "C2":
        return [("all_reduce sum grad_x_i", allreduce(n * h * 4))]
    name = {"C0": "broadcast X", "IF_REDUCE": "reduce embedding", "IB_BCAST": "broadcast grad_emb"}[op]
    return [(name, x / bandwidth + latency)]
