"""Memory regression benchmark of one huge row per data format: the peak RSS of `vp-accelerate train --check` on a
data file of 40 short rows and one row whose value is `--mb` MB (default 10), per format (text with a byte-level
BPE, text with a Llama-style SentencePiece tokenizer, chat, prompt_completion, preference (DPO),
unpaired_preference (KTO)). Each run is its own process; its peak RSS is the kernel's (wait4's ru_maxrss).

    python scripts/bench_long_rows.py                      # this checkout
    python scripts/bench_long_rows.py --against DIR        # also another checkout (e.g. `git archive REV | tar -x`)

Prints one line per format: its exit code, peak RSS and the last line it said. docs/reliability.md quotes a run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ["alpha", "beta", "gamma", "delta", "paris", "france", "hello", "world"]


def _short(fmt: str, i: int) -> dict:
    words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(12))
    return {
        "text": {"text": words},
        "chat": {"messages": [{"role": "user", "content": words}, {"role": "assistant", "content": words}]},
        "prompt_completion": {"prompt": words + " ", "completion": words},
        "preference": {"prompt": words + " ", "chosen": "alpha beta", "rejected": "gamma delta"},
        "unpaired_preference": {"prompt": words + " ", "completion": "alpha beta", "label": i % 2 == 0},
    }[fmt]


def _long(fmt: str, value: str) -> dict:
    return {
        "text": {"text": value},
        "chat": {"messages": [{"role": "user", "content": "alpha"}, {"role": "assistant", "content": value}]},
        "prompt_completion": {"prompt": "alpha ", "completion": value},
        "preference": {"prompt": "alpha ", "chosen": value, "rejected": "gamma delta"},
        "unpaired_preference": {"prompt": "alpha ", "completion": value, "label": True},
    }[fmt]


def _tokenizers(work: str) -> dict:
    """{"bpe": dir, "sentencepiece": dir}: a byte-level BPE (the project's own trainer) and a Llama-style one
    (normalizer Prepend("▁") + Replace(" ", "▁"), BPE with byte fallback), both trained on the words."""
    sys.path.insert(0, ROOT)
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    from vp_accelerate.train.tokens.tokenizer import train_bpe

    lines = [" ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(12)) for i in range(300)]
    corpus = os.path.join(work, "corpus.jsonl")
    with open(corpus, "w") as f:
        f.writelines(json.dumps({"text": line}) + "\n" for line in lines)
    train_bpe([corpus], 300, os.path.join(work, "bpe"), min_frequency=1)
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=320, special_tokens=specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(os.path.join(work, "sentencepiece"))
    return {"bpe": os.path.join(work, "bpe"), "sentencepiece": os.path.join(work, "sentencepiece")}


CASES = [
    ("text", "bpe"),
    ("text", "sentencepiece"),
    ("chat", "bpe"),
    ("prompt_completion", "bpe"),
    ("preference", "bpe"),
    ("unpaired_preference", "bpe"),
]


def _case(work: str, fmt: str, tok: str, mb: float) -> str:
    """The recipe of one case (its data written beside it)."""
    import yaml

    value = " ".join(["paris france hello"] * int(mb * 1e6 / 19))
    data = os.path.join(work, f"{fmt}-{os.path.basename(tok)}.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(_short(fmt, i)) + "\n" for i in range(40))
        f.write(json.dumps(_long(fmt, value)) + "\n")
    recipe = {
        "model": {"source": "llama-tiny", "config": {"vocab_size": 512}},
        "tokenizer": {"source": f"bpe:{tok}" if tok.endswith("bpe") else tok},
        "data": {"files": [data], "format": fmt, "seq_len": 64, "eval_holdout": 0},
        "pipeline": {"microbatches": 2},
        "train": {"global_batch": 2},
        "eval": {"batches": 0},
        "logging": {"output_dir": os.path.join(work, "out", fmt), "wandb_mode": "disabled"},
    }
    if fmt == "unpaired_preference":
        recipe["preference"] = {"loss_type": "kto"}
    path = os.path.join(work, f"{fmt}-{os.path.basename(tok)}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(recipe, f)
    return path


def peak_rss(code_root: str, recipe: str, work: str) -> tuple[int, float, str]:
    """(exit code, peak RSS in GB, last line said) of `train RECIPE --check` with `code_root`'s package."""
    env = {
        **os.environ,
        "PYTHONPATH": code_root,
        "HF_DATASETS_CACHE": os.path.join(work, "ds", os.path.basename(recipe)),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    cmd = [sys.executable, "-m", "vp_accelerate", "train", recipe, "--check", "--world-size", "2"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    lines = [line for line in out.splitlines() if line.strip()]
    return p.returncode, usage.ru_maxrss / 1e6, (lines[-1] if lines else "")[:160]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=10.0, help="size of the long value in MB (default 10)")
    ap.add_argument("--against", help="another checkout's root, measured beside this one")
    args = ap.parse_args(argv)
    print(f"load: {open('/proc/loadavg').read().split()[:3]} (1, 5, 15 min)")
    with tempfile.TemporaryDirectory(prefix="vp_long_rows_") as work:
        toks = _tokenizers(work)
        for fmt, tok in CASES:
            recipe = _case(work, fmt, toks[tok], args.mb)
            for name, root in [("this", ROOT)] + ([("against", args.against)] if args.against else []):
                code, gb, said = peak_rss(root, recipe, work)
                print(f"{fmt:<20} {tok:<13} {name:<8} exit {code}  peak RSS {gb:5.2f} GB  {said}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
