"""Input validation shared by the vocabulary layers: errors that name the cause and the fix.

All checks run on every rank before any collective, on data every rank holds identically, so a bad
input makes every rank raise the same ValueError instead of leaving peers blocked in a collective.

`check_token_ids` reads its verdict back to the host: on a GPU that is a device->host sync. The
pipeline runtime checks ids and labels once per step on the host (`PipelineModel._microbatches`) and
calls the per-microbatch passes with `check_inputs=False`, so IF and S never wait on the device for it.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_float(t: torch.Tensor, name: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{name} has dtype {t.dtype}; the vocabulary layers need a floating tensor "
            f"(float32, bfloat16, float16 or float64): cast it, e.g. {name}.float()"
        )


def check_same_dtype(a: torch.Tensor, a_name: str, b: torch.Tensor, b_name: str) -> None:
    if a.dtype != b.dtype:
        raise ValueError(
            f"{a_name} is {a.dtype} but {b_name} is {b.dtype}; cast one so both match "
            f"(statistics are kept in float32 whatever the dtype)"
        )


def check_token_ids(ids: torch.Tensor, vocab_size: int, name: str, ignore_index: int | None = None) -> None:
    """Raise if an id lies outside [0, vocab_size) (other than `ignore_index`), naming its position."""
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"{name} must be an integer tensor, got {ids.dtype}")
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if bool(bad.any()):
        pos = torch.nonzero(bad)[0].tolist()
        value = int(ids[tuple(pos)])
        allowed = f"[0, {vocab_size})" + (f" or {ignore_index} (ignored)" if ignore_index is not None else "")
        raise ValueError(
            f"{name} at position {tuple(pos)} is {value}, outside {allowed} "
            f"({int(bad.sum())} such entries); check the tokenizer's vocabulary size against "
            f"the model's (vocab_size={vocab_size})"
        )
