"""Replay a schedule's action lists with pass costs: step time, bubbles, memory, MFU, timeline.

The replay is schedule/replay.py's driver with a cost clock; what each pass waits for is
schedule/deps.py's `consumed`, as in the validator and the executor. Execution model (`SIMULATOR`):
each rank runs its actions in order. A send is non-blocking; the data lands
p2p_time later. A receive is posted where it stands and waited for by the pass that consumes it.
Collectives run as the runtime runs them (vocab/comm.py): each is a chain of dependent steps (C1: the
max all-reduce, the rescale by exp(m_i - m), the sums all-reduce) on a communication resource of its
own that overlaps compute; a chain starts once every rank has issued it (a rank issues one when it
reaches it, without waiting) and the resource is free, and the pass that needs the result waits for
it. `blocking_collectives=True` makes every rank wait for each chain instead. Chain steps are timeline
records of lane "comm".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vp_accelerate.schedule.ir import COMPUTE_OPS, Op, Schedule, TimedAction
from vp_accelerate.schedule.replay import Rules, replay


@dataclass
class SimResult:
    """What one simulated step costs."""

    step_time: float
    """Makespan in seconds."""
    bubble_rate: float
    """Idle fraction of all ranks over the step: 1 - sum(busy) / (p * step_time)."""
    busy: list[float]
    """Per rank, seconds of compute passes."""
    peak_activation_microbatches: list[float]
    """Per rank, peak transformer activations in flight (F to B, or W when split), in microbatches of
    that rank's layers: each (mb, chunk) weighs chunk layers / rank layers."""
    peak_stash_microbatches: list[int]
    """Per rank, peak number of microbatches whose VP S->T state is held."""
    peak_activation_bytes: list[float]
    """Per rank, peak bytes of activations + VP stash (needs a shape-based cost model; else 0)."""
    static_bytes: list[float]
    """Per rank, parameter + gradient + optimizer bytes (shape-based cost model; else 0)."""
    peak_memory_bytes: list[float]
    """static_bytes + peak_activation_bytes."""
    mfu: float
    """Model FLOPs utilisation given the peak FLOP rate (0 without a shape-based model)."""
    timeline: list[TimedAction] = field(repr=False)
    """Every compute pass (and collective, op C0/C1/...) with its start and end."""


SIMULATOR = Rules(
    "the simulator's rules (buffered sends, every operation independent)",
    rendezvous=False,
    queues="none",
    batches=False,
)
"""Sends never wait for the peer; a receive is posted where it stands and waited for by its consumer;
collectives start once every rank issued them, one chain at a time."""


class _CostClock:
    """A cost model (or measured costs) as the replay's clock."""

    def __init__(self, costs):
        self.costs = costs
        self.passes: dict = {}  # (rank, op, chunk) -> seconds: the same pass costs the same for every microbatch
        self.chains: dict = {}  # collective op -> its chain's steps
        # host time a rank spends posting a transfer or handing a chain over (measured costs may give it)
        issue = getattr(costs, "issue_time", lambda op: 0.0)
        self.issue = {op: issue(op) for op in Op}
        self.p2p = costs.p2p_time()

    def pass_time(self, rank: int, a) -> float:
        key = (rank, a.op, a.chunk)
        if key not in self.passes:
            self.passes[key] = self.costs.pass_time(rank, a.op, a.chunk)
        return self.passes[key]

    def issue_time(self, op: Op) -> float:
        return self.issue[op]

    def p2p_time(self) -> float:
        return self.p2p

    def chain_steps(self, op: Op) -> list[tuple[str, float]]:
        if op not in self.chains:
            self.chains[op] = chain_steps(self.costs, op)
        return self.chains[op]


def simulate(
    schedule: Schedule,
    costs,
    peak_flops: float | None = None,
    blocking_collectives: bool = False,
    rules: Rules = SIMULATOR,
) -> SimResult:
    """Time `schedule` with `costs` (CostModel or MeasuredCosts). MFU uses peak_flops, or the cost
    model's hardware peak. Collectives are asynchronous (issued in order, waited for by the pass that
    needs their result: S, T, IB, F of chunk 0, B of the last chunk), as on GPUs where they run on a
    stream of their own; `blocking_collectives` makes every rank wait for each one instead (gloo).
    `rules`: the communication rules of the replay (schedule/replay.py); `streams.NCCL` times the lists
    as NCCL runs them (rendezvous sends, in-order batches per communicator)."""
    if blocking_collectives:
        rules = dataclasses.replace(rules, blocking_collectives=True)
    out = replay(schedule, rules, _CostClock(costs))
    timeline = [TimedAction(r, a.op.value, a.mb, a.chunk, start, end) for r, a, start, end in out.passes]
    p = schedule.num_ranks
    for a, _, start, end in out.chains:
        timeline += [TimedAction(r, a.op.value, a.mb, 0, start, end, lane="comm") for r in range(p)]
    return _summarise(schedule, costs, timeline, peak_flops)


