"""Every rank exits 0 at the end of a script that never calls `close()` (as the README's example ends).

Such scripts once aborted at random at interpreter exit (SIGABRT, "terminate called without an active
exception": a thread still joinable, or a process group torn down by static destructors). The
runtime's exit hook (runtime/shutdown.py) now stops the communication workers and the watchdog and
destroys the process groups. The ranks are launched as a launcher would (env rendezvous), several
times over, each from a saved checkpoint, running one evaluation step and one training step.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.launch import env_ranks
from helpers.tiny import tiny_llama

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    pipe = PipelineModel(sys.argv[1], PipelineConfig(schedule=sys.argv[2], method="vocab-2", microbatches=2))
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    res = pipe.train_step(ids, labels=ids)
    print("loss", res.loss, "eval", pipe.eval_step(ids, labels=ids), flush=True)
    # no pipe.close(): the exit hook ends the workers, the watchdog and the groups
""")


def _run_once(script: str, ckpt: str, schedule: str, timeout_s: float = 300.0) -> list[tuple[int, str, str]]:
    outs = env_ranks([sys.executable, script, ckpt, schedule], 2, timeout_s=timeout_s)
    if outs is None:
        pytest.fail("a rank did not exit")
    return outs


def _check_runs(tmp_path, runs: int):
    ckpt = tmp_path / "ckpt"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_llama(61, tied=True)).save_pretrained(ckpt)
    script = tmp_path / "no_close.py"
    script.write_text(SCRIPT)
    for i in range(runs):
        schedule = ("1f1b", "vhalf", "interleaved")[i % 3]
        for rank, (code, out, err) in enumerate(_run_once(str(script), str(ckpt), schedule)):
            assert code == 0, f"run {i} ({schedule}), rank {rank} exited {code}\n{out}\n{err[-3000:]}"
            assert "loss" in out


def test_scripts_without_close_exit_0_on_every_rank(tmp_path):
    _check_runs(tmp_path, 1)


@pytest.mark.slow
def test_scripts_without_close_exit_0_on_every_rank_many_times(tmp_path):
    _check_runs(tmp_path, 40)


LATE_PEER = textwrap.dedent("""
    import os, time
    import torch
    import torch.distributed as dist
    from vp_accelerate.runtime import shutdown
    from vp_accelerate.vocab import comm

    dist.init_process_group("gloo")
    shutdown.register()  # as PipelineModel does
    rank, buf = dist.get_rank(), torch.zeros(4)
    if rank == 0:  # the last chain of this rank still waits on its peer when the script ends
        comm.worker(None).submit(lambda: (dist.recv(buf, src=1), print("received", buf.sum().item(), flush=True)))
    else:  # the peer is late (a loaded machine), past any few-second wait
        time.sleep(float(os.environ["LATE_S"]))
        dist.send(torch.ones(4), dst=0)
""")


@pytest.mark.slow  # ~13 s idle: a peer 8 s late
def test_a_chain_waiting_on_a_late_peer_at_exit_ends_before_the_interpreter(tmp_path):
    """A rank whose communication worker is still inside a collective when its script ends (its peer is 8 s
    late) waits for that chain, then exits 0. Before, the exit waited 5 s and left the thread in the gloo
    call: it returned while the interpreter finalized and aborted the process ("terminate called without
    an active exception", exit 134), or the process was gone before the receive ended."""
    script = tmp_path / "late.py"
    script.write_text(LATE_PEER)
    outs = env_ranks([sys.executable, str(script)], 2, env={"LATE_S": "8"}, timeout_s=120)
    assert outs is not None, "a rank did not exit"
    for rank, (code, out, err) in enumerate(outs):
        assert code == 0, f"rank {rank} exited {code}\n{out}\n{err[-3000:]}"
    assert "received 4.0" in outs[0][1]


ORDER_SCRIPT = textwrap.dedent("""
    import torch.distributed as dist
    from vp_accelerate.runtime import shutdown, watchdog
    from vp_accelerate.vocab import comm

    class Store:
        def __init__(self):
            self.kv = {}
        def set(self, k, v):
            self.kv[k] = v
        def check(self, keys):
            return all(k in self.kv for k in keys)
        def get(self, k):
            return str(self.kv[k]).encode()

    dist.distributed_c10d._get_default_store = lambda: Store()
    dist.get_rank, dist.get_world_size = (lambda: 0), (lambda: 2)
    close_workers, stop = comm.close_workers, watchdog.Watchdog.stop

    def close_workers_said(timeout_s):
        print("workers drained", flush=True)
        return close_workers(timeout_s=timeout_s)

    def stop_said(self):
        if not self.stopped:
            print("watchdog stopped", flush=True)
        stop(self)

    comm.close_workers, watchdog.Watchdog.stop = close_workers_said, stop_said
    shutdown.register()  # as PipelineModel does, before it starts the watchdog
    watchdog.start(dead_after_s=60.0)
""")


def test_at_exit_the_workers_drain_before_the_watchdog_stops(tmp_path):
    # shutdown.py's order: a peer that dies while this rank's last chains drain is still seen by the watchdog.
    # Before, watchdog.start registered its own exit hook, which atexit ran first (the last registered first).
    import subprocess

    script = tmp_path / "order.py"
    script.write_text(ORDER_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["workers drained", "watchdog stopped"], out.stdout
