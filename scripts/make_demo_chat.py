#!/usr/bin/env python
"""Write the demo chat set (question/answer conversations from Babel/CLDR, Faker and Python docstrings).

    python scripts/make_demo_chat.py --out outputs/demo_chat --conversations 4000 --seed 0
    python scripts/make_demo_chat.py --preference --conversations 1000 --out outputs/demo_preference  # DPO pairs
    python scripts/make_demo_chat.py --unpaired --conversations 1000 --out outputs/demo_unpaired  # KTO rows

Offline and deterministic for a seed and package versions; needs `pip install faker babel` (the `demo`
extra). See vp_accelerate/demo/chat.py for what the conversations are.
"""

import argparse
import json
import sys

from vp_accelerate.demo.chat import make_demo_chat, make_demo_preference


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="outputs/demo_chat", help="output directory")
    ap.add_argument("--conversations", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--preference",
        action="store_true",
        help="write preference pairs (prompt, chosen, rejected: another conversation's answer) instead",
    )
    ap.add_argument(
        "--unpaired",
        action="store_true",
        help="write KTO's unpaired rows (prompt, completion, label: the own answer true, another's false) instead",
    )
    args = ap.parse_args(argv)
    if args.unpaired:
        counts = make_demo_preference(args.out, args.conversations, args.seed, unpaired=True)
    else:
        make = make_demo_preference if args.preference else make_demo_chat
        counts = make(args.out, args.conversations, args.seed)
    print(json.dumps(counts), f"-> {args.out}/train.jsonl, {args.out}/eval.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
