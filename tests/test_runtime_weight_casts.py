"""Mixed precision holds one low-precision copy of each weight per step, whatever the microbatches in flight.

One rank, baseline method, the step's forwards all before its backwards (GPipe order), so m microbatches
are in flight at the peak. Each in-flight microbatch must add only its activations to the peak: before
the step-wide cast, every forward cast the weights for itself and its graph kept that copy until its
backward, so each microbatch in flight also added a whole bf16 copy of the rank's weights. The copies
are counted once, as weight copies, and are gone after the step. A LoRA base model's frozen decoder weights
are held in bf16 (no copy at all); the frozen full lm_head is cast once per step. The same rank also checks that the vocabulary passes leave the id check
to the host (no device sync per pass) and what dtype C0 / IB travel in.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from helpers.tiny import tiny_llama
from vp_accelerate.distributed import spawn

VOCAB = 256


def _gpipe(schedule):
    """The same actions with every forward first: all microbatches in flight before the first backward."""
    from vp_accelerate.schedule.ir import Op

    acts = schedule.actions[0]
    forwards = [a for a in acts if a.op is Op.F]
    return dataclasses.replace(schedule, actions=(tuple(forwards + [a for a in acts if a.op is not Op.F]),))


def _matmul_weight_bytes(pipe) -> int:
    """bf16 bytes of one copy of every nn.Linear weight in the chunks plus the full lm_head."""
    n = sum(m.weight.numel() for c in pipe.mods.chunks.values() for m in c.modules() if isinstance(m, torch.nn.Linear))
    return 2 * (n + pipe.mods.head.weight.numel())


def _trained_linear(pipe) -> int:
    """Parameters of the nn.Linear weights in the chunks that train (all of them, or LoRA's adapters)."""
    return sum(
        m.weight.numel()
        for c in pipe.mods.chunks.values()
        for m in c.modules()
        if isinstance(m, torch.nn.Linear) and m.weight.requires_grad
    )


def _memory(adapter):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel, memory

    copies = []  # weak references to every weight copy the meter saw, to check they are freed
    is_cast, add_copy = memory.is_parameter_cast, memory.ActivationMeter.add_weight_copy

    def spy_cast(t):
        found = is_cast(t)
        if found:
            copies.append(weakref.ref(t if t._base is None else t._base))
        return found

    def spy_add(self, t):
        copies.append(weakref.ref(t))
        return add_copy(self, t)

    memory.is_parameter_cast, memory.ActivationMeter.add_weight_copy = spy_cast, spy_add
    out = {}
    for m in (2, 8):
        pipe = PipelineModel(
            tiny_llama(VOCAB, hidden_size=64, num_layers=2, attn_implementation="eager"),
            PipelineConfig(
                schedule="1f1b", method="baseline", microbatches=m, mixed_precision="bf16", attn_implementation="eager"
            ),
            adapter=adapter,
        )
        pipe.schedule = _gpipe(pipe.schedule)
        ids = torch.randint(0, VOCAB, (m, 4), generator=torch.Generator().manual_seed(0))
        res = pipe.train_step(ids, ids)
        stats = pipe.stats()
        gc.collect()
        out[m] = dict(
            loss=res.loss,
            peak=res.peak_activation_bytes,
            copies=stats["weight_copy_bytes"],
            in_flight=stats["peak_activation_microbatches"],
            one_copy=_matmul_weight_bytes(pipe),
            trained_and_head=2 * (_trained_linear(pipe) + pipe.mods.head.weight.numel()),
            head=2 * pipe.mods.head.weight.numel(),
            seen=len(copies),
            alive=sum(r() is not None for r in copies),
        )
        copies.clear()
        pipe.close()
    return out


def _recomputed(adapter):
    """Loss and gradients with activation checkpointing none / selective / full under bf16. A recomputed
    layer casts its weights in backward as autocast does, while the forward used the step's shared
    copies (cached or, for frozen weights, swapped in): the gradients agree only if both are the same."""
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    out = {}
    for mode in ("none", "selective", "full"):
        pipe = PipelineModel(
            tiny_llama(VOCAB, hidden_size=32, num_layers=4, attn_implementation="eager"),
            PipelineConfig(
                schedule="1f1b",
                method="baseline",
                microbatches=4,
                mixed_precision="bf16",
                activation_checkpointing=mode,
                attn_implementation="eager",
            ),
            adapter=adapter,
        )
        ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
        res = pipe.train_step(ids, ids)
        out[mode] = (res.loss, {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None})
        pipe.close()
    return out


def _rank():
    from vp_accelerate.runtime.adapter_config import AdapterConfig

    lora = AdapterConfig(type="lora", r=4)
    return {
        "trainable": _memory(None),
        "lora": _memory(lora),
        "vocab": _vocab_passes(),
        "recomputed": _recomputed(None),
        "recomputed lora": _recomputed(lora),
    }


@pytest.fixture(scope="module")
def measured():
    (out,) = spawn(_rank, 1, timeout_s=600)  # one process for every case: a rank's start costs more than a step
    return out


@pytest.mark.parametrize("lora", [False, True], ids=["trainable", "lora"])
def test_microbatches_in_flight_share_one_low_precision_copy_of_the_weights(measured, lora):
    two, eight = measured["lora" if lora else "trainable"][2], measured["lora" if lora else "trainable"][8]
    assert (two["in_flight"], eight["in_flight"]) == (2, 8)
    one_copy = two["one_copy"]
    # the peak grows by the activations of the 6 extra microbatches only: each used to add a weight copy too
    per_microbatch = (eight["peak"] - two["peak"]) / 6
    assert 0 < per_microbatch < one_copy, (per_microbatch, one_copy)
    assert eight["peak"] == pytest.approx(4 * two["peak"], rel=0.05)  # activations alone: linear in flight
    for run in (two, eight):
        assert run["seen"] > 0 and run["alive"] == 0  # the copies die with the step
        if lora:  # the base held in bf16: copies of the head and the adapters only (LoRA A of layer 0
            # multiplies an input that needs no gradient: its weight is never saved)
            assert run["head"] <= run["copies"] <= run["trained_and_head"] < one_copy / 2, run
        else:
            assert run["copies"] == one_copy  # exactly one copy, counted once, for 2 or 8 in flight


@pytest.mark.parametrize("key", ["recomputed", "recomputed lora"])
def test_recomputed_layers_see_the_same_low_precision_weights(measured, key):
    runs = measured[key]
    loss, grads = runs["none"]
    assert grads  # LoRA: the adapters (and nothing frozen) have gradients
    for mode in ("selective", "full"):
        assert runs[mode][0] == loss, mode
        assert runs[mode][1].keys() == grads.keys()
        for name, g in grads.items():
            assert torch.equal(runs[mode][1][name], g), (mode, name)


def _vocab_passes():
    """Vocabulary passes (IF, S) at p=1: how often they check ids, what C0 / IB carry, and the host check."""
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.vocab import embedding, output_layer

    calls = []
    for module in (embedding, output_layer):
        original = module.check_token_ids
        module.check_token_ids = lambda *a, _f=original, **k: (calls.append(a[2]), _f(*a, **k))[1]
    exchanged = {}
    c0, ib = output_layer.broadcast_x, embedding.ib_broadcast
    output_layer.broadcast_x = lambda x, *a, **k: (exchanged.setdefault("C0", set()).add(str(x.dtype)), c0(x, *a, **k))[
        1
    ]
    embedding.ib_broadcast = lambda g, *a, **k: (exchanged.setdefault("IB", set()).add(str(g.dtype)), ib(g, *a, **k))[1]
    out = {}
    for mode in ("no", "bf16"):
        exchanged.clear()
        pipe = PipelineModel(
            tiny_llama(VOCAB, hidden_size=32, num_layers=2),
            PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=2, mixed_precision=mode),
        )
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
        pipe.train_step(ids, ids)
        out[mode] = (len(calls), {k: sorted(v) for k, v in exchanged.items()})
        bad = ids.clone()
        bad[1, 3] = VOCAB
        try:
            pipe.train_step(bad, ids)
        except ValueError as e:
            out[mode + " error"] = str(e)
        pipe.close()
    return out


