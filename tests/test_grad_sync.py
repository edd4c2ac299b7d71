"""Data-parallel gradients are summed in flat buckets: the bucket plan, and the same sums as one
all-reduce per tensor (bit for bit on two ranks) with far fewer calls."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from vp_accelerate.distributed import spawn
from vp_accelerate.runtime.grad_sync import plan_buckets


def _t(n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)


def test_buckets_keep_order_one_dtype_each_and_never_exceed_the_cap():
    tensors = [_t(10), _t(10), _t(5, torch.float64), _t(5), _t(30), _t(6), _t(5, torch.float64)]
    # cap 100 B: 40 + 40 + 20 B of fp32 fill one bucket exactly, the next 24 B start another; the 120 B
    # tensor (over the cap) goes alone; the two 40 B fp64 tensors share theirs
    buckets = plan_buckets(tensors, bucket_bytes=100)
    assert buckets == [[0, 1, 3], [2, 6], [4], [5]]
    for b in buckets:
        assert len({tensors[i].dtype for i in b}) == 1
        assert len(b) == 1 or sum(tensors[i].numel() * tensors[i].element_size() for i in b) <= 100
    assert sorted(i for b in buckets for i in b) == list(range(len(tensors)))
    assert plan_buckets([_t(4)] * 3) == [[0, 1, 2]]  # the default 25 MiB cap: tiny tensors share one bucket
    assert plan_buckets([]) == []
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        plan_buckets([_t(1)], bucket_bytes=0)


def _reduce_both_ways():
    from vp_accelerate.runtime.grad_sync import all_reduce_buckets

    g = torch.Generator().manual_seed(dist.get_rank())
    shapes = [(7, 3), (5,), (40, 40), (2, 2, 2), (1,), (300,)]
    tensors = [torch.randn(s, generator=g) for s in shapes] + [torch.randn(9, generator=g, dtype=torch.float64)]
    tensors.append(torch.randn(6, 4, generator=g).t())  # a non-contiguous gradient
    reference = [t.clone() for t in tensors]
    for t in reference:
        dist.all_reduce(t)
    calls = all_reduce_buckets(tensors, None, bucket_bytes=4096)  # 40x40 fp32 (6400 B) goes alone
    return calls, all(torch.equal(a, b) for a, b in zip(tensors, reference)), len(tensors)


def test_bucketed_all_reduce_gives_the_per_tensor_sums():
    for calls, equal, n in spawn(_reduce_both_ways, 2, timeout_s=120):
        assert equal
        assert calls == 3 < n  # fp32 small ones, the big one, the fp64 one


def _pp2_dp2_run(kind: str, overlap: bool, reduce_dtype):
    from helpers.tiny import tiny_llama
    from vp_accelerate.runtime import PipelineConfig, PipelineModel, grad_sync

    cfg = PipelineConfig(
        schedule=kind, method="vocab-2", microbatches=2, pp_size=2, dp_size=2, dp_reduce_dtype=reduce_dtype
    )
    pipe = PipelineModel(tiny_llama(101, num_layers=4), cfg, seed=3)
    if not overlap:  # the old order: every gradient summed after the step
        pipe._dp_reducer = lambda: None
    issued_in_backward = []
    real_finish = grad_sync.DPReducer.finish

    def finish(self, params):
        issued_in_backward.append(self.calls)  # buckets already issued by the passes
        return real_finish(self, params)

    grad_sync.DPReducer.finish = finish
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    losses = []
    try:
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + pipe.dp_rank)  # each replica its own batch
            ids = torch.randint(3, 101, (4, 10), generator=g)
            losses.append(pipe.train_step(ids, ids).loss)
            opt.step()
            pipe.zero_grad()
    finally:
        grad_sync.DPReducer.finish = real_finish
    params = [p.detach().clone() for p in pipe.parameters()]
    pipe.close()
    return losses, params, issued_in_backward


def _pp2_dp2_losses(kind: str):
    """The reduce after the step (the old order), the overlapped one, the overlapped one in bf16."""
    return [_pp2_dp2_run(kind, *variant) for variant in ((False, None), (True, None), (True, "bf16"))]


@pytest.mark.parametrize("kind", ["1f1b", "vhalf"])
def test_pp2_dp2_overlapped_bucket_reduce_gives_the_same_losses_and_weights(kind):
    # each decoder chunk's buckets go out right after its last B/W pass on the rank; with two replicas each
    # element's sum is the same a + b whatever the bucket, so losses and weights match bit for bit
    for old, new, bf16 in spawn(_pp2_dp2_losses, 4, kind, timeout_s=300):
        (l0, p0, _), (l1, p1, issued), (l2, _, _) = old, new, bf16
        assert l0 == l1
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))
        assert issued and all(n > 0 for n in issued)  # overlapped: issued before the step ended
        assert l2 == pytest.approx(l0, rel=2e-2)  # bf16 buckets: sums rounded to bf16, losses close
        assert l2[1:] != l0[1:]  # the option is in effect: the updated weights differ slightly


def _pp2_dp2_wait_positions():
    """One pp2 x dp2 step with 4 KiB buckets (many per chunk): for each bucket, the pass that issued it and
    the pass during which the rank waited for it (None: at the step's end)."""
    from helpers.tiny import tiny_llama
    from vp_accelerate.runtime import PipelineConfig, PipelineModel, grad_sync

    R = grad_sync.DPReducer
    real = (R.__init__, R.after_pass, R._complete, dist.all_reduce)
    state = {"pass": None, "n": 0}
    issued: dict[int, int] = {}
    seen: list[tuple] = []

    def init(self, *args, **kwargs):
        real[0](self, *args, **kwargs)
        self.bucket_bytes = 4096

    def after_pass(self, a):
        state["pass"], state["n"] = state["n"], state["n"] + 1
        try:
            real[1](self, a)
        finally:
            state["pass"] = None

    def all_reduce(tensor, *args, **kwargs):
        work = real[3](tensor, *args, **kwargs)
        if state["pass"] is not None:
            issued[id(work)] = state["pass"]
        return work

    def complete(self, work, flat, members):
        seen.append((issued.get(id(work)), state["pass"]))
        real[2](self, work, flat, members)

    R.__init__, R.after_pass, R._complete, dist.all_reduce = init, after_pass, complete, all_reduce
    try:
        cfg = PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=2, pp_size=2, dp_size=2)
        pipe = PipelineModel(tiny_llama(101, num_layers=4), cfg, seed=3)
        ids = torch.randint(3, 101, (4, 10), generator=torch.Generator().manual_seed(pipe.dp_rank))
        pipe.train_step(ids, ids)
        pipe.close()
    finally:
        R.__init__, R.after_pass, R._complete, dist.all_reduce = real
    return seen


def test_pp2_dp2_bucket_reduce_is_never_waited_for_in_the_pass_that_issued_it():
    """A pass issues its chunk's buckets and returns: a bucket is retired at a later pass (only once its
    reduce completed) or at the step's end, so the reduce runs while the later passes compute. (Before,
    issuing bucket k waited for bucket k-2 inside the same pass: this failed.)"""
    for seen in spawn(_pp2_dp2_wait_positions, 4, timeout_s=120):
        from_passes = [(i, w) for i, w in seen if i is not None]
        assert len(from_passes) > 2  # several buckets issued by the backward passes
        assert all(w is None or w > i for i, w in from_passes), from_passes
