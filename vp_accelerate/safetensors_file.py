"""The one place a safetensors file is opened: every reader in the project (a model's weights, a checkpoint's rank
files, the export, the `--check` of a model folder, the coverage walk) goes through `open_safetensors` or
`load_safetensors` (tests/test_safetensors_one_loader.py greps the package for any other `safe_open` / `load_file`).

A safetensors file is often one someone handed us. safetensors checks its header when it opens it (a header length
past the file, e.g. 2^62; garbled JSON; offsets past the end, e.g. a 4 TiB tensor in 16 bytes) and raises its own
`SafetensorError` before any tensor is allocated; a raw `safe_open` lets that reach the user as a traceback. Here
it becomes `UnreadableSafetensors` (a ValueError) naming the file and the reason in one line, which each caller
turns into its own error (a CheckpointError with the checkpoint's way out, a RecipeError on `model.source`).
The dtypes a file may hold are checked too: one torch cannot read is the same one line, not a KeyError later.
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors' dtype names of the tensors this project reads and writes."""


class UnreadableSafetensors(ValueError):
    """A safetensors file that cannot be read; `path` and `why` (what a caller puts in its own message)."""

    def __init__(self, path, why: str):
        super().__init__(f"{path} {why}")
        self.path = str(path)
        self.why = why


def _why(e: Exception) -> str:
    """'cannot be read (SafetensorError: header too large)': the error's first paragraph on one line."""
    text = " ".join(str(e).split("\n\n")[0].split())[:300]
    return f"cannot be read ({type(e).__name__}: {text})"


def open_safetensors(path):
    """`safe_open(path)` (a context manager and handle: tensors read on demand, a slice at a time), its header
    checked by safetensors on opening; UnreadableSafetensors for a file that is missing or not one."""
    path = os.fspath(path)
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError, OSError (missing, a directory), ...
        raise UnreadableSafetensors(path, _why(e)) from None


def load_safetensors(path) -> dict:
    """Every tensor of a safetensors file (`safetensors.torch.load_file`); UnreadableSafetensors when the file is
    not one."""
    path = os.fspath(path)
    try:
        return load_file(path)
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, a dtype torch lacks
        raise UnreadableSafetensors(path, _why(e)) from None


def check_header(path) -> None:
    """Open `path` and close it: its header (length, JSON, offsets) is checked and nothing is read."""
    with open_safetensors(path):
        pass


def dtype_of(handle, name: str, path) -> torch.dtype:
    """The torch dtype of tensor `name` in an open file; UnreadableSafetensors for one this project cannot hold."""
    code = handle.get_slice(name).get_dtype()
    if code not in DTYPES:
        raise UnreadableSafetensors(
            path, f"holds tensor {name!r} as {code}, not one of the dtypes a model is saved in ({', '.join(DTYPES)})"
        )
    return DTYPES[code]
