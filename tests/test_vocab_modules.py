"""VocabParallelEmbedding + VocabParallelLMHeadLoss through autograd vs the float64 reference."""

import random

import pytest
import torch
import torch.distributed as dist

from vp_accelerate.distributed import spawn
from vp_accelerate.vocab.modules import VocabParallelEmbedding, VocabParallelLMHeadLoss
from vp_accelerate.vocab.output_layer import OutputLayerOptions
from vp_accelerate.vocab.reference import reference
from vp_accelerate.vocab.verify import VerifyCase, make_problem


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def _modules_errors(seed: int) -> list[float]:
    rank = dist.get_rank()
    errors = []
    for tied in (False, True):
        for algo in ("naive", "vocab-1", "vocab-2"):
            opts = OutputLayerOptions(algorithm=algo, memory="recompute", chunk_size=13, label_smoothing=0.05)
            prob = make_problem(VerifyCase(vocab_size=77, hidden=16, tokens=24, tied=tied, opts=opts), seed)
            emb = VocabParallelEmbedding(77, 16, pad_multiple=8)
            emb.load_full_weight(prob["emb"])
            head = VocabParallelLMHeadLoss(77, 16, options=opts, pad_multiple=8, weight=emb.weight if tied else None)
            if not tied:
                head.load_full_weight(prob["weight"])
            x0 = prob["x0"].clone().requires_grad_(True)
            ids, labels = prob["ids"].view(4, 6), prob["labels"].view(4, 6)  # [batch, seq] shapes
            loss = head(x0.view(4, 6, 16) + emb(ids), labels)
            loss.backward()
            ref = reference(prob["x0"], prob["ids"], prob["labels"], prob["emb"], prob["weight"], opts.label_smoothing)
            start, _ = emb.partition.shard_range(rank)
            n = emb.partition.valid_rows(rank)
            errors += [
                abs(loss.item() - ref.loss.item()) / ref.loss.item(),
                _rel(x0.grad, ref.grad_x),
                _rel(emb.weight.grad[:n], ref.grad_e[start : start + n]),
            ]
            if not tied:
                errors.append(_rel(head.weight.grad[:n], ref.grad_w[start : start + n]))
            assert torch.count_nonzero(emb.weight.grad[n:]) == 0, "padding rows got a gradient"
    return errors


@pytest.mark.parametrize("world_size", [2])
def test_modules_match_float64(world_size):
    seed = random.randrange(2**31)
    errs = spawn(_modules_errors, world_size, seed)
    worst = max(max(e) for e in errs)
    assert worst < 1e-5, f"seed {seed}: worst relative error {worst:.3g}"
