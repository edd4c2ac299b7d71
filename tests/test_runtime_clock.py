"""A step's times come from its clock (runtime/clock.py): on a GPU CUDA events, read once after the loss.

No GPU here, so a fake device clock stands in for the CUDA one: its marks are ticks of a counter (one
"second" each), nothing like the host's time. The step time, the bubble rate, the per-pass times,
tokens/s and the timeline must all be the fake clock's, on every rank.
"""

from __future__ import annotations

import torch

from vp_accelerate.distributed import spawn
from vp_accelerate.runtime.clock import StepTimes
from vp_accelerate.schedule.ir import COMPUTE_OPS, TimedAction


class FakeDeviceClock:
    """Marks are ticks: every mark is one tick after the previous one; a chain runs for 3 ticks."""

    def __init__(self) -> None:
        self.tick, self.spans, self.chains, self.reads = 0, [], [], 0

    def start(self) -> None:
        self.tick, self.spans, self.chains = 0, [], []

    def mark(self) -> int:
        self.tick += 1
        return self.tick

    def span(self, op, mb, chunk, begin, end) -> None:
        self.spans.append(TimedAction(0, op, mb, chunk, float(begin), float(end)))

    def chain(self, op, mb, timer) -> None:
        begin = self.mark()
        self.chains.append(TimedAction(0, op, mb, 0, float(begin), float(begin + 3), lane="comm"))

    def stop(self) -> None:
        self.end = self.mark()

    def read(self, rank: int) -> StepTimes:
        self.reads += 1
        records = [TimedAction(rank, r.op, r.mb, r.chunk, r.start, r.end, r.lane) for r in self.spans + self.chains]
        return StepTimes(records, float(self.end))


def _step_on_fake_clock():
    from transformers import LlamaConfig

    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    config = LlamaConfig(
        vocab_size=67, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    pipe = PipelineModel(config, PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=4))
    clocks = []
    pipe.make_clock = lambda device: clocks.append(FakeDeviceClock()) or clocks[-1]
    ids = torch.randint(0, 67, (4, 8), generator=torch.Generator().manual_seed(0))
    res = pipe.train_step(ids, ids)
    stats = pipe.stats()
    pipe.close()
    return res, stats["timeline"], stats["pass_time_s"], [c.reads for c in clocks]


def test_step_times_bubble_and_timeline_come_from_the_clock():
    results = spawn(_step_on_fake_clock, 2)
    rates = []
    for res, timeline, pass_time, reads in results:
        assert reads == [1]  # one clock per step, read once
        ticks = sorted({t for r in timeline for t in (r.start, r.end)})
        assert all(t == int(t) for t in ticks)  # every time is a tick of the fake clock, none the host's
        assert {r.op for r in timeline if r.lane == "compute"} >= {"F", "B", "S", "T", "IF", "IB"}
        assert any(r.lane == "comm" and r.op == "C1" and r.end - r.start == 3 for r in timeline)
        busy = sum(r.end - r.start for r in timeline if r.op in COMPUTE_OPS)
        assert pass_time == busy
        assert res.step_time_s == max(ticks) + 1  # the stop mark comes after the last pass's
        assert res.tokens_per_s == res.num_tokens / res.step_time_s
        rates.append(1 - busy / res.step_time_s)
    for res, *_ in results:
        assert abs(res.bubble_rate - sum(rates) / len(rates)) < 1e-12  # the mean over the pipeline's ranks


class _FakeEvent:
    """torch.cuda.Event's surface: recorded on a stream at its current time (ms); elapsed_time only
    between completed events, as CUDA requires."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing  # a mark without timing cannot be read
        self.ms, self.stream, self.synced = None, None, False

    def record(self, stream) -> None:
        self.ms, self.stream = stream.now_ms, stream

    def synchronize(self) -> None:
        self.stream.completed_ms = max(self.stream.completed_ms, self.ms)

    def elapsed_time(self, end: "_FakeEvent") -> float:
        for e in (self, end):
            assert e.ms <= e.stream.completed_ms, "elapsed_time of an event the host has not waited for"
        return end.ms - self.ms


class _FakeStream:
    def __init__(self) -> None:
        self.now_ms, self.completed_ms = 0.0, -1.0


def test_the_cuda_clock_reads_events_once_synchronised(monkeypatch):
    from vp_accelerate.runtime import clock

    compute, comm = _FakeStream(), _FakeStream()
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    c = clock.for_device(torch.device("cuda", 0))
    assert isinstance(c, clock.CudaClock)
    compute.now_ms = 1000.0
    c.start()
    compute.now_ms = 1250.0  # the host queued F at once; the device ran it 250 ms later
    begin = c.mark()
    compute.now_ms = 1750.0
    c.span("F", 0, 0, begin, c.mark())
    chain = (_FakeEvent(True), _FakeEvent(True))  # what a _StreamJob recorded on the communication stream
    comm.now_ms = 1300.0
    chain[0].record(comm)
    comm.now_ms = 1400.0
    chain[1].record(comm)
    c.chain("C1", 0, type("Timer", (), {"span": lambda self: chain})())
    compute.now_ms = 2000.0
    c.stop()
    times = c.read(rank=3)
    assert times.step_time_s == 1.0
    assert [(r.op, r.lane, r.start, r.end, r.rank) for r in times.records] == [
        ("F", "compute", 0.25, 0.75, 3),
        ("C1", "comm", 0.3, 0.4, 3),
    ]
