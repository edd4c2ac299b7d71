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
PARTS = ("vocab_ws1", "schedules_ws1", "bf16_ws1", "output_layer_1gpu", "streams_1gpu", "quickstart_bf16")
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
    "one-process `accelerate launch --mixed_precision bf16` of recipes/quickstart.yaml (a short run)",
}
TOLERANCE = {"vocab_ws1": 1e-4, "schedules_ws1": 1e-5, "bf16_gap": 0.02, "race": 1e-10}
STEP_TIME_BAND = (0.7, 1.02)  # reported step time / CUDA-event time around train_step (the events enclose it)
SLEEP_CYCLES = 5_000_000  # torch.cuda._sleep per pass and per chain: ~3 ms, far longer than any kernel here
EFFICIENCY_BAND = (0.6, 1.6)  # full time / (p x shard time); outside it the shard's kernels or the timing are off
MEMORY_AT_8 = 0.35  # the shard's peak memory at p = 8 over its peak at p = 1 (ideal: 1/8 plus the fixed N x h)
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
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("ACCELERATE_")}
    env.update(WANDB_MODE="offline", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")  # a launch of its own
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
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
        + ["--set", "checkpoint.every=0", "--set", "lr.warmup_steps=2"]
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
        lines.append(f"| {part} | {r['status']} | {_one_line(part, r)} | {CRITERIA[part]} |")
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
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
