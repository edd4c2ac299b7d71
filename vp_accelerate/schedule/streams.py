"""NCCL's rules for the replay driver (`replay.py`), and the check that a schedule finishes under them.

The model (what a GPU launch does with each rank's action list, issued in order by a host that never
blocks):
- compute passes run in order on the rank's compute stream; a pass waits for the communication it
  consumes (its receive's batch, the collective whose result it reads);
- a p2p batch (`ir.p2p_batches`: adjacent p2p actions, one `batch_isend_irecv`) and a collective chain
  start once the compute issued before them is done (torch makes the communicator's stream wait on
  the current stream at issue) and once the previous operation of their communicator is done (one
  stream per communicator: the pipeline's p2p, the vocabulary collectives);
- rendezvous: a send completes only when the peer's matching receive has been posted (its batch has
  started) — true for every message larger than NCCL's internal buffers, as activations are — and a
  batch completes when all its ops have; a collective completes once every rank has started it.
- `serialized=True` adds the rule of `CUDA_DEVICE_MAX_CONNECTIONS=1`: the operations of all
  communicators of a rank start in issue order, one after the other.

- communicators: the runtime connects the pipeline's and the vocabulary's before step 1
  (runtime.groups.warm_up), so the replay starts with both (`WARMED_UP`); `replay_streams(s,
  connected=frozenset())` models NCCL's lazy creation instead (`Rules.connected`), which rejects every
  order that uses two communicators: the second would be created while the first one's operations may
  still run.

Messages on one sender->receiver channel match in issue order. `replay_streams` raises ScheduleError on
a mismatch or a deadlock, naming each rank's blocked operation and what it waits for. The replay has no
clock: it decides whether the lists finish, not how long they take.
"""

from __future__ import annotations

import dataclasses

from .ir import Schedule
from .replay import Rules, replay

WARMED_UP = frozenset({"pp", "vocab"})
"""The communicators runtime.groups.warm_up connects before the first step."""

_NCCL = "NCCL semantics (sends complete when the peer's receive is posted, p2p batches complete in issue order, "
NCCL = Rules(
    _NCCL + "one stream per communicator)", rendezvous=True, queues="communicator", batches=True, connected=WARMED_UP
)
"""NCCL with one stream per communicator (the pipeline's p2p, the vocabulary collectives)."""
NCCL_SERIALIZED = Rules(
    _NCCL + "all communicators serialised (CUDA_DEVICE_MAX_CONNECTIONS=1))",
    rendezvous=True,
    queues="rank",
    batches=True,
    connected=WARMED_UP,
)
"""NCCL with every communicator of a rank in one issue order (one hardware connection)."""


def replay_streams(s: Schedule, serialized: bool = False, connected: frozenset = WARMED_UP) -> None:
    """Replay `s` under NCCL's stream semantics (module docstring); raise ScheduleError on a deadlock.
    `connected`: the communicators that exist before the step (the others are created lazily)."""
    rules = NCCL_SERIALIZED if serialized else NCCL
    if connected != rules.connected:
        rules = dataclasses.replace(rules, name=rules.name + ", communicators created lazily", connected=connected)
    replay(s, rules)
