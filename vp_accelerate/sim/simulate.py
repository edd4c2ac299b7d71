"""Replay a schedule's action lists with pass costs: step time, bubbles, memory, MFU, timeline.

The replay is schedule/replay.py's driver with a cost clock; what each pass waits for is
schedule/deps.py's `consumed`, as in the validator and the executor. Execution model: each rank runs
its actions in order; its p2p batches and collectives are issued where they stand and the pass that
consumes one waits for it. Under NCCL's rules (the default, `streams.NCCL`) a send and its receive
complete p2p_time after both sides have posted them and each communicator runs its operations in issue
order; under `replay.BUFFERED` a send never waits and its data lands p2p_time later.
Collectives run as the runtime runs them (vocab/comm.py): each is a chain of dependent steps (C1: the
max all-reduce, the rescale by exp(m_i - m), the sums all-reduce) on a communication resource of its
own that overlaps compute; a chain starts once every rank has issued it (a rank issues one when it
reaches it, without waiting) and the resource is free, and the pass that needs the result waits for
it. `blocking_collectives=True` makes every rank wait for each chain instead, as it does for a synchronous method
(the interlaced pipeline, whose ranks wait for its collectives as a tensor-parallel layer does). Chain steps are timeline
records of lane "comm".
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

from vp_accelerate.schedule.ir import COLLECTIVES, COMPUTE_OPS, Schedule, TimedAction
from vp_accelerate.schedule.replay import CostClock, Replayed, Rules, replay
from vp_accelerate.schedule.streams import NCCL


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
    """Per rank, peak bytes of activations + VP stash held between passes (needs a shape-based cost model;
    else 0)."""
    static_bytes: list[float]
    """Per rank, parameter + gradient + optimizer bytes (shape-based cost model; else 0)."""
    peak_memory_bytes: list[float]
    """static_bytes + the peak of what is held plus what the pass running at that moment makes and frees
    within itself (`CostModel.transient_bytes`): at least static_bytes + peak_activation_bytes."""
    mfu: float
    """Model FLOPs utilisation given the peak FLOP rate (0 without a shape-based model)."""
    timeline: list[TimedAction] = field(repr=False)
    """Every compute pass (and collective, op C0/C1/...) with its start and end."""


def simulate(
    schedule: Schedule,
    costs,
    peak_flops: float | None = None,
    blocking_collectives: bool = False,
    rules: Rules = NCCL,
) -> SimResult:
    """Time `schedule` with `costs` (CostModel or MeasuredCosts). MFU uses peak_flops, or the cost
    model's hardware peak. Collectives are asynchronous (issued in order, waited for by the pass that
    needs their result: S, T, IB, F of chunk 0, B of the last chunk), as on GPUs where they run on a
    stream of their own; `blocking_collectives` makes every rank wait for each one instead (gloo).
    `rules`: the communication rules of the replay (schedule/replay.py): by default NCCL's, as a GPU
    launch runs the lists (a send completes once the peer's receive is posted, each communicator's
    operations in issue order; `streams.NCCL`); `replay.BUFFERED` lets every send complete at once."""
    if blocking_collectives or schedule.method.synchronous:  # interlaced: every rank waits for each chain
        rules = dataclasses.replace(rules, blocking_collectives=True)
    hw = getattr(costs, "hw", None)
    out = _contended_replay(schedule, rules, costs, getattr(hw, "comm_sm_fraction", 0.0))
    timeline = [TimedAction(r, a.op.value, a.mb, a.chunk, start, end) for r, a, start, end in out.passes]
    p = schedule.num_ranks
    for a, _, start, end in out.chains:
        timeline += [TimedAction(r, a.op.value, a.mb, 0, start, end, lane="comm") for r in range(p)]
    return _summarise(schedule, costs, timeline, peak_flops)


class _StretchedClock(CostClock):
    """A cost clock whose passes each take `stretch[(rank, op, mb, chunk)]` times their cost."""

    def __init__(self, costs, stretch: dict):
        super().__init__(costs)
        self.stretch = stretch

    def pass_time(self, rank: int, a) -> float:
        return super().pass_time(rank, a) * self.stretch.get((rank, a.op, a.mb, a.chunk), 1.0)


def _contended_replay(schedule: Schedule, rules: Rules, costs, sm_fraction: float, rounds: int = 4) -> Replayed:
    """The replay with compute slowed where a rank's collectives hold SMs. NCCL runs a collective as one
    kernel per rank whose thread blocks (one per channel) each hold an SM from the moment the kernel
    starts on the communication stream, right after the rank issues it, until the collective completes:
    through the wait for the last rank to issue it as well as the transfer. A compute pass on that rank
    meanwhile gets the other SMs, so the part of it that overlaps such a window runs at (1 - sm_fraction)
    of its speed. (Point-to-point kernels hold SMs too, but a pass waiting for a transfer is not running.)
    The windows depend on the pass times and the pass times on the windows: replayed `rounds` more times,
    each pass stretched by the overlap its instance had in the replays before (within 0.5% of MFU after
    4 rounds on the paper's 8-rank cells)."""
    out = replay(schedule, rules, CostClock(costs))
    if sm_fraction <= 0 or not any(a.op in COLLECTIVES for acts in schedule.actions for a in acts):
        return out
    held: dict = {}
    for _ in range(rounds):
        windows = _collective_windows(schedule, out)
        for r, a, start, end in out.passes:
            key = (r, a.op, a.mb, a.chunk)
            now = _overlap(windows[r], start, end) / (end - start) if end > start else 0.0
            # half the step towards the new overlap: a full step overshoots (a slower pass moves the windows
            # that slowed it) and alternates between two timings
            held[key] = (held.get(key, now) + now) / 2
        stretch = {key: 1.0 / (1.0 - sm_fraction * h) for key, h in held.items()}
        out = replay(schedule, rules, _StretchedClock(costs, stretch))
    return out


def _collective_windows(schedule: Schedule, out: Replayed) -> list[list[tuple[float, float]]]:
    """Per rank, the merged intervals during which one of its collectives was issued and not complete (a
    rank issues a collective when its line reaches it: at the end of the compute pass before it)."""
    ends = {(r, id(a)): end for r, a, _, end in out.passes}
    done: dict = {}
    for a, _, _, end in out.chains:
        key = (a.op, a.mb, a.chunk)
        done[key] = max(done.get(key, 0.0), end)
    windows = []
    for r, actions in enumerate(schedule.actions):
        t, spans = 0.0, []
        for a in actions:
            if a.op.value in COMPUTE_OPS:
                t = ends.get((r, id(a)), t)
            elif a.op in COLLECTIVES and (a.op, a.mb, a.chunk) in done:
                spans.append((t, done[(a.op, a.mb, a.chunk)]))
        merged: list[tuple[float, float]] = []
        for s, e in sorted(spans):
            if merged and s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        windows.append(merged)
    return windows


def _overlap(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] inside the sorted, disjoint `spans`."""
    i = bisect.bisect_right(spans, (start, float("inf"))) - 1
    total = 0.0
    for s, e in spans[max(i, 0) :]:
        if s >= end:
            break
        total += max(0.0, min(e, end) - max(s, start))
    return total


def _summarise(schedule: Schedule, costs, timeline: list[TimedAction], peak_flops) -> SimResult:
    p = schedule.num_ranks
    step = max(t.end for t in timeline)
    busy = [0.0] * p
    for t in timeline:
        if t.op in COMPUTE_OPS:
            busy[t.rank] += t.end - t.start
    model = costs if hasattr(costs, "activation_bytes") else getattr(costs, "model", None)
    act_mb, stash_mb, act_bytes, all_bytes = _memory(schedule, timeline, model)
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
        peak_memory_bytes=[s + a for s, a in zip(static, all_bytes)],
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
    emb = model.input_bytes() if model else 0.0
    root = schedule.chunk_rank[0]
    arrivals = [{} if model is None or schedule.forward_only else model.grad_arrivals(r) for r in range(p)]
    grads_after = [-sum(a.values()) for a in arrivals]  # gradients are not held before their first pass
    for t in timeline:
        r = t.rank
        if t.lane != "compute":
            continue
        arrived = arrivals[r].pop((t.op, t.chunk), None)
        if arrived:
            events[r].append((t.start, 1, 0.0, 0, 0.0, arrived))
        if model is not None and not schedule.forward_only and t.op in ("F", "B", "W", "S", "T", "IF"):
            tr = model.transient_bytes(t.op, t.chunk)  # held during the pass alone (order_peak_memory's rule)
            if arrived is None and t.op == free_op:  # a fresh gradient added into the held one at the pass's end,
                # when the chunk's activations are gone (regrad_bytes; order_peak_memory's rule)
                tr = max(tr, model.regrad_bytes(t.op, t.chunk) - model.activation_bytes(t.chunk))
            if t.op == "IF" and r == root:  # kept (a communication buffer, then chunk 0's input) until its B
                events[r].append((t.start, 1, 0.0, 0, 0.0, emb))
            elif tr:  # within the pass: in the peak of memory, not in the activations held between passes
                events[r] += [(t.start, 1, 0.0, 0, 0.0, tr), (t.end, 0, 0.0, 0, 0.0, -tr)]
        if t.op == "F" and not schedule.forward_only:
            w = layers[t.chunk] / rank_layers[r] if rank_layers[r] else 0.0  # a stage may hold no layer (paper redis)
            b = model.activation_bytes(t.chunk) if model else 0.0
            events[r].append((t.start, 1, w, 0, b))
        elif t.op == "B" and schedule.split_backward and model is not None:
            # the weight-gradient queue grows while autograd frees the activations; after B only the queue
            # is held (order_peak_memory's rule)
            queue, act = model.weight_grad_queue_bytes(t.chunk), model.activation_bytes(t.chunk)
            grow = max(0.0, queue - act)
            events[r] += [(t.start, 1, 0.0, 0, 0.0, grow), (t.end, 0, 0.0, 0, 0.0, -grow)]
            events[r] += [(t.end, 0, 0.0, 0, -act), (t.end, 1, 0.0, 0, queue)]
        elif t.op == free_op:
            w = layers[t.chunk] / rank_layers[r] if rank_layers[r] else 0.0  # a stage may hold no layer (paper redis)
            b = model.activation_bytes(t.chunk) if model else 0.0
            if schedule.split_backward and model is not None:
                b = model.weight_grad_queue_bytes(t.chunk)  # W frees the queue; B freed the activations
            events[r].append((t.end, 0, -w, 0, -b))
            if t.chunk == 0 and r == root and emb and not schedule.forward_only:
                events[r].append((t.end, 0, 0.0, 0, 0.0, -emb))
        elif t.op == "S":
            b = model.stash_bytes() if model else 0.0
            events[r].append((t.start, 1, 0.0, 1, b))
            if schedule.forward_only:  # no T: the state dies with the loss at C1
                events[r].append((t.end, 0, 0.0, -1, -b))
        elif t.op == "T":
            b = model.stash_bytes() if model else 0.0
            events[r].append((t.end, 0, 0.0, -1, -b))
    act_mb, stash_mb, act_bytes, all_bytes = [], [], [], []
    for r in range(p):
        cur = [0.0, 0, 0.0, grads_after[r]]
        peak = [0.0, 0, 0.0, grads_after[r]]
        for e in sorted(events[r], key=lambda e: (e[0], e[1])):
            w, n, b = e[2], e[3], e[4]
            tr = e[5] if len(e) > 5 else 0.0
            cur = [cur[0] + w, cur[1] + n, cur[2] + b, cur[3] + b + tr]
            peak = [max(x, y) for x, y in zip(peak, cur)]
        act_mb.append(round(peak[0], 6))
        stash_mb.append(peak[1])
        act_bytes.append(peak[2])
        all_bytes.append(peak[3])
    return act_mb, stash_mb, act_bytes, all_bytes


def order_peak_memory(schedule: Schedule, model, events=None) -> list[float]:
    """Per rank, the peak bytes of `simulate(schedule, model).peak_memory_bytes` without timing the
    step: a rank runs its passes one after another in list order, so what it holds at any moment follows
    from that order alone (allocated at an F or S, freed after the B / W or T; during each pass its
    `transient_bytes` on top), whatever the pass times. The planner screens layouts for memory with it
    before it times any. `events`: `memory_events(schedule)` when the caller keeps it for many models."""
    act = [model.activation_bytes(c) for c in range(schedule.num_chunks)]
    # split backward: B frees a microbatch's activations and leaves its weight-gradient queue until W
    queue = [model.weight_grad_queue_bytes(c) if schedule.split_backward else 0.0 for c in range(schedule.num_chunks)]
    stash = model.stash_bytes()
    emb = model.input_bytes()
    root = schedule.chunk_rank[0]
    free_op = "W" if schedule.split_backward else "B"
    trans = {
        (op, c): (0.0 if schedule.forward_only else model.transient_bytes(op, c))
        for op in ("F", free_op, "B", "S", "T", "IF")
        for c in range(schedule.num_chunks)
    }
    kinds = {0: "F", 1: free_op, 2: "S", 3: "T", 5: "B"}
    peaks = []
    for r, rank_events in enumerate(events or memory_events(schedule)):
        # gradients are allocated in the step, by the first pass that writes them (CostModel.grad_arrivals)
        arrivals = {} if schedule.forward_only else model.grad_arrivals(r)
        cur = peak = -sum(arrivals.values())
        for kind, chunk in rank_events:
            arrived = arrivals.pop((kinds.get(kind), chunk), None)
            cur += arrived or 0.0
            if kind == 0:  # F: the chunk's activations
                cur += act[chunk]
                peak = max(peak, cur + trans["F", chunk])
            elif kind == 1:  # B (W when split): freed; after the step's first, a fresh gradient beside the held one,
                # made at the pass's end, when the chunk's activations are gone (regrad_bytes)
                again = 0.0 if arrived is not None or schedule.forward_only else model.regrad_bytes(free_op, chunk)
                peak = max(peak, cur + max(trans[free_op, chunk], again - act[chunk]))
                held = queue[chunk] if schedule.split_backward else act[chunk]
                cur -= held + (emb if chunk == 0 and r == root else 0.0)
            elif kind == 2:  # S: the VP stash (forward-only: held during S alone)
                peak = max(peak, cur + stash + trans["S", chunk])
                cur += 0.0 if schedule.forward_only else stash
            elif kind == 3:  # T
                peak = max(peak, cur + trans["T", chunk])
                cur -= stash
            elif kind == 4:  # IF: the first stage's rank keeps the reduced embedding until chunk 0's B
                if r == root and not schedule.forward_only:
                    cur += emb
                else:
                    peak = max(peak, cur + trans["IF", 0])
            else:  # B of a split backward: autograd frees the activations as the W queue grows
                peak = max(peak, cur + trans["B", chunk] + max(0.0, queue[chunk] - act[chunk]))
                cur += queue[chunk] - act[chunk]
            peak = max(peak, cur)
        peaks.append(model.static_bytes(r) + peak)
    return peaks


def memory_events(schedule: Schedule) -> list[list[tuple[int, int]]]:
    """Per rank, (0 alloc / 1 free / 2 stash / 3 unstash, chunk) of its passes that hold memory, in order."""
    free_op = "W" if schedule.split_backward else "B"
    if schedule.forward_only:
        kinds = {"S": 2, "T": 3}
    else:
        kinds = {"F": 0, free_op: 1, "S": 2, "T": 3, "IF": 4}
        if schedule.split_backward:
            kinds["B"] = 5
    return [[(kinds[a.op.value], a.chunk) for a in actions if a.op.value in kinds] for actions in schedule.actions]
