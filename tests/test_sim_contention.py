"""Collectives that hold SMs (Hardware.comm_sm_fraction): a rank's compute slows while one of its collectives
is issued and not complete; the paper's setup (sim.paper.PAPER_HARDWARE) prices the output layer's softmax as
Megatron runs it. Each test fails on a simulator without the mechanism (no such Hardware field, no
PAPER_HARDWARE)."""

import dataclasses

import pytest

from vp_accelerate.cost import Hardware, for_schedule
from vp_accelerate.schedule import build_schedule
from vp_accelerate.schedule.ir import Op
from vp_accelerate.schedule.replay import CostClock, replay
from vp_accelerate.schedule.streams import NCCL
from vp_accelerate.sim.paper import PAPER_HARDWARE, shape
from vp_accelerate.sim.simulate import _collective_windows, _overlap, simulate


def _timed(method: str, fraction: float, p: int = 4, m: int = 8):
    s = build_schedule("1f1b", method, p, m)
    hw = dataclasses.replace(Hardware(), comm_sm_fraction=fraction)
    return simulate(s, for_schedule(shape(128000, 2048), s, hw=hw))


def test_overlap_of_a_pass_with_disjoint_windows():
    spans = [(0.0, 1.0), (2.0, 3.0), (5.0, 6.0)]
    assert _overlap(spans, 0.5, 2.5) == pytest.approx(1.0)  # half of the first, half of the second
    assert _overlap(spans, 3.0, 5.0) == 0.0  # between two windows
    assert _overlap(spans, -1.0, 10.0) == pytest.approx(3.0)
    assert _overlap([], 0.0, 1.0) == 0.0


def test_held_sms_slow_vocabulary_parallel_steps_and_nothing_without_collectives():
    free, held = _timed("vocab-2", 0.0), _timed("vocab-2", 0.2)
    assert free.step_time == _timed("vocab-2", Hardware().comm_sm_fraction).step_time  # the default holds none
    assert held.step_time > free.step_time * 1.01
    # the passes themselves got longer (not only waits): busy time grows
    assert sum(held.busy) > sum(free.busy) * 1.01
    # no collective in the baseline's step: nothing to hold SMs, the same timing
    assert _timed("baseline", 0.2).step_time == pytest.approx(_timed("baseline", 0.0).step_time)


def test_a_collective_is_held_from_its_issue_to_its_end_on_every_rank():
    s = build_schedule("1f1b", "vocab-2", 4, 8)
    model = for_schedule(shape(128000, 2048), s)
    out = replay(s, NCCL, CostClock(model))
    windows = _collective_windows(s, out)
    chain_end = max(end for a, _, _, end in out.chains if a.op is Op.C1 and a.mb == 3)
    ends = {(r, id(a)): end for r, a, _, end in out.passes}
    for r, actions in enumerate(s.actions):
        # the rank issues C1 of microbatch 3 when its line reaches it (after the compute pass before it in its
        # list) and holds SMs from then until the chain ends
        i = next(k for k, a in enumerate(actions) if a.op is Op.C1 and a.mb == 3)
        issued = max(ends[(r, id(a))] for a in actions[:i] if (r, id(a)) in ends)
        assert any(lo == pytest.approx(issued) and chain_end <= hi + 1e-12 for lo, hi in windows[r])


def test_paper_hardware_prices_the_softmax_as_megatron_runs_it():
    """52 bytes per logit over forward and backward (sim.paper.PAPER_HARDWARE's count): the baseline's last
    stage costs more against a decoder layer than with the default's fused 12 bytes per pass."""
    assert PAPER_HARDWARE.logit_bytes * 2 == 52
    s = build_schedule("1f1b", "baseline", 8, 8)
    default, paper = (for_schedule(shape(256000, 2048), s, hw=hw) for hw in (Hardware(), PAPER_HARDWARE))

    def out_layers(model):  # the last stage's output layer, in decoder layers
        layer = model.pass_time(0, Op.F, 0) + model.pass_time(0, Op.B, 0)
        last = model.pass_time(7, Op.F, 7) + model.pass_time(7, Op.B, 7)
        return (last - layer) / (layer / model.chunk_layers[0])

    assert out_layers(paper) > out_layers(default) + 0.5
