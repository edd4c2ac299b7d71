"""SIGKILL a 2-rank training run at a random step, resume it, and compare with an uninterrupted run.

    python scripts/fault_kill_resume.py [--work /tmp/vp_fault_resume] [--steps 12] [--every 3] [--kill-at K]

1. An uninterrupted run (the reference), logging every step.
2. The same run, killed (launcher + both ranks, SIGKILL) right after it logs step K (random in
   every+1..steps-1 unless given), as a preempted or crashed job would be.
3. `--resume`: it must restart from the last complete checkpoint J <= K (the newest save, or the one before it
   while the newest was still being written in the background; losing only steps J+1..K), and every
   resumed step must log exactly the reference's loss, grad norm and LR — which holds only if the data
   order continues where it stopped (and the optimizer, LR schedule and RNG were restored). Final weights
   are compared too (fp32, CPU).
Exit code 0 when everything holds.
"""

from __future__ import annotations

import os
import random
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
    ap = run_parser(__doc__, "/tmp/vp_fault_resume")
    ap.add_argument("--kill-at", type=int, default=None, help="step after which to kill (default: random)")
    args = ap.parse_args(argv)
    spec = spec_from(args)
    kill_at = args.kill_at or random.randrange(spec.every + 1, spec.steps)
    prepare(spec)
    from vp_accelerate.train.persist import store as ckpt

    finish(start(spec, "reference"), "the reference run")
    ref = metrics(spec, "reference")

    victim = start(spec, "victim")
    kill_when(victim, lambda: kill_at in metrics(spec, "victim"))
    logged = max(metrics(spec, "victim"))
    latest = ckpt.read_latest(os.path.join(spec.work, "victim", "ckpt"))
    resume_from = ckpt.read_meta(latest)["step"] if latest else 0  # none complete yet: from the start
    print(
        f"killed after step {logged} (asked {kill_at}); last checkpoint: step {resume_from}; "
        f"steps to redo: {logged - resume_from}"
    )

    finish(start(spec, "victim", resume=True), "the resumed run")
    got = metrics(spec, "victim")
    problems = []
    newest = (logged // spec.every) * spec.every  # killed right after logging it, its save may not have run
    # checkpoints are written in the background: the newest may still have been writing (then `latest` is the
    # one before it), and when the kill came right after logging a save step, that save may not have begun
    allowed = (newest, newest - spec.every, newest - 2 * spec.every)[: 3 if logged % spec.every == 0 else 2]
    if resume_from not in allowed:
        problems.append(f"resumed from step {resume_from}, expected the checkpoint of step {allowed[0]}")
    problems += compare_losses(ref, got, range(resume_from + 1, spec.steps + 1))
    diff = max_weight_diff(final_weights(spec, "reference"), final_weights(spec, "victim"))
    print(
        f"resumed steps {resume_from + 1}..{spec.steps}: loss/grad-norm/LR "
        f"{'identical to the uninterrupted run' if not problems else 'DIFFER'}; final weights max |diff| = "
        f"{diff:.3g}"
    )
    if diff > 1e-6:
        problems.append(f"final weights differ by {diff}")
    for p in problems:
        print("FAIL:", p)
    print("OK" if not problems else "FAILED")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
