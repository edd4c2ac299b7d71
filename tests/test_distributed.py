import socket

import pytest
import torch
import torch.distributed as dist

from vp_accelerate import distributed
from vp_accelerate.distributed import RankFailed, spawn
from vp_accelerate.distributed import free_port as real_free_port


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


def _abort_on_rank1():
    import os

    if dist.get_rank() == 1:
        os.write(2, b"rank 1 says its last words\n")
        os.abort()  # as std::terminate does: SIGABRT, no report
    t = torch.zeros(1)
    dist.all_reduce(t)


def test_a_rank_that_dies_without_reporting_is_named_with_its_last_lines():
    # model_coverage's crash line names the family and these lines (before: only the exit code)
    with pytest.raises(RankFailed, match=r"rank 1 failed: process exited with code -6 .*rank 1 says its last words"):
        spawn(_abort_on_rank1, 2, timeout_s=120)


def _count_calls(path: str) -> int:
    with open(path, "a") as f:
        f.write("x")
    if "taken" in path:
        raise RuntimeError("address already in use")  # fn's own error: not a port to retry
    return dist.get_world_size()


def test_spawn_retries_a_port_taken_before_the_group_formed_and_nothing_else(tmp_path, monkeypatch):
    """A port another process binds between free_port and rank 0's store is retried on a fresh one; an
    error that fn raised is never retried, whatever it says."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    monkeypatch.setattr(distributed, "free_port", lambda: ports.pop() if ports else real_free_port())
    try:
        assert spawn(_count_calls, 2, str(tmp_path / "calls"), timeout_s=30) == [2, 2]
    finally:
        taken.close()
    assert not ports and (tmp_path / "calls").read_text() == "xx"  # fn ran once per rank, on the fresh port
    with pytest.raises(RankFailed, match="address already in use"):
        spawn(_count_calls, 2, str(tmp_path / "taken"), timeout_s=30)
    assert (tmp_path / "taken").read_text() == "xx"  # once per rank: not retried


class _FakeCuda:
    """torch.cuda as a 2-GPU machine would answer; records set_device and what came first."""

    def __init__(self, monkeypatch, events: list, count: int = 2):
        self.current = 0

        def set_device(index):
            events.append(("set_device", int(index)))
            self.current = int(index)

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", set_device)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)


def test_the_device_comes_from_local_rank(monkeypatch):
    from vp_accelerate.distributed import local_device

    events: list = []
    _FakeCuda(monkeypatch, events)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert local_device() == torch.device("cuda", 1) and events == [("set_device", 1)]
    monkeypatch.delenv("LOCAL_RANK")
    assert local_device() == torch.device("cuda", 1)  # no LOCAL_RANK: the current device, left as it is
    monkeypatch.setenv("LOCAL_RANK", "2")  # more processes than GPUs
    assert local_device(strict=False) == torch.device("cuda", 1)  # gloo (CPU tests on a GPU box): current device
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2 but this machine shows 2 CUDA device"):
        local_device(strict=True)  # NCCL: two ranks cannot share a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_device() == torch.device("cpu")


def test_init_from_env_sets_the_device_before_the_process_group(monkeypatch):
    events: list = []
    _FakeCuda(monkeypatch, events)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: events.append(("init", backend)))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    for key, value in dict(
        RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"
    ).items():
        monkeypatch.setenv(key, value)
    assert distributed.init_from_env() == (3, 4)
    assert events == [("set_device", 1), ("init", "nccl")]  # NCCL's communicators land on GPU 1, not 0

    events.clear()  # a group accelerate made already: the device is still set from LOCAL_RANK
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert distributed.init_from_env() == (3, 4)
    assert events == [("set_device", 1)]
