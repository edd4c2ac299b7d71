"""The cost model's model shape matches the real HF modules: the MLP's matrix count (FLOPs, MFU, params)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.tiny import FAMILIES, tiny_config
from vp_accelerate.cost import shape_from_hf_config
from vp_accelerate.cost.shape import mlp_matrices
from vp_accelerate.models.adapter import find_parts


@pytest.mark.parametrize("family", FAMILIES)
def test_mlp_matrices_match_the_modules(family):
    """Every supported family: the MLP weights of a decoder layer hold mlp_matrices * h * ffn elements."""
    cfg = tiny_config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    mlp = find_parts(model).layers[0].mlp
    shape = shape_from_hf_config(cfg, seq=16)
    weights = sum(p.numel() for p in mlp.parameters() if p.dim() == 2)
    assert weights == shape.mlp_matrices * shape.hidden * shape.ffn


@pytest.mark.parametrize(
    "model_type", ["apertus", "arcee", "jais2", "phi", "starcoder2", "cohere2", "olmo2", "glm4", "exaone4", "smollm3"]
)
def test_mlp_matrices_of_more_families(model_type):
    """Families beyond the tiny test set, at their default sizes on the meta device (no memory)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, num_hidden_layers=1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shape = shape_from_hf_config(cfg, seq=16)
    mlp = model.model.layers[0].mlp
    assert sum(p.numel() for p in mlp.parameters() if p.dim() == 2) == shape.mlp_matrices * shape.hidden * shape.ffn


def test_cohere_and_granite_count_the_gated_mlp():
    for family in ("cohere", "granite"):
        shape = shape_from_hf_config(
            {
                "model_type": family,
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "intermediate_size": 128,
                "vocab_size": 100,
            },
            seq=8,
        )
        assert shape.mlp_matrices == 3
        n, h = shape.tokens, shape.hidden
        assert shape.layer_linear_flops() == 8 * n * h * h + 2 * 3 * n * h * 128
    assert mlp_matrices("gpt2") == mlp_matrices("gpt_neox") == mlp_matrices("") == 2


@pytest.mark.slow
def test_mlp_matrices_of_every_verified_dense_family():
    """Every family models/ verifies, at tiny size on the meta device; mixture-of-experts MLPs are not
    modelled by ModelShape (their FLOPs follow the routed experts) and are left out."""
    from vp_accelerate.bench.coverage import tiny_family_config
    from vp_accelerate.models.verified import VERIFIED

    wrong = []
    for model_type in sorted(VERIFIED):
        cfg = tiny_family_config(model_type)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        mlp = getattr(find_parts(model).layers[0], "mlp", None)
        if mlp is None or any("expert" in name for name, _ in mlp.named_modules()):
            continue
        shape = shape_from_hf_config(cfg, seq=16)
        weights = sum(p.numel() for p in mlp.parameters() if p.dim() == 2)
        if weights != shape.mlp_matrices * shape.hidden * shape.ffn:
            wrong.append((model_type, weights / (shape.hidden * shape.ffn), shape.mlp_matrices))
    assert not wrong, wrong


def test_grouped_query_attention_counts_k_and_v_at_their_width():
    """Llama-3-70B: q and o 8192^2, k and v 8192 x 1024 (8 kv heads of 128), MLP 3 x 8192 x 28672."""
    config = {
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    }
    shape = shape_from_hf_config(config, seq=4096)
    assert shape.layer_params() == 2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 == 855_638_016
    assert shape.layer_linear_flops() == 2 * 4096 * 855_638_016
    mha = shape_from_hf_config({**config, "num_key_value_heads": 64}, seq=4096)
    assert mha.layer_params() == 4 * 8192**2 + 3 * 8192 * 28672  # without GQA: the paper's 4h^2
    assert shape.model_flops() < mha.model_flops()
