"""scripts/gpu_check.py's plumbing on the CPU: the world-size-1 exact part (every schedule x method against
HF) at its tiny size, and a summary that names every part that did not run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
                               "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}, timeout=300)


def test_exact_part_at_world_size_1_and_the_summary(tmp_path):
    run = _run("--part", "exact", "--tiny", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    exact = json.loads((tmp_path / "exact.json").read_text())
    assert exact["status"] == "pass" and exact["backend"] == "gloo"
    assert len(exact["rows"]) == 9 and all(r["ok"] for r in exact["rows"])  # every schedule x method
    assert _run("--summarize", "--out", str(tmp_path)).returncode == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "| exact | pass | 9 schedule x method on gloo" in summary
    for part in ("selftest", "bf16", "output_layer", "share"):  # not run here: said so, with the reason
        assert f"| {part} | not run |" in summary and f"- {part}: no result" in summary
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"selftest", "exact", "bf16", "output_layer", "share"}
