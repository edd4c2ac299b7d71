"""Decoder families from a saved checkpoint and from a config: exact on 2 ranks, or refused before any work.

The default run covers one family per mechanism (one 2-rank spawn): GPT-NeoX (output head stored as
`embed_out`, untied), Phi (lm_head bias sharded with the vocabulary rows), Gemma-3 (rotary embedding per
layer type, tied weights), Qwen2-MoE (experts fused from per-expert checkpoint tensors, shared expert).
Each is trained one step with vocab-2 and baseline from `save_pretrained`'s directory and from the config,
and its loss and every gradient are compared with the HF model (float64, 1e-5); `export_hf` writes the
checkpoint's own tensor names and reloads to the same weights; `eval_step` on the same checkpoint with
dropout 0.1 equals HF's `model.eval()` loss. The whole walk (docs/models.md) is `-m slow`.
"""

import json
from pathlib import Path

import pytest

from vp_accelerate.bench.coverage import check_families, decoder_families, tiny_family_config
from vp_accelerate.models import UnsupportedModelError, check_supported

MECHANISMS = ["gpt_neox", "phi", "gemma3_text", "qwen2_moe"]


def _assert_all_pass(results):
    bad = [(r.model_type, r.status, r.reason) for r in results if r.status != "pass"]
    assert not bad, bad
    for r in results:
        assert set(r.worst) >= {f"{s}/{m}" for s in ("checkpoint", "config") for m in ("vocab-2", "baseline")}
        assert max(r.worst.values()) <= 1e-5, (r.model_type, r.worst)


def test_one_family_per_mechanism_is_exact_from_checkpoint_and_config(tmp_path):
    results = check_families(MECHANISMS, tmp_path)
    _assert_all_pass(results)
    assert all("eval" in r.worst for r in results if r.model_type in ("gpt_neox", "phi")), (
        "families with dropout fields get the eval_step check"
    )


@pytest.mark.parametrize(
    "model_type,overrides,needle",
    [
        ("mixtral", dict(output_router_logits=True), "output_router_logits=True"),
        ("qwen3_moe", dict(output_router_logits=True), "load-balancing loss"),
        ("qwen3_5_text", {}, "linear_attention"),
        ("gemma3n_text", {}, "per-layer inputs"),
    ],
)
def test_unsupported_families_are_refused_naming_the_feature(model_type, overrides, needle):
    cfg = tiny_family_config(model_type, **overrides)
    with pytest.raises(UnsupportedModelError, match=needle):
        check_supported(cfg)


def test_pipeline_model_refuses_before_any_process_group():
    import torch.distributed as dist

    from vp_accelerate.runtime import PipelineModel

    with pytest.raises(UnsupportedModelError, match="output_router_logits"):
        PipelineModel(tiny_family_config("mixtral", output_router_logits=True))
    assert not dist.is_initialized()


def test_preflight_refuses_an_unsupported_checkpoint(tmp_path, capsys):
    import yaml
    from transformers import AutoModelForCausalLM

    from vp_accelerate.train.cli.commands import train_main

    model_dir = tmp_path / "moe"
    AutoModelForCausalLM.from_config(tiny_family_config("qwen2_moe", output_router_logits=True)).save_pretrained(
        model_dir
    )
    (tmp_path / "train.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    recipe = {
        "model": {"source": str(model_dir)},
        "tokenizer": {"source": str(model_dir)},
        "data": {"files": [str(tmp_path / "train.jsonl")], "seq_len": 16},
        "pipeline": {"microbatches": 2},
        "train": {"global_batch": 2},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code = train_main([str(path), "--check", "--world-size", "2"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "model.source: model_type 'qwen2_moe' has output_router_logits=True" in err, err


@pytest.mark.slow
def test_every_decoder_family_passes_or_is_refused(tmp_path):
    """The full walk: nothing crashes or differs, and at least 30 families run exactly."""
    results = check_families(decoder_families(), tmp_path, timeout_s=3600)
    bad = [(r.model_type, r.status, r.reason) for r in results if r.status in ("fail", "crash")]
    assert not bad, bad
    assert sum(r.status == "pass" for r in results) >= 30
    for r in results:
        if r.status == "refused":
            assert r.reason, r.model_type


def test_verified_list_is_the_documented_table():
    """models.verified.VERIFIED (what find_parts trusts without a warning) is exactly docs/models.md's passing rows."""
    from pathlib import Path

    from vp_accelerate.models import VERIFIED

    table = (Path(__file__).resolve().parent.parent / "docs" / "models.md").read_text()
    passing = {row.split("|")[1].strip() for row in table.splitlines() if row.startswith("| ") and "| pass |" in row}
    assert passing == set(VERIFIED)
    assert len(passing) >= 30
    documented = {row.split("|")[1].strip() for row in table.splitlines() if row.startswith("| ") and "|---" not in row}
    assert set(decoder_families()) <= documented | {"family"}, "a family of the installed transformers is missing"


def test_a_crashed_spawn_names_the_family_and_each_ranks_last_lines():
    """scripts/model_coverage.py's line for a family whose spawn failed: the family and every failing rank's
    last lines (before: only the error's last line, e.g. "rank 1 failed: process exited ..." without the family)."""
    import importlib.util

    from vp_accelerate.distributed import RankFailed

    spec = importlib.util.spec_from_file_location(
        "model_coverage", Path(__file__).resolve().parents[1] / "scripts" / "model_coverage.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    err = RankFailed(
        "2 of 2 ranks failed\nrank 0 failed: RuntimeError: boom\nTraceback (most recent call last):\n"
        '  File "x.py", line 3, in f\nRuntimeError: boom\nrank 1 failed: process exited with code -6 without reporting; its last lines: '
        "terminate called without an active exception"
    )
    line = mod.crash_reason("gpt_neox", err)
    assert line.startswith("gpt_neox: RankFailed: rank 0: ")
    assert "RuntimeError: boom" in line and "rank 1: process exited with code -6" in line
    assert "terminate called without an active exception" in line  # the rank's own last lines (spawn's)


def test_layer_types_are_the_mask_builders_keys(monkeypatch):
    """The layer types a model may have are `masks.MASK_BUILDERS`' keys, read where they are checked: the error
    names that set, and a kind given a builder there is accepted with no second list to edit."""
    from vp_accelerate.models import adapter, masks

    cfg = tiny_family_config("qwen3_5_text")
    kinds = tuple(sorted(set(cfg.layer_types)))
    with pytest.raises(UnsupportedModelError, match="linear_attention") as err:
        adapter._layer_types(cfg, len(cfg.layer_types))
    assert f"(supported: {tuple(masks.MASK_BUILDERS)})" in str(err.value)
    monkeypatch.setitem(masks.MASK_BUILDERS, "linear_attention", masks.MASK_BUILDERS["full_attention"])
    assert set(adapter._layer_types(cfg, len(cfg.layer_types))) == set(kinds)
