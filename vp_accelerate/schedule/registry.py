"""The one list of schedule kinds and methods, and what each one implies.

Every other module asks these two tables instead of testing names: whether a method is
vocabulary-parallel, how many collective barriers it puts between the last chunk's F and B, which
output-layer algorithm it runs, whether its layer split comes from the cost model; which block a
schedule kind repeats, how many chunks a rank holds, whether it splits B from W, which methods it
supports. The recipe's allowed values and the command lines' choices are these tables' keys.

Adding a schedule is one block generator in blocks.py plus one `SCHEDULES` entry. Adding a
vocabulary pass or collective is one `VOCAB_ACTIONS` entry (when it runs, what it follows: deps.py
derives every rule from it) plus the executor's `_do_<op>` (docs/ARCHITECTURE.md, "A new pass").

Names are matched case-insensitively (`1F1B`, `Vocab-2`); `schedule_kind` / `method` return the
entry, `normalise_schedule` / `normalise_method` the canonical name, and an unknown name raises
ScheduleError (a ValueError) listing the valid names with a "did you mean".
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from vp_accelerate.lookup import lookup

from . import blocks
from .blocks import Block
from .ir import Op, ScheduleError


@dataclass(frozen=True)
class Method:
    """Where the vocabulary layers live and how the output layer synchronises."""

    name: str
    """Registry key."""
    vocab_parallel: bool
    """Vocabulary layers sharded over every pipeline rank (passes S/T/IF/IB, collectives C0/C1/C2);
    False: full embedding on chunk 0's owner, full output layer + loss on the last chunk's owner."""
    barriers: int
    """Collective barriers between the last chunk's F and B (0 without VP). One (vocab-2): S computes
    the input gradient and C1 all-reduces it with the softmax statistics. Two (vocab-1): T computes it
    and a second all-reduce, C2, completes it."""
    output_algorithm: str | None
    """The output-layer algorithm of vocab/output_layer.py this method runs; None without VP."""
    balanced_layers: bool
    """The default layer split comes from the cost model (fewer layers on the first and last stage,
    which also run the vocabulary layers) instead of an even split."""
    description: str
    """One line for help texts."""
    synchronous: bool = False
    """The vocabulary passes of a microbatch run on every rank in one synchronous step between the pipeline
    passes (the interlaced pipeline: the vocabulary layers tensor-parallel over the pipeline group), in the
    schedule's `synchronous_block`, instead of in gaps of the block placed around the pipeline passes."""

    def __str__(self) -> str:
        return self.name

    def __reduce__(self):  # pickles as its name: the unpickled entry is the registry's own object
        return method, (self.name,)

    @property
    def grad_barrier(self) -> Op | None:
        """The collective after which the last chunk's input gradient is complete (its B waits for it)."""
        return {0: None, 1: Op.C1, 2: Op.C2}[self.barriers]

    @property
    def input_grad_in_t(self) -> bool:
        """True when T (not S) computes the output layer's input gradient, reduced in C2."""
        return self.barriers == 2


@dataclass(frozen=True)
class ScheduleKind:
    """A pipeline schedule family: its repeating block and what it supports."""

    name: str
    """Registry key."""
    block: Callable[[int, int, int], Block]
    """(num_ranks, chunks_per_rank, backward_shift) -> the repeating block of blocks.py."""
    methods: tuple[str, ...]
    """Methods this schedule runs, in `METHODS` order."""
    chunks_per_rank: int | None
    """Model chunks per rank the schedule is built for; None: the user chooses (>= 1)."""
    default_chunks_per_rank: int
    """Chunks per rank when the user does not choose."""
    split_backward: bool
    """B computes only input gradients and W the weight gradients (zero-bubble style)."""
    forward_only: bool
    """Has an evaluation (forward-only) variant."""
    description: str
    """One line for help texts."""
    synchronous_block: Callable[[int], Block] | None = None
    """num_ranks -> the block of the synchronous methods (`Method.synchronous`): every period holds a
    vocabulary step all ranks run at one time; None: the schedule runs no synchronous method."""

    def __str__(self) -> str:
        return self.name

    def __reduce__(self):  # pickles as its name (its block is a lambda); unpickles to the registry's entry
        return schedule_kind, (self.name,)


@dataclass(frozen=True)
class VocabAction:
    """An action every rank runs once per microbatch in the vocabulary-parallel methods: a pass (S, T,
    IF, IB) or a collective (C0, C1, C2, IF_REDUCE, IB_BCAST). `schedule/deps.py` derives the rules of
    each from this entry: what it comes after, what a pass reads, after which passes a collective is
    issued, its root."""

    op: Op
    """Its op (an `ir.Op`, or another str enum member: the executor runs it with `_do_<value>`)."""
    follows: Op | None
    """The action of the same microbatch it comes after on every rank (a pass following a collective reads
    that collective's result); None: nothing of its microbatch on every rank."""
    training_only: bool = False
    """Only in a training step (it belongs to the backward)."""
    min_barriers: int = 1
    """Methods with at least this many collective barriers run it (C2: only vocab-1's two)."""
    root: str | None = None
    """Collectives with a root: "first" (the owner of chunk 0) or "last" (the owner of the last chunk)."""
    after_chunk: Op | None = None
    """A rooted collective issued after its root's pass of this op on the root's chunk (C0 after the
    last chunk's F, IB_BCAST after chunk 0's B)."""


