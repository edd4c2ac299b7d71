"""The one-GPU check, part by part; scripts/gpu_check.sh runs each part in its own process with a time limit.

    python scripts/gpu_check.py --part exact --out DIR [--tiny]     # one part -> DIR/<part>.json
    python scripts/gpu_check.py --summarize --out DIR               # DIR/results.json + DIR/summary.md

Parts (every one has a --tiny size that runs on a CPU in seconds, to test the plumbing):
  selftest      the vocabulary layers against float64 (vp-accelerate selftest) on a 1-rank group
  exact         one train_step of every schedule x method at world size 1 vs the HF model, float64
  bf16          a small Llama trained 50 steps with bf16 compute and fp32 master weights, and in fp32
  output_layer  scripts/bench_output_layer.py in bf16 at N=4096, h=4096, shards of a 256k vocabulary
                for p = 1, 2, 4, 8: S+T scaling efficiency beside the paper's Table 3
  share         can two ranks share the one GPU (NCCL, or gloo with CUDA tensors)? Decides the 2-rank bench
Each part writes {"part", "status": "pass" | "fail" | "not run", "why", ...figures}; the summary says
plainly what did not run and why.
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
PARTS = ("selftest", "exact", "bf16", "output_layer", "share")
PAPER_TABLE3 = "87–93% at 8 shards"  # the paper's output-layer scaling efficiency (Table 3), as a range


def _device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _one_rank_env() -> None:
    """A 1-rank launcher environment: init_from_env then joins NCCL on a GPU, gloo on a CPU."""
    from vp_accelerate.distributed import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))


def _llama(vocab: int, hidden: int, layers: int, heads: int = 4):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                       max_position_embeddings=512, tie_word_embeddings=False, attn_implementation="eager")


# ---- parts ------------------------------------------------------------------------------------------
def part_selftest(tiny: bool, out: Path) -> dict:
    import contextlib
    import io

    from vp_accelerate.vocab import selftest

    _one_rank_env()
    args = ["--json", "--seed", "0"] + (["--vocab", "300", "--hidden", "32", "--tokens", "64"] if tiny else
                                       ["--vocab", "8000", "--hidden", "512", "--tokens", "1024"])  # its float64 reference runs on the CPU
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = selftest.main(args)
    res = json.loads(buf.getvalue().strip().splitlines()[-1])
    worst = max(v for modes in res["max_rel_error"].values() for v in modes.values())
    return {"status": "pass" if rc == 0 else "fail", "max_rel_error": worst, "tolerance": res["tolerance"],
            "vocab": res["vocab"], "hidden": res["hidden"], "tokens": res["tokens"]}


def part_exact(tiny: bool, out: Path) -> dict:
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
    AutoModelForCausalLM.from_config(_llama(vocab=1000 if tiny else 32000, hidden=64 if tiny else 256,
                                            layers=4)).save_pretrained(ckpt)
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
        pipe = PipelineModel(str(ckpt), PipelineConfig(schedule=schedule, method=method, microbatches=4,
                                                       attn_implementation="eager"), dtype=torch.float64, device=dev)
        res = pipe.train_step(ids, labels)
        err = 0.0
        for name, p in pipe.named_parameters():
            r = grads[name][:p.shape[0]]  # one rank: a vocabulary shard is the whole matrix (plus padding)
            err = max(err, float((p.grad[:r.shape[0]] - r).norm() / r.norm().clamp_min(1e-30)))
        loss_err = abs(res.loss - loss.item()) / abs(loss.item())
        # HF upcasts the logits to float32 in its loss: 1e-5 is its rounding, not ours
        good = loss_err < 1e-5 and err < 1e-5 and pipe.groups.world_size == 1
        ok &= good
        rows.append({"schedule": schedule, "method": method, "loss_rel_error": loss_err, "grad_rel_error": err,
                     "ok": good})
        pipe.close()
    return {"status": "pass" if ok else "fail", "backend": dist.get_backend(), "device": str(dev), "rows": rows}


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


def part_bf16(tiny: bool, out: Path) -> dict:
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
        pipe = PipelineModel(str(ckpt), PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=4,
                                                       mixed_precision=mode), dtype=torch.float32, device=dev)
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
                str(v.dtype) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()}
        pipe.close()
    tail = max(1, min(5, steps // 4))
    last = {m: sum(c["losses"][-tail:]) / tail for m, c in curves.items()}
    gap = abs(last["bf16"] - last["no"]) / last["no"]
    falls = all(math.isfinite(last[m]) and last[m] < 0.97 * curves[m]["losses"][0] for m in curves)
    ok = falls and gap < 0.02 and dtypes == {"torch.float32"}
    return {"status": "pass" if ok else "fail", "steps": steps, "model": f"Llama {layers} x h{hidden}, V={vocab}",
            "first_loss": {m: c["losses"][0] for m, c in curves.items()}, "last_loss": last,
            "relative_gap": gap, "master_dtypes": sorted(dtypes), "curves": curves}


def part_output_layer(tiny: bool, out: Path) -> dict:
    """bench_output_layer.py: S+T(+C1) of one shard vs the full layer; efficiency = full / (p x shard)."""
    path = out / "output_layer_rows.json"
    size = (["--tokens", "128", "--hidden", "32", "--vocab", "2048", "--ranks", "1", "2", "--algorithms", "vocab-2",
             "--reps", "1"] if tiny else
            ["--tokens", "4096", "--hidden", "4096", "--vocab", "256000", "--ranks", "1", "2", "4", "8",
             "--algorithms", "vocab-1", "vocab-2", "--reps", "5", "--dtype", "bfloat16"])
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_output_layer.py"), *size, "--modes", "store",
                          "--json", str(path)], capture_output=True, text=True, check=False)
    if run.returncode != 0:
        return {"status": "fail", "why": run.stderr[-2000:]}
    data = json.loads(path.read_text())
    table = [{k: r[k] for k in ("vocab", "p", "algorithm", "time_s", "peak_bytes", "efficiency") if k in r}
             for r in data["rows"]]
    at8 = [r["efficiency"] for r in table if r.get("p") == 8]
    return {"status": "pass", "where": data["where"], "tokens": data["tokens"], "hidden": data["hidden"],
            "dtype": data["dtype"], "rows": table, "paper_table3": PAPER_TABLE3,
            "efficiency_at_8": at8, "markdown": run.stdout}


def _share_worker(rank: int, port: int, backend: str, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.cuda.set_device(0)
        dist.init_process_group(backend, rank=rank, world_size=2)
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        if rank == 0:  # the pipeline also needs point-to-point
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        torch.cuda.synchronize()
        results.put((rank, "ok", float(t[0])))
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the answer is whether this works
        results.put((rank, "error", f"{type(e).__name__}: {str(e)[:300]}"))


def part_share(tiny: bool, out: Path) -> dict:
    """Two processes on one GPU: does NCCL (or gloo with CUDA tensors) do all-reduce and send/recv?"""
    import queue

    import torch
    import torch.multiprocessing as mp

    from vp_accelerate.distributed import free_port

    if not torch.cuda.is_available():
        return {"status": "not run", "why": "no CUDA device: two ranks sharing a GPU cannot be tried on a CPU"}
    found = {}
    for backend in ("nccl", "gloo"):
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_share_worker, args=(r, port, backend, results), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        answers = []
        for _ in range(2):
            try:
                answers.append(results.get(timeout=60))
            except queue.Empty:
                answers.append((-1, "error", "no answer within 60 s (hung)"))
                break
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        found[backend] = ("works" if all(a[1] == "ok" for a in answers) else
                          "; ".join(str(a[2]) for a in answers if a[1] != "ok"))
    works = [b for b, v in found.items() if v == "works"]
    why = ("the 2-rank `vp-accelerate bench` was not run: its harness places every rank on the CPU (gloo); "
           "a GPU comparison of 2 ranks needs 2 GPUs")
    return {"status": "not run", "two_ranks_on_one_gpu": found, "usable_backends": works, "why": why}


# ---- summary ----------------------------------------------------------------------------------------
def summarize(out: Path) -> tuple[dict, str]:
    results = {}
    for part in PARTS:
        f = out / f"{part}.json"
        results[part] = json.loads(f.read_text()) if f.exists() else {
            "part": part, "status": "not run", "why": "no result: the part crashed or ran past its time limit "
                                                        f"(see {part}.log)"}
    lines = ["# GPU check", ""]
    dev = next((r.get("device_name") for r in results.values() if r.get("device_name")), None)
    lines += [f"Device: {dev or 'unknown'}.", "", "| part | status | result |", "|---|---|---|"]
    for part in PARTS:
        r = results[part]
        lines.append(f"| {part} | {r['status']} | {_one_line(part, r)} |")
    lines += ["", "Did not run or failed:" if any(r["status"] != "pass" for r in results.values()) else
              "Every part ran and passed."]
    for part in PARTS:
        r = results[part]
        if r["status"] != "pass":
            lines.append(f"- {part}: {r.get('why', 'see its JSON')}")
    ol = results["output_layer"]
    if ol.get("markdown"):
        lines += ["", "## Output layer (scripts/bench_output_layer.py)", "", ol["markdown"].strip(),
                  "", f"Paper, Table 3: {PAPER_TABLE3}."]
    text = "\n".join(lines) + "\n"
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "summary.md").write_text(text)
    return results, text


def _one_line(part: str, r: dict) -> str:
    if r["status"] == "not run" and part != "share":
        return r.get("why", "")[:120]
    if part == "selftest":
        return f"max relative error {r['max_rel_error']:.1e} (tolerance {r['tolerance']:g})"
    if part == "exact":
        bad = [f"{x['schedule']}/{x['method']}" for x in r["rows"] if not x["ok"]]
        worst = max(x["grad_rel_error"] for x in r["rows"])
        return (f"{len(r['rows'])} schedule x method on {r['backend']}, worst gradient error {worst:.1e}"
                + (f"; FAILED: {', '.join(bad)}" if bad else ""))
    if part == "bf16":
        return (f"{r['steps']} steps, loss {r['first_loss']['bf16']:.3f} -> {r['last_loss']['bf16']:.3f} (bf16) vs "
                f"{r['last_loss']['no']:.3f} (fp32), gap {r['relative_gap'] * 100:.2f}%, master {r['master_dtypes']}")
    if part == "output_layer":
        at8 = ", ".join(f"{e * 100:.0f}%" for e in r.get("efficiency_at_8", [])) or "p=8 not measured"
        return f"S+T efficiency at 8 shards: {at8} (paper: {PAPER_TABLE3})"
    if part == "share":
        return f"two ranks on one GPU: {r.get('two_ranks_on_one_gpu', r.get('why', ''))}"
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for <part>.json, results.json and summary.md")
    ap.add_argument("--part", choices=PARTS, help="run one part")
    ap.add_argument("--summarize", action="store_true", help="combine the parts' JSON into results.json + summary.md")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized problems (tests the plumbing in seconds)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        print(summarize(out)[1])
        return 0
    if not args.part:
        ap.error("give --part or --summarize")
    import torch

    t0 = time.perf_counter()
    try:
        result = globals()[f"part_{args.part}"](args.tiny, out)
    except Exception as e:  # noqa: BLE001 - a failed part is a result, the others still run
        import traceback

        result = {"status": "fail", "why": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    result.update(part=args.part, seconds=round(time.perf_counter() - t0, 1), tiny=args.tiny,
                  device_name=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU")
    (out / f"{args.part}.json").write_text(json.dumps(result, indent=1))
    print(f"{args.part}: {result['status']} ({result['seconds']} s)", flush=True)
    return 0 if result["status"] != "fail" else 1


if __name__ == "__main__":
    sys.exit(main())
