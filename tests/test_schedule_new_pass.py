"""A new pass kind is one `registry.VOCAB_ACTIONS` entry (its rules follow from deps.py) plus one executor
method: a dummy no-op pass NOOP after every C1, registered for the test only, is placed by the builder,
expected and checked by the validator, timed by the simulator and run by the executor
(docs/ARCHITECTURE.md, "A new pass")."""

from __future__ import annotations

import dataclasses
import enum
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.tiny import tiny_llama
from vp_accelerate.distributed import spawn
from vp_accelerate.schedule import Action, Op, ScheduleError, build_schedule, validate
from vp_accelerate.schedule.registry import VOCAB_ACTIONS, VocabAction


class Extra(str, enum.Enum):
    """A pass kind outside `ir.Op`: any str enum member names an op (the executor runs `_do_<value>`)."""

    NOOP = "NOOP"
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


# every rank, every microbatch of a training step, after C1 (it reads its result)
NOOP = VocabAction(Extra.NOOP, follows=Op.C1, training_only=True)


def _with_noop(s):
    """`s` with NOOP(mb) right after each C1(mb) on every rank (by hand, for the runtime's schedule below)."""
    lists = []
    for acts in s.actions:
        out = []
        for a in acts:
            out.append(a)
            if a.op is Op.C1:
                out.append(Action(Extra.NOOP, a.mb))
        lists.append(tuple(out))
    return dataclasses.replace(s, actions=tuple(lists))


@pytest.fixture
def register(monkeypatch):
    """Registers NOOP when called; monkeypatch removes it after the test (nothing else remembers it)."""
    return lambda: monkeypatch.setitem(VOCAB_ACTIONS, Extra.NOOP, NOOP)


def test_validator_expects_and_orders_the_new_pass(register):
    s = build_schedule("1f1b", "vocab-2", 4, 8)  # before NOOP exists
    with pytest.raises(ScheduleError, match="NOOP.*does not belong on this rank"):
        validate(_with_noop(s))  # unregistered: a foreign action
    register()
    with pytest.raises(ScheduleError, match="never runs NOOP"):
        validate(s)  # registered: every rank must run it
    validate(_with_noop(s))
    acts = list(_with_noop(s).actions[2])
    i, j = acts.index(Action(Extra.NOOP, 3)), acts.index(Action(Op.C1, 3))
    acts[i], acts[j] = acts[j], acts[i]
    bad = dataclasses.replace(s, actions=_with_noop(s).actions[:2] + (tuple(acts),) + _with_noop(s).actions[3:])
    with pytest.raises(ScheduleError, match=r"rank 2, .*NOOP\(mb=3\): runs before C1\(mb=3\)"):
        validate(bad)


class _Costs:
    """A cost model that also times NOOP (a real pass would get its time in cost/costs.py)."""

    def __init__(self, model, noop_s: float):
        self.model, self.noop_s = model, noop_s

    def pass_time(self, rank, op, chunk):
        return self.noop_s if op is Extra.NOOP else self.model.pass_time(rank, op, chunk)

    def __getattr__(self, name):
        return getattr(self.model, name)


def _model(s):
    from vp_accelerate.cost import for_schedule
    from vp_accelerate.sim.paper import shape

    return for_schedule(shape(64000, 2048), s)


def test_builder_and_simulator_place_and_time_the_new_pass(register):
    from vp_accelerate.sim.simulate import simulate

    p, m = 4, 8
    plain = build_schedule("vhalf", "vocab-1", p, m)
    evaluation = build_schedule("vhalf", "vocab-1", p, m, forward_only=True)
    register()
    grid = build_schedule("vhalf", "vocab-1", p, m)  # the unit grid puts NOOP beside T (timing._place_extra)
    validate(grid)
    costs = _Costs(_model(grid), 0.05)
    fast = build_schedule("vhalf", "vocab-1", p, m, costs=costs)  # the list scheduler orders it by deps.py
    # training only: the evaluation step has none
    assert build_schedule("vhalf", "vocab-1", p, m, forward_only=True).actions == evaluation.actions
    for s in (grid, fast):
        assert sum(a.op is Extra.NOOP for acts in s.actions for a in acts) == p * m
    base = simulate(plain, _model(plain))
    res = simulate(fast, costs)
    noops = [t for t in res.timeline if t.op == "NOOP"]
    assert len(noops) == p * m and all(t.end - t.start == pytest.approx(0.05) for t in noops)
    c1_end = {t.mb: t.end for t in res.timeline if t.op == "C1" and t.lane == "comm"}
    assert all(t.start >= c1_end[t.mb] for t in noops)
    assert res.step_time > base.step_time  # 32 x 50 ms more work


def test_a_pass_the_grid_cannot_place_is_named(monkeypatch):
    # after the input reduce only chunk 0's F reads: no vocabulary pass's slot to share
    monkeypatch.setitem(VOCAB_ACTIONS, Extra.NOOP, VocabAction(Extra.NOOP, follows=Op.IF_REDUCE))
    with pytest.raises(ScheduleError, match="NOOP follows IF_REDUCE.*add its placement to schedule/timing.py"):
        build_schedule("1f1b", "vocab-2", 2, 2)


def _run_with_noop(ckpt: str, ids, labels):
    """On each rank: register NOOP and `Executor._do_NOOP`, train one step with NOOP in the schedule, and
    return (the step's loss, the loss before it, NOOP's microbatches in run order, its timeline count)."""
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.executor import Executor

    ran: list[int] = []
    # built before NOOP is registered: the runtime builds with the cost model, which has no time for NOOP
    # (a real pass gets one in cost/costs.py), so NOOP goes in by hand
    pipe = PipelineModel(ckpt, PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=4))
    before = pipe.eval_step(ids, labels)
    VOCAB_ACTIONS[Extra.NOOP] = NOOP
    Executor._do_NOOP = lambda self, a: ran.append(a.mb)
    try:
        pipe.schedule = _with_noop(pipe.schedule)
        validate(pipe.schedule)
        res = pipe.train_step(ids, labels)
        records = sum(1 for r in pipe.stats()["timeline"] if r.op == "NOOP")
        pipe.close()
        return res.loss, before, ran, records
    finally:
        del Executor._do_NOOP
        del VOCAB_ACTIONS[Extra.NOOP]


def test_executor_runs_the_new_pass(tmp_path):
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    ckpt = str(tmp_path / "ckpt")
    AutoModelForCausalLM.from_config(tiny_llama(97, attn_implementation="eager")).save_pretrained(ckpt)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (4, 8), generator=g)
    out = spawn(_run_with_noop, 2, ckpt, ids, ids.clone(), timeout_s=120)
    for loss, before, ran, records in out:
        assert ran == [0, 1, 2, 3]  # once per microbatch, in order, on every rank
        assert records == 4  # in the step's timeline like any pass
        assert loss == pytest.approx(before, rel=1e-6)  # a no-op: the step's loss is the model's loss
    assert Extra.NOOP not in VOCAB_ACTIONS
