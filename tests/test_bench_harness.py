"""The benchmark harness end to end in quick mode on tiny sizes, with a fake of our runtime.

The fake has PipelineModel's API (train_step / stats / zero_grad) but runs the whole HF model on
every rank, so this tests the harness (spawn, round-robin, memory, aggregation, JSON, plots) and the
adapter from our runtime's results, not the runtime itself.
"""

import json
import time
import types
from dataclasses import dataclass

import torch

from vp_accelerate.bench.config import BenchConfig
from vp_accelerate.bench.methods import Method, OursRunner
from vp_accelerate.bench.report import build_rows, markdown_table
from vp_accelerate.bench.run import bench_main
from vp_accelerate.bench.timeline import Pass, balanced_bound_s, bubble_rate
from vp_accelerate.bench.worker import MemoryRecord, StepRecord


@dataclass
class _FakeConfig:
    schedule: str
    method: str
    microbatches: int




class _FakePipelineModel:
    def __init__(self, model, cfg, dtype, seed):
        import torch.distributed as dist

        self.rank = dist.get_rank()
        self.model = model  # OursRunner hands over the seeded HF model the peer also builds
        self.records = []

    def train_step(self, input_ids, labels):
        t0 = time.perf_counter()
        loss = self.model(input_ids=input_ids, labels=labels).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.records = [Pass(self.rank, "F", 0, 0, 0.0, t1 - t0), Pass(self.rank, "SEND_ACT", 0, 0, t1 - t0, t1 - t0),
                        Pass(self.rank, "B", 0, 0, t1 - t0, t2 - t0)]
        return types.SimpleNamespace(loss=float(loss), step_time_s=t2 - t0, bubble_rate=0.0)

    def stats(self):
        return {"param_bytes": sum(p.numel() * 4 for p in self.model.parameters()), "timeline": self.records}

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)


_FAKE_RUNTIME = types.SimpleNamespace(PipelineModel=_FakePipelineModel, PipelineConfig=_FakeConfig)


def _build_fake(model_config, microbatches, seed):
    return OursRunner(model_config, "1f1b", "vocab-2", microbatches, seed, runtime=_FAKE_RUNTIME)


FAKE_OURS = Method("fake-ours", "1f1b", _build_fake, relative_times=True, unavailable=lambda: None)


def test_quick_benchmark_end_to_end(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = bench_main(["--quick", "--hidden", "32", "--layers", "2", "--heads", "2", "--seq", "16",
                     "--microbatches", "2", "--vocabs", "300", "--steps", "3",
                     "--methods", "peer", f"{__name__}:FAKE_OURS",
                     "--json", str(out), "--plots", str(tmp_path)])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == ["peer", f"{__name__}:FAKE_OURS"]
    for r in rows:
        assert r["vocab"] == 300 and r["tokens_per_s"] > 0 and 0 <= r["bubble_rate"] < 1
        assert len(r["peak_memory_bytes"]) == 2 and min(r["peak_memory_bytes"]) > 0
        assert len(r["step_s_all"]) == 3 and r["efficiency"] > 0
    # the fake computes HF's own loss on the same batch and weights: the peer must agree
    assert abs(rows[0]["loss"] - rows[1]["loss"]) < 1e-5
    assert rows[0]["ratio_to_peer"] == 1.0
    # our runtime's non-compute records (sends, collectives) are not passes
    assert {p[1] for p in rows[1]["timeline"]} == {"F", "B"}
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