VOCAB_ACTIONS: dict[Op, VocabAction] = {
    a.op: a
    for a in (
        VocabAction(Op.IF, follows=None),
        VocabAction(Op.IF_REDUCE, follows=Op.IF, root="first"),
        VocabAction(Op.C0, follows=None, root="last", after_chunk=Op.F),
        VocabAction(Op.S, follows=Op.C0),
        VocabAction(Op.C1, follows=Op.S),
        VocabAction(Op.T, follows=Op.C1, training_only=True),
        VocabAction(Op.C2, follows=Op.T, training_only=True, min_barriers=2),
        VocabAction(Op.IB_BCAST, follows=None, training_only=True, root="first", after_chunk=Op.B),
        VocabAction(Op.IB, follows=Op.IB_BCAST, training_only=True),
    )
}
"""Every vocabulary action, keyed by op (the order of the table does not matter)."""


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "baseline",
            vocab_parallel=False,
            barriers=0,
            output_algorithm=None,
            balanced_layers=False,
            description="embedding on the first stage, output layer + loss on the last",
        ),
        Method(
            "redis",
            vocab_parallel=False,
            barriers=0,
            output_algorithm=None,
            balanced_layers=True,
            description="baseline with the layers redistributed by the cost model",
        ),
        Method(
            "vocab-1",
            vocab_parallel=True,
            barriers=2,
            output_algorithm="vocab-1",
            balanced_layers=False,
            description="vocabulary parallel, two barriers (input gradient in T, reduced in C2)",
        ),
        Method(
            "vocab-2",
            vocab_parallel=True,
            barriers=1,
            output_algorithm="vocab-2",
            balanced_layers=False,
            description="vocabulary parallel, one barrier (input gradient in S, reduced in C1)",
        ),
        Method(
            "interlaced",
            vocab_parallel=True,
            barriers=2,
            output_algorithm="vocab-1",
            balanced_layers=False,
            synchronous=True,
            description="the paper's interlaced baseline: vocabulary layers tensor-parallel, run synchronously",
        ),
    )
}

SCHEDULES: dict[str, ScheduleKind] = {
    k.name: k
    for k in (
        ScheduleKind(
            "1f1b",
            lambda p, v, shift: blocks.one_f_one_b(p, shift),
            methods=("baseline", "redis", "vocab-1", "vocab-2", "interlaced"),
            chunks_per_rank=1,
            default_chunks_per_rank=1,
            split_backward=False,
            forward_only=True,
            description="one chunk per rank, one forward one backward",
            synchronous_block=blocks.one_f_one_b_synchronous,
        ),
        ScheduleKind(
            "vhalf",
            lambda p, v, shift: blocks.v_half(p, shift),
            methods=("baseline", "vocab-1", "vocab-2"),
            chunks_per_rank=2,
            default_chunks_per_rank=2,
            split_backward=True,
            forward_only=True,
            description="zero-bubble V shape, two chunks per rank, B/W split",
        ),
        ScheduleKind(
            "interleaved",
            lambda p, v, shift: blocks.interleaved(p, v, shift),
            methods=("baseline", "vocab-2"),
            chunks_per_rank=None,
            default_chunks_per_rank=2,
            split_backward=False,
            forward_only=True,
            description="interleaved 1F1B, chunks round-robin over the ranks",
        ),
    )
}


def schedule_kind(name: str) -> ScheduleKind:
    """The registered schedule kind called `name` (any case); ScheduleError if there is none."""
    return lookup(SCHEDULES, name, ScheduleError, f"unknown schedule kind {name!r}")


def method(name: str) -> Method:
    """The registered method called `name` (any case); ScheduleError if there is none."""
    return lookup(METHODS, name, ScheduleError, f"unknown method {name!r}")


def normalise_schedule(name: str) -> str:
    """The canonical (registry) spelling of schedule kind `name`."""
    return schedule_kind(name).name


def normalise_method(name: str) -> str:
    """The canonical (registry) spelling of method `name`."""
    return method(name).name


def supported_pairs() -> list[tuple[str, str]]:
    """Every (schedule kind, method) the builder accepts."""
    return [(k, m) for k, kind in SCHEDULES.items() for m in kind.methods]


def check_pair(kind: str, method_name: str) -> tuple[ScheduleKind, Method]:
    """Both entries, or ScheduleError when the schedule does not run the method."""
    k, m = schedule_kind(kind), method(method_name)
    if m.name not in k.methods:
        others = [s for s, sk in SCHEDULES.items() if m.name in sk.methods]
        raise ScheduleError(
            f"schedule {k.name!r} does not support method {m.name!r}; it supports "
            f"{', '.join(k.methods)} (use {' or '.join(others)} for {m.name})"
        )
    return k, m


def argparse_type(normalise: Callable[[str], str]) -> Callable[[str], str]:
    """An argparse `type=` that accepts any case and reports an unknown name with the valid ones."""

    def parse(text: str) -> str:
        try:
            return normalise(text)
        except ScheduleError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = normalise.__name__
    return parse
