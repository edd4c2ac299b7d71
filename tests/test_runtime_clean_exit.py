"""Every rank exits 0 at the end of a script that never calls `close()` (as the README's example ends).

Such scripts once aborted at random at interpreter exit (SIGABRT, "terminate called without an active
exception": a thread still joinable, or a process group torn down by static destructors). The
runtime's exit hook (runtime/shutdown.py) now stops the communication workers and the watchdog and
destroys the process groups. The ranks are launched as a launcher would (env rendezvous), several
times over, each from a saved checkpoint, running one evaluation step and one training step.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.launch import env_ranks
from helpers.tiny import tiny_llama
from vp_accelerate.runtime import shutdown

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    pipe = PipelineModel(sys.argv[1], PipelineConfig(schedule=sys.argv[2], method="vocab-2", microbatches=2))
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    res = pipe.train_step(ids, labels=ids)
    print("loss", res.loss, "eval", pipe.eval_step(ids, labels=ids), flush=True)
    import faulthandler
    print("faulthandler", faulthandler.is_enabled(), flush=True)
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
            # a launched rank prints every thread's Python stack if a signal kills it (an abort at exit)
            assert "faulthandler True" in out
            assert err.strip() == "" or "Fatal Python error" not in err


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


def _name_this_thread(name: bytes) -> None:
    """Give the calling thread its native name (what /proc/self/task/*/comm shows), as torch names its threads."""
    ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME


def test_the_exit_hook_waits_until_every_gloo_worker_is_parked():
    """torch's gloo worker thread (`pt_gloo_runloop`) marks a collective complete (the caller's wait returns)
    and only then drops its reference to the work; when it is the last one, the work's tensors are released
    there, under the GIL (torch 2.13's `TensorImpl::decref_pyobject`). If the interpreter is finalizing by
    then, CPython 3.11 ends that thread with pthread_exit inside the noexcept destructor: std::terminate,
    SIGABRT after the script's last line (the exit abort; docs/reliability.md has the stack). So the exit hook
    returns only once every gloo worker is parked in its wait for new work. A thread named like one, still
    running when the hook starts, then parked: the hook returns after it parked (before, it returned at
    once, leaving a worker that was still running to the finalizing interpreter)."""
    named, hook_started, parked_soon = threading.Event(), threading.Event(), threading.Event()

    def worker():
        _name_this_thread(b"pt_gloo_runloop")
        named.set()
        hook_started.wait()
        time.sleep(0.5)  # busy a while after the hook started (a sleep is not a parked wait, as work is not)
        parked_soon.set()
        threading.Event().wait()  # parked: an untimed condition-variable wait, as the runloop waits for work

    threading.Thread(target=worker, daemon=True).start()
    named.wait()
    hook_started.set()
    shutdown.shutdown()
    assert parked_soon.is_set()
    assert not shutdown.gloo_threads_busy()


@pytest.mark.parametrize(
    "syscall, parked",
    [
        ("202 0x55daf9da92d0 0x189 0x0 0x0 0x0 0xffffffff 0x7f3c 0x7f3d", True),  # condition variable, no timeout
        ("202 0x55daf9da92d0 0x80 0x2 0x0 0x0 0x0 0x7f3c 0x7f3d", False),  # a mutex (the work queue's)
        ("202 0x7ffff7f5d0a8 0x189 0x0 0x7f3cbf811c40 0x0 0xffffffff 0x7f3c 0x7f3d", False),  # timed: the GIL
        ("running", False),  # on a CPU
        ("0 0x9 0x55dafc8afc30 0x2000 0x0 0x0 0x0 0x7ffe 0x7f3c", False),  # another syscall (read)
    ],
)
def test_what_counts_as_a_parked_gloo_worker(syscall, parked):
    if shutdown._FUTEX != 202:
        pytest.skip("the syscall numbers above are x86_64's")
    assert shutdown._parked(syscall.split()) is parked


SYNC_THEN_END = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from vp_accelerate.runtime import shutdown

    dist.init_process_group("gloo")
    shutdown.register()  # as PipelineModel does
    group = dist.distributed_c10d._get_default_group()  # held, as a PipelineModel holds its groups
    dist.all_reduce(torch.ones(4))  # the script's last collective; then it ends
""")


@pytest.mark.slow  # ~60 s idle: 20 two-rank runs
def test_a_script_ending_right_after_a_collective_exits_0_many_times(tmp_path):
    """The plain form of the exit abort: a synchronous gloo all-reduce and the script's end. Without the exit
    hook's wait for the gloo workers, 2 of 8 such plain-torch runs aborted at load 11 (exit -6,
    "terminate called without an active exception")."""
    script = tmp_path / "sync_then_end.py"
    script.write_text(SYNC_THEN_END)
    for run in range(20):
        outs = env_ranks([sys.executable, str(script)], 2, timeout_s=120)
        assert outs is not None, "a rank did not exit"
        for rank, (code, out, err) in enumerate(outs):
            assert code == 0, f"run {run}, rank {rank} exited {code}\n{out}\n{err[-3000:]}"


FAULT_STACKS = textwrap.dedent("""
    import faulthandler, os, sys, threading
    from vp_accelerate.distributed import enable_fault_stacks

    print(enable_fault_stacks(), faulthandler.is_enabled(), flush=True)
    if sys.argv[1] == "abort":  # as std::terminate ends a rank: SIGABRT
        threading.Thread(target=threading.Event().wait, name="helper", daemon=True).start()
        os.abort()
""")


# not launched (no faulthandler) in the slow run: the suite's budget
@pytest.mark.parametrize("launched", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_launched_rank_prints_every_threads_stack_on_a_fatal_signal(tmp_path, launched):
    """In a rank a launcher started (LOCAL_RANK set), faulthandler is on for all threads: SIGABRT prints each
    thread's Python stack; a normal exit prints nothing. A process no launcher started is left as it is."""
    script = tmp_path / "fault.py"
    script.write_text(FAULT_STACKS)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "WORLD_SIZE")}
    env.pop("PYTHONFAULTHANDLER", None)
    if launched:
        env.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="2")
    normal = subprocess.run([sys.executable, str(script), "end"], env=env, capture_output=True, text=True)
    assert normal.returncode == 0 and normal.stderr == "", normal.stderr
    assert normal.stdout.split() == ([str(launched)] * 2)
    aborted = subprocess.run([sys.executable, str(script), "abort"], env=env, capture_output=True, text=True)
    assert aborted.returncode == -signal.SIGABRT
    if launched:
        assert "Fatal Python error: Aborted" in aborted.stderr
        assert aborted.stderr.count("Thread 0x") + aborted.stderr.count("Current thread 0x") >= 2, aborted.stderr
    else:
        assert "Fatal Python error" not in aborted.stderr
