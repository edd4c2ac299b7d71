"""The planner's memory model against the dry run on other families than Llama (issue 48 item 4: within 5% per
rank, both ways). `scripts/bench_planner_memory.py` sweeps the published shapes (docs/large_models.md); here a
tiny shape per fixed term, and the heavier sweep cells in the slow run."""

from __future__ import annotations

import dataclasses

import pytest

from vp_accelerate.dryrun.world import dry_run_world, planned_bytes
from vp_accelerate.runtime.config import PipelineConfig

QWEN3_WIDE_HEADS = dict(
    model_type="qwen3",
    vocab_size=4099,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    tie_word_embeddings=True,
    use_sliding_window=False,
    sliding_window=None,
)
"""Qwen3-0.6B's proportions at a tiny size: heads x head_dim (256) twice the hidden size, q/k norms, tied."""


def deviations(conf: dict, schedule: str, method: str, seq: int, microbatches: int, pp: int = 2, ckpt="none"):
    """Per rank (planned / dry-run peak - 1), one replica of `pp` ranks, bf16 with SDPA, as `vp-accelerate
    dryrun` runs it."""
    return deviations_with(conf, schedule, method, seq, microbatches, pp, ckpt)


def deviations_with(conf, schedule, method, seq, microbatches, pp=2, ckpt="none", attention="sdpa"):
    """`deviations` with the attention kernel given (eager for a family without SDPA)."""
    from transformers import AutoConfig

    from vp_accelerate.sim.plan import PlanRequest

    cfg = PipelineConfig(
        schedule=schedule,
        method=method,
        microbatches=microbatches,
        pp_size=pp,
        mixed_precision="bf16",
        attn_implementation="sdpa",
        activation_checkpointing=ckpt,
    )
    cfg = dataclasses.replace(cfg, attn_implementation=attention)
    result = dry_run_world(AutoConfig.for_model(**conf), cfg, pp, microbatches, seq)
    req = PlanRequest(gpus=pp, memory_gb=80.0, seq=seq, global_batch=microbatches)
    return [p / m.peak_bytes - 1 for m, p in zip(result.ranks, planned_bytes(conf, req, cfg))]


def test_head_dim_apart_from_the_hidden_size_and_head_norms_are_priced():
    """q, k, v and o_proj's widths are heads x head_dim, not the hidden size, in the parameters, FLOPs and kept
    activations, and Qwen3's q/k norms keep their fp32 input, rsqrt and normalised output. On Qwen3-0.6B (8 layers,
    1f1b/baseline pp 4, seq 1024) the planner was 26% under the dry run on rank 1, now 1.4%; this tiny shape was
    -15% / -13% (ranks 0 / 1) before, -2.0% / -2.4% now (1.2 s of CPU)."""
    devs = deviations(QWEN3_WIDE_HEADS, "1f1b", "vocab-2", seq=256, microbatches=4)
    assert all(abs(d) < 0.05 for d in devs), devs


