"""Walk every decoder family of the installed transformers and write docs/models.md's table.

    python scripts/model_coverage.py                 # every family, rewrites docs/models.md
    python scripts/model_coverage.py llama phi --no-write

Each family is refused by `check_supported` (with the missing feature), or trained one step on 2 gloo
ranks from a save_pretrained directory and from its config, with vocab-2 and baseline, and compared with
the HF model in one process (float64, loss and every gradient within 1e-5 relative). Families run in
batches of `--batch` per 2-rank spawn; a batch that fails is rerun one family at a time to name the culprit.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vp_accelerate.bench.coverage import FamilyResult, check_families, write_table  # noqa: E402
from vp_accelerate.models.families import decoder_families  # noqa: E402


def crash_reason(family: str, error: Exception, lines: int = 3) -> str:
    """One line for a family whose 2-rank spawn failed: the family, and each failing rank's last lines
    (`RankFailed` names every rank: "rank N failed: ..." followed by its traceback)."""
    text = str(error).strip()
    ranks = re.split(r"^(?=rank \d+ failed: )", text, flags=re.M)
    parts = []
    for chunk in ranks:
        if chunk.startswith("rank "):
            who, body = chunk.split(" failed: ", 1)
            tail = [line.strip() for line in body.strip().splitlines() if line.strip()][-lines:]
            parts.append(f"{who}: " + " / ".join(tail))
    return f"{family}: {type(error).__name__}: " + (
        " || ".join(parts) if parts else " / ".join(text.splitlines()[-lines:])
    )


def run(families: list[str], batch: int) -> list[FamilyResult]:
    out: list[FamilyResult] = []
    for i in range(0, len(families), batch):
        group = families[i : i + batch]
        t0 = time.perf_counter()
        try:
            res = check_families(group)
        except Exception as e:  # one family broke the spawn: rerun each alone
            if len(group) == 1:
                res = [FamilyResult(group[0], "crash", crash_reason(group[0], e))]
            else:
                res = [r for mt in group for r in run([mt], 1)]
        for r in res:
            print(f"{r.model_type:24s} {r.status:8s} {r.reason[: 600 if r.status == 'crash' else 150]}", flush=True)
        print(f"  ({len(group)} families, {time.perf_counter() - t0:.0f} s)", flush=True)
        out += res
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", help="model types (default: every decoder family)")
    ap.add_argument("--batch", type=int, default=8, help="families per 2-rank spawn")
    ap.add_argument("--out", default=str(ROOT / "docs" / "models.md"))
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    families = args.families or decoder_families()
    results = run(families, args.batch)
    if not args.no_write:
        write_table(results, args.out)
        print(f"wrote {args.out}")
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "refused", "fail", "crash")}
    print(", ".join(f"{n} {s}" for s, n in counts.items()))
    return 1 if counts["fail"] or counts["crash"] else 0


if __name__ == "__main__":
    sys.exit(main())
