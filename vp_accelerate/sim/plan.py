"""The planner: every way to lay a model out on a cluster, simulated, best first.

For a model shape, a GPU count, memory per GPU, sequence length and global batch it enumerates
schedule x method x (pp, dp) x microbatch size (hence microbatches per replica) x output-layer memory
mode, simulates one training step of each with the cost model, drops what does not fit in memory, and
ranks the rest by predicted tokens/s.

pp = 1 is plain data parallelism: every GPU holds the whole model with its gradients and optimizer
state and runs its microbatches one after the other (gradient accumulation), so a user sees when
pipelining is not worth it (the model fits and the all-reduce is cheap) or when it is the only way to fit.

Each schedule is ordered by its pass costs as the runtime orders it (cost.cost_aware_schedule; the
order is taken at the output layer's "store" memory mode, the one it hardly depends on).

Speed (a plan takes seconds to a minute): schedules are built once per (kind, method, pp, microbatches,
shape, hardware) and cached; a step with many microbatches is simulated at a smaller count and
extrapolated (past the warm-up every extra microbatch adds the busiest rank's work for one microbatch,
and the memory peak no longer grows), and pp divides the GPU count. Data parallelism adds a ring
all-reduce of the gradients after the pipeline drains (not overlapped with the backward: for pp = 1 this
is pessimistic next to DDP's bucketed overlap).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache

from vp_accelerate import modes
from vp_accelerate.cost import CostModel, Hardware, ModelShape, cost_aware_schedule, for_schedule, shape_from_hf_config
from vp_accelerate.schedule import build_schedule
from vp_accelerate.schedule.registry import METHODS, SCHEDULES

from .simulate import simulate

DATA_PARALLEL = ("1f1b", "baseline")
"""The (schedule, method) a pp = 1 plan runs: one rank, the whole model, nothing to pipeline."""

MEMORY_MODES = tuple(modes.MEMORY_MODES)
"""Output-layer memory modes the planner tries (every one of the table)."""
MAX_SIMULATED_MICROBATCHES = 32
"""Above this many (and 3 x pp) microbatches per replica a step is extrapolated from a shorter simulated
one at the busiest rank's per-microbatch pace."""


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for."""

    gpus: int
    """GPUs in all (pp x dp)."""
    memory_gb: float
    """Memory per GPU in GB (1e9 bytes) that a rank may fill."""
    seq: int
    """Tokens per sequence."""
    global_batch: int
    """Sequences per optimizer step, all replicas together."""
    hardware: Hardware = field(default_factory=Hardware)
    """Device speed and links (peak FLOP/s for MFU, sustained efficiency, bandwidths)."""
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Sequences per microbatch to try (those that divide a replica's batch)."""
    schedules: tuple[str, ...] = tuple(SCHEDULES)
    """Schedule kinds to try."""
    methods: tuple[str, ...] = tuple(METHODS)
    """Methods to try."""


@dataclass(frozen=True)
class Plan:
    """One layout, simulated."""

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
    """Predicted seconds per optimizer step."""
    tokens_per_s: float
    """global batch x seq / step time."""
    mfu: float
    """Model FLOPs utilisation (paper's FLOP count over peak)."""
    bubble: float
    """Idle fraction of rank time."""
    peak_memory_gb: tuple[float, ...]
    """Per pipeline rank: parameters + gradients + optimizer state + peak activations, GB."""
    fits: bool
    """Every rank's peak fits in the request's memory per GPU."""

    def pipeline_section(self) -> dict:
        """The recipe `pipeline:` keys (runtime.PipelineConfig fields) this plan sets."""
        return {
            "schedule": self.schedule,
            "method": self.method,
            "microbatches": self.microbatches,
            "memory": self.memory,
            "dp_size": self.dp,
            "pp_size": self.pp,
        }

    @property
    def label(self) -> str:
        """ "schedule/method", or "data parallel" for pp = 1 (no pipeline)."""
        return "data parallel" if self.pp == 1 else f"{self.schedule}/{self.method}"

    def describe(self) -> str:
        return (
            f"{self.label} pp={self.pp} dp={self.dp} mbs={self.microbatch_size} "
            f"m={self.microbatches} memory={self.memory}"
        )


@lru_cache(maxsize=512)
def _schedule(kind: str, method: str, pp: int, m: int, shape: ModelShape | None = None, hw: Hardware | None = None):
    """The schedule the runtime would run (ordered by this shape's pass costs); the unit-grid order
    without a shape."""
    if shape is None:
        return build_schedule(kind, method, pp, m)
    return cost_aware_schedule(shape, kind, method, pp, m, hw=hw)[0]


def _simulate_step(kind: str, method: str, pp: int, m: int, shape: ModelShape, hw: Hardware, memory: str):
    """(step time, bubble, peak bytes per rank, layers per chunk) of one step, extrapolated when m is large."""

    def run(k: int):
        sched = _schedule(kind, method, pp, k, shape, hw)
        model = _with_memory(for_schedule(shape, sched, hw), memory)
        return simulate(sched, model), model

    if m <= MAX_SIMULATED_MICROBATCHES:
        res, model = run(m)
        return res.step_time, res.bubble_rate, res.busy, res.peak_memory_bytes, model.chunk_layers
    hi = max(MAX_SIMULATED_MICROBATCHES, 3 * pp)
    r_hi, model = run(hi)
    # past the warm-up the pipeline runs at its busiest rank's pace: each extra microbatch adds that
    # rank's work for one microbatch (and the memory peak no longer grows)
    per_mb = max(r_hi.busy) / hi
    step = r_hi.step_time + (m - hi) * per_mb
    busy = [b * m / hi for b in r_hi.busy]  # busy time is per-microbatch work
    bubble = 1 - sum(busy) / (pp * step)
    return step, bubble, busy, r_hi.peak_memory_bytes, model.chunk_layers


