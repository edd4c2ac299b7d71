"""The trust and integrity cases of docs/reliability.md: each case is tried, in one process, and the
table between the markers in the doc is written from this list, so the doc cannot drift from what runs.

    python scripts/reliability_cases.py            # run every case; exit 1 if any does not get what the table says
    python scripts/reliability_cases.py --write    # run them, then rewrite the table in docs/reliability.md
    python scripts/reliability_cases.py --table    # print the table (no run)

A case is (what is tried, where it is caught, what it gets: the text its one line must hold). `run` makes the
input in a fresh folder, tries it (`train --check`, the checkpoint loader, export, a save on a full disk) and
returns (exit code or exception name, the output). tests/test_docs_reliability_table.py checks that the doc's table is
this list's (fast) and runs every case (slow); tests/test_persist_integrity.py, test_persist_resume_check.py,
test_data_identity.py and test_train_check_inputs.py assert each case in detail.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DOC = os.path.join(ROOT, "docs", "reliability.md")
BEGIN = "<!-- reliability_cases.py: begin -->"
END = "<!-- reliability_cases.py: end -->"


@dataclass
class Case:
    tried: str
    """The input or fault, as a user would describe it."""
    caught: str
    """Where: `--check` (before any process), `resume`, `save`, `load`, `export`, `data`."""
    gets: str
    """What the one line says (a regular expression the output must match; shown as written)."""
    run: Callable[[str], tuple[object, str]]
    """Try it in a fresh folder: (exit code or exception type name, output)."""
    code: object = 2


# ------------------------------------------------------------------------------------------ the inputs
_TOK: dict = {}


def _tokenizer_dir() -> str:
    """A ~300-token BPE and a corpus, made once per process."""
    if not _TOK:
        from vp_accelerate.train.tokens.tokenizer import train_bpe

        d = tempfile.mkdtemp(prefix="vp_cases_tok_")
        words = ["alpha", "beta", "gamma", "мир", "世界"]
        with open(os.path.join(d, "train.jsonl"), "w") as f:
            for i in range(200):
                f.write(json.dumps({"text": " ".join(words[(i + k) % 5] for k in range(20))}, ensure_ascii=False))
                f.write("\n")
        train_bpe([os.path.join(d, "train.jsonl")], 300, os.path.join(d, "tok"), min_frequency=1)
        _TOK["dir"] = d
    return _TOK["dir"]


def _recipe(work: str, **sections) -> str:
    import yaml

    tok = _tokenizer_dir()
    data = {
        "model": {"source": "llama-tiny"},
        "tokenizer": {"source": f"bpe:{os.path.join(tok, 'tok')}"},
        "data": {"files": [os.path.join(tok, "train.jsonl")], "seq_len": 64},
        "pipeline": {"microbatches": 4},
        "train": {"global_batch": 8},
        "eval": {"batches": 0},
        "logging": {"output_dir": os.path.join(work, "out"), "wandb_mode": "disabled"},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    path = os.path.join(work, "recipe.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return path


def _captured(fn) -> tuple[object, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = fn()
        except SystemExit as e:
            code = e.code
        except Exception as e:  # noqa: BLE001 - the case's outcome is the exception's name and message
            return type(e).__name__, f"{type(e).__name__}: {e}"
    return code, err.getvalue()


def _check(work: str, recipe: str, *args) -> tuple[object, str]:
    from vp_accelerate.train.cli.commands import train_main

    return _captured(lambda: train_main([recipe, "--check", "--world-size", "2", *args]))


def _write(path: str, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _with_data(data: bytes, name: str = "d.jsonl", **extra):
    def run(work):
        path = _write(os.path.join(work, name), data)
        return _check(work, _recipe(work, data={"files": [path], **extra}))

    return run


def _with_set(item: str):
    return lambda work: _check(work, _recipe(work), "--set", item)


def _model_dir(work: str, config: str | None = None, missing_shard: bool = False) -> str:
    from safetensors.torch import save_file

    from vp_accelerate.train.recipe.presets import preset_config

    d = os.path.join(work, "model")
    preset_config("llama-tiny").save_pretrained(d)
    if config is not None:
        _write(os.path.join(d, "config.json"), config.encode())
    if missing_shard:
        index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
        _write(os.path.join(d, "model.safetensors.index.json"), json.dumps(index).encode())
        save_file({}, os.path.join(d, "model-1.safetensors"))
    return d


def _model(**kw):
    return lambda work: _check(work, _recipe(work, model={"source": _model_dir(work, **kw)}))


def _saved(work: str, steps=(1, 2), meta_extra=None, model_files=None) -> str:
    import torch

    from vp_accelerate.train.persist import store as ckpt

    root = os.path.join(work, "ckpt")
    path = ""
    for step in steps:
        p = torch.nn.Parameter(torch.zeros(4))
        opt = torch.optim.AdamW([p])
        path = ckpt.save_checkpoint(
            ckpt.SaveSpec(root, step, 0, write_model_files=model_files),
            ckpt.RankState(
                {"w": torch.randn(64, 64)}, opt.state_dict(), {"step": step}, {"fingerprint": {}, **(meta_extra or {})}
            ),
            lambda: None,
        )
    return path


def _damaged(rel: str, how: str):
    def run(work):
        from vp_accelerate.train.persist import store as ckpt

        path = _saved(work)
        target = os.path.join(path, rel)
        if how == "truncate":
            os.truncate(target, os.path.getsize(target) // 2)
        elif how == "empty":
            os.truncate(target, 0)
        elif how == "remove":
            os.remove(target)
        elif how == "flip":
            with open(target, "r+b") as f:
                f.seek(os.path.getsize(target) - 9)
                b = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b[0] ^ 1]))
        elif how == "garble":
            _write(target, b"{not json")
        return _captured(lambda: (ckpt.read_meta(path), ckpt.load_rank(path, 0)) and 0)

    return run


def _dangling_latest(work):
    _write(os.path.join(work, "out", "checkpoints", "latest"), b"step_00000003\n")
    return _check(work, _recipe(work))


def _resume_changed(work):
    from vp_accelerate.train.persist.resume_check import data_identity
    from vp_accelerate.train.recipe import load_recipe, recipe_to_dict

    recipe = load_recipe(_recipe(work))
    meta = {"recipe": recipe_to_dict(recipe), "data": data_identity(recipe.data)}
    cdir = os.path.join(work, "out", "checkpoints")
    os.makedirs(cdir)
    os.replace(_saved(work, steps=(3,), meta_extra=meta), os.path.join(cdir, "step_00000003"))
    _write(os.path.join(cdir, "latest"), b"step_00000003\n")
    sets = ["optimizer.lr=1e-6", "optimizer.weight_decay=0.5", "lr.decay=constant"]
    return _check(work, _recipe(work), "--resume", *[x for s in sets for x in ("--set", s)])


def _output_dir_locked(work):
    from vp_accelerate.train.cli.commands import _run
    from vp_accelerate.train.recipe import load_recipe

    out = os.path.join(work, "out")
    hold = "import sys,time; from vp_accelerate.train.run import run_lock; run_lock.acquire(sys.argv[1]); print(1, flush=True); time.sleep(60)"
    first = subprocess.Popen([sys.executable, "-c", hold, out], stdout=subprocess.PIPE, text=True)
    try:
        first.stdout.readline()
        path = _recipe(work)
        args = type("Args", (), {"resume": None, "stop_at": None, "override": [], "recipe": path, "overrides": []})()
        return _captured(lambda: _run(load_recipe(path), args))
    finally:
        first.kill()
        first.wait()


def _export_remote_code(work):
    from vp_accelerate.train.cli.commands import export_main

    mark = os.path.join(work, "payload_ran")

    def files(d):
        _write(
            os.path.join(d, "config.json"),
            json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "c.Evil"}}).encode(),
        )
        _write(os.path.join(d, "c.py"), f"open({mark!r}, 'w').write('ran')\n".encode())

    meta = {
        "ranks": [{"rank": 0, "pp_rank": 0, "dp_rank": 0}],
        "vocab_size": 64,
        "recipe": {"model": {"trust_remote_code": True}},
    }
    path = _saved(work, steps=(1,), meta_extra=meta, model_files=files)
    code, out = _captured(lambda: export_main([path, os.path.join(work, "hf")]))
    return code, out + (" PAYLOAD RAN" if os.path.exists(mark) else " payload not run")


def _full_disk(work):
    from vp_accelerate.train.persist import space as ckpt_space

    real = ckpt_space.free_bytes
    ckpt_space.free_bytes = lambda path: 4096
    try:
        return _captured(lambda: _saved(work, steps=(1,)) and 0)
    finally:
        ckpt_space.free_bytes = real


def _prune_foreign(work):
    root = os.path.join(work, "ckpt")
    for name in ("step_00000000", "step_backup"):
        _write(os.path.join(root, name, "notes.txt"), b"the user's")
    _saved(work, steps=(1, 2, 3))
    left = sorted(os.listdir(root))
    return 0, "left: " + ", ".join(left)


def _resave_window(work):
    import multiprocessing

    from vp_accelerate.train.persist import store as ckpt

    def killed(stage):
        import torch

        p = torch.nn.Parameter(torch.zeros(4))
        state = ckpt.RankState(
            {"w": torch.randn(64, 64)}, torch.optim.AdamW([p]).state_dict(), {"step": 2}, {"fingerprint": {}}
        )
        spec = ckpt.SaveSpec(os.path.join(work, "ckpt"), 2, 0, crash_after=f"kill:{stage}")
        ckpt.save_checkpoint(spec, state, barrier=lambda: None)

    _saved(work)
    said = []
    for stage in ("weights", "rank0_files", "aside", "rename", "latest"):
        child = multiprocessing.get_context("fork").Process(target=killed, args=(stage,))
        child.start()
        child.join(60)
        path = ckpt.read_latest(os.path.join(work, "ckpt"))
        ckpt.load_rank(path, 0)
        said.append(f"{stage}: latest loads ({os.path.basename(path)})")
    return 0, "; ".join(said)


def _chat_empty_turn(work):
    rows = [
        {
            "messages": [
                {"role": "user", "content": "beta"},
                {"role": "assistant", "content": "" if i == 4 else "alpha " * 9},
            ]
        }
        for i in range(120)
    ]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    return _with_data(data, format="chat")(work)


def _stale_cache(work):
    from transformers import AutoTokenizer

    from vp_accelerate.train.data import build_data
    from vp_accelerate.train.recipe import DataSection

    tok = AutoTokenizer.from_pretrained(os.path.join(_tokenizer_dir(), "tok"))
    path = _write(os.path.join(work, "d.txt"), b"alpha beta gamma\n" * 60)
    cfg = DataSection(files=[path], seq_len=8, eval_holdout=0.0)
    first = next(build_data(cfg, tok, len(tok), 0, 2)[0])["input_ids"]
    st = os.stat(path)
    _write(path, b"gamma alpha beta\n" * 60)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = next(build_data(cfg, tok, len(tok), 0, 2)[0])["input_ids"]
    return 0, "the new rows are read" if not (first == second).all() else "the OLD rows came from the cache"


# ----------------------------------------------------------------------------------------- hostile inputs
def _train(work: str, *sets: str, fault: dict | None = None, steps: int = 2, extra=()) -> tuple[object, str]:
    """`vp-accelerate train` on one process (scripts/fault_worker.py: the trainer, with `fault` injected)."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "fault_worker.py"), _recipe(work), *extra]
    for item in (f"train.steps={steps}", "checkpoint.every=1", *sets):
        cmd += ["--set", item]
    env = {**os.environ, "VP_FAULT": json.dumps(fault or {}), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, timeout=300)
    return out.returncode, out.stdout + out.stderr


