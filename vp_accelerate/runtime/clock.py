"""Where a step's times come from: one interface, the host's clock on CPU, CUDA events on GPU.

The executor marks the start and end of every pass (and of every WAIT, every p2p batch post) on the
compute lane, and hands the clock every collective chain it issues (the "comm" lane). Nothing is turned
into seconds until `read()`, which `PipelineModel.train_step` calls ONCE per step, after the loss (which
already synchronised the host with the device): on a GPU a mark is a CUDA event recorded on the stream
that runs the work, so pass times, step time and bubble rate are what the device did, not when the host
queued it, and measuring costs no host synchronisation inside the step.

- `HostClock`: a mark is `time.perf_counter()`; a chain's span is when the communication worker thread
  ran it (vocab/comm.py). On CPU the host is the device, so this is exact.
- `CudaClock`: a mark is a timing-enabled CUDA event recorded on the current stream; a chain's span is
  the pair of events its `_StreamJob` recorded on the communication stream around it. Times are
  `start.elapsed_time(mark)` (milliseconds between two events of one device, across streams).

A test can put any object with these methods in place (`PipelineModel.make_clock`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vp_accelerate.schedule.ir import TimedAction


@dataclass
class StepTimes:
    """What a clock read: the step's timeline and its duration, in seconds from the step's start."""

    records: list[TimedAction] = field(default_factory=list)
    step_time_s: float = 0.0


class Clock(Protocol):
    def start(self) -> None:
        """The step begins now (call before its first pass)."""

    def mark(self) -> Any:
        """A point in time on the compute lane (opaque until `read`)."""

    def span(self, op: str, mb: int, chunk: int, begin: Any, end: Any) -> None:
        """Record that `op` ran on the compute lane from mark `begin` to mark `end`."""

    def chain(self, op: str, mb: int, timer: Any) -> None:
        """Record a collective chain (its `Pending.timer`: `.span()` gives its two marks)."""

    def stop(self) -> None:
        """The step's work ends now (after the last gradient reduction)."""

    def read(self, rank: int) -> StepTimes:
        """Every record in seconds from `start`, and the step time; once per step, after the loss."""


class _Recorder:
    """What both clocks share: the records in their own marks, turned into seconds by `_seconds`."""

    def __init__(self) -> None:
        self._t0: Any = None
        self._end: Any = None
        self._spans: list[tuple[str, int, int, Any, Any]] = []
        self._chains: list[tuple[str, int, Any]] = []

    def span(self, op: str, mb: int, chunk: int, begin: Any, end: Any) -> None:
        self._spans.append((op, mb, chunk, begin, end))

    def chain(self, op: str, mb: int, timer: Any) -> None:
        if timer is not None:
            self._chains.append((op, mb, timer))

    def start(self) -> None:
        self._spans, self._chains, self._end = [], [], None
        self._t0 = self.mark()

    def stop(self) -> None:
        self._end = self.mark()

    def read(self, rank: int) -> StepTimes:
        if self._end is None:  # never stopped: the step ends now
            self.stop()
        self._sync()
        sec = self._seconds
        records = [TimedAction(rank, op, mb, chunk, sec(b), sec(e)) for op, mb, chunk, b, e in self._spans]
        for op, mb, timer in self._chains:  # the chains as the communication lane ran them
            b, e = timer.span()
            records.append(TimedAction(rank, op, mb, 0, sec(b), sec(e), lane="comm"))
        out = StepTimes(records, sec(self._end))
        self._spans, self._chains = [], []  # the marks (events) go with the step
        return out

    def mark(self) -> Any:  # pragma: no cover - each clock has its own
        raise NotImplementedError

    def _sync(self) -> None:
        pass

    def _seconds(self, mark: Any) -> float:  # pragma: no cover
        raise NotImplementedError


class HostClock(_Recorder):
    """The host's `time.perf_counter()` (CPU: the host does the work)."""

    def mark(self) -> float:
        return time.perf_counter()

    def _seconds(self, mark: float) -> float:
        return mark - self._t0


class CudaClock(_Recorder):
    """CUDA events on the stream current when marked (the compute stream; chains bring their own)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _sync(self) -> None:
        # the end mark is the latest work of the compute stream, so every mark before it on that stream
        # is complete; a chain's events are on the communication stream: synchronised on their own
        self._end.synchronize()
        for _, _, timer in self._chains:
            timer.span()[1].synchronize()

    def _seconds(self, mark: torch.cuda.Event) -> float:
        return self._t0.elapsed_time(mark) / 1e3


def for_device(device: torch.device) -> Clock:
    """The clock of a step on `device`: CUDA events on a GPU, the host's clock elsewhere."""
    return CudaClock(device) if device.type == "cuda" else HostClock()