def _dp_sync_time(kind, method, pp, shape, hw, dp, layers) -> float:
    """Ring all-reduce of the slowest rank's gradients (grad_bytes per parameter) over dp replicas."""
    sched = _schedule(kind, method, pp, pp)  # only its layout
    model = CostModel(shape, method, sched.chunk_rank, tuple(layers), hw, split_backward=sched.split_backward)
    params = max(model.rank_params(r) for r in range(pp))
    return 2 * (dp - 1) / dp * params * model.grad_bytes / hw.collective_bandwidth + hw.latency


_MODELS_MEMORY = "output_memory" in CostModel.__dataclass_fields__
"""The cost model tells the output layer's memory modes apart (else only "store" is planned)."""


def _with_memory(model: CostModel, memory: str) -> CostModel:
    return replace(model, output_memory=memory) if _MODELS_MEMORY else model


def _layouts(req: PlanRequest, layers: int):
    for pp in range(1, req.gpus + 1):
        if req.gpus % pp:
            continue
        dp = req.gpus // pp
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
                if pp == 1 and (kind, method) != DATA_PARALLEL:  # one rank: every schedule is the same
                    continue
                if METHODS[method].balanced_layers and chunks != pp:
                    continue
                for b in req.microbatch_sizes:
                    rows = req.global_batch // dp
                    if rows % b or rows // b < pp:
                        continue
                    modes = MEMORY_MODES if METHODS[method].vocab_parallel and _MODELS_MEMORY else ("store",)
                    for memory in modes:
                        yield kind, method, pp, dp, b, rows // b, memory


def plan(config, req: PlanRequest) -> list[Plan]:
    """Every layout of `config` (an HF config object, dict or config.json path) for `req`, simulated;
    fitting plans first, then by tokens/s."""
    base = shape_from_hf_config(config, seq=req.seq)
    plans = []
    for kind, method, pp, dp, b, m, memory in _layouts(req, base.layers):
        shape = replace(base, microbatch_size=b)
        try:
            step, bubble, busy, peak, layers = _simulate_step(kind, method, pp, m, shape, req.hardware, memory)
        except ValueError:  # e.g. redis cannot give every stage a layer: not a layout
            continue
        if dp > 1:  # gradient all-reduce across replicas after the pipeline drains (not overlapped)
            step += _dp_sync_time(kind, method, pp, shape, req.hardware, dp, layers)
        flops = m * shape.model_flops() * dp
        peak_gb = tuple(x / 1e9 for x in peak)
        plans.append(
            Plan(
                schedule=kind,
                method=method,
                pp=pp,
                dp=dp,
                microbatch_size=b,
                microbatches=m,
                memory=memory,
                chunk_layers=tuple(layers),
                step_time_s=step,
                tokens_per_s=req.global_batch * req.seq / step,
                mfu=flops / (step * req.gpus * req.hardware.peak_flops),
                bubble=bubble,
                peak_memory_gb=peak_gb,
                fits=max(peak_gb) <= req.memory_gb,
            )
        )
    plans.sort(key=lambda p: (not p.fits, -p.tokens_per_s))
    return plans


def assumptions(req: PlanRequest, gpu: str | None = None) -> list[str]:
    """What every number of a plan rests on, one line each (the planner's table header)."""
    hw = req.hardware
    probe = CostModel(ModelShape(hidden=8, layers=1, heads=1, ffn=8, vocab=8, seq=8), "baseline", (0,), (1,), hw)
    per_param = probe.shape.dtype_bytes + probe.grad_bytes + probe.optimizer_bytes
    return [
        f"device: {gpu or 'custom'}, {hw.peak_flops / 1e12:g} TFLOP/s dense bf16 peak (MFU's denominator), "
        f"{req.memory_gb:g} GB per GPU, HBM {hw.mem_bandwidth / 1e12:g} TB/s, {hw.sms} SMs",
        f"compute: large GEMMs sustain {hw.efficiency:.0%} of peak; smaller and oddly shaped ones less (wave "
        f"quantisation, short reductions); softmax and norms memory-bound",
        f"links: {hw.p2p_bandwidth / 1e9:g} GB/s point-to-point, {hw.collective_bandwidth / 1e9:g} GB/s collective bus "
        f"bandwidth, {hw.latency * 1e6:g} us per call; data-parallel gradient all-reduce after the step, not overlapped",
        f"memory: bf16 weights + fp32 gradients + fp32 master and Adam state ({per_param} bytes per parameter, no "
        f"sharding over data parallelism) + activations (flash-attention layer count, Korthikanti et al.)",
    ]


def best(config, req: PlanRequest) -> Plan:
    """The fastest plan that fits; ValueError naming the smallest memory need when none does."""
    plans = plan(config, req)
    fitting = [p for p in plans if p.fits]
    if not fitting:
        if not plans:
            raise ValueError(
                f"no layout exists for {req.gpus} GPUs and a global batch of {req.global_batch}: "
                f"the batch must divide by the data-parallel size and give each replica at least "
                f"pp microbatches"
            )
        need = min(max(p.peak_memory_gb) for p in plans)
        raise ValueError(
            f"no layout fits in {req.memory_gb:g} GB per GPU; the smallest needs {need:.1f} GB "
            f"(use more GPUs, a shorter sequence or a smaller model)"
        )
    return fitting[0]


def as_dict(p: Plan) -> dict:
    d = asdict(p)
    d["peak_memory_gb"] = list(p.peak_memory_gb)
    d["chunk_layers"] = list(p.chunk_layers)
    return d
