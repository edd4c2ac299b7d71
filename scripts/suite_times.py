"""Wall time per test module from a pytest JUnit XML (`pytest --junitxml FILE`): the suite's budget says no module
may take over 60 s alone (except those marked `slow`, which CI does not run).

    python -m pytest -n 2 --dist loadfile --junitxml /tmp/suite.xml ...; python scripts/suite_times.py /tmp/suite.xml

A module's time is the sum of its tests' setup + call + teardown (with `--dist loadfile` a module runs on one worker,
so this is its wall time there, module fixtures included).
"""

from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET

BUDGET_S = 60.0


def module_times(path: str) -> dict[str, float]:
    totals: dict[str, float] = collections.defaultdict(float)
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = ".".join(m for m in module if m.startswith("test_")) or case.get("classname", "?")
        totals[name.split(".")[0]] += float(case.get("time", 0))
    return dict(totals)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("junit", nargs="+", help="JUnit XML files of one suite run (the parallel and the serial part)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds a module may take (default 60)")
    args = ap.parse_args(argv)
    totals: dict[str, float] = collections.defaultdict(float)
    for path in args.junit:
        for name, t in module_times(path).items():
            totals[name] += t
    over = 0
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1]):
        flag = "  over budget" if t > args.budget else ""
        over += bool(flag)
        print(f"{t:7.1f} s  {name}{flag}")
    print(f"{len(totals)} modules, {sum(totals.values()):.0f} s in all; {over} over {args.budget:.0f} s")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
