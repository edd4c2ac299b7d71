"""The watchdog sees the device: a pass's end mark (a CUDA event on a GPU) is polled with `query()`, so a
device that hangs after the host moved on (the host runs ahead; `end_step` comes before the step's only
host wait) counts as a stall, named by the last pass the device finished and the one it is still on.

Emulated on CPU with marks that complete when the test says so (a fake device clock). Before device
marks were tracked, `stalled_for()` was 0 between steps and the report said only "between steps": these
failed."""

from __future__ import annotations

import threading
import time

from vp_accelerate.runtime.watchdog import Progress, Watchdog


class _Mark:
    """A fake device event: complete once the test sets `done`."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def _run_passes(progress: Progress, names: list[str]) -> list[_Mark]:
    marks = []
    progress.begin_step()
    for name in names:
        progress.enter(name)
        marks.append(_Mark())
        progress.finished(marks[-1])
    progress.end_step()  # the host is done; the device is not
    return marks


def _watched() -> Progress:
    progress = Progress()
    progress.track_device = True  # as the watchdog's own Progress (its thread retires the marks)
    return progress


def test_a_device_still_working_between_steps_counts_as_stalled_and_is_named():
    progress = _watched()
    marks = _run_passes(progress, ["F(mb=0, chunk=0)", "B(mb=0, chunk=0)", "S(mb=0)"])
    marks[0].done = True  # the device finished the first pass, then hangs in the second
    time.sleep(0.02)
    assert progress.stalled_for() > 0  # 0 before: "between steps" hid the device
    text = progress.describe()
    assert text.startswith("between steps (3 passes done)")
    assert "device: last finished F(mb=0, chunk=0), still on B(mb=0, chunk=0)" in text
    before = progress.device_done
    for m in marks:
        m.done = True
    assert progress.stalled_for() == 0.0  # the device caught up: idle between steps, not stalled
    assert progress.device_done == before + 2
    assert "device" not in progress.describe()


def test_host_marks_are_not_tracked_and_an_idle_rank_is_never_stalled():
    progress = Progress()
    progress.begin_step()
    progress.enter("F(mb=0, chunk=0)")
    progress.finished(time.perf_counter())  # the host clock's mark: the host is the device
    progress.end_step()
    assert progress.stalled_for() == 0.0
    assert not progress.device_busy()


def test_without_a_watchdog_no_device_mark_is_kept():
    # an executor's own Progress (one rank, `watchdog_dead_after_s: null`, or after close()): nobody polls,
    # so a kept mark (a CUDA event per pass) would live as long as the process (before: 40 more per step)
    progress = Progress()
    for _ in range(10):
        _run_passes(progress, ["F(mb=0, chunk=0)", "B(mb=0, chunk=0)", "S(mb=0)", "T(mb=0)"])
    assert not progress.device_pending
    assert progress.passes_done == 40


def test_a_stopped_watchdog_keeps_no_mark():
    dog = Watchdog.__new__(Watchdog)  # stop() alone: its thread, store and flags as a started one holds them
    dog._stop, dog.interval_s, dog.progress = threading.Event(), 0.01, _watched()
    dog._thread, dog.store, dog.key, dog.rank = threading.Thread(target=lambda: None), _NoStore(), "k", 0
    dog._thread.start()
    _run_passes(dog.progress, ["F(mb=0, chunk=0)"])
    assert dog.progress.device_pending
    dog.stop()
    assert not dog.progress.device_pending
    _run_passes(dog.progress, ["F(mb=1, chunk=0)"])
    assert not dog.progress.device_pending


class _NoStore:
    def set(self, key, value) -> None:
        pass


def test_a_labelled_wait_after_the_step_is_a_pass_the_watchdog_times():
    # the step's end (a DP bucket, the loss sum): before, stalled_for() was 0 outside a step, so a rank stuck
    # there was never reported
    progress = _watched()
    _run_passes(progress, ["F(mb=0, chunk=0)"])[0].done = True
    own = progress.begin_wait("DP bucket 2/3")
    time.sleep(0.02)
    assert progress.stalled_for() > 0
    assert progress.describe().startswith("in the step's end: DP bucket 2/3, waits for its peers")
    mark = _Mark()
    progress.end_wait(own, mark)  # the host is past it (NCCL's wait); the device is not
    assert progress.stalled_for() > 0 and "still on DP bucket 2/3" in progress.describe()
    mark.done = True
    assert progress.stalled_for() == 0.0 and progress.passes_done == 2


def test_a_labelled_wait_inside_a_pass_is_what_the_pass_waits_for():
    progress = _watched()
    progress.begin_step()
    progress.enter("S(mb=0)")
    own = progress.begin_wait("valid-token count")
    assert progress.describe().startswith("in S(mb=0), waits for valid-token count")
    progress.end_wait(own)
    assert progress.current == "S(mb=0)" and progress.passes_done == 0
