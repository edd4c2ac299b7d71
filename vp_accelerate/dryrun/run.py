"""Run one rank of a layout under the fake world (`fake_world.fake_rank`): build + load, one training step,
the optimizer step (ZeRO-1 when dp > 1), a checkpoint's state_dicts and an eval step, with the bytes the
allocator would hold at each phase; then the distinct ranks of a whole layout."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from vp_accelerate.runtime.config import PipelineConfig
from vp_accelerate.schedule.world import CommOp as Op

from .fake_world import fake_rank


@dataclass
class RankMemory:
    """One rank's bytes, as the CUDA allocator would count them (storages alive at once)."""

    rank: int
    """Global rank that was run."""
    param_bytes: int
    """Parameters after build + load."""
    grad_bytes: int
    """Gradients after the training step."""
    optimizer_bytes: int
    """Optimizer state after its first step (this rank's ZeRO-1 share when dp > 1)."""
    activation_peak_bytes: int
    """Peak during the training step above what was alive before it (activations, stashes, buffers, the step's
    16-bit weight copies, grads)."""
    save_bytes: int
    """Peak while building the checkpoint's state_dicts above what was alive before."""
    eval_peak_bytes: int
    """Peak during the eval step above what was alive before."""
    peak_bytes: int
    """The largest live total of the whole run."""
    seconds: float
    """Host time of this rank's dry run."""
    live_bytes: int = 0
    """Everything alive before the training step: the parameters and the non-parameter buffers (rotary tables)."""
    optimizer_peak_bytes: int = 0
    """Peak during the optimizer step above what was alive before it (its state and transients, e.g. ZeRO-1's
    bucket flats)."""

    def largest_term(self) -> tuple[str, int]:
        terms = {
            "parameters": self.param_bytes,
            "gradients": self.grad_bytes,
            "optimizer state": self.optimizer_bytes,
            "activations": self.activation_peak_bytes - self.grad_bytes,
            "checkpoint save": self.save_bytes,
        }
        name = max(terms, key=terms.get)
        return name, terms[name]


def run_rank(source, cfg: PipelineConfig, rank: int, world_size: int, batch: int, seq: int, adapter=None):
    """(RankMemory, program) of `rank`: the real PipelineModel, step, optimizer, save and eval on fake tensors.
    `adapter`: an AdapterConfig (a LoRA run: the frozen base in the compute dtype, the adapters trained)."""
    t0 = time.perf_counter()
    cfg = dataclasses.replace(cfg, watchdog_dead_after_s=None, watchdog_stall_s=None)
    with torch.device("cpu"):
        ids = torch.randint(0, 2, (batch, seq))  # real host tokens: the data loader's, not the device's
    from vp_accelerate.runtime.pipeline import PipelineModel

    with fake_rank(rank, world_size) as (rec, counter):
        pipe = PipelineModel(source, cfg, adapter=adapter)
        rec.named = pipe.named_parameters  # the data-parallel buckets' identities (their parameters' names)
        param_bytes = pipe.param_bytes()
        rec.phase = "train_step"
        live = counter.reset_peak()  # parameters and every non-parameter buffer (rotary tables, masks' caches)
        pipe.train_step(ids, ids)
        act_peak = counter.peak - live
        grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in pipe.parameters() if p.grad is not None)
        rec.phase = "optimizer"
        opt = pipe.make_optimizer(lr=1e-4, fused=True)  # as the trainer builds it on CUDA: no foreach temporaries
        seen = counter.peak
        before_opt = counter.reset_peak()
        pipe.step(opt)
        opt_bytes = counter.live - before_opt
        opt_peak = counter.peak - before_opt  # the state it makes and its transients (ZeRO-1's bucket flats)
        pipe.zero_grad()
        rec.phase = "save"
        seen = max(seen, counter.peak)
        before = counter.reset_peak()
        sd = (pipe.state_dict(), opt.state_dict())
        save_bytes = counter.peak - before
        del sd
        rec.phase = "eval"
        seen = max(seen, counter.peak)
        before = counter.reset_peak()
        pipe.eval_step(ids, ids)
        eval_peak = counter.peak - before
        seen = max(seen, counter.peak)
        # the first step ran before the optimizer existed; every later step runs with its state alive, so the
        # steady-state peaks are what was alive before the step (parameters and buffers) + the optimizer state
        # + the step's own peak, and the optimizer step's own peak above the gradients (first step: the state
        # it makes and its transients; later: the state it holds and the same transients)
        peak = max(seen, live + opt_bytes + act_peak, before_opt + opt_peak, live + grad_bytes + opt_bytes + save_bytes)
        pipe.close() if hasattr(pipe, "close") else None
    mem = RankMemory(
        rank,
        param_bytes,
        grad_bytes,
        opt_bytes,
        act_peak,
        save_bytes,
        eval_peak,
        peak,
        time.perf_counter() - t0,
        live,
        opt_peak,
    )
    return mem, list(rec.ops)


def replica_program(program: list[Op], block: int, d: int) -> list[Op]:
    """Replica 0's program of a rank as replica `d` issues it: the groups inside replica 0 (its `block` =
    pp x tp ranks: pipeline, tensor-parallel, vocabulary, tied ends), their roots and the p2p peers moved by
    d * block; the data-parallel and world groups, which span replicas, are the same (a ZeRO-1 broadcast's root
    is the owner's global rank on every replica). tests/test_dryrun.py runs a rank of replica 1 for real and
    compares."""
    return _moved(program, lambda members: all(r < block for r in members), lambda r: r + d * block if r < block else r)


def tp_program(program: list[Op], tp: int, t: int) -> list[Op]:
    """TP rank 0's program of a stage as the stage's TP rank `t` issues it: the groups of TP coordinate 0 (its
    pipeline and data-parallel groups, host ones too: every member a TP rank 0), their roots and the p2p peers
    (the counterpart stages) moved by t; the groups that hold every TP rank (the stage's TP group, the replica's
    vocabulary group, the world) are the same, and so are their roots (a vocabulary broadcast is rooted at the
    stage's TP rank 0 on every TP rank). tests/test_dryrun_tp.py runs TP rank 1 for real and compares."""
    return _moved(program, lambda members: all(r % tp == 0 for r in members), lambda r: r + t)


def _moved(program: list[Op], inside, move) -> list[Op]:
    """`program` with every group whose members satisfy `inside` renamed by `move` (its members and root), and
    every p2p peer moved."""
    out = []
    for op in program:
        c, root = op.comm, op.root
        if c and inside(op.members()):
            kind, k = c.split(":", 1)[0], c.rsplit("#", 1)[1]
            c = f"{kind}:{tuple(move(r) for r in op.members())}#{k}"
            root = None if root is None else move(root)
        p2p = tuple((x, move(p), nb) for x, p, nb in op.p2p)
        out.append(dataclasses.replace(op, comm=c, p2p=p2p, root=root))
    return out
