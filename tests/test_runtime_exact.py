"""The runtime executes every schedule x method exactly: losses and weights match the HF model itself.

Each world size runs in one spawn (process start-up dominates); every rank trains every configuration
on the same fresh random batches as the single-process reference — one SGD step in float32, then three
AdamW steps in float64 (Adam divides by the gradient's own scale, so float32 rounding in gradients that
are nearly zero becomes visible in the update; float64 keeps the check at 1e-5 for every element) —
and the ranks' parameters are gathered and compared with the reference model's, name by name.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from helpers.tiny import tiny_llama
from vp_accelerate.distributed import spawn
from vp_accelerate.schedule.registry import supported_pairs

CONFIGS = supported_pairs()  # every (schedule, method) the registry offers: a new schedule is tested too
RUNS = [(torch.float32, "sgd", 1), (torch.float64, "adamw", 3)]  # (dtype, optimizer, steps)
LR = 1e-3


def _optimizer(name: str, params):
    # Adam's update is lr * m / (sqrt(v) + eps): for a gradient element far below eps it is lr * g / eps, so
    # eps sets how much a gradient's rounding noise moves the weights. HF's float64 models are not float64
    # throughout (RMSNorm, the eager softmax and rotary run in float32), so the pipeline's and the
    # reference's gradients differ by ~1e-9 wherever they batch rows differently; with eps=1e-6 that moved
    # a near-zero element by 1.5e-6 after three steps for about one seed in three (data-parallel run).
    # eps=1e-4 keeps that noise 100x below the check while gradients above 1e-4 are still normalised.
    return torch.optim.SGD(params, lr=0.5) if name == "sgd" else torch.optim.AdamW(params, lr=LR, eps=1e-4)


def _tiny_config(vocab: int, tied: bool) -> LlamaConfig:
    return tiny_llama(vocab, tied=tied, attn_implementation="eager")


def _batches(seed: int, vocab: int, batch: int, seq: int, pad: bool):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max(steps for _, _, steps in RUNS)):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = ids.clone()
        if pad:  # right padding: ignored labels at the end of some rows
            for r in range(0, batch, 2):
                cut = int(torch.randint(2, seq, (1,), generator=g))
                labels[r, cut:] = -100
        out.append((ids, labels))
    return out


def _reference(ckpt: str, batches, dtype, opt_name, steps) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=dtype)
    opt = _optimizer(opt_name, model.parameters())
    losses = []
    for ids, labels in batches[:steps]:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        eval_loss = model(input_ids=batches[0][0], labels=batches[0][1]).loss.item()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, eval_loss


def _train_on_ranks(ckpt: str, batches, configs, microbatches: int, dp_size: int, runs):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    results = {}
    for config, (dtype, opt_name, steps) in [(c, r) for c in configs for r in runs]:
        schedule, method, *split = config  # an explicit layers_per_stage may follow the method
        pipe = PipelineModel(
            ckpt,
            PipelineConfig(
                schedule=schedule,
                method=method,
                microbatches=microbatches,
                layers_per_stage=split[0] if split else None,
                dp_size=dp_size,
                attn_implementation="eager",
            ),
            dtype=dtype,
        )
        opt = _optimizer(opt_name, pipe.parameters())
        losses = []
        for ids, labels in batches[:steps]:
            rows = ids.shape[0] // dp_size
            sl = slice(pipe.dp_rank * rows, (pipe.dp_rank + 1) * rows)
            res = pipe.train_step(ids[sl], labels[sl])
            opt.step()
            pipe.zero_grad()
            losses.append(res.loss)
        stats = pipe.stats()
        layers = tuple(end - start for start, end in pipe.layout.chunk_layers)
        memory = (
            stats["peak_activation_microbatches"],
            stats["peak_stash_microbatches"],
            stats["peak_activation_bytes"],
            layers,
        )
        comm = sorted({(r.op, r.mb) for r in stats["timeline"] if r.lane == "comm" and r.end >= r.start})
        overlapped = _passes_during_chains(stats["timeline"])
        eval_loss = pipe.eval_step(*batches[0])
        results[(*config, opt_name)] = (
            losses,
            pipe.gather_hf_state_dict(),
            memory,
            eval_loss,
            comm,
            pipe.schedule,
            overlapped,
        )
        pipe.close()
    return results


def _passes_during_chains(timeline) -> int:
    """Compute passes of this rank that started while one of its collective chains ran (the lanes' records)."""
    from vp_accelerate.schedule.ir import COMPUTE_OPS

    chains = [(r.start, r.end) for r in timeline if r.lane == "comm"]
    starts = [r.start for r in timeline if r.lane == "compute" and r.op in COMPUTE_OPS]
    return sum(any(a < t < b for a, b in chains) for t in starts)


def _check(world: int, vocab: int, tied: bool, configs, dp_size: int = 1, tmp_path=None, runs=RUNS):
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_tiny_config(vocab, tied))
    ckpt = str(tmp_path / "ckpt")
    model.save_pretrained(ckpt)
    microbatches = 2 * (world // dp_size)
    batches = _batches(seed, vocab, batch=microbatches * dp_size, seq=8, pad=True)
    per_rank = spawn(_train_on_ranks, world, ckpt, batches, configs, microbatches, dp_size, runs, timeout_s=600)
    for dtype, opt_name, steps in runs:
        ref_losses, ref_params, ref_eval = _reference(ckpt, batches, dtype, opt_name, steps)
        for key in [(*c, opt_name) for c in configs]:
            _compare(key, per_rank, world, ref_losses, ref_params, seed)
            for r in range(world):  # evaluation with the forward-only schedule, on the trained weights
                assert per_rank[r][key][3] == pytest.approx(ref_eval, rel=1e-5), (key, r)
            _check_comm_lane(key, per_rank, world, microbatches)
            if key[1] == "interlaced":  # synchronous: every rank waits for each chain before its next pass
                assert [per_rank[r][key][6] for r in range(world)] == [0] * world, key
    _compare_memory_with_simulator(per_rank, configs, world // dp_size, microbatches, vocab, runs[0])


def _check_comm_lane(key, per_rank, world, microbatches):
    """The measured timeline has each vocabulary collective chain as it ran, on its own lane."""
    method = key[1]
    two = ["C0", "C1", "C2", "IB_BCAST", "IF_REDUCE"]
    ops = {"vocab-1": two, "interlaced": two, "vocab-2": ["C0", "C1", "IB_BCAST", "IF_REDUCE"]}
    want = sorted((op, mb) for op in ops.get(method, []) for mb in range(microbatches))
    for r in range(world):
        assert per_rank[r][key][4] == want, (key, r)


def _compare_memory_with_simulator(per_rank, configs, pp, microbatches, vocab, run):
    """The activations the runtime held per rank are what the simulator predicts: the same count of
    (microbatch, chunk) activations and S->T states, and bytes within 10% (the runtime counts the
    storages autograd saves; the simulator's cost model computes them for an eager-attention HF layer)."""
    from vp_accelerate.cost import ModelShape, for_schedule
    from vp_accelerate.sim.simulate import simulate

    dtype, opt_name, _ = run
    cfg = _tiny_config(vocab, tied=False)
    shape = ModelShape(
        hidden=cfg.hidden_size,
        layers=cfg.num_hidden_layers,
        heads=cfg.num_attention_heads,
        ffn=cfg.intermediate_size,
        vocab=vocab,
        seq=8,
        dtype_bytes=dtype.itemsize,
        mlp_matrices=3,
        kv_heads=cfg.num_key_value_heads,
        attention="eager",
    )
    for config in configs:
        key = (*config, opt_name)
        sched = per_rank[0][key][5]  # the order the runtime ran (cost-aware)
        assert all(per_rank[r][key][5] == sched for r in range(pp)), key
        layers = per_rank[0][key][2][3]  # the runtime's layer split (redis's too)
        sim = simulate(sched, for_schedule(shape, sched, chunk_layers=layers))
        for r in range(pp):
            act, stash, nbytes, _ = per_rank[r][key][2]
            assert act == pytest.approx(sim.peak_activation_microbatches[r]), (key, r)
            assert stash == sim.peak_stash_microbatches[r], (key, r)
            if sum(n for c, n in enumerate(layers) if sched.chunk_rank[c] == r):
                # a rank without decoder layers keeps a few [N, h] tensors (its chunk runs only the final norm
                # or the input pieces): there the meter and the model differ by about one of them, beyond 10%
                assert nbytes == pytest.approx(sim.peak_activation_bytes[r], rel=0.10), (key, r)


def _compare(key, per_rank, world, ref_losses, ref_params, seed):
    losses, params = per_rank[0][key][:2]
    for r in range(world):  # every rank knows the loss
        assert per_rank[r][key][0] == pytest.approx(losses, rel=1e-12), (key, r)
    assert losses == pytest.approx(ref_losses, rel=1e-5), (key, seed)
    assert set(params) == set(ref_params), key
    for name, ref in ref_params.items():
        torch.testing.assert_close(
            params[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key} {name} (seed {seed}): {m}"
        )


# The balanced split may empty an end stage (the paper's redis at 256k: no decoder layer on the last stage,
# which then runs only the final norm and the output layer); explicit splits with an empty end chunk, run
# in the same spawn as the rest.
EMPTY_END_STAGES = [("1f1b", "redis", (8, 0)), ("1f1b", "vocab-2", (8, 0)), ("1f1b", "baseline", (0, 8))]


def test_every_schedule_and_method_on_2_ranks_untied(tmp_path):
    _check(2, vocab=101, tied=False, configs=CONFIGS + EMPTY_END_STAGES, tmp_path=tmp_path)


# 4 processes on a 2-core machine are slow: the float32 SGD run is left to the 2-rank test and the
# slow-marked full run below
ADAMW_ONLY = [r for r in RUNS if r[1] == "adamw"]


# every schedule and every method once on 4 tied ranks in the suite; all 9 pairs in the slow run below
TIED_4 = [
    ("1f1b", "redis"),
    ("1f1b", "vocab-1"),
    ("vhalf", "vocab-2"),
    ("interleaved", "baseline"),
    ("1f1b", "interlaced"),
]


def test_each_schedule_and_method_on_4_ranks_tied(tmp_path):
    assert {s for s, _ in TIED_4} | {m for _, m in TIED_4} == {s for s, _ in CONFIGS} | {m for _, m in CONFIGS}
    _check(4, vocab=103, tied=True, configs=TIED_4, tmp_path=tmp_path, runs=ADAMW_ONLY)


def test_pp2_x_dp2(tmp_path):
    _check(
        4,
        vocab=97,
        tied=False,
        configs=[("1f1b", "vocab-2"), ("1f1b", "baseline"), ("vhalf", "vocab-1")],
        dp_size=2,
        tmp_path=tmp_path,
        runs=ADAMW_ONLY,
    )


@pytest.mark.slow
def test_every_schedule_and_method_on_4_ranks_tied_fp32_too(tmp_path):
    _check(4, vocab=103, tied=True, configs=CONFIGS, tmp_path=tmp_path)
