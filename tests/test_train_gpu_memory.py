"""The per-rank CUDA memory metrics (max allocated / reserved per logging window), with the allocator's
counters faked so the CPU suite checks the bookkeeping; the CPU path keeps the resident-set numbers."""

from __future__ import annotations

import torch

from vp_accelerate.train.run import tracking


class _Pipe:
    def stats(self):
        return {"peak_activation_bytes": 10, "param_bytes": 20}


def test_cuda_window_memory_is_reported_per_log_and_the_run_peak_kept(monkeypatch):
    allocator = {"allocated": 300 * 2**20, "reserved": 512 * 2**20}
    resets = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocator["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: allocator["reserved"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    monkeypatch.setattr(tracking, "_CUDA_RUN_PEAK", 0)
    cuda = torch.device("cuda", 0)

    first = tracking.rank_metrics([tracking.rank_stats(_Pipe(), cuda)])
    assert first["memory/rank0_cuda_max_allocated_mib"] == 300
    assert first["memory/rank0_cuda_max_reserved_mib"] == 512
    assert first["memory/rank0_peak_mib"] == 300 and resets == [cuda]

    allocator.update(allocated=100 * 2**20, reserved=256 * 2**20)  # a quieter window after the reset
    second = tracking.rank_metrics([tracking.rank_stats(_Pipe(), cuda)])
    assert second["memory/rank0_cuda_max_allocated_mib"] == 100
    assert second["memory/rank0_cuda_max_reserved_mib"] == 256
    assert second["memory/rank0_peak_mib"] == 300  # the run's peak survives the window reset


def test_cpu_ranks_report_resident_memory_and_no_cuda_keys():
    metrics = tracking.rank_metrics([tracking.rank_stats(_Pipe(), torch.device("cpu"))])
    assert metrics["memory/rank0_peak_mib"] > 0 and metrics["memory/rank0_rss_mib"] > 0
    assert not any("cuda" in k for k in metrics)
