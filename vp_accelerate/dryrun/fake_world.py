"""One rank of a fake world: torch's fake process group and FakeTensorMode, an allocator counter, and the
recording of every operation on every communicator.

The runtime runs unchanged; the seams it needs are set here and undone on exit:
- host side groups use the fake backend (`groups.HOST_BACKEND`): the fake world has no gloo;
- the meta skeleton of the HF model is built outside fake mode (fake meta parameters cannot be swapped into
  real modules by `nn.Module._apply`), and `torch.utils.swap_tensors` falls back to `.data` for fake
  parameters that hold weak references;
- the vocabulary collective chains run inline in issue order (on a GPU they are issued on a side stream at
  submit time; the CPU worker thread would hide them from the counter);
- the TP sequence all-gather and reduce-scatter are recorded where runtime/tensor_parallel.py holds torch's
  functions (it binds them at import, past the patched `torch.distributed` names);
- a host read of a device value (`.item()`, `bool(t)`) is answered (True / 1) and recorded as a sync;
- fp16's overflow check (`precision.unscale_and_check`) runs and is recorded, and answers "no overflow": a
  finite step, whose optimizer step (and ZeRO-1 broadcast) runs as on a GPU; the host read's 1 would say
  overflow and skip it every step;
- the schedule's order is the one a GPU rank builds (`rank_parts.rank_schedules` with the GPU's pass
  costs), not the order a CPU device would get;
- transformers' mask builder does not take a fake padding mask for a traced one: on a GPU a batch without
  padding gets no mask (SDPA's is_causal, and grouped-query attention without repeating k and v), and the
  dry run counts that path, not the materialised [b, 1, s, s] mask and repeated k / v of a traced graph;
- SDPA with attention dropout (GPT-2's attn_pdrop) runs without it: a GPU's flash and memory-efficient kernels
  drop inside the kernel from a seed and keep what they keep without dropout, where the CPU's only path with
  dropout is the math one, which materialises the [b, a, s, s] scores, probabilities and dropout mask (GPT-2
  medium: the dry run 2.9x the planner's figure with them);
- while the checkpoint's state_dict is taken, a copy to "cpu" is the host copy it is on a GPU (the ZeRO
  moments streamed to the host) and is not counted as device memory.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._pytree import tree_flatten

from vp_accelerate.dryrun import FakeWorldMissing
from vp_accelerate.models import build as model_build
from vp_accelerate.models import meta as model_meta
from vp_accelerate.runtime import groups as runtime_groups
from vp_accelerate.runtime import p2p
from vp_accelerate.schedule.world import CommOp as Op
from vp_accelerate.vocab import comm

try:  # torch has no public fake process group; this private one is tested on the torch versions pyproject allows
    from torch.testing._internal.distributed.fake_pg import FakeStore
except ImportError as e:
    raise FakeWorldMissing(
        f"the dry run needs torch's fake process group (torch.testing._internal.distributed.fake_pg), which "
        f"torch {torch.__version__} does not have ({e}); install a full torch >= 2.11 (pyproject.toml's range)"
    ) from None


@dataclass
class Recorder:
    """The ordered program of the rank being run, and the names of the groups it created."""

    ops: list[Op] = field(default_factory=list)
    names: dict = field(default_factory=dict)  # id(group) -> name
    counts: dict = field(default_factory=dict)  # (kind, ranks) -> groups made so far
    phase: str = "build"
    lock: threading.Lock = field(default_factory=threading.Lock)
    named: object = None  # () -> (name, parameter) pairs of the rank's model, set once it is built
    idents: list = field(default_factory=list)  # the next collectives' identities (the buckets just planned)

    def bucket_names(self, tensors, buckets) -> list[str]:
        """Per bucket of `tensors` (parameters or their gradients), its parameters' names."""
        names = {}
        for n, p in self.named() if self.named is not None else ():
            names[id(p)] = n
            if p.grad is not None:
                names[id(p.grad)] = n
        return [",".join(names.get(id(tensors[i]), f"?{tuple(tensors[i].shape)}") for i in idx) for idx in buckets]

    def name(self, group) -> str:
        if group is None or group is dist.group.WORLD:
            return f"dev:{tuple(range(dist.get_world_size()))}#world"
        return self.names.get(id(group), f"dev:unknown{id(group)}")

    def add(self, op: Op) -> None:
        with self.lock:
            self.ops.append(op)


_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
    "gather",
    "scatter",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
)


def _bytes(args) -> int:
    flat, _ = tree_flatten(list(args))
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


def _group_arg(fn_name: str, args, kwargs):
    if "group" in kwargs:
        return kwargs["group"]
    # positional group: all_reduce(t, op, group), broadcast(t, src, group), all_gather(l, t, group), ...
    pos = {"barrier": 0, "all_gather_object": 2, "gather_object": 3, "broadcast_object_list": 2}.get(fn_name, 2)
    return args[pos] if len(args) > pos else None


