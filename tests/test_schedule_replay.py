"""The one replay driver (schedule/replay.py): the validator replays it without a clock under NCCL's rules,
the simulator with costs under its own; both read what a pass waits on from schedule/deps.py."""

import dataclasses

import pytest

from helpers.old_order import receives_at_consumers
from vp_accelerate.cost import for_schedule
from vp_accelerate.schedule import ScheduleError, build_schedule
from vp_accelerate.schedule.deps import consumed
from vp_accelerate.schedule.ir import COMPUTE_PASSES
from vp_accelerate.schedule.registry import supported_pairs
from vp_accelerate.schedule.replay import BUFFERED, NullClock, replay
from vp_accelerate.schedule.streams import NCCL, NCCL_SERIALIZED
from vp_accelerate.sim.paper import shape
from vp_accelerate.sim.simulate import simulate


@pytest.mark.parametrize("kind,method", supported_pairs())
def test_nccl_timing_is_never_faster_than_buffered_sends(kind, method):
    # the replay is max-plus: NCCL's rules only add waits (rendezvous, in-order queues), so with the same
    # costs every schedule takes at least as long under them, and every pass still runs once
    for p, m in ((2, 4), (4, 9)):
        s = build_schedule(kind, method, p, m)
        costs = for_schedule(shape(64000, 1024), s)
        eager, nccl, serial = (simulate(s, costs, rules=r) for r in (BUFFERED, NCCL, NCCL_SERIALIZED))
        assert eager.step_time <= nccl.step_time * (1 + 1e-12) <= serial.step_time * (1 + 1e-12)
        n = sum(1 for acts in s.actions for a in acts if a.op in COMPUTE_PASSES)
        assert len([t for t in nccl.timeline if t.lane == "compute"]) == n


def test_every_pass_starts_after_what_it_consumes():
    s = build_schedule("vhalf", "vocab-2", 4, 8)
    costs = for_schedule(shape(128000, 2048), s)
    r = simulate(s, costs, rules=NCCL)
    start = {(t.rank, t.op, t.mb, t.chunk): t.start for t in r.timeline if t.lane == "compute"}
    chain_end = {}
    for t in r.timeline:
        if t.lane == "comm":
            chain_end[(t.op, t.mb)] = max(chain_end.get((t.op, t.mb), 0.0), t.end)
    checked = 0
    for rank, acts in enumerate(s.actions):
        for a in acts:
            for op, mb, _ in consumed(s, rank, a):
                if (op.value, mb) in chain_end:  # a collective: the pass starts once its chain ended
                    assert start[(rank, a.op.value, a.mb, a.chunk)] >= chain_end[(op.value, mb)] - 1e-12
                    checked += 1
    assert checked > 0


def test_one_driver_two_rules_the_old_order_runs_buffered_and_hangs_on_nccl():
    old = receives_at_consumers(build_schedule("1f1b", "vocab-2", 2, 4))
    replay(old, BUFFERED, NullClock())  # buffered sends: the order finishes
    simulate(old, for_schedule(shape(32000, 1024), old), rules=BUFFERED)
    with pytest.raises(ScheduleError, match="deadlocks under NCCL semantics"):
        simulate(old, for_schedule(shape(32000, 1024), old))  # NCCL's rules: the default


def test_a_message_never_received_is_named():
    s = build_schedule("1f1b", "baseline", 2, 2)
    lists = [list(acts) for acts in s.actions]
    lists[1] = [a for a in lists[1] if a.op.value != "RECV_ACT" or a.mb != 1]
    broken = dataclasses.replace(s, actions=tuple(map(tuple, lists)))
    with pytest.raises(ScheduleError, match="never received"):
        replay(broken, BUFFERED)
