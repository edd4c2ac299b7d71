"""End to end under a real 2-process launch on CPU (`vp-accelerate launch`, i.e. accelerate's launcher with
configs/accelerate_cpu_2proc.yaml): train with wandb offline, read the metrics back, resume == uninterrupted,
export loads with from_pretrained and reproduces the eval loss. The resumed and init_from runs, whose
subject is the trainer, run on 2 ranks forked as the launcher starts them (tests/helpers/launch.py); plain
`accelerate launch -m vp_accelerate train` trains in tests/test_train_multinode.py."""

import json
import math
import os

import pytest
import torch

from helpers.launch import BIN, CPU_2PROC, run_env, train_ranks
from helpers.launch import launch as run
from helpers.tiny import TINY_MODEL, bpe, corpus, recipe_file

VP_ACCELERATE = os.path.join(BIN, "vp-accelerate")
STEPS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    try:
        from vp_accelerate.demo.corpus import make_demo_corpus

        make_demo_corpus(str(d / "corpus"), size_mb=0.25, seed=0)
    except ImportError:  # without the demo extra: a small synthetic multilingual corpus
        import random

        rng = random.Random(0)
        words = "alpha beta gamma delta мир дом 世界 你好 données λόγος".split()
        os.makedirs(d / "corpus")
        for split, n in (("train", 2000), ("eval", 60)):
            corpus(d / "corpus", words, lines=n, per_line=40, seed=rng, name=f"{split}.jsonl")
    bpe([d / "corpus" / "train.jsonl"], d, 512)
    path = recipe_file(
        d / "recipe.yaml",
        d / "tok",
        [d / "corpus" / "train.jsonl"],
        model={"config": {**TINY_MODEL["config"], "hidden_size": 64, "intermediate_size": 128}},
        tokenizer={"resize_vocab": True},
        data={"eval_files": [str(d / "corpus" / "eval.jsonl")], "seq_len": 32},
        pipeline={"schedule": "1f1b", "method": "vocab-2", "microbatches": 4},
        optimizer={"lr": 3e-3},
        lr={"warmup_steps": 2, "decay": "cosine"},
        train={"steps": STEPS, "global_batch": 8, "seed": 0},
        eval={"every": 3, "batches": 2},
        checkpoint={"every": 3, "keep": 3},
        logging={"wandb_mode": "offline", "log_every": 1, "peak_tflops": 1.0},
    )
    return d, path


def launch(setup, name, *extra, check=True):
    d, recipe = setup
    # accelerate's launcher through `vp-accelerate launch` (its exit-2 path: test_train_launch_errors.py)
    cmd = [VP_ACCELERATE, "launch", "--config_file", CPU_2PROC, "train", recipe]
    out = run([*cmd, "--set", f"logging.output_dir={d / name}", *extra], d, run_env(d / "ds_cache"), timeout_s=300)
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out


