"""`vp-accelerate plan` and `pipeline.schedule: auto`: every layout simulated, what does not fit dropped,
the fastest first; a recipe with schedule auto runs the best plan."""

import json
import random

import pytest
import yaml

from vp_accelerate.sim.plan import PlanRequest, best, plan
from vp_accelerate.train.cli.plan import model_config, plan_main

# a 1B-class shape (llama-3.2-1b's): vocabulary a quarter of the per-layer work at seq 2048
CONFIG = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
}


def test_every_plan_uses_every_gpu_and_the_whole_batch_and_the_fastest_fitting_comes_first():
    req = PlanRequest(gpus=8, memory_gb=40.0, seq=2048, global_batch=32)
    plans = plan(CONFIG, req)
    assert len({(p.schedule, p.method, p.pp, p.microbatch_size, p.memory) for p in plans}) == len(plans)
    for p in plans:
        assert p.pp * p.dp == 8 and p.microbatches * p.microbatch_size * p.dp == 32
        assert p.microbatches >= p.pp and sum(p.chunk_layers) == 16
        assert p.fits == (max(p.peak_memory_gb) <= 40.0)
    fitting = [p for p in plans if p.fits]
    assert fitting and plans[: len(fitting)] == fitting  # fitting plans first
    assert [p.tokens_per_s for p in fitting] == sorted((p.tokens_per_s for p in fitting), reverse=True)
    assert best(CONFIG, req) == fitting[0]
    # vocabulary parallelism beats the baseline on a 128k vocabulary at equal pp x dp
    top = {
        (p.method, p.pp): p.tokens_per_s
        for p in plans
        if p.schedule == "1f1b" and p.memory == "store" and p.microbatch_size == 1
    }
    assert top[("vocab-2", 8)] > top[("baseline", 8)]


def test_less_memory_drops_plans_and_too_little_names_what_is_needed():
    full = plan(CONFIG, PlanRequest(gpus=4, memory_gb=1000.0, seq=2048, global_batch=16))
    need = min(max(p.peak_memory_gb) for p in full)
    tight = plan(CONFIG, PlanRequest(gpus=4, memory_gb=need * 1.2, seq=2048, global_batch=16))
    assert 0 < sum(p.fits for p in tight) < len(full)
    with pytest.raises(
        ValueError,
        match=rf"no layout fits in {need * 0.5:g} GB per GPU; the smallest needs "
        rf"{need:.1f} GB",
    ):
        best(CONFIG, PlanRequest(gpus=4, memory_gb=need * 0.5, seq=2048, global_batch=16))


def test_plan_command_prints_the_top_plans_as_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert model_config(str(tmp_path)) == CONFIG  # a model directory reads its config.json
    code = plan_main([str(path), "--gpus", "4", "--memory-gb", "80", "--seq", "1024", "--global-batch", "16", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and 1 <= len(out["plans"]) <= 5 and out["fitting"] <= out["considered"]
    for key in (
        "tokens_per_s",
        "mfu",
        "bubble",
        "peak_memory_gb",
        "schedule",
        "method",
        "pp",
        "dp",
        "microbatches",
        "memory",
    ):
        assert key in out["plans"][0]
    assert len(out["plans"][0]["peak_memory_gb"]) == out["plans"][0]["pp"]
    assert plan_main(["llama-tiny", "--gpus", "2", "--memory-gb", "8", "--seq", "64", "--global-batch", "4"]) == 0
    assert "schedule/method" in capsys.readouterr().out
    assert plan_main(["lama-tiny", "--gpus", "2", "--memory-gb", "8", "--seq", "64", "--global-batch", "4"]) == 2
    assert "did you mean llama-tiny" in capsys.readouterr().err


def test_a_recipe_with_schedule_auto_takes_the_best_plan(tmp_path, capsys):
    from vp_accelerate.train.cli.commands import train_main
    from vp_accelerate.train.tokens.tokenizer import train_bpe

    rng = random.Random()
    with open(tmp_path / "train.jsonl", "w") as f:
        for _ in range(100):
            f.write(json.dumps({"text": " ".join(rng.choices(["alpha", "beta", "gamma", "delta"], k=20))}) + "\n")
    train_bpe([str(tmp_path / "train.jsonl")], 300, str(tmp_path / "tok"), min_frequency=1)
    recipe = {
        "model": {"source": "llama-tiny"},
        "tokenizer": {"source": f"bpe:{tmp_path / 'tok'}"},
        "data": {"files": [str(tmp_path / "train.jsonl")], "seq_len": 64},
        "pipeline": {"schedule": "auto", "plan_memory_gb": 4},
        "train": {"global_batch": 8},
        "eval": {"batches": 0},
    }  # 100 random rows may hold none out; evaluation is not what this tests
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code = train_main([str(path), "--check", "--world-size", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    expected = best(model_config("llama-tiny").to_dict(), PlanRequest(gpus=2, memory_gb=4, seq=64, global_batch=8))
    assert f"pipeline.schedule auto: {expected.describe()}" in captured.err
    chosen = json.loads(captured.out)["pipeline"]
    assert (chosen["schedule"], chosen["method"], chosen["microbatches"]) == (
        expected.schedule,
        expected.method,
        expected.microbatches,
    )
    assert train_main([str(path), "--check"]) == 2  # no world size: says what auto needs
    assert "auto needs the number of processes" in capsys.readouterr().err


def test_plain_data_parallelism_is_a_plan_with_the_whole_model_and_its_optimizer_state():
    plans = plan(CONFIG, PlanRequest(gpus=4, memory_gb=1000.0, seq=2048, global_batch=16))
    dp_only = [p for p in plans if p.pp == 1]
    assert dp_only and all(p.dp == 4 and p.label == "data parallel" and p.chunk_layers == (16,) for p in dp_only)
    params = 16 * (4 * 2048**2 + 3 * 2048 * 8192) + 128256 * 2048  # layers + the tied vocabulary matrix
    assert min(p.peak_memory_gb[0] for p in dp_only) > params * 18 / 1e9  # bf16 + fp32 grad + fp32 master/Adam


def test_plan_header_states_its_assumptions_and_gpu_presets_set_them(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert plan_main([str(path), "--gpus", "4", "--gpu", "h200", "--seq", "1024", "--global-batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "989 TFLOP/s" in out and "141 GB per GPU" in out and "450 GB/s point-to-point" in out and "62%" in out
    assert (
        plan_main(
            [
                str(path),
                "--gpus",
                "4",
                "--gpu",
                "a100",
                "--memory-gb",
                "40",
                "--bandwidth-gbs",
                "50",
                "--seq",
                "1024",
                "--global-batch",
                "16",
                "--json",
            ]
        )
        == 0
    )
    header = " ".join(json.loads(capsys.readouterr().out)["assumptions"])
    assert "312 TFLOP/s" in header and "40 GB per GPU" in header and "50 GB/s point-to-point" in header
    assert plan_main([str(path), "--gpus", "4", "--seq", "1024", "--global-batch", "16"]) == 2
    assert "give --memory-gb" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_main(["--help"])
    help_text = capsys.readouterr().out
    for column in ("tokens/s", "MFU", "bubble", "peak GB per rank", "data parallel"):
        assert column in help_text