def _init_from_damaged(work):
    code, out = _train(work)
    if code != 0:
        return code, out
    path = os.path.join(work, "out", "checkpoints", "step_00000002")
    weights = os.path.join(path, "rank_00000", "model.safetensors")
    with open(weights, "r+b") as f:
        f.seek(os.path.getsize(weights) - 4096)
        block = f.read(4096)
        f.seek(-4096, os.SEEK_CUR)
        f.write(bytes(b ^ 0x5A for b in block))
    return _train(work, f"model.init_from={path}", f"logging.output_dir={os.path.join(work, 'again')}")


def _export_missing(work):
    import shutil

    code, out = _train(work)
    if code != 0:
        return code, out
    shutil.rmtree(os.path.join(work, "out", "hf"))
    return _train(work, extra=("--resume",))


def _checkpoints_of_a_running_run(work):
    """A real run held inside step 2 (step 1 saved), and a second run, in this process, whose checkpoint.dir is
    the first's checkpoints folder, with --resume."""
    import time

    from vp_accelerate.train.cli.commands import _run
    from vp_accelerate.train.recipe import load_recipe

    mark = os.path.join(work, "held")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "fault_worker.py"), _recipe(work)]
    cmd += ["--set", "train.steps=3", "--set", "checkpoint.every=1", "--set", "checkpoint.background=false"]
    fault = {"hold": {"step": 2, "mark": mark}}
    env = {**os.environ, "VP_FAULT": json.dumps(fault), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=work)
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(mark) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if not os.path.exists(mark):
            return "first run did not reach step 2", first.communicate()[0] if first.poll() is not None else ""
        import yaml

        with open(os.path.join(work, "recipe.yaml")) as f:
            data = yaml.safe_load(f)
        data["checkpoint"] = {"dir": os.path.join(work, "out", "checkpoints")}
        data["logging"]["output_dir"] = os.path.join(work, "second")
        second = os.path.join(work, "second.yaml")
        with open(second, "w") as f:
            yaml.safe_dump(data, f)
        recipe = load_recipe(second)
        args = type(
            "Args", (), {"resume": "latest", "stop_at": None, "override": [], "recipe": second, "overrides": []}
        )
        return _captured(lambda: _run(recipe, args()))
    finally:
        first.kill()
        first.communicate()


