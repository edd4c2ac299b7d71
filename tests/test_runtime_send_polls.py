"""The executor's poll of send-only p2p batches costs O(1) per pass, and drops exactly the completed ones.

Plain gloo's send Works report completion only once waited on, so every send batch of a step stays
pending until the step's end; the poll used to rescan all of them before every action (O(sends^2) a step,
~15 ms a step at 64 microbatches). These tests fail on that code: the first counts polls.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from vp_accelerate.runtime.executor import Executor


class _Batch:
    """A send batch that reports completion from poll number `done_after` on (never: None)."""

    polls = 0

    def __init__(self, done_after=None):
        self.done_after, self.seen, self.waited = done_after, 0, False

    def is_completed(self) -> bool:
        _Batch.polls += 1
        self.seen += 1
        return self.done_after is not None and self.seen >= self.done_after

    def wait(self) -> None:
        self.waited = True


class _Meter:
    def __init__(self):
        self.released = []

    def release_comm(self, key):
        self.released.append(key)


def _executor(batches):
    ex = Executor.__new__(Executor)  # only the step state is needed
    ex.state = SimpleNamespace(send_batches=deque(batches), meter=_Meter())
    return ex


def test_polls_stay_linear_when_sends_never_report_completion():
    """Plain gloo: 256 sends, one poll per pass between them -> at most one poll per pass (was n^2 / 2)."""
    _Batch.polls = 0
    ex = _executor([])
    n = 256
    for _ in range(n):
        ex.state.send_batches.append(_Batch(done_after=None))
        ex._drop_completed_sends()
    assert _Batch.polls <= n
    assert len(ex.state.send_batches) == n and ex.state.meter.released == []


def test_completed_batches_are_released_in_issue_order():
    """Batches that completed (in issue order, as on one stream) are waited on and their bytes released."""
    first, second, third = _Batch(done_after=1), _Batch(done_after=1), _Batch(done_after=None)
    ex = _executor([first, second, third])
    ex._drop_completed_sends()
    assert first.waited and second.waited and not third.waited
    assert ex.state.meter.released == [("p2p", id(first)), ("p2p", id(second))]
    assert list(ex.state.send_batches) == [third]