@contextlib.contextmanager
def recording(rec: Recorder):
    """Patch torch.distributed's calls to append each one to `rec` (then run it on the fake group)."""
    saved = {}
    host_kinds = {"gloo", "fake"}

    def new_group(*args, **kwargs):
        g = saved["new_group"](*args, **kwargs)
        ranks = kwargs.get("ranks", args[0] if args else None)
        ranks = tuple(range(dist.get_world_size())) if ranks is None else tuple(sorted(ranks))
        kind = "host" if kwargs.get("backend") in host_kinds else "dev"
        k = rec.counts.get((kind, ranks), 0)
        rec.counts[(kind, ranks)] = k + 1
        rec.names[id(g)] = f"{kind}:{ranks}#{k}"
        return g

    def collective(fn_name):
        def call(*args, **kwargs):
            name = rec.name(_group_arg(fn_name, args, kwargs))
            root = kwargs.get("src", args[1] if len(args) > 1 else None) if fn_name in ("broadcast", "reduce") else None
            ident = rec.idents.pop(0) if rec.idents and name.startswith("dev:") else ""
            op = Op(name.split(":")[0], name, fn_name, nbytes=_bytes(args[:2]), label=rec.phase, ident=ident, root=root)
            rec.add(op)
            return saved[fn_name](*args, **kwargs)

        return call

    def batch(p2p_op_list):
        rank = dist.get_rank()
        ops = []
        for o in p2p_op_list:
            d = "send" if o.op is dist.isend else "recv"
            ops.append((d, o.peer if o.peer is not None else o.group_peer, o.tensor.numel() * o.tensor.element_size()))
        name = rec.name(p2p_op_list[0].group)
        del rank
        rec.add(Op(name.split(":")[0], name, "batch_isend_irecv", p2p=tuple(ops), label=rec.phase))
        return saved["batch_isend_irecv"](p2p_op_list)

    def single(fn_name, d):
        def call(tensor, peer=None, group=None, tag=0, **kwargs):
            name = rec.name(group)
            peer = peer if peer is not None else kwargs.get("group_peer")
            nb = tensor.numel() * tensor.element_size()
            rec.add(Op(name.split(":")[0], name, fn_name, p2p=((d, peer, nb),), label=rec.phase))
            return saved[fn_name](tensor, peer, group, tag, **kwargs)

        return call

    from vp_accelerate.runtime import grad_sync, zero

    real_plan = grad_sync.plan_buckets

    def plan_buckets(tensors, *args, **kwargs):
        # the buckets just planned are the next device collectives (grad_sync's all-reduces, zero's
        # broadcasts issue one per bucket, in order): each carries its parameters' names
        buckets = real_plan(tensors, *args, **kwargs)
        rec.idents = rec.bucket_names(tensors, buckets)
        return buckets

    grad_sync.plan_buckets = zero.plan_buckets = plan_buckets
    # the TP sequence all-gather and reduce-scatter: runtime/tensor_parallel.py holds torch's functions (their
    # names differ between torch releases), so they are recorded where it holds them
    from vp_accelerate.runtime import tensor_parallel as tp_comm

    real_tp = (tp_comm._ALL_GATHER, tp_comm._REDUCE_SCATTER)

    def tp_collective(kind, real):
        def call(*args, **kwargs):
            name = rec.name(_group_arg(kind, args, kwargs))
            rec.add(Op(name.split(":")[0], name, kind, nbytes=_bytes(args[:2]), label=rec.phase))
            return real(*args, **kwargs)

        return call

    tp_comm._ALL_GATHER = tp_collective("all_gather_into_tensor", real_tp[0])
    tp_comm._REDUCE_SCATTER = tp_collective("reduce_scatter_tensor", real_tp[1])
    patches = {"new_group": new_group, "batch_isend_irecv": batch}
    patches.update({n: collective(n) for n in _COLLECTIVES})
    # isend / irecv stay unpatched: P2POp checks its op by identity (the runtime batches them)
    patches.update({"send": single("send", "send"), "recv": single("recv", "recv")})
    for n, f in patches.items():
        saved[n] = getattr(dist, n)
        setattr(dist, n, f)
    original_p2p, p2p._ORIGINAL = p2p._ORIGINAL, batch  # p2p.install() puts torch's own back
    try:
        yield rec
    finally:
        grad_sync.plan_buckets = zero.plan_buckets = real_plan
        tp_comm._ALL_GATHER, tp_comm._REDUCE_SCATTER = real_tp
        p2p._ORIGINAL = original_p2p
        for n, f in saved.items():
            setattr(dist, n, f)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    """The tensors among an op's arguments (one level of lists: aten ops take no deeper nesting)."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


_DEVICE = torch.ops.prim.device.default
_TO_COPY = torch.ops.aten._to_copy.default


class AllocCounter(FakeTensorMode):
    """The fake tensor mode of a rank, counting the live and peak bytes of tensor storages as an allocator
    sees them: a storage counts from the op that made it until its last reference dies. Also answers host
    reads of fake values (True / 1) and records each as a sync in the rank's program. One mode, not a mode
    over FakeTensorMode: every op of a step passes one Python dispatch layer instead of two."""

    def __init__(self, rec: Recorder):
        super().__init__(allow_non_fake_inputs=True)
        self.rec = rec
        self.live = 0
        self.peak = 0
        self._seen: dict[int, weakref.finalize] = {}
        self._inside = False  # dispatching an op: nested ops are its implementation, not the runtime's

    def reset_peak(self) -> int:
        self.peak = self.live
        return self.live

    def _track(self, t: torch.Tensor) -> None:
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(s)
        if key in self._seen and self._seen[key].alive:
            return
        nbytes = s.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self._seen[key] = weakref.finalize(s, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and isinstance(args[0], FakeTensor):
            # `t.device` (over half the calls a step makes): answered here, not through the fake mode below
            return args[0].fake_device
        kwargs = kwargs or {}
        tensors = _tensors(args, kwargs)
        host_data = tensors and not any(isinstance(t, FakeTensor) or t.is_meta for t in tensors)
        meta_factory = not tensors and str(kwargs.get("device")) == "meta"
        if host_data or meta_factory:
            # host data (the batch, its masks): real values in host memory; a module made on the meta device
            # stays real meta, so that materialising it swaps in fake tensors (nn.Module._apply)
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            self.rec.add(Op("sync", "", "read", label=self.rec.phase))
            if t.dtype == torch.bool:
                return True
            return 1.0 if t.is_floating_point() else 1
        # self.dispatch, not super().__torch_dispatch__: the same work without a second dynamo-disable wrapper
        # and stats counter per op (a step makes hundreds of thousands)
        if self._inside:  # an op the fake mode runs to implement another (a decomposition): the outer one is
            return self.dispatch(func, types, args, kwargs)  # the kernel a GPU runs, counted alone
        self._inside = True
        try:
            out = self.dispatch(func, types, args, kwargs)
        finally:
            self._inside = False
        if self.rec.phase == "save" and func is _TO_COPY and str(kwargs.get("device")) == "cpu":
            return out  # the checkpoint's copy to the host (`.to("cpu")`): host memory, not the device's
        for t in _tensors(out if isinstance(out, (tuple, list)) else (out,), {}):
            self._track(t)
        return out


def _inline_submit(self, chain):
    job = comm._ThreadJob(chain)
    job.run()
    return job


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int):
    """This process as `rank` of a fake world of `world_size`: yields (Recorder, AllocCounter); every
    tensor made inside is fake (allocations counted, no memory used)."""
    rec = Recorder()
    if dist.is_initialized():
        dist.destroy_process_group()
    runtime_groups._HOST_GROUP = None
    saved = (runtime_groups.HOST_BACKEND, model_build.meta_model, torch.utils.swap_tensors, comm.CommWorker.submit)
    real_meta, real_swap = saved[1], saved[2]

    def meta_model(*args, **kwargs):
        with unset_fake_temporarily():
            return real_meta(*args, **kwargs)

    def swap(t1, t2):
        try:
            real_swap(t1, t2)
        except RuntimeError:
            with torch.no_grad():
                t1.data = t2.data

    from transformers import masking_utils

    from vp_accelerate.runtime import precision, rank_parts

    saved_check = precision.unscale_and_check

    def finite_step(*args, **kwargs) -> bool:
        saved_check(*args, **kwargs)  # its work and its all-reduce are counted and recorded
        return False  # the host read answered 1 ("overflow"); a GPU's finite step says 0

    precision.unscale_and_check = finite_step
    saved_sdpa = torch.nn.functional.scaled_dot_product_attention

    def gpu_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        # dropout inside a GPU kernel keeps nothing more (module docstring)
        return saved_sdpa(query, key, value, attn_mask, 0.0, *args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = gpu_sdpa
    saved_schedules = rank_parts.rank_schedules
    rank_parts.rank_schedules = lambda config, cfg, pp, _device: saved_schedules(config, cfg, pp, "cuda")
    saved_tracing = masking_utils.is_tracing
    masking_utils.is_tracing = lambda tensor=None: saved_tracing(None)  # fakeness is not tracing here
    runtime_groups.HOST_BACKEND = "fake"
    model_build.meta_model = model_meta.meta_model = meta_model
    torch.utils.swap_tensors = swap
    comm.CommWorker.submit = _inline_submit
    try:
        with recording(rec), warnings.catch_warnings():
            # the runtime's own activation meter keys storages by data_ptr, which fake tensors do not have
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
            counter = AllocCounter(rec)
            with counter:
                yield rec, counter
    finally:
        runtime_groups.HOST_BACKEND, model_build.meta_model, torch.utils.swap_tensors, comm.CommWorker.submit = saved
        model_meta.meta_model = real_meta
        masking_utils.is_tracing = saved_tracing
        rank_parts.rank_schedules = saved_schedules
        precision.unscale_and_check = saved_check
        torch.nn.functional.scaled_dot_product_attention = saved_sdpa
        if dist.is_initialized():
            dist.destroy_process_group()
        runtime_groups._HOST_GROUP = None
