"""Checkpoint -> shard -> export round trips, deterministic sharded init, vocabulary resizing."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.tiny import tiny_config
from vp_accelerate.models import StageLayout, assemble_state_dict, build_rank, resolve_config, save_hf
from vp_accelerate.models import weights as weights_mod
from vp_accelerate.vocab.partition import VocabPartition


def seeded_model(family, **cfg):
    torch.manual_seed(7)
    return AutoModelForCausalLM.from_config(tiny_config(family, **cfg), attn_implementation="eager")


def build_all(source, layout, placement, vocab_size=None, **kw):
    V = vocab_size or resolve_config(source).vocab_size
    part = VocabPartition(V, layout.num_ranks) if placement == "vocab" else None
    return [
        build_rank(source, layout, r, placement, part, vocab_size=vocab_size, **kw) for r in range(layout.num_ranks)
    ]


def export_offline(rms, out_dir):
    """Per-rank state dicts (what checkpoints hold) -> one HF directory, in one process."""
    sds = [{n: t for n, t in rm.state_dict().items() if not rm.is_duplicate(n)} for rm in rms]
    sd = assemble_state_dict(sds, rms[0].vocab_size, rms[0].sharded_names)
    return save_hf(sd, rms[0].config, out_dir)


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize(
    "family,tie,shard",
    [("llama", False, None), ("gemma", None, "30KB"), ("gpt2", None, "30KB"), ("qwen3", False, "30KB")],
)
def test_checkpoint_shard_export_roundtrip(tmp_path, family, tie, shard):
    """save_pretrained (sharded or not) -> build every rank reading only its tensors -> export -> same model."""
    ref = seeded_model(family, tie=tie)
    ref.save_pretrained(tmp_path / "ckpt", **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    for placement, layout in (
        ("vocab", StageLayout.v_shape(4, 2)),
        ("vocab", StageLayout.one_per_rank(4, 3)),
        ("baseline", StageLayout.one_per_rank(4, 3)),
    ):
        rms = build_all(str(tmp_path / "ckpt"), layout, placement)
        if placement == "vocab":
            part = rms[0].partition
            for rm in rms:  # padded rows are zero, a tied model holds one tensor
                assert rm.embed_weight.shape[0] == part.shard_size
                assert rm.embed_weight[part.valid_rows(rm.rank) :].abs().sum() == 0
                assert (rm.head_weight is rm.embed_weight) == ref.config.tie_word_embeddings
        out = export_offline(rms, tmp_path / f"out-{placement}-{layout.num_chunks}")
        back = AutoModelForCausalLM.from_pretrained(out)
        assert back.config.tie_word_embeddings == ref.config.tie_word_embeddings
        if ref.config.tie_word_embeddings:
            assert back.lm_head.weight is back.get_input_embeddings().weight
        assert_same_weights(ref, back)


def test_checkpoint_rank_reads_only_its_tensors_and_rows(tmp_path, monkeypatch):
    """A middle rank reads its own layers and only its shard's rows of the vocabulary matrices."""
    ref = seeded_model("llama", tie=False, num_layers=6)
    ref.save_pretrained(tmp_path / "ckpt", max_shard_size="30KB")
    reads = []
    orig_get, orig_rows = weights_mod.SafetensorsSource.get, weights_mod.SafetensorsSource.rows
    monkeypatch.setattr(
        weights_mod.SafetensorsSource, "get", lambda self, name: reads.append((name, None)) or orig_get(self, name)
    )
    monkeypatch.setattr(
        weights_mod.SafetensorsSource,
        "rows",
        lambda self, name, s, e: reads.append((name, (s, e))) or orig_rows(self, name, s, e),
    )
    layout = StageLayout.one_per_rank(6, 3)
    part = VocabPartition(ref.config.vocab_size, 3)
    build_rank(str(tmp_path / "ckpt"), layout, 1, "vocab", part)
    whole = {name for name, rows in reads if rows is None}
    assert whole == {n for n in ref.state_dict() if n.startswith(("model.layers.2.", "model.layers.3."))}
    start, end = part.shard_range(1)
    assert {(name, rows) for name, rows in reads if rows is not None} == {
        ("model.embed_tokens.weight", (start, end)),
        ("lm_head.weight", (start, end)),
    }


def test_fresh_init_is_the_same_full_init_for_every_layout(monkeypatch):
    """A rank's layers and shard rows equal the same rows of the one-rank init, whatever p and layout."""
    monkeypatch.setattr(weights_mod, "INIT_BLOCK_ROWS", 64)  # several init blocks, shards straddling them
    cfg = tiny_config("llama", tie=False)
    full = build_rank(cfg, StageLayout.one_per_rank(4, 1), 0, "vocab", VocabPartition(cfg.vocab_size, 1), seed=3)
    full_sd = full.state_dict()
    for layout in (StageLayout.one_per_rank(4, 3), StageLayout.v_shape(4, 2)):
        rms = build_all(cfg, layout, "vocab", seed=3)
        part = rms[0].partition
        for rm in rms:
            start, _ = part.shard_range(rm.rank)
            n = part.valid_rows(rm.rank)
            for name, t in rm.state_dict().items():
                if name in rm.sharded_names:
                    assert torch.equal(t[:n], full_sd[name][start : start + n]), name
                    assert t[n:].abs().sum() == 0
                else:
                    assert torch.equal(t, full_sd[name]), name
    other = build_rank(cfg, StageLayout.one_per_rank(4, 1), 0, "vocab", VocabPartition(cfg.vocab_size, 1), seed=4)
    assert not torch.equal(other.embed_weight, full.embed_weight)
    # The model's own init scheme: normal(0, initializer_range) matrices, ones for RMSNorm, padding row zero.
    std = cfg.initializer_range
    assert abs(full.embed_weight.std().item() - std) < 0.1 * std
    assert full.embed_weight[cfg.pad_token_id].abs().sum() == 0
    assert torch.equal(full_sd["model.norm.weight"], torch.ones(cfg.hidden_size))


@pytest.mark.parametrize("family,tie,delta", [("llama", False, 13), ("gemma", None, 13), ("qwen3", False, -10)])
def test_vocab_resize_matches_hf_mean_resizing(tmp_path, family, tie, delta):
    ref = seeded_model(family, tie=tie)
    V, new_v = ref.config.vocab_size, ref.config.vocab_size + delta
    rms = build_all(ref, StageLayout.v_shape(4, 2), "vocab", vocab_size=new_v)
    back = AutoModelForCausalLM.from_pretrained(export_offline(rms, tmp_path / "resized"))
    assert back.config.vocab_size == new_v
    ref.resize_token_embeddings(new_v, mean_resizing=True)
    for got, want in (
        (back.get_input_embeddings().weight, ref.get_input_embeddings().weight),
        (back.get_output_embeddings().weight, ref.get_output_embeddings().weight),
    ):
        assert got.shape == want.shape == (new_v, ref.config.hidden_size)
        assert torch.equal(got[: min(V, new_v)], want[: min(V, new_v)])
        # HF samples around the mean with covariance 1e-9 * cov: equal up to that noise.
        torch.testing.assert_close(got[V:], want[V:], atol=1e-4 * want[:V].abs().max().item(), rtol=0)
