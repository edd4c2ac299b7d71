"""The methods the harness compares, behind one small interface so the peer and ours plug in alike.

A `Method` knows its schedule family (for the balanced bound), whether it can run here, and how to
build a `Runner` on each rank. A Runner does one training step and reports (loss, this rank's passes).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from vp_accelerate import runtime as vp_runtime
from vp_accelerate.bench.timeline import Pass
from vp_accelerate.schedule.ir import COMPUTE_OPS  # the rest (sends, receives, collectives) are waits
from vp_accelerate.schedule.registry import supported_pairs


class Runner(Protocol):
    """One rank's instance of a method, built on every rank of the default process group."""

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, list[Pass]]:
        """Forward + backward of one step; (token-mean loss, same on every rank; this rank's passes).

        Pass times are either absolute time.perf_counter() values or relative to the step start;
        `Method.relative_times` says which.
        """

    def zero_grad(self) -> None: ...

    def param_bytes(self) -> int: ...


@dataclass(frozen=True)
class Method:
    """A benchmarked method: a name, its schedule family, and how to build it."""

    name: str
    """Name in tables and plots ("peer", "1f1b-vocab-2", ...)."""
    schedule: str
    """Schedule family, "1f1b" or "vhalf": picks the warm-up/cool-down of the balanced bound."""
    build: Callable[..., Runner]
    """build(model_config, microbatches, seed) -> Runner, called on every rank."""
    relative_times: bool
    """True if the runner's pass times are already relative to its step start."""
    unavailable: Callable[[], str | None]
    """None if the method can run in this checkout, else the reason it cannot."""


class OursRunner:
    """Our runtime's PipelineModel as a Runner."""

    def __init__(self, model_config, schedule: str, method: str, microbatches: int, seed: int, runtime=None):
        """`runtime` is the module providing PipelineModel and PipelineConfig (default vp_accelerate.runtime;
        any module with the same API will do)."""
        # bench.peer imports torch.distributed.pipelining, which a torch build may lack (`_peer_missing`)
        from vp_accelerate.bench.peer import build_peer_model

        runtime = runtime or vp_runtime
        cfg = runtime.PipelineConfig(schedule=schedule, method=method, microbatches=microbatches)
        # Start from the very weights the peer builds (a seeded HF model; PipelineModel copies the
        # parts this rank holds), so every method's loss on the same batch must agree: a built-in
        # check that all of them train the same model on the same data.
        source = build_peer_model(model_config, seed)
        self.pipe = runtime.PipelineModel(source, cfg, dtype=torch.float32, seed=seed)
        del source

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, list[Pass]]:
        res = self.pipe.train_step(input_ids, labels)
        records = self.pipe.stats().get("timeline", [])
        passes = [
            Pass(int(r.rank), str(getattr(r.op, "value", r.op)), int(r.mb), int(r.chunk), float(r.start), float(r.end))
            for r in records
        ]
        return float(res.loss), [p for p in passes if p.op in COMPUTE_OPS]

    def zero_grad(self) -> None:
        self.pipe.zero_grad()

    def param_bytes(self) -> int:
        return int(self.pipe.stats()["param_bytes"])


def _runtime_missing() -> str | None:
    try:  # an availability probe: the import is the check
        from vp_accelerate.runtime import PipelineModel  # noqa: F401
    except ImportError as e:
        return f"vp_accelerate.runtime cannot be imported yet ({e})"
    return None


def _peer_missing() -> str | None:
    try:  # an availability probe: the import is the check
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # noqa: F401
    except ImportError as e:
        return f"torch.distributed.pipelining unavailable ({e})"
    return None


def _build_peer(model_config, microbatches: int, seed: int) -> Runner:
    from vp_accelerate.bench.peer import PeerRunner  # optional: torch.distributed.pipelining (`_peer_missing`)

    return PeerRunner(model_config, microbatches, seed=seed)


def _ours(schedule: str, method: str) -> Method:
    def build(model_config, microbatches: int, seed: int) -> Runner:
        return OursRunner(model_config, schedule, method, microbatches, seed)

    return Method(f"{schedule}-{method}", schedule, build, relative_times=True, unavailable=_runtime_missing)


METHODS: dict[str, Method] = {
    "peer": Method("peer", "1f1b", _build_peer, relative_times=False, unavailable=_peer_missing),
    **{m.name: m for m in (_ours(kind, method) for kind, method in supported_pairs())},
}


def get_method(name: str) -> Method:
    """A registered method by name, or any Method object named as "module.path:attribute".

    The second form lets a caller benchmark a method of its own (the tests plug in a fake runtime).
    """
    if ":" in name:
        module, attr = name.split(":", 1)
        method = getattr(importlib.import_module(module), attr)
        if not isinstance(method, Method):
            raise TypeError(f"{name} is a {type(method).__name__}, not a bench Method")
        return method
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    return METHODS[name]
