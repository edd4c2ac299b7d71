"""The README's benchmark figures, from one run of the current harness.

    python scripts/readme_figures.py run          # run the harness once, write its table into docs/benchmarks.md
                                                  # ("The run behind the README") and the README's figures from it
    python scripts/readme_figures.py render       # rewrite the README's figures from the table in docs/benchmarks.md
    python scripts/readme_figures.py check        # exit 1 when the README does not say what that table says

The table keeps the run's date, command and the machine's load average before and after, so a reader can weigh the
numbers; the README paragraph is made from the table alone (tests/test_docs.py re-renders it), so the two cannot
disagree. One run, its spread quoted: never the best cell of several runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
TABLE_BEGIN = "<!-- readme run: written by `python scripts/readme_figures.py run` -->"
TABLE_END = "<!-- end of readme run -->"
FIGURES_BEGIN = "<!-- figures: written by `python scripts/readme_figures.py` from docs/benchmarks.md -->"
FIGURES_END = "<!-- end of figures -->"
VOCABS = (32768, 65536, 131072, 262144)
METHODS = ("peer", "1f1b-redis", "1f1b-vocab-2")
COLUMNS = ("V", "method", "tokens/s", "vs peer", "step s (min-max)", "bubble", "peak MiB per rank", "mem max/min")


def _between(text: str, begin: str, end: str) -> tuple[int, int]:
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise SystemExit(f"no block {begin!r} ... {end!r}")
    return start, stop + len(end)


def _replace(text: str, begin: str, end: str, block: str) -> str:
    start, stop = _between(text, begin, end)
    return text[:start] + block + text[stop:]


def _mib(x: float) -> str:
    return f"{x / 2**20:.0f}"


def table(rows: list[dict], meta: dict) -> str:
    """The markdown block of docs/benchmarks.md: the run's circumstances, then one row per (V, method)."""
    lines = [
        TABLE_BEGIN,
        "",
        f"Run on {meta['date']} with `{meta['command']}` ({meta['minutes']:.0f} minutes; load average "
        f"{meta['load_before']:.1f} before, {meta['load_after']:.1f} after, on {meta['cores']} cores).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in rows:
        steps = r["step_s_all"]
        peaks = " / ".join(_mib(b) for b in r["peak_memory_bytes"])
        lines.append(
            f"| {r['vocab'] // 1024}k | {r['method']} | {r['tokens_per_s']:.0f} | {r['ratio_to_peer']:.2f}x | "
            f"{min(steps):.2f}-{max(steps):.2f} | {r['bubble_rate'] * 100:.1f}% | {peaks} | "
            f"{r['memory_imbalance']:.2f} |"
        )
    return "\n".join(lines + ["", TABLE_END])


def parse_table(text: str) -> tuple[list[dict], dict]:
    """(rows, meta) back from docs/benchmarks.md's block: what `figures` needs."""
    start, stop = _between(text, TABLE_BEGIN, TABLE_END)
    block = text[start:stop]
    m = re.search(r"Run on (\S+) with `([^`]+)` \((\d+) minutes; load average ([\d.]+) before, ([\d.]+) after", block)
    meta = {
        "date": m.group(1),
        "command": m.group(2),
        "load_before": float(m.group(4)),
        "load_after": float(m.group(5)),
    }
    rows = []
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != len(COLUMNS) or not cells[0].endswith("k"):
            continue
        lo, hi = (float(x) for x in cells[4].split("-"))
        rows.append(
            {
                "vocab": cells[0],
                "method": cells[1],
                "tokens_per_s": float(cells[2]),
                "ratio": float(cells[3].rstrip("x")),
                "spread": hi / lo - 1,
                "bubble": float(cells[5].rstrip("%")),
                "imbalance": float(cells[7]),
            }
        )
    return rows, meta


def figures(rows: list[dict], meta: dict) -> str:
    """The README paragraph, from the table's rows."""
    vp = [r for r in rows if r["method"] == "1f1b-vocab-2"]
    peer = {r["vocab"]: r for r in rows if r["method"] == "peer"}
    redis = {r["vocab"]: r for r in rows if r["method"] == "1f1b-redis"}
    ratios = ", ".join(f"{r['ratio']:.2f}x" for r in vp)
    vocabs = ", ".join(r["vocab"] for r in vp)
    over_redis = ", ".join(
        f"{r['tokens_per_s'] / redis[r['vocab']]['tokens_per_s']:.2f}x" for r in vp if r["vocab"] in redis
    )
    bubbles = [r["bubble"] for r in vp]
    peer_bubbles = [peer[r["vocab"]]["bubble"] for r in vp if r["vocab"] in peer]
    imb = [r["imbalance"] for r in vp]
    peer_imb = [peer[r["vocab"]]["imbalance"] for r in vp if r["vocab"] in peer]
    spread = max(r["spread"] for r in rows) * 100
    return "\n".join(
        [
            FIGURES_BEGIN,
            f"One run of the benchmark harness on {meta['date']} (2 CPU ranks, Llama-style h=256, 8 layers, seq 256, "
            f"8 microbatches, fp32; load average {meta['load_before']:.1f} before and {meta['load_after']:.1f} after "
            f"on the shared machine; the table is in `docs/benchmarks.md`): 1F1B + vocab-2 ran at {ratios} the "
            f"tokens/s of `torch.distributed.pipelining`'s Schedule1F1B at {vocabs} vocabularies ({over_redis} the "
            f"baseline with its layers redistributed), with a {min(bubbles):.0f}-{max(bubbles):.0f}% bubble where the "
            f"peer's was {min(peer_bubbles):.0f}-{max(peer_bubbles):.0f}%, and per-rank peak memory max/min "
            f"{min(imb):.2f}-{max(imb):.2f} (the peer's {min(peer_imb):.2f}-{max(peer_imb):.2f}: its last rank holds "
            f"the output layer). A method's step times spread by up to {spread:.0f}% over the timed steps of this run.",
            FIGURES_END,
        ]
    )


def render() -> str:
    rows, meta = parse_table(BENCHMARKS.read_text(encoding="utf-8"))
    return _replace(README.read_text(encoding="utf-8"), FIGURES_BEGIN, FIGURES_END, figures(rows, meta))


def run(args) -> None:
    cmd = [sys.executable, "scripts/benchmark.py", "--vocabs", *map(str, args.vocabs), "--methods", *args.methods]
    cmd += ["--steps", str(args.steps)]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        load_before, t0 = os.getloadavg()[0], time.time()
        subprocess.run([*cmd, "--json", out], cwd=ROOT, check=True)
        load_after, minutes = os.getloadavg()[0], (time.time() - t0) / 60
        with open(out) as f:
            rows = json.load(f)
    shown = " ".join(["python scripts/benchmark.py", *cmd[2:]])
    meta = {
        "date": datetime.date.today().isoformat(),
        "command": shown,
        "minutes": minutes,
        "load_before": load_before,
        "load_after": load_after,
        "cores": os.cpu_count(),
    }
    text = BENCHMARKS.read_text(encoding="utf-8")
    BENCHMARKS.write_text(_replace(text, TABLE_BEGIN, TABLE_END, table(rows, meta)), encoding="utf-8")
    README.write_text(render(), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["run", "render", "check"])
    ap.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS))
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.what == "run":
        run(args)
    elif args.what == "render":
        README.write_text(render(), encoding="utf-8")
    elif render() != README.read_text(encoding="utf-8"):
        print(
            "README.md's benchmark figures differ from docs/benchmarks.md; run python scripts/readme_figures.py render"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
