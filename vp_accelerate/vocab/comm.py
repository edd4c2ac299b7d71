"""Collective helpers of the vocabulary layers: a `Pending` handle and group-rank addressing.

Every collective entry point (C0, C1, C2, IF reduce, IB broadcast) returns a `Pending`. With
`async_op=False` it is already complete; otherwise the caller may run other work and call `wait()`,
which waits for the issued collectives and then runs the step's finalization (which may itself issue
the dependent rest of the step's collectives, e.g. C1's sums need C1's max first).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.distributed as dist


class Pending:
    """Handle of collectives in flight; `wait()` completes them and returns the step's result."""

    def __init__(self, works: Sequence[Any] = (), finalize: Callable[[], Any] | None = None):
        self._works = [w for w in works if w is not None]
        self._finalize = finalize
        self._done = False
        self._result: Any = None

    @property
    def done(self) -> bool:
        """True once `wait()` has run (always true for a synchronous call)."""
        return self._done

    def wait(self) -> Any:
        """Wait for the collectives, finalize the state once, and return the result (idempotent)."""
        if not self._done:
            for w in self._works:
                w.wait()
            self._works = []
            if self._finalize is not None:
                self._result = self._finalize()
                self._finalize = None
            self._done = True
        return self._result


def finish(pending: Pending, async_op: bool) -> Pending:
    """Complete `pending` now unless the caller asked for an asynchronous op."""
    if not async_op:
        pending.wait()
    return pending


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (torch's src/dst arguments want global ranks)."""
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)

