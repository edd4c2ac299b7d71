"""Every schedule is deadlock-free under NCCL's semantics, and orders that would hang on NCCL are caught.

NCCL completes a large send only once the peer has posted the matching receive, completes a rank's p2p
batches in issue order, and with CUDA_DEVICE_MAX_CONNECTIONS=1 serialises all communicators of a rank.
gloo shows none of that, so the validator replays every schedule under those rules (schedule/streams.py).
"""

import dataclasses

import pytest

from helpers.old_order import receives_at_consumers
from vp_accelerate.schedule import Op, ScheduleError, build_schedule, validate
from vp_accelerate.schedule.ir import p2p_batches
from vp_accelerate.schedule.registry import supported_pairs
from vp_accelerate.schedule.streams import replay_streams

RANKS = (2, 3, 4, 8, 16, 32)


def _microbatches(p: int) -> list[int]:
    return sorted({p, 2 * p, 2 * p + 1, 64})


# the baseline / redis pairs of the V and interleaved schedules in the slow run (the suite's budget); every VP
# pair and 1F1B's baseline stay
_NCCL_PAIRS = [
    pytest.param(k, m, marks=pytest.mark.slow) if m in ("baseline", "redis") and k != "1f1b" else (k, m)
    for k, m in supported_pairs()
]


@pytest.mark.parametrize("kind,method", _NCCL_PAIRS)
def test_every_schedule_is_deadlock_free_under_nccl_rules(kind, method):
    for p in RANKS:
        for m in _microbatches(p):
            s = build_schedule(kind, method, p, m)
            validate(s)  # includes the serialised-communicator replay, which implies the per-communicator one
            if p <= 4:
                replay_streams(s, serialized=False)
                ev = build_schedule(kind, method, p, m, forward_only=True) if s.kind.forward_only else None
                if ev is not None:
                    validate(ev)


def _with_lists(s, lists):
    return dataclasses.replace(s, actions=tuple(tuple(a) for a in lists))


def test_the_issue_example_hangs_with_receives_at_their_consumers():
    # 1F1B + vocab-2, p=2, m=4: rank 0 posts SEND_ACT(mb 2) then RECV_GRAD(mb 0), rank 1 SEND_GRAD(mb 0)
    # then RECV_ACT(mb 2), in separate batches: each send waits for a receive the peer posts only after
    # its own send completed. gloo (sends never block) runs it; NCCL would hang.
    old = receives_at_consumers(build_schedule("1f1b", "vocab-2", 2, 4))
    with pytest.raises(ScheduleError, match="deadlocks under NCCL semantics"):
        replay_streams(old, serialized=False)
    with pytest.raises(ScheduleError, match=r"p2p batch .*SEND_.*waits for rank \d to post the matching receive"):
        validate(old)


def test_serialised_communicators_catch_a_cross_communicator_cycle():
    # rank 1 posts a receive after a collective that rank 0 issues after the matching send: with one
    # stream per communicator both complete; with every communicator in one issue order (one hardware
    # connection) rank 0's send waits for rank 1's receive, which waits behind the collective, which
    # waits for rank 0's collective, which waits behind the send
    s = build_schedule("1f1b", "vocab-2", 2, 4)
    acts = list(s.actions[1])
    for i, a in enumerate(acts):
        if a.op is Op.RECV_ACT and i + 1 < len(acts) and acts[i + 1].op in (Op.C0, Op.C1, Op.IF_REDUCE):
            acts.insert(i + 1, acts.pop(i))
            break
    else:
        pytest.fail("no receive right before a collective on rank 1")
    broken = _with_lists(s, [s.actions[0], acts])
    replay_streams(broken, serialized=False)  # one stream each: fine
    with pytest.raises(ScheduleError, match="all communicators serialised"):
        replay_streams(broken, serialized=True)
    with pytest.raises(ScheduleError, match="deadlocks under NCCL semantics"):
        validate(broken)


def test_one_rank_has_no_p2p():
    for kind, method in supported_pairs():
        s = build_schedule(kind, method, 1, 2)
        assert not any(isinstance(b, tuple) for b in p2p_batches(s.actions[0]))
        validate(s)


@pytest.mark.parametrize("kind,method", supported_pairs())
def test_each_p2p_batch_talks_to_one_peer(kind, method):
    # a pass waits for the whole batch holding its receive: a batch with two peers would make it wait for
    # the other peer's transfer too (V-Half + VP on 8 ranks lost its lead over 1F1B to exactly that)
    for p in (2, 4, 8):
        s = build_schedule(kind, method, p, 2 * p)
        for acts in s.actions:
            batches = [b for b in p2p_batches(acts) if isinstance(b, tuple)]
            assert batches and all(len({a.peer for a in b}) == 1 for b in batches)
