"""The output layer and input embedding on 1-4 gloo ranks vs a single-process float64 reference.

One spawn per world size runs every case (spawning costs seconds, a case milliseconds). Each run draws
a fresh seed, printed in the failure message so a failure can be replayed with `verify_case`.
"""

import random

import pytest

from vp_accelerate.distributed import spawn
from vp_accelerate.vocab.output_layer import OutputLayerOptions as Opts
from vp_accelerate.vocab.verify import VerifyCase, verify_case

TOL = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 4e-2}
V = 101  # prime: never divisible by the world size


def cases(p: int) -> list[VerifyCase]:
    out = []
    for algo in ("naive", "vocab-1", "vocab-2"):
        for memory in ("store", "recompute"):
            for chunk in (None, 7):
                out.append(VerifyCase(vocab_size=V, microbatches=2, opts=Opts(algo, memory, chunk)))
        # label smoothing; softcap + logit scale; everything at once with tied weights and padded shards
        out.append(VerifyCase(vocab_size=V, opts=Opts(algo, "store", 16, label_smoothing=0.1)))
        out.append(
            VerifyCase(vocab_size=V, microbatches=2, opts=Opts(algo, "recompute", None, softcap=4.0, logit_scale=0.6))
        )
        out.append(
            VerifyCase(
                vocab_size=V,
                tied=True,
                pad_multiple=16,
                microbatches=2,
                opts=Opts(algo, "store", 5, label_smoothing=0.2, softcap=6.0, logit_scale=1.3),
            )
        )
        out.append(VerifyCase(vocab_size=V, tied=True, opts=Opts(algo, "recompute", 9)))
        # an output bias sharded with the rows (Phi), with padded shards, chunks and every transform
        out.append(
            VerifyCase(
                vocab_size=V,
                bias=True,
                pad_multiple=16,
                microbatches=2,
                opts=Opts(algo, "store", 7, label_smoothing=0.1, softcap=5.0, logit_scale=0.8),
            )
        )
        out.append(VerifyCase(vocab_size=V, bias=True, tied=True, opts=Opts(algo, "recompute")))
        # shards that are pure padding on 4 ranks (V=9 split 4/4/1/0), and a microbatch with no valid label
        out.append(VerifyCase(vocab_size=9, pad_multiple=4, microbatches=2, opts=Opts(algo, "recompute", 3)))
        out.append(VerifyCase(vocab_size=V, ignored_fraction=1.0, opts=Opts(algo)))
        # low precision: x and weights in bf16/fp16, statistics in fp32
        out.append(VerifyCase(vocab_size=V, dtype="bfloat16", microbatches=2, opts=Opts(algo, "store", 20)))
        out.append(VerifyCase(vocab_size=V, dtype="float16", opts=Opts(algo, "recompute")))
    # every root: the rank that reduces IF, broadcasts X (C0) and ∂L/∂emb (IB)
    return [VerifyCase(**{**c.__dict__, "root": i % p}) for i, c in enumerate(out)]


def _run_all(p: int, seed: int) -> list[dict]:
    return [verify_case(c, seed) for c in cases(p)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_algorithms_and_modes_match_float64(world_size):
    seed = random.randrange(2**31)
    per_rank = spawn(_run_all, world_size, world_size, seed, timeout_s=180)
    failures = []
    for i, case in enumerate(cases(world_size)):
        errs = {q: max(r[i][q] for r in per_rank) for q in per_rank[0][i]}
        if max(errs.values()) > TOL[case.dtype]:
            failures.append(f"{case}: {errs}")
    assert not failures, f"seed {seed}, world size {world_size}:\n" + "\n".join(failures)


def _chain_outputs(n: int, h: int) -> dict:
    """S, C1, T (, C2) of one microbatch per algorithm on this rank: (storage bytes, own bytes) of every
    tensor a chain left in the state, and the bytes the state holds after C1 (inputs and logits aside)."""
    import torch
    import torch.distributed as dist

    from vp_accelerate.runtime.memory import storage_bytes
    from vp_accelerate.vocab import output_layer as vout
    from vp_accelerate.vocab.partition import VocabPartition

    rank = dist.get_rank()
    part = VocabPartition(V, dist.get_world_size())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=gen)
    weight = torch.randn(part.shard_size, h, generator=gen)
    labels = torch.randint(0, V, (n,), generator=gen)
    scale = torch.full((n,), 1.0 / n)
    out = {}
    for algo in ("naive", "vocab-1", "vocab-2"):
        state = vout.s_pass(x, labels, scale, weight, part, rank, Opts(algo, "recompute"))
        vout.c1(state, async_op=False)
        inputs = {"opts", "partition", "rank", "x", "x_shape", "weight", "bias", "labels"}
        held = storage_bytes(v for k, v in vars(state).items() if k not in inputs)
        vout.t_pass(state, torch.zeros_like(weight))
        if algo == "vocab-1":
            vout.c2(state, async_op=False)
        made = {k: getattr(state, k) for k in ("row_max", "row_sum", "loss", "loss_sum", "grad_x")}
        own = {k: (t.untyped_storage().nbytes(), t.numel() * t.element_size()) for k, t in made.items()}
        out[algo] = {"own": own, "held_after_c1": held}
    return out


def test_chain_outputs_have_storages_of_their_own():
    # vocab-2's C1 all-reduces [s_i, a_i] as one [N, h+1] buffer; a row_sum that is a view of it kept the
    # whole buffer alive from C1 to T (N*(h+1)*4 bytes per microbatch in flight instead of N*4)
    n, h = 64, 32
    for res in spawn(_chain_outputs, 2, n, h):
        for algo, got in res.items():
            for name, (storage, own) in got["own"].items():
                assert storage == own, (algo, name, storage, own)
        # what vocab-2 holds from C1 to T: [N] statistics, g, labels, the mask and ∇x — no [N, h+1] buffer
        assert res["vocab-2"]["held_after_c1"] < n * (h + 1) * 4 + n * h * 4, res["vocab-2"]
