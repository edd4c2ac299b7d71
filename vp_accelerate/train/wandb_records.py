"""Read back what wandb logged offline: the `run-*.wandb` file of an offline run directory.

wandb 0.31 ships no Python reader for its transaction log. The file is a 7-byte header (`:W&B`,
magic, version) followed by LevelDB-log framing — 32 KiB blocks of records, each `crc32 (4) |
length (2, little-endian) | type (1: full, 2: first, 3: middle, 4: last)` — whose payloads are
`wandb_internal_pb2.Record` protobufs. That is enough to check logged metrics in tests and scripts.
"""

from __future__ import annotations

import glob
import json
import os
import struct

_BLOCK = 32768
_HEADER = 7


def iter_payloads(path: str):
    """Yield the raw protobuf payload of every record in a `.wandb` file."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb transaction log (header {data[:4]!r})")
    pos, pending = _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a record header is zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield payload
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            yield pending + payload
            pending = b""


def read_run(path: str) -> dict:
    """{"history": [ {key: value} per logged step ], "config": {...}, "summary": {...}} of a run.

    `path` is a `.wandb` file or a run directory (or a dir containing one offline run).
    """
    from wandb.proto import wandb_internal_pb2 as pb

    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "**", "run-*.wandb"), recursive=True))
        if not found:
            raise FileNotFoundError(f"no run-*.wandb file under {path}")
        path = found[-1]
    history, config, summary = [], {}, {}
    for payload in iter_payloads(path):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({_key(item): json.loads(item.value_json) for item in rec.history.item})
        elif kind in ("config", "run"):
            updates = rec.config.update if kind == "config" else rec.run.config.update
            for item in updates:
                config[_key(item)] = json.loads(item.value_json)
        elif kind == "summary":
            for item in rec.summary.update:
                summary[_key(item)] = json.loads(item.value_json)
    return {"history": history, "config": config, "summary": summary, "file": path}


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)
