"""Catch host tensors on device-only process groups while running on CPU.

On GPUs every group the runtime builds is NCCL except its gloo side groups (`Groups.host_group`,
`Groups.pp_host_group`), and NCCL rejects a CPU tensor. On a CPU test machine every tensor is on the
CPU, so a device comparison alone cannot see the mistake. Two pieces make it visible:

- `HostTagMode` (a TorchFunctionMode) tags every tensor that would live in host memory on a GPU
  machine: made by a factory without `device=` (torch.tensor, torch.zeros, ...), by `.cpu()`, by
  `torch.from_numpy`, or computed only from such tensors. `.to(device)` / `.cuda()` clear the tag.
- `CollectiveAudit` wraps the torch.distributed collectives and point-to-point calls and records,
  for each tensor, whether its group is a host (gloo side) group or a device group, and the tensor's
  device and host tag. `problems()` lists every tensor that would break on NCCL: a host-tagged or
  off-device tensor on a device group, and an object collective on a device group (on NCCL it
  stages the pickled bytes through GPU memory; the runtime keeps those on the host groups).

Known blind spots (documented so nobody trusts more than is there): a factory given an explicit
`device="cpu"` and `.to("cpu")` look like device placements on a CPU machine; tensors made on other
threads are not tagged (modes are per thread).
"""

from __future__ import annotations

import contextlib
import traceback

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_flatten, tree_map

_TAG = "_vp_host_born"
_FACTORIES = set(_device_constructors()) | {torch.from_numpy, torch.frombuffer}


def is_host(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _TAG, False)


def _tag(t, value: bool):
    if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
        setattr(t, _TAG, value)
    return t


def _caller() -> str:
    """The innermost project frame that issued the collective, to name it in a failure."""
    for frame in reversed(traceback.extract_stack()):
        if "vp_accelerate" in frame.filename and not frame.filename.endswith("distributed.py"):
            return f"{frame.filename.split('vp_accelerate', 1)[1].lstrip('/')}:{frame.lineno} ({frame.name})"
    return "?"


