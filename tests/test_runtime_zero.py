"""ZeRO-1 (`pipeline.zero: 1`): the optimizer state sharded over data parallelism gives bit for bit the
updates of today's unsharded AdamW (the reference: the same pipeline with `zero: 0`, itself tested against
HF in test_runtime_exact.py) — loss and every parameter after several steps, with weight decay groups,
clipping that bites, tied weights, fp16 loss scaling and LoRA — while each replica holds ~1/d of the
optimizer state; and its state_dict (keyed by parameter name) resumes the run exactly."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.tiny import tiny_llama
from vp_accelerate.distributed import spawn
from vp_accelerate.runtime.zero import assign_owners

STEPS = 3
LORA = ("q_proj", "v_proj", "down_proj")


def test_owners_are_balanced_largest_first():
    assert assign_owners([10, 1, 1, 8, 3], 2) == [0, 0, 0, 1, 1]  # 10 + 1 + 1 and 8 + 3
    owners = assign_owners([5] * 7, 3)
    assert [owners.count(r) for r in range(3)] == [3, 2, 2]
    assert assign_owners([], 4) == []


def _batches(seed: int, vocab: int, rows: int, seq: int = 8):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (rows, seq), generator=g)
        labels = ids.clone()
        labels[0, seq // 2 :] = -100
        out.append((ids, labels))
    return out


def _run(ckpt, batches, config, zero, resume_at=None):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.adapter_config import AdapterConfig

    schedule, method, precision, lora = config
    pipe = PipelineModel(
        ckpt,
        PipelineConfig(
            schedule=schedule,
            method=method,
            microbatches=4,
            dp_size=int(torch.distributed.get_world_size()) // 2,
            zero=zero,
            mixed_precision=precision,
            attn_implementation="eager",
        ),
        dtype=None if precision else torch.float64,
        adapter=AdapterConfig(type="lora", r=4, alpha=8, target_modules=LORA) if lora else None,
    )

    def make():
        decay = [p for p in pipe.trainable_parameters() if p.dim() >= 2]
        rest = [p for p in pipe.trainable_parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}] + ([{"params": rest, "weight_decay": 0.0}] if rest else [])
        return pipe.make_optimizer(groups, torch.optim.AdamW, lr=1e-2, eps=1e-6)

    opt = make()
    losses, norms = [], []
    rows = batches[0][0].shape[0] // pipe.dp_size
    for step, (ids, labels) in enumerate(batches):
        if step == resume_at:  # a fresh optimizer continues from the state_dict every replica saved (merged)
            merged = {}
            for pp_rank, part in _all_gather((pipe.pp_rank, opt.state_dict())):
                if pp_rank != pipe.pp_rank:  # vocabulary shards of other pipeline ranks share the names
                    continue
                merged.setdefault("param_groups", part["param_groups"])
                merged.setdefault("state", {}).update(part["state"])
                merged["format"] = part.get("format")
            if method == "baseline":  # as a plain AdamW's state_dict (index-keyed: a checkpoint from before ZeRO)
                order = [n for g in merged["param_groups"] for n in g["params"]]
                groups, i = [], 0
                for g in merged["param_groups"]:
                    groups.append({**g, "params": list(range(i, i + len(g["params"])))})
                    i += len(g["params"])
                merged = {"param_groups": groups, "state": {order.index(n): v for n, v in merged["state"].items()}}
            opt = make()
            opt.load_state_dict(merged)
        sl = slice(pipe.dp_rank * rows, (pipe.dp_rank + 1) * rows)
        res = pipe.train_step(ids[sl], labels[sl])
        norms.append(pipe.clip_grad_norm_(0.05))  # below the norm: clipping changes every update
        pipe.step(opt)
        pipe.zero_grad()
        losses.append(res.loss)
    state_bytes = (
        opt.state_bytes() if zero else sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    )
    params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    out = (losses, norms, params, state_bytes, pipe.zero_sharded, pipe.loss_scaler is not None)
    pipe.close()
    return out


def _all_gather(obj):
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, obj)
    return parts


def _both(ckpt, batches, configs):
    results = {}
    for config in configs:
        results[config] = {z: _run(ckpt, batches, config, z) for z in (0, 1)}
        # the state_dict round trip: as a plain AdamW's index-keyed state (the baseline config) and by name
        # (LoRA); the fp16 run is not rerun (test time)
        results[config]["resumed"] = (
            results[config][1] if config[2] == "fp16" else _run(ckpt, batches, config, 1, resume_at=STEPS - 1)
        )
    return results


def _exact(values) -> list:
    """Floats compared bit for bit, a NaN equal to a NaN."""
    return ["nan" if v != v else v for v in values]


def _check(world: int, configs, tmp_path):
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    ckpt = str(tmp_path / "ckpt")
    AutoModelForCausalLM.from_config(tiny_llama(97, tied=True, num_layers=4)).save_pretrained(ckpt)
    dp = world // 2
    per_rank = spawn(_both, world, ckpt, _batches(seed, 97, rows=4 * dp), configs, timeout_s=600)
    for config in configs:
        for r, res in enumerate(per_rank):
            plain, zero, resumed = res[config][0], res[config][1], res[config]["resumed"]
            assert zero[4] and not plain[4], config  # sharded with zero 1 only
            # losses, gradient norms (an fp16 step that overflows has a NaN norm on both: the same value)
            assert _exact(zero[0]) == _exact(plain[0]) and _exact(zero[1]) == _exact(plain[1]), (config, r, seed)
            assert _exact(zero[0]) == _exact(resumed[0]), (config, r, seed)
            assert plain[2].keys() == zero[2].keys()
            for name in plain[2]:
                assert torch.equal(plain[2][name], zero[2][name]), (config, r, name, seed)
                assert torch.equal(resumed[2][name], zero[2][name]), (config, r, name, seed)
        # each replica of a pipeline rank holds a disjoint share: together the unsharded state, each ~1/dp of it
        for pp in range(2):
            shares = [per_rank[d * 2 + pp][config][1][3] for d in range(dp)]
            full = per_rank[pp][config][0][3]
            assert sum(shares) == full, (config, pp, shares, full)
            assert max(shares) < full / dp * 1.5, (config, pp, shares, full)
    return per_rank


def test_zero1_pp2_x_dp2_exact(tmp_path):
    configs = [
        ("1f1b", "baseline", None, False),  # tied embedding on two pipeline ranks, float64
        ("vhalf", "vocab-2", "fp16", False),  # loss scaling, fp32 masters
        ("1f1b", "vocab-1", None, True),  # LoRA: only the adapters have state
    ]
    per_rank = _check(4, configs, tmp_path)
    assert per_rank[0][configs[1]][0][5]  # the fp16 run had a loss scaler


@pytest.mark.slow
def test_zero1_pp2_x_dp4_exact(tmp_path):
    _check(8, [("1f1b", "vocab-2", None, False)], tmp_path)


def test_state_dict_copies_nothing_and_the_checkpoint_snapshot_copies_the_moments():
    """A save adds no device memory and no host wait on the main thread: `state_dict` hands out the live
    moments (no `_to_copy`, no `clone`: before, each moment went to the host there, one blocking transfer
    each, before the background snapshot began), and the checkpoint's snapshot (pinned host buckets on
    CUDA; emulated here with CPU buckets) holds this step's values bit for bit after the live ones change."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vp_accelerate.runtime.zero import ZeroOptimizer
    from vp_accelerate.train.persist import writer

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen.append(func)
            return out

    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    opt = ZeroOptimizer(
        [{"params": params}], torch.optim.AdamW, None, 0, [0], {p: f"p{i}" for i, p in enumerate(params)}
    )
    for p in params:
        p.grad = torch.randn_like(p)
    opt.inner.step()
    with Ops() as ops:
        sd = opt.state_dict()
    assert not [f for f in ops.seen if f in (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default)]
    before = {n: {k: v.clone() for k, v in s.items()} for n, s in sd["state"].items()}
    snap = writer.Snapshot(bucketed=("cpu",))
    saved = snap.copy(sd)
    snap.ready()
    for p in params:  # training goes on: the live moments change in place
        p.grad = torch.randn_like(p)
    opt.inner.step()
    for p, name in zip(params, ["p0", "p1"]):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert sd["state"][name][k].data_ptr() == opt.inner.state[p][k].data_ptr()  # live, not a copy
            assert torch.equal(saved["state"][name][k], before[name][k])  # the snapshot kept this step's
            assert not torch.equal(opt.inner.state[p][k], before[name][k])


