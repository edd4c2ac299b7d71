"""Packing with document boundaries is exact: a packed batch (position ids restarting per document, SFT
loss masks, padding) gives the loss and gradients of the same documents run one by one through the HF
model, under every schedule x method on 2 gloo ranks (float64, one SGD step compared weight by weight).

SDPA runs in float64 throughout: tolerances are float64's. HF's eager attention takes its softmax in float32,
so a row of 24 keys (most masked) and a row of n keys round differently (~1e-10 in the loss, the same between
HF's own packed and unpacked forward): float32 tolerances there."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.tiny import tiny_llama
from vp_accelerate.distributed import spawn
from vp_accelerate.train.data import pack_documents

CONFIGS = [
    ("1f1b", "baseline"),
    ("1f1b", "redis"),
    ("1f1b", "vocab-1"),
    ("1f1b", "vocab-2"),
    ("vhalf", "baseline"),
    ("vhalf", "vocab-1"),
    ("vhalf", "vocab-2"),
    ("interleaved", "baseline"),
    ("interleaved", "vocab-2"),
]
LR = 0.5
SEQ, ROWS = 24, 4


def _documents(seed: int, vocab: int):
    """Documents of random lengths, each with an SFT-like loss mask (a prompt without loss, then an answer)."""
    rng = np.random.default_rng(seed)
    docs, masks = [], []
    while len(docs) < 40:
        n = int(rng.integers(2, 13))
        docs.append(rng.integers(0, vocab, n).tolist())
        cut = int(rng.integers(0, n - 1))
        masks.append([0] * cut + [1] * (n - cut))
    ids, labels, pos, _ = pack_documents(docs, masks, SEQ, pad_id=0, split_long=False)
    ids, labels, pos = (torch.from_numpy(a[:ROWS]) for a in (ids, labels, pos))
    # the documents in the rows used, recovered from the packed batch itself (padding documents carry no loss)
    pieces = []
    for r in range(ROWS):
        edges = torch.nonzero(pos[r] == 0).flatten().tolist() + [SEQ]
        pieces += [
            (ids[r, a:e], labels[r, a:e]) for a, e in zip(edges[:-1], edges[1:]) if (labels[r, a:e] != -100).any()
        ]
    assert all(len(torch.nonzero(pos[r] == 0)) >= 2 for r in range(ROWS))  # several documents in every row
    return ids, labels, pos, pieces


def _loss_sum(model, ids, labels) -> torch.Tensor:
    """Σ of next-token cross-entropies of one document, in float64 (HF's own loss upcasts only to float32)."""
    logits = model(input_ids=ids[None]).logits[0, :-1]
    return torch.nn.functional.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum")


def _reference(ckpt: str, pieces, attn: str) -> tuple[float, float, dict[str, torch.Tensor]]:
    """(loss, loss after one SGD step, weights after it) of the documents run one by one."""
    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation=attn, dtype=torch.float64)
    n_total = sum(int((lab[1:] != -100).sum()) for _, lab in pieces)
    total = 0.0
    for ids, labels in pieces:  # one document at a time: no packing, no mask, positions 0..n-1
        loss = _loss_sum(model, ids, labels) / n_total
        loss.backward()
        total += loss.item()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
        after = sum(_loss_sum(model, i, lab).item() for i, lab in pieces) / n_total
    return total, after, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_on_ranks(ckpt: str, batch, runs):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    ids, labels, pos = batch
    out = {}
    for attn, schedule, method in runs:
        pipe = PipelineModel(
            ckpt,
            PipelineConfig(schedule=schedule, method=method, microbatches=ROWS, attn_implementation=attn),
            dtype=torch.float64,
        )
        res = pipe.train_step(ids, labels, position_ids=pos)
        with torch.no_grad():
            for p in pipe.parameters():
                p -= LR * p.grad
        eval_loss = pipe.eval_step(ids, labels, position_ids=pos)
        pipe.zero_grad()
        # a batch where no token carries loss (prompts only): loss 0 and zero gradients, not 0/0
        empty = pipe.train_step(ids, torch.full_like(labels, -100), position_ids=pos)
        grads_zero = all(p.grad is None or not p.grad.any() for p in pipe.parameters())
        out[(attn, schedule, method)] = (
            res.loss,
            res.num_tokens,
            eval_loss,
            pipe.gather_hf_state_dict(),
            (empty.loss, empty.num_tokens, grads_zero),
        )
        pipe.close()
    return out


TOL = {"sdpa": dict(loss=1e-10, rtol=1e-9, atol=1e-11), "eager": dict(loss=1e-8, rtol=1e-5, atol=1e-7)}
RUNS = [("sdpa", *c) for c in CONFIGS] + [("eager", "1f1b", "vocab-2"), ("eager", "vhalf", "baseline")]


def test_packed_batch_equals_documents_one_by_one(tmp_path):
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    config = tiny_llama(101)
    ckpt = str(tmp_path / "ckpt")
    AutoModelForCausalLM.from_config(config).save_pretrained(ckpt)
    ids, labels, pos, pieces = _documents(seed, 101)
    refs = {attn: _reference(ckpt, pieces, attn) for attn in TOL}
    n_loss = sum(int((lab[1:] != -100).sum()) for _, lab in pieces)
    per_rank = spawn(_train_on_ranks, 2, ckpt, (ids, labels, pos), RUNS, timeout_s=600)
    for key in RUNS:
        tol = TOL[key[0]]
        ref_loss, ref_after, ref_params = refs[key[0]]
        for r in range(2):
            loss, n_tokens, eval_loss, _, empty = per_rank[r][key]
            assert empty == (0.0, 0, True), (key, r)
            assert loss == pytest.approx(ref_loss, rel=tol["loss"]), (key, r, seed)
            assert n_tokens == n_loss  # train/loss_tokens: only the tokens that carry loss
            assert eval_loss == pytest.approx(ref_after, rel=tol["loss"]), (key, r, seed)  # forward-only schedule
        params = per_rank[0][key][3]
        assert set(params) == set(ref_params)
        for name, ref in ref_params.items():
            torch.testing.assert_close(
                params[name], ref, rtol=tol["rtol"], atol=tol["atol"], msg=lambda m: f"{key} {name} (seed {seed}): {m}"
            )
