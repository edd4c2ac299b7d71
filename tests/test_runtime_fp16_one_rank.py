"""fp16: when the gradients of ONE rank overflow, every rank skips the step.

Each rank only sees its own parameters' gradients, so the decision must be shared (an all-reduce of
the overflow flag over the pipeline): were it taken per rank, the ranks without an inf would step and
the pipeline's weights would drift apart. Here an inf is injected into one decoder weight's gradient on
rank 1 only, at a scale that overflows nothing else.

The same ranks then run one step of `mixed_precision: pure-bf16`: bf16 parameters, gradients and AdamW
state, no autocast and no loss scaler, and the loss of the single-process bf16 HF model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.tiny import tiny_llama
from vp_accelerate.distributed import spawn


def _one_rank_overflows(ckpt: str):
    import torch.distributed as dist

    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    pipe = PipelineModel(
        ckpt,
        PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=2, mixed_precision="fp16"),
        dtype=torch.float32,
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.loss_scaler.scale = 8.0  # far from overflow on its own
    if dist.get_rank() == 1:
        name, weight = next((n, p) for n, p in pipe.named_parameters() if "layers" in n and "proj" in n)
        weight.register_hook(lambda g: g * float("inf"))
    before = [p.detach().clone() for p in pipe.parameters()]
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    res = pipe.train_step(ids, ids)
    own_inf = any(p.grad is not None and not torch.isfinite(p.grad).all() for p in pipe.parameters())
    stepped = pipe.step(opt)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, pipe.parameters()))
    pipe.close()
    return (own_inf, res.skipped, stepped, unchanged, pipe.loss_scaler.scale), _pure_bf16_step(ckpt, ids)


def _pure_bf16_step(ckpt: str, ids: torch.Tensor):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    pipe = PipelineModel(
        ckpt, PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=2, mixed_precision="pure-bf16")
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    res = pipe.train_step(ids, ids)
    dtypes = {str(p.dtype) for p in pipe.parameters()} | {str(p.grad.dtype) for p in pipe.parameters()}
    pipe.step(opt)
    dtypes |= {str(v.dtype) for s in opt.state.values() for v in s.values() if v.is_floating_point() and v.dim()}
    plain = (pipe.compute_dtype, pipe.loss_scaler, res.loss_scale)
    pipe.close()
    return res.loss, dtypes, plain


def test_one_rank_overflows_and_every_rank_skips(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    AutoModelForCausalLM.from_config(
        tiny_llama(97, hidden_size=64, num_layers=4, attn_implementation="eager")
    ).save_pretrained(ckpt)
    ((inf0, *rank0), pure0), ((inf1, *rank1), pure1) = spawn(_one_rank_overflows, 2, ckpt)
    assert not inf0 and inf1  # only rank 1 saw an inf in its own gradients
    for skipped, stepped, unchanged, scale in (rank0, rank1):
        assert skipped and not stepped and unchanged
        assert scale == 4.0  # halved on both ranks alike
    # pure-bf16: everything bf16 on both ranks, no autocast, no loss scale; the loss of the bf16 model
    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.bfloat16)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids).loss.item()
    for loss, dtypes, plain in (pure0, pure1):
        assert dtypes == {"torch.bfloat16"} and plain == (None, None, 1.0)
        assert abs(loss - want) < 2e-2 * want and loss == pure0[0]


def test_pure_bf16_refuses_fp32_parameters_before_any_group(tmp_path):
    import torch.distributed as dist

    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    with pytest.raises(ValueError, match="mixed_precision=pure-bf16 keeps the parameters in torch.bfloat16"):
        PipelineModel("llama-tiny", PipelineConfig(mixed_precision="pure-bf16"), dtype=torch.float32)
    with pytest.raises(ValueError, match="mixed_precision=bf16 keeps the parameters in torch.float32"):
        PipelineModel("llama-tiny", PipelineConfig(mixed_precision="bf16"), dtype=torch.bfloat16)
    assert not dist.is_initialized()
