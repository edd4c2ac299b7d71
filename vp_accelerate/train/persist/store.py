"""Checkpoints of a pipeline run: every rank's shards, optimizer, LR schedule, RNG and data position.

Layout of `<dir>`:

    step_00000100/
      meta.json                 format version, step, layout fingerprint, recipe, per-rank (pp_rank, dp_rank),
                                model/'s record
      meta.record.json          meta.json's size and hash
      model/                    config.json + tokenizer files (what `export` needs besides weights)
      rank_00000/model.safetensors    this rank's parameters (HF-style names, vocabulary shards as held)
      rank_00000/optimizer.pt         torch.save of the optimizer state_dict
      rank_00000/trainer_state.pt     LR scheduler, RNG states, data iterator position
      rank_00000/files.json           the rank's files' sizes and hashes
    latest                      name of the newest complete checkpoint (updated last)

Atomicity: everything is written into `step_X.tmp/`, each file fsynced and read back; once every rank's
write is verified (`complete_save`, an agreement of all ranks: a run's next save, or its end) rank 0
renames the directory to `step_X/` and only then replaces `latest` (write + fsync + rename). A run writes
in the background while it trains on (`begin_save`, `writer.py`). A crash at
any point leaves `latest` naming the previous complete checkpoint; stale `.tmp` dirs are ignored and
removed by the next save. Loading uses safetensors and `torch.load(weights_only=True)` only.

meta.json's `format` is the version of this layout (`FORMAT`); a checkpoint of another version, or of none
(written before versions), is refused by `read_meta` in one line: every loader (resume, `model.init_from`,
`export`, the resharding reads) starts there.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import files, space, writer
from .files import CheckpointError

LATEST = "latest"
BEST = "best"
META = "meta.json"
TMP = ".tmp"
"""A step folder being written (`step_X.tmp`): never read; removed by the next save."""
OLD = ".old"
"""A complete step folder moved aside while a re-save of its step renames the new one in."""
META_RECORD = "meta.record.json"
"""Beside meta.json: its size and hash ({"meta.json": {size, xxh3_128}}), written after it."""
STEP_DIR = re.compile(r"step_\d{8}")
FORMAT = 1
"""meta.json's `format`: the version of the checkpoint layout this code writes and reads (and no other)."""

__all__ = ["CheckpointError"]


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_dir_name(rank: int) -> str:
    return f"rank_{rank:05d}"