def _usr1_to_the_launcher(work):
    """`vp-accelerate launch` on 2 ranks, rank 0 held inside step 2 until a SIGUSR1 reaches it; SIGUSR1 to the
    launcher alone (tests/helpers/fault_site installs the hold in the launched ranks)."""
    import signal
    import time

    mark = os.path.join(work, "held")
    site = os.path.join(ROOT, "tests", "helpers", "fault_site")
    cmd = [os.path.join(os.path.dirname(sys.executable), "vp-accelerate"), "launch", "--config_file"]
    cmd += [
        os.path.join(ROOT, "configs", "accelerate_cpu_2proc.yaml"),
        "train",
        _recipe(work),
        "--set",
        "train.steps=3",
    ]
    fault = {"hold": {"step": 2, "until": "SIGUSR1", "mark": mark}}
    env = {**os.environ, "VP_FAULT": json.dumps(fault), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([site, ROOT])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=work)
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(mark) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    latest = os.path.join(work, "out", "checkpoints", "latest")
    return proc.returncode, out + (f" latest: {open(latest).read().strip()}" if os.path.exists(latest) else "")


def _sigterm(during: str):
    def run(work):
        return _train(work, fault={"signal": {"step": 2, "during": during}}, steps=4)

    return run


def _sigterm_last(work):
    return _train(work, fault={"signal": {"step": 2, "during": "step"}}, steps=2)


def _rewrite_meta(path: str, change) -> None:
    """meta.json changed (`change(meta)` edits it, or returns its new text), its record made to match: a crafted
    checkpoint, so the record alone does not catch it."""
    from vp_accelerate.train.persist import files as ckpt_files
    from vp_accelerate.train.persist import store as ckpt

    meta_path = os.path.join(path, ckpt.META)
    meta = json.loads(open(meta_path).read())
    text = change(meta)
    _write(meta_path, (text if isinstance(text, str) else json.dumps(meta)).encode())
    _write(os.path.join(path, ckpt.META_RECORD), json.dumps(ckpt_files.record(path, [ckpt.META])).encode())


def _crafted(change=None, rank_file=None, data=b"", load="meta"):
    """A checkpoint whose meta.json (`change`) or a rank file (`rank_file` := `data`, its record made to match)
    was crafted; then read as a resume reads it."""

    def run(work):
        from vp_accelerate.train.persist import files as ckpt_files
        from vp_accelerate.train.persist import store as ckpt

        path = _saved(work, steps=(1,), meta_extra={"ranks": [{"rank": 0, "pp_rank": 0, "dp_rank": 0}]})
        _write(os.path.join(work, "outside.txt"), b"secret")
        if change is not None:
            _rewrite_meta(path, change)
        if rank_file is not None:
            rdir = os.path.join(path, "rank_00000")
            _write(os.path.join(rdir, rank_file), data)
            record = json.loads(open(os.path.join(rdir, ckpt_files.MANIFEST)).read())
            record.update(ckpt_files.record(rdir, [rank_file]))
            _write(os.path.join(rdir, ckpt_files.MANIFEST), json.dumps(record).encode())

        def read():
            meta = ckpt.read_meta(path)
            ckpt.check_model_files(path, meta)
            ckpt.check_rank_files(path, 0)
            if load == "optimizer":
                ckpt_files.load_torch(os.path.join(path, "rank_00000", "optimizer.pt"), mmap=True)
            else:
                ckpt.load_weights(path, 0)
            return 0

        return _captured(read)

    return run


def _meta_edited(work):
    from vp_accelerate.train.persist import store as ckpt

    path = _saved(work)
    size = os.path.getsize(os.path.join(path, ckpt.META))
    text = json.dumps({"step": 9, "fingerprint": {}})
    _write(os.path.join(path, ckpt.META), (text + " " * (size - len(text))).encode())  # same size, other bytes
    return _captured(lambda: ckpt.read_meta(path) and 0)


def _files_json_outside(work):
    from vp_accelerate.train.persist import files as ckpt_files
    from vp_accelerate.train.persist import store as ckpt

    path = _saved(work, steps=(1,))
    rdir = os.path.join(path, "rank_00000")
    record = json.loads(open(os.path.join(rdir, ckpt_files.MANIFEST)).read())
    record["../../outside.txt"] = {"size": 6, "xxh3_128": "0" * 32}
    _write(os.path.join(rdir, ckpt_files.MANIFEST), json.dumps(record).encode())
    return _captured(lambda: ckpt.check_rank_files(path, 0) or 0)


def _files_json_missing(work):
    from vp_accelerate.train.persist import store as ckpt

    path = _saved(work, steps=(1,))
    os.remove(os.path.join(path, "rank_00000", "files.json"))
    return _captured(lambda: ckpt.load_rank(path, 0) and 0)


def _pickled_optimizer(work):
    import pickle

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {os.path.join(work, 'payload_ran')}",))

    code, out = _crafted(rank_file="optimizer.pt", data=pickle.dumps({"state": Payload()}), load="optimizer")(work)
    return code, out + (" PAYLOAD RAN" if os.path.exists(os.path.join(work, "payload_ran")) else " payload not run")


