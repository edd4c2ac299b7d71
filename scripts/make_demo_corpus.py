#!/usr/bin/env python
"""Write the multilingual demo corpus (Faker + Babel/CLDR + Python docstrings) to a local dir.

    python scripts/make_demo_corpus.py --out outputs/demo_corpus --size-mb 4 --seed 0

Offline and deterministic for a seed and package versions; needs `pip install faker babel` (the
`demo` extra). See vp_accelerate/demo/corpus.py for what the text is.
"""

import argparse
import json
import sys

from vp_accelerate.demo.corpus import make_demo_corpus


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="outputs/demo_corpus", help="output directory")
    ap.add_argument("--size-mb", type=float, default=4.0, help="approximate size of the text in MB")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    manifest = make_demo_corpus(args.out, args.size_mb, args.seed)
    print(json.dumps({k: manifest[k] for k in ("documents", "text_bytes", "sha256")}))
    print(f"{len(manifest['languages'])} languages -> {args.out}/train.jsonl, {args.out}/eval.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
