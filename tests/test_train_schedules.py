"""LR schedules: transformers' names (with their kwargs) next to this project's cosine/linear/constant."""

import io

import pytest
import torch

from vp_accelerate.train.recipe import LRSection, RecipeError
from vp_accelerate.train.recipe.lr_schedule import build_scheduler, check_schedule, hf_names, lr_factor


def lrs(cfg, steps=100, start=0, state=None):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=2.0)
    sched = build_scheduler(opt, cfg, steps)
    if state is not None:
        sched.load_state_dict(state)
    out = []
    for _ in range(start, steps):
        out.append(sched.get_last_lr()[0] / 2.0)
        opt.step()
        sched.step()
    return out, sched


def test_every_transformers_name_builds():
    kwargs = {"warmup_stable_decay": {"num_decay_steps": 10}}
    names = hf_names()
    assert {"cosine_with_min_lr", "warmup_stable_decay", "cosine_with_restarts", "linear_hf"} <= set(names)
    for name in names:
        cfg = LRSection(warmup_steps=5, decay=name, scheduler_kwargs=kwargs.get(name, {}))
        check_schedule(cfg, 50)
        values, _ = lrs(cfg, 50)
        assert max(values) <= 1.0 + 1e-9 and len(values) == 50, name


def test_own_names_are_unchanged():
    cfg = LRSection(warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    values, _ = lrs(cfg)
    assert values == pytest.approx([lr_factor(s, 100, 10, "cosine", 0.1) for s in range(100)])


def test_floor_and_stable_phase():
    values, _ = lrs(LRSection(warmup_steps=10, decay="cosine_with_min_lr", min_lr_ratio=0.25))
    assert values[10] == pytest.approx(1.0) and min(values[10:]) >= 0.25 - 1e-9
    assert values[-1] == pytest.approx(0.25, abs=0.01)
    wsd, _ = lrs(
        LRSection(
            warmup_steps=10, decay="warmup_stable_decay", min_lr_ratio=0.0, scheduler_kwargs={"num_decay_steps": 20}
        )
    )
    assert wsd[10:80] == pytest.approx([1.0] * 70) and wsd[-1] < 0.05 and wsd[85] < wsd[80]


def test_state_round_trips_through_a_weights_only_load():
    cfg = LRSection(warmup_steps=5, decay="warmup_stable_decay", scheduler_kwargs={"num_decay_steps": 30})
    full, _ = lrs(cfg)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=2.0)
    sched = build_scheduler(opt, cfg, 100)
    for _ in range(60):
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    buf.seek(0)
    resumed, _ = lrs(cfg, 100, start=60, state=torch.load(buf, weights_only=True))
    assert resumed == pytest.approx(full[60:])


@pytest.mark.parametrize(
    "cfg,message",
    [
        (
            LRSection(decay="cosine_with_min_lrr"),
            "lr.decay: unknown schedule 'cosine_with_min_lrr'; did you mean 'cosine_with_min_lr'?",
        ),
        (
            LRSection(decay="warmup_stable_decay"),
            "lr.scheduler_kwargs: 'warmup_stable_decay' with {}: .*num_decay_steps",
        ),
        (LRSection(decay="cosine", scheduler_kwargs={"num_cycles": 2}), "lr.scheduler_kwargs: 'cosine' takes none"),
        (LRSection(decay="cosine_with_restarts", scheduler_kwargs={"cycles": 2}), "lr.scheduler_kwargs: .*cycles"),
    ],
)
def test_bad_schedules_name_the_key(cfg, message):
    with pytest.raises(RecipeError, match=message):
        check_schedule(cfg, 100)
