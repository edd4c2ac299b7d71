"""Stage layouts, their errors, the unsupported-model error, and resident parameter bytes per rank."""

import pytest
import torch

from helpers.tiny import tiny_config
from vp_accelerate.models import LayoutError, StageLayout, UnsupportedModelError, build_rank, find_parts, meta_model
from vp_accelerate.vocab.partition import VocabPartition


def test_layout_constructors():
    one = StageLayout.one_per_rank(8, 4)
    assert one.chunk_layers == ((0, 2), (2, 4), (4, 6), (6, 8)) and one.chunk_rank == (0, 1, 2, 3)
    v = StageLayout.v_shape(8, 2)
    assert v.chunk_rank == (0, 1, 1, 0) and v.chunk_layers == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert v.first_rank == v.last_rank == 0 and v.chunks_of(0) == (0, 3) and v.layers_of(1) == (2, 3, 4, 5)
    inter = StageLayout.interleaved(10, 2, 2)
    assert inter.chunk_rank == (0, 1, 0, 1) and inter.chunk_layers == ((0, 3), (3, 6), (6, 8), (8, 10))
    redis = StageLayout.one_per_rank(8, 3, layer_counts=[2, 4, 2])
    assert redis.chunk_layers == ((0, 2), (2, 6), (6, 8)) and redis.num_layers == 8
    assert StageLayout.v_shape(6, 3).chunk_rank == (0, 1, 2, 2, 1, 0)


@pytest.mark.parametrize(
    "make,msg",
    [
        (lambda: StageLayout.one_per_rank(3, 4), "cannot split 3 decoder layers into 4 chunks"),
        (lambda: StageLayout.v_shape(5, 3), "cannot split 5 decoder layers into 6 chunks"),
        (lambda: StageLayout.interleaved(8, 2, 0), "chunks_per_rank must be >= 1"),
        (lambda: StageLayout.one_per_rank(8, 3, layer_counts=[2, 2, 2]), "sum to 6, but the model has 8"),
        (lambda: StageLayout.one_per_rank(8, 3, layer_counts=[4, 4]), "got 2 layer counts but this layout has 3"),
        (lambda: StageLayout.one_per_rank(8, 3, layer_counts=[4, 0, 4]), "needs at least one decoder layer"),
        (lambda: StageLayout(((0, 2), (3, 4)), (0, 1)), "chunk 1 starts at layer 3"),
        (lambda: StageLayout(((0, 2), (2, 4)), (0, 2)), "must use every rank"),
    ],
)
def test_impossible_layouts_say_why(make, msg):
    with pytest.raises(LayoutError, match=msg):
        make()


def test_layout_must_fit_the_model_and_vocab_needs_a_partition():
    cfg = tiny_config("llama")
    with pytest.raises(LayoutError, match="layout covers 6 decoder layers but LlamaForCausalLM has 4"):
        build_rank(cfg, StageLayout.one_per_rank(6, 2), 0, "baseline")
    with pytest.raises(ValueError, match="needs partition"):
        build_rank(cfg, StageLayout.one_per_rank(4, 2), 0, "vocab")
    with pytest.raises(ValueError, match="partition is for V=300"):
        build_rank(cfg, StageLayout.one_per_rank(4, 2), 0, "vocab", VocabPartition(300, 2))


def test_unsupported_model_names_the_missing_part_and_the_fix():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        "opt",
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=32,
        word_embed_proj_dim=16,
    )
    with pytest.raises(UnsupportedModelError, match=r"OPTForCausalLM .*no base_model_pp_plan.*ADAPTERS\[\"opt\"\]"):
        find_parts(meta_model(cfg))
    with pytest.raises(UnsupportedModelError, match="input embedding"):
        build_rank(cfg, StageLayout.one_per_rank(2, 1), 0, "baseline")


def _bytes_per_rank(cfg, layout, placement):
    part = VocabPartition(cfg.vocab_size, layout.num_ranks) if placement == "vocab" else None
    return [build_rank(cfg, layout, r, placement, part).param_bytes() for r in range(layout.num_ranks)]


@pytest.mark.slow  # slow: builds every rank of a 256k vocabulary (7 s); the memory tests of test_runtime_exact check the balance in bytes
def test_vocab_parallel_balances_parameter_memory_at_256k_vocab():
    """With VP the ranks' resident bytes differ by at most one decoder layer plus padding; baseline does not."""
    V, p = 256_000 + 3, 4  # not divisible by p: the last shard has padding rows
    cfg = tiny_config("llama", vocab_size=V, hidden_size=64, num_layers=8, tie=False)
    model = meta_model(cfg)
    layer_bytes = sum(t.numel() * 4 for t in model.model.layers[0].parameters())
    norm_bytes = sum(t.numel() * 4 for t in model.model.norm.parameters())
    part = VocabPartition(V, p)
    pad_bytes = 2 * (part.padded_size - V) * cfg.hidden_size * 4
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, layout in (
            ("1f1b", StageLayout.one_per_rank(8, p)),
            ("vshape", StageLayout.v_shape(8, p)),
            ("1f1b-uneven", StageLayout.one_per_rank(8, p, layer_counts=[3, 2, 2, 1])),
        ):
            vp = _bytes_per_rank(cfg, layout, "vocab")
            base = _bytes_per_rank(cfg, layout, "baseline")
            print(f"\n{name} V={V} h=64 L=8 p={p}: vocab bytes {vp}; baseline bytes {base}")
            counts = [len(layout.layers_of(r)) for r in range(p)]
            # Even splits differ by at most one layer; a deliberate uneven split by its count difference.
            spread = max(1, max(counts) - min(counts))
            assert max(vp) - min(vp) <= spread * layer_bytes + norm_bytes + pad_bytes, (name, vp)
            assert max(base) - min(base) >= V * cfg.hidden_size * 4  # a whole vocabulary matrix of imbalance
    finally:
        torch.set_num_threads(n)