def _safetensors(header: bytes, body: bytes = b"", length: int | None = None) -> bytes:
    import struct

    return struct.pack("<Q", len(header) if length is None else length) + header + body


def _resave_old_by_step(work):
    from vp_accelerate.train.persist import store as ckpt

    path = _saved(work, steps=(1, 2))
    os.rename(path, path + ckpt.OLD)  # a re-save of step 2 killed after it moved the old folder aside
    return _captured(lambda: print(ckpt.resume_path(os.path.join(work, "ckpt"), "2"), file=sys.stderr) or 0)


def _lock_symlink(work):
    from vp_accelerate.train.run import run_lock

    out = os.path.join(work, "out")
    os.makedirs(out)
    target = _write(os.path.join(work, "precious.txt"), b"keep me")
    os.symlink(target, os.path.join(out, run_lock.LOCK_FILE))
    code, said = _captured(lambda: run_lock.acquire(out) and 0)
    return code, said + (" target kept" if open(target, "rb").read() == b"keep me" else " TARGET TRUNCATED")


def _lock_malformed(work):
    import fcntl

    from vp_accelerate.train.run import run_lock

    out = os.path.join(work, "out")
    lock = _write(os.path.join(out, run_lock.LOCK_FILE), b'[1, {"pid": 2}]')
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held by another open file description, as another process would
    try:
        return _captured(lambda: run_lock.acquire(out) and 0)
    finally:
        os.close(fd)


def _long_row(work):
    from vp_accelerate.train.data import long_text

    seen = []
    real = long_text._ids
    long_text._ids = lambda tok, text: seen.append(len(text)) or real(tok, text)
    try:
        row = json.dumps({"text": " ".join(["alpha beta gamma"] * 200_000)}).encode() + b"\n"
        rows = b'{"text": "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta"}\n' * 400
        code, out = _with_data(rows + row)(work)
    finally:
        long_text._ids = real
    return code, out + f" longest tokenizer call {max(seen):,} characters of {len(row):,}"


BOMB = "\n".join(
    [f"a0: &a0 [{', '.join(['lol'] * 9)}]"]
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    + ["model:", "  config: *a8"]
)


def _model_dir_crafted(index=None, weights=None):
    def run(work):
        d = _model_dir(work)
        if index is not None:
            _write(os.path.join(d, "model.safetensors.index.json"), json.dumps({"weight_map": index}).encode())
        if weights is not None:
            _write(os.path.join(d, "model.safetensors"), weights)
        return _check(work, _recipe(work, model={"source": d}))

    return run


