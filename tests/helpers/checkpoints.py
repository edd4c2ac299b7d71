"""A checkpoint of synthetic state written by `store.save_checkpoint` on one rank, for the checkpoint tests."""

from __future__ import annotations

import multiprocessing
import os
import signal

import torch

from vp_accelerate.train.persist import store as ckpt


def state(seed: int) -> tuple[dict, dict, dict]:
    """(model, optimizer, trainer state) of a tiny run after one step: two vocabulary matrices, an AdamW's state_dict
    and an LR schedule after one step, a data position; `seed` draws the weights and is the step."""
    g = torch.Generator().manual_seed(seed)
    model = {
        "model.embed_tokens.weight": torch.randn(16, 4, generator=g),
        "lm_head.weight": torch.randn(16, 4, generator=g),
    }
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    p.grad = torch.ones(3)
    opt.step()
    schedule.step()
    trainer = {"scheduler": schedule.state_dict(), "data": {"epoch": 0, "step": seed}, "step": seed}
    return model, opt.state_dict(), trainer


def save_one_rank(root, step: int, state: tuple, crash=None, keep: int = 2) -> str:
    """Save (model_state, optimizer_state, trainer_state) as step `step` of the checkpoint dir `root` (rank 0 of
    one, a config.json for model/); `crash` stops the save at that point (`SaveSpec.crash_after`)."""
    return ckpt.save_checkpoint(spec(root, step, crash, keep), ckpt.RankState(*state, META), barrier=lambda: None)


META = {"fingerprint": {"model": "m"}}
"""The synthetic checkpoints' meta.json (before `format`, `step` and `files` are added)."""


def spec(root, step: int, crash=None, keep: int = 2) -> ckpt.SaveSpec:
    """Step `step` of checkpoint dir `root` on rank 0 of one, with a config.json for model/."""
    config = lambda d: open(os.path.join(d, "config.json"), "w").write("{}")  # noqa: E731
    return ckpt.SaveSpec(str(root), step, 0, config, keep, crash_after=crash)


def killed(target, *args) -> None:
    """Run `target(*args)` in a forked child that a save stage SIGKILLs (`SaveSpec.crash_after="kill:STAGE"`)."""
    child = multiprocessing.get_context("fork").Process(target=target, args=args)
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
