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
