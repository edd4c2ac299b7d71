"""What a data file is, by content: its size, `mtime_ns` and an xxh3-128 hash of every byte.

The tokenization cache key (`tokenize.tokenize_fingerprint`) and a checkpoint's record of its data (`meta.json`
"data", compared by `--resume`) are made of these. `datasets` keys local files by path and mtime only, so a file
rewritten with its mtime kept (`cp -p`, `rsync -a`, `tar x`) would train its old rows from the cache.

Why the whole file and not its first and last MB: a row edited in the middle keeps the size and both ends, and
silently training the old row is the failure this exists to prevent. The cost is one streamed read per file
*version*: the hash is remembered (in this process and in a small file under the datasets cache) by the file's
path, device, inode, size, `mtime_ns` and `ctime_ns`. No user tool can keep `ctime` when it rewrites a file,
so a rewrite always misses that memo and is hashed again, while a re-launch on unchanged files costs one
`stat` per file. The hash itself takes 0.3-0.65 s per GiB on one core of the shared build box (file in the page
cache; the disk is usually slower).
"""

from __future__ import annotations

import json
import mmap
import os

import xxhash

_MEMO: dict[tuple, str] = {}


def _memo_dir() -> str:
    """Where hashes of file versions are remembered across processes: beside the datasets cache."""
    root = os.environ.get("HF_DATASETS_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "datasets"
    )
    return os.path.join(root, "vp_accelerate_file_hashes")


def content_hash(path: str) -> str:
    """xxh3-128 of every byte of `path`, through mmap (the OS pages it in; nothing is copied into Python)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_128(b"").hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return xxhash.xxh3_128(m).hexdigest()


def _version_key(path: str, st: os.stat_result) -> tuple:
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remembered(key: tuple) -> str | None:
    if key in _MEMO:
        return _MEMO[key]
    name = xxhash.xxh3_128_hexdigest(json.dumps(key).encode()) + ".json"
    try:
        with open(os.path.join(_memo_dir(), name)) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    return saved.get("hash") if saved.get("key") == list(key) else None


def _remember(key: tuple, digest: str) -> None:
    _MEMO[key] = digest
    folder = _memo_dir()
    name = xxhash.xxh3_128_hexdigest(json.dumps(key).encode()) + ".json"
    try:  # best effort: a read-only cache only costs a re-hash next time
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f"{name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump({"key": list(key), "hash": digest}, f)
        os.replace(tmp, os.path.join(folder, name))
    except OSError:
        pass


def file_identity(path: str) -> dict:
    """{"path", "size", "mtime_ns", "xxh3_128"} of one local file (the hash from the memo when the file is the
    version hashed before)."""
    st = os.stat(path)
    key = _version_key(path, st)
    digest = _remembered(key)
    if digest is None:
        digest = content_hash(path)
        after = os.stat(path)
        if _version_key(path, after) == key:  # not rewritten while it was read: worth remembering
            _remember(key, digest)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "xxh3_128": digest}


def files_identity(paths: list[str]) -> list[dict]:
    """`file_identity` of each file, in order."""
    return [file_identity(p) for p in paths]


def identity_differences(saved: list[dict], current: list[dict]) -> list[str]:
    """One line per data file that differs between a checkpoint's record and this run, by content (a file
    copied elsewhere or touched, same bytes, is the same file; one rewritten with the same name is not)."""
    if [(d["size"], d["xxh3_128"]) for d in saved] == [(d["size"], d["xxh3_128"]) for d in current]:
        return []  # the same bytes in the same order, wherever they lie now
    old = {d["path"]: d for d in saved}
    new = {d["path"]: d for d in current}
    lines = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path), new.get(path)
        if a is None:
            lines.append(f"data.files: {path} is new (not in the checkpoint's data)")
        elif b is None:
            lines.append(f"data.files: {path} was in the checkpoint's data and is not in this run's")
        elif (a["size"], a["xxh3_128"]) != (b["size"], b["xxh3_128"]):
            lines.append(
                f"data.files: {path} changed since the checkpoint (size {a['size']} -> {b['size']} bytes, "
                f"content hash {a['xxh3_128'][:12]} -> {b['xxh3_128'][:12]})"
            )
    if not lines:
        lines.append(
            f"data.files: other files or another order ({len(saved)} files in the checkpoint's data, "
            f"{len(current)} in this run's)"
        )
    return lines
