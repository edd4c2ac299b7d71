"""`bench --against REF` (bench/against.py): the worktree, each side's import path, the round-robin order
and the ratios. Cheap: no benchmark process runs here (run_side is replaced); a real run is recorded in
docs/benchmarks.md. These tests fail before --against existed (the module did not)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from vp_accelerate.bench import against
from vp_accelerate.bench.config import BenchConfig
from vp_accelerate.bench.run import bench_main

pytestmark = pytest.mark.skipif(
    subprocess.run(["git", "-C", str(against.PACKAGE_ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0,
    reason="--against needs a git checkout (this tree is not one)",
)


def _worktrees() -> str:
    return subprocess.run(
        ["git", "-C", str(against.PACKAGE_ROOT), "worktree", "list"], capture_output=True, text=True
    ).stdout


def test_ref_checkout_is_a_worktree_removed_afterwards():
    with against.ref_checkout("HEAD") as (path, commit):
        assert (path / "vp_accelerate" / "bench").is_dir() and len(commit) == 40
        assert str(path) in _worktrees()
    assert not path.exists() and str(path) not in _worktrees()


def test_unknown_ref_is_one_line_and_exit_2(capsys):
    assert bench_main(["--against", "no-such-ref-xyz", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no-such-ref-xyz" in err and "no such commit" in err


def test_each_side_imports_its_own_code_first(monkeypatch, tmp_path):
    (tmp_path / "vp_accelerate").mkdir()
    monkeypatch.setenv("PYTHONPATH", f"{against.PACKAGE_ROOT}:/some/other/dir")
    parts = against.side_env(tmp_path)["PYTHONPATH"].split(":")
    assert parts == [str(tmp_path), "/some/other/dir"]  # this checkout dropped: REF's ranks import REF


def test_round_robin_order_and_ratios(monkeypatch):
    order = []
    speed = {"current": iter([100.0, 120.0, 110.0]), "ref": iter([100.0, 100.0, 100.0])}

    def fake_run_side(root, cfg, method, workdir, label):
        side = label.split("-")[0]
        order.append((label.rsplit("-", 1)[1], method, side))
        tps = next(speed[side]) if method == "m1" else 50.0
        return [{"vocab": 1024, "method": method, "tokens_per_s": tps, "loss": 1.0}]

    monkeypatch.setattr(against, "run_side", fake_run_side)
    cfg = BenchConfig(vocabs=(1024,), methods=("m1", "m2"))
    rows = against.compare(cfg, Path("/ref"), rounds=3)
    assert order[:4] == [("0", "m1", "current"), ("0", "m1", "ref"), ("0", "m2", "current"), ("0", "m2", "ref")]
    assert len(order) == 12
    m1 = next(r for r in rows if r.method == "m1")
    assert m1.ratio == pytest.approx(1.1) and (m1.ratio_min, m1.ratio_max) == pytest.approx((1.0, 1.2))
    assert "1.100x" in against.comparison_table(rows, "REF")