def _tokenizer_bad_line(work):
    script = os.path.join(ROOT, "scripts", "train_tokenizer.py")
    data = _write(os.path.join(work, "d.jsonl"), b'{"text": "alpha"}\n' * 20 + b"[" * 100_000 + b"\n")
    out = subprocess.run(
        [sys.executable, script, data, "--out", os.path.join(work, "tok"), "--vocab-size", "300"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.returncode, out.stdout + out.stderr


def _config_json(change: dict | None = None, text: str | None = None, command: str = "plan"):
    """A model folder whose config.json has `change` applied (or is `text`), handed to `plan`, `dryrun` or
    `train --check`."""

    def run(work):
        d = _model_dir(work)
        path = os.path.join(d, "config.json")
        if text is None:
            with open(path) as f:
                _write(path, json.dumps({**json.load(f), **change}).encode())
        else:
            _write(path, text.encode())
        if command == "--check":
            return _check(work, _recipe(work, model={"source": d}))
        from vp_accelerate.train.cli.dryrun import dryrun_main
        from vp_accelerate.train.cli.plan import plan_main

        shape = ["--seq", "64", "--global-batch", "8", "--memory-gb", "80"]
        if command == "plan":
            return _captured(lambda: plan_main([d, "--gpus", "2", *shape]))
        return _captured(lambda: dryrun_main([d, "--world-size", "2", *shape]))

    return run


def _exported(rank_file: bytes | None = None, recipe: dict | None = None, foreign: bool = False):
    """`vp-accelerate export` of a one-rank checkpoint of a 1-layer Llama with model/ (config, tokenizer) as a run
    writes it, whose rank file is `rank_file` (its record made to match), whose meta.json holds `recipe`, or
    (`foreign`) whose weights are another model's tensors."""

    def run(work):
        import shutil

        import torch
        from transformers import AutoModelForCausalLM

        from vp_accelerate.train.cli.commands import export_main
        from vp_accelerate.train.persist import files as ckpt_files
        from vp_accelerate.train.recipe.presets import preset_config

        sizes = dict(vocab_size=300, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_key_value_heads=2)
        config = preset_config("llama-tiny", sizes)
        tok = os.path.join(_tokenizer_dir(), "tok")

        def files(d):
            config.save_pretrained(d)
            for name in os.listdir(tok):
                shutil.copy(os.path.join(tok, name), d)

        meta = {"ranks": [{"rank": 0, "pp_rank": 0, "dp_rank": 0}], "vocab_size": 300}
        if recipe is not None:
            meta["recipe"] = recipe
        weights = {"w": torch.zeros(4, 4)} if foreign else AutoModelForCausalLM.from_config(config).state_dict()
        path = _saved_state(work, {k: v.clone() for k, v in weights.items()}, meta, files)
        if rank_file is not None:
            rdir = os.path.join(path, "rank_00000")
            _write(os.path.join(rdir, "model.safetensors"), rank_file)
            entries = json.loads(open(os.path.join(rdir, ckpt_files.MANIFEST)).read())
            entries.update(ckpt_files.record(rdir, ["model.safetensors"]))
            _write(os.path.join(rdir, ckpt_files.MANIFEST), json.dumps(entries).encode())
        return _captured(lambda: export_main([path, os.path.join(work, "hf")]))

    return run


def _saved_state(work: str, state: dict, meta: dict, model_files) -> str:
    import torch

    from vp_accelerate.train.persist import store as ckpt

    p = torch.nn.Parameter(torch.zeros(4))
    return ckpt.save_checkpoint(
        ckpt.SaveSpec(os.path.join(work, "ckpt"), 1, 0, write_model_files=model_files),
        ckpt.RankState(state, torch.optim.AdamW([p]).state_dict(), {"step": 1}, {"fingerprint": {}, **meta}),
        lambda: None,
    )


def _linked(where: str):
    """A checkpoint with `where` (a rank file, a model/ file, the rank folder, `latest`) a symbolic link to a file
    (or folder) outside it of another size; then read as a resume reads it."""

    def run(work):
        from vp_accelerate.train.persist import store as ckpt

        path = _saved(work, steps=(1,), meta_extra={"ranks": [{"rank": 0, "pp_rank": 0, "dp_rank": 0}]})
        secret = _write(os.path.join(work, "outside", "secret.bin"), b"s" * 12345)
        link = os.path.join(path, where) if where != "latest" else os.path.join(work, "ckpt", "latest")
        if os.path.isdir(link):
            os.rename(link, os.path.join(work, "outside", "rank"))
            secret = os.path.join(work, "outside", "rank")
        elif os.path.exists(link):
            os.remove(link)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(secret, link)

        def read():
            found = ckpt.read_latest(os.path.join(work, "ckpt"))
            ckpt.read_meta(found)
            ckpt.load_rank(found, 0)
            return 0

        code, out = _captured(read)
        return ("the outside file's size was said" if "12345" in out or "12,345" in out else code), out

    return run


def _sentencepiece_dir(work: str) -> str:
    """A Llama-style SentencePiece tokenizer (normalizer Prepend("▁") + Replace(" ", "▁"), BPE with byte fallback:
    every input starts with "▁", so a piece encoded alone would differ from the same text mid-row)."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    lines = [" ".join(["alpha", "beta", "gamma", "delta"][(i + k) % 4] for k in range(12)) for i in range(200)]
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    d = os.path.join(work, "sentencepiece")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        d
    )
    return d


def _long_row_sentencepiece(work):
    from vp_accelerate.train.data import long_text

    seen = []
    real = long_text._ids
    long_text._ids = lambda tok, text: seen.append(len(text)) or real(tok, text)
    try:
        row = json.dumps({"text": " ".join(["alpha beta gamma"] * 200_000)}).encode() + b"\n"
        rows = b'{"text": "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta"}\n' * 400
        path = _write(os.path.join(work, "d.jsonl"), rows + row)
        recipe = _recipe(work, data={"files": [path]}, tokenizer={"source": _sentencepiece_dir(work)})
        code, out = _check(work, recipe)
    finally:
        long_text._ids = real
    return code, out + f" longest tokenizer call {max(seen):,} characters of {len(row):,}"


def _long_field(fmt: str, row: dict, **sections):
    """A data file of short rows of `fmt` and one whose field holds 2 MB (`row`, "LONG" marking the field)."""

    def run(work):
        short = {
            "chat": {"messages": [{"role": "user", "content": "alpha"}, {"role": "assistant", "content": "beta"}]},
            "preference": {"prompt": "alpha ", "chosen": "beta gamma", "rejected": "gamma delta"},
        }[fmt]
        long = json.loads(json.dumps(row).replace('"LONG"', json.dumps(" ".join(["alpha beta"] * 200_000))))
        data = b"".join(json.dumps(r).encode() + b"\n" for r in [short] * 40 + [long])
        path = _write(os.path.join(work, "d.jsonl"), data)
        return _check(work, _recipe(work, data={"files": [path], "format": fmt, "eval_holdout": 0}, **sections))

    return run


HOSTILE = [
    Case(
        "`model.init_from` a checkpoint with 4 KiB flipped inside one rank's `model.safetensors`",
        "load (every rank, before any weight)",
        r"training stopped: CheckpointError: checkpoint file .*model.safetensors does not hold the bytes",
        _init_from_damaged,
        3,
    ),
    Case(
        "SIGTERM to every rank mid-step (preemption)",
        "end of the step (every rank)",
        r"saved checkpoint .*step_00000002.*stopped by SIGTERM at step 2; resume with --resume",
        _sigterm("step"),
        75,
    ),
    Case(
        "SIGTERM inside a checkpoint write",
        "end of the step (the save completes)",
        r"saved checkpoint .*step_00000002.*stopped by SIGTERM at step 2; resume with --resume",
        _sigterm("save"),
        75,
    ),
    Case(
        "meta.json's record of files names `../../outside.txt` (record rewritten to match)",
        "load",
        r"meta.json names '../../outside.txt', which is not a file inside",
        _crafted(lambda m: m["files"].update({"../../outside.txt": {"size": 6, "xxh3_128": "0" * 32}})),
        "CheckpointError",
    ),
    Case(
        "meta.json's record of files names an absolute path",
        "load",
        r"meta.json names '/etc/hostname', which is not a file inside",
        _crafted(lambda m: m["files"].update({"/etc/hostname": {"size": 6, "xxh3_128": "0" * 32}})),
        "CheckpointError",
    ),
    Case(
        "a rank's files.json names `../../outside.txt`",
        "load",
        r"files.json names '../../outside.txt', which is not a file of the rank folder",
        _files_json_outside,
        "CheckpointError",
    ),
    Case(
        "a rank's files.json missing while meta.json records the files",
        "load",
        r"files.json is missing \(the checkpoint records its files",
        _files_json_missing,
        "CheckpointError",
    ),
    Case(
        "meta.json edited (its record no longer matches)",
        "load",
        r"meta.json does not hold the bytes that were saved",
        _meta_edited,
        "CheckpointError",
    ),
    Case(
        "meta.json without `step`",
        "load",
        r"`step` is 'None', not a step number",
        _crafted(lambda m: m.pop("step")),
        "CheckpointError",
    ),
    Case(
        'meta.json with `ranks: "all"`',
        "load",
        r"`ranks` is 'all', not a list of the saved ranks",
        _crafted(lambda m: m.update(ranks="all")),
        "CheckpointError",
    ),
    Case(
        "meta.json with `vocab_size: 1e12`",
        "load (before anything is sized by it)",
        r"`vocab_size` is '1000000000000', not a vocabulary size",
        _crafted(lambda m: m.update(vocab_size=10**12)),
        "CheckpointError",
    ),
    Case(
        "meta.json nested 100,000 deep",
        "load",
        r"meta.json is not valid JSON \(nested deeper than the parser's limit\)",
        _crafted(lambda m: "[" * 100_000 + "]" * 100_000),
        "CheckpointError",
    ),
    Case(
        "`model.safetensors` whose header length is 2^62",
        "load",
        r"model.safetensors cannot be read \(SafetensorError",
        _crafted(rank_file="model.safetensors", data=_safetensors(b"{}", length=1 << 62)),
        "CheckpointError",
    ),
    Case(
        "`model.safetensors` with a garbled JSON header",
        "load",
        r"model.safetensors cannot be read \(SafetensorError",
        _crafted(rank_file="model.safetensors", data=_safetensors(b'{"w": {"dtype": "F32", "shape": [2')),
        "CheckpointError",
    ),
    Case(
        "`model.safetensors` whose offsets lie past the end (a 4 TiB tensor in 16 bytes)",
        "load (nothing allocated)",
        r"model.safetensors cannot be read \(SafetensorError",
        _crafted(
            rank_file="model.safetensors",
            data=_safetensors(
                json.dumps({"w": {"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 1 << 42]}}).encode(),
                b"\0" * 16,
            ),
        ),
        "CheckpointError",
    ),
    Case(
        "`optimizer.pt` that is a pickle running code",
        "load (weights_only)",
        r"optimizer.pt holds Python objects other than tensors \(a pickle that would run code\): refused.* payload not run",
        _pickled_optimizer,
        "CheckpointError",
    ),
    Case(
        "`--resume 2` after a re-save of step 2 was killed with the old folder moved aside",
        "resume",
        r"step_00000002.old",
        _resave_old_by_step,
        0,
    ),
    Case(
        "a model dir whose index names `../outside.safetensors`",
        "`--check`",
        r"names the weight file '../outside.safetensors', which is not a file in",
        _model_dir_crafted(index={"w": "../outside.safetensors"}),
    ),
    Case(
        "a model dir whose `model.safetensors` header length is 2^62",
        "`--check`",
        r"model.safetensors is not a readable safetensors file",
        _model_dir_crafted(weights=_safetensors(b"{}", length=1 << 62)),
    ),
    Case(
        "a JSONL row nested 100,000 deep",
        "`--check` (a bad row)",
        r"d.jsonl, line 151: not valid JSON \(nested deeper than the parser's limit\)",
        _with_data(b'{"text": "alpha beta"}\n' * 150 + b"[" * 100_000 + b"\n"),
    ),
    Case(
        "a 3.4 MB single-line row",
        "data (tokenized in pieces)",
        r"checked: .* longest tokenizer call 200,000 characters",
        _long_row,
        0,
    ),
    Case(
        "a YAML alias bomb (9 levels of 9 aliases) under `model.config`",
        "`--check` (before expansion)",
        r"YAML aliases .* expand to more than 100,000 values",
        lambda w: _check(w, _write(os.path.join(w, "r.yaml"), BOMB.encode())),
    ),
    Case(
        "a recipe nested 50,000 deep",
        "`--check`",
        r"nested deeper than a YAML reader allows",
        lambda w: _check(w, _write(os.path.join(w, "r.yaml"), ("a:" + " [" * 50_000).encode())),
    ),
    Case(
        "`--set logging.output_dir=` (empty)",
        "`--check`",
        r"logging.output_dir: is empty; name a folder",
        _with_set("logging.output_dir="),
    ),
    Case(
        "the output-dir lock file is a symlink to another file",
        "start of the run",
        r"lock file .* is a symbolic link .* target kept",
        _lock_symlink,
        "RecipeError",
    ),
    Case(
        "a held lock whose record is not an object",
        "start of the run",
        r"another run is writing into .* \(host \?, pid \?, started \?\)",
        _lock_malformed,
        "RecipeError",
    ),
    Case(
        "a tokenizer training file with a line nested 100,000 deep",
        "`scripts/train_tokenizer.py`",
        r"d.jsonl, line 21: not valid JSON \(nested too deep\)",
        _tokenizer_bad_line,
    ),
]


STOPS = [
    Case(
        "SIGUSR1 to the launcher alone of a `vp-accelerate launch` job (2 ranks, mid-step)",
        "the launcher passes it on (PET_SIGNALS_TO_HANDLE); end of the step",
        r"stopped by SIGUSR1 at step 2; resume with --resume.*launcher stopped by SIGUSR1.*latest: step_00000002",
        _usr1_to_the_launcher,
        75,
    ),
    Case(
        "a second run with `checkpoint.dir` = a running run's checkpoints folder, and `--resume`",
        "start (the lock on the folder's real path)",
        r"checkpoint.dir: another run is writing into .*/out/checkpoints \(host .*, pid \d+",
        _checkpoints_of_a_running_run,
    ),
    Case(
        "SIGTERM in a run's last step",
        "end of the run (it saves and exports)",
        r"exported the final model to .*SIGTERM arrived in this run's last step or after it: the run ended as usual "
        r"\(its checkpoint and the final export written\)",
        _sigterm_last,
        0,
    ),
    Case(
        "`--resume` of a finished run whose `hf/` export is missing",
        "end of the run (nothing to train)",
        r"the run had finished at step 2 but its export is missing: writing it.*exported the final model to .*"
        r"done: the run had already finished at step 2, nothing left to train; the model is in",
        _export_missing,
        0,
    ),
    Case(
        "a run with evaluation off (`eval.batches: 0`) ends",
        "the last line",
        r"done: evaluation was off \(eval.batches: 0\) after step 2; the model is in",
        lambda work: _train(work),
        0,
    ),
]


FROM_A_FILE = [
    Case(
        "a model's config.json with `num_hidden_layers: 1000000000`",
        "`plan` (before any layout is built)",
        r"config.json: num_hidden_layers is 1000000000, not a number of decoder layers \(an integer from 1 to 4,096\)",
        _config_json({"num_hidden_layers": 10**9}),
    ),
    Case(
        "a model's config.json with `hidden_size: -64`",
        "`dryrun`",
        r"config.json: hidden_size is -64, not a number of hidden units",
        _config_json({"hidden_size": -64}, command="dryrun"),
    ),
    Case(
        "a model's config.json with `vocab_size: -256`",
        "`--check`",
        r"model.source: .*config.json: vocab_size is -256, not a number of vocabulary rows",
        _config_json({"vocab_size": -256}, command="--check"),
    ),
    Case(
        "a model's config.json with `hidden_size: NaN`",
        "`plan`",
        r"config.json: hidden_size is nan, not a number of hidden units",
        _config_json(text='{"model_type": "llama", "hidden_size": NaN, "num_hidden_layers": 2}'),
    ),
    Case(
        'a model\'s config.json with `hidden_size: "256"` (a string), 4.5 or a list',
        "`plan`",
        r'config.json: hidden_size is "256" \(a string\), not a number of hidden units',
        _config_json({"hidden_size": "256"}),
    ),
    Case(
        "a model's config.json nested 200,000 deep",
        "`plan`, `--check`",
        r"config.json is not valid JSON for a model config \(nested deeper than the parser's limit",
        _config_json(text='{"model_type": "llama", "x": ' + "[" * 200_000 + "]" * 200_000 + "}", command="--check"),
    ),
    Case(
        "`--set model.config.num_hidden_layers=1000000000`",
        "`--check`",
        r"model.config: num_hidden_layers is 1000000000, .*set model.config.num_hidden_layers",
        _with_set("model.config.num_hidden_layers=1000000000"),
    ),
    Case(
        "`export` of a checkpoint whose rank `model.safetensors` has a header length of 2^62 (record rewritten to match)",
        "export",
        r"export error: checkpoint file .*model.safetensors cannot be read \(SafetensorError: .*header too large",
        _exported(rank_file=_safetensors(b"{}", length=1 << 62)),
    ),
    Case(
        "`export` of a checkpoint whose rank `model.safetensors` has a garbled JSON header",
        "export",
        r"export error: checkpoint file .*model.safetensors cannot be read \(SafetensorError: .*invalid JSON",
        _exported(rank_file=_safetensors(b'{"w": {"dtype": "F32", "shape": [2')),
    ),
    Case(
        "`export` of a checkpoint whose rank `model.safetensors` has offsets past the end (a 4 TiB tensor in 16 bytes)",
        "export (nothing allocated)",
        r"export error: checkpoint file .*model.safetensors cannot be read \(SafetensorError: .*not fully covered",
        _exported(
            rank_file=_safetensors(
                json.dumps({"w": {"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 1 << 42]}}).encode(),
                b"\0" * 16,
            )
        ),
    ),
    Case(
        "`export` of a checkpoint whose meta.json's `recipe.adapter` has an unknown key",
        "export",
        r"export error: checkpoint file .*meta.json: recipe.adapter.bogus: unknown key",
        _exported(recipe={"adapter": {"type": "lora", "bogus": 1}}),
    ),
    Case(
        "`export` of a checkpoint whose weights are another model's tensors",
        "export",
        r"export error: .*step_00000001 cannot be exported: exported tensors do not match LlamaForCausalLM",
        _exported(foreign=True),
    ),
    Case(
        "a rank's `optimizer.pt` that is a symbolic link to a file outside the checkpoint (of another size)",
        "load (before it is stat'ed)",
        r"optimizer.pt leads outside the checkpoint .* through a symbolic link .* refused, nothing is read through it",
        _linked("rank_00000/optimizer.pt"),
        "CheckpointError",
    ),
    Case(
        "model/'s `tokenizer.json` a symbolic link to a file outside (not in meta.json's record)",
        "load, export (meta.json is read after the walk)",
        r"tokenizer.json leads outside the checkpoint .* through a symbolic link",
        _linked("model/tokenizer.json"),
        "CheckpointError",
    ),
    Case(
        "a rank folder that is a symbolic link to a folder outside the checkpoint",
        "load",
        r"rank_00000 leads outside the checkpoint .* through a symbolic link",
        _linked("rank_00000"),
        "CheckpointError",
    ),
    Case(
        "`latest` a symbolic link to a file outside",
        "resume (before it is read)",
        r"latest is a symbolic link, not the pointer file a run writes",
        _linked("latest"),
        "CheckpointError",
    ),
    Case(
        "a 3.4 MB single-line row with a Llama-style SentencePiece tokenizer (every input opens with its prefix space)",
        "data (tokenized in pieces, each behind its context)",
        r"checked: .* longest tokenizer call 199,\d{3} characters of 3,400,012",
        _long_row_sentencepiece,
        0,
    ),
    Case(
        "a chat row whose assistant turn holds 2 MB",
        "`--check` (an invalid row, before any tokenizer call)",
        r"d.jsonl, line 41: 'messages' holds 2,200,017 characters .* more than the 1,000,000 a chat row may hand "
        r"the tokenizer at once",
        _long_field(
            "chat", {"messages": [{"role": "user", "content": "alpha"}, {"role": "assistant", "content": "LONG"}]}
        ),
    ),
    Case(
        "a DPO row whose `chosen` holds 2 MB (KTO and prompt / completion rows alike)",
        "`--check` (an invalid row)",
        r"d.jsonl, line 41: 'chosen' holds 2,199,999 characters .* a preference row may hand the tokenizer at once",
        _long_field("preference", {"prompt": "alpha ", "chosen": "LONG", "rejected": "gamma delta"}),
    ),
]


CASES = [
    Case(
        "`export` of a shared checkpoint whose meta.json sets `trust_remote_code` and whose model/ has an `auto_map` + code",
        "export",
        r"own Python code .* add --trust-remote-code.* payload not run",
        _export_remote_code,
    ),
    Case(
        "`--resume` with `--set optimizer.lr=1e-6 optimizer.weight_decay=0.5 lr.decay=constant`",
        "`--check` and resume",
        r"optimizer.lr: the checkpoint has 0.0003, this run 1e-06 .*--resume --override optimizer",
        _resume_changed,
    ),
    Case(
        "a data file rewritten with its mtime kept (`cp -p`, `rsync -a`)",
        "data (cache key by content)",
        r"the new rows are read",
        _stale_cache,
        0,
    ),
    Case(
        "a second run into an `output_dir` a live run holds",
        "start of the run",
        r"another run is writing into .* \(host .*, pid \d+",
        _output_dir_locked,
    ),
    Case(
        "a re-save of the step `latest` names, killed (SIGKILL) at each point",
        "save",
        r"weights: latest loads.*aside: latest loads \(step_00000002.old\).*latest: latest loads",
        _resave_window,
        0,
    ),
    Case(
        "truncated `model.safetensors`",
        "load (every rank, before `resumed`)",
        r"checkpoint file .*model.safetensors is \d+ bytes, \d+ were saved .*--resume 1",
        _damaged("rank_00000/model.safetensors", "truncate"),
        "CheckpointError",
    ),
    Case(
        "one flipped bit in `model.safetensors`",
        "load",
        r"model.safetensors does not hold the bytes that were saved",
        _damaged("rank_00000/model.safetensors", "flip"),
        "CheckpointError",
    ),
    Case(
        "truncated `optimizer.pt`",
        "load",
        r"optimizer.pt is \d+ bytes, \d+ were saved",
        _damaged("rank_00000/optimizer.pt", "truncate"),
        "CheckpointError",
    ),
    Case(
        "empty `trainer_state.pt`",
        "load",
        r"trainer_state.pt is empty \(0 bytes\)",
        _damaged("rank_00000/trainer_state.pt", "empty"),
        "CheckpointError",
    ),
    Case(
        "missing `optimizer.pt`",
        "load",
        r"optimizer.pt is missing; the checkpoint .* is damaged",
        _damaged("rank_00000/optimizer.pt", "remove"),
        "CheckpointError",
    ),
    Case(
        "unparsable `meta.json`",
        "load",
        r"meta.json is \d+ bytes, \d+ were saved",
        _damaged("meta.json", "garble"),
        "CheckpointError",
    ),
    Case(
        "`step_*` folders in `checkpoint.dir` the run did not write",
        "pruning",
        r"left: latest, step_00000000, step_00000002, step_00000003, step_backup",
        _prune_foreign,
        0,
    ),
    Case(
        "a full disk at a save",
        "save (every rank)",
        r"disk full: rank 0 needs about \d+ bytes .* 4096 are free",
        _full_disk,
        "CheckpointError",
    ),
    Case(
        "a non-UTF-8 byte in a JSONL",
        "`--check`",
        r"d.jsonl, line 2, column 14: byte 0xe9 is not UTF-8",
        _with_data(b'{"text": "ok"}\n{"text": "caf\xe9"}\n' + b'{"text": "alpha beta"}\n' * 150),
    ),
    Case("a recipe that is a directory", "`--check`", r"is a directory; name a YAML file", lambda w: _check(w, w)),
    Case(
        "a recipe that is not UTF-8",
        "`--check`",
        r"not UTF-8 text \(byte 0xe9",
        lambda w: _check(w, _write(os.path.join(w, "r.yaml"), b"train: {steps: 3} # caf\xe9\n")),
    ),
    Case(
        "`--set model.config={hidden_size: 64` (malformed)",
        "`--check`",
        r"--set model.config: .* is not a YAML value",
        _with_set("model.config={hidden_size: 64"),
    ),
    Case(
        "`--set model.config=[1, 2]`",
        "`--check`",
        r"--set model.config: expects a mapping",
        _with_set("model.config=[1, 2]"),
    ),
    Case(
        "`--set model.config.hidden_size=abc` (mistyped)",
        "`--check`",
        r"model.config.hidden_size: expects an integer",
        _with_set("model.config.hidden_size=abc"),
    ),
    Case(
        "`--set optimizer.lr=.nan`",
        "`--check`",
        r"optimizer.lr: must be a finite number, got nan",
        _with_set("optimizer.lr=.nan"),
    ),
    Case(
        "a model dir with a broken `config.json`",
        "`--check`",
        r"config.json is not valid JSON",
        _model(config='{"model_type": "llama",'),
    ),
    Case(
        "a safetensors shard the index names is missing",
        "`--check`",
        r"missing 1 of the 2 weight files .*model-2.safetensors",
        _model(missing_shard=True),
    ),
    Case(
        "`checkpoint.dir` pointing at a file",
        "`--check`",
        r"checkpoint.dir: .* is a file, not a directory",
        lambda w: _check(w, _recipe(w, checkpoint={"dir": _write(os.path.join(w, "f"), b"x")})),
    ),
    Case(
        "a dangling `latest` without `--resume`",
        "`--check`",
        r"names 'step_00000003', which is not a complete checkpoint",
        _dangling_latest,
    ),
    Case(
        "a directory listed beside a data file",
        "`--check`",
        r"more' is a directory, not a data file",
        lambda w: _check(
            w,
            _recipe(
                w,
                data={
                    "files": [
                        os.path.join(_tokenizer_dir(), "train.jsonl"),
                        os.makedirs(os.path.join(w, "more")) or os.path.join(w, "more"),
                    ]
                },
            ),
        ),
    ),
    Case(
        "a directory as the only data file",
        "`--check`",
        r"more' is a directory, not a data file",
        lambda w: _check(
            w, _recipe(w, data={"files": [os.makedirs(os.path.join(w, "more")) or os.path.join(w, "more")]})
        ),
    ),
    Case(
        "a JSONL with a UTF-8 BOM",
        "`--check`",
        r"checked: data.files .*: 150 rows",
        _with_data(b"\xef\xbb\xbf" + b'{"text": "alpha beta gamma"}\n' * 150),
        0,
    ),
    Case(
        "an assistant turn with empty content",
        "`--check` (a warning)",
        r"1 conversation\(s\) have an assistant turn with empty content.*d.jsonl, line 5",
        _chat_empty_turn,
        0,
    ),
    *HOSTILE,
    *STOPS,
    *FROM_A_FILE,
]


def table() -> str:
    rows = ["| input or fault tried | caught at | what it gets (the line holds) |", "|---|---|---|"]
    for c in CASES:
        code = f"exit {c.code}" if isinstance(c.code, int) else c.code
        rows.append(f"| {c.tried} | {c.caught} | {code}: `{c.gets}` |")
    return "\n".join(rows)


def doc_table(text: str) -> str:
    """The table between the markers of docs/reliability.md."""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def run_all() -> list[str]:
    """Each case tried in a fresh folder; the problems (none when every case got what the table says)."""
    problems = []
    for c in CASES:
        with tempfile.TemporaryDirectory(prefix="vp_case_") as work:
            os.environ["HF_DATASETS_CACHE"] = os.path.join(work, "ds_cache")
            code, out = c.run(work)
        flat = " ".join(out.split())
        ok = code == c.code and re.search(c.gets, flat) is not None and "Traceback" not in out
        print(f"{'ok ' if ok else 'BAD'} {c.tried}: {code}: {flat[-300:]}", flush=True)
        if not ok:
            problems.append(f"{c.tried}: got {code!r}: {flat[-500:]}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the table in docs/reliability.md after the run")
    ap.add_argument("--table", action="store_true", help="print the table without running the cases")
    args = ap.parse_args(argv)
    if args.table:
        print(table())
        return 0
    problems = run_all()
    if args.write:
        text = open(DOC, encoding="utf-8").read()
        text = text.replace(doc_table(text), table())
        open(DOC, "w", encoding="utf-8").write(text)
    print("OK" if not problems else f"FAILED: {len(problems)} case(s)")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
