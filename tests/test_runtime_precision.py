"""Mixed precision keeps fp32 master weights and still trains like the model: 3 AdamW steps in bf16 / fp16
compute on 2 ranks against the single-process float64 HF model, and the fp16 loss scaler's skip."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from helpers.tiny import tiny_llama
from vp_accelerate.distributed import spawn
from vp_accelerate.runtime.precision import LossScaler, resolve

CONFIGS = [("1f1b", "vocab-2"), ("vhalf", "vocab-1"), ("1f1b", "baseline")]  # vhalf: deferred weight gradients
STEPS, LR = 3, 1e-3


def _config(vocab: int) -> LlamaConfig:
    return tiny_llama(vocab, hidden_size=64, num_layers=4, attn_implementation="eager")


def _batches(seed: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (4, 16), generator=g)
        labels = ids.clone()
        labels[1, 10:] = -100
        out.append((ids, labels))
    return out


def _record_exchanges(exchanged: set) -> None:
    """Record the dtype of every tensor a rank sends or receives: p2p batches, C0's X, IB's gradient.
    Call after building each pipeline (it installs its p2p transport into torch.distributed)."""
    import torch.distributed as dist

    from vp_accelerate.vocab import embedding, output_layer

    post = dist.batch_isend_irecv

    def posted(ops):
        exchanged.update(("p2p", str(op.tensor.dtype)) for op in ops)
        return post(ops)

    dist.batch_isend_irecv = posted
    if hasattr(output_layer.broadcast_x, "recorded"):
        return
    c0, ib = output_layer.broadcast_x, embedding.ib_broadcast

    def broadcast_x(x, *args, **kwargs):
        exchanged.add(("C0", str(x.dtype)))
        return c0(x, *args, **kwargs)

    def ib_broadcast(grad, *args, **kwargs):
        exchanged.add(("IB", str(grad.dtype)))
        return ib(grad, *args, **kwargs)

    broadcast_x.recorded = True
    output_layer.broadcast_x, embedding.ib_broadcast = broadcast_x, ib_broadcast


def _train(ckpt: str, batches, mode: str):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    out = {}
    exchanged: set = set()  # (what, dtype) of every tensor that travelled between ranks
    for schedule, method in CONFIGS:
        pipe = PipelineModel(
            ckpt,
            PipelineConfig(
                schedule=schedule, method=method, microbatches=4, mixed_precision=mode, attn_implementation="eager"
            ),
            dtype=torch.float32,
        )
        _record_exchanges(exchanged)
        opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
        computed = set()  # the dtype decoder matmuls really ran in
        for chunk in pipe.mods.chunks.values():
            for mod in chunk.modules():
                if isinstance(mod, torch.nn.Linear):
                    mod.register_forward_hook(lambda m, i, o: computed.add(str(o.dtype)))
        losses, dtypes, skipped = [], set(), []
        for ids, labels in batches:
            res = pipe.train_step(ids, labels)
            dtypes |= {str(p.grad.dtype) for p in pipe.parameters() if p.grad is not None}
            skipped.append(res.skipped)
            pipe.step(opt)
            pipe.zero_grad()
            losses.append(res.loss)
        dtypes |= {str(p.dtype) for p in pipe.parameters()}
        dtypes |= {
            str(v.dtype) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.is_floating_point()
        }
        out[(schedule, method)] = (losses, pipe.gather_hf_state_dict(), dtypes, skipped, computed)
        pipe.close()
    out["exchanged"] = exchanged
    return out


def _reference(ckpt: str, batches):
    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float64)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids, labels in batches:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, init, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["bf16", "fp16"])  # CPU autocast runs both
def test_mixed_precision_trains_like_float64_with_fp32_master_weights(tmp_path, mode):
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    vocab = 97
    ckpt = str(tmp_path / "ckpt")
    AutoModelForCausalLM.from_config(_config(vocab)).save_pretrained(ckpt)
    batches = _batches(seed, vocab)
    per_rank = spawn(_train, 2, ckpt, batches, mode, timeout_s=600)
    ref_losses, init, ref = _reference(ckpt, batches)
    low = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[mode]
    for rank in per_rank:  # activations, gradients, C0 and IB travel in the compute dtype: half fp32's bytes
        assert rank["exchanged"] == {("p2p", low), ("C0", low), ("IB", low)}, rank["exchanged"]
    for key in CONFIGS:
        losses, params, dtypes, skipped, computed = per_rank[0][key]
        assert dtypes == {"torch.float32"}, (key, dtypes)  # parameters, gradients, AdamW state
        assert computed == {low} and per_rank[1][key][4] == {low}, (key, computed)
        assert per_rank[1][key][2] == {"torch.float32"}, key
        assert skipped == [False] * STEPS, key
        assert losses == pytest.approx(ref_losses, rel=2e-2), (key, seed)
        moved = []
        for name, r in ref.items():
            p = params[name].double()
            rel = (p - r).norm() / r.norm()
            assert rel < 5e-2, (key, name, float(rel), seed)
            # the updates themselves agree (weights alone would also be close with no training at all)
            update, ref_update = p - init[name], r - init[name]
            moved.append(float(torch.nn.functional.cosine_similarity(update.flatten(), ref_update.flatten(), dim=0)))
        assert min(moved) > 0.9, (key, min(moved), seed)


def _overflow(ckpt: str):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    pipe = PipelineModel(
        ckpt,
        PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=2, mixed_precision="fp16"),
        dtype=torch.float32,
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    before = [p.detach().clone() for p in pipe.parameters()]
    pipe.loss_scaler.scale = 2.0**120  # fp16 activation gradients overflow at once
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    res = pipe.train_step(ids, ids)
    stepped = pipe.step(opt)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, pipe.parameters()))
    pipe.zero_grad()
    res2 = pipe.train_step(ids, ids)
    pipe.close()
    return res.skipped, stepped, unchanged, pipe.loss_scaler.scale, res2.loss_scale, res.loss


def test_fp16_overflow_skips_the_step_on_every_rank_and_lowers_the_scale(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    AutoModelForCausalLM.from_config(_config(97)).save_pretrained(ckpt)
    for skipped, stepped, unchanged, scale, next_scale, loss in spawn(_overflow, 2, ckpt):
        assert skipped and not stepped and unchanged
        assert next_scale == 2.0**119  # halved once
        assert scale <= next_scale
        assert loss == pytest.approx(4.57, abs=0.5)  # the loss is still reported unscaled (≈ ln 97)


def test_loss_scaler_grows_after_clean_steps_and_resolve_names_the_choices():
    s = LossScaler(scale=8.0, growth_interval=2)
    s.update(False)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 16.0
    s.update(True)
    assert (s.scale, s.skipped_steps, s.clean_steps) == (8.0, 1, 0)
    restored = LossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored == s
    assert resolve(None) == "no" and resolve("BF16") == "bf16"
    with pytest.raises(ValueError, match="fp16"):
        resolve("fp8")


def test_trainer_takes_accelerates_mixed_precision_unless_the_recipe_sets_one():
    from types import SimpleNamespace

    from vp_accelerate.runtime import PipelineConfig
    from vp_accelerate.train.run.trainer import mixed_precision_for

    def recipe(mode):
        return SimpleNamespace(pipeline=PipelineConfig(mixed_precision=mode))

    assert mixed_precision_for(recipe(None), "bf16") == "bf16"
    assert mixed_precision_for(recipe(None), None) == "no"
    assert mixed_precision_for(recipe("fp16"), "bf16") == "fp16"  # the recipe wins
    assert mixed_precision_for(recipe("pure-bf16"), "bf16") == "pure-bf16"
    for flag in ("fp8", "pure-bf16"):  # accelerate has no pure-bf16: only the recipe can ask for it
        with pytest.raises(ValueError, match=f"--mixed_precision {flag} is not supported.*pure-bf16"):
            mixed_precision_for(recipe(None), flag)
