"""Benchmark our methods against torch.distributed.pipelining on local gloo ranks.

Thin wrapper over `vp_accelerate.bench.run.bench_main` (also `vp-accelerate bench`); see --help.
"""

import sys

from vp_accelerate.bench.run import bench_main

if __name__ == "__main__":
    sys.exit(bench_main(sys.argv[1:]))
