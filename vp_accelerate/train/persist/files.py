"""Every file of a checkpoint is read here: one loader per kind that names the file and the fix on any error
(missing, empty, truncated, unparsable, or bytes that differ from what was saved), and the per-file record of
size and hash that catches the last.

Each rank writes `rank_XXXXX/files.json` beside its shards: every file's size and xxh3-128 hash, taken from
the bytes as written (read back after the fsync). Rank 0 records `model/`'s files the same way in meta.json
("files"). A load checks the size first (a truncated copy costs a `stat`), then the hash (a flipped byte costs
one more pass over the file: 0.30-0.65 s per GiB measured on the shared 2-core build box, file in the page cache,
against 0.3 s for safetensors' own load of it).

Loading uses safetensors and `torch.load(weights_only=True)` only: no file runs code.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import zipfile

import torch

from vp_accelerate import safetensors_file
from vp_accelerate.safetensors_file import UnreadableSafetensors

from ..data.identity import content_hash as digest


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, damaged, or does not match the run loading it."""


MANIFEST = "files.json"
"""Per rank folder: {file name: {"size": bytes, "xxh3_128": hex}} of the files the rank wrote."""

_STEP = re.compile(r"step_\d{8}")


def record(folder: str, names) -> dict:
    """{name: {"size", "xxh3_128"}} of files in `folder` as they are on disk now."""
    return {
        n: {"size": os.path.getsize(os.path.join(folder, n)), "xxh3_128": digest(os.path.join(folder, n))}
        for n in names
    }


def _checkpoint_of(path: str) -> tuple[str, str]:
    """(the step folder a checkpoint file is in, the checkpoint root) of a file path."""
    folder = os.path.dirname(os.path.abspath(path))
    while folder != os.path.dirname(folder) and not _STEP.fullmatch(os.path.basename(folder).split(".")[0]):
        folder = os.path.dirname(folder)
    if not _STEP.fullmatch(os.path.basename(folder).split(".")[0]):
        folder = os.path.dirname(os.path.abspath(path))
    return folder, os.path.dirname(folder)


def fix(path: str) -> str:
    """What to do about a damaged file of a checkpoint: the other complete checkpoints beside it, by step."""
    step_dir, root = _checkpoint_of(path)
    others = []
    if os.path.isdir(root):
        others = sorted(
            d
            for d in os.listdir(root)
            if _STEP.fullmatch(d)
            and d != os.path.basename(step_dir)
            and os.path.isfile(os.path.join(root, d, "meta.json"))
        )
    where = (
        f"resume from another checkpoint (--resume {int(others[-1][5:])}; complete ones in {root}: {', '.join(others)})"
        if others
        else "there is no other complete checkpoint beside it, so start the run afresh"
    )
    return f"the checkpoint {step_dir} is damaged; copy it again from where it came from, or {where}"


