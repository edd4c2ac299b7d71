"""Schedules as data: the IR, the generators and the validator."""

from .build import SUPPORTED, build_schedule
from .ir import (COLLECTIVES, KINDS, METHODS, P2P, Action, Op, Schedule, ScheduleError, TimedAction)
from .validate import validate

__all__ = ["Action", "Op", "Schedule", "ScheduleError", "TimedAction", "build_schedule", "validate", "SUPPORTED",
           "KINDS", "METHODS", "COLLECTIVES", "P2P"]
