"""sim.paper.residuals counts the public 8-GPU cells within 10% of the paper (ratio and absolute MFU) and
names the worst; cells made from the paper's own numbers (no simulation runs here, so it is cheap)."""

from vp_accelerate.sim.paper import METHODS, PAPER_MFU, VOCABS, residual_line, residuals


def _cells(scale_vocab2_256k: float = 1.0) -> list[dict]:
    cells = []
    for seq, table in PAPER_MFU.items():
        for i, v in enumerate(VOCABS):
            base = table["baseline"][i]
            for meth in METHODS[1:]:
                mfu = table[meth][i] * (scale_vocab2_256k if (meth, v, seq) == ("vocab-2", 256000, 2048) else 1.0)
                paper = table[meth][i] / base
                cells.append(
                    {"seq": seq, "vocab": v, "method": meth, "sim_mfu": mfu, "sim_baseline_mfu": base}
                    | {"sim_ratio": mfu / base, "paper_ratio": paper, "error": mfu / base / paper - 1}
                )
    return cells


def test_the_paper_against_itself_is_all_within():
    r = residuals(_cells())
    assert (r["ratio_within_10"], r["ratio_cells"], r["mfu_within_10"], r["mfu_cells"]) == (32, 32, 40, 40)


def test_one_cell_off_by_20_percent_is_the_worst_of_both():
    r = residuals(_cells(1.2))
    assert (r["ratio_within_10"], r["mfu_within_10"]) == (31, 39)
    assert r["worst_ratio"][:3] == r["worst_mfu"][:3] == (2048, 256000, "vocab-2")
    assert "vocab-2 at 256k, seq 2048: +20.0%" in residual_line(_cells(1.2))
