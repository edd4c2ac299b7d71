"""A user error at launch ends every rank with one line and exit code 2; tracebacks only for bugs.

Real 2-process launches on CPU: a data set with a bad row at a random line, under `vp-accelerate launch`
(exit 2, stderr is that one line) and under plain `accelerate launch` (the ranks say one line, no rank
traceback; torch elastic's launcher still adds its own report and exit 1, which no launched process can
change). The launch reads the rows `--check` tokenized (the same datasets cache entry). The error channel of
`main_process_first` itself runs on spawned gloo ranks.
"""

import json
import os
import random

import pytest

from helpers.launch import BIN, CPU_2PROC, accelerate_train, run_env, train_ranks
from helpers.launch import launch as run
from helpers.tiny import bpe, recipe_file
from vp_accelerate.distributed import spawn

RNG = random.Random()


def _first_rank_fails(kind: str):
    import torch.distributed as dist

    from vp_accelerate.train.data import DataError
    from vp_accelerate.train.run.user_errors import main_process_first

    try:
        with main_process_first("testing"):
            if dist.get_rank() == 0:
                raise DataError("data.files: x.jsonl, line 3: bad") if kind == "user" else ValueError("boom")
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        return type(e).__name__, str(e), getattr(e, "quiet", False)
    return None


@pytest.mark.parametrize("kind", ["user", "bug"])
def test_an_error_on_the_main_process_stops_every_rank(kind):
    got = spawn(_first_rank_fails, 2, kind, timeout_s=60)
    if kind == "user":
        assert got == [("DataError", "data.files: x.jsonl, line 3: bad", True)] * 2  # rank 0 printed it already
    else:
        assert got[0] == ("ValueError", "boom", False)
        assert got[1] == ("RuntimeError", "rank 0 failed while testing: ValueError: boom", True)


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("launch")
    rng = random.Random(RNG.random())
    words = ["alpha", "beta", "gamma", "delta", "paris"]
    rows = [
        {
            "messages": [
                {"role": "user", "content": " ".join(rng.choices(words, k=4))},
                {"role": "assistant", "content": rng.choice(words)},
            ]
        }
        for _ in range(60)
    ]
    line = rng.randrange(2, 60)
    rows[line - 1]["messages"][1]["role"] = "bot"
    (d / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "t.txt").write_text(" ".join(words * 20) + "\n")
    bpe([d / "t.txt"], d, 280)
    recipe_file(
        d / "r.yaml",
        d / "tok",
        [d / "chat.jsonl"],
        tokenizer={"source": str(d / "tok")},
        data={"seq_len": 64},
        pipeline={"microbatches": 2},
        train={"global_batch": 4, "steps": 2},
        eval={"batches": 0},
        logging={"output_dir": str(d / "out")},
    )
    env = run_env(d / "ds_cache")
    # `python -m vp_accelerate train --check` as one plain process forked from the preloaded fork server
    check = train_ranks([str(d / "r.yaml"), "--check"], d, env, nprocs=1, mixed_precision=None)
    return d, line, env, check


def _lines(err: str) -> list[str]:
    """stderr without progress bars (datasets' "Generating ... split" bars)."""
    return [x for x in err.splitlines() if x.strip() and "examples/s" not in x]


def test_check_lists_the_bad_row(bad_run):
    d, line, _, check = bad_run
    assert check.returncode == 2, check.stderr
    assert f"  {d / 'chat.jsonl'}, line {line}: turn 1 has unknown role 'bot'" in check.stderr


def test_vp_accelerate_launch_exits_2_with_one_line(bad_run):
    d, line, env, _ = bad_run
    out = run(
        [os.path.join(BIN, "vp-accelerate"), "launch", "--config_file", CPU_2PROC, "train", str(d / "r.yaml")], d, env
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert _lines(out.stderr) == [
        f"data error: data.files: {d / 'chat.jsonl'}, line {line}: turn 1 has unknown role 'bot'; expected one of "
        f"system, user, assistant, tool. Fix the rows, or set data.skip_invalid: true to skip such rows (they are "
        f"counted)"
    ], out.stderr[-3000:]
    assert "tokenizing" not in out.stderr  # the rows --check tokenized were read from the datasets cache


@pytest.mark.slow
def test_accelerate_launch_ranks_say_one_line_and_no_traceback(bad_run):
    d, line, env, _ = bad_run
    out = run(accelerate_train([str(d / "r.yaml")]), d, env)
    assert out.returncode == 1  # torch elastic's, for any failed rank
    said = [x for x in _lines(out.stderr) if x.startswith("data error:")]
    assert len(said) == 1 and f"line {line}: turn 1 has unknown role 'bot'" in said[0]
    assert "[rank" not in out.stderr and "exitcode  : 2" in out.stderr  # no rank traceback; the rank exited 2


@pytest.mark.slow  # a guard: one more 2-process launch
def test_push_to_hub_refused_offline_exits_2_with_one_line(bad_run):
    """checkpoint.push_to_hub under HF_HUB_OFFLINE=1 (the tests' environment): refused before any rank trains,
    in one line and exit code 2 under `vp-accelerate launch`, no launcher report."""
    d, _, env, _ = bad_run
    assert env.get("HF_HUB_OFFLINE") == "1"
    args = ["--set", "checkpoint.push_to_hub=me/model", "--set", "data.skip_invalid=true"]
    out = run(
        [os.path.join(BIN, "vp-accelerate"), "launch", "--config_file", CPU_2PROC, "train", str(d / "r.yaml"), *args],
        d,
        env,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert _lines(out.stderr) == [
        "recipe error: checkpoint.push_to_hub: HF_HUB_OFFLINE=1 is set, so the final export cannot be uploaded; "
        "unset it where the hub is reachable, or drop push_to_hub (the export stays in <output_dir>/hf) "
        "(--set checkpoint.push_to_hub=me/model)"
    ], out.stderr[-3000:]


EXIT_SCRIPT = """
import atexit, sys
from vp_accelerate.exit_codes import exit_launched
atexit.register(print, "teardown ran")
print("recipe error: said before the exit")  # buffered: stdout is a pipe
exit_launched(int(sys.argv[1]))
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("world, code", [("2", 2), ("1", 2), ("2", 3)])
def test_a_launched_user_error_exits_without_teardown(world, code):
    """A launched rank's exit 2 skips the interpreter's teardown (where a native object aborted the process
    under the launcher), its output flushed; an unlaunched process or another code takes the usual exit."""
    import subprocess
    import sys

    env = {**os.environ, "WORLD_SIZE": world}
    p = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(code)], env=env, capture_output=True, timeout=120)
    said = "recipe error: said before the exit\n"
    assert p.returncode == code
    assert p.stdout.decode() == (said if (world, code) == ("2", 2) else said + "teardown ran\n")
