"""LoRA under bf16 mixed precision holds its frozen base weights in bf16: 2 bytes per frozen decoder weight,
no fp32 copy and no per-step bf16 cast of it; adapters keep fp32 masters. On 2 ranks (V-Half vocab-1, whose
split backward routes the base layers through its own linear; marked slow: 1F1B vocab-2, V-Half baseline):

- the held bytes: every frozen nn.Linear weight of the decoder layers is bf16 (2 bytes per parameter; the
  old code held fp32: 4, plus a bf16 copy each step), the adapters fp32, and the step makes no frozen copies;
- the loss and every adapter gradient are bit for bit those of `frozen_in_compute_dtype: false` (the fp32
  base cast each step): the cast of a frozen weight is the same tensor every step;
- numerics against single-process peft whose base was cast to bf16 (adapters fp32, torch.autocast bf16):
  loss and adapter gradients to bf16 precision.

The first check fails on the code before `AdapterConfig.frozen_in_compute_dtype` (fp32 frozen weights).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.grads import gathered_grads
from helpers.tiny import tiny_llama
from vp_accelerate.distributed import spawn

pytest.importorskip("peft", reason="LoRA needs the lora extra (pip install peft)")

TARGETS = ["q_proj", "v_proj", "down_proj"]
SEED = 7
FAST = [("vhalf", "vocab-1")]  # VP, and the split backward's own linear on the base layers
SLOW = [("1f1b", "vocab-2"), ("vhalf", "baseline")]


def _on_ranks(ckpt: str, ids, labels, configs):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.adapter_config import AdapterConfig
    from vp_accelerate.runtime.precision import frozen_matmul_weights

    out = {}
    for schedule, method in configs:
        for held in (True, False):
            pipe = PipelineModel(
                ckpt,
                PipelineConfig(
                    schedule=schedule,
                    method=method,
                    microbatches=4,
                    attn_implementation="eager",
                    mixed_precision="bf16",
                ),
                seed=SEED,
                adapter=AdapterConfig(type="lora", r=4, alpha=8, target_modules=TARGETS, frozen_in_compute_dtype=held),
            )
            chunks = list(pipe.mods.chunks.values())
            frozen = [
                p
                for c in chunks
                for m in c.modules()
                if isinstance(m, torch.nn.Linear)
                for p in [m.weight]
                if not p.requires_grad
            ]
            adapters = [p for n, p in pipe.named_parameters() if "lora_" in n]
            per_step_copies = sum(len(frozen_matmul_weights(c)) for c in chunks)
            res = pipe.train_step(ids, labels)
            grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
            out[(schedule, method, held)] = dict(
                frozen_bytes=sum(p.numel() * p.element_size() for p in frozen) / sum(p.numel() for p in frozen),
                adapter_dtypes={p.dtype for p in adapters},
                grad_dtypes={g.dtype for g in grads.values()},
                per_step_copies=per_step_copies,
                loss=res.loss,
                grads=grads,
                hf_grads=_gathered_grads(pipe),
            )
            pipe.close()
    return out


def _gathered_grads(pipe):
    """The adapters' gradients by HF name, in float32, on pipeline rank 0 (None elsewhere)."""
    sd = gathered_grads(pipe)
    return None if sd is None else {n: t.float() for n, t in sd.items() if "lora_" in n}


def _peft_bf16_base(ckpt: str, ids, labels):
    """peft with its base layers cast to bf16 (the adapters fp32), forward under autocast bf16."""
    from peft import LoraConfig, get_peft_model

    from vp_accelerate.models.lora import init_lora_weights, lora_modules

    base = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))
    init_lora_weights(lora_modules(model, lambda n: n.removeprefix("base_model.model.")), SEED)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad and m is not base.lm_head:
                m.weight.data = m.weight.data.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    loss.backward()
    grads = {n.removeprefix("base_model.model."): p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), {n: g for n, g in grads.items() if "lora_B" in n}  # B = 0 at the start: A gets none


def test_lora_base_held_in_bf16_matches_the_cast_each_step_and_peft(tmp_path):
    _check(tmp_path, FAST)


@pytest.mark.slow
def test_lora_base_held_in_bf16_on_more_schedules(tmp_path):
    _check(tmp_path, SLOW)


def _check(tmp_path, configs):
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_llama(101, tied=False, attn_implementation="eager"))
    ckpt = str(tmp_path / "ckpt")
    model.save_pretrained(ckpt)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 101, (8, 12), generator=g)
    labels = ids.clone()
    labels[0, 6:] = -100
    per_rank = spawn(_on_ranks, 2, ckpt, ids, labels, configs, timeout_s=600)
    ref_loss, ref_grads = _peft_bf16_base(ckpt, ids, labels)
    for r in range(2):
        for schedule, method in configs:
            new, old = per_rank[r][(schedule, method, True)], per_rank[r][(schedule, method, False)]
            what = (r, schedule, method, seed)
            assert new["frozen_bytes"] == 2 and old["frozen_bytes"] == 4, what
            assert new["per_step_copies"] == 0 and old["per_step_copies"] > 0, what
            assert new["adapter_dtypes"] == {torch.float32} and new["grad_dtypes"] == {torch.float32}, what
            assert new["loss"] == old["loss"], what  # bit for bit
            assert new["grads"].keys() == old["grads"].keys(), what
            for n, gr in new["grads"].items():
                assert torch.equal(gr, old["grads"][n]), (*what, n)
            assert new["loss"] == pytest.approx(ref_loss, rel=2e-2), what
            if r == 0:
                hf = new["hf_grads"]
                assert set(ref_grads) <= set(hf), (what, sorted(ref_grads)[:2], sorted(hf)[:2])
                for n in ref_grads:
                    got = hf[n]
                    err = (got - ref_grads[n]).norm() / ref_grads[n].norm()
                    assert err < 5e-2, (*what, n, err.item())