def _has_device_arg(args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    for a in args[1:]:
        if isinstance(a, (torch.device, str)) or (isinstance(a, int) and not isinstance(a, bool)):
            return True
        if isinstance(a, torch.Tensor):  # .to(other): follows the other tensor
            return True
    return False


class HostTagMode(TorchFunctionMode):
    """Tag tensors that a GPU run would hold in host memory (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FACTORIES:
            return tree_map(lambda t: _tag(t, kwargs.get("device") is None), out)
        if func is torch.Tensor.cpu:
            src = args[0]
            return _tag(out.clone() if out is src else out, True)  # a real .cpu() copies a GPU tensor
        if func in (torch.Tensor.to, torch.Tensor.cuda) and (
            func is torch.Tensor.cuda or _has_device_arg(args, kwargs)
        ):
            src = args[0]
            if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], torch.Tensor):
                moved_host = is_host(args[1])
            else:
                moved_host = False
            if out is src and is_host(src) != moved_host:
                out = out.view_as(out)  # a no-op move on CPU: tag an alias, not the source
            return _tag(out, moved_host)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(is_host(t) for t in inputs) and not any(not is_host(t) and t.dim() > 0 for t in inputs):
            # only host tensors (or host tensors and device scalars) in: the result is on the host
            tree_map(lambda t: _tag(t, True), out)
        return out


_TENSOR_OPS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
)
_P2P = ("isend", "irecv")  # patched in c10d too: P2POp checks `op in [isend, irecv]` against c10d's names
_OBJECT_OPS = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")


class CollectiveAudit:
    """Record every collective's (kind, op, group, tensor device, host tag) while active."""

    def __init__(self, device: torch.device, host_groups):
        self.device = torch.device(device)
        self.host_groups = [g for g in host_groups if g is not None]
        self.records: list[dict] = []
        self._saved: list[tuple[object, str, object]] = []

    def _kind(self, group) -> str:
        return "host" if any(group is g for g in self.host_groups) else "device"

    def _note(self, op: str, tensors, group) -> None:
        kind = self._kind(group)
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.records.append(
                    {
                        "op": op,
                        "group": kind,
                        "device": str(t.device),
                        "host_tag": is_host(t),
                        "shape": tuple(t.shape),
                        "at": _caller(),
                    }
                )

    @staticmethod
    def _group(args, kwargs, position: int):
        if "group" in kwargs:
            return kwargs["group"]
        return args[position] if len(args) > position else None

    def _wrap(self, name: str, orig):
        audit = self
        group_pos = {
            "all_reduce": 2,
            "broadcast": 2,
            "reduce": 3,
            "all_gather": 2,
            "all_gather_into_tensor": 2,
            "reduce_scatter": 3,
            "reduce_scatter_tensor": 3,
            "all_to_all": 2,
            "all_to_all_single": 4,
            "gather": 3,
            "scatter": 3,
            "send": 2,
            "recv": 2,
            "isend": 2,
            "irecv": 2,
            "all_gather_object": 2,
            "gather_object": 3,
            "broadcast_object_list": 2,
            "scatter_object_list": 3,
        }[name]

        def wrapper(*args, **kwargs):
            group = audit._group(args, kwargs, group_pos)
            if name in _OBJECT_OPS:
                audit.records.append(
                    {
                        "op": name,
                        "group": audit._kind(group),
                        "device": "object",
                        "host_tag": False,
                        "shape": (),
                        "at": _caller(),
                    }
                )
            else:
                tensors = [a for a in tree_flatten((args[:2], kwargs.get("tensor"), kwargs.get("tensor_list")))[0]]
                audit._note(name, tensors, group)
            return orig(*args, **kwargs)

        wrapper.__name__ = name
        return wrapper

    def _batch(self, orig):
        audit = self

        def batch_isend_irecv(p2p_op_list):
            for op in p2p_op_list:
                audit._note("batch_isend_irecv", [op.tensor], op.group)
            return orig(p2p_op_list)

        return batch_isend_irecv

    def __enter__(self):
        for name in _TENSOR_OPS + _P2P + _OBJECT_OPS:
            orig = getattr(dist, name)
            wrapped = self._wrap(name, orig)
            self._patch(dist, name, wrapped)
            if name in _P2P:
                self._patch(c10d, name, wrapped)
        self._patch(dist, "batch_isend_irecv", self._batch(dist.batch_isend_irecv))
        return self

    def _patch(self, module, name: str, value) -> None:
        self._saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def __exit__(self, *exc):
        for module, name, value in reversed(self._saved):
            setattr(module, name, value)
        self._saved.clear()

    def _unique(self) -> list[dict]:
        seen, out = set(), []
        for r in self.records:
            key = (r["op"], r["group"], r["device"], r["host_tag"], r["at"])
            if key not in seen:
                seen.add(key)
                out.append(r)
        return out

    def problems(self) -> list[str]:
        """Every record that NCCL would reject (or that stages host data through the GPU)."""
        out = []
        for r in self._unique():
            if r["group"] == "device":
                if r["device"] == "object":
                    out.append(f"{r['at']}: {r['op']}, an object collective on a device group (use a host group)")
                elif r["device"] != str(self.device) or r["host_tag"]:
                    where = "a host tensor" if r["host_tag"] else f"a tensor on {r['device']}"
                    out.append(
                        f"{r['at']}: {r['op']}, {where} of shape {r['shape']} on a device group (device {self.device})"
                    )
            elif r["device"] not in ("object", "cpu"):
                out.append(f"{r['at']}: {r['op']}, a tensor on {r['device']} on a host (gloo) group")
        return out


@contextlib.contextmanager
def audit(device, host_groups):
    """Both pieces at once: yields the CollectiveAudit."""
    with CollectiveAudit(device, host_groups) as rec, HostTagMode():
        yield rec