def _fused_resume(saved_step_dtype):
    """Two replicas (dp 2, gloo) of fused AdamW: 3 steps straight, and 2 steps + a resume from the merged
    name-keyed state (as a checkpoint, read on the CPU) + 1 step. Returns both results and the restored
    `step` values' (type, dtype, device) next to the ones torch's own AdamW(fused=True).load_state_dict makes."""
    from vp_accelerate.runtime.zero import ZeroOptimizer

    torch.manual_seed(0)  # the same parameters and gradients on both replicas (grad_sync's result)
    shapes = [(6, 5), (5,), (4, 6), (3,)]
    init = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    group, rank = torch.distributed.group.WORLD, torch.distributed.get_rank()

    def make(values):
        params = [torch.nn.Parameter(t.detach().clone()) for t in values]
        names = {p: f"w{i}" for i, p in enumerate(params)}
        groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]
        return params, ZeroOptimizer(groups, torch.optim.AdamW, group, rank, [0, 1], names, lr=1e-2, fused=True)

    def steps(params, opt, which):
        for k in which:
            for p, g in zip(params, grads[k]):
                p.grad = g.clone()
            opt.step()

    params, opt = make(init)
    steps(params, opt, range(3))
    straight = [p.detach().clone() for p in params]

    params, opt = make(init)
    steps(params, opt, range(2))
    merged = {"format": "zero-1", "state": {}}
    for part in _all_gather(opt.state_dict()):
        merged["param_groups"] = part["param_groups"]
        for name, s in part["state"].items():  # the saving run's scalar dtype (float64 under a float64 default)
            merged["state"][name] = {**s, "step": s["step"].to(saved_step_dtype)}
    params, opt = make(params)  # the weights as saved, a fresh optimizer
    opt.load_state_dict(merged)
    got = [(type(s["step"]), s["step"].dtype, s["step"].device) for s in opt.inner.state.values()]
    assert got, "this replica owns no parameter"
    ref = torch.optim.AdamW(list(opt.inner.state), lr=1e-2, fused=True)
    ref_groups = [{**ref.param_groups[0], "params": list(range(len(opt.inner.state)))}]
    ref.load_state_dict(
        {"state": {i: merged["state"][opt.names[p]] for i, p in enumerate(opt.inner.state)}, "param_groups": ref_groups}
    )
    want = [(type(s["step"]), s["step"].dtype, s["step"].device) for s in ref.state.values()]
    steps(params, opt, [2])
    return straight, [p.detach().clone() for p in params], got, want


def test_zero1_resume_with_fused_adamw():
    """A ZeRO-1 resume under fused AdamW (fused runs on the CPU too) puts each `step` where torch's fused
    kernels read it: a float32 tensor on the parameter's device, as torch's own load_state_dict does, and
    continues the run exactly. Before, the step stayed as read from the checkpoint (a CPU scalar of the
    saving run's dtype), which fused CUDA kernels cannot use."""
    for straight, resumed, got, want in spawn(_fused_resume, 2, torch.float64, timeout_s=120):
        assert got and got == want
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
