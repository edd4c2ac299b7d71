"""The watchdog sees the device: a pass's end mark (a CUDA event on a GPU) is polled with `query()`, so a
device that hangs after the host moved on (the host runs ahead; `end_step` comes before the step's only
host wait) counts as a stall, named by the last pass the device finished and the one it is still on.

Emulated on CPU with marks that complete when the test says so (a fake device clock). Before device
marks were tracked, `stalled_for()` was 0 between steps and the report said only "between steps": these
failed."""

from __future__ import annotations

import time

from vp_accelerate.runtime.watchdog import Progress


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


def test_a_device_still_working_between_steps_counts_as_stalled_and_is_named():
    progress = Progress()
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
