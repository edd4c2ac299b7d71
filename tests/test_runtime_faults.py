"""No hang: when one rank raises or is killed mid-step, every rank exits non-zero within bounded time.

Launched like torchrun / accelerate would (separate processes, env rendezvous; forked from the preloaded
fork server by `forked_ranks`, tests/helpers/launch.py), not through `spawn`, which would tear the peers
down itself and hide a hang. The ranks run a bare `PipelineModel`
loop (scripts/fault_worker.py --pipeline); the failing rank raises, or SIGKILLs itself, in its forward
of microbatch 1 at step 2, with its peer blocked on it.
"""

import json
import time
from pathlib import Path

import pytest

from helpers.launch import forked_ranks

WORKER = Path(__file__).parent.parent / "scripts" / "fault_worker.py"


def _launch(mode: str, fail_rank: int, timeout_s: float = 120.0):
    start = time.monotonic()
    fault = json.dumps({"fail": {"step": 2, "rank": fail_rank, "how": mode}})
    outs = forked_ranks(str(WORKER), ["--pipeline"], 2, {"VP_FAULT": fault}, timeout_s)
    if outs is None:
        pytest.fail(f"rank hung for more than {timeout_s} s after rank {fail_rank} failed ({mode})")
    return outs, time.monotonic() - start


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_rank_that_raises_stops_every_rank(fail_rank):
    outs, _ = _launch("raise", fail_rank)
    for rank, (code, out, err) in enumerate(outs):
        assert code != 0, f"rank {rank} exited 0\n{out}\n{err}"
        assert "finished" not in out
    other = outs[1 - fail_rank][2]
    assert (
        f"rank {fail_rank}: RuntimeError: injected failure" in other
        or "Connection closed" in other
        or "Connection reset" in other
    ), other[-2000:]


def test_a_killed_rank_stops_every_rank():
    outs, _ = _launch("kill", 1)
    assert outs[1][0] != 0
    code, out, err = outs[0]
    assert code != 0, f"rank 0 exited 0\n{out}\n{err}"
    # the survivor says it in the watchdog's one line (before: gloo's "Connection reset by peer" traceback)
    assert "[vp-accelerate] rank 0 stops: a peer's connection closed in the middle of a step" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_stalled_rank_is_reported_with_every_rank_pass_and_the_job_ends():
    # rank 1 sleeps inside F(mb=1) of step 2 (a hang, nothing raises, its heartbeat goes on); rank 0 waits
    # for its activation. After 2 s without a finished pass the watchdog prints where every rank is.
    fault = json.dumps({"stall": {"step": 2, "rank": 1, "seconds": 120}, "watchdog_stall_s": 2})
    outs = forked_ranks(str(WORKER), ["--pipeline"], 2, {"VP_FAULT": fault}, 90.0)
    assert outs is not None, "the stall was not detected: a rank still ran after 90 s"
    for rank, (code, out, err) in enumerate(outs):
        assert code != 0, f"rank {rank} exited 0\n{out}\n{err}"
        assert "finished" not in out
    text = outs[0][2] + outs[1][2]
    assert "no pass finished for" in text, text[-3000:]
    # the stalled rank computes inside its pass (rank 1 holds chunk 1); its peer waits in a pass for the
    # collective rank 1 never joins
    assert "rank 1: in F(mb=1, chunk=1), computing" in text, text[-3000:]
    assert "rank 0: in " in text and ", waits for " in text, text[-3000:]


def test_a_rank_stuck_at_the_step_end_is_reported_by_every_rank():
    # pp 1 x dp 2: rank 1 sleeps in DPReducer.finish at step 2, after the schedule's last pass (before: no
    # watchdog line at all, every rank silent until the sleep or the group's timeout ended)
    fault = json.dumps({"stall_end": {"step": 2, "rank": 1, "seconds": 120}, "watchdog_stall_s": 2, "dp_size": 2})
    outs = forked_ranks(str(WORKER), ["--pipeline"], 2, {"VP_FAULT": fault}, 90.0)
    assert outs is not None, "the stall at the step's end was not detected: a rank still ran after 90 s"
    for rank, (code, out, err) in enumerate(outs):
        assert code != 0, f"rank {rank} exited 0\n{out}\n{err}"
        assert "finished" not in out
    text = outs[0][2] + outs[1][2]
    assert "no pass finished for" in text, text[-3000:]
    # the sleeping rank is in the step's end; its peer waits in a labelled collective of the step's end
    assert "rank 1: between steps" in text or "rank 1: in the step's end" in text, text[-3000:]
    assert "rank 0: in the step's end: " in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def test_a_rank_that_raises_between_steps_stops_its_peer_with_one_line():
    # rank 1 raises after its train_step of step 2; rank 0 enters the clip norm's all-reduce, whose connection
    # then closes: one line, not gloo's traceback (before: 'Connection closed by peer' traceback)
    fault = json.dumps({"fail_between": {"step": 2, "rank": 1}, "clip": True})
    outs = forked_ranks(str(WORKER), ["--pipeline"], 2, {"VP_FAULT": fault}, 90.0)
    assert outs is not None, "rank 0 hung after its peer failed between steps"
    code, out, err = outs[0]
    assert code != 0, f"rank 0 exited 0\n{out}\n{err}"
    assert "[vp-accelerate] rank 0 stops: " in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "injected failure between steps" in outs[1][2]
