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
