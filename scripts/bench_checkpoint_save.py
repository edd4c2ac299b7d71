"""Training time lost per checkpoint save on CPU: a synchronous save against the background writer.

    python scripts/bench_checkpoint_save.py [--hidden 512] [--layers 8] [--steps 20] [--every 5] [--rounds 2]

One process trains a Llama-shaped model (AdamW, CPU) for `--steps` steps three ways, round-robin `--rounds`
times: without checkpoints, saving every `--every` steps synchronously (`store.save_checkpoint`: write, fsync,
verify before the next step), and saving in the background (`store.begin_save` + `complete_save` at the next
save and at the end, as the trainer does; the final flush is counted). The time lost per save is (the run's
time - the run without saves) / saves; the median over the rounds is printed, with each round's figure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from vp_accelerate.train.persist import store  # noqa: E402


def train(model, opt, batch, steps: int, every: int, mode: str, root: str) -> float:
    """Seconds for `steps` training steps with checkpoints every `every` steps in `mode` (none/sync/background)."""
    pending = None
    start = time.perf_counter()
    for step in range(1, steps + 1):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mode == "none" or step % every:
            continue
        spec = store.SaveSpec(root, step, 0)
        state = store.RankState(
            {n: p.detach() for n, p in model.named_parameters()}, opt.state_dict(), {"step": step}, {"fingerprint": {}}
        )
        if mode == "sync":
            store.save_checkpoint(spec, state, barrier=lambda: None)
            continue
        if pending is not None:  # the trainer's order: the previous save completes, then this one begins
            store.complete_save(pending, barrier=lambda: None)
        pending = store.begin_save(spec, state, barrier=lambda: None, background=True)
    if pending is not None:
        store.complete_save(pending, barrier=lambda: None)  # the end of training: the last one becomes latest
    return time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary dir)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.seq,
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq))
    params = sum(p.numel() for p in model.parameters())
    saves = args.steps // args.every
    print(
        f"model {params / 1e6:.1f}M params ({params * 12 / 2**20:.0f} MiB per save with AdamW's moments), "
        f"{args.steps} steps, a save every {args.every} ({saves} saves), torch threads {torch.get_num_threads()}"
    )
    base = args.dir or tempfile.mkdtemp(prefix="vp_bench_ckpt_")
    times: dict[str, list[float]] = {"none": [], "sync": [], "background": []}
    train(model, opt, batch, 2, args.every, "none", base)  # warm-up: AdamW's state exists, allocator warm
    for _ in range(args.rounds):
        for mode in times:
            root = os.path.join(base, mode)
            shutil.rmtree(root, ignore_errors=True)
            times[mode].append(train(model, opt, batch, args.steps, args.every, mode, root))
    step_s = statistics.median(times["none"]) / args.steps
    print(f"a training step: {step_s * 1e3:.0f} ms (median of the runs without saves)")
    for mode in ("sync", "background"):
        lost = [(t - n) / saves for t, n in zip(times[mode], times["none"])]
        rounds = ", ".join(f"{x:.2f}" for x in lost)
        print(f"{mode:>10}: {statistics.median(lost):.2f} s lost per save (rounds: {rounds})")
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
