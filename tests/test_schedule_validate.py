"""The validator catches broken schedules and names the rank and action."""

import dataclasses

import pytest

from vp_accelerate.schedule import Action, Op, ScheduleError, build_schedule, validate


def _with_rank(s, rank, actions):
    lists = list(s.actions)
    lists[rank] = tuple(actions)
    return dataclasses.replace(s, actions=tuple(lists))


def test_swapped_collectives_on_one_rank():
    s = build_schedule("1f1b", "vocab-2", 4, 8)
    acts = list(s.actions[2])
    # IF_REDUCE(j) and C1(k) share a boundary: swapping them breaks no local dependency
    i = next(k for k in range(len(acts) - 1) if acts[k].op is Op.IF_REDUCE and acts[k + 1].op is Op.C1)
    acts[i], acts[i + 1] = acts[i + 1], acts[i]
    with pytest.raises(ScheduleError, match=r"rank 2, action #\d+ .*collective"):
        validate(_with_rank(s, 2, acts))


def test_dropped_receive():
    s = build_schedule("vhalf", "vocab-2", 4, 8)
    acts = [a for a in s.actions[1] if not (a.op is Op.RECV_ACT and a.mb == 3)]
    with pytest.raises(ScheduleError, match=r"rank 1, action #\d+ F\(mb=3, chunk=1\): runs before RECV_ACT"):
        validate(_with_rank(s, 1, acts))


def test_dropped_send_is_a_deadlock():
    s = build_schedule("1f1b", "baseline", 3, 6)
    acts = [a for a in s.actions[0] if not (a.op is Op.SEND_ACT and a.mb == 2)]
    with pytest.raises(ScheduleError, match="never runs SEND_ACT"):
        validate(_with_rank(s, 0, acts))


def test_deadlock_order():
    # rank 0 waits for mb 0's gradient before joining C1(0), which rank 1's B(0) needs: nobody can move
    s = build_schedule("1f1b", "vocab-2", 2, 4)
    acts = list(s.actions[0])
    recv = acts.index(Action(Op.RECV_GRAD, 0, 0, 1))
    c1 = acts.index(Action(Op.C1, 0, 0, -1))
    acts.insert(c1, acts.pop(recv))
    with pytest.raises(ScheduleError, match=r"deadlocks under NCCL semantics.*rank 0: .*RECV_GRAD\(mb=0.*rank 1: "):
        validate(_with_rank(s, 0, acts))


def test_out_of_order_receives():
    s = build_schedule("1f1b", "baseline", 2, 4)
    acts = list(s.actions[1])
    i = acts.index(Action(Op.RECV_ACT, 1, 1, 0))
    j = acts.index(Action(Op.RECV_ACT, 2, 1, 0))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match="rank 1, action"):
        validate(_with_rank(s, 1, acts))


def test_dependency_order_within_a_rank():
    s = build_schedule("1f1b", "vocab-1", 2, 4)
    acts = list(s.actions[1])  # last stage: B(0) must wait for C2(0)
    b = acts.index(Action(Op.B, 0, 1))
    c2 = acts.index(Action(Op.C2, 0, 0, -1))
    acts.insert(c2, acts.pop(b))
    with pytest.raises(ScheduleError, match=r"rank 1, action #\d+ B\(mb=0, chunk=1\): runs before C2"):
        validate(_with_rank(s, 1, acts))


def test_duplicate_and_foreign_actions():
    s = build_schedule("1f1b", "baseline", 2, 2)
    with pytest.raises(ScheduleError, match="runs twice"):
        validate(_with_rank(s, 0, s.actions[0] + (s.actions[0][0],)))
    with pytest.raises(ScheduleError, match="does not belong"):
        validate(_with_rank(s, 0, s.actions[0] + (Action(Op.S, 0),)))


def test_wrong_root():
    s = build_schedule("1f1b", "vocab-2", 2, 2)
    acts = [dataclasses.replace(a, peer=0) if a.op is Op.C0 else a for a in s.actions[0]]
    with pytest.raises(ScheduleError, match="root must be rank 1"):
        validate(_with_rank(s, 0, acts))


def test_the_validator_sees_each_collective_of_a_chain():
    """C1 is one IR action but three collectives (max, then the sums after the rescale); the order check
    compares them one by one and names the one where two ranks part."""
    from vp_accelerate.schedule.ir import chain_collectives
    from vp_accelerate.schedule.registry import METHODS

    assert len(chain_collectives(Op.C1, METHODS["vocab-2"])) == 3
    assert len(chain_collectives(Op.C2, METHODS["vocab-1"])) == 1
    s = build_schedule("1f1b", "vocab-2", 4, 8)
    acts = list(s.actions[1])
    i = next(k for k in range(len(acts) - 1) if acts[k].op is Op.IF_REDUCE and acts[k + 1].op is Op.C1)
    acts[i], acts[i + 1] = acts[i + 1], acts[i]
    with pytest.raises(ScheduleError, match=r"rank 1, .*C1.*\(all_reduce max m_i\) but rank 0's is IF_REDUCE"):
        validate(_with_rank(s, 1, acts))
