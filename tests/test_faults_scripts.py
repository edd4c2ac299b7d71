"""The long fault injections (scripts/fault_*.py), each a few real 2-process launches: marked slow.

pytest -m slow tests/test_faults_scripts.py      # ~2-3 min on a 2-core box
"""

import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, tmp_path, *args):
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", script),
            "--work",
            str(tmp_path / "w"),
            "--steps",
            "6",
            "--every",
            "2",
            "--seed",
            str(random.randrange(1000)),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    return out.returncode, out.stdout + out.stderr


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_loses_nothing(tmp_path):
    code, log = run("fault_checkpoint_kill.py", tmp_path)
    assert code == 0, log[-3000:]
    assert "killed during the write of step_00000004" in log and "latest = step_00000002" in log
    assert "final weights max |diff| = 0" in log


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_resume_matches_the_uninterrupted_run(tmp_path):
    kill_at = random.randrange(3, 6)
    code, log = run("fault_kill_resume.py", tmp_path, "--kill-at", str(kill_at))
    assert code == 0, log[-3000:]
    assert "identical to the uninterrupted run" in log
