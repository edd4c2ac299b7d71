"""ZeRO-1 over data parallelism: each replica keeps the optimizer state of only its share of the parameters.

Without it every data-parallel replica of a pipeline rank holds the same AdamW moments (8 bytes per fp32
parameter) for every parameter. `ZeroOptimizer` gives each parameter one owner among the d replicas
(greedy by size, largest first, so the shares are within one matrix of 1/d each); only the owner keeps
its state and runs its update, then every owner broadcasts its updated parameters to the other replicas
in flat buckets (`grad_sync.plan_buckets`). This is torch's `ZeroRedundancyOptimizer` scheme (whole
parameters per rank, all-reduced gradients, broadcast after the step), written here so that

- the owner's update is the same torch optimizer on the same tensors as without sharding, so the result
  is bit for bit today's (tested: loss and every parameter after several AdamW steps);
- the optimizer state is keyed by HF parameter name (`state_dict`), so a checkpoint holds each
  parameter's moments once per data-parallel group, and a run with another layout can find them by name;
- gradients stay all-reduced (grad_sync, unchanged): clipping's global norm, the fp16 overflow check and
  tied / LoRA parameters see the same gradients as without sharding. A reduce-scatter would save the
  broadcast's traffic but needs flat-shard optimizer state; the all-reduce also keeps gloo (which has no
  reduce_scatter_tensor on CPU in every torch version) on the same code path as NCCL.

Bytes per parameter (fp32 parameters, which are also the masters under bf16/fp16 autocast): parameter 4 +
gradient 4 + AdamW m and v 8/d. The parameters themselves are the fp32 masters here (the compute copy is
autocast's per-step cast), so they are not sharded.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from vp_accelerate.cost.data_parallel import assign_owners  # the planner prices the same shares
from vp_accelerate.runtime import p2p
from vp_accelerate.runtime.grad_sync import in_buckets, in_place, pack, unflatten_into

FORMAT = "zero-1"
"""`state_dict()["format"]` of a sharded optimizer's state."""


@torch.no_grad()
def broadcast_buckets(tensors: list[torch.Tensor], src: int, group, is_src: bool) -> int:
    """Broadcast `tensors` from global rank `src` over `group`, in flat buckets; returns the calls made."""

    def start(members):
        if is_src or in_place(members):
            flat = pack(members)
        else:  # a receiver's bucket: an empty buffer of its size
            flat = torch.empty(sum(t.numel() for t in members), dtype=members[0].dtype, device=members[0].device)
        target = members[0] if flat is None else flat
        work = p2p.collective(dist.broadcast, target, group, "ZeRO-1 parameter broadcast", async_op=True, src=src)
        return work, flat

    def finish(k, n, work, flat, members) -> None:
        p2p.wait_labelled(work, f"ZeRO broadcast {k}/{n} from rank {src}", members[0].device)
        if flat is not None and not is_src:
            unflatten_into(flat, members)

    return in_buckets(tensors, start, finish)


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


class ZeroOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose state is sharded over a data-parallel group (ZeRO-1).

    `param_groups` and hyperparameters are those of `optimizer_class(param_groups, **defaults)`: the
    outer `param_groups` hold every parameter (an LR scheduler sets their `lr`), an inner optimizer of
    `optimizer_class` holds this replica's own ones and copies the hyperparameters before each step.
    `names` gives each parameter its (HF) name, the key of its state in `state_dict`. `src_ranks[d]` is
    the global rank of replica d in `dp_group`, `dp_rank` this one's position there.
    """

    def __init__(self, param_groups, optimizer_class, dp_group, dp_rank: int, src_ranks, names: dict, **defaults):
        param_groups = [dict(g) for g in param_groups]
        for g in param_groups:
            g["params"] = list(g["params"])
        super().__init__(param_groups, defaults)
        self.dp_group, self.dp_rank, self.src_ranks = dp_group, dp_rank, list(src_ranks)
        self.names = {p: names[p] for g in self.param_groups for p in g["params"]}
        flat = [p for g in self.param_groups for p in g["params"]]
        self.owner = dict(zip(flat, assign_owners([p.numel() for p in flat], len(self.src_ranks))))
        # inner groups: this replica's parameters of each outer group (groups it owns nothing of are left out)
        self._inner_of = []  # outer group index of each inner group
        inner_groups = []
        for i, g in enumerate(self.param_groups):
            mine = [p for p in g["params"] if self.owner[p] == dp_rank]
            if mine:
                inner_groups.append({**_hyper(g), "params": mine})
                self._inner_of.append(i)
        self.inner = optimizer_class(inner_groups, **defaults) if inner_groups else None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ZeroOptimizer.step: closures are not supported (the pipeline computes the loss)")
        if self.inner is not None:
            for inner, i in zip(self.inner.param_groups, self._inner_of):
                inner.update(_hyper(self.param_groups[i]))  # the LR scheduler sets the outer groups
            self.inner.step()
        by_owner = defaultdict(list)
        for g in self.param_groups:
            for p in g["params"]:
                by_owner[self.owner[p]].append(p)
        for d, src in enumerate(self.src_ranks):
            if by_owner[d]:
                broadcast_buckets(by_owner[d], src, self.dp_group, is_src=d == self.dp_rank)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this replica holds."""
        if self.inner is None:
            return 0
        return sum(
            t.numel() * t.element_size() for s in self.inner.state.values() for t in s.values() if torch.is_tensor(t)
        )

    def state_dict(self) -> dict:
        """{"format": "zero-1", "param_groups": [hyperparameters and parameter names of each group],
        "state": {name: state of each parameter this replica owns}}.

        Like a torch optimizer's, the state's tensors are the live ones (detached, no copy): a checkpoint's
        snapshot (train/persist/writer.py) copies them to pinned host buffers without blocking the host, with
        the model's, and its background writer waits for the copies. A copy here would run on the main
        thread, a device->host transfer per moment that the host waits for, before the snapshot even began;
        a device clone would add the owned m and v (8 bytes per owned parameter) at save time. Copy before
        the next `step()` whatever must keep this step's values."""
        state = {}
        if self.inner is not None:
            for p, s in self.inner.state.items():
                state[self.names[p]] = {k: (v.detach() if torch.is_tensor(v) else v) for k, v in s.items()}
        return {
            "format": FORMAT,
            "param_groups": [{**_hyper(g), "params": [self.names[p] for p in g["params"]]} for g in self.param_groups],
            "state": state,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a `state_dict` of this format (any replica's, or all of them merged: only the owned
        parameters' state is kept), or a plain torch optimizer's over the same groups (state by index)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state has {len(groups)} parameter groups, this optimizer {len(self.param_groups)}"
            )
        if state_dict.get("format") == FORMAT:
            by_name = state_dict["state"]
        else:  # a plain torch optimizer's: state keyed by the index in the groups' order
            order = [self.names[p] for g in self.param_groups for p in g["params"]]
            by_name = {order[i]: s for i, s in state_dict["state"].items()}
        for g, saved in zip(self.param_groups, groups):
            g.update(_hyper(saved))
        if self.inner is None:
            return
        for inner, i in zip(self.inner.param_groups, self._inner_of):
            inner.update(_hyper(self.param_groups[i]))
        # through the inner optimizer's own load_state_dict (index-keyed, its groups' order): torch then puts
        # every value where its kernels read it. Moments go to the parameter's dtype and device; `step`
        # stays a CPU scalar for the plain kernels but goes to the parameter's device as float32 for fused
        # or capturable AdamW (a checkpoint is read with map_location cpu; fused CUDA kernels read the step
        # on the GPU, and expect float32 whatever dtype the saving run's scalars had).
        order = [p for g in self.inner.param_groups for p in g["params"]]
        state = {i: by_name[self.names[p]] for i, p in enumerate(order) if self.names[p] in by_name}
        groups, i = [], 0
        for g in self.inner.param_groups:
            groups.append({**_hyper(g), "params": list(range(i, i + len(g["params"])))})
            i += len(g["params"])
        self.inner.load_state_dict({"state": state, "param_groups": groups})