def config_fingerprint(config) -> str:
    """Hash of a model config (its JSON), to tell checkpoints of different models apart."""
    text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else json.dumps(config)
    data = json.loads(text)
    for volatile in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        data.pop(volatile, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------- RNG state
def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    np_state = np.random.get_state()
    state["numpy"] = {
        "name": np_state[0],
        "keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "pos": int(np_state[2]),
        "has_gauss": int(np_state[3]),
        "cached": float(np_state[4]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------- saving
def _write_model_files(tmp: str, write_model_files) -> dict:
    """model/ (config, tokenizer) in the step folder being written; their sizes and hashes for meta.json."""
    if write_model_files is None:
        return {}
    mdir = os.path.join(tmp, "model")
    os.makedirs(mdir, exist_ok=True)
    write_model_files(mdir)
    for name in os.listdir(mdir):
        writer.fsync_file(os.path.join(mdir, name))
    return {f"model/{n}": v for n, v in files.record(mdir, sorted(os.listdir(mdir))).items()}


def _promote(ckpt_dir: str, step: int, tmp: str, crash) -> None:
    """The re-save without a window: new folder written -> the old one renamed aside -> the new one renamed in
    -> `latest` -> the old one deleted. `latest` names a complete folder after a kill at any point
    (`read_latest` takes the aside copy while the new one is not in yet)."""
    final = os.path.join(ckpt_dir, step_dir_name(step))
    aside = final + OLD
    if os.path.lexists(final):  # re-saving a step (e.g. after a resume): the complete one goes aside first
        if os.path.lexists(aside):
            shutil.rmtree(aside)  # a re-save's leftover: `final` is complete, so nothing reads it
        os.rename(final, aside)
        writer.fsync_dir(ckpt_dir)
        writer.crash("aside", crash)
    os.rename(tmp, final)
    writer.fsync_dir(ckpt_dir)
    writer.crash("rename", crash)
    _write_pointer(ckpt_dir, LATEST, step_dir_name(step))
    writer.crash("latest", crash)
    if os.path.lexists(aside):
        shutil.rmtree(aside)


@dataclass
class RankState:
    """What one rank writes into a checkpoint (`begin_save`, `save_checkpoint`)."""

    model: dict
    """This rank's tensors by name: `model.safetensors`."""
    optimizer: dict
    """The optimizer's state_dict: `optimizer.pt`."""
    trainer: dict
    """Every other part of the run's state (LR schedule, RNG, data position, ...): `trainer_state.pt`."""
    meta: dict
    """meta.json (rank 0's is written): it must hold the layout's `fingerprint`; `format` and `step` are added."""


@dataclass(frozen=True)
class SaveSpec:
    """Where and how one checkpoint is saved (`begin_save`, `save_checkpoint`)."""

    ckpt_dir: str
    """The run's checkpoint root."""
    step: int
    """The step saved."""
    rank: int
    """This process's global rank (0 writes meta.json and model/, and promotes the folder)."""
    write_model_files: Callable[[str], None] | None = None
    """Rank 0: writes config/tokenizer files into the folder it is given (what `export` needs besides weights)."""
    keep: int = 2
    """checkpoint.keep: how many recent checkpoints stay."""
    best: bool = False
    """This one becomes `best`'s."""
    keep_best: bool = False
    """The checkpoint `best` names is never pruned."""
    crash_after: str | None = None
    """Tests: the stage to stop at (`writer.crash`; "kill:STAGE" SIGKILLs this process there)."""

    @property
    def tmp(self) -> str:
        """The step folder while it is written."""
        return os.path.join(self.ckpt_dir, step_dir_name(self.step)) + TMP


@dataclass
class PendingSave:
    """A checkpoint every rank has begun (`begin_save`) and whose files may still be being written; only
    `complete_save` moves `latest` to it."""

    spec: SaveSpec
    """The checkpoint's place and pruning."""
    write: writer.RankWrite
    """This rank's files (and on rank 0 meta.json), written in the background or already written."""


def begin_save(spec: SaveSpec, state: RankState, barrier: Callable[[], None], background: bool = True) -> PendingSave:
    """Collective (one barrier): start checkpoint `spec.step`. Rank 0 makes the step's `.tmp` folder and writes
    model/; then, `background`, this rank's state is copied to host memory (`writer.Snapshot`) and a thread
    writes, fsyncs and verifies its files (rank 0's meta.json last) while the caller trains on; else they are
    written before this returns. `latest` does not move: `complete_save` does that once every rank's write is
    verified; the previous `begin_save` must be completed first."""
    tmp, recorded, problem = spec.tmp, {}, None
    if spec.rank == 0:
        os.makedirs(spec.ckpt_dir, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)  # left by a crashed save (one writer per output dir: `run_lock.py`)
        os.makedirs(tmp)
        try:
            recorded = _write_model_files(tmp, spec.write_model_files)
        except (OSError, RuntimeError) as e:  # said by every rank at `complete_save`, as a write problem
            problem = space.write_problem(e, tmp, spec.ckpt_dir, 0, spec.rank)
    barrier()
    rdir = os.path.join(tmp, rank_dir_name(spec.rank))
    need = sum(space.state_bytes(x) for x in (state.model, state.optimizer, state.trainer))
    snap = None
    if background:  # the previous save is complete (the caller waits for it): its pinned buckets are reused
        snap = writer.Snapshot(_pinned.setdefault(spec.rank, []))
        state = RankState(*snap.copy((state.model, state.optimizer, state.trainer, state.meta)))

    def work() -> None:
        if snap is not None:
            snap.ready()  # the device -> host copies have landed
        writer.write_rank_files(rdir, state.model, state.optimizer, state.trainer, spec.crash_after)
        if spec.rank == 0:
            meta = {**state.meta, "format": FORMAT, "step": spec.step, "files": recorded}
            writer.write_json(os.path.join(tmp, META), meta)
            # meta.json is checked like the rest: its size and hash beside it
            writer.write_json(os.path.join(tmp, META_RECORD), files.record(tmp, [META]))
            writer.fsync_dir(tmp)
            writer.crash("rank0_files", spec.crash_after)

    return PendingSave(spec, writer.RankWrite(work, spec.ckpt_dir, rdir, need, spec.rank, background, problem))


_pinned: dict[int, list] = {}
"""Per rank: the pinned host buckets of its last snapshot (CUDA), which the next one reuses."""


def complete_save(
    pending: PendingSave, barrier: Callable[[], None], agree: Callable[[object], list] | None = None
) -> str:
    """Collective, on the main thread: wait for this rank's write, agree that every rank's verified (a write
    error on any rank stops every rank with one line naming the file, nothing lost), and only then rank 0
    renames the folder in, moves `latest` (and `best`) and prunes. Returns the checkpoint's path."""
    gather_all = agree or (lambda x: (barrier(), [x])[1])
    s = pending.spec
    problem = pending.write.wait()
    _stop_on(gather_all(problem), s.ckpt_dir, s.tmp, s.rank)
    if s.rank == 0:
        try:
            _promote(s.ckpt_dir, s.step, s.tmp, s.crash_after)
            if s.best:
                _write_pointer(s.ckpt_dir, BEST, step_dir_name(s.step))
            _prune(s.ckpt_dir, s.keep, read_best(s.ckpt_dir) if s.keep_best else None)
        except writer.SimulatedCrash:
            raise
        except (OSError, RuntimeError) as e:
            problem = space.write_problem(e, s.tmp, s.ckpt_dir, 0, s.rank)
    _stop_on(gather_all(problem), s.ckpt_dir, s.tmp, s.rank)
    return os.path.join(s.ckpt_dir, step_dir_name(s.step))


def save_checkpoint(
    spec: SaveSpec, state: RankState, barrier: Callable[[], None], agree: Callable[[object], list] | None = None
) -> str:
    """Collective: every rank calls it with its own state; the files are written before it returns (a run
    writes in the background: `begin_save`, then `complete_save`). Returns the final checkpoint path.
    `agree(x)`: every rank's `x` (an all-gather; without it only this rank's): a write error on any rank (a full
    disk) stops every rank with one line naming the file, nothing lost."""
    return complete_save(begin_save(spec, state, barrier, background=False), barrier, agree)


def _stop_on(problems: list, ckpt_dir: str, tmp: str, rank: int) -> None:
    """Every rank raises the first rank's write problem (one line); rank 0 removes the partial folder (the
    space it held is what a full disk needs back; `latest` never named it)."""
    said = [p for p in problems if p]
    if not said:
        return
    if rank == 0 and os.path.isdir(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
    kept = read_latest_quietly(ckpt_dir)
    raise CheckpointError(f"{said[0]}; nothing is lost: {kept or 'no checkpoint was complete yet'}")


def read_latest_quietly(ckpt_dir: str) -> str:
    """What `latest` names, as words for a message (never raises)."""
    try:
        path = read_latest(ckpt_dir)
    except CheckpointError:
        return ""
    return f"the last complete checkpoint {path} is untouched; free space, then --resume" if path else ""


def _write_pointer(ckpt_dir: str, name: str, target: str) -> None:
    """`name` (latest / best) names `target`, replaced atomically."""
    tmp = os.path.join(ckpt_dir, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(target + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, name))
    writer.fsync_dir(ckpt_dir)


def ours(ckpt_dir: str, name: str) -> bool:
    """A folder this code wrote: `step_` and 8 digits, holding its meta.json (anything else is left alone)."""
    return STEP_DIR.fullmatch(name) is not None and os.path.isfile(os.path.join(ckpt_dir, name, META))


def _prune(ckpt_dir: str, keep: int, protect: str | None = None) -> None:
    """Delete complete checkpoints older than the newest `keep` (never the one `latest` names, nor `protect`),
    and the aside copy of a re-save whose new folder is in. Only folders this code wrote (`ours`)."""
    latest = read_latest(ckpt_dir)
    steps = sorted(d for d in os.listdir(ckpt_dir) if ours(ckpt_dir, d))
    for name in steps[:-keep] if keep > 0 else []:
        if os.path.join(ckpt_dir, name) not in (latest, protect):
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
    for name in steps:
        if ours(ckpt_dir, name + OLD) and os.path.join(ckpt_dir, name + OLD) not in (latest, protect):
            shutil.rmtree(os.path.join(ckpt_dir, name + OLD), ignore_errors=True)


# ----------------------------------------------------------------------------------------- loading
def _no_link(pointer: str) -> None:
    """`latest` and `best` are files the run writes; a symbolic link there is refused before it is read (its
    target's first line would be shown as the name it holds)."""
    if os.path.islink(pointer):
        raise CheckpointError(
            f"{pointer} is a symbolic link, not the pointer file a run writes; delete it and resume with --resume STEP"
        )


def read_latest(ckpt_dir: str) -> str | None:
    """Path of the newest complete checkpoint in `ckpt_dir`, or None when there is none."""
    pointer = os.path.join(ckpt_dir, LATEST)
    if not os.path.isfile(pointer):
        return None
    _no_link(pointer)
    with open(pointer, encoding="utf-8", errors="replace") as f:
        name = f.read(4096).strip()
    if not STEP_DIR.fullmatch(name):  # only a folder of this directory: never `../x` or an absolute path
        raise CheckpointError(
            f"{pointer} names {name[:80]!r}, not a checkpoint folder of {ckpt_dir} (step_ and 8 digits); "
            f"resume with --resume STEP, or delete {pointer} to start afresh"
        )
    path = os.path.join(ckpt_dir, name)
    if os.path.isfile(os.path.join(path, META)):
        return path
    if STEP_DIR.fullmatch(name) and os.path.isfile(os.path.join(path + OLD, META)):
        return path + OLD  # a re-save was stopped between moving the old folder aside and renaming the new in
    have = sorted(d for d in os.listdir(ckpt_dir) if ours(ckpt_dir, d))
    raise CheckpointError(
        f"{pointer} names {name!r}, which is not a complete checkpoint; resume from one that is "
        f"(--resume STEP; complete ones there: {', '.join(have) or 'none'}), or delete {pointer} to start afresh"
    )


def read_best(ckpt_dir: str) -> str | None:
    """Path of the checkpoint with the lowest eval loss (checkpoint.keep_best), or None when none is named."""
    pointer = os.path.join(ckpt_dir, BEST)
    if not os.path.isfile(pointer):
        return None
    _no_link(pointer)
    with open(pointer, encoding="utf-8", errors="replace") as f:
        name = f.read(4096).strip()
    path = os.path.join(ckpt_dir, name)
    return path if STEP_DIR.fullmatch(name) and os.path.isfile(os.path.join(path, META)) else None


def resolve(path: str) -> str:
    """A checkpoint dir given either itself or the run's checkpoint root (then `latest` is followed)."""
    if os.path.isfile(os.path.join(path, META)):
        return path
    found = read_latest(path) if os.path.isdir(path) else None
    if found is None:
        raise CheckpointError(f"no checkpoint at {path!r} (no {META}, no {LATEST} pointer)")
    return found


def resume_path(ckpt_dir: str | None, which: str = "latest") -> str | None:
    """The checkpoint `--resume WHICH` names: `latest` (the newest complete one in `ckpt_dir`, None when there
    is none), a step number (`ckpt_dir/step_XXXXXXXX`), or a path (a step dir, or a checkpoint dir whose
    `latest` is followed)."""
    if which == "latest":
        return read_latest(ckpt_dir) if ckpt_dir and os.path.isdir(ckpt_dir) else None
    if which.isdigit():
        path = os.path.join(ckpt_dir or "", step_dir_name(int(which)))
        if not os.path.isfile(os.path.join(path, META)) and os.path.isfile(os.path.join(path + OLD, META)):
            return path + OLD  # a re-save stopped after moving this step aside (as read_latest finds it)
        if not os.path.isfile(os.path.join(path, META)):
            have = (
                sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step_") and not d.endswith(".tmp"))
                if ckpt_dir and os.path.isdir(ckpt_dir)
                else []
            )
            raise CheckpointError(
                f"--resume {which}: no complete checkpoint {path} (checkpoints there: {', '.join(have) or 'none'})"
            )
        return path
    return resolve(os.path.expanduser(which))


def read_meta(path: str) -> dict:
    """A checkpoint's meta.json, checked against its record (meta.record.json: its size and hash), for its format
    version (`check_format`) and for the keys and types the loaders read (`check_meta`), after checking that no
    entry of the checkpoint is a symbolic link leading outside it (`files.check_links`); CheckpointError naming the
    file and the fix otherwise."""
    meta_path, record_path = os.path.join(path, META), os.path.join(path, META_RECORD)
    files.check_links(path)  # no file of it is a link to one outside (every load starts here)
    record = files.check_record(files.read_json(record_path), record_path) if os.path.exists(record_path) else None
    if record is not None:
        files.check_file(meta_path, record.get(META))
    meta = files.read_json(meta_path)
    check_format(meta, meta_path)
    if record is None:
        raise CheckpointError(f"checkpoint file {record_path} is missing; {files.fix(record_path)}")
    return check_meta(meta, meta_path)


def check_format(meta, meta_path: str) -> None:
    """meta.json is of this code's format version (`FORMAT`), else one line naming the version and the fix."""
    found = meta.get("format") if isinstance(meta, dict) else None
    if _int(found, FORMAT, FORMAT + 1):
        return
    said = "no format version" if found is None else f"format version {' '.join(str(found)[:40].split())!r}"
    raise CheckpointError(
        f"checkpoint {os.path.dirname(meta_path)} has {said}; this vp-accelerate reads checkpoint format {FORMAT} "
        f"only: resume or export it with the vp-accelerate that saved it, or start the run afresh"
    )


MAX_RANKS = 1 << 20
"""More saved ranks than this in a meta.json is damage (the loaders would loop over them)."""

MAX_VOCAB = 1 << 31
"""A vocab_size past this in meta.json is damage (export would size the vocabulary matrices by it)."""


def _int(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def check_meta(meta: dict, meta_path: str) -> dict:
    """meta.json has the keys the loaders read, of their types and within sane sizes (checked before anything is
    sized by them): `step`, `fingerprint`, `ranks`, `vocab_size`, `sharded_names`, `tp_size`, `tp_sliced`,
    `tp_vocab`, `files`."""

    def bad(key: str, what: str) -> CheckpointError:
        value = " ".join(str(meta.get(key))[:80].split())
        return CheckpointError(f"checkpoint file {meta_path}: `{key}` is {value!r}, {what}; {files.fix(meta_path)}")

    if not _int(meta.get("step"), 0, 1 << 62):
        raise bad("step", "not a step number")
    if not isinstance(meta.get("fingerprint"), dict):
        raise bad("fingerprint", "not the layout's record (an object)")
    if "ranks" in meta:
        ranks = meta["ranks"]
        keys = ("rank", "pp_rank", "dp_rank")
        if not isinstance(ranks, list) or not ranks or len(ranks) > MAX_RANKS:
            raise bad("ranks", "not a list of the saved ranks")
        if not all(isinstance(r, dict) and all(_int(r.get(k), 0, MAX_RANKS) for k in keys) for r in ranks):
            raise bad("ranks", "not a list of {rank, pp_rank, dp_rank} numbers")
        if len({r["rank"] for r in ranks}) != len(ranks):
            raise bad("ranks", "naming a rank twice")
        if not all(_int(r.get("tp_rank", 0), 0, MAX_RANKS) for r in ranks):
            raise bad("ranks", "with a tp_rank that is not a number")
    if not _int(meta.get("tp_size", 1), 1, MAX_RANKS):
        raise bad("tp_size", "not a number of tensor-parallel ranks")
    sliced = meta.get("tp_sliced", {})
    if not isinstance(sliced, dict) or not all(isinstance(n, str) and d in (0, 1) for n, d in sliced.items()):
        raise bad("tp_sliced", "not a map of tensor names to a slice dim (0 or 1)")
    packed = meta.get("tp_packed", {})
    if not isinstance(packed, dict) or not all(
        isinstance(n, str) and isinstance(p, list) and 0 < len(p) <= 8 and all(_int(x, 1, 1 << 40) for x in p)
        for n, p in packed.items()
    ):
        raise bad("tp_packed", "not a map of tensor names to their fused parts' sizes")
    if "vocab_size" in meta and not _int(meta["vocab_size"], 1, MAX_VOCAB):
        raise bad("vocab_size", "not a vocabulary size")
    for key in ("sharded_names", "tp_vocab"):
        names = meta.get(key, [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise bad(key, "not a list of tensor names")
    if "files" in meta:
        for rel in files.check_record(meta["files"], meta_path):
            files.inside(os.path.dirname(meta_path), rel, meta_path)
    return meta


def check_fingerprint(saved: dict, current: dict, path: str) -> None:
    """Error listing every layout/model key that differs between a checkpoint and this run."""
    diffs = [
        f"{k}: checkpoint has {saved.get(k)!r}, this run has {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if saved.get(k) != current.get(k)
    ]
    if diffs:
        raise CheckpointError(f"checkpoint {path} does not match this run:\n  " + "\n  ".join(diffs))


def _rank_dir(path: str, rank: int) -> str:
    """Saved rank `rank`'s folder of checkpoint `path` (CheckpointError when it has none)."""
    rdir = os.path.join(path, rank_dir_name(rank))
    if not os.path.isdir(rdir):
        raise CheckpointError(f"checkpoint {path} has no shards for rank {rank}")
    return rdir


def load_rank(path: str, rank: int) -> tuple[dict, dict, dict]:
    """(model_state, optimizer_state, trainer_state) of one rank, loaded without unpickling code."""
    recorded = files.rank_record(_rank_dir(path, rank))
    optimizer_state = files.load_torch(
        os.path.join(path, rank_dir_name(rank), "optimizer.pt"), recorded.get("optimizer.pt")
    )
    return load_weights(path, rank, recorded), optimizer_state, load_trainer_state(path, rank, recorded)


def load_trainer_state(path: str, rank: int, recorded: dict | None = None) -> dict:
    """One rank's `trainer_state.pt` (every part of the run but the model and optimizer: `run/state_parts.py`)."""
    rdir = _rank_dir(path, rank)
    recorded = files.rank_record(rdir) if recorded is None else recorded
    return files.load_torch(os.path.join(rdir, "trainer_state.pt"), recorded.get("trainer_state.pt"))


def load_weights(path: str, rank: int, recorded: dict | None = None) -> dict:
    """One rank's `model.safetensors` of checkpoint `path`, checked against its recorded size and hash."""
    rdir = _rank_dir(path, rank)
    recorded = files.rank_record(rdir) if recorded is None else recorded
    return files.load_safetensors(os.path.join(rdir, "model.safetensors"), recorded.get("model.safetensors"))


def check_shapes(saved: dict, current: dict, path: str, rank: int) -> None:
    """The saved shards must have exactly this rank's parameter names and shapes."""
    missing = sorted(set(current) - set(saved))
    extra = sorted(set(saved) - set(current))
    wrong = [
        f"{k}: saved {tuple(saved[k].shape)}, expected {tuple(current[k].shape)}"
        for k in sorted(set(saved) & set(current))
        if saved[k].shape != current[k].shape
    ]
    if missing or extra or wrong:
        raise CheckpointError(
            f"checkpoint {path}, rank {rank}: parameters differ from this run's — "
            f"missing {missing[:5]}, unexpected {extra[:5]}, shapes {wrong[:5]}"
        )


def saved_ranks(path: str, meta: dict) -> list[int]:
    """The global ranks whose folders checkpoint `path` holds: meta.json's list (a run's checkpoints), else the
    rank folders there are."""
    if "ranks" in meta:
        return [r["rank"] for r in meta["ranks"]]
    return sorted(int(d.split("_")[1]) for d in os.listdir(path) if d.startswith("rank_"))


def check_weight_file(path: str, rank: int) -> None:
    """One saved rank's model.safetensors is there and (when recorded) of the recorded size and hash."""
    rdir = _rank_dir(path, rank)
    files.check_file(os.path.join(rdir, "model.safetensors"), files.rank_record(rdir).get("model.safetensors"))


def check_rank_files(path: str, rank: int) -> None:
    """One saved rank's files are there, not empty, and (when recorded) of the recorded size and hash."""
    rdir = _rank_dir(path, rank)
    recorded = files.rank_record(rdir)
    for name in sorted(set(recorded) | {"model.safetensors", "optimizer.pt", "trainer_state.pt"}):
        files.check_file(os.path.join(rdir, name), recorded.get(name))


def check_model_files(path: str, meta: dict) -> None:
    """model/'s files (config, tokenizer) are whole and unchanged since the save (meta.json's record)."""
    record = os.path.join(path, META)
    for rel, expected in sorted(files.check_record(meta.get("files") or {}, record).items()):
        files.check_file(files.inside(path, rel, record), expected)