def test_vocabulary_passes_leave_the_id_check_to_the_host_and_exchange_the_compute_dtype(measured):
    out = measured["vocab"]
    assert out["no"][0] == 0 and out["bf16"][0] == 0  # IF and S never ran the per-pass check (a device sync on GPUs)
    assert out["no"][1] == {"C0": ["torch.float32"], "IB": ["torch.float32"]}
    assert out["bf16"][1] == {"C0": ["torch.bfloat16"], "IB": ["torch.bfloat16"]}
    for mode in ("no", "bf16"):  # the host check still names the bad id
        assert f"token id {VOCAB} at sample 1, position 3 is outside the vocabulary" in out[mode + " error"]


def test_the_cost_model_counts_one_low_precision_copy_per_parameter():
    """The simulator's static memory under mixed precision: fp32 parameters (the master copy), fp32
    gradients, Adam's m and v, and the step's one 16-bit copy of the weights — not one per microbatch."""
    from vp_accelerate.cost import CostModel, shape_from_hf_config

    shape = shape_from_hf_config(tiny_llama(VOCAB, hidden_size=64, num_layers=4), seq=16)
    model = CostModel(shape, "vocab-2", chunk_rank=(0, 1), chunk_layers=(2, 2))
    for rank in (0, 1):
        assert model.static_bytes(rank) == model.rank_params(rank) * (4 + 4 + 8 + 2)


