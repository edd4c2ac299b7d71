"""The benchmark harness: `vp-accelerate bench` end to end with the real runtime at tiny sizes, and the
aggregation of per-rank records into rows."""

import json

import pytest

from vp_accelerate import cli
from vp_accelerate.bench.config import BenchConfig
from vp_accelerate.bench.report import build_rows, markdown_table
from vp_accelerate.bench.timeline import Pass, balanced_bound_s, bubble_rate
from vp_accelerate.bench.worker import MemoryRecord, StepRecord
from vp_accelerate.schedule.ir import COMPUTE_OPS

METHODS = ("peer", "1f1b-baseline", "1f1b-vocab-2", "vhalf-vocab-2")


def test_bench_command_with_the_runtime(tmp_path, capsys):
    """One spawn of 2 ranks runs the peer and our runtime (1F1B and V-Half, with and without VP)."""
    out = tmp_path / "rows.json"
    rc = cli.main(
        [
            "bench",
            "--hidden",
            "32",
            "--layers",
            "4",
            "--heads",
            "2",
            "--seq",
            "16",
            "--microbatches",
            "4",
            "--vocabs",
            "300",
            "--warmup",
            "0",
            "--steps",
            "2",
            "--strict",
            "--methods",
            *METHODS,
            "--json",
            str(out),
            "--plots",
            str(tmp_path),
        ]
    )
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == list(METHODS)
    peer = rows[0]
    compute = set(COMPUTE_OPS)
    for r in rows:
        name = r["method"]
        assert r["vocab"] == 300 and r["tokens_per_s"] > 0 and 0 <= r["bubble_rate"] < 1, name
        assert r["tokens_per_s"] == pytest.approx(4 * 16 / r["step_s"]) and len(r["step_s_all"]) == 2, name
        assert 0 < r["efficiency"] and r["balanced_bound_s"] > 0, name
        for key in ("peak_memory_bytes", "peak_activation_bytes", "param_bytes", "pass_time_s"):
            assert len(r[key]) == 2 and min(r[key]) > 0, (name, key)
        assert r["memory_imbalance"] == pytest.approx(max(r["peak_memory_bytes"]) / min(r["peak_memory_bytes"]))
        # every method starts from the same seeded weights and batch: all compute the HF model's loss
        assert r["loss"] == pytest.approx(peer["loss"], abs=1e-5), name
        assert r["ratio_to_peer"] == pytest.approx(r["tokens_per_s"] / peer["tokens_per_s"]), name
        ops = {p[1] for p in r["timeline"]}  # passes only: sends, receives and collectives are waits
        assert {"F", "B"} <= ops <= compute, (name, ops)
        if "vocab" in name:
            assert {"S", "T"} <= ops, (name, ops)
        if name.startswith("vhalf"):
            assert "W" in ops, (name, ops)
    assert "| peer |" in capsys.readouterr().out
    assert (tmp_path / "bench_throughput.png").stat().st_size > 0
    assert (tmp_path / "bench_memory.png").stat().st_size > 0


def test_rows_from_records():
    """Aggregation: median over reps of the slowest rank; bubble and bound from the passes."""
    cfg = BenchConfig(vocabs=(1024,), methods=("peer",), microbatches=2, seq=8, steps=3)
    steps = []
    for rep, t in enumerate([1.0, 3.0, 2.0]):
        for rank in range(2):
            passes = [Pass(rank, "F", 0, 0, 0.0, 0.25 * t), Pass(rank, "B", 0, 0, 0.5 * t, 0.75 * t)]
            steps.append(StepRecord(1024, "peer", rank, rep, t if rank == 0 else t - 0.1, 1.5, passes))
    mem = [MemoryRecord(1024, "peer", r, 100, 10, 20 + 20 * r) for r in range(2)]
    (row,) = build_rows(cfg, ["peer"], mem, steps)
    assert row.step_s == 2.0 and row.tokens_per_s == 16 / 2.0
    assert abs(row.bubble_rate - 0.5) < 1e-9  # half of each rank's time is in passes
    assert row.peak_memory_bytes == [120, 140] and abs(row.memory_imbalance - 140 / 120) < 1e-9
    passes = [Pass(*p) for p in row.timeline]
    assert abs(row.balanced_bound_s - balanced_bound_s(passes, 2, 2, "1f1b")) < 1e-12
    assert abs(row.balanced_bound_s - 1.0 * (1 + 1 / 2)) < 1e-9  # 2 s of passes / 2 ranks x (1 + (p-1)/m)
    assert abs(bubble_rate(passes, 2, 2.0) - 0.5) < 1e-9
    assert "| 1k | peer |" in markdown_table([row])
