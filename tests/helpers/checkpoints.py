"""A checkpoint of synthetic state written by `checkpoint.save_checkpoint` on one rank, for the checkpoint tests."""

from __future__ import annotations

import os

from vp_accelerate.train.persist import store as ckpt


def save_one_rank(root, step: int, state: tuple, crash=None, keep: int = 2) -> str:
    """Save (model_state, optimizer_state, trainer_state) as step `step` of the checkpoint dir `root` (rank 0 of
    one, a config.json for model/); `crash` stops the save at that point (`save_checkpoint`'s `_crash_after`)."""
    model, opt, trainer = state
    return ckpt.save_checkpoint(
        str(root),
        step,
        rank=0,
        model_state=model,
        optimizer_state=opt,
        trainer_state=trainer,
        meta={"fingerprint": {"model": "m"}},
        barrier=lambda: None,
        keep=keep,
        write_model_files=lambda d: open(os.path.join(d, "config.json"), "w").write("{}"),
        _crash_after=crash,
    )
