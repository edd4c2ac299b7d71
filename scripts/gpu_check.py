"""The one-GPU check, part by part; scripts/gpu_check.sh runs each part in its own process with a time limit.

    python3 scripts/gpu_check.py --part schedules_ws1 --out DIR [--tiny]   # one part -> DIR/<part>.json
    python3 scripts/gpu_check.py --summarize --out DIR                     # DIR/results.json + DIR/summary.md

One GPU runs one rank. NCCL refuses two ranks on one device, so every part here runs at world size 1:
there is no point-to-point traffic and a collective on a 1-rank group moves no data. What needs more
than one rank (p2p, NCCL's one-Work batches and rendezvous order, collectives that move data, PP x DP)
is checked on the CPU by the test suite (gloo ranks), not here. The parts and what each really checks:
see CHECKS and CRITERIA below (the summary prints both). Every part has a --tiny size that runs on a CPU
in seconds; that run tests the plumbing of this script, not a GPU.
Each part writes {"part", "status": "pass" | "fail", "why", "checks", "criterion", ...figures}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_STARTED = time.monotonic()  # the part's process started about now: its time limit counts from here
PARTS = (
    "vocab_ws1",
    "schedules_ws1",
    "bf16_ws1",
    "zero_fused_1gpu",
    "progress_device_1gpu",
    "persist_1gpu",
    "memory_1gpu",
    "output_layer_1gpu",
    "streams_1gpu",
    "quickstart_bf16",
)
CHECKS = {
    "vocab_ws1": "the vocabulary layers' CUDA compute (S, T, input-layer IF/IB; naive, vocab-1, vocab-2 x store, "
    "recompute, chunked) against float64, on a 1-rank NCCL group: one shard is the whole vocabulary "
    "and the collectives move no data",
    "schedules_ws1": "one train_step of every schedule x method on the GPU at world size 1 (1-rank NCCL group: no "
    "p2p, no data moved by collectives), float64, against the HF model: device placement and each "
    "schedule's local pass order on CUDA, not multi-rank exactness",
    "bf16_ws1": "bf16 compute with fp32 master weights at world size 1: a small Llama trained the same 50 AdamW "
    "steps in bf16 and in fp32",
    "output_layer_1gpu": "one rank's compute share of the output layer (S + C1 + T over V/p rows, C1/C2 on a 1-rank "
    "group) against HF's lm_head + cross_entropy over the whole vocabulary, bf16, N=4096, "
    "h=4096, V=256k, p = 1, 2, 4, 8: whether the shard's kernels keep their throughput and "
    "its memory falls as V/p shrinks. Communication is not in it, so it is not the paper's "
    "multi-GPU scaling figure (Table 3)",
    "streams_1gpu": "GPU-only bugs of one rank's step, at world size 1: (a) stream races: every schedule x method "
    "trained one step in float64 twice on plain, packed and padded batches, the second with torch.cuda._sleep "
    "injected on the compute stream before every pass (each producer) and on the communication stream at the "
    "start of every vocabulary chain, so a missing event wait reads stale data and changes the gradients; (b) "
    "host syncs: those delayed steps, and after a warm-up one step of V-Half + vocab-1 and interleaved + "
    "baseline in bf16 and 1F1B + vocab-2 in fp16 on each batch, under torch.cuda.set_sync_debug_mode('warn'), "
    "the loss read and fp16's found-inf flag excepted: each sync is named by its innermost frame in "
    "transformers (the HF line that blocks) and in vp_accelerate (ours that led there); (c) the reported "
    "step time beside CUDA events around train_step (a larger bf16 model). p2p, the data-parallel reduce "
    "and collectives that move data need two ranks: not here",
    "quickstart_bf16": "the quickstart recipe end to end on the GPU: demo corpus, BPE tokenizer, then a "
    "one-process `accelerate launch --mixed_precision bf16` of recipes/quickstart.yaml (a short run; "
    "logging.wandb_mode disabled where wandb is not installed, as on the lease's image)",
    "zero_fused_1gpu": "ZeRO-1 (runtime/zero.py) with fused AdamW on a one-rank data-parallel group (NCCL on the GPU): "
    "4 steps of a 4-layer h256 Llama against plain fused AdamW, with a resume (the host state_dict loaded into a "
    "new ZeroOptimizer) before the last; where the optimizer's `step` tensors live, before and after the resume",
    "progress_device_1gpu": "the watchdog's Progress (runtime/watchdog.py) reading device marks: a step whose first "
    "pass ends in a 2 s torch.cuda._sleep, so the host finishes the step at once and the device is still in that "
    "pass (its length calibrated with CUDA events at the busy clock); then a pass stuck on the host with the device "
    "idle (CPU run: marks completed by a 2 s timer)",
    "persist_1gpu": "the trainer on the GPU with background checkpoints (`checkpoint.background`): a bf16 run of 8 "
    "steps saving at 4 and 8 (each save's host copies into pinned buckets, written by a writer thread), then "
    "`--resume` from step 4 in a new process; the resumed steps against the uninterrupted run's metrics",
    "memory_1gpu": "memory calibration (issue: memory truth): `vp-accelerate dryrun` of Llama-3.2-1B at world size "
    "1 (1f1b/vocab-2, m 4, seq 2048, global batch 8, bf16, fused AdamW) against the same sequence on the GPU (build, "
    "train_step, optimizer step, state_dicts, eval_step, a second step): torch.cuda.max_memory_allocated, "
    "max_memory_reserved and mem_get_info, once with the default allocator and once with "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, each its own process",
}
TOLERANCE = {"vocab_ws1": 1e-4, "schedules_ws1": 1e-5, "bf16_gap": 0.02, "race": 1e-10}
STEP_TIME_BAND = (0.7, 1.02)  # reported step time / CUDA-event time around train_step (the events enclose it)
SLEEP_CYCLES = 5_000_000  # torch.cuda._sleep per pass and per chain: ~3 ms, far longer than any kernel here
EFFICIENCY_BAND = (0.6, 1.6)  # full time / (p x shard time); outside it the shard's kernels or the timing are off
MEMORY_AT_8 = 0.35  # the shard's peak memory at p = 8 over its peak at p = 1 (ideal: 1/8 plus the fixed N x h)
PROGRESS_HOLD_S = 2.0  # how long the device (or the CPU analogue's mark) stays busy after the host finished
PERSIST_TOLERANCE = 1e-4  # on CUDA, after the first resumed forward: bf16 backward kernels may add in another order
MEMORY_BAND = (0.9, 1.1)  # the dry run's peak over max_memory_allocated
CRITERIA = {
    "vocab_ws1": f"every relative error (loss, dX, dW, dE) <= {TOLERANCE['vocab_ws1']:g}",
    "schedules_ws1": f"every schedule x method pair the registry supports: loss and every gradient within relative "
    f"{TOLERANCE['schedules_ws1']:g} of HF float64",
    "bf16_ws1": f"both losses fall by > 3%, bf16 and fp32 agree within {TOLERANCE['bf16_gap']:.0%} over the last 5 "
    "steps, parameters and AdamW state stay fp32",
    "output_layer_1gpu": f"every (algorithm, p) row measured; scaling efficiency full / (p x shard) within "
    f"{EFFICIENCY_BAND[0]:.0%}-{EFFICIENCY_BAND[1]:.0%} for every row; the shard's peak memory "
    f"at p = 8 <= {MEMORY_AT_8:g} x its peak at p = 1 (tiny CPU run: rows measured and finite "
    "only, CPU timings of a 128-token problem are noise)",
    "streams_1gpu": f"(a) every pair's gradients and loss with the delays within relative {TOLERANCE['race']:g} of "
    f"those without (float64: only a race moves them); (b) every step ran under sync debug mode 'warn' (its "
    f"syncs are figures: count, first site in HF and in vp_accelerate, each distinct site; they do not fail "
    f"the part); (c) "
    f"reported / event step time within {STEP_TIME_BAND[0]:g}-{STEP_TIME_BAND[1]:g} on each of 3 steps (tiny "
    "CPU run: no CUDA, so (a) runs without delays, (b) sees no syncs and (c) only checks the times are positive); "
    "every run started in time (none skipped for the limit)",
    "zero_fused_1gpu": "losses and every parameter bit-identical to plain fused AdamW after 3 steps and after the "
    "resumed step; every `step` tensor on the parameters' device in float32 (what fused kernels read), before and "
    "after load_state_dict; the saved state on the host",
    "progress_device_1gpu": f"the host finishes the step in under {PROGRESS_HOLD_S / 2:g} s; meanwhile Progress says "
    "'between steps ...; device: ... still on F(mb=0, chunk=0)', device_busy() and stalled_for() counts from the "
    "device's side; once the device caught up nothing is pending, stalled_for() is 0 and the last device pass is "
    "the step's last; a pass stuck on the host reads 'in F(mb=1, chunk=0), computing' with no device part",
    "persist_1gpu": "both runs exit 0; the resumed run logs exactly the steps after the checkpoint; the first "
    "resumed step's loss and every step's lr equal the uninterrupted run's bit for bit, grad norms and later losses "
    f"within relative {PERSIST_TOLERANCE:g} (deterministic kernels asked for, but CUDA attention backward may add "
    "in another order; CPU run: every figure exact); "
    "every save written by a checkpoint-writer thread from host copies, on CUDA pinned ones",
    "memory_1gpu": f"both probes and the dry run finish; max_memory_allocated within {MEMORY_BAND[0]:g}-"
    f"{MEMORY_BAND[1]:g} x the dry run's peak, in both allocator settings (the figures, reserved and the "
    "device's used memory outside the allocator, are the calibration; tiny CPU run: the probes' steps run on the "
    "CPU and the CUDA figures are skipped)",
    "quickstart_bf16": "the launch (--mixed_precision bf16) exits 0, its metrics hold a finite train/loss for every "
    "logged step, the last loss is below the first, and they hold the CUDA allocator's figures (the run was on "
    "the GPU) (tiny CPU run: 3 steps of a tiny corpus on the CPU, precision no, losses finite only)",
}
# Paper Table 3: vocabulary-layer scaling efficiency relative to linear scaling, at 8 / 16 / 32 GPUs
# (communication included). One GPU cannot reproduce these; the summary quotes them for context only.
PAPER_GPUS = (8, 16, 32)
PAPER_TABLE3 = {
    2048: {"output vocab-1": (91.3, 84.2, 80.6), "output vocab-2": (86.7, 79.8, 75.9), "input": (40.0, 28.9, 15.2)},
    4096: {"output vocab-1": (93.2, 88.0, 85.2), "output vocab-2": (88.4, 83.4, 79.7), "input": (27.7, 15.5, 8.4)},
}


STREAMS_RESERVE_S = 25  # streams_1gpu starts no new model with less of its limit left: (c) and the JSON still fit


def _time_left():
    """Seconds left of this part's limit (GPU_CHECK_LIMIT_S, set by gpu_check.sh; none: unlimited), as a
    function of no arguments."""
    limit = float(os.environ.get("GPU_CHECK_LIMIT_S") or "inf")
    return lambda: limit - (time.monotonic() - _STARTED)


def _device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _one_rank_env() -> None:
    """A 1-rank launcher environment: init_from_env then joins NCCL on a GPU, gloo on a CPU."""
    from vp_accelerate.distributed import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def _llama(vocab: int, hidden: int, layers: int, heads: int = 4):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


# ---- parts ------------------------------------------------------------------------------------------
def part_vocab_ws1(tiny: bool, out: Path) -> dict:
    """vp-accelerate selftest on a 1-rank group (NCCL on a GPU, gloo on a CPU)."""
    import contextlib
    import io

    from vp_accelerate.vocab import selftest

    _one_rank_env()
    args = ["--json", "--seed", "0", "--tolerance", str(TOLERANCE["vocab_ws1"])] + (
        ["--vocab", "300", "--hidden", "32", "--tokens", "64"]
        if tiny
        else ["--vocab", "8000", "--hidden", "512", "--tokens", "1024"]
    )  # its float64 reference runs on the CPU
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = selftest.main(args)
    res = json.loads(buf.getvalue().strip().splitlines()[-1])
    worst = max(v for modes in res["max_rel_error"].values() for v in modes.values())
    bad = [
        f"{a}/{m} {v:.1e}"
        for a, modes in res["max_rel_error"].items()
        for m, v in modes.items()
        if not v <= res["tolerance"]
    ]
    ok = rc == 0 and not bad and res["world_size"] == 1
    return {
        "status": "pass" if ok else "fail",
        "max_rel_error": worst,
        "tolerance": res["tolerance"],
        "world_size": res["world_size"],
        "vocab": res["vocab"],
        "hidden": res["hidden"],
        "tokens": res["tokens"],
        **({} if ok else {"why": f"over the tolerance {res['tolerance']:g}: {', '.join(bad) or 'see the log'}"}),
    }


def part_schedules_ws1(tiny: bool, out: Path) -> dict:
    """train_step of every schedule x method on one rank (NCCL on a GPU) vs the HF model, both float64."""
    import torch
    from transformers import AutoModelForCausalLM

    from vp_accelerate.distributed import init_from_env
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.schedule.registry import supported_pairs

    _one_rank_env()
    init_from_env()
    import torch.distributed as dist

    dev = _device()
    torch.manual_seed(0)
    ckpt = out / "exact_model"
    AutoModelForCausalLM.from_config(
        _llama(vocab=1000 if tiny else 32000, hidden=64 if tiny else 256, layers=4)
    ).save_pretrained(ckpt)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64, attn_implementation="eager").to(dev)
    g = torch.Generator().manual_seed(1)
    vocab = ref.config.vocab_size
    ids = torch.randint(0, vocab, (4, 32 if tiny else 128), generator=g)
    labels = ids.clone()
    labels[0, 20:] = -100
    loss = ref(input_ids=ids.to(dev), labels=labels.to(dev)).loss
    loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    rows, ok = [], True
    for schedule, method in supported_pairs():
        pipe = PipelineModel(
            str(ckpt),
            PipelineConfig(schedule=schedule, method=method, microbatches=4, attn_implementation="eager"),
            dtype=torch.float64,
            device=dev,
        )
        res = pipe.train_step(ids, labels)
        err = 0.0
        for name, p in pipe.named_parameters():
            r = grads[name][: p.shape[0]]  # one rank: a vocabulary shard is the whole matrix (plus padding)
            err = max(err, float((p.grad[: r.shape[0]] - r).norm() / r.norm().clamp_min(1e-30)))
        loss_err = abs(res.loss - loss.item()) / abs(loss.item())
        # HF upcasts the logits to float32 in its loss: 1e-5 is its rounding, not ours
        tol = TOLERANCE["schedules_ws1"]
        good = loss_err < tol and err < tol and pipe.groups.world_size == 1
        ok &= good
        rows.append(
            {"schedule": schedule, "method": method, "loss_rel_error": loss_err, "grad_rel_error": err, "ok": good}
        )
        pipe.close()
    bad = [f"{r['schedule']}/{r['method']}" for r in rows if not r["ok"]]
    return {
        "status": "pass" if ok else "fail",
        "backend": dist.get_backend(),
        "device": str(dev),
        "world_size": dist.get_world_size(),
        "rows": rows,
        **({"why": f"off by more than {TOLERANCE['schedules_ws1']:g}: {', '.join(bad)}"} if bad else {}),
    }


def _learnable_batch(g, batch: int, seq: int, vocab: int):
    """3 in 4 next tokens follow a fixed rule (learnable), the rest are random (a loss floor well above 0)."""
    import torch

    ids = torch.empty(batch, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for t in range(1, seq):
        rule = (ids[:, t - 1] * 7 + 3) % vocab
        rand = torch.randint(0, vocab, (batch,), generator=g)
        ids[:, t] = torch.where(torch.rand(batch, generator=g) < 0.75, rule, rand)
    return ids


def part_bf16_ws1(tiny: bool, out: Path) -> dict:
    """50 AdamW steps in bf16 compute with fp32 master weights, and the same in fp32: loss falls, and the
    two agree within 2% over the last 5 steps."""
    import torch
    from transformers import AutoModelForCausalLM

    from vp_accelerate.distributed import init_from_env
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    _one_rank_env()
    init_from_env()
    dev = _device()
    steps, vocab, hidden, layers, batch, seq = (12, 128, 64, 2, 8, 32) if tiny else (50, 4096, 256, 4, 16, 128)
    torch.manual_seed(0)
    ckpt = out / "bf16_model"
    AutoModelForCausalLM.from_config(_llama(vocab, hidden, layers, heads=8 if not tiny else 4)).save_pretrained(ckpt)
    curves, dtypes = {}, set()
    for mode in ("bf16", "no"):
        pipe = PipelineModel(
            str(ckpt),
            PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=4, mixed_precision=mode),
            dtype=torch.float32,
            device=dev,
        )
        opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(2)
        losses = []
        t0 = time.perf_counter()
        for _ in range(steps):
            ids = _learnable_batch(g, batch, seq, vocab)
            res = pipe.train_step(ids, ids)
            pipe.clip_grad_norm_(1.0)
            pipe.step(opt)
            pipe.zero_grad()
            losses.append(res.loss)
        curves[mode] = {"losses": losses, "seconds": time.perf_counter() - t0}
        if mode == "bf16":
            dtypes = {str(p.dtype) for p in pipe.parameters()} | {
                str(v.dtype) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
            }
        pipe.close()
    tail = max(1, min(5, steps // 4))
    last = {m: sum(c["losses"][-tail:]) / tail for m, c in curves.items()}
    gap = abs(last["bf16"] - last["no"]) / last["no"]
    falls = all(math.isfinite(last[m]) and last[m] < 0.97 * curves[m]["losses"][0] for m in curves)
    ok = falls and gap < TOLERANCE["bf16_gap"] and dtypes == {"torch.float32"}
    why = "; ".join(
        w
        for w, bad in (
            ("a loss did not fall by 3%", not falls),
            (f"bf16 vs fp32 gap {gap:.1%} >= {TOLERANCE['bf16_gap']:.0%}", not gap < TOLERANCE["bf16_gap"]),
            (f"master dtypes {sorted(dtypes)}", dtypes != {"torch.float32"}),
        )
        if bad
    )
    return {
        "status": "pass" if ok else "fail",
        **({"why": why} if why else {}),
        "steps": steps,
        "model": f"Llama {layers} x h{hidden}, V={vocab}",
        "first_loss": {m: c["losses"][0] for m, c in curves.items()},
        "last_loss": last,
        "relative_gap": gap,
        "master_dtypes": sorted(dtypes),
        "curves": curves,
    }


OUTPUT_LAYER_SIZE = {
    "tokens": 4096,
    "hidden": 4096,
    "vocab": 256000,
    "ranks": (1, 2, 4, 8),
    "algorithms": ("vocab-1", "vocab-2"),
}
OUTPUT_LAYER_TINY = {"tokens": 128, "hidden": 32, "vocab": 2048, "ranks": (1, 2), "algorithms": ("vocab-2",)}


def judge_output_layer(rows: list[dict], size: dict, tiny: bool) -> list[str]:
    """What is off in the output-layer rows (empty = pass): CRITERIA["output_layer_1gpu"]."""
    problems = []
    shard = {(r["algorithm"], r["p"]): r for r in rows if r.get("p") is not None}
    full = [r for r in rows if r.get("p") is None]
    if len(full) != 1 or not (math.isfinite(full[0]["time_s"]) and full[0]["time_s"] > 0):
        problems.append("the full-vocabulary reference was not measured")
    for algo in size["algorithms"]:
        for p in size["ranks"]:
            r = shard.get((algo, p))
            if r is None or not (math.isfinite(r["time_s"]) and r["time_s"] > 0):
                problems.append(f"{algo} p={p} not measured")
            elif not tiny and not EFFICIENCY_BAND[0] <= r["efficiency"] <= EFFICIENCY_BAND[1]:
                problems.append(
                    f"{algo} p={p} efficiency {r['efficiency']:.0%} outside "
                    f"{EFFICIENCY_BAND[0]:.0%}-{EFFICIENCY_BAND[1]:.0%}"
                )
        one, eight = shard.get((algo, 1)), shard.get((algo, 8))
        if not tiny and one and eight and not eight["peak_bytes"] <= MEMORY_AT_8 * one["peak_bytes"]:
            problems.append(
                f"{algo} peak memory at p=8 is {eight['peak_bytes'] / max(one['peak_bytes'], 1):.2f} x "
                f"that at p=1 (> {MEMORY_AT_8:g})"
            )
    return problems


def part_output_layer_1gpu(tiny: bool, out: Path) -> dict:
    """bench_output_layer.py: S+C1+T(+C2) of one V/p shard vs the full layer; efficiency = full / (p x shard)."""
    path = out / "output_layer_rows.json"
    size = OUTPUT_LAYER_TINY if tiny else OUTPUT_LAYER_SIZE
    args = [
        "--tokens",
        str(size["tokens"]),
        "--hidden",
        str(size["hidden"]),
        "--vocab",
        str(size["vocab"]),
        "--ranks",
        *map(str, size["ranks"]),
        "--algorithms",
        *size["algorithms"],
        "--modes",
        "store",
        "--reps",
        "1" if tiny else "5",
        "--dtype",
        "float32" if tiny else "bfloat16",
        "--json",
        str(path),
    ]
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_output_layer.py"), *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        return {"status": "fail", "why": f"bench_output_layer.py exited {run.returncode}: {run.stderr[-1500:]}"}
    data = json.loads(path.read_text())
    table = [
        {k: r[k] for k in ("vocab", "p", "algorithm", "time_s", "peak_bytes", "efficiency") if k in r}
        for r in data["rows"]
    ]
    problems = judge_output_layer(table, size, tiny)
    return {
        "status": "fail" if problems else "pass",
        **({"why": "; ".join(problems)} if problems else {}),
        "where": data["where"],
        "tokens": data["tokens"],
        "hidden": data["hidden"],
        "dtype": data["dtype"],
        "rows": table,
        "markdown": run.stdout,
    }


def _stream_delays(cycles: int):
    """A context: torch.cuda._sleep(cycles) on the compute stream before every compute pass of the executor
    (each producer's kernels start late) and on the communication stream at the start of every vocabulary
    chain (its result comes late). A consumer that does not wait for its producer's event then reads stale
    data. On the CPU it changes nothing."""
    import contextlib

    import torch

    from vp_accelerate.runtime.executor import Executor
    from vp_accelerate.schedule.ir import COMPUTE_PASSES
    from vp_accelerate.vocab import comm

    @contextlib.contextmanager
    def delays():
        if not torch.cuda.is_available():
            yield
            return
        real = {op: getattr(Executor, f"_do_{op.value}") for op in COMPUTE_PASSES}
        real_job = comm._StreamJob

        def slow_pass(fn):
            def run(self, a):
                torch.cuda._sleep(cycles)
                return fn(self, a)

            return run

        class SlowJob(real_job):
            def __init__(self, chain, device, inputs):
                def slow_chain():  # runs on the communication stream (inside its stream context)
                    torch.cuda._sleep(cycles)
                    return chain()

                super().__init__(slow_chain, device, inputs)

        for op, fn in real.items():
            setattr(Executor, f"_do_{op.value}", slow_pass(fn))
        comm._StreamJob = SlowJob
        try:
            yield
        finally:
            for op, fn in real.items():
                setattr(Executor, f"_do_{op.value}", fn)
            comm._StreamJob = real_job

    return delays()


def _mask_batches(g, batch: int, seq: int, vocab: int) -> dict:
    """The same ids as plain, packed (documents restart at seq // 3) and padded (every other row) batches."""
    import torch

    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    packed = torch.arange(seq).repeat(batch, 1)
    packed[:, seq // 3 :] -= seq // 3
    padded = torch.ones(batch, seq, dtype=torch.long)
    padded[::2, -(seq // 4) :] = 0
    return {"plain": (ids, ids, None, None), "packed": (ids, ids, None, packed), "padded": (ids, ids, padded, None)}


SYNC_WARNING = "synchronizing CUDA operation"  # torch's sync-debug warning text (c10/cuda warn_or_error_on_sync)
SYNC_SITES_KEPT = 40  # distinct sync sites in the JSON, in order of first appearance (the count covers all)


def _package_roots() -> dict:
    """The folders of the packages a blocking call is attributed to: HF's code, then ours."""
    import transformers

    import vp_accelerate

    return {"transformers": Path(transformers.__file__).parent, "vp_accelerate": Path(vp_accelerate.__file__).parent}


def sync_site(stack, roots: dict) -> dict:
    """Where a blocking call sits in `stack` (traceback.extract_stack(), outermost frame first): for each
    package in `roots` (name -> its folder) the innermost frame inside it, as "name/path.py:line in function"
    (for transformers: the HF line that blocks; for vp_accelerate: our line that led there), or None."""
    site = {}
    for name, root in roots.items():
        site[name] = None
        for frame in reversed(stack):
            try:
                rel = Path(frame.filename).resolve().relative_to(Path(root).resolve())
            except ValueError:
                continue
            site[name] = f"{name}/{rel.as_posix()}:{frame.lineno} in {frame.name}"
            break
    return site


def record_syncs(sites: list, roots: dict | None = None):
    """A context: torch.cuda.set_sync_debug_mode("warn") (on CUDA), and each sync warning, from any thread,
    appended to `sites` as sync_site() of the stack that raised it instead of being printed. A sync then
    names its place and the step runs on ("error" would stop the step at the first one)."""
    import contextlib
    import traceback
    import warnings

    import torch

    @contextlib.contextmanager
    def recording():
        where = roots if roots is not None else _package_roots()
        with warnings.catch_warnings():  # restores showwarning and the filters on exit
            warnings.simplefilter("always")  # every sync, not once per line
            shown = warnings.showwarning

            def hook(message, category, filename, lineno, file=None, line=None):
                if SYNC_WARNING in str(message):
                    sites.append(sync_site(traceback.extract_stack()[:-1], where))
                else:
                    shown(message, category, filename, lineno, file, line)

            warnings.showwarning = hook
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)

    return recording()


def summarize_syncs(found: list[tuple[str, dict]]) -> dict:
    """(run, site) pairs -> the figures: how many, the first one (its transformers and vp_accelerate
    frames), and each distinct site with its count and the first run it showed in."""
    distinct: dict = {}
    for run, site in found:
        key = (site["transformers"], site["vp_accelerate"])
        if key not in distinct:
            distinct[key] = {**site, "count": 0, "first_run": run}
        distinct[key]["count"] += 1
    first = {"run": found[0][0], **found[0][1]} if found else None
    in_hf = next(({"run": r, **s} for r, s in found if s["transformers"]), None)
    sites = list(distinct.values())[:SYNC_SITES_KEPT]
    return {"syncs": len(found), "first": first, "first_in_transformers": in_hf, "sites": sites}


def _syncs_line(syncs: dict) -> str:
    if not syncs["syncs"]:
        return f"{syncs['checked_steps']} steps, no host sync"
    hf = syncs["first_in_transformers"]
    first = hf or syncs["first"]
    return f"{syncs['syncs']} host syncs in {syncs['checked_steps']} steps at {len(syncs['sites'])} sites, first " + (
        f"in HF at {hf['transformers']} (from {hf['vp_accelerate']})" if hf else f"at {first['vp_accelerate']}"
    )


# part (b)'s mixed-precision runs: the fp64 runs of (a) cover every schedule x method, these add the casts
# and the loss scaler (split backward + vocab-1, two chunks + baseline, and fp16's found-inf)
SYNC_MIXED = (("vhalf", "vocab-1", "bf16"), ("interleaved", "baseline", "bf16"), ("1f1b", "vocab-2", "fp16"))


def part_streams_1gpu(tiny: bool, out: Path) -> dict:
    """(a) stream races by injected delays, (b) host syncs under sync debug mode 'warn', each named by its
    frames, (c) step time by CUDA events: CHECKS / CRITERIA["streams_1gpu"].

    Budget (100 s limit; 13 models, was 20): start, CUDA and NCCL ~15 s; (a)+(b) one float64 model per
    schedule x method (9), 3 batches x 2 steps each, the delayed step also the sync-debug step, ~30 s;
    (b) 3 mixed-precision models x 3 batches x 2 steps ~8 s; (c) one h2048 model, 5 steps ~10 s: ~65 s.
    Past STREAMS_RESERVE_S before the limit the remaining runs are skipped and named, so the figures so
    far come back."""
    import torch
    from transformers import AutoModelForCausalLM

    from vp_accelerate.distributed import init_from_env
    from vp_accelerate.runtime import PipelineConfig, PipelineModel, pipeline, precision
    from vp_accelerate.schedule.registry import supported_pairs

    _one_rank_env()
    init_from_env()
    dev = _device()
    cuda = dev.type == "cuda"
    problems: list[str] = []
    left = _time_left()
    torch.manual_seed(0)
    small = out / "streams_model"
    AutoModelForCausalLM.from_config(_llama(1000, 64 if tiny else 128, 4)).save_pretrained(small)
    g = torch.Generator().manual_seed(5)
    batches = _mask_batches(g, 4, 32 if tiny else 96, 1000)
    kinds = ("plain",) if tiny else ("plain", "packed", "padded")  # tiny: the plumbing, on the CPU
    found: list[tuple[str, dict]] = []  # (run, sync site) of every host sync seen
    checked, skipped = 0, []
    real_finish, real_unscale = pipeline.finish_loss, precision.unscale_and_check

    def allowed(fn):  # the loss read and fp16's found-inf flag are the step's allowed syncs
        def run(*a, **k):
            if not cuda:
                return fn(*a, **k)
            mode = torch.cuda.get_sync_debug_mode()  # "warn" in a checked step, off in the others
            torch.cuda.set_sync_debug_mode(0)
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode(mode)

        return run

    def checked_step(pipe, run, batch):
        """One step under sync debug mode 'warn': its syncs recorded with their place, none raised."""
        nonlocal checked
        sites: list = []
        if cuda:
            torch.cuda.synchronize()
        with record_syncs(sites):
            res = pipe.train_step(*batch)
        found.extend((run, s) for s in sites)
        checked += 1
        return res

    def figures_so_far(last: str) -> dict:
        """This part's JSON as it stands, written after each model so a kill by the limit leaves it."""
        fig = {
            "status": "fail",
            "why": f"stopped part-way (its time limit, a hang or a crash; see its log) after {last}",
            "device": str(dev),
            "races": races,
            "worst_race_error": max((r["rel_error"] for r in races), default=float("nan")),  # nan: none ran
            "delays_injected": cuda,
            "sync_debug": {"mode": "warn" if cuda else "off (no CUDA)", "checked_steps": checked}
            | summarize_syncs(found),
            "step_time": [],
        }
        if last:
            write_result(out, "streams_1gpu", tiny, fig)
        return fig

    # (a) + (b): per schedule x method one float64 model; per batch kind a step without delays (also the
    # warm-up: first-use allocations, library handles), then the same step with the delays under sync
    # debug mode: only a race changes a bit beyond rounding, and no sync is left unnamed
    races = []
    pipeline.finish_loss, precision.unscale_and_check = allowed(real_finish), allowed(real_unscale)
    try:
        for schedule, method in supported_pairs():
            if left() < STREAMS_RESERVE_S:
                skipped.append(f"{schedule}/{method} float64")
                continue
            cfg = PipelineConfig(schedule=schedule, method=method, microbatches=4)
            pipe = PipelineModel(str(small), cfg, dtype=torch.float64, device=dev)
            for name in kinds:
                res = pipe.train_step(*batches[name])
                ref = {n: p.grad.detach().clone() for n, p in pipe.named_parameters()}
                pipe.zero_grad()
                with _stream_delays(SLEEP_CYCLES):
                    res2 = checked_step(pipe, f"{schedule}/{method} float64 {name}", batches[name])
                err = max(
                    float((p.grad.detach() - ref[n]).norm() / ref[n].norm().clamp_min(1e-30))
                    for n, p in pipe.named_parameters()
                )
                err = max(err, abs(res2.loss - res.loss) / abs(res.loss))
                pipe.zero_grad()
                races.append({"schedule": schedule, "method": method, "batch": name, "rel_error": err})
                if not err <= TOLERANCE["race"]:
                    problems.append(f"race: {schedule}/{method} {name} moved by {err:.1e} with the delays")
            pipe.close()
            figures_so_far(f"{schedule}/{method} float64")
        # (b) the mixed-precision paths, after a warm-up step per batch kind
        for schedule, method, mp in SYNC_MIXED if cuda else ():
            if left() < STREAMS_RESERVE_S:
                skipped.append(f"{schedule}/{method} {mp}")
                continue
            cfg = PipelineConfig(schedule=schedule, method=method, microbatches=4, mixed_precision=mp)
            pipe = PipelineModel(str(small), cfg, device=dev)
            for name in kinds:
                pipe.train_step(*batches[name])
                pipe.zero_grad()
                checked_step(pipe, f"{schedule}/{method} {mp} {name}", batches[name])
                pipe.zero_grad()
            pipe.close()
            figures_so_far(f"{schedule}/{method} {mp}")
    finally:
        pipeline.finish_loss, precision.unscale_and_check = real_finish, real_unscale
    syncs = figures_so_far("")["sync_debug"]
    if skipped:
        problems.append(f"out of time, not run: {', '.join(skipped)}")
    # (c) reported step time beside CUDA events around train_step, on a model big enough to be GPU-bound
    hidden, seq, vocab = (64, 32, 1000) if tiny else (2048, 1024, 32000)
    big = _llama(vocab, hidden, 4, heads=4 if tiny else 16)  # seeded init from the config: nothing on disk
    pipe = PipelineModel(
        big, PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=4, mixed_precision="bf16"), device=dev
    )
    ids = torch.randint(0, vocab, (8, seq), generator=g)
    timing = []
    warm = 1 if tiny else 2  # the first steps allocate and tune
    for step in range(warm + 3):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        res = pipe.train_step(ids, ids)
        if cuda:
            end.record()
            end.synchronize()
            measured = start.elapsed_time(end) / 1000
        else:
            measured = time.perf_counter() - t0
        pipe.zero_grad()
        if step >= warm:
            timing.append({"reported_s": res.step_time_s, "event_s": measured, "ratio": res.step_time_s / measured})
    pipe.close()
    for t in timing:
        if not (t["reported_s"] > 0 and t["event_s"] > 0):
            problems.append(f"step time not positive: {t}")
        elif not tiny and cuda and not STEP_TIME_BAND[0] <= t["ratio"] <= STEP_TIME_BAND[1]:
            problems.append(
                f"reported step time {t['reported_s'] * 1e3:.1f} ms vs CUDA events {t['event_s'] * 1e3:.1f} ms "
                f"(ratio {t['ratio']:.2f} outside {STEP_TIME_BAND[0]:g}-{STEP_TIME_BAND[1]:g})"
            )
    return {
        "status": "fail" if problems else "pass",
        **({"why": "; ".join(problems)[:1500]} if problems else {}),
        "device": str(dev),
        "races": races,
        "worst_race_error": max((r["rel_error"] for r in races), default=float("nan")),  # nan: none ran
        "delays_injected": cuda,
        "sync_debug": syncs,
        "step_time": timing,
    }


def part_quickstart_bf16(tiny: bool, out: Path) -> dict:
    """The quickstart recipe, one process, `accelerate launch --mixed_precision bf16` on the GPU."""
    import shutil

    work = out / "quickstart"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = _own_launch_env()
    steps = 3 if tiny else 40
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    mp = "no" if tiny else "bf16"
    commands = [
        [sys.executable, str(ROOT / "scripts" / "make_demo_corpus.py"), "--out", "outputs/demo_corpus"]
        + (["--size-mb", "0.1"] if tiny else ["--size-mb", "1"]),
        [sys.executable, str(ROOT / "scripts" / "train_tokenizer.py"), "--vocab-size", "512" if tiny else "4096"]
        + ["--out", "outputs/demo_tokenizer", "outputs/demo_corpus/train.jsonl"],
        accelerate
        + ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", mp, "--dynamo_backend", "no"]
        + (["--cpu"] if tiny else [])
        + ["-m", "vp_accelerate", "train", str(ROOT / "recipes" / "quickstart.yaml")]
        + ["--set", f"train.steps={steps}", "--set", "logging.log_every=1", "--set", "eval.every=0"]
        + ["--set", "checkpoint.every=0", "--set", "lr.warmup_steps=2", "--set", f"logging.wandb_mode={_wandb_mode()}"]
        + (
            ["--set", "data.seq_len=32", "--set", "train.global_batch=4", "--set", "pipeline.microbatches=2"]
            if tiny
            else []
        ),
    ]
    log = []
    for cmd in commands:
        run = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, check=False)
        log.append(f"$ {' '.join(cmd)}\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
        (out / "quickstart_bf16.commands.log").write_text("\n".join(log))
        if run.returncode != 0:
            return {"status": "fail", "why": f"`{' '.join(cmd[-8:])}` exited {run.returncode}: {run.stderr[-800:]}"}
    rows = [json.loads(line) for line in (work / "outputs" / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    problems = []
    if len(losses) < steps or not all(math.isfinite(x) for x in losses):
        problems.append(f"{len(losses)} finite train/loss rows for {steps} steps: {losses[:8]}")
    elif not tiny and not losses[-1] < losses[0]:  # 3 tiny CPU steps need not lower the loss
        problems.append(f"loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}")
    text = "\n".join(log)
    want_device = "cpu" if tiny else "cuda"
    on_cuda = any("cuda" in key for r in rows for key in r)  # the trainer logs the CUDA allocator's peaks
    if not tiny and not on_cuda:
        problems.append("the metrics hold no CUDA memory figures: the run was not on the GPU")
    return {
        "status": "fail" if problems else "pass",
        **({"why": "; ".join(problems)} if problems else {}),
        "steps": steps,
        "mixed_precision": mp,
        "device": want_device if (tiny or on_cuda) else "cpu",
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "log_tail": text[-1500:],
    }


# ---- this round's GPU paths at world size 1: fused ZeRO, Progress's device marks, persistence, memory -----------
ZERO_STEPS = 3
DETERMINISTIC = "import torch; torch.use_deterministic_algorithms(True, warn_only=True)"
"""Run first in a process whose steps are compared bit for bit with another's (with CUBLAS_WORKSPACE_CONFIG)."""


def _deterministic() -> None:
    """Deterministic kernels in this process: CUDA's index_add_ (the embedding's backward) otherwise adds with
    atomics in any order, so two runs of one step differ in the last bits; cuBLAS needs its workspace fixed."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS handle
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)  # as DETERMINISTIC does in a child process


def part_zero_fused_1gpu(tiny: bool, out: Path) -> dict:
    """ZeRO-1 (runtime/zero.py) with fused AdamW on a one-rank data-parallel group, against plain fused AdamW."""
    import torch
    import torch.distributed as dist

    from vp_accelerate.distributed import init_from_env
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.zero import ZeroOptimizer

    _deterministic()  # two models' steps compared bit for bit: no atomics (the embedding's index_add_)
    _one_rank_env()
    init_from_env()
    dev = _device()
    vocab, hidden, layers, batch, seq = (256, 32, 2, 4, 16) if tiny else (8192, 256, 4, 8, 256)
    config = _llama(vocab, hidden, layers)
    dp_group = dist.new_group([0])  # at dp 1 make_optimizer builds no ZeRO: the one-rank group is made here
    hyper = dict(lr=1e-3, weight_decay=0.1, fused=True)  # as the trainer builds it on CUDA (CPU has fused too)

    def model():
        return PipelineModel(config, PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=2), device=dev)

    def zero_opt(pipe):
        names = {p: n for n, p in pipe.named_parameters()}
        groups = [{"params": pipe.trainable_parameters()}]
        return ZeroOptimizer(groups, torch.optim.AdamW, dp_group, 0, [0], names, **hyper)

    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(ZERO_STEPS + 1)]
    plain, sharded = model(), model()  # the same seeded init
    plain_opt = torch.optim.AdamW(plain.trainable_parameters(), **hyper)
    zero = zero_opt(sharded)

    def train(pipe, opt, ids):
        res = pipe.train_step(ids, ids)
        pipe.step(opt)
        pipe.zero_grad()
        return res.loss

    def steps_where(opt):
        inner = opt.inner.state if isinstance(opt, ZeroOptimizer) else opt.state
        return sorted({f"{s['step'].device} {s['step'].dtype}" for s in inner.values()})

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))

    problems = []
    for ids in batches[:ZERO_STEPS]:
        if train(plain, plain_opt, ids) != train(sharded, zero, ids):
            problems.append("a loss differs from plain fused AdamW's")
    want = [f"{dev} torch.float32"]
    where = steps_where(zero)
    if where != want:
        problems.append(f"the optimizer's step tensors are on {where}, not {want}")
    if not same(plain, sharded):
        problems.append(f"parameters after {ZERO_STEPS} steps differ from plain fused AdamW's")
    # a resume: the host state_dict loaded into a new ZeroOptimizer; fused kernels read `step` on the device
    saved = zero.state_dict()
    host = sorted({str(v.device) for s in saved["state"].values() for v in s.values() if torch.is_tensor(v)})
    if host != ["cpu"]:
        problems.append(f"the saved state is on {host}, not the host")
    resumed = zero_opt(sharded)
    resumed.load_state_dict(saved)
    where_resumed = steps_where(resumed)
    if where_resumed != want:
        problems.append(f"after load_state_dict the step tensors are on {where_resumed}, not {want}")
    train(plain, plain_opt, batches[-1])
    train(sharded, resumed, batches[-1])
    if not same(plain, sharded):
        problems.append("after the resumed step the parameters differ from plain fused AdamW's")
    plain.close()
    sharded.close()
    return {
        "status": "fail" if problems else "pass",
        **({"why": "; ".join(problems)} if problems else {}),
        "device": str(dev),
        "backend": dist.get_backend(dp_group),
        "steps": ZERO_STEPS + 1,
        "parameters": sum(p.numel() for p in plain.parameters()),
        "step_tensors": where,
        "step_tensors_after_resume": where_resumed,
        "saved_state_on": host,
        "bit_identical": not problems,
    }


class _LateMark:
    """The CPU analogue of a CUDA event recorded behind a long kernel: query() is False until `after` is set."""

    def __init__(self, after):
        self.after = after

    def query(self) -> bool:
        return self.after.is_set()


def _sleep_cycles_per_s() -> float:
    """torch.cuda._sleep cycles per second on this GPU, timed with CUDA events."""
    import torch

    cycles, rates = 100_000_000, []
    for _ in range(3):  # the first raises the clocks from idle (345 MHz on an idle H200, ~1980 MHz busy)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        rates.append(cycles / (start.elapsed_time(end) / 1000))
    return max(rates)  # the busy clock: the long sleep runs at it, so it lasts at least the time asked


def part_progress_device_1gpu(tiny: bool, out: Path) -> dict:
    """Progress (runtime/watchdog.py) reading a long device kernel: the host finishes its passes and the step at
    once, the device is still in the first pass; Progress must say the device is busy there (not a host hang),
    count the stall from the device's side, and clear when the device catches up. Then a pass stuck on the host,
    which must read as one."""
    import threading

    import torch

    from vp_accelerate.runtime.watchdog import Progress

    cuda = torch.cuda.is_available()
    if cuda:
        cycles = int(PROGRESS_HOLD_S * _sleep_cycles_per_s())

        timing = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]

        def long_pass():
            timing[0].record()
            torch.cuda._sleep(cycles)
            timing[1].record()
            mark = torch.cuda.Event()
            mark.record()
            return mark

        def short_pass():
            torch.ones(1024, device="cuda").mul_(2)
            mark = torch.cuda.Event()
            mark.record()
            return mark

        def device_catches_up():
            torch.cuda.synchronize()

    else:  # the device is a timer: marks complete PROGRESS_HOLD_S after the host finished
        done = threading.Event()

        def long_pass():
            threading.Timer(PROGRESS_HOLD_S, done.set).start()
            return _LateMark(done)

        def short_pass():
            return _LateMark(done)  # queued behind the long one, as on one stream

        def device_catches_up():
            done.wait(PROGRESS_HOLD_S + 5)

    first, second, stuck = "F(mb=0, chunk=0)", "B(mb=0, chunk=0)", "F(mb=1, chunk=0)"
    p = Progress()
    p.track_device = True  # as a watchdog's Progress: without a watchdog thread no mark is kept (none polls it)
    t0 = time.monotonic()
    p.begin_step()
    p.enter(first)
    p.finished(long_pass())
    p.enter(second)
    p.finished(short_pass())
    p.end_step()
    host_s = time.monotonic() - t0
    busy_text, busy = p.describe(), p.device_busy()
    time.sleep(PROGRESS_HOLD_S / 4)  # a quarter: the check holds if the kernel lasts a quarter of what was asked
    stalled_busy, busy_later = p.stalled_for(), p.device_busy()
    device_catches_up()
    t_caught = time.monotonic() - t0
    kernel_s = timing[0].elapsed_time(timing[1]) / 1000 if cuda else PROGRESS_HOLD_S
    time.sleep(0.05)
    p.poll_device()
    idle_text, idle_stall, still_busy = p.describe(), p.stalled_for(), p.device_busy()
    # a host hang: a pass entered and never finished, the device idle
    p.begin_step()
    p.enter(stuck)
    time.sleep(0.3)
    hang_text, hang_stall, hang_busy = p.describe(), p.stalled_for(), p.device_busy()
    p.end_step()
    problems = []
    if not host_s < PROGRESS_HOLD_S / 2:
        problems.append(f"the host took {host_s:.2f} s for the step: it did not run ahead of the device")
    if not (busy and busy_text.startswith("between steps") and f"still on {first}" in busy_text):
        problems.append(f"while the device ran the long pass Progress said: {busy_text!r}")
    if not (busy_later and stalled_busy >= 0.8 * PROGRESS_HOLD_S / 4):
        problems.append(
            f"{PROGRESS_HOLD_S / 4:g} s into the long pass: device_busy() {busy_later}, stalled_for() "
            f"{stalled_busy:.2f} s (the kernel took {kernel_s:.2f} s)"
        )
    if still_busy or idle_stall != 0.0 or "device" in idle_text or p.device_last != second or p.device_done != 2:
        problems.append(
            f"after the device caught up: busy {still_busy}, stalled_for {idle_stall:.2f}, {idle_text!r}, "
            f"last {p.device_last!r}, {p.device_done} device passes done"
        )
    if hang_busy or not hang_text.startswith(f"in {stuck}") or "device" in hang_text or not hang_stall >= 0.25:
        problems.append(f"a pass stuck on the host read as: {hang_text!r} (stalled_for {hang_stall:.2f})")
    return {
        "status": "fail" if problems else "pass",
        **({"why": "; ".join(problems)} if problems else {}),
        "device": "cuda" if cuda else "cpu (marks completed by a timer)",
        "hold_s": PROGRESS_HOLD_S,
        "long_kernel_s": round(kernel_s, 3),
        "host_step_s": round(host_s, 4),
        "device_caught_up_s": round(t_caught, 3),
        "busy_report": busy_text,
        "stalled_while_busy_s": round(stalled_busy, 3),
        "idle_report": idle_text,
        "host_hang_report": hang_text,
    }


def _own_launch_env() -> dict:
    """This environment without a launcher's variables, for a process that makes its own 1-rank group."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("ACCELERATE_")}
    env.update(WANDB_MODE="offline", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _wandb_mode() -> str:
    """offline where wandb is installed, else disabled (the lease's image has no wandb; metrics.jsonl is written
    either way)."""
    import importlib.util

    return "offline" if importlib.util.find_spec("wandb") else "disabled"


def _train_rows(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/loss" in r}


def part_persist_1gpu(tiny: bool, out: Path) -> dict:
    """A run of the trainer with background checkpoints (pinned host copies on CUDA), then --resume from its first
    checkpoint in a new process: the resumed steps against the uninterrupted run's."""
    import random
    import shutil
    import threading

    import yaml

    work = out / "persist"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    os.environ["HF_DATASETS_CACHE"] = str(work / "ds_cache")
    _deterministic()  # both runs, so that the resumed steps can match bit for bit on CUDA too
    import torch

    from vp_accelerate.train.tokens.tokenizer import train_bpe

    cuda = torch.cuda.is_available()
    steps, every = (6, 3) if tiny else (8, 4)
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    text = "".join(json.dumps({"text": " ".join(rng.choices(words, k=48))}) + "\n" for _ in range(800))
    (work / "train.jsonl").write_text(text)
    train_bpe([str(work / "train.jsonl")], 320, str(work / "tok"), min_frequency=1)
    hidden = 64 if tiny else 256
    recipe = {
        "model": {
            "source": "llama-tiny",
            "config": {"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_attention_heads": 4},
        },
        "tokenizer": {"source": f"bpe:{work / 'tok'}", "resize_vocab": True},
        "data": {"files": [str(work / "train.jsonl")], "seq_len": 32 if tiny else 128},
        "pipeline": {
            "schedule": "1f1b",
            "method": "vocab-2",
            "microbatches": 2 if tiny else 4,
            "mixed_precision": "bf16" if cuda else "no",
        },
        "optimizer": {"lr": 3e-3},
        "lr": {"warmup_steps": 2},
        "train": {"steps": steps, "global_batch": 4 if tiny else 8, "seed": 0},
        "eval": {"every": 0},
        "checkpoint": {"every": every, "keep": 3, "background": True, "export_hf": False},
        "logging": {"wandb_mode": _wandb_mode(), "log_every": 1},
    }
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    # the uninterrupted run, in this process: what the background saves copied and which thread wrote them
    from vp_accelerate.train.cli.commands import train_main
    from vp_accelerate.train.persist import writer

    snapshots, writers = [], []
    real_copy, real_write = writer.Snapshot.copy, writer.write_rank_files

    def tensors(x):
        if torch.is_tensor(x):
            yield x
        elif isinstance(x, dict):
            for v in x.values():
                yield from tensors(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                yield from tensors(v)

    def copy(self, state):
        got = real_copy(self, state)
        src, dst = list(tensors(state)), list(tensors(got))
        snapshots.append(
            {
                "tensors": len(dst),
                "from_device": sum(t.device.type == "cuda" for t in src),
                "pinned": sum(t.is_pinned() for t in dst),
                "on_host": sum(t.device.type == "cpu" for t in dst),
                "bytes": sum(t.numel() * t.element_size() for t in dst),
            }
        )
        return got

    def write(*args, **kwargs):
        writers.append(threading.current_thread().name)
        return real_write(*args, **kwargs)

    writer.Snapshot.copy, writer.write_rank_files = copy, write
    t0 = time.perf_counter()
    try:
        rc = train_main([str(path), "--set", f"logging.output_dir={work / 'full'}"])
    finally:
        writer.Snapshot.copy, writer.write_rank_files = real_copy, real_write
    full_s = time.perf_counter() - t0
    if rc != 0:
        return {"status": "fail", "why": f"the uninterrupted run exited {rc} (see persist_1gpu.log)"}
    ckpt = work / "full" / "checkpoints" / f"step_{every:08d}"
    env = _own_launch_env()  # this process holds the run's 1-rank group (and its port)
    main = f"{DETERMINISTIC}; import sys; from vp_accelerate.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", main, "train", str(path), "--resume", str(ckpt)]
    cmd += ["--set", f"logging.output_dir={work / 'resumed'}"]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, check=False)
    resumed_s = time.perf_counter() - t0
    (out / "persist_1gpu.resume.log").write_text(run.stdout[-4000:] + run.stderr[-8000:])
    if run.returncode != 0:
        return {"status": "fail", "why": f"the --resume run exited {run.returncode}: {run.stderr[-600:]}"}
    full, resumed = _train_rows(work / "full" / "metrics.jsonl"), _train_rows(work / "resumed" / "metrics.jsonl")
    problems, rows = [], []
    if sorted(resumed) != list(range(every + 1, steps + 1)):
        problems.append(f"the resumed run logged steps {sorted(resumed)}, not {every + 1}..{steps}")
    for step in sorted(resumed):
        a, b = full.get(step, {}), resumed[step]
        rel = {
            k: abs(a[k] - b[k]) / max(abs(a[k]), 1e-30)
            for k in ("train/loss", "train/grad_norm", "train/lr")
            if k in a and k in b
        }
        rows.append({"step": step, **{k.split("/")[1]: b.get(k) for k in rel}, "rel_error": rel})
        for k, err in rel.items():
            # the first resumed step's loss is a forward of the loaded weights on the loaded data position: exact;
            # a backward (the grad norm, later steps) may add in another order on CUDA (attention kernels)
            exact = not cuda or k == "train/lr" or (k == "train/loss" and step == every + 1)
            if exact and err != 0.0:
                problems.append(f"step {step} {k} differs from the uninterrupted run's ({err:.1e}); it must be exact")
            elif err > PERSIST_TOLERANCE:
                problems.append(f"step {step} {k} off by {err:.1e} > {PERSIST_TOLERANCE:g}")
    saves = steps // every
    if len(snapshots) != saves or len(writers) != saves:
        problems.append(f"{len(snapshots)} snapshots and {len(writers)} writes for {saves} background saves")
    if any(not w.startswith("checkpoint-writer") for w in writers):
        problems.append(f"a checkpoint was written on {writers}, not a writer thread")
    for s in snapshots:
        if s["on_host"] != s["tensors"] or (cuda and (s["from_device"] == 0 or s["pinned"] < s["from_device"])):
            problems.append(f"a snapshot's host copies: {s}")
    return {
        "status": "fail" if problems else "pass",
        **({"why": "; ".join(problems)} if problems else {}),
        "device": "cuda" if cuda else "cpu",
        "steps": steps,
        "resumed_from": every,
        "snapshots": snapshots,
        "writer_threads": sorted(set(writers)),
        "rows": rows,
        "bitwise": all(all(v == 0.0 for v in r["rel_error"].values()) for r in rows),
        "seconds_uninterrupted": round(full_s, 1),
        "seconds_resumed": round(resumed_s, 1),
        "wandb_mode": recipe["logging"]["wandb_mode"],
    }


MEMORY_LAYOUT = {
    "model": "llama-3.2-1b",
    "seq": 2048,
    "global_batch": 8,
    "schedule": "1f1b",
    "method": "vocab-2",
    "microbatches": 4,
}
MEMORY_TINY = {**MEMORY_LAYOUT, "model": "llama-tiny", "seq": 64, "global_batch": 4, "microbatches": 2}
ALLOC_SETTINGS = {"default": None, "expandable": "expandable_segments:True"}


def memory_probe(layout: dict, path: Path) -> None:
    """One process (PYTORCH_CUDA_ALLOC_CONF as its parent set it): the dry run's sequence on the device (build,
    train_step, fused AdamW step, state_dicts, eval_step) and a second, steady-state step, the CUDA allocator's
    figures after each phase -> `path` (JSON)."""
    import dataclasses

    import torch
    from transformers import AutoConfig

    from vp_accelerate.distributed import init_from_env
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.train.cli.plan import model_arg

    _one_rank_env()
    init_from_env()
    cuda = torch.cuda.is_available()
    dev = _device()
    config = model_arg(layout["model"]).config
    hf = AutoConfig.for_model(**config) if isinstance(config, dict) else config
    cfg = PipelineConfig(
        schedule=layout["schedule"],
        method=layout["method"],
        microbatches=layout["microbatches"],
        mixed_precision="bf16",
        attn_implementation="sdpa",
    )
    cfg = dataclasses.replace(cfg, watchdog_dead_after_s=None, watchdog_stall_s=None)  # as the dry run
    ids = torch.randint(0, 2, (layout["global_batch"], layout["seq"]))  # as the dry run: host tokens
    phases = []

    def figures(phase):
        row = {"phase": phase}
        if cuda:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            row.update(
                allocated=torch.cuda.memory_allocated(),
                max_allocated=torch.cuda.max_memory_allocated(),
                max_reserved=torch.cuda.max_memory_reserved(),
                reserved=torch.cuda.memory_reserved(),
                device_used=total - free,
                device_total=total,
            )
        phases.append(row)

    t0 = time.perf_counter()
    pipe = PipelineModel(hf, cfg, device=dev)
    figures("build")
    pipe.train_step(ids, ids)
    figures("train_step")
    opt = pipe.make_optimizer(lr=1e-4, fused=True)
    pipe.step(opt)
    pipe.zero_grad()
    figures("optimizer")
    sd = (pipe.state_dict(), opt.state_dict())
    del sd
    figures("save")
    pipe.eval_step(ids, ids)
    figures("eval")
    pipe.train_step(ids, ids)  # steady state: the optimizer's state alive through the step
    pipe.step(opt)
    pipe.zero_grad()
    figures("second step")
    pipe.close()
    path.write_text(
        json.dumps(
            {
                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                "cuda": cuda,
                "phases": phases,
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )
    import torch.distributed as dist

    dist.destroy_process_group()  # after the figures are written: an exit problem cannot lose them


def judge_memory(dryrun: dict, probes: dict) -> tuple[list[dict], list[str]]:
    """memory_1gpu's rows (one per allocator setting) and what is off in them (CRITERIA["memory_1gpu"]): `dryrun`
    holds the dry run's `peak_bytes`, `probes` each probe's JSON (memory_probe)."""
    problems = []
    rows = []
    for name, probe in probes.items():
        row = {"allocator": name, "alloc_conf": probe["alloc_conf"], "seconds": probe["seconds"]}
        if probe["cuda"]:
            last = probe["phases"][-1]
            row.update(
                max_allocated=last["max_allocated"],
                max_reserved=last["max_reserved"],
                device_used=last["device_used"],
                device_total=last["device_total"],
                outside_allocator=last["device_used"] - last["reserved"],  # CUDA context, NCCL, cuBLAS handles
                dryrun_over_allocated=dryrun["peak_bytes"] / last["max_allocated"],
                reserved_over_allocated=last["max_reserved"] / last["max_allocated"],
                phases=probe["phases"],
            )
            ratio = row["dryrun_over_allocated"]
            if not MEMORY_BAND[0] <= ratio <= MEMORY_BAND[1]:
                problems.append(
                    f"{name}: the dry run's peak {dryrun['peak_bytes'] / 1e9:.2f} GB is {ratio:.3f} x "
                    f"max_memory_allocated {last['max_allocated'] / 1e9:.2f} GB (outside {MEMORY_BAND})"
                )
        else:
            row["measured"] = "skipped: no CUDA (the probe ran its steps on the CPU)"
            if [p["phase"] for p in probe["phases"]][-1] != "second step":
                problems.append(f"{name}: the probe stopped at {probe['phases'][-1]['phase']}")
        rows.append(row)
    return rows, problems


def part_memory_1gpu(tiny: bool, out: Path) -> dict:
    """`vp-accelerate dryrun` of a 1B layout at world size 1 (on the CPU, in its own process) beside the same
    layout's steps on the GPU, once with the default allocator and once with expandable segments (each its own
    process): max_memory_allocated against the dry run's peak, max_memory_reserved and mem_get_info beside it."""
    import torch

    layout = MEMORY_TINY if tiny else MEMORY_LAYOUT
    cuda = torch.cuda.is_available()
    flags = ["--world-size", "1", "--pp", "1", "--seq", str(layout["seq"]), "--global-batch"]
    flags += [str(layout["global_batch"]), "--schedule", layout["schedule"], "--method", layout["method"]]
    flags += ["--microbatches", str(layout["microbatches"]), "--gpu", "h200", "--json"]
    base = {k: v for k, v in _own_launch_env().items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    dry = subprocess.Popen(  # on the CPU while the GPU runs the probes
        [sys.executable, "-m", "vp_accelerate", "dryrun", layout["model"], *flags],
        env={**base, "CUDA_VISIBLE_DEVICES": ""},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    probes, problems, notes = {}, [], []
    for name, conf in ALLOC_SETTINGS.items():
        env = dict(base, **({"PYTORCH_CUDA_ALLOC_CONF": conf} if conf else {}))
        target = out / f"memory_{name}.json"
        target.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--memory-probe", str(target), "--out", str(out)] + (
            ["--tiny"] if tiny else []
        )
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        (out / f"memory_{name}.log").write_text(run.stdout[-4000:] + run.stderr[-8000:])
        if not target.exists():
            problems.append(f"the {name} probe exited {run.returncode} without its figures: {run.stderr[-600:]}")
            continue
        if run.returncode != 0:  # after writing its figures: an exit problem, not a memory one (see its log)
            notes.append(f"the {name} probe wrote its figures, then exited {run.returncode}")
        probes[name] = json.loads(target.read_text())
    stdout, stderr = dry.communicate()
    if dry.returncode != 0:
        return {"status": "fail", "why": f"dryrun exited {dry.returncode}: {stderr[-800:]}", "probes": probes}
    rank = json.loads(stdout)["ranks"][0]
    dryrun = {k: rank.get(k) for k in ("peak_bytes", "planned_bytes", "reserve_bytes", "activation_peak_bytes")}
    rows, judged = judge_memory(dryrun, probes)
    problems += judged
    if not dryrun["peak_bytes"] or dryrun["peak_bytes"] <= 0:
        problems.append(f"the dry run gave no peak: {rank}")
    return {
        "status": "fail" if problems else "pass",
        **({"why": "; ".join(problems)} if problems else {}),
        "layout": layout,
        "dryrun": dryrun,
        "rows": rows,
        "measured": cuda,
        "notes": notes,
    }


# ---- summary ----------------------------------------------------------------------------------------
def paper_table3_markdown() -> str:
    head = " | ".join(f"{g} GPUs" for g in PAPER_GPUS)
    lines = [f"| seq | layer | {head} |", "|---|---|" + "---|" * len(PAPER_GPUS)]
    for seq, layers in PAPER_TABLE3.items():
        for layer, figures in layers.items():
            lines.append(f"| {seq} | {layer} | " + " | ".join(f"{x:.1f}%" for x in figures) + " |")
    return "\n".join(lines)


def summarize(out: Path) -> tuple[dict, str]:
    results = {}
    for part in PARTS:
        f = out / f"{part}.json"
        results[part] = (
            json.loads(f.read_text())
            if f.exists()
            else {
                "part": part,
                "status": "not run",
                "why": f"no result: the part crashed or ran past its time limit (see {part}.log)",
            }
        )
    ran = [r for r in results.values() if "tiny" in r]
    dev = next((r.get("device_name") for r in ran if r.get("device_name")), None)
    tiny = any(r["tiny"] for r in ran)
    lines = [
        "# GPU check",
        "",
        f"Device: {dev or 'unknown'}. "
        + (
            "Tiny sizes on the CPU: this run checks the script's plumbing, not a GPU (the sizes named below are "
            "the GPU run's). "
            if tiny
            else ""
        )
        + "Every part runs at world size 1 (one GPU holds one rank; NCCL refuses two ranks on one device): "
        "there is no point-to-point traffic and a collective on a 1-rank group moves no data. Multi-rank "
        "behaviour is checked on the CPU by the test suite, not here.",
        "",
        "| part | status | result | passes when |",
        "|---|---|---|---|",
    ]
    for part in PARTS:
        r = results[part]
        try:
            line = _one_line(part, r)
        except (KeyError, TypeError, ValueError):  # a part that stopped early has only some of its figures
            line = r.get("why", "see its JSON")[:300]
        lines.append(f"| {part} | {r['status']} | {line} | {CRITERIA[part]} |")
    failed = [p for p in PARTS if results[p]["status"] != "pass"]
    lines += ["", "Did not run or failed:" if failed else "Every part ran and passed."]
    lines += [f"- {p}: {results[p].get('why', 'see its JSON')}" for p in failed]
    lines += ["", "## What each part checks", ""] + [f"- `{p}`: {CHECKS[p]}." for p in PARTS]
    ol = results["output_layer_1gpu"]
    if ol.get("markdown"):
        lines += ["", "## Output layer on one GPU (scripts/bench_output_layer.py)", "", ol["markdown"].strip()]
    lines += [
        "",
        "The paper's Table 3 (below) is the vocabulary layers' scaling across 8, 16 and 32 GPUs, "
        "communication included, relative to linear scaling. One GPU cannot reproduce it: the efficiency "
        "above is one rank's compute share against the full layer, with no communication, so it says "
        "whether the shard's kernels keep their throughput as V/p shrinks, and is no estimate of the "
        "paper's figures.",
        "",
        paper_table3_markdown(),
    ]
    text = "\n".join(lines) + "\n"
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "summary.md").write_text(text)
    return results, text


def _one_line(part: str, r: dict) -> str:
    if r["status"] == "not run" or "traceback" in r:
        return r.get("why", "")[:160]
    if part == "vocab_ws1":
        return f"max relative error {r['max_rel_error']:.1e} (tolerance {r['tolerance']:g})"
    if part == "schedules_ws1":
        bad = [f"{x['schedule']}/{x['method']}" for x in r["rows"] if not x["ok"]]
        worst = max(max(x["grad_rel_error"], x["loss_rel_error"]) for x in r["rows"])
        return (
            f"{len(r['rows'])} schedule x method on {r['backend']} at world size {r['world_size']}, "
            f"worst relative error {worst:.1e}" + (f"; FAILED: {', '.join(bad)}" if bad else "")
        )
    if part == "bf16_ws1":
        return (
            f"{r['steps']} steps, loss {r['first_loss']['bf16']:.3f} -> {r['last_loss']['bf16']:.3f} (bf16) vs "
            f"{r['last_loss']['no']:.3f} (fp32), gap {r['relative_gap'] * 100:.2f}%, master {r['master_dtypes']}"
        )
    if part == "output_layer_1gpu":
        eff = ", ".join(
            f"{x['algorithm']} p={x['p']} {x['efficiency'] * 100:.0f}%" for x in r["rows"] if x.get("p") is not None
        )
        return f"one shard's compute vs the full layer: {eff}" + (f"; {r['why']}" if r.get("why") else "")
    if part == "streams_1gpu":
        ratios = ", ".join(f"{t['ratio']:.2f}" for t in r["step_time"])
        syncs = r["sync_debug"]
        checked = _syncs_line(syncs) if syncs["mode"] == "warn" else f"off (no CUDA), {syncs['checked_steps']} steps"
        return (
            f"races: {len(r['races'])} steps, worst {r['worst_race_error']:.1e} (delays "
            f"{'on' if r['delays_injected'] else 'off: no CUDA'}); sync debug: {checked}; reported / event step "
            f"time {ratios}" + (f"; {r['why']}" if r.get("why") else "")
        )
    if part == "zero_fused_1gpu":
        return (
            f"{r['steps']} fused AdamW steps on {r['backend']}, bit-identical {r['bit_identical']}; step tensors "
            f"{', '.join(r['step_tensors'])}, after resume {', '.join(r['step_tensors_after_resume'])}"
            + (f"; {r['why']}" if r.get("why") else "")
        )
    if part == "progress_device_1gpu":
        return (
            f"host step {r['host_step_s'] * 1e3:.1f} ms, device caught up at {r['device_caught_up_s']:.2f} s; busy: "
            f"'{r['busy_report']}'; host hang: '{r['host_hang_report']}'" + (f"; {r['why']}" if r.get("why") else "")
        )
    if part == "persist_1gpu":
        pinned = sum(s["pinned"] for s in r["snapshots"])
        return (
            f"{r['steps']} steps, {len(r['snapshots'])} background saves ({pinned} pinned host tensors), resumed "
            f"from {r['resumed_from']}: bitwise {r['bitwise']}, worst "
            f"{max((e for x in r['rows'] for e in x['rel_error'].values()), default=0):.1e}"
            + (f"; {r['why']}" if r.get("why") else "")
        )
    if part == "memory_1gpu":
        parts = []
        for x in r.get("rows", []):
            if "max_allocated" in x:
                parts.append(
                    f"{x['allocator']}: allocated {x['max_allocated'] / 2**30:.2f} GiB (dry run x "
                    f"{x['dryrun_over_allocated']:.3f}), reserved {x['max_reserved'] / 2**30:.2f} GiB, outside "
                    f"the allocator {x['outside_allocator'] / 2**30:.2f} GiB"
                )
            else:
                parts.append(f"{x['allocator']}: {x['measured']}")
        dry = r.get("dryrun", {}).get("peak_bytes")
        head = f"dry run peak {dry / 2**30:.2f} GiB; " if dry else ""
        return head + "; ".join(parts) + (f"; {r['why']}" if r.get("why") else "")
    if part == "quickstart_bf16":
        if r.get("first_loss") is None:
            return r.get("why", "")[:160]
        return (
            f"{r['steps']} steps {r['mixed_precision']} on {r['device']}, loss {r['first_loss']:.3f} -> "
            f"{r['last_loss']:.3f}" + (f"; {r['why']}" if r.get("why") else "")
        )
    return ""


def write_result(out: Path, part: str, tiny: bool, result: dict, seconds: float | None = None) -> None:
    """<part>.json: the result with what the summary reads beside it (checks, criterion, `seconds` (default:
    since the process started), size, device). Also written part-way (status fail) so a part killed by its limit or
    a hang leaves the figures it had."""
    import torch

    result.update(
        part=part,
        checks=CHECKS[part],
        criterion=CRITERIA[part],
        seconds=round(time.monotonic() - _STARTED if seconds is None else seconds, 1),
        tiny=tiny,
        device_name=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU",
    )
    (out / f"{part}.json").write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for <part>.json, results.json and summary.md")
    ap.add_argument("--part", choices=PARTS, help="run one part")
    ap.add_argument("--summarize", action="store_true", help="combine the parts' JSON into results.json + summary.md")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized problems (tests the plumbing in seconds)")
    ap.add_argument("--memory-probe", metavar="JSON", help=argparse.SUPPRESS)  # memory_1gpu's child process
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.memory_probe:
        memory_probe(MEMORY_TINY if args.tiny else MEMORY_LAYOUT, Path(args.memory_probe))
        return 0
    if args.summarize:  # exit status 0 only when every part ran and passed
        results, text = summarize(out)
        print(text)
        return 0 if all(r["status"] == "pass" for r in results.values()) else 1
    if not args.part:
        ap.error("give --part or --summarize")
    import torch  # noqa: F401 - imported before t0: the seconds leave out its import, as before

    t0 = time.perf_counter()
    try:
        result = globals()[f"part_{args.part}"](args.tiny, out)
    except Exception as e:  # noqa: BLE001 - a failed part is a result, the others still run
        import traceback

        result = {"status": "fail", "why": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    write_result(out, args.part, args.tiny, result, time.perf_counter() - t0)
    print(f"{args.part}: {result['status']} ({result['seconds']} s)", flush=True)
    return 0 if result["status"] != "fail" else 1


if __name__ == "__main__":
    sys.exit(main())
