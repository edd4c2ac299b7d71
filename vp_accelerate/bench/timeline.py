"""Measured pass timelines and what is derived from them: busy time, bubble rate, the balanced bound."""

from __future__ import annotations

import dataclasses

from vp_accelerate.schedule.ir import TimedAction as Pass  # the timeline record shared with sim and runtime
from vp_accelerate.schedule.registry import schedule_kind


def shift(passes: list[Pass], t0: float) -> list[Pass]:
    """The passes with times relative to t0 (the step's start)."""
    return [dataclasses.replace(p, start=p.start - t0, end=p.end - t0) for p in passes]


def busy_s(passes: list[Pass]) -> float:
    """Total compute time of the passes (communication waits are the gaps between them)."""
    return sum(p.end - p.start for p in passes)


def bubble_rate(passes: list[Pass], num_ranks: int, step_s: float) -> float:
    """Fraction of rank-time not spent in a compute pass: 1 - sum(busy) / (p * step time)."""
    if step_s <= 0:
        return 0.0
    return max(0.0, 1.0 - busy_s(passes) / (num_ranks * step_s))


def ramp_fraction(schedule: str, num_ranks: int, microbatches: int) -> float:
    """The unavoidable warm-up + cool-down of a perfectly balanced schedule, as a fraction of per-rank work.

    1F1B with p equal stages and m microbatches takes (m + p - 1) pass-pairs, of which m are work:
    the ramp is (p - 1) / m. V-Half runs two half-size chunks per rank, so its ramp is counted in
    half-size passes: (p - 1) / (2m). (Zero-bubble schedules fill part of this with W passes; we keep
    the 1F1B-style ramp as the bound so it stays a bound no method could beat by scheduling alone.)
    """
    kind = schedule_kind(schedule)
    if kind.split_backward:  # zero-bubble style: the ramp is counted in the kind's smaller chunks
        return (num_ranks - 1) / (kind.default_chunks_per_rank * microbatches)
    return (num_ranks - 1) / microbatches


def balanced_bound_s(passes: list[Pass], num_ranks: int, microbatches: int, schedule: str) -> float:
    """Step time if the measured work were spread evenly over the ranks, plus the schedule's ramp.

    total measured pass time / p, times (1 + ramp). Efficiency = bound / measured step time.
    """
    per_rank = busy_s(passes) / num_ranks
    return per_rank * (1.0 + ramp_fraction(schedule, num_ranks, microbatches))
