"""Every generated schedule validates; impossible requests fail with a clear ScheduleError."""

import pytest

from vp_accelerate.schedule import Op, ScheduleError, build_schedule, validate
from vp_accelerate.schedule.registry import supported_pairs

PAIRS = supported_pairs()


def _cases():
    # p = 16 and 32 and m = 64 are validated by test_schedule_nccl.py's grid
    for p in (2, 3, 4, 5, 6, 7, 8):
        for m in sorted({p, 2 * p, 4 * p}):
            yield p, m


@pytest.mark.parametrize("kind,method", PAIRS)
def test_every_schedule_validates(kind, method):
    for p, m in _cases():
        validate(build_schedule(kind, method, p, m))


@pytest.mark.parametrize("kind,method", PAIRS)
def test_forward_only_validates_and_has_no_backward(kind, method):
    for p, m in [(2, 2), (3, 7), (4, 16), (8, 8), (8, 32)]:
        s = build_schedule(kind, method, p, m, forward_only=True)
        validate(s)
        ops = {a.op for rank in s.actions for a in rank}
        assert not ops & {Op.B, Op.W, Op.T, Op.C2, Op.IB, Op.IB_BCAST, Op.SEND_GRAD, Op.RECV_GRAD}
        if s.vocab_parallel:
            assert {Op.IF, Op.IF_REDUCE, Op.C0, Op.S, Op.C1} <= ops


def test_interleaved_more_chunks():
    for v in (1, 3, 4):
        for method in ("baseline", "vocab-2"):
            s = build_schedule("interleaved", method, 4, 12, chunks_per_rank=v)
            assert s.chunk_rank == tuple(c % 4 for c in range(4 * v))
            validate(s)


def test_layouts():
    assert build_schedule("vhalf", "vocab-2", 4, 8).chunk_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert build_schedule("1f1b", "redis", 4, 8).chunk_rank == (0, 1, 2, 3)
    assert build_schedule("vhalf", "baseline", 4, 8).split_backward
    assert not build_schedule("1f1b", "vocab-1", 4, 8).split_backward


def test_redis_has_the_baseline_order():
    a = build_schedule("1f1b", "baseline", 4, 12)
    b = build_schedule("1f1b", "redis", 4, 12)
    assert a.actions == b.actions


def _inflight_before_first_backward(s, rank):
    n = 0
    for a in s.actions[rank]:
        if a.op is Op.B:
            return n
        n += a.op is Op.F
    return n


@pytest.mark.parametrize("method,extra", [("baseline", 0), ("vocab-2", 1), ("vocab-1", 2)])
def test_1f1b_warmup_grows_one_microbatch_per_barrier(method, extra):
    p = 6
    s = build_schedule("1f1b", method, p, 24)
    assert [_inflight_before_first_backward(s, r) for r in range(p)] == [p - r + extra for r in range(p)]


def test_collectives_same_order_everywhere_and_rooted():
    s = build_schedule("vhalf", "vocab-1", 4, 8)
    seqs = [[a for a in rank if a.op in (Op.C0, Op.C1, Op.C2, Op.IF_REDUCE, Op.IB_BCAST)] for rank in s.actions]
    assert all(q == seqs[0] for q in seqs)
    roots = {a.op: a.peer for a in seqs[0]}
    assert roots[Op.C0] == 0 and roots[Op.IF_REDUCE] == 0 and roots[Op.C1] == -1


@pytest.mark.parametrize(
    "args,match",
    [
        (("1f1b", "baseline", 4, 3), "num_microbatches .3. must be >= num_ranks .4."),
        (("1f1b", "baseline", 0, 4), "num_ranks must be an integer >= 1"),
        (("zb", "baseline", 4, 8), "unknown schedule kind"),
        (("1f1b", "vocab-3", 4, 8), "unknown method"),
        (("interleaved", "vocab-1", 4, 8), "does not support method 'vocab-1'"),
        (("vhalf", "redis", 4, 8), "does not support method 'redis'"),
    ],
)
def test_impossible_requests(args, match):
    with pytest.raises(ScheduleError, match=match):
        build_schedule(*args)


def test_wrong_chunk_counts():
    with pytest.raises(ScheduleError, match="exactly 2 chunk"):
        build_schedule("vhalf", "baseline", 4, 8, chunks_per_rank=3)
    with pytest.raises(ScheduleError, match="chunks_per_rank must be an integer >= 1"):
        build_schedule("interleaved", "baseline", 4, 8, chunks_per_rank=0)


@pytest.mark.parametrize("kind,method", [("1f1b", "vocab-2"), ("vhalf", "vocab-1"), ("interleaved", "baseline")])
def test_one_rank_is_a_valid_degenerate_pipeline(kind, method):
    """World size 1 (a single-GPU check) runs the same passes with no point-to-point traffic."""
    from vp_accelerate.schedule.ir import P2P
    from vp_accelerate.schedule.validate import validate

    s = build_schedule(kind, method, 1, 4)
    validate(s)
    assert s.num_ranks == 1 and not any(a.op in P2P for a in s.actions[0])
    assert sum(a.op is Op.F for a in s.actions[0]) == 4 * len(s.chunk_rank)