@pytest.mark.parametrize("family", ["qwen3", "gemma", "llama"])
def test_layer_params_count_the_heads_width(family):
    """A decoder layer's matrices hold `layer_params` elements exactly when head_dim is not hidden / heads (q and
    o_proj are h x heads * head_dim): was 2h^2 for q and o whatever head_dim said."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers.tiny import tiny_config
    from vp_accelerate.cost import shape_from_hf_config
    from vp_accelerate.models.adapter import find_parts

    cfg = tiny_config(family, num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # 64 wide on h 32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    layer = find_parts(model).layers[0]
    shape = shape_from_hf_config(cfg, seq=16)
    assert sum(p.numel() for p in layer.parameters() if p.dim() == 2) == shape.layer_params()
    assert shape.q_width() == 64


def test_the_baselines_vocabulary_ends_are_priced_as_their_backward_runs():
    """1f1b/baseline on a model whose vocabulary ends dominate (V 65536, h 64): the embedding is looked up in fp32
    (no 16-bit copy) and every B after the step's first adds a fresh dense fp32 [V, h] gradient into the held one,
    once the chunk's activations are gone; the loss's backward holds two fp32 [N, V] at once. Within 1% on both
    ranks (before: -5.8% on Qwen3-0.6B's last rank, -5.2% on Qwen3-8B's first; here -9% / -12%)."""
    conf = dict(
        model_type="llama",
        vocab_size=65536,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        tie_word_embeddings=False,
    )
    devs = deviations(conf, "1f1b", "baseline", seq=256, microbatches=4)
    assert all(abs(d) < 0.01 for d in devs), devs


GPT2_TINY = dict(
    model_type="gpt2",
    vocab_size=4099,
    n_embd=128,
    n_head=4,
    n_layer=2,
    n_positions=256,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
)


def test_gpt2_layers_and_attention_dropout_are_priced_as_a_gpu_runs_them():
    """GPT-2's layer: NewGELU ("gelu_new", elementwise Python ops) keeps three [N, ffn] tensors beside its input,
    LayerNorm no normalised copy, one cast for the fused c_attn; and the dry run's SDPA with attn_pdrop 0.1 counts
    what a GPU's kernel keeps (no [b, a, s, s] probabilities or dropout mask: the CPU's math path had them). GPT-2
    medium (8 layers, 1f1b/baseline pp 4, seq 1024): -64.8% before, -4.1% .. +0.2% now; here rank 1 (layers only)
    was -70% before (the dry run with the math path's probabilities, the planner without the activation's)."""
    devs = deviations(GPT2_TINY, "1f1b", "baseline", seq=256, microbatches=4)
    assert abs(devs[1]) < 0.05, devs


def test_the_dry_runs_sdpa_counts_a_gpu_kernels_dropout():
    """SDPA with attention dropout keeps on a GPU what it keeps without (the flash and memory-efficient kernels drop
    inside the kernel); the CPU's only dropout path is the math one ([b, a, s, s] scores, probabilities, mask), which
    the dry run counted before: GPT-2 medium's dry run was 2.9x the planner's figure with it."""
    from transformers import AutoConfig

    from vp_accelerate.dryrun.run import run_rank

    cfg = PipelineConfig(
        schedule="1f1b", method="vocab-2", microbatches=2, pp_size=2, mixed_precision="bf16", attn_implementation="sdpa"
    )
    peaks = []
    for p in (0.0, 0.1):
        conf = AutoConfig.for_model(**dict(GPT2_TINY, n_layer=2, attn_pdrop=p))
        peaks.append(run_rank(conf, cfg, 1, 2, 2, 256)[0].peak_bytes)
    assert peaks[0] == peaks[1], peaks


FAMILY_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma",
    "gemma2",
    "phi3",
    "gpt2",
    "gpt_neox",
    "cohere",
    "granite",
)


@pytest.mark.parametrize("family", FAMILY_TYPES)
def test_the_family_sets_match_the_modules(family):
    """The planner's per-family sets (cost/shape.py) against each family's HF modules on the meta device: q/k norms,
    no SDPA path, nn.LayerNorm, a fused q/k/v linear, sandwich norms."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    from helpers.tiny import tiny_config
    from vp_accelerate.cost import shape as sh
    from vp_accelerate.models.adapter import find_parts

    cfg = tiny_config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    layer = find_parts(model).layers[0]
    names = {n.rsplit(".", 1)[-1] for n, _ in layer.named_modules()}
    assert ("q_norm" in names) == (family in sh.HEAD_NORM_TYPES)
    assert (not type(model)._supports_sdpa) == (family in sh.NO_SDPA_TYPES)
    assert any(type(m) is nn.LayerNorm for m in layer.modules()) == (family in sh.LAYER_NORM_TYPES)
    assert bool(names & {"c_attn", "query_key_value", "qkv_proj"}) == (family in sh.FUSED_QKV_TYPES)
    assert ("post_feedforward_layernorm" in names) == (family in sh.SANDWICH_NORM_TYPES)


def _bench_shapes() -> dict:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "bench_planner_memory.py"
    spec = importlib.util.spec_from_file_location("bench_planner_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SHAPES


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["qwen3-0.6b", "gemma-2-9b", "gpt2-medium", "pythia-1.4b", "qwen2-7b"])
@pytest.mark.parametrize("layout", [("1f1b", "baseline"), ("1f1b", "vocab-2")])
def test_published_family_shapes_within_5_percent(shape, layout):
    """Sweep cells of scripts/bench_planner_memory.py at 4 layers, pp 2, seq 1024: every rank within 5% both ways
    (before: Qwen3-0.6B -26%, Gemma-2-9B -15% (and no dry run: SDPA refused), GPT-2 medium -65%, Pythia +5.8%)."""
    conf = dict(_bench_shapes()[shape])
    conf["n_layer" if conf["model_type"] == "gpt2" else "num_hidden_layers"] = 4
    if conf["model_type"] == "gemma2":
        conf["layer_types"] = ["full_attention"] * 4
    from vp_accelerate.cost.shape import default_attention

    devs = deviations_with(conf, *layout, seq=1024, microbatches=4, attention=default_attention(conf))
    assert all(abs(d) < 0.05 for d in devs), devs
