"""The data-parallel gradient sync priced as the runtime overlaps it (`cost.data_parallel.overlapped_sync_time`,
runtime/grad_sync.py `DPReducer`): a chunk's reduce starts at its last backward pass, the vocabulary shards' after
the rank's last pass; what is left after the step's last pass is what the step pays."""

from __future__ import annotations

import pytest

from vp_accelerate.cost import ModelShape, cost_aware_schedule
from vp_accelerate.cost.data_parallel import grad_sync_time, overlapped_sync_time
from vp_accelerate.sim.plan import _slack
from vp_accelerate.sim.simulate import simulate

BW, LAT = 25e9, 20e-6


@pytest.mark.parametrize("zero", [0, 1])
def test_everything_final_at_the_end_is_the_pessimistic_price(zero):
    params = 3e9
    whole = grad_sync_time(params, 4, zero, BW, LAT)
    # one bucket stream: the chunk and the rest back to back cost one more latency than one reduce of both
    split = overlapped_sync_time([[(0.0, params * 4 * 0.75)]], [(0.0, params * 4 * 0.25)], 4, zero, BW, LAT)
    assert split == pytest.approx(whole + LAT)
    assert overlapped_sync_time([[(0.0, params * 4)]], [(0.0, 0.0)], 4, zero, BW, LAT) == pytest.approx(whole)
    assert overlapped_sync_time([[(0.0, params * 4)]], [(0.0, 0.0)], 1, zero, BW, LAT) == 0.0


def test_a_chunk_final_early_hides_its_reduce_behind_the_passes_after_it():
    nbytes = 8e9
    reduce = 2 * 0.5 * nbytes / BW + LAT  # dp 2
    assert overlapped_sync_time([[(reduce + 1.0, nbytes)]], [(0.0, 0.0)], 2, 0, BW, LAT) == 0.0
    left = overlapped_sync_time([[(reduce / 4, nbytes)]], [(0.0, 0.0)], 2, 0, BW, LAT)
    assert left == pytest.approx(reduce * 3 / 4)
    # the slowest rank sets the step's end; a rank that ended early hides its vocabulary shards' reduce
    two = overlapped_sync_time([[(0.0, nbytes)], [(5.0, nbytes)]], [(0.0, 0.0), (5.0, nbytes)], 2, 0, BW, LAT)
    assert two == pytest.approx(reduce)


def _exposed(kind: str) -> tuple[float, float]:
    shape = ModelShape(hidden=2048, layers=16, heads=16, ffn=8192, vocab=128000, seq=2048)
    sched, model = cost_aware_schedule(shape, kind, "vocab-2", 4, 8)
    slack = _slack(sched, simulate(sched, model))
    ready, after = [], []
    for r in range(4):
        chunks, rest = dict(slack[r][0]), 0.0
        held = []
        for (op, c), nbytes in model.grad_arrivals(r).items():
            if op in ("B", "W"):
                held.append((chunks[c], nbytes))
            else:
                rest += nbytes
        ready.append(held)
        after.append((slack[r][1], rest))
    params = max(model.rank_params(r) for r in range(4))
    return overlapped_sync_time(ready, after, 8, 0, BW, LAT), grad_sync_time(params, 8, 0, BW, LAT)


def test_1f1b_hides_nothing_and_vhalf_hides_part():
    """1F1B's rank 0 ends the step with chunk 0's last B: its whole reduce is exposed, as the pessimistic price
    says. V-Half's ranks finish one of their two chunks before the step ends: part of the reduce is hidden."""
    overlapped, pessimistic = _exposed("1f1b")
    assert overlapped == pytest.approx(pessimistic, rel=0.02)
    overlapped, pessimistic = _exposed("vhalf")
    assert overlapped < 0.95 * pessimistic
