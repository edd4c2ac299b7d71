"""The trainer (`vp-accelerate train`), or a bare `PipelineModel` loop, with faults injected.

    VP_FAULT='{"poison": {"step": 3, "microbatch": 1, "value": "nan"}}' \
      accelerate launch --config_file configs/accelerate_cpu_2proc.yaml scripts/fault_worker.py RECIPE --set ...
    VP_FAULT='{"fail": {"step": 2, "rank": 1, "how": "kill"}}' \
      RANK=.. WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. python scripts/fault_worker.py --pipeline

The first form is the real trainer; the second (`--pipeline`) trains a tiny Llama with `PipelineModel`
alone for three steps, launched one process per rank with torchrun-style environment variables, so a
test sees the runtime's own failure handling without the trainer or a launcher in between.
VP_FAULT (JSON) says what to break:
- `poison`: at training step `step` (1-based), add `value` ("nan" | "inf") to the input embedding of
  microbatch `microbatch` (the input of chunk 0, after the vocabulary-parallel embedding reduce), so its
  loss and every gradient it touches go non-finite — as bad data or an overflow would.
- `poison_grad`: at step `step`, after the backward, set one gradient entry of parameter index `param` on
  rank `rank` to `value`: a non-finite gradient while every loss is finite.
- `fail`: at step `step`, rank `rank` raises (`"how": "raise"`) or SIGKILLs itself (`"how": "kill"`) inside
  its first chunk's forward, mid-schedule, with its peer blocked on it.
- `stall`: at step `step`, rank `rank` sleeps `seconds` inside its first chunk's forward of microbatch 1
  (a hang: its peer waits for it, nobody raises); with `--pipeline`, `watchdog_stall_s` (default 600) is
  the PipelineConfig's, so the watchdog's stall report ends the job.
- `stall_end`: at step `step`, rank `rank` sleeps `seconds` inside the step's end (`DPReducer.finish`, before
  its data-parallel buckets complete): a hang after the schedule's last pass; with `--pipeline` set `dp_size` 2.
- `fail_between`: at step `step`, rank `rank` raises right after its train_step returned (between steps), while
  its peers enter the next collective (the clip norm).
- `dp_size`, `clip`: with `--pipeline`, the PipelineConfig's dp_size (pp_size = world / dp_size) and whether each
  step clips the gradient norm (a collective after the step).
- `slow_fsync_s`: sleep this long before each checkpoint fsync, so a kill lands inside the write.
- `signal`: at step `step`, rank `rank` (every rank when absent) sends itself the signal `name` (default
  SIGTERM), a real one delivered by the kernel: inside its first chunk's forward (`"during": "step"`, the
  default) or inside the checkpoint write of that step (`"during": "save"`, at its first fsync): a preemption.
- `hold`: at step `step`, rank `rank` (default 0) waits inside its first chunk's forward of microbatch 1 until
  it has received the signal `until` (default SIGTERM; from anyone: a test, a scheduler, the launcher passing it
  on), at most `seconds` (default 120), after touching the file `mark` when given; its peers wait on it: a run
  that cannot end before a signal reaches it, whatever the machine's speed. From step 2 on every rank has its
  stop-signal handlers installed by then (step 1's collectives came after).
Used by tests/test_faults_training.py, tests/test_runtime_faults.py (`--pipeline`) and scripts/fault_*.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def install(fault: dict) -> None:
    from vp_accelerate.runtime import pipeline
    from vp_accelerate.runtime.executor import Executor
    from vp_accelerate.train.persist import writer as checkpoint_writer

    state = {"step": 0}
    original_train_step = pipeline.PipelineModel.train_step

    def train_step(self, *args, **kwargs):
        state["step"] += 1
        res = original_train_step(self, *args, **kwargs)
        between = fault.get("fail_between")
        if between and state["step"] == between["step"] and self.rank == between.get("rank", 0):
            raise RuntimeError(f"injected failure between steps at step {state['step']}")
        bad = fault.get("poison_grad")
        if bad and state["step"] == bad["step"] and self.rank == bad.get("rank", 0):
            grad = self.parameters()[bad.get("param", 0)].grad
            grad.view(-1)[0] = float(bad.get("value", "inf"))
        return res

    pipeline.PipelineModel.train_step = train_step

    stall_end = fault.get("stall_end")
    if stall_end:
        from vp_accelerate.runtime import grad_sync

        original_finish = grad_sync.DPReducer.finish

        def finish(self, params):
            rank = int(os.environ.get("RANK", "0"))
            if state["step"] == stall_end["step"] and rank == stall_end.get("rank", 0):
                time.sleep(float(stall_end.get("seconds", 60)))
            return original_finish(self, params)

        grad_sync.DPReducer.finish = finish

    fail, stall, sig, hold = fault.get("fail"), fault.get("stall"), fault.get("signal"), fault.get("hold")

    def signal_here(where: str, rank: int) -> None:
        if sig and sig.get("during", "step") == where and state["step"] == sig["step"] and not state.get("signalled"):
            if sig.get("rank") in (None, rank):
                state["signalled"] = True
                os.kill(os.getpid(), getattr(signal, sig.get("name", "SIGTERM")))

    def hold_here(rank: int) -> None:
        if not hold or state["step"] != hold["step"] or state.get("held") or rank != hold.get("rank", 0):
            return
        state["held"] = True
        num, got = getattr(signal, hold.get("until", "SIGTERM")), []
        previous = signal.getsignal(num)  # the run's own handler (checkpoint.stop_signals) still records it

        def note(signum, frame):
            got.append(signum)
            if callable(previous):
                previous(signum, frame)

        signal.signal(num, note)
        if hold.get("mark"):
            open(hold["mark"], "w").close()
        deadline = time.monotonic() + float(hold.get("seconds", 120))
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
        signal.signal(num, previous)

    if fail or stall or sig or hold:
        original_forward_pass = Executor._do_F

        def do_f(self, a):
            if a.mb == 1 and not self.schedule.forward_only:
                signal_here("step", self.groups.rank)
                hold_here(self.groups.rank)
            if fail and state["step"] == fail["step"] and self.groups.rank == fail.get("rank", 0) and a.mb == 1:
                if fail.get("how", "raise") == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected failure at step {state['step']}")
            if stall and state["step"] == stall["step"] and self.groups.rank == stall.get("rank", 0) and a.mb == 1:
                time.sleep(float(stall.get("seconds", 60)))
            return original_forward_pass(self, a)

        Executor._do_F = do_f

    poison = fault.get("poison")
    if poison:
        original_chunk_input = Executor._chunk_input

        def chunk_input(self, a):
            x = original_chunk_input(self, a)
            if (
                a.chunk == 0
                and a.mb == poison.get("microbatch", 0)
                and state["step"] == poison["step"]
                and not self.schedule.forward_only
            ):
                x = x + float(poison.get("value", "nan"))
            return x

        Executor._chunk_input = chunk_input

    delay = float(fault.get("slow_fsync_s", 0.0))
    if delay or sig:
        original_fsync = checkpoint_writer.fsync_file

        def slow_fsync(path):
            time.sleep(delay)
            signal_here("save", int(os.environ.get("RANK", "0")))
            original_fsync(path)

        checkpoint_writer.fsync_file = slow_fsync


def pipeline_main(steps: int = 3, stall_s: float = 600.0, dp_size: int = 1, clip: bool = False) -> int:
    """Train a tiny 2-rank pipeline with `PipelineModel` alone; rendezvous from the environment."""
    import torch
    from transformers import LlamaConfig

    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    torch.set_num_threads(1)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    # a short watchdog deadline: a peer that stops answering is declared dead within seconds
    pipe = PipelineModel(
        config,
        PipelineConfig(microbatches=2, dp_size=dp_size, watchdog_dead_after_s=5.0, watchdog_stall_s=stall_s),
    )
    ids = torch.randint(0, 128, (2, 16))
    for _ in range(steps):
        pipe.train_step(ids, ids)
        if clip:
            pipe.clip_grad_norm_(1.0)
    print(f"finished {steps} steps", flush=True)
    return 0


def main() -> int:
    fault = json.loads(os.environ.get("VP_FAULT", "{}"))
    install(fault)
    if sys.argv[1:] == ["--pipeline"]:
        return pipeline_main(
            stall_s=float(fault.get("watchdog_stall_s", 600.0)),
            dp_size=int(fault.get("dp_size", 1)),
            clip=bool(fault.get("clip", False)),
        )
    from vp_accelerate.train.cli.commands import train_main

    return train_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