def _damaged(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {path} {what}; {fix(path)}")


def _within(path: str, folder: str) -> bool:
    """`path` resolves (every symbolic link on the way followed) to `folder` or something inside it."""
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _linked_out(path: str, folder: str) -> CheckpointError:
    return _damaged(
        path,
        f"leads outside the checkpoint {folder} through a symbolic link (of its own or of a folder on the way): "
        f"refused, nothing is read through it (a checkpoint holds its own files; copy one with cp -rL / rsync -L)",
    )


def contained(path: str) -> str:
    """`path`, a file of a checkpoint, when it resolves inside its checkpoint (the step folder it is in, a link
    to it followed); CheckpointError when a symbolic link (the file's own, a rank folder's) leads outside it.
    Checked before the file is stat'ed, so nothing about a file outside (its size, whether it exists) is said."""
    folder = _checkpoint_of(path)[0]
    if not _within(path, folder):
        raise _linked_out(path, folder)
    return path


def check_links(step_dir: str) -> None:
    """Every entry of checkpoint `step_dir` (walked without following links: a linked folder is not entered)
    resolves inside it: a symbolic link to a file or folder outside is refused in one line, whatever its name
    (model/'s tokenizer files, which transformers opens by name, included)."""
    for folder, dirs, names in os.walk(step_dir):
        for name in sorted(dirs + names):
            path = os.path.join(folder, name)
            if os.path.islink(path) and not _within(path, step_dir):
                raise _linked_out(path, step_dir)


def _present(path: str) -> None:
    contained(path)
    if not os.path.isfile(path):
        raise _damaged(path, "is missing")
    if os.path.getsize(path) == 0:
        raise _damaged(path, "is empty (0 bytes)")


MAX_JSON_BYTES = 64 << 20
"""The largest meta.json / files.json read (a real one is kilobytes): a bigger one is damage, not read."""


def read_json(path: str) -> dict:
    """A JSON file of a checkpoint (meta.json, files.json) as a dict."""
    _present(path)
    if os.path.getsize(path) > MAX_JSON_BYTES:
        raise _damaged(path, f"is {os.path.getsize(path):,} bytes, not the few kilobytes such a file holds")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise _damaged(path, f"is not valid JSON ({type(e).__name__}: {' '.join(str(e).split())})") from None
    except RecursionError:  # json's parser recurses per level
        raise _damaged(path, "is not valid JSON (nested deeper than the parser's limit)") from None
    if not isinstance(data, dict):
        raise _damaged(path, f"holds a JSON {type(data).__name__}, not an object")
    return data


def inside(folder: str, name, record: str) -> str:
    """`folder`/`name` for a file name a checkpoint's record gives (meta.json, files.json, an index): only a
    relative path that stays inside `folder` (no absolute path, no `..`), else CheckpointError naming the
    record; nothing outside a checkpoint is ever opened, stat'ed or hashed because a record names it."""
    parts = name.replace("\\", "/").split("/") if isinstance(name, str) else []
    if not parts or not name or name.startswith("/") or ".." in parts or "\x00" in name or os.path.isabs(name):
        raise _damaged(record, f"names {str(name)[:80]!r}, which is not a file inside {folder}")
    return os.path.join(folder, name)


def check_record(entries, record: str) -> dict:
    """A {file name: {"size", "xxh3_128"}} record (files.json, meta.json's `files`) with the types it must have."""
    if not isinstance(entries, dict):
        raise _damaged(record, f"holds a {type(entries).__name__} where a record of files belongs")
    for name, entry in entries.items():
        ok = isinstance(entry, dict) and isinstance(entry.get("xxh3_128"), str)
        size = entry.get("size") if isinstance(entry, dict) else None
        if not ok or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise _damaged(record, f"records {str(name)[:80]!r} as {str(entry)[:80]}, not {{size, xxh3_128}}")
    return entries


def check_file(path: str, expected: dict | None) -> None:
    """The file is there, not empty, and (when a record exists) of the recorded size and hash."""
    _present(path)
    if expected is None:
        return
    size = os.path.getsize(path)
    if size != expected["size"]:
        raise _damaged(
            path, f"is {size} bytes, {expected['size']} were saved (truncated, or a copy that did not finish)"
        )
    if digest(path) != expected["xxh3_128"]:
        raise _damaged(path, "does not hold the bytes that were saved (its hash differs: changed bytes on disk)")


def load_safetensors(path: str, expected: dict | None = None) -> dict:
    """A safetensors file's tensors, checked against the record."""
    check_file(path, expected)
    try:
        return safetensors_file.load_safetensors(path)
    except UnreadableSafetensors as e:
        raise _damaged(path, e.why) from None


def load_torch(path: str, expected: dict | None = None, mmap: bool = False):
    """A `torch.save` file (weights_only: tensors and plain containers, no code), checked against the record.
    A file holding anything else (a pickle with code) is refused in one line naming it; torch's own advice
    (retry with weights_only=False, i.e. run the file's code) is not passed on."""
    check_file(path, expected)
    mmap = mmap and zipfile.is_zipfile(path)  # only torch.save's zip files map; any other is read to be refused
    try:
        return torch.load(path, weights_only=True, mmap=mmap, map_location="cpu")
    except pickle.UnpicklingError:  # weights_only refused a global: the file would run code
        raise _damaged(
            path, "holds Python objects other than tensors (a pickle that would run code): refused"
        ) from None
    except Exception as e:  # noqa: BLE001 - zip reader RuntimeError, EOFError, ...
        raise _damaged(path, f"cannot be read ({type(e).__name__}: {_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    return " ".join(str(e).split("\n\n")[0].split())[:300]


def open_safetensors(path: str):
    """`safetensors_file.open_safetensors` (tensors read on demand), CheckpointError naming the file when
    its header is not one (a header length past the file, garbled JSON, offsets past the end: safetensors checks
    them before reading)."""
    contained(path)
    try:
        return safetensors_file.open_safetensors(path)
    except UnreadableSafetensors as e:
        raise _damaged(path, e.why) from None


def unreadable(e: UnreadableSafetensors) -> CheckpointError:
    """A checkpoint's safetensors file found unreadable below the checkpoint code (the export's reads) as the
    CheckpointError a load gives."""
    return _damaged(e.path, e.why)


def rank_record(rank_dir: str) -> dict:
    """A rank folder's files.json (its files' sizes and hashes); missing, it is damage."""
    path = contained(os.path.join(rank_dir, MANIFEST))
    if not os.path.exists(path):
        raise _damaged(path, "is missing (the checkpoint records its files since it was saved)")
    entries = check_record(read_json(path), path)
    for name in entries:
        if "/" in name or "\\" in name:
            raise _damaged(path, f"names {name[:80]!r}, which is not a file of the rank folder {rank_dir}")
        inside(rank_dir, name, path)
    return entries
