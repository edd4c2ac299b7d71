import pytest
import torch
import torch.distributed as dist

from vp_accelerate.distributed import RankFailed, spawn


def _allreduce_rank():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    t = torch.zeros(1)
    dist.all_reduce(t)  # rank 0 blocks here: spawn must still return


def test_spawn_returns_per_rank_results():
    assert spawn(_allreduce_rank, 3) == [6.0, 6.0, 6.0]


def test_spawn_names_the_failing_rank_without_hanging():
    with pytest.raises(RankFailed, match="rank 1 failed: ValueError: boom on purpose"):
        spawn(_raise_on_rank1, 2, timeout_s=30)


def _die_on_rank1():
    import os

    if dist.get_rank() == 1:
        os._exit(3)  # like the OOM killer: no exception, no report
    t = torch.zeros(1)
    dist.all_reduce(t)  # rank 0 blocks here until spawn stops it


def test_spawn_stops_when_a_rank_dies_without_reporting():
    import time

    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 failed: process exited with code 3"):
        spawn(_die_on_rank1, 2, timeout_s=120)
    assert time.monotonic() - start < 60  # not the 120 s collective timeout