def _saved_weight_storages(
    lin: torch.nn.Linear, x: torch.Tensor, refs: list | None = None, keep: list | None = None
) -> set[int]:
    """Storages of the bf16 [out, in]-sized tensors one autocast forward of `lin` saves for backward
    (weak references to them go to `refs`; the tensors themselves to `keep`, so that a later cast cannot
    reuse a freed one's address)."""
    found = set()

    def pack(t):
        if t.dtype == torch.bfloat16 and t.numel() == lin.weight.numel():
            found.add(t.untyped_storage().data_ptr())
            if refs is not None:
                refs.append(weakref.ref(t if t._base is None else t._base))
            if keep is not None:
                keep.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x).float().sum().backward()
    return found


def test_the_step_region_holds_one_cast_and_runs_cuda_backward_on_the_calling_thread():
    from vp_accelerate.runtime.precision import step_weight_casts

    lin, x = torch.nn.Linear(8, 8), torch.randn(2, 8, requires_grad=True)
    kept: list = []  # both casts alive at once: two storages are two casts, not one address reused
    assert len(_saved_weight_storages(lin, x, keep=kept) | _saved_weight_storages(lin, x, keep=kept)) == 2
    refs: list = []
    with step_weight_casts(torch.device("cpu"), torch.bfloat16):
        shared = _saved_weight_storages(lin, x, refs) | _saved_weight_storages(lin, x, refs)
        assert len(shared) == 1 and torch.is_autocast_enabled("cpu") is False  # autocast itself stays off
        assert refs[0]() is not None  # the cache holds the copy while the step lasts
    assert refs and all(r() is None for r in refs)  # and lets it go when the step ends
    assert torch._C._is_multithreading_enabled()  # CPU backward runs on the calling thread anyway
    # on CUDA the step's backward runs on the calling thread, where the region is open; restored after
    with step_weight_casts(torch.device("cuda"), torch.bfloat16):
        assert not torch._C._is_multithreading_enabled()
    assert torch._C._is_multithreading_enabled()