def chain_steps(costs, op: Op) -> list[tuple[str, float]]:
    """(step, seconds) of one collective chain: the cost model's steps when it has them, else one step."""
    if hasattr(costs, "chain_steps"):
        return costs.chain_steps(op)
    return [(op.value, costs.collective_time(op))]


def _summarise(schedule: Schedule, costs, timeline: list[TimedAction], peak_flops) -> SimResult:
    p = schedule.num_ranks
    step = max(t.end for t in timeline)
    busy = [0.0] * p
    for t in timeline:
        if t.op in COMPUTE_OPS:
            busy[t.rank] += t.end - t.start
    model = costs if hasattr(costs, "activation_bytes") else getattr(costs, "model", None)
    act_mb, stash_mb, act_bytes = _memory(schedule, timeline, model)
    static = [model.static_bytes(r) if model else 0.0 for r in range(p)]
    mfu = 0.0
    if model is not None:
        peak = peak_flops or model.hw.peak_flops
        mfu = schedule.num_microbatches * model.model_flops() / (step * p * peak)
    return SimResult(
        step_time=step,
        bubble_rate=1 - sum(busy) / (p * step),
        busy=busy,
        peak_activation_microbatches=act_mb,
        peak_stash_microbatches=stash_mb,
        peak_activation_bytes=act_bytes,
        static_bytes=static,
        peak_memory_bytes=[s + a for s, a in zip(static, act_bytes)],
        mfu=mfu,
        timeline=timeline,
    )


def _memory(schedule: Schedule, timeline: list[TimedAction], model):
    """Sweep allocation (+) and free (-) events per rank. Frees sort before allocations at equal
    times, so back-to-back passes do not double count."""
    p = schedule.num_ranks
    free_op = "W" if schedule.split_backward else "B"
    events: list[list] = [[] for _ in range(p)]
    rank_layers = [0] * p
    layers = getattr(model, "chunk_layers", None) or (1,) * schedule.num_chunks
    for c, r in enumerate(schedule.chunk_rank):
        rank_layers[r] += layers[c]
    for t in timeline:
        r = t.rank
        if t.op == "F" and not schedule.forward_only:
            w = layers[t.chunk] / rank_layers[r] if rank_layers[r] else 0.0  # a stage may hold no layer (paper redis)
            b = model.activation_bytes(t.chunk) if model else 0.0
            events[r].append((t.start, 1, w, 0, b))
        elif t.op == free_op:
            w = layers[t.chunk] / rank_layers[r] if rank_layers[r] else 0.0  # a stage may hold no layer (paper redis)
            b = model.activation_bytes(t.chunk) if model else 0.0
            events[r].append((t.end, 0, -w, 0, -b))
        elif t.op == "S":
            b = model.stash_bytes() if model else 0.0
            events[r].append((t.start, 1, 0.0, 1, b))
            if schedule.forward_only:  # no T: the state dies with the loss at C1
                events[r].append((t.end, 0, 0.0, -1, -b))
        elif t.op == "T":
            b = model.stash_bytes() if model else 0.0
            events[r].append((t.end, 0, 0.0, -1, -b))
    act_mb, stash_mb, act_bytes = [], [], []
    for r in range(p):
        cur = [0.0, 0, 0.0]
        peak = [0.0, 0, 0.0]
        for _, _, w, n, b in sorted(events[r], key=lambda e: (e[0], e[1])):
            cur = [cur[0] + w, cur[1] + n, cur[2] + b]
            peak = [max(x, y) for x, y in zip(peak, cur)]
        act_mb.append(round(peak[0], 6))
        stash_mb.append(peak[1])
        act_bytes.append(peak[2])
    return act_mb, stash_mb, act_bytes
