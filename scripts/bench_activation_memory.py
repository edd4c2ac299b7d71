"""Activation memory per rank of the 1F1B methods, measured on CPU gloo ranks: microbatches in flight and bytes.

For each pipeline size p and method, one training step of a Llama-style model (h=256, 4 heads, FFN 4h, seq 256,
2p microbatches of one sequence, fp32, V=32k by default) on p gloo ranks, reporting per rank:
- `in flight`: the runtime's own count of (microbatch, chunk) activations held at its peak
  (`PipelineModel.stats()["peak_activation_microbatches"]`, what tests/test_runtime_exact.py checks against the
  simulator);
- `act MiB`: the runtime meter's bytes of those activations plus VP's S->T state (`peak_activation_bytes`);
- `profiled MiB`: the peak of torch's own allocation trace over a second step above its start (the benchmark's
  meter, `bench/memory.py`: saved activations, buffers and every transient such as the logits).

    python scripts/bench_activation_memory.py                   # p = 4 and 8, baseline vocab-1 vocab-2 interlaced
    python scripts/bench_activation_memory.py --ranks 4 --vocab 131072 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

METHODS = ("baseline", "vocab-1", "vocab-2", "interlaced")


def _rank(ckpt: str, methods, microbatches: int, seq: int, vocab: int) -> dict:
    import torch

    from vp_accelerate.bench.memory import peak_allocated_during
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (microbatches, seq), generator=g)
    out = {}
    for method in methods:
        pipe = PipelineModel(ckpt, PipelineConfig(schedule="1f1b", method=method, microbatches=microbatches))
        pipe.train_step(ids, ids.clone())  # gradients allocated: the profiled step accumulates in place
        stats = pipe.stats()
        profiled, _ = peak_allocated_during(lambda: pipe.train_step(ids, ids.clone()))
        out[method] = {
            "in_flight": stats["peak_activation_microbatches"],
            "activation_bytes": stats["peak_activation_bytes"],
            "profiled_bytes": profiled,
        }
        pipe.close()
    return out


def measure(ranks: int, vocab: int, seq: int, layers: int, methods=METHODS) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from vp_accelerate.distributed import spawn

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        per_rank = spawn(_rank, ranks, tmp, methods, 2 * ranks, seq, vocab, timeout_s=1800)
    return {m: [per_rank[r][m] for r in range(ranks)] for m in methods}


def table(results: dict) -> str:
    lines = [
        "| p | V | method | in flight per rank | act MiB per rank | profiled MiB per rank |",
        "|---|---|---|---|---|---|",
    ]
    for (p, vocab), by_method in results.items():
        for m, rows in by_method.items():
            flight = " / ".join(f"{r['in_flight']:g}" for r in rows)
            act = " / ".join(f"{r['activation_bytes'] / 2**20:.0f}" for r in rows)
            prof = " / ".join(f"{r['profiled_bytes'] / 2**20:.0f}" for r in rows)
            lines.append(f"| {p} | {vocab // 1024}k | {m} | {flight} | {act} | {prof} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8], help="pipeline sizes (default 4 8)")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (at least the largest --ranks)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--json", help="write the per-rank figures here")
    a = ap.parse_args(argv)
    if a.layers < max(a.ranks):
        print(f"--layers {a.layers}: fewer decoder layers than {max(a.ranks)} ranks; use --layers >= {max(a.ranks)}")
        return 2
    results = {(p, a.vocab): measure(p, a.vocab, a.seq, a.layers, tuple(a.methods)) for p in a.ranks}
    print(table(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({f"p{p}_v{v}": r for (p, v), r in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
