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
    _check_runs(tmp_path, 2)


@pytest.mark.slow
def test_scripts_without_close_exit_0_on_every_rank_many_times(tmp_path):
    _check_runs(tmp_path, 40)
