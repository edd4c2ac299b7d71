"""A checkpoint of synthetic state written by `store.save_checkpoint` on one rank, for the checkpoint tests."""

from __future__ import annotations

import os

from vp_accelerate.train.persist import store as ckpt


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
