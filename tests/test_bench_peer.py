"""The peer (torch.distributed.pipelining Schedule1F1B) computes the same loss and gradients as HF."""

import torch
import torch.distributed as dist

from vp_accelerate.bench.config import BenchConfig, llama_config, synthetic_batch
from vp_accelerate.bench.peer import PeerRunner, build_peer_model, even_split
from vp_accelerate.distributed import spawn

CFG = BenchConfig(hidden=64, layers=4, heads=4, seq=16, microbatches=4)
VOCAB = 500


def _peer_step(cfg: BenchConfig, vocab: int):
    runner = PeerRunner(llama_config(cfg, vocab), cfg.microbatches, seed=cfg.seed)
    # 30% ignored labels: microbatches have different valid-token counts, so a mean of
    # per-microbatch means would differ from the token mean checked below.
    input_ids, labels = synthetic_batch(cfg, vocab, ignore_fraction=0.3)
    losses = []
    for _ in range(2):  # the second step checks that per-step state (n_valid, passes) is reset
        runner.zero_grad()
        loss, passes = runner.step(input_ids, labels)
        losses.append(loss)
    ops = sorted((p.op, p.mb) for p in passes)
    assert ops == sorted([("F", k) for k in range(cfg.microbatches)] + [("B", k) for k in range(cfg.microbatches)])
    # numpy, not tensors: torch's queue pickling shares tensor storage through files the exiting
    # child may already have removed
    grads = {n: p.grad.numpy().copy() for n, p in runner.module.named_parameters()}
    return dist.get_rank(), losses, grads


def test_peer_matches_single_process_hf_reference():
    results = spawn(_peer_step, 2, CFG, VOCAB, timeout_s=60)
    model = build_peer_model(llama_config(CFG, VOCAB), CFG.seed)
    input_ids, labels = synthetic_batch(CFG, VOCAB, ignore_fraction=0.3)
    ref = model(input_ids=input_ids, labels=labels).loss
    ref.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    for rank, losses, grads in results:
        for loss in losses:
            assert abs(loss - ref.item()) < 1e-5, (rank, loss, ref.item())
        start, _ = even_split(CFG.layers, 2, rank)
        for name, g in grads.items():
            # stage names: embed_tokens.weight, layers.{i}.…, norm.weight, lm_head.weight
            if name.startswith("layers."):
                i, rest = name[len("layers.") :].split(".", 1)
                hf_name = f"model.layers.{int(i) + start}.{rest}"
            elif name.startswith("lm_head"):
                hf_name = name
            else:
                hf_name = f"model.{name}"
            torch.testing.assert_close(torch.from_numpy(g), ref_grads[hf_name], atol=1e-5, rtol=1e-4, msg=hf_name)


def test_even_split_covers_all_layers():
    for layers, stages in [(8, 2), (7, 3), (3, 3)]:
        ranges = [even_split(layers, stages, s) for s in range(stages)]
        assert ranges[0][0] == 0 and ranges[-1][1] == layers
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1
