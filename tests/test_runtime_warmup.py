"""Communicators up front: the process group is bound to the rank's GPU (`device_id`) on NCCL, and
`PipelineModel` connects every communicator of the rank (pipeline, vocabulary, data-parallel, tied) in one
fixed order before the first step (runtime/groups.warm_up); the validator's lazy-creation model
(schedule/streams.py) shows why: without it a vocabulary method would create one communicator while the
other's operations may still run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from vp_accelerate.distributed import init_kwargs, spawn
from vp_accelerate.schedule import ScheduleError, build_schedule
from vp_accelerate.schedule.registry import supported_pairs
from vp_accelerate.schedule.streams import replay_streams


def test_nccl_groups_are_bound_to_the_rank_device():
    cuda1 = torch.device("cuda", 1)
    assert init_kwargs("nccl", cuda1) == {"device_id": cuda1}
    assert init_kwargs("gloo") == {}


@pytest.mark.parametrize("kind,method", supported_pairs())
def test_with_the_warm_up_every_order_passes_and_without_it_vocab_methods_are_rejected(kind, method):
    for p in (2, 4, 8, 16, 32):
        s = build_schedule(kind, method, p, p)
        replay_streams(s, serialized=True)  # pipeline + vocabulary communicators connected before the step
        replay_streams(s, serialized=False)
        if s.vocab_parallel:  # two communicators: the second would be created with the first one's ops in flight
            with pytest.raises(ScheduleError, match="would create the (pp|vocab) communicator"):
                replay_streams(s, serialized=False, connected=frozenset())
        else:  # one communicator: its lazy creation is a collective point every rank reaches
            replay_streams(s, serialized=False, connected=frozenset())


def _ops_before_first_step(method: str):
    from helpers.tiny import tiny_llama
    from vp_accelerate.runtime import PipelineConfig, PipelineModel, p2p

    seen: list = []  # (what, group) in call order, during PipelineModel's construction only
    real_all_reduce, real_broadcast, real_post = dist.all_reduce, dist.broadcast, p2p.post

    def all_reduce(t, *a, group=None, **k):
        seen.append(("all_reduce large" if t.numel() * t.element_size() >= 2**20 else "all_reduce", group))
        return real_all_reduce(t, *a, group=group, **k)

    def broadcast(t, *a, group=None, **k):
        seen.append(("broadcast", group))
        return real_broadcast(t, *a, group=group, **k)

    def post(ops, label):  # every p2p batch goes through p2p.post (torch's, or the NCCL emulation)
        seen.append(("p2p", ops[0].group))
        return real_post(ops, label)

    dist.all_reduce, dist.broadcast, p2p.post = all_reduce, broadcast, post
    try:
        pipe = PipelineModel(
            tiny_llama(101, tied=True, num_layers=4),
            PipelineConfig(schedule="1f1b", method=method, microbatches=2, pp_size=2, dp_size=2),
        )
    finally:
        dist.all_reduce, dist.broadcast, p2p.post = real_all_reduce, real_broadcast, real_post
    g = pipe.groups
    names = {id(g.pp_group): "pp", id(g.vocab_group): "vocab", id(g.dp_group): "dp"}
    if pipe.parts.tied_group is not None:
        names[id(pipe.parts.tied_group)] = "tied"
    out = [(what, names[id(group)]) for what, group in seen if id(group) in names]
    ids = torch.randint(0, 101, (4, 8), generator=torch.Generator().manual_seed(g.dp_rank))
    loss = pipe.train_step(ids, ids).loss  # the step runs on the connected communicators
    pipe.close()
    return out, loss


@pytest.mark.parametrize("method", ["vocab-2", "baseline"])
def test_pipeline_model_connects_every_communicator_in_one_order_before_step_1(method):
    """Each communicator: a small all-reduce, a broadcast and one large all-reduce (the large one and the
    broadcast are new: this failed before they were added to the warm-up)."""
    per_rank = spawn(_ops_before_first_step, 4, method, timeout_s=120)
    groups = ["pp", "vocab", "dp"] + (["tied"] if method == "baseline" else [])  # tied: first and last stage
    want = [(what, g) for g in groups for what in ("all_reduce", "broadcast", "all_reduce large")]
    want.append(("p2p", "pp"))
    for ops, _ in per_rank:
        assert ops == want
    assert len({round(loss, 6) for _, loss in per_rank}) == 1


def test_a_host_group_that_does_not_connect_names_the_interface(monkeypatch):
    from vp_accelerate.runtime import groups

    def refused():
        raise RuntimeError("Connection refused")

    monkeypatch.setattr(groups, "host_group", refused)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    with pytest.raises(RuntimeError, match=r"gloo host group does not connect \(GLOO_SOCKET_IFNAME=eth9\).*refused"):
        groups.connect_host_group()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    with pytest.raises(RuntimeError, match="GLOO_SOCKET_IFNAME unset"):
        groups.connect_host_group()
