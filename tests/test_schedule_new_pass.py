"""A new pass kind is one `registry.VOCAB_ACTIONS` entry (its rules follow from deps.py) plus one executor
method: a dummy no-op pass NOOP after every C1, registered for the test only, is expected and checked by
the validator, timed by the simulator and run by the executor (docs/ARCHITECTURE.md, "A new pass")."""

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


NOOP = VocabAction(Extra.NOOP, follows=Op.C1)  # every rank, every microbatch, after C1 (it reads its result)


def _with_noop(s):
    """`s` with NOOP(mb) right after each C1(mb) on every rank (where a builder that knew NOOP puts it)."""
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
def registered(monkeypatch):
    monkeypatch.setitem(VOCAB_ACTIONS, Extra.NOOP, NOOP)
    yield
    # monkeypatch removes the entry after the test; nothing else remembers it


def test_validator_expects_and_orders_the_new_pass(registered):
    s = build_schedule("1f1b", "vocab-2", 4, 8)
    with pytest.raises(ScheduleError, match="never runs NOOP"):
        validate(s)  # registered: every rank must run it
    validate(_with_noop(s))
    early = _with_noop(s)
    acts = list(early.actions[2])
    i = acts.index(Action(Extra.NOOP, 3))
    j = acts.index(Action(Op.C1, 3))
    acts[i], acts[j] = acts[j], acts[i]
    bad = dataclasses.replace(early, actions=early.actions[:2] + (tuple(acts),) + early.actions[3:])
    with pytest.raises(ScheduleError, match=r"rank 2, .*NOOP\(mb=3\): runs before C1\(mb=3\)"):
        validate(bad)


def test_unregistered_the_pass_is_foreign():
    s = build_schedule("1f1b", "vocab-2", 4, 8)
    with pytest.raises(ScheduleError, match="NOOP.*does not belong on this rank"):
        validate(_with_noop(s))


class _Costs:
    """A cost model that also times NOOP (a real pass would get its time in cost/costs.py)."""

    def __init__(self, model, noop_s: float):
        self.model, self.noop_s = model, noop_s

    def pass_time(self, rank, op, chunk):
        return self.noop_s if op is Extra.NOOP else self.model.pass_time(rank, op, chunk)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_simulator_times_the_new_pass(registered):
    from vp_accelerate.cost import for_schedule
    from vp_accelerate.sim.paper import shape
    from vp_accelerate.sim.simulate import simulate

    s = build_schedule("vhalf", "vocab-1", 4, 8)
    model = for_schedule(shape(64000, 2048), s)
    plain = simulate(s, model)
    free = simulate(_with_noop(s), _Costs(model, 0.0))
    slow = simulate(_with_noop(s), _Costs(model, 0.05))
    noops = [t for t in slow.timeline if t.op == "NOOP"]
    assert len(noops) == 4 * 8 and all(t.end - t.start == pytest.approx(0.05) for t in noops)
    # even a free NOOP holds its rank's line until C1 is done (it reads it); a costly one costs more
    assert plain.step_time <= free.step_time < slow.step_time
    c1_end = {t.mb: t.end for t in slow.timeline if t.op == "C1" and t.lane == "comm"}
    assert all(t.start >= c1_end[t.mb] for t in noops)


def _run_with_noop(ckpt: str, ids, labels):
    """On each rank: register NOOP and `Executor._do_NOOP`, train one step with NOOP in the schedule, and
    return (the step's loss, the loss before it, NOOP's microbatches in run order, its timeline count)."""
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.executor import Executor

    ran: list[int] = []
    # built before NOOP is registered: the block placement does not know it (_with_noop puts it in)
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