# ---- cost-aware construction (schedule/list_schedule.py) ---------------------------------------------


def _costs(kind, method, p, layers_per_rank=2, vocab=32000):
    from vp_accelerate.cost import ModelShape, for_schedule

    grid = build_schedule(kind, method, p, p)
    shape = ModelShape(hidden=2048, layers=layers_per_rank * grid.num_chunks, heads=16, ffn=8192, vocab=vocab, seq=2048)
    return for_schedule(shape, grid)


@pytest.mark.parametrize("kind,method", PAIRS)
def test_cost_aware_schedules_validate(kind, method):
    """The builder validates what it builds; forward-only too; the order is a pure function of the inputs."""
    for p, m in [(2, 2), (2, 7), (3, 9), (4, 4), (4, 17), (5, 10), (8, 24)]:
        costs = _costs(kind, method, p)
        s = build_schedule(kind, method, p, m, costs=costs)
        validate(s)
        assert s.actions == build_schedule(kind, method, p, m, costs=costs).actions
        validate(build_schedule(kind, method, p, m, costs=costs, forward_only=True))


@pytest.mark.parametrize("method", [pytest.param("vocab-1", marks=pytest.mark.slow), "vocab-2"])
def test_cost_aware_vhalf_beats_the_grid_and_1f1b_within_its_memory(method):
    """With real costs (B ~ 1.2 F, W ~ 0.9 F, S/T on every rank) the unit grid's V-Half order idles; the
    cost-aware one stays within the grid's activation peak on every rank and beats 1F1B + VP."""
    from vp_accelerate.sim.simulate import simulate

    p, m = 8, 64
    costs = _costs("vhalf", method, p)
    grid = simulate(build_schedule("vhalf", method, p, m), costs)
    new = simulate(build_schedule("vhalf", method, p, m, costs=costs), costs)
    one = _costs("1f1b", method, p, layers_per_rank=4)
    f1b = simulate(build_schedule("1f1b", method, p, m, costs=one), one)
    assert new.bubble_rate < grid.bubble_rate - 0.1
    assert new.bubble_rate < f1b.bubble_rate
    for r in range(p):
        assert new.peak_activation_microbatches[r] <= grid.peak_activation_microbatches[r]


def test_cost_aware_keeps_the_grid_when_it_is_as_good():
    """Without VP, 1F1B's grid order is already as fast as any greedy reordering: the builder keeps it."""
    for kind, method in [("1f1b", "redis"), ("1f1b", "baseline")]:
        costs = _costs(kind, method, 4)
        assert build_schedule(kind, method, 4, 16, costs=costs).actions == build_schedule(kind, method, 4, 16).actions


def test_cost_aware_from_measured_costs(tmp_path):
    import json

    from vp_accelerate.cost import MeasuredCosts

    path = tmp_path / "t.json"
    path.write_text(
        json.dumps(
            {
                "passes": [{"F": 1.0, "B": 1.2, "W": 0.9, "S": 0.3, "T": 0.2, "IF": 0.0, "IB": 0.0}] * 4,
                "p2p": 0.01,
                "collectives": {"C0": 0.01, "C1": 0.05},
            }
        )
    )
    s = build_schedule("vhalf", "vocab-2", 4, 16, costs=MeasuredCosts.from_json(path))
    validate(s)


@pytest.mark.parametrize("kind,method", [("1f1b", "vocab-1"), ("vhalf", "vocab-2"), ("interleaved", "vocab-2")])
def test_the_list_schedulers_times_are_the_replays_under_buffered_sends(kind, method):
    """One model of time: the step the list scheduler plans lasts what the replay driver computes for its
    lowered lists under `replay.BUFFERED` with the same clock (to the tick), and no pass starts later
    there than planned (the replay starts each as soon as its inputs allow; the scheduler may hold back
    one, as IF until its release)."""
    import dataclasses

    from vp_accelerate.schedule.list_schedule import POLICIES, Ticks, list_schedule
    from vp_accelerate.schedule.lower import lower
    from vp_accelerate.schedule.registry import check_pair
    from vp_accelerate.schedule.replay import BUFFERED, CostClock, makespan, replay
    from vp_accelerate.schedule.timing import place

    p, m = 4, 12
    grid = build_schedule(kind, method, p, m)
    sk, meth = check_pair(kind, method)
    block = sk.block(p, 2, meth.barriers * sk.block(p, 2, 0).sub_period)
    passes, _ = place(block, p, m, meth, False)
    clock = CostClock(_costs(kind, method, p))
    ticks = Ticks(clock, passes)
    for policy in POLICIES:
        planned, colls, span = list_schedule(grid, passes, ticks, policy)
        lists = lower(p, grid.chunk_rank, planned, colls)
        out = replay(dataclasses.replace(grid, actions=lists), BUFFERED, clock)
        tol = 1e-5 * span * ticks.tick_s
        assert makespan(out) == pytest.approx(span * ticks.tick_s, abs=tol)
        starts = {(r, a.op, a.mb, a.chunk): start for r, a, start, _ in out.passes}
        for tp in planned:
            assert starts[(tp.rank, tp.op, tp.mb, tp.chunk)] <= tp.slot * ticks.tick_s + tol
