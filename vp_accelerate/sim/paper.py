"""Reproduce docs/simulation.md: the paper's 8-GPU setup simulated, next to its measured MFU.

    python -m vp_accelerate.sim.paper docs   # prints the markdown tables, writes docs/img/*.png
"""

from __future__ import annotations

import sys
from pathlib import Path

from vp_accelerate.schedule import build_schedule

from vp_accelerate.cost import ModelShape, for_schedule
from .plot import plot_timeline, plot_vocab_sweep
from .simulate import simulate

VOCABS = (32000, 64000, 128000, 256000)
# The paper's MFU % measured on 8 x A100, 1F1B, 128 microbatches
PAPER_MFU = {
    2048: {"baseline": (46.16, 40.48, 33.11, 25.23), "redis": (46.01, 46.37, 44.22, 38.91),
           "vocab-1": (50.42, 50.28, 49.93, 50.12), "vocab-2": (50.23, 50.18, 49.82, 49.69)},
    4096: {"baseline": (47.05, 41.87, 35.00, 26.75), "redis": (46.93, 46.78, 47.44, 43.01),
           "vocab-1": (50.98, 50.98, 50.83, 50.66), "vocab-2": (50.93, 50.75, 50.56, 50.40)},
}
PAPER_MEM_2048 = {"baseline": (14.86, 16.32, 19.25, 25.64), "vocab-1": (15.63, 16.02, 16.84, 18.59),
                  "vocab-2": (14.83, 15.23, 16.04, 17.78)}


def shape(vocab: int, seq: int) -> ModelShape:
    """The paper's ~4B model: 32 layers, h=3072, 24 heads, FFN 4h, microbatch size 1."""
    return ModelShape(hidden=3072, layers=32, heads=24, ffn=4 * 3072, vocab=vocab, seq=seq)


def run(kind: str, method: str, p: int, m: int, vocab: int, seq: int):
    s = build_schedule(kind, method, p, m)
    return simulate(s, for_schedule(shape(vocab, seq), s))


def ratio_table(p: int = 8, m: int = 128) -> str:
    lines = ["| seq | V | sim vocab-2/baseline | paper | sim redis/baseline | paper | sim MFU base / redis / vocab-1 / vocab-2 |",
             "|---|---|---|---|---|---|---|"]
    for seq in (2048, 4096):
        for i, v in enumerate(VOCABS):
            mfu = {meth: run("1f1b", meth, p, m, v, seq).mfu * 100 for meth in ("baseline", "redis", "vocab-1", "vocab-2")}
            pm = {k: vals[i] for k, vals in PAPER_MFU[seq].items()}
            lines.append(f"| {seq} | {v // 1000}k | {mfu['vocab-2'] / mfu['baseline']:.2f} | "
                         f"{pm['vocab-2'] / pm['baseline']:.2f} | {mfu['redis'] / mfu['baseline']:.2f} | "
                         f"{pm['redis'] / pm['baseline']:.2f} | {mfu['baseline']:.1f} / {mfu['redis']:.1f} / "
                         f"{mfu['vocab-1']:.1f} / {mfu['vocab-2']:.1f} |")
    return "\n".join(lines)


def memory_table(p: int = 8, m: int = 128) -> str:
    lines = ["| method | sim peak GB (max over ranks) 32k/64k/128k/256k | paper GB |", "|---|---|---|"]
    for meth in ("baseline", "vocab-1", "vocab-2"):
        sim = [max(run("1f1b", meth, p, m, v, 2048).peak_memory_bytes) / 1e9 for v in VOCABS]
        lines.append(f"| {meth} | {' / '.join(f'{x:.1f}' for x in sim)} | "
                     f"{' / '.join(f'{x:.2f}' for x in PAPER_MEM_2048[meth])} |")
    return "\n".join(lines)


def scaling_table(m: int = 128, seq: int = 2048) -> str:
    combos = [("1f1b", "baseline"), ("1f1b", "redis"), ("1f1b", "vocab-1"), ("1f1b", "vocab-2"),
              ("vhalf", "baseline"), ("vhalf", "vocab-2"), ("interleaved", "baseline"), ("interleaved", "vocab-2")]
    lines = ["| p | layers | V | " + " | ".join(f"{k} {m_}" for k, m_ in combos) + " |",
             "|---|---|---|" + "---|" * len(combos)]
    for p, layers in ((16, 64), (32, 128)):
        for v in (64000, 256000):
            cells = []
            for kind, meth in combos:
                s = build_schedule(kind, meth, p, m)
                sh = ModelShape(hidden=3072, layers=layers, heads=24, ffn=4 * 3072, vocab=v, seq=seq)
                r = simulate(s, for_schedule(sh, s))
                cells.append(f"{r.mfu * 100:.1f}% / {max(r.peak_memory_bytes) / 1e9:.0f}G")
            lines.append(f"| {p} | {layers} | {v // 1000}k | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def images(out_dir: Path) -> list[str]:
    img = out_dir / "img"
    img.mkdir(parents=True, exist_ok=True)
    made = []
    for kind, meth in (("1f1b", "baseline"), ("1f1b", "vocab-2"), ("vhalf", "baseline"), ("vhalf", "vocab-2")):
        p, m, v = 4, 12, 256000
        r = run(kind, meth, p, m, v, 2048)
        path = img / f"timeline_{kind}_{meth}.png"
        plot_timeline(r.timeline, path, title=f"{kind} / {meth}, p={p}, m={m}, V=256k, seq 2048: "
                                              f"MFU {r.mfu * 100:.1f}%, bubble {r.bubble_rate * 100:.1f}%")
        made.append(str(path))
    rows = []
    for meth in ("baseline", "redis", "vocab-1", "vocab-2"):
        for v in VOCABS:
            r = run("1f1b", meth, 8, 128, v, 2048)
            rows.append({"method": meth, "vocab": v, "mfu": r.mfu, "peak_memory_gb": max(r.peak_memory_bytes) / 1e9})
    path = img / "vocab_sweep_1f1b_p8.png"
    plot_vocab_sweep(rows, str(path), title="1F1B, 8 ranks, 128 microbatches, seq 2048 (simulated)")
    made.append(str(path))
    return made


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "docs")
    print(ratio_table())
    print()
    print(memory_table())
    print()
    print(scaling_table())
    print()
    print("\n".join(images(out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
