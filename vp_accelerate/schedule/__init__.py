"""Schedules as data: the IR, the registry of kinds and methods, the generators and the validator."""

from .build import build_schedule
from .ir import COLLECTIVES, COMPUTE_OPS, P2P, Action, Op, Schedule, ScheduleError, TimedAction
from .registry import (
    METHODS,
    SCHEDULES,
    Method,
    ScheduleKind,
    method,
    normalise_method,
    normalise_schedule,
    schedule_kind,
    supported_pairs,
)
from .validate import validate

__all__ = [
    "Action",
    "Op",
    "Schedule",
    "ScheduleError",
    "TimedAction",
    "build_schedule",
    "validate",
    "METHODS",
    "SCHEDULES",
    "Method",
    "ScheduleKind",
    "method",
    "schedule_kind",
    "normalise_method",
    "normalise_schedule",
    "supported_pairs",
    "COLLECTIVES",
    "COMPUTE_OPS",
    "P2P",
]
