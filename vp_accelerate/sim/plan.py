"""The planner: every way to lay a model out on a cluster, screened for memory, the fitting ones
simulated, best first.

For a model shape, a GPU count (and GPUs per node), memory per GPU, sequence length and global batch it
enumerates schedule x method x (pp, dp) x microbatch size (hence microbatches per replica) x ZeRO stage
(0 or 1, dp > 1) x activation checkpointing (none, selective, full) x output-layer memory mode (VP).

pp = 1 is plain data parallelism: every GPU holds the whole model with its gradients (and, without
ZeRO-1, its optimizer state) and runs its microbatches one after the other (gradient accumulation).

How it stays fast (seconds for a 70B model on 32 GPUs):
- memory first, without timing anything: a layout whose parameters, gradients and optimizer state alone
  overflow a GPU is dropped; the others get their activation peak from the order of each rank's passes
  (`simulate.order_peak_memory`), which needs no clock;
- dominated layouts are not timed: checkpointing and the "recompute" output memory only ever make a
  step slower, so of the (checkpointing, memory) variants of one layout only those that fit and that
  no faster variant that fits dominates are simulated (none before selective before full; store before
  recompute);
- each fitting layout is timed by the replay of the order the runtime would run (cost-aware,
  cost.cost_aware_schedule). That order is built once per (schedule, method, pp, simulated microbatches,
  checkpointing, links), at one sequence per microbatch and the "store" memory mode, and cached: the pass
  times' ratios that order it hardly move with the microbatch size. A step of m microbatches is simulated
  at min(m, pp) and extrapolated: past the warm-up every extra microbatch adds the busiest rank's work
  for one microbatch. (Measured against whole simulations of a 70B model at 8 ranks x 64 microbatches:
  1F1B and interleaved within 1.4%, V-Half 5% fast, since its steady state keeps a small bubble.)

Nodes: ranks are numbered as the runtime numbers them (pipelines are blocks of consecutive ranks,
sim/cluster.py), so a pipeline of at most a node's GPUs stays inside the node; a pipeline or data-parallel
group that crosses nodes is priced at the inter-node bandwidth. Data parallelism adds the gradient
synchronisation (all-reduce, or ZeRO-1's reduce-scatter + all-gather) and the optimizer step after the
pipeline drains (cost/data_parallel.py).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from vp_accelerate import modes
from vp_accelerate.cost import (
    CostModel,
    Hardware,
    ModelShape,
    cost_aware_schedule,
    for_schedule,
    gpu_order,
    shape_from_hf_config,
)
from vp_accelerate.cost.data_parallel import (
    OPTIMIZER_STEP_BYTES,
    ZERO_LEVELS,
    check_zero,
    grad_sync_time,
    optimizer_shards,
    optimizer_step_time,
    overlapped_sync_time,
)
from vp_accelerate.cost.memory import (
    COMMUNICATOR_BYTES,
    CONTEXT_BYTES,
    FRAGMENTATION,
    LORA_TARGETS,
    allocated_of,
    lora_layer_params,
    reserve_bytes,
    run_memory,
    tied_ranks,
)
from vp_accelerate.cost.shape import default_attention
from vp_accelerate.model_config import read_config_json
from vp_accelerate.schedule import build_schedule
from vp_accelerate.schedule.ir import COMPUTE_OPS, Op, Schedule
from vp_accelerate.schedule.registry import METHODS, SCHEDULES, check_pair

from .cluster import INTERNODE_BANDWIDTH, Cluster
from .simulate import memory_events, order_peak_memory, simulate

TP_SIZES = (1, 2, 4, 8)
"""Tensor-parallel sizes the planner tries by default (a node of 8 GPUs at most)."""
TP_METHODS = ("baseline", "redis", "vocab-1", "vocab-2")
"""Methods the planner lays out with tp > 1, as the runtime runs them: vocab-1 / vocab-2 shard the vocabulary over
the replica's pp x tp ranks; baseline and redis split their end stages' embedding and output layer over the stage's
TP ranks (V/tp rows each, a vocabulary-parallel cross-entropy: `CostModel.end_rows`, `end_tp_time`). Interlaced is
refused under TP (runtime/tensor_parallel.py `NOT_YET`)."""
NO_TP_FAMILIES = frozenset({"gpt2", "bloom", "opt", "falcon", "gpt_bigcode", "stablelm", "mpt", "olmo2"})
"""Families whose config declares no TP plan, or one with styles the runtime does not split (OLMo-2's q/k/v, normalised
over all heads: docs/tensor_parallelism.md), whatever plan a config object carries. (Phi-3's fused projections are
split one part at a time.)"""

DATA_PARALLEL = ("1f1b", "baseline")
"""The (schedule, method) a pp = 1 plan runs: one rank, the whole model, nothing to pipeline."""

NODE_MARGIN = 0.03
"""Pipelines inside a node are preferred: one that crosses nodes ranks above them only when it is
predicted more than 3% faster. Its point-to-point transfers and vocabulary collectives then share the
inter-node fabric with the other replicas' gradient traffic, and a slow link or node stalls the whole
pipeline; the simulator models neither (sim/cluster.py prices each group's links alone)."""

MEMORY_MODES = tuple(modes.MEMORY_MODES)
"""Output-layer memory modes the planner tries, cheapest first (store, recompute)."""
HEADROOM_TIE = 0.01
"""Plans within 1% of the fastest one's tokens/s are as fast as it (the simulator's error is larger): among
them the planner picks the one with the most memory left (the least peak on its fullest rank)."""
TIGHT = 0.95
"""A plan whose fullest rank needs more than 95% of the GPU's memory (reserve included) is flagged tight."""
CHECKPOINTING = ("none", "selective", "full")
"""Activation-checkpointing modes the planner tries, cheapest first (modes.CHECKPOINTING)."""


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for."""

    gpus: int
    """GPUs in all (pp x tp x dp)."""
    memory_gb: float
    """Memory per GPU in GB (1e9 bytes) that a rank may fill."""
    seq: int
    """Tokens per sequence."""
    global_batch: int
    """Sequences per optimizer step, all replicas together."""
    hardware: Hardware = field(default_factory=Hardware)
    """Device speed and links inside a node (peak FLOP/s for MFU, sustained efficiency, bandwidths)."""
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Sequences per microbatch to try (those that divide a replica's batch)."""
    schedules: tuple[str, ...] = tuple(SCHEDULES)
    """Schedule kinds to try."""
    methods: tuple[str, ...] = tuple(m for m, entry in METHODS.items() if not entry.synchronous)
    """Methods to try (by default all but the paper's interlaced baseline, kept for measurement: it holds 1.5p
    microbatches where vocab-2 holds p + 1, and is not faster under this model's costs)."""
    gpus_per_node: int | None = None
    """GPUs per node; None = all GPUs in one node (every link at `hardware`'s bandwidth)."""
    internode_bandwidth: float = INTERNODE_BANDWIDTH
    """Bytes/s per GPU between nodes (used with `gpus_per_node`)."""
    zero: tuple[int, ...] = ZERO_LEVELS
    """ZeRO stages to try when dp > 1 (0: whole optimizer state per replica, 1: sharded over dp)."""
    checkpointing: tuple[str, ...] = CHECKPOINTING
    """Activation-checkpointing modes to try (PipelineConfig.activation_checkpointing)."""
    top: int = 5
    """Fitting plans that come out simulated and exactly ranked; the others that fit are simulated only
    when their lower bound (the busiest rank's work) does not already rank them below these."""
    lora_rank: int | None = None
    """LoRA of this rank instead of full training: memory priced by cost/memory.py `lora_rank_memory` (frozen
    base in the compute dtype, adapters trained); None = every parameter trains."""
    lora_targets: tuple[str, ...] = LORA_TARGETS
    """The adapted linear modules (HF names, or "all-linear") when `lora_rank` is set."""
    tensor_parallel: tuple[int, ...] = TP_SIZES
    """Tensor-parallel sizes to try; each is kept only where it divides the GPUs per node (a stage's TP ranks stay
    inside a node), the heads, the key/value heads, the MLP width and the sequence, for a family with a TP plan
    and a vocabulary-parallel method (`tp_sizes`)."""

    @property
    def cluster(self) -> Cluster:
        return Cluster(self.gpus, self.gpus_per_node, self.internode_bandwidth)


@dataclass(frozen=True)
class Plan:
    """One layout: its memory per rank, and (when it fits) its simulated step."""

    schedule: str
    """Schedule kind."""
    method: str
    """Method."""
    pp: int
    """Pipeline ranks."""
    dp: int
    """Data-parallel replicas."""
    microbatch_size: int
    """Sequences per microbatch."""
    microbatches: int
    """Microbatches per replica per step."""
    memory: str
    """Output-layer S->T state: "store" or "recompute" (VP only; "store" otherwise)."""
    chunk_layers: tuple[int, ...]
    """Decoder layers per chunk, model order."""
    step_time_s: float
    """Predicted seconds per optimizer step (nan when the layout does not fit: not timed)."""
    tokens_per_s: float
    """global batch x seq / step time (0 when not timed)."""
    mfu: float
    """Model FLOPs utilisation (paper's FLOP count, GQA-aware, over peak; 0 when not timed)."""
    bubble: float
    """Idle fraction of rank time (nan when not timed)."""
    peak_memory_gb: tuple[float, ...]
    """Per pipeline rank: parameters + gradients + optimizer state + peak activations + the reserve (CUDA
    context, NCCL buffers, fragmentation; cost/memory.py `rank_memory`), GB (a layout dropped on its static
    memory alone: that + one microbatch's activations + the reserve, a lower bound). A layout that passes
    the screen gets it on the order a GPU runs (`cost.gpu_order`, the dry run's order; `gpu_peaks`)."""
    fits: bool
    """Every rank's peak fits in the request's memory per GPU."""
    zero: int = 0
    """ZeRO stage: 1 = optimizer state and fp32 master weights sharded over the dp replicas (dp > 1)."""
    activation_checkpointing: str = "none"
    """Decoder layers recomputed in backward: "none", "selective" (every other one) or "full"."""
    pipeline_crosses_nodes: bool = False
    """The pipeline's ranks span nodes (its transfers priced at the inter-node bandwidth)."""
    memory_bound: bool = False
    """`peak_memory_gb` is a lower bound: the layout was dropped on its static memory plus one microbatch's
    activations before any order was read (it needs at least that)."""
    reserve_gb: tuple[float, ...] = ()
    """Per pipeline rank, the reserve inside `peak_memory_gb` (cost/memory.py `reserve_bytes`: CUDA context,
    NCCL buffers per communicator, fragmentation), GB."""
    gpu_order: bool = False
    """`peak_memory_gb` is read on the order a GPU runs (`gpu_peaks`); else on the grid's screen order (a
    layout far below the card, or dropped by the screen)."""
    simulated: bool = False
    """The step was simulated. A fitting plan that was not: its busiest rank's work alone already makes it
    slower than the request's `top` plans, and its step time is that lower bound (tokens/s and MFU upper
    bounds)."""
    tp: int = 1
    """Tensor-parallel ranks per stage (sequence parallelism on, the runtime's default); `peak_memory_gb` is per
    pipeline rank, the same on each of its TP ranks."""

    def pipeline_section(self) -> dict:
        """The recipe `pipeline:` keys (runtime.PipelineConfig fields) this plan sets, ZeRO stage included
        (runtime/zero.py shards Adam's m and v over dp as priced)."""
        return {
            "zero": self.zero,
            "schedule": self.schedule,
            "method": self.method,
            "microbatches": self.microbatches,
            "memory": self.memory,
            "dp_size": self.dp,
            "pp_size": self.pp,
            "tp_size": self.tp,
            "activation_checkpointing": self.activation_checkpointing,
        }

    @property
    def label(self) -> str:
        """ "schedule/method", or "data parallel" for pp = 1 (no pipeline; with TP "data parallel/method": where the
        vocabulary lives still differs)."""
        if self.pp == 1:
            return f"data parallel/{self.method}" if self.tp > 1 else "data parallel"
        return f"{self.schedule}/{self.method}"

    def describe(self) -> str:
        tp = f" tp={self.tp}" if self.tp > 1 else ""
        return (
            f"{self.label} pp={self.pp}{tp} dp={self.dp} mbs={self.microbatch_size} "
            f"m={self.microbatches} memory={self.memory} zero={self.zero} ckpt={self.activation_checkpointing}"
        )


@dataclass
class Search:
    """What a plan search found."""

    plans: list[Plan]
    """Fitting plans (timed, fastest first), then the others (untimed, least memory first)."""
    considered: int
    """Layouts enumerated, including those not timed because a faster variant of theirs fits."""
    dominated: int
    """Layouts skipped: a variant with less recomputation fits (it is faster and also fits)."""
    bounded: int = 0
    """Fitting layouts not simulated: their work bound is slower than the `top` simulated ones."""

    @property
    def fitting(self) -> list[Plan]:
        return [p for p in self.plans if p.fits]

    def smallest_need_gb(self) -> float | None:
        """The least peak memory of any layout that does not fit (GB), None when there is none."""
        needs = [max(p.peak_memory_gb) for p in self.plans if not p.fits]
        return min(needs) if needs else None


# ---- cached building blocks -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Grid:
    """The block's unit-grid order of a layout (cheap to build) and what the screen reads off it."""

    schedule: Schedule
    """The layout (chunk owners, split backward) and an order whose activation peaks bound the runtime's
    cost-aware order's (its list scheduler keeps under them)."""
    events: list
    """simulate.memory_events of it."""
    work: tuple[tuple[tuple[Op, int, int], ...], ...]
    """Per rank: (op, chunk, count) of its compute passes, for the work bound on the step time."""


@dataclass(frozen=True)
class _Layout:
    """What cost.for_schedule reads off a schedule (the same at any microbatch count), from its block
    alone: cheaper than building a schedule of a large pipeline."""

    method: object
    num_ranks: int
    num_chunks: int
    chunk_rank: tuple[int, ...]
    split_backward: bool


@lru_cache(maxsize=1024)
def _layout(kind: str, method: str, pp: int) -> _Layout:
    sk, meth = check_pair(kind, method)
    block = sk.block(pp, sk.chunks_per_rank or sk.default_chunks_per_rank, 0)
    chunk_rank = tuple(block.chunk_rank)
    return _Layout(meth, pp, len(chunk_rank), chunk_rank, block.split_backward)


@lru_cache(maxsize=1024)
def _grid(kind: str, method: str, pp: int, m: int) -> _Grid:
    sched = build_schedule(kind, method, pp, m)
    work = []
    for actions in sched.actions:
        counts = Counter((a.op, a.chunk) for a in actions if a.op.value in COMPUTE_OPS)
        work.append(tuple((op, chunk, n) for (op, chunk), n in sorted(counts.items(), key=str)))
    return _Grid(sched, memory_events(sched), tuple(work))


@lru_cache(maxsize=512)
def _ordered(kind: str, method: str, pp: int, m: int, shape: ModelShape, hw: Hardware, ckpt: str, tp_bw=None):
    """The schedule the runtime would run, ordered by this shape's pass costs (the expensive part)."""
    costs = (lambda model: replace(model, tp_bandwidth=tp_bw)) if tp_bw else None
    return cost_aware_schedule(shape, kind, method, pp, m, hw=hw, activation_checkpointing=ckpt, costs=costs)[0]


@lru_cache(maxsize=4096)
def _timed(
    kind: str,
    method: str,
    pp: int,
    m: int,
    shape: ModelShape,
    order_shape: ModelShape,
    hw: Hardware,
    memory,
    ckpt,
    tp_bw=None,
):
    """(step time, busy per rank) of `m` microbatches of `shape`, in the order built for `order_shape`; `tp_bw`:
    the TP collectives' bandwidth (the node's links)."""
    sched = _ordered(kind, method, pp, m, order_shape, hw, ckpt, tp_bw)
    model = replace(for_schedule(shape, sched, hw, activation_checkpointing=ckpt), output_memory=memory)
    res = simulate(sched, replace(model, tp_bandwidth=tp_bw))
    return res.step_time, tuple(res.busy), _slack(sched, res)


def _slack(sched, res) -> tuple:
    """Per rank, ((chunk, seconds from its last B / W to the step's end), ...) and the seconds from the rank's
    last pass to the step's end: when the runtime issues each chunk's data-parallel reduce (`DPReducer`). The
    drain after the last microbatch's passes is the same in a longer step, so these carry over."""
    end, last, rank_end = res.step_time, {}, [0.0] * sched.num_ranks
    for t in res.timeline:
        if t.lane == "compute" and t.op in COMPUTE_OPS:
            rank_end[t.rank] = max(rank_end[t.rank], t.end)
            if t.op in ("B", "W"):
                last[(t.rank, t.chunk)] = max(last.get((t.rank, t.chunk), 0.0), t.end)
    return tuple(
        (tuple((c, end - last.get((r, c), end)) for c in sched.chunks_of(r)), end - rank_end[r])
        for r in range(sched.num_ranks)
    )


def _step(kind, method, pp, m, shape, hw, memory, ckpt, tp_bw=None):
    """(step time, bubble, `_slack`) of m microbatches: simulated at min(m, pp), extrapolated at the busiest
    rank's per-microbatch pace beyond (see the module docstring)."""
    k = min(m, pp)
    step, busy, slack = _timed(kind, method, pp, k, shape, replace(shape, microbatch_size=1), hw, memory, ckpt, tp_bw)
    step += (m - k) * max(busy) / k
    return step, 1 - sum(busy) * (m / k) / (pp * step), slack


# ---- the search -------------------------------------------------------------------------------------


def tp_sizes(config, req: PlanRequest, shape: ModelShape) -> tuple[int, ...]:
    """The tensor-parallel sizes of `req.tensor_parallel` this model and cluster can run: 1, and each tp > 1 that
    divides the GPUs per node (or the GPUs), the heads, key/value heads, MLP width and sequence (sequence
    parallelism), for a family with a TP plan (models/tensor_parallel.py `check_config`); full training or LoRA
    (the adapters split as their base layers: cost/memory.py `lora_layer_params`)."""
    out = [1] if 1 in req.tensor_parallel else []
    node = req.gpus_per_node or req.gpus
    family = _get(config, "model_type") or ""
    plan = _get(config, "base_model_tp_plan")
    has_plan = (bool(plan) if plan is not None else True) and family not in NO_TP_FAMILIES
    for t in sorted(set(req.tensor_parallel) - {1}):
        if t < 1 or not has_plan or node % t or req.gpus % t:
            continue
        if any(n % t for n in (shape.heads, shape.kv_heads or shape.heads, shape.ffn, req.seq)):
            continue
        out.append(t)
    return tuple(out)


def _get(config, key: str):
    if isinstance(config, (str, Path)):
        config = read_config_json(config)
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def _base_layouts(req: PlanRequest, layers: int, tps: tuple[int, ...] = (1,)):
    """(kind, method, pp, tp, dp, microbatch size, microbatches) of every layout the GPUs and batch allow."""
    for tp in tps:
        for pp in range(1, req.gpus // tp + 1):
            if (req.gpus // tp) % pp or req.gpus % tp:
                continue
            dp = req.gpus // (pp * tp)
            if req.global_batch % dp:
                continue
            for kind in req.schedules:
                sk = SCHEDULES[kind]
                chunks = pp * (sk.chunks_per_rank or sk.default_chunks_per_rank)
                if chunks > layers:
                    continue
                for method in req.methods:
                    if method not in sk.methods:
                        continue
                    if tp > 1 and method not in TP_METHODS:
                        continue
                    # one rank per stage: every schedule is the same (with TP the vocabulary is still sharded, or
                    # split over the TP ranks: baseline; redis balances nothing on one stage)
                    if pp == 1 and (kind, method) != DATA_PARALLEL and not (tp > 1 and kind == "1f1b"):
                        continue
                    if pp == 1 and METHODS[method].balanced_layers:
                        continue
                    if METHODS[method].balanced_layers and chunks != pp:
                        continue
                    rows = req.global_batch // dp
                    for b in req.microbatch_sizes:
                        if rows % b or rows // b < pp:
                            continue
                        yield kind, method, pp, tp, dp, b, rows // b


def _variants(req: PlanRequest, method: str, dp: int):
    """(zero, checkpointing, memory) of one layout, each zero stage's cheapest-to-run variants first."""
    ckpts = [c for c in CHECKPOINTING if c in req.checkpointing]
    memories = MEMORY_MODES if METHODS[method].vocab_parallel else ("store",)
    for zero in sorted({check_zero(z) for z in req.zero}) if dp > 1 else (0,):
        yield zero, [(c, mem) for c in ckpts for mem in memories]


def _dominates(a: tuple[str, str], b: tuple[str, str]) -> bool:
    """Variant a recomputes no more than b (checkpointing and output memory): a is at least as fast."""
    return CHECKPOINTING.index(a[0]) <= CHECKPOINTING.index(b[0]) and MEMORY_MODES.index(a[1]) <= MEMORY_MODES.index(
        b[1]
    )


def search(config, req: PlanRequest) -> Search:
    """Every layout of `config` (an HF config object, dict or config.json path) for `req`: those that
    fit simulated and ranked by tokens/s, the others with their memory need."""
    if req.gpus_per_node is not None and req.gpus % req.gpus_per_node and req.gpus > req.gpus_per_node:
        raise ValueError(f"--gpus {req.gpus} is not a whole number of nodes of {req.gpus_per_node} GPUs")
    # activations as the runtime keeps them: HF's decoder layers under SDPA (the flash kernel on a GPU, but
    # the module's own saved tensors: fp32 norm inputs, q / k / v, the MLP's four [N, ffn]), not the
    # paper's fused-kernel count (34sbh), which is a third lower
    base = replace(
        shape_from_hf_config(config, seq=req.seq, attention=attention_kind(config)),
        frozen_weights=req.lora_rank is not None,
        adapted_mlp=_adapts_mlp(req.lora_targets),
    )
    cluster = req.cluster
    limit = req.memory_gb * 1e9
    plans: list[Plan] = []
    candidates = []  # (lower bound on the step time, untimed plan, shape, pipeline links, data-parallel time)
    pruned = []  # (lower bound on the memory, index in plans, kind, method, pp, m, cost model)
    considered = dominated = bounded = 0
    orders: dict = {}  # (kind, method, pp, microbatches, checkpointing) -> the GPU's order, its layer split
    tp_bw = req.hardware.collective_bandwidth  # a stage's TP ranks share a node's links
    for kind, method, pp, tp, dp, b, m in _base_layouts(req, base.layers, tp_sizes(config, req, base)):
        shape = replace(base, microbatch_size=b, tp=tp)
        hw = cluster.pipeline_hardware(req.hardware, pp, dp, tp)
        crosses = cluster.pipeline_crosses(pp, dp, tp)
        layout = _layout(kind, method, pp)
        grid = None  # the memory screen's order: min(m, 2 pp) microbatches, by when the peak has set in
        for zero, variants in _variants(req, method, dp):
            fitting: list[tuple[str, str]] = []  # variants that fit on the grid's figure with room to spare
            for ckpt, memory in variants:
                considered += 1
                if any(_dominates(f, (ckpt, memory)) for f in fitting):
                    dominated += 1
                    continue
                try:
                    model = for_schedule(shape, layout, hw, activation_checkpointing=ckpt)
                except ValueError:  # e.g. redis cannot give every stage a layer: not a layout
                    considered -= 1
                    continue
                model = replace(
                    model, output_memory=memory, optimizer_shards=optimizer_shards(zero, dp), tp_bandwidth=tp_bw
                )
                # at least one microbatch's activations of its first chunk are held on every rank
                static = [
                    _rank_total(model, r, model.activation_bytes(layout.chunk_rank.index(r)), dp, req)
                    for r in range(pp)
                ]
                if max(static) > limit:  # dropped before any order is built
                    peak = static
                    bound = True
                    pruned.append((max(static), len(plans), kind, method, pp, m, model))
                else:
                    bound = False
                    grid = grid or _grid(kind, method, pp, min(m, 2 * pp))
                    peak = _with_reserve(model, _peaks(grid, model, req), dp, req)
                fits = max(peak) <= limit
                reserve = _reserves(peak, pp, dp, method, base.tied, layout.chunk_rank, tp)
                plan_ = Plan(
                    schedule=kind,
                    method=method,
                    pp=pp,
                    dp=dp,
                    microbatch_size=b,
                    microbatches=m,
                    memory=memory,
                    chunk_layers=model.chunk_layers,
                    step_time_s=math.nan,
                    tokens_per_s=0.0,
                    mfu=0.0,
                    bubble=math.nan,
                    peak_memory_gb=tuple(x / 1e9 for x in peak),
                    reserve_gb=tuple(x / 1e9 for x in reserve),
                    fits=fits,
                    zero=zero,
                    activation_checkpointing=ckpt,
                    pipeline_crosses_nodes=crosses,
                    memory_bound=bound,
                    tp=tp,
                )
                if fits:
                    # near the card the grid's figure decides nothing: the GPU's order does, when (and only when)
                    # the plan could rank among the shown ones (below); meanwhile it dominates no variant
                    if max(peak) * (1 + GRID_MARGIN) <= limit:
                        fitting.append((ckpt, memory))
                    after = _after_pipeline(plan_, req, model)  # a bound: see _after_pipeline
                    work = max(
                        sum(n * model.pass_time(r, op, c) for op, c, n in ops) for r, ops in enumerate(grid.work)
                    )
                    candidates.append(
                        (m * work / grid.schedule.num_microbatches + after, plan_, shape, hw, after, model)
                    )
                else:
                    plans.append(plan_)
    # time the fitting layouts, least work first, until `top` timed ones are faster than what any other
    # could be: a step is never shorter than its busiest rank's passes plus what follows the pipeline. A layout
    # near the card is read on the GPU's order first (the expensive part), and dropped if it does not fit there.
    candidates.sort(key=lambda c: c[0])
    timed: list[float] = []
    for bound, plan_, shape, hw, after, model in candidates:
        if len(timed) >= req.top and sorted(timed)[req.top - 1] <= bound:
            plans.append(_with_step(plan_, req, shape, bound, math.nan))
            bounded += 1
            continue
        if max(plan_.peak_memory_gb) * 1e9 * (1 + GRID_MARGIN) > limit:
            plan_ = _on_gpu_order(config, req, plan_, orders)
            if not plan_.fits:
                plans.append(plan_)
                continue
        step, bubble, slack = _step(
            plan_.schedule,
            plan_.method,
            plan_.pp,
            plan_.microbatches,
            shape,
            hw,
            plan_.memory,
            plan_.activation_checkpointing,
            tp_bw if plan_.tp > 1 else None,
        )
        after = _after_pipeline(plan_, req, model, slack)
        timed.append(step + after)
        plans.append(_with_step(plan_, req, shape, step + after, bubble))
    if not any(p.fits for p in plans):  # nothing fits: the smallest need is exact, not a bound
        _refine_needs(plans, pruned, req)
    plans = _shown_on_gpu_order(config, req, plans, orders)
    return Search(plans, considered, dominated, bounded)


def _on_gpu_order(config, req: PlanRequest, p: Plan, orders: dict) -> Plan:
    """`p` with its memory read on the order a GPU runs (`gpu_peaks`), and whether it fits on that figure."""
    peak = gpu_peaks(
        config, p.schedule, p.method, p.pp, p.microbatches, p.microbatch_size,
        p.activation_checkpointing, p.memory, p.zero, p.dp, req, orders, p.tp,
    )  # fmt: skip
    tied = shape_from_hf_config(config, seq=req.seq).tied
    chunk_rank = _layout(p.schedule, p.method, p.pp).chunk_rank
    reserve = tuple(x / 1e9 for x in _reserves(peak, p.pp, p.dp, p.method, tied, chunk_rank, p.tp))
    gb = tuple(x / 1e9 for x in peak)
    return replace(p, peak_memory_gb=gb, reserve_gb=reserve, fits=max(peak) <= req.memory_gb * 1e9, gpu_order=True)


def schedule_memory(
    config,
    schedule: Schedule,
    chunk_layers,
    seq: int,
    microbatch_size: int,
    ckpt: str,
    memory: str,
    zero: int,
    dp: int,
    lora_rank: int | None = None,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
    tp: int = 1,
    attention: str | None = None,
) -> list[float]:
    """Per pipeline rank, the tensor bytes (no reserve) the planner's memory model gives `schedule` in the order
    it is (e.g. the cost-aware order a GPU rank runs, which the dry run replays), rather than the block's grid
    order the search screens with: what `vp-accelerate dryrun` compares its measured peaks with. With
    `lora_rank`: a LoRA run's (`lora_rank_memory`: frozen base in bf16, the adapters trained). `tp`: each of a
    stage's TP ranks (sequence parallelism on), the same on each. `attention`: the run's attn_implementation
    (eager keeps the [b, a, s, s] probabilities; any other kernel is priced as SDPA); None = the family's default
    (`default_attention`: SDPA, eager where HF has no SDPA path)."""
    kind = attention_kind(config, attention)
    shape = replace(shape_from_hf_config(config, seq=seq, attention=kind), microbatch_size=microbatch_size, tp=tp)
    shape = replace(shape, frozen_weights=lora_rank is not None, adapted_mlp=_adapts_mlp(lora_targets))
    model = for_schedule(shape, schedule, activation_checkpointing=ckpt, chunk_layers=tuple(chunk_layers))
    model = replace(model, output_memory=memory, optimizer_shards=optimizer_shards(zero, dp))
    if lora_rank is None:
        return order_peak_memory(schedule, model)
    held = replace(model, grad_bytes=0)  # the frozen base gets no gradient; the adapters' few are static
    peaks = order_peak_memory(schedule, held)
    out = []
    for r, p in enumerate(peaks):
        m = run_memory(model, r, p - held.static_bytes(r), dp, lora_rank, lora_targets)
        out.append(m.static + m.activation_peak)
    return out


def attention_kind(config, attn_implementation: str | None = None) -> str:
    """`ModelShape.attention` for a run of `config` with `attn_implementation` (None: the family's default)."""
    if attn_implementation is None:
        attn_implementation = default_attention(read_config_json(config) if isinstance(config, (str, Path)) else config)
    return "eager" if attn_implementation == "eager" else "sdpa"


ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj")


def _adapts_mlp(targets) -> bool:
    """LoRA `targets` adapt more than the attention's input linears (ModelShape.adapted_mlp: the planner then
    counts the layer's kept inputs as in full training)."""
    return not set(targets) <= set(ATTENTION_LINEARS)


def _with_reserve(model: CostModel, peaks: list[float], dp: int, req: PlanRequest | None = None) -> list[float]:
    """`order_peak_memory`'s peaks (static + activations) as `run_memory` totals (reserve added)."""
    held = _held(model, req)
    return [_rank_total(model, r, p - held.static_bytes(r), dp, req) for r, p in enumerate(peaks)]


ORDER_MICROBATCHES = 2
"""The GPU's order is read at min(m, 2 pp) microbatches: its activation peak has set in by then (Llama-3-70B,
16 ranks: 1F1B and V-Half at 2 pp give the peaks of 128 microbatches, within 0.2% per rank), and building it
at m costs seconds a layout."""


def gpu_peaks(
    config, kind, method, pp, m, b, ckpt, memory, zero, dp, req: PlanRequest, orders=None, tp: int = 1
) -> list[float]:
    """Per rank, the memory (tensors + reserve) of a layout on the order a GPU rank runs (`cost.gpu_order`,
    the runtime's and the dry run's order and layer split, at min(m, 2 pp) microbatches), priced as the dry
    run's planned figure (`schedule_memory`) plus `reserve_bytes` of it. `orders`: a cache of orders."""
    k = min(m, ORDER_MICROBATCHES * pp)
    key = (kind, method, pp, k, ckpt)
    orders = {} if orders is None else orders
    if key not in orders:
        train, _, counts = gpu_order(config, kind, method, pp, k, activation_checkpointing=ckpt, evaluation=False)
        orders[key] = (train, counts)
    sched, counts = orders[key]
    lora = dict(lora_rank=req.lora_rank, lora_targets=req.lora_targets) if req.lora_rank is not None else {}
    tensors = schedule_memory(config, sched, counts, req.seq, b, ckpt, memory, zero, dp, **lora, tp=tp)
    vp = sched.method.vocab_parallel
    tied = tied_ranks(shape_from_hf_config(config, seq=req.seq).tied, vp, sched.chunk_rank)
    return [x + reserve_bytes(x, pp, dp, vp, r in tied, tp) for r, x in enumerate(tensors)]


GRID_MARGIN = 0.15
"""The grid order screens: a layout whose grid figure is within 15% of the card gets its figure from the GPU's
order before it is called fitting (the grid read 3.5-10% below the GPU's order per rank on Llama-3-70B, 16
ranks); one further below is presumed to fit and is read on the GPU's order only if it is shown."""


def _shown_on_gpu_order(config, req: PlanRequest, plans: list[Plan], orders: dict) -> list[Plan]:
    """`plans` ranked, every fitting one among the first `req.top` shown with its figure on the GPU's order
    (a plan that then needs more than the card moves to the ones that do not fit)."""
    while True:
        plans = _headroom_first(sorted(plans, key=_rank))
        shown = [p for p in plans if p.fits][: req.top]
        todo = [p for p in shown if not p.gpu_order]
        if not todo:
            return plans
        ids = {id(p) for p in todo}
        plans = [_on_gpu_order(config, req, p, orders) if id(p) in ids else p for p in plans]


def _reserves(peaks, pp: int, dp: int, method: str, tied_weights: bool, chunk_rank, tp: int = 1) -> tuple[float, ...]:
    """Per rank, the reserve inside a memory total (tensors + `reserve_bytes` of them)."""
    vp = METHODS[method].vocab_parallel
    tied = tied_ranks(tied_weights, vp, chunk_rank)
    return tuple(x - allocated_of(x, pp, dp, vp, r in tied, tp) for r, x in enumerate(peaks))


def _held(model: CostModel, req: PlanRequest | None) -> CostModel:
    """The model whose gradients arrive during the step: under LoRA the frozen base gets none (the adapters'
    few are counted from the start), so the activation peak is read without them."""
    return replace(model, grad_bytes=0) if req is not None and req.lora_rank is not None else model


def _peaks(grid, model: CostModel, req: PlanRequest) -> list[float]:
    return order_peak_memory(grid.schedule, _held(model, req), grid.events)


def _rank_total(model: CostModel, r: int, activations: float, dp: int, req: PlanRequest | None) -> float:
    lora = None if req is None else req.lora_rank
    return run_memory(model, r, activations, dp, lora, req.lora_targets if req is not None else LORA_TARGETS).total


def _headroom_first(plans: list[Plan]) -> list[Plan]:
    """`plans` (ranked) with the fitting ones within HEADROOM_TIE of the fastest reordered by their fullest
    rank's peak, least first: equally fast, the one with more memory left is the safer run."""
    fitting = [p for p in plans if p.fits and p.simulated]
    if not fitting:
        return plans
    lead = _rank(fitting[0])[1]  # minus the (node-margined) tokens/s of the fastest
    tied = [p for p in plans if p.fits and p.simulated and _rank(p)[1] <= lead * (1 - HEADROOM_TIE)]
    tied.sort(key=lambda p: (round(max(p.peak_memory_gb), 1), _rank(p)))
    ids = {id(p) for p in tied}
    return tied + [p for p in plans if id(p) not in ids]


def tight(p: Plan, req: PlanRequest) -> bool:
    """The plan's fullest rank needs more than TIGHT of the GPU's memory."""
    return max(p.peak_memory_gb) > TIGHT * req.memory_gb


def _refine_needs(plans: list[Plan], pruned: list, req: PlanRequest) -> None:
    """Give the layouts dropped on a memory bound their peak from the order, least bound first, until the
    least exact peak is below every remaining bound (so `Search.smallest_need_gb` is exact)."""
    dropped = {x[1] for x in pruned}
    exact = [max(p.peak_memory_gb) * 1e9 for i, p in enumerate(plans) if i not in dropped]
    least = min(exact, default=math.inf)
    for bound, i, kind, method, pp, m, model in sorted(pruned, key=lambda x: x[0]):
        if bound >= least:
            break
        grid = _grid(kind, method, pp, min(m, 2 * pp))
        peak = _with_reserve(model, _peaks(grid, model, req), plans[i].dp, req)
        chunk_rank = _layout(kind, method, pp).chunk_rank
        reserve = _reserves(peak, pp, plans[i].dp, method, model.shape.tied, chunk_rank, model.shape.tp)
        reserve = tuple(x / 1e9 for x in reserve)
        plans[i] = replace(
            plans[i], peak_memory_gb=tuple(x / 1e9 for x in peak), reserve_gb=reserve, memory_bound=False
        )
        least = min(least, max(peak))


def _after_pipeline(p: Plan, req: PlanRequest, model: CostModel, slack: tuple | None = None) -> float:
    """Seconds after the pipeline's last pass: the data-parallel gradient sync and the optimizer step, for the
    rank with the most parameters. The sync overlaps the backward as the runtime runs it
    (`overlapped_sync_time`): each decoder chunk's reduce from its last B / W (`slack`: when, from the simulated
    step); without `slack`, the search's lower bound: chunk 0's reduce exposed from the step's end (its last
    backward ends a 1F1B or interleaved step; V-Half's W may trail it by a pass), every other chunk's hidden.
    LoRA's few adapter gradients are priced after the pipeline (`grad_sync_time`)."""
    params = max(model.rank_params(r) for r in range(p.pp))
    dp_bw = req.cluster.dp_bandwidth(req.hardware, p.pp, p.dp, p.tp)
    if req.lora_rank is not None:  # only the adapters have gradients to sync and state to step
        per_layer = lora_layer_params(model.shape, req.lora_rank, req.lora_targets)
        params = max(sum(n for c, n in enumerate(model.chunk_layers) if model.chunk_rank[c] == r) for r in range(p.pp))
        params *= per_layer
        sync = grad_sync_time(
            params, p.dp, p.zero, dp_bw, req.hardware.latency, model.grad_bytes, model.shape.dtype_bytes
        )
        return sync + optimizer_step_time(params, p.dp, p.zero, req.hardware.mem_bandwidth)
    ready, after = [], []
    for r in range(p.pp):
        chunks = dict(slack[r][0]) if slack is not None else {}
        held, rest = [], 0.0
        for (op, c), nbytes in model.grad_arrivals(r).items():
            if op not in ("B", "W"):
                rest += nbytes
            elif slack is not None:
                held.append((chunks.get(c, 0.0), nbytes))
            elif c == 0:
                held.append((0.0, nbytes))
            else:
                held.append((math.inf, nbytes))
        ready.append(held)
        after.append((slack[r][1] if slack is not None else (0.0 if r == model.chunk_rank[0] else math.inf), rest))
    sync = overlapped_sync_time(ready, after, p.dp, p.zero, dp_bw, req.hardware.latency, model.grad_bytes)
    return sync + optimizer_step_time(params, p.dp, p.zero, req.hardware.mem_bandwidth)


def _with_step(p: Plan, req: PlanRequest, shape: ModelShape, step: float, bubble: float) -> Plan:
    """`p` with a step time (simulated, or a lower bound when `bubble` is nan) and what follows from it."""
    flops = p.microbatches * shape.model_flops() * p.dp
    return replace(
        p,
        step_time_s=step,
        tokens_per_s=req.global_batch * req.seq / step,
        mfu=flops / (step * req.gpus * req.hardware.peak_flops),
        bubble=bubble,
        simulated=not math.isnan(bubble),
    )


def _rank(p: Plan):
    """Fitting first, fastest first, where a pipeline across nodes must be more than NODE_MARGIN faster
    to rank above one inside a node; among equals less recomputation, then no ZeRO (fewer moving parts).
    The others by their memory need."""
    if p.fits:
        speed = p.tokens_per_s / (1 + NODE_MARGIN) if p.pipeline_crosses_nodes else p.tokens_per_s
        return (0, -speed, p.pipeline_crosses_nodes, CHECKPOINTING.index(p.activation_checkpointing), p.zero)
    return (1, max(p.peak_memory_gb), 0, 0, 0)


def plan(config, req: PlanRequest) -> list[Plan]:
    """`search(config, req).plans`: fitting plans first, then by tokens/s."""
    return search(config, req).plans


def why(found: Search, req: PlanRequest) -> str:
    """One line: which plan the planner picks and why (what it needs to fit, where its pipeline sits)."""
    fitting = found.fitting
    if not fitting:
        return "no layout fits"
    best_ = fitting[0]
    fastest = max(fitting, key=lambda p: p.tokens_per_s)
    if fastest is best_ or fastest.tokens_per_s <= best_.tokens_per_s:
        parts = [f"picked {best_.describe()}: the fastest of {len(fitting)} layouts that fit"]
        if len(fitting) > 1:
            ahead = best_.tokens_per_s / fitting[1].tokens_per_s - 1
            parts.append(f"{ahead:.1%} ahead of the next ({fitting[1].describe()})")
    else:
        behind = 1 - best_.tokens_per_s / fastest.tokens_per_s
        parts = [
            f"picked {best_.describe()} at {max(best_.peak_memory_gb):.1f} GB: within {HEADROOM_TIE:.0%} of the "
            f"fastest of {len(fitting)} layouts that fit ({behind:.1%} behind {fastest.describe()}, which needs "
            f"{max(fastest.peak_memory_gb):.1f} GB), with more memory left"
        ]
    needs = []
    if best_.activation_checkpointing != "none":
        plain = [p for p in found.plans if _same_layout(p, best_) and p.activation_checkpointing == "none"]
        need = f" (needs {_need(plain)} without)" if plain else ""
        needs.append(f"{best_.activation_checkpointing} activation checkpointing{need}")
    if best_.zero:
        plain = [p for p in found.plans if _same_layout(p, best_) and p.zero == 0 and p.memory == best_.memory]
        plain = [p for p in plain if p.activation_checkpointing == best_.activation_checkpointing]
        need = f" (needs {_need(plain[:1])} without)" if plain and not plain[0].fits else ""
        needs.append(f"ZeRO-1 over dp={best_.dp}{need}")
    if needs:
        parts.append("uses " + " and ".join(needs))
    if req.gpus_per_node is not None:
        if best_.pipeline_crosses_nodes:
            inside = [p for p in found.plans if not p.pipeline_crosses_nodes and p.pp > 1]
            if not [p for p in inside if p.fits]:
                reason = f"; the least any in-node pipeline needs is {_need(inside)}" if inside else ""
                parts.append(
                    f"its pipeline crosses nodes because no pipeline of <= {req.gpus_per_node} GPUs fits{reason}"
                )
            else:
                parts.append("its pipeline crosses nodes, yet it beats every in-node pipeline that fits")
        elif best_.pp > 1:
            parts.append(f"its pipeline stays inside a node of {req.gpus_per_node} GPUs")
        faster = [p for p in fitting if p.pipeline_crosses_nodes and p.tokens_per_s > best_.tokens_per_s]
        if not best_.pipeline_crosses_nodes and faster:
            gain = faster[0].tokens_per_s / best_.tokens_per_s - 1
            parts.append(
                f"{faster[0].describe()} across nodes is predicted {gain:.1%} faster, within the "
                f"{NODE_MARGIN:.0%} preference for in-node pipelines"
            )
    if tight(best_, req):
        parts.append(f"TIGHT: its fullest rank needs {max(best_.peak_memory_gb):.1f} GB, over {TIGHT:.0%} of the GPU's")
    return "; ".join(parts)


def _need(plans: list[Plan]) -> str:
    """The least peak memory of `plans`, "at least" when it is a bound."""
    least = min(plans, key=lambda p: max(p.peak_memory_gb))
    return f"{'at least ' if least.memory_bound else ''}{max(least.peak_memory_gb):.1f} GB"


def _same_layout(a: Plan, b: Plan) -> bool:
    return (a.schedule, a.method, a.pp, a.tp, a.dp, a.microbatch_size) == (
        b.schedule,
        b.method,
        b.pp,
        b.tp,
        b.dp,
        b.microbatch_size,
    )


def assumptions(req: PlanRequest, gpu: str | None = None) -> list[str]:
    """What every number of a plan rests on, one line each (the planner's table header)."""
    hw = req.hardware
    probe = CostModel(ModelShape(hidden=8, layers=1, heads=1, ffn=8, vocab=8, seq=8), "baseline", (0,), (1,), hw)
    per_param = probe.shape.dtype_bytes + probe.grad_bytes + probe.optimizer_bytes
    if req.gpus_per_node is None:
        nodes = f"one node: every link {hw.p2p_bandwidth / 1e9:g} GB/s"
    else:
        nodes = (
            f"{req.gpus_per_node} GPUs per node (pipelines are blocks of consecutive ranks); a pipeline or "
            f"data-parallel group across nodes at {req.internode_bandwidth / 1e9:g} GB/s per GPU"
        )
    return (
        [
            f"device: {gpu or 'custom'}, {hw.peak_flops / 1e12:g} TFLOP/s dense bf16 peak (MFU's denominator), "
            f"{req.memory_gb:g} GB per GPU, HBM {hw.mem_bandwidth / 1e12:g} TB/s, {hw.sms} SMs",
            f"compute: large GEMMs sustain {hw.efficiency:.0%} of peak; smaller and oddly shaped ones less (wave "
            f"quantisation, short reductions); softmax and norms memory-bound",
            f"links: {hw.p2p_bandwidth / 1e9:g} GB/s point-to-point, {hw.collective_bandwidth / 1e9:g} GB/s collective bus "
            f"bandwidth, {hw.latency * 1e6:g} us per call; {nodes}; data-parallel gradient all-reduce (and ZeRO-1's "
            f"broadcast of the updated parameters) after the step, not overlapped",
            f"memory: bf16 weights + fp32 gradients + fp32 master and Adam state ({per_param} bytes per parameter; "
            f"ZeRO-1: 10 + 8/dp, Adam's m and v sharded over dp as runtime/zero.py does) + activations (what HF's SDPA decoder "
            f"layers save under bf16 autocast; checkpointed layers keep their bf16 input only) + each pass's own work "
            f"(16-bit weight gradients, logits, a recomputed layer) + a "
            f"reserve of {CONTEXT_BYTES / 1e9:g} GB CUDA context, {COMMUNICATOR_BYTES / 1e9:g} GB NCCL buffers per "
            f"communicator and {FRAGMENTATION:.0%} fragmentation (cost/memory.py); plans within {HEADROOM_TIE:.0%} of the "
            f"fastest ranked by memory left, above {TIGHT:.0%} of the GPU flagged tight",
            f"optimizer: fused AdamW step, memory-bound ({OPTIMIZER_STEP_BYTES} bytes per parameter of HBM traffic; "
            f"torch.optim.AdamW(fused=True), which the trainer builds on CUDA)",
        ]
        + _tp_line(req)
        + _lora_line(req)
    )


def _tp_line(req: PlanRequest) -> list[str]:
    sizes = [t for t in req.tensor_parallel if t > 1]
    if not sizes:
        return []
    return [
        f"tensor parallelism: tp in {sizes} where it divides the node, the heads, kv heads, MLP width and seq "
        f"(sequence parallelism on): a stage's decoder weights, gradients and optimizer state / tp; vocab-1/-2: "
        f"V/(pp x tp) vocabulary rows a rank; baseline/redis: the end stages' embedding and output layer V/tp rows "
        f"a TP rank, the vocabulary-parallel cross-entropy's [N, V/tp] fp32 and its max and sum all-reduces, X's "
        f"gradient all-reduced, the embedding's reduce-scatter; activations as the runtime keeps them (norms and "
        f"residual on 1/tp of the tokens, the sliced linears' inputs whole); per layer F and B four collectives "
        f"(all-gather and reduce-scatter per region, f's gradient in fp32 under mixed precision) on the node's "
        f"{req.hardware.collective_bandwidth / 1e9:g} GB/s, not overlapped with compute (NVLink SHARP not "
        f"modelled); GEMMs at their sliced shapes; one more NCCL communicator a rank"
        + ("; LoRA adapters split as their base layers (adapter.dropout must be 0 under TP)" if req.lora_rank else "")
    ]


def _lora_line(req: PlanRequest) -> list[str]:
    if req.lora_rank is None:
        return []
    return [
        f"LoRA r={req.lora_rank} on {', '.join(req.lora_targets)}: frozen decoder weights held in bf16 (2 bytes "
        f"per parameter, no gradient or optimizer state), frozen vocabulary shards fp32 (no step copy: cast per call), "
        f"adapters as trained parameters (cost/memory.py lora_rank_memory); step time without the frozen weights' "
        f"gradient GEMMs (W passes free, the backward's input gradients only), the adapters' gradient sync and "
        f"optimizer step"
    ]


def best(config, req: PlanRequest) -> Plan:
    """The fastest plan that fits; ValueError naming the smallest memory need when none does."""
    found = search(config, req)
    if not found.fitting:
        need = found.smallest_need_gb()
        if need is None:
            raise ValueError(
                f"no layout exists for {req.gpus} GPUs and a global batch of {req.global_batch}: "
                f"the batch must divide by the data-parallel size and give each replica at least "
                f"pp microbatches"
            )
        raise ValueError(
            f"no layout fits in {req.memory_gb:g} GB per GPU; the smallest needs {need:.1f} GB "
            f"(use more GPUs, a shorter sequence or a smaller model)"
        )
    return found.fitting[0]


def as_dict(p: Plan) -> dict:
    d = asdict(p)
    d["peak_memory_gb"] = list(p.peak_memory_gb)
    d["reserve_gb"] = list(p.reserve_gb)
    d["chunk_layers"] = list(p.chunk_layers)
    return d
