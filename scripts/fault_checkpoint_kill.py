"""SIGKILL a 2-rank training run in the middle of writing a checkpoint; the previous one must survive.

    python scripts/fault_checkpoint_kill.py [--work /tmp/vp_fault_ckpt] [--steps 12] [--every 3]

1. An uninterrupted run (the reference).
2. The same run, with checkpoint fsyncs slowed down (scripts/fault_worker.py `slow_fsync_s`) so the kill
   lands inside the write: as soon as rank 0's weights file of the second checkpoint appears in its
   `step_X.tmp/` dir, the launcher and both ranks get SIGKILL.
3. Checks: `latest` still names the first checkpoint and it loads on both ranks (safetensors +
   weights_only); the half-written `.tmp` dir is what the kill left.
4. `--resume` to the end. The resumed steps must log exactly the reference's loss / grad norm / LR, and
   the final weights must equal the reference's (fp32, CPU; printed as the max abs difference).
Exit code 0 when everything holds.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fault_common import (  # noqa: E402
    compare_losses,
    final_weights,
    finish,
    kill_when,
    max_weight_diff,
    metrics,
    prepare,
    run_parser,
    spec_from,
    start,
)


def main(argv=None) -> int:
    ap = run_parser(__doc__, "/tmp/vp_fault_ckpt")
    args = ap.parse_args(argv)
    spec = spec_from(args)
    prepare(spec)
    from vp_accelerate.train.persist import store as ckpt

    finish(start(spec, "reference"), "the reference run")
    ref = metrics(spec, "reference")

    first, second = spec.every, 2 * spec.every
    victim = start(spec, "victim", {"slow_fsync_s": 0.5})
    cdir = os.path.join(spec.work, "victim", "ckpt")
    tmp = os.path.join(cdir, ckpt.step_dir_name(second) + ".tmp")
    kill_when(victim, lambda: os.path.exists(os.path.join(tmp, "rank_00000", "model.safetensors")))
    left = sorted(os.path.relpath(os.path.join(b, f), tmp) for b, _, fs in os.walk(tmp) for f in fs)
    print(f"killed during the write of {ckpt.step_dir_name(second)}: the .tmp dir holds {left}")

    latest = ckpt.read_latest(cdir)
    problems = []
    if not latest.endswith(ckpt.step_dir_name(first)):
        problems.append(f"latest is {latest}, expected {ckpt.step_dir_name(first)}")
    if os.path.exists(os.path.join(cdir, ckpt.step_dir_name(second))):
        problems.append("the interrupted checkpoint appears complete")
    for rank in (0, 1):
        model, opt, state = ckpt.load_rank(latest, rank)
        if state["step"] != first or not model:
            problems.append(f"rank {rank}'s shard of {latest} is not the step-{first} state")
    print(f"latest = {os.path.basename(latest)}, loads on both ranks")

    finish(start(spec, "victim", resume=True), "the resumed run")
    got = metrics(spec, "victim")
    problems += compare_losses(ref, got, range(first + 1, spec.steps + 1))
    diff = max_weight_diff(final_weights(spec, "reference"), final_weights(spec, "victim"))
    print(
        f"resumed steps {first + 1}..{spec.steps}: loss/grad-norm/LR "
        f"{'identical' if not problems else 'DIFFER'}; final weights max |diff| = {diff:.3g}"
    )
    if diff > 1e-6:
        problems.append(f"final weights differ by {diff}")
    for p in problems:
        print("FAIL:", p)
    print("OK" if not problems else "FAILED")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
