"""Benchmark lowfp.quantize on 2^24 float32 elements (see lowfp/experiments/bench.py; `lowfp bench` runs the
same with a smaller default size). Example: python bench/bench_quantize.py --json bench/out/quantize.json"""

import sys

from lowfp.experiments import bench

if __name__ == "__main__":
    sys.exit(bench.main(sys.argv[1:], default_size=1 << 24))
