"""Every helper thread runs on its rank's GPU: CUDA's current device is per thread and a new thread's is GPU 0,
so the watchdog's `event.query()`, the checkpoint writer's `event.synchronize()` or a communication worker
would each create a CUDA context (~0.5 GB) on GPU 0 for every other rank of the node.

Emulated on CPU (no GPU here): torch.cuda's device calls are replaced by a recorder that says CUDA is in use on
device 3 in the starting thread, and the test checks that each thread made device 3 current before its work.
Before `distributed.start_thread`, no thread called `set_device`: these failed."""

from __future__ import annotations

import threading

import pytest
import torch

from vp_accelerate import distributed


class _Cuda:
    """torch.cuda's device calls, per thread, as a process using CUDA device 3 would see them."""

    def __init__(self, monkeypatch):
        self.current: dict[str, int] = {}
        self.main = threading.current_thread().name
        self.current[self.main] = 3
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current.get(threading.current_thread().name, 0))
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)

    def set_device(self, device) -> None:
        self.current[threading.current_thread().name] = int(device)


@pytest.fixture
def cuda(monkeypatch):
    return _Cuda(monkeypatch)


def test_start_thread_gives_the_thread_the_starting_threads_device(cuda):
    seen = []
    t = distributed.start_thread(lambda: seen.append(torch.cuda.current_device()), "probe")
    t.join(5)
    assert seen == [3] and t.daemon


def test_the_communication_worker_runs_on_the_ranks_device(cuda):
    from vp_accelerate.vocab.comm import CommWorker

    worker = CommWorker("vp-comm-test")
    job = worker.submit(lambda: torch.cuda.current_device())
    job.finished.wait(5)
    assert job.result() == 3
    assert worker.close(5)


def test_the_checkpoint_writer_runs_on_the_ranks_device(cuda, tmp_path):
    from vp_accelerate.train.persist import writer

    seen = []
    write = writer.RankWrite(
        lambda: seen.append(torch.cuda.current_device()), str(tmp_path), str(tmp_path), 0, 0, background=True
    )
    assert write.wait() is None
    assert seen == [3]


class _Store:
    def __init__(self):
        self.kv = {}

    def set(self, key, value):
        self.kv[key] = value

    def check(self, keys):
        return all(k in self.kv for k in keys)

    def get(self, key):
        return str(self.kv[key]).encode()


def test_the_watchdog_thread_runs_on_the_ranks_device(cuda, monkeypatch):
    import torch.distributed as dist

    from vp_accelerate.runtime import watchdog

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: _Store())
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    seen = []
    monkeypatch.setattr(watchdog.Watchdog, "_publish_progress", lambda self: seen.append(torch.cuda.current_device()))
    dog = watchdog.Watchdog(interval_s=0.01)
    try:
        for _ in range(500):
            if seen:
                break
            threading.Event().wait(0.01)
    finally:
        dog.stop()
    assert seen and set(seen) == {3}