class _Bf16WeightShaped(torch.utils._python_dispatch.TorchDispatchMode):
    """Live and peak bytes of the bf16 tensors shaped like a weight (the step's weight copies and the 16-bit
    weight gradients), each storage from the op that made it until it dies."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.live, self.peak, self.seen = shapes, 0, 0, {}

    def _free(self, key, nbytes):
        self.live -= nbytes
        self.seen.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and tuple(t.shape) in self.shapes:
                s = t.untyped_storage()
                if id(s) not in self.seen:
                    self.live += s.nbytes()
                    self.peak = max(self.peak, self.live)
                    self.seen[id(s)] = weakref.finalize(s, self._free, id(s), s.nbytes())
        return out


def _one_step(autocast_cache: bool, seed: int, schedule: str = "1f1b", method: str = "vocab-2", ckpt: str = "none"):
    """A 2-rank 1F1B bf16 step (no split backward); `autocast_cache`: the trainable weights' copies left to
    autocast's cache as before (StepCasts.trainable makes none). Returns (gradients, peak bf16 bytes shaped
    like a weight, one bf16 copy of the rank's decoder weights)."""
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.step_casts import StepCasts

    made = StepCasts.trainable
    if autocast_cache:
        StepCasts.trainable = lambda self, chunk: []
    try:
        torch.manual_seed(seed)
        cfg = PipelineConfig(
            schedule=schedule, method=method, microbatches=4, mixed_precision="bf16", activation_checkpointing=ckpt
        )
        pipe = PipelineModel(tiny_llama(VOCAB, num_layers=4 if schedule == "1f1b" else 8), cfg)
        linears = [m.weight for c in pipe.mods.chunks.values() for m in c.modules() if isinstance(m, torch.nn.Linear)]
        count = _Bf16WeightShaped({tuple(w.shape) for w in linears})
        # 20 tokens a microbatch: no activation is shaped like a weight (dims 16, 32, 64)
        ids = torch.randint(0, VOCAB, (4, 20), generator=torch.Generator().manual_seed(seed))
        with count:
            pipe.train_step(ids, labels=ids)
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        pipe.close()
    finally:
        StepCasts.trainable = made
    return grads, count.peak, 2 * sum(w.numel() for w in linears)


def _both(seed: int, *layout):
    return _one_step(True, seed, *layout), _one_step(False, seed, *layout)


def test_a_weight_gradient_goes_into_the_fp32_grad_as_soon_as_it_is_made():
    """1F1B under bf16: each trainable linear's 16-bit gradient is added into its fp32 .grad as soon as autograd
    has it (the step's copies are leaves with a hook: `StepCasts.trainable`), bit for bit the gradients of
    autocast's cached cast, whose conversion autograd ran last in each backward, with the whole chunk's
    16-bit weight gradients alive until then. Measured as the peak of weight-shaped bf16 tensors: before, the
    step's copies plus all their gradients (about 2 copies of the rank's weights); now the copies plus about
    one weight's gradient."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    for rank, ((grads_before, peak_before, copy), (grads_now, peak_now, _)) in enumerate(spawn(_both, 2, seed)):
        assert grads_before.keys() == grads_now.keys()
        for name, g in grads_before.items():
            assert torch.equal(g, grads_now[name]), (rank, name)
        assert peak_before >= 1.9 * copy, (rank, peak_before, copy)
        assert peak_now <= 1.4 * copy, (rank, peak_now, copy)


def test_weight_copies_recompute_and_the_baseline_head_give_the_same_gradients():
    """The same bit-for-bit gradients where the copies are also swapped in for B (interleaved, every layer
    recomputed under full checkpointing) and where the baseline's full lm_head gets one."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    for rank, ((before, _, _), (now, _, _)) in enumerate(spawn(_both, 2, seed, "interleaved", "baseline", "full")):
        assert before.keys() == now.keys()
        for name, g in before.items():
            assert torch.equal(g, now[name]), (rank, name)