def train_forked(setup, name, *extra):
    """The same run on 2 ranks forked from the preloaded fork server (the launcher is `launch`'s subject)."""
    d, recipe = setup
    out = train_ranks([recipe, "--set", f"logging.output_dir={d / name}", *extra], d, run_env(d / "ds_cache"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out


def metrics(path):
    rows = [json.loads(line) for line in open(path)]
    train = {r["step"]: r for r in rows if "train/loss" in r}
    evals = {r["step"]: r["eval/loss"] for r in rows if "eval/loss" in r}
    return train, evals


@pytest.fixture(scope="module")
def full_run(setup):
    out = launch(setup, "full")
    return setup[0] / "full", out


def test_two_processes_train_and_log_to_wandb_offline(full_run):
    """Metrics are read from the trainer's metrics.jsonl (the same dict it hands wandb); of wandb's side
    the test checks only that the offline run was written (wandb 0.31 has no reader for its log)."""
    import glob

    run_dir, out = full_run
    log = out.stdout + out.stderr
    assert "MULTI_CPU" in log and "world size 2" in log
    assert "rank 0 (pp 0/2" in log and "rank 1 (pp 1/2" in log  # who holds which layers / vocab rows
    train, evals = metrics(run_dir / "metrics.jsonl")
    assert sorted(train) == list(range(1, STEPS + 1)) and sorted(evals) == [3, 6]
    losses = [train[s]["train/loss"] for s in sorted(train)]
    assert losses[-1] < losses[0] and all(math.isfinite(x) for x in losses)
    last = train[STEPS]
    for key in (
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/mfu",
        "perf/bubble_rate",
        "memory/rank0_param_mib",
        "memory/rank1_param_mib",
        "memory/rank1_peak_activation_mib",
    ):
        assert key in last, key
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    ppl = [r["eval/ppl"] for r in rows if r["step"] == STEPS and "eval/ppl" in r]
    assert ppl == [pytest.approx(math.exp(evals[STEPS]))]
    runs = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1 and os.path.getsize(runs[0]) > 0, os.listdir(run_dir)


def test_checkpoints_and_the_hf_export_are_on_by_default(full_run):
    """No checkpoint section in the command: output_dir/checkpoints (the recipe's every 3, keep 3) and the final
    model in output_dir/hf with its tokenizer; a new run into the same directory is refused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, out = full_run
    saved = sorted(os.listdir(run_dir / "checkpoints"))  # and the run's lock on its checkpoint folder (run_lock.py)
    assert saved == [".vp-accelerate.lock", "latest", "step_00000003", "step_00000006"]
    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "hf"))
    tok = AutoTokenizer.from_pretrained(str(run_dir / "hf"))
    assert model.config.vocab_size == len(tok) == 512
    assert "exported the final model to" in out.stderr


def test_a_new_run_does_not_mix_with_an_earlier_ones_checkpoints(setup, full_run, capsys):
    from vp_accelerate.train.cli.commands import train_main

    d, recipe = setup
    args = [recipe, "--set", f"logging.output_dir={d / 'full'}", "--check"]
    assert train_main(args) == 2
    assert (
        "holds checkpoints of an earlier run (latest step_00000006); continue that run with --resume"
        in capsys.readouterr().err
    )
    assert train_main(args + ["--resume", "3"]) == 0
    assert train_main(args + ["--resume", "4"]) == 2
    assert "--resume 4: no complete checkpoint" in capsys.readouterr().err


def test_resume_equals_uninterrupted(setup, full_run):
    """Resume from the step-3 checkpoint the full run wrote (what a crash after step 3 leaves behind), named by
    its path, into a new output dir."""
    run_dir, _ = full_run
    train_forked(
        setup,
        "resumed",
        "--resume",
        str(run_dir / "checkpoints" / "step_00000003"),
        "--set",
        "logging.wandb_mode=disabled",
    )
    full, full_eval = metrics(run_dir / "metrics.jsonl")
    resumed, resumed_eval = metrics(setup[0] / "resumed" / "metrics.jsonl")
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step]["train/loss"] == full[step]["train/loss"], step
        assert resumed[step]["train/grad_norm"] == full[step]["train/grad_norm"], step
        assert resumed[step]["train/lr"] == full[step]["train/lr"], step
        for key in ("train/tokens", "train/loss_tokens", "train/epoch"):  # counters go on from the checkpoint
            assert resumed[step][key] == full[step][key], (step, key)
    assert resumed_eval[STEPS] == full_eval[STEPS]


@pytest.mark.slow  # two more launches (one of 4 processes); tests/test_reshard.py loads across layouts exactly
def test_resume_into_another_schedule_and_data_parallel_size(setup, full_run):
    """The step-3 checkpoint of the 1f1b run resumes into vhalf on 2 ranks and into pp 2 x dp 2 (ZeRO-1) on 4:
    the same step, LR, data position and counters, and the losses of the uninterrupted run up to the layouts'
    float32 summation order (the weights and moments load exactly: tests/test_reshard.py)."""
    run_dir, _ = full_run
    d, recipe = setup
    full, _ = metrics(run_dir / "metrics.jsonl")
    for name, nprocs, extra in (("to_vhalf", 2, ["pipeline.schedule=vhalf"]), ("to_dp2", 4, ["pipeline.dp_size=2"])):
        sets = [x for e in [*extra, "logging.wandb_mode=disabled", "checkpoint.export_hf=false"] for x in ("--set", e)]
        args = [
            recipe,
            "--set",
            f"logging.output_dir={d / name}",
            "--resume",
            str(run_dir / "checkpoints" / "step_00000003"),
        ]
        out = train_ranks(args + sets, d, run_env(d / "ds_cache"), nprocs=nprocs)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
        resumed, _ = metrics(d / name / "metrics.jsonl")
        assert sorted(resumed) == [4, 5, 6], name
        for step in (4, 5, 6):
            assert resumed[step]["train/loss"] == pytest.approx(full[step]["train/loss"], rel=1e-4), (name, step)
            assert resumed[step]["train/lr"] == full[step]["train/lr"], (name, step)
            for key in ("train/tokens", "train/epoch"):
                assert resumed[step][key] == full[step][key], (name, step, key)


def test_checkpoint_records_the_layout(full_run):
    from vp_accelerate.train.persist import store as ckpt

    run_dir, _ = full_run
    meta = ckpt.read_meta(ckpt.read_latest(str(run_dir / "checkpoints")))
    fp = meta["fingerprint"]
    assert fp["world_size"] == 2 and fp["method"] == "vocab-2" and len(fp["layout"]) == 2
    # the layout is describe()'s fields (RankLayout.placement), not its text: chunks, layers, vocabulary rows
    assert [r["chunks"] for r in fp["layout"]] == [
        [{"chunk": 0, "start": 0, "end": 2}],
        [{"chunk": 1, "start": 2, "end": 4}],
    ]
    v = meta["vocab_size"]
    assert [r["vocab_rows"] for r in fp["layout"]] == [[0, (v + 1) // 2], [(v + 1) // 2, v]]
    assert meta["sharded_names"] == ["lm_head.weight", "model.embed_tokens.weight"]
    with pytest.raises(ckpt.CheckpointError, match="method: checkpoint has 'vocab-2', this run has 'baseline'"):
        ckpt.check_fingerprint(fp, {**fp, "method": "baseline"}, "ckpt")


def test_export_loads_with_from_pretrained_and_gives_the_eval_loss(setup, full_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vp_accelerate.train.cli.commands import export_main
    from vp_accelerate.train.data import build_data
    from vp_accelerate.train.recipe import load_recipe

    d, recipe_path = setup
    run_dir, _ = full_run
    out = d / "hf"
    assert export_main([str(run_dir / "checkpoints"), str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    recipe = load_recipe(recipe_path)
    _, evals = build_data(
        recipe.data, tok, model.config.vocab_size, 0, recipe.train.global_batch, eval_batches=recipe.eval.batches
    )
    with torch.no_grad():
        losses = [model(input_ids=b["input_ids"], labels=b["labels"]).loss.item() for b in evals]
    _, trained_eval = metrics(run_dir / "metrics.jsonl")
    assert sum(losses) / len(losses) == pytest.approx(trained_eval[STEPS], rel=1e-4)

    auto = AutoModelForCausalLM.from_pretrained(str(run_dir / "hf"))  # the automatic export is the same model
    assert all(torch.equal(a, b) for a, b in zip(auto.state_dict().values(), model.state_dict().values()))


def test_init_from_takes_the_weights_only(setup, full_run):
    """model.init_from: the full run's last weights, a fresh optimizer and schedule (at a negligible LR, the
    first evaluation equals the full run's last one; a fresh model's is far above)."""
    run_dir, _ = full_run
    train_forked(
        setup,
        "init",
        "--set",
        f"model.init_from={run_dir / 'checkpoints'}",
        "--set",
        "train.steps=1",
        "--set",
        "optimizer.lr=1e-12",
        "--set",
        "logging.wandb_mode=disabled",
        "--set",
        "checkpoint.export_hf=false",
    )
    train, evals = metrics(setup[0] / "init" / "metrics.jsonl")
    _, full_eval = metrics(run_dir / "metrics.jsonl")
    assert sorted(train) == [1] and evals[1] == pytest.approx(full_eval[STEPS], abs=1e-5)
