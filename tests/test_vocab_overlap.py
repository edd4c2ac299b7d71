"""Vocabulary collective chains progress without their rank's compute thread.

One rank is busy computing (a loop of matmuls) for 0.5 s between issuing a chain (C0, C1, C2, IF reduce,
IB broadcast) and waiting on it. The other ranks' waits must end within 0.1 s of the last rank's issue:
the chain — for C1 max all-reduce -> rescale -> sums all-reduce — runs on each rank's communication
worker, not in the busy rank's `wait()`. Were any step of a chain issued by the consumer, every other
rank would wait the full 0.5 s (5 x the bound): `test_the_check_fails_when_chains_run_in_wait` runs the same
measurement with every chain moved into `wait()` and requires every case to come out late.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from vp_accelerate.distributed import spawn
from vp_accelerate.vocab.embedding import embed_partial, ib_broadcast, if_reduce
from vp_accelerate.vocab.output_layer import (
    OutputLayerOptions,
    broadcast_x,
    c1,
    c2,
    s_pass,
    t_pass,
    token_mean_grad_scale,
)
from vp_accelerate.vocab.partition import VocabPartition, shard_tensor

BUSY_S = 0.5  # 5 x BOUND_S: a chain the busy rank holds back is late by all of it
BOUND_S = 0.1
ATTEMPTS = 3
CASES = [
    ("vocab-2", "C1"),
    ("vocab-1", "C1"),
    ("vocab-1", "C2"),
    ("vocab-2", "C0"),
    ("vocab-2", "IF_REDUCE"),
    ("vocab-1", "IB_BCAST"),
]
N, H, V = 8, 4, 29


def _state(algorithm: str, part: VocabPartition, rank: int, group):
    g = torch.Generator().manual_seed(0)  # the same x and labels on every rank
    x = torch.randn(N, H, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    weight = shard_tensor(torch.randn(V, H, generator=g), part, rank)
    st = s_pass(x, labels, token_mean_grad_scale(labels, N), weight, part, rank, OutputLayerOptions(algorithm))
    return st, weight


def _issue(algorithm: str, op: str, part: VocabPartition, rank: int, busy: int, group):
    """Prepare the inputs (not timed), then return a function that issues the chain."""
    st, weight = _state(algorithm, part, rank, group)
    if op == "C1":
        return lambda: c1(st, group)
    if op == "C2":
        c1(st, group).wait()
        t_pass(st, torch.zeros_like(weight))
        return lambda: c2(st, group)
    buf = torch.randn(N, H) if rank == busy else torch.empty(N, H)
    if op == "C0":
        return lambda: broadcast_x(buf, busy, group, async_op=True)
    if op == "IB_BCAST":
        return lambda: ib_broadcast(buf, busy, group, async_op=True)
    partial = embed_partial(torch.arange(N) % V, weight, part, rank)
    return lambda: if_reduce(partial, busy, group, async_op=True)


def _busy(seconds: float) -> None:
    """Keep the compute thread busy with real work (torch releases the GIL inside each matmul)."""
    a = torch.randn(128, 128)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = torch.tanh(a @ a)


def _chains_in_wait() -> None:
    """The wrong engine: each chain runs on the consumer's thread when it waits (as issuing C1's sums
    all-reduce inside wait() once did)."""
    from vp_accelerate.vocab import comm, embedding, output_layer

    def submit(chain, group, device, inputs=(), label="", async_op=True):
        return comm.finish(comm.Pending(finalize=chain, label=label), async_op)

    output_layer.submit = embedding.submit = submit


def _measure(cases, lazy: bool = False, tries: int = ATTEMPTS) -> list[list[tuple[float, float]]]:
    """Per case, per attempt: every rank's (issue time, time its wait ended), time.monotonic() seconds.

    A case is retried (up to ATTEMPTS) only while some non-busy rank ended late: a wait that the busy
    rank delays is late in every attempt, while a loaded machine's scheduling hiccup is not.
    """
    if lazy:
        _chains_in_wait()
    rank, p = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(p)))  # the vocabulary group; barriers below use the world group
    part = VocabPartition(V, p)
    busy = p - 1
    for algorithm, op in cases:  # warm-up: first use of each op and of the worker is not what we time
        _issue(algorithm, op, part, rank, busy, group)().wait()
    out = []
    for algorithm, op in cases:
        attempts = []
        for _ in range(tries):
            issue = _issue(algorithm, op, part, rank, busy, group)
            dist.barrier()
            t_issue = time.monotonic()
            pending = issue()
            if rank == busy:
                _busy(BUSY_S)  # the compute thread is busy between issuing and consuming
            pending.wait()
            times = [None] * p
            dist.all_gather_object(times, (t_issue, time.monotonic()))
            attempts.append(times)
            if _late(times, busy) <= BOUND_S:
                break
        out.append(attempts)
    return out


def _late(times: list[tuple[float, float]], busy: int) -> float:
    """How long after the last rank's issue the slowest non-busy rank's wait ended."""
    last_issue = max(t[0] for t in times)
    return max(t[1] for r, t in enumerate(times) if r != busy) - last_issue


@pytest.mark.serial  # a 0.1 s bound: scripts/test.sh runs it with no other test beside it
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_busy_rank_does_not_delay_the_others(world_size):
    attempts = spawn(_measure, world_size, CASES, timeout_s=120)[0]  # every rank gathered the same times
    busy = world_size - 1
    late = []
    for case, tries in zip(CASES, attempts):
        for times in tries:  # the busy rank did wait out its sleep, so the test can tell
            assert times[busy][1] - times[busy][0] >= BUSY_S
        best = min(_late(times, busy) for times in tries)
        if best > BOUND_S:
            late.append(
                f"{case}: the other ranks' waits ended {[round(_late(t, busy), 3) for t in tries]} s "
                f"after the last issue (bound {BOUND_S} s, busy rank {busy} slept {BUSY_S} s)"
            )
    assert not late, "\n".join(late)


def test_the_check_fails_when_chains_run_in_wait():
    attempts = spawn(_measure, 2, CASES, True, 1, timeout_s=120)[0]
    for case, tries in zip(CASES, attempts):
        assert _late(tries[0], 1) > BUSY_S / 2, f"{case} looks overlapped although it ran in wait()"
