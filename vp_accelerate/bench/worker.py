"""What each benchmark rank runs: build every method for one vocabulary size, measure memory, time steps.

Methods are timed round-robin (rep 0: A B C, rep 1: B C A, ...) so that drift on a shared machine
(other jobs, thermal state) hits every method alike instead of whichever ran last.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from vp_accelerate.bench.config import BenchConfig, llama_config, synthetic_batch
from vp_accelerate.bench.memory import peak_allocated_during
from vp_accelerate.bench.methods import get_method
from vp_accelerate.bench.timeline import Pass, shift


@dataclass
class MemoryRecord:
    """One rank's memory for one (vocab, method)."""

    vocab: int
    method: str
    rank: int
    param_bytes: int
    """Bytes of the parameters this rank holds."""
    peak_activation_bytes: int
    """Allocator peak above the step's start, gradients already allocated (activations + transients)."""
    peak_step_bytes: int
    """Allocator peak above the step's start, from freed gradients (activations + gradients + transients)."""

    @property
    def peak_memory_bytes(self) -> int:
        return self.param_bytes + self.peak_step_bytes


@dataclass
class StepRecord:
    """One rank's timed step for one (vocab, method, repetition)."""

    vocab: int
    method: str
    rank: int
    rep: int
    step_s: float
    """Wall time between two barriers around the step, on this rank."""
    loss: float
    passes: list[Pass] = field(default_factory=list)
    """This rank's compute passes, seconds from the step start."""


def _timed_step(runner, relative: bool, input_ids, labels) -> tuple[float, float, list[Pass]]:
    runner.zero_grad()
    dist.barrier()
    t0 = time.perf_counter()
    loss, passes = runner.step(input_ids, labels)
    dist.barrier()  # the step ends when the slowest rank is done
    step_s = time.perf_counter() - t0
    return step_s, loss, passes if relative else shift(passes, t0)


def bench_rank(cfg: BenchConfig, methods: list[str]) -> tuple[list[MemoryRecord], list[StepRecord]]:
    """Run the whole sweep on this rank (spawned by `run.run_benchmark`); returns its records."""
    rank = dist.get_rank()
    mem: list[MemoryRecord] = []
    steps: list[StepRecord] = []
    for vocab in cfg.vocabs:
        model_config = llama_config(cfg, vocab)
        input_ids, labels = synthetic_batch(cfg, vocab)
        specs = {name: get_method(name) for name in methods}
        runners = {name: spec.build(model_config, cfg.microbatches, cfg.seed) for name, spec in specs.items()}
        for name, runner in runners.items():
            for _ in range(max(1, cfg.warmup)):  # at least one, so gradients exist for the next measurement
                runner.zero_grad()
                runner.step(input_ids, labels)
            act_peak, _ = peak_allocated_during(lambda: runner.step(input_ids, labels))
            runner.zero_grad()
            step_peak, _ = peak_allocated_during(lambda: runner.step(input_ids, labels))
            mem.append(MemoryRecord(vocab, name, rank, runner.param_bytes(), act_peak, step_peak))
            runner.zero_grad()
        for rep in range(cfg.steps):
            k = rep % len(methods)
            for name in methods[k:] + methods[:k]:
                step_s, loss, passes = _timed_step(runners[name], specs[name].relative_times, input_ids, labels)
                steps.append(StepRecord(vocab, name, rank, rep, step_s, loss, passes))
                runners[name].zero_grad()
        del runners
        gc.collect()  # free this vocabulary's models before building the next, larger ones
    return mem, steps
