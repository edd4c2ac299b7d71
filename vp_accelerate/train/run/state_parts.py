"""The stateful parts of a training run, one list (`PARTS`): what a checkpoint saves of each and how a resume puts
it back. `run_state.save_run` and `run_state.resume_run` both walk it, so a part added here is saved and resumed.

The model and optimizer have files of their own (`model.safetensors`, `optimizer.pt`, keyed by parameter name so
that they reshard: `persist/reshard.py`); every other part is one key of the rank's `trainer_state.pt`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..persist import store as ckpt
from ..persist.reshard import (
    load_named_optimizer_state,
    rank_model_state,
    rank_optimizer_state,
    reshard_model,
    reshard_optimizer_state,
)


@dataclass
class Saved:
    """The checkpoint a resume reads, as the parts see it."""

    path: str
    """Its step folder."""
    meta: dict
    """Its meta.json (`store.read_meta`)."""
    rank: int
    """The saved rank whose trainer state this rank takes: its own in the same layout, else rank 0's (the LR
    schedule, data position, loss scale and counters are the same on every rank)."""
    _trainer: dict = field(default_factory=dict)

    def trainer_state(self, rank: int | None = None) -> dict:
        """Saved rank `rank`'s (default `self.rank`'s) trainer_state.pt, read once."""
        rank = self.rank if rank is None else rank
        if rank not in self._trainer:
            self._trainer[rank] = ckpt.load_trainer_state(self.path, rank)
        return self._trainer[rank]


@dataclass(frozen=True)
class Part:
    """One stateful part of a run."""

    name: str
    """Its key in trainer_state.pt (`model` and `optimizer`: their own files)."""
    save: Callable[[Any], object]
    """run -> this rank's state of the part (tensors and plain containers: `torch.load(weights_only=True)` reads
    it back)."""
    load: Callable[[Any, Saved], None]
    """(run, the checkpoint) -> the part restored on this rank."""


def _load_optimizer(run, saved: Saved) -> None:
    pipe = run.pipe
    state = reshard_optimizer_state(pipe, saved.path, saved.meta)
    load_named_optimizer_state(run.optimizer, pipe.named_parameters(), state, same_groups=False)


def _load_scheduler(run, saved: Saved) -> None:
    run.scheduler.load_state_dict(saved.trainer_state()["scheduler"])
    groups = len(run.optimizer.param_groups)
    for key in ("base_lrs", "_last_lr"):  # another layout may have another number of groups (all share the LR)
        values = getattr(run.scheduler, key, None)
        if isinstance(values, list) and values and len(values) != groups:
            setattr(run.scheduler, key, [values[0]] * groups)


def _load_rng(run, saved: Saved) -> None:
    """This rank's RNG: the saved rank of its number, where there is one (else rank 0's)."""
    rank = run.pipe.rank if run.pipe.rank < len(saved.meta["ranks"]) else 0
    ckpt.set_rng_state(saved.trainer_state(rank)["rng"])


MODEL = Part(
    "model",
    lambda run: rank_model_state(run.pipe),
    lambda run, saved: reshard_model(run.pipe, saved.path, saved.meta),
)

PARTS: tuple[Part, ...] = (
    MODEL,
    Part("optimizer", lambda run: rank_optimizer_state(run.pipe, run.optimizer), _load_optimizer),
    Part("scheduler", lambda run: run.scheduler.state_dict(), _load_scheduler),
    Part(  # the fp16 loss scale
        "precision",
        lambda run: run.pipe.precision_state_dict(),
        lambda run, saved: run.pipe.load_precision_state_dict(saved.trainer_state()["precision"]),
    ),
    Part(
        "data",
        lambda run: run.train_it.state_dict(),
        lambda run, saved: run.train_it.load_state_dict(saved.trainer_state()["data"]),
    ),
    Part("rng", lambda run: ckpt.rng_state(), _load_rng),
    Part(
        "counters",
        lambda run: dict(run.counters),
        lambda run, saved: run.counters.update(saved.trainer_state()["counters"]),
    ),
    Part(  # the best eval loss so far (checkpoint.keep_best, eval.patience)
        "best", lambda run: dict(run.best), lambda run, saved: run.best.update(saved.trainer_state()["best"])
    ),
)
"""Every part a checkpoint holds, in the order a resume loads them."""

OWN_FILES = ("model", "optimizer")
"""The parts with files of their own; the others make trainer_state.pt."""


def rank_state(run, step: int, meta: dict) -> ckpt.RankState:
    """What this rank saves of `run` after `step`: every part's state, placed in its file."""
    states = {p.name: p.save(run) for p in PARTS}
    trainer = {"step": step, **{n: s for n, s in states.items() if n not in OWN_FILES}}
    return ckpt.RankState(states["model"], states["optimizer"], trainer, meta)


def load_parts(run, saved: Saved) -> None:
    """Every part of `run` from checkpoint `saved`."""
    for part in PARTS:
        part.load(run, saved)
