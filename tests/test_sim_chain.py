"""The simulator models the runtime: collective chains on a resource of their own, GEMM efficiency from
shapes, the output layer's memory modes, measured host issue times; and it reproduces the paper's table."""

import json

import pytest

from vp_accelerate.cost import MeasuredCosts, for_schedule
from vp_accelerate.cost.efficiency import GemmModel
from vp_accelerate.schedule import build_schedule
from vp_accelerate.schedule.ir import Op, chain_collectives
from vp_accelerate.sim.paper import shape
from vp_accelerate.sim.simulate import simulate


def test_c1_is_a_chain_of_dependent_steps_on_the_comm_lane():
    s = build_schedule("1f1b", "vocab-2", 4, 8)
    model = for_schedule(shape(128000, 2048), s)
    steps = model.chain_steps(Op.C1)
    # every collective the validator sees, with the rescale between the max and the sums
    assert [n for n, _ in steps if n != "rescale"] == list(chain_collectives(Op.C1, s.method))
    assert [n for n, _ in steps].index("rescale") == 2
    assert model.collective_time(Op.C1) == pytest.approx(sum(t for _, t in steps))
    res = simulate(s, model)
    rec = sorted(
        (r for r in res.timeline if r.lane == "comm" and r.op == "C1" and r.mb == 3 and r.rank == 0),
        key=lambda r: r.start,
    )
    assert len(rec) == len(steps)
    for a, b in zip(rec, rec[1:]):  # back to back: each step starts when the previous one ends
        assert b.start == pytest.approx(a.end)
    t_start = min(r.start for r in res.timeline if r.op == "T" and r.mb == 3)
    assert t_start >= rec[-1].end  # T waits for the whole chain
    blocking = simulate(s, model, blocking_collectives=True)
    assert blocking.step_time > res.step_time  # the switch: every rank waits for every chain


def test_gemm_efficiency_falls_with_shape_and_vocab_passes_scale_below_linear():
    g = GemmModel()
    assert g.efficiency(128 * 9, 256 * 12, 10**6) == pytest.approx(1.0, abs=1e-4)  # 108 tiles: one full wave
    assert g.efficiency(128 * 9, 256 * 12 + 1, 10**6) < 0.6  # one tile more: a second, nearly empty wave
    assert g.efficiency(4096, 4096, 128) < g.efficiency(4096, 4096, 4096)  # short reductions pay more
    sh = shape(256000, 2048)
    per_rank = {}
    for p in (8, 16, 32):
        m = for_schedule(sh, build_schedule("1f1b", "vocab-2", p, p))
        per_rank[p] = m.pass_time(0, Op.S, 0) + m.pass_time(0, Op.T, 0) + m.collective_time(Op.C1)
    one = per_rank[8] * 8
    fraction = {p: one / (p * t) for p, t in per_rank.items()}
    assert fraction[16] < 1.0 and fraction[32] < fraction[16]  # relative to 8 GPUs


def test_recompute_keeps_less_from_s_to_t_and_pays_a_product_in_t():
    import dataclasses

    s = build_schedule("1f1b", "vocab-2", 4, 8)
    store = for_schedule(shape(128000, 2048), s)
    rec = dataclasses.replace(store, output_memory="recompute")
    assert rec.stash_bytes() < store.stash_bytes() / 10
    assert rec.pass_time(0, Op.T, 0) > store.pass_time(0, Op.T, 0)
    assert rec.pass_time(0, Op.S, 0) == store.pass_time(0, Op.S, 0)


def test_measured_issue_times_are_charged_to_the_compute_thread(tmp_path):
    s = build_schedule("1f1b", "vocab-2", 2, 4)
    passes = [{"F": 1.0, "B": 2.0, "S": 0.5, "T": 0.5, "IF": 0.1, "IB": 0.1}] * 2
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"passes": passes}))
    issued = tmp_path / "issued.json"
    issued.write_text(json.dumps({"passes": passes, "issue": {"SEND_ACT": 0.05, "RECV_ACT": 0.05, "C1": 0.05}}))
    t0 = simulate(s, MeasuredCosts.from_json(plain)).step_time
    t1 = simulate(s, MeasuredCosts.from_json(issued)).step_time
    assert t0 + 0.05 * 4 <= t1  # at least each C1 on the critical path


@pytest.mark.slow
def test_every_cell_of_the_papers_8_gpu_table_within_10_percent():
    from vp_accelerate.sim.paper import ratio_cells

    cells = ratio_cells()
    assert len(cells) == 2 * 4 * 4
    bad = [c for c in cells if abs(c["error"]) > 0.10 and c["method"] != "interlaced"]
    assert not bad, bad
    # interlaced was predicted, not fitted: its absolute MFU within 5% in every cell (its ratios carry the
    # baseline's own -7% at 256k on top: up to +11.4%, docs/simulation.md)
    from vp_accelerate.sim.paper import PAPER_MFU, VOCABS

    inter = [c for c in cells if c["method"] == "interlaced"]
    off = [c["sim_mfu"] / PAPER_MFU[c["seq"]]["interlaced"][VOCABS.index(c["vocab"])] - 1 for c in inter]
    assert len(off) == 8 and max(abs(x) for x in off) <= 0.05, off


def test_the_scaling_table_has_a_column_for_every_supported_pair():
    from vp_accelerate.schedule.registry import supported_pairs
    from vp_accelerate.sim.paper import scaling_table

    header = scaling_table(m=8, sizes=((4, 8),), vocabs=(64000,)).splitlines()[0]
    assert [c.strip() for c in header.strip("|").split("|")][3:] == [f"{k} {m}" for k, m in supported_pairs()]
