"""A rounding between two element-wise operations, eager and compiled by Inductor, in one run.

    python bench/bench_fused.py [--device cpu|cuda] [--numel N] [--repeats R]

f(x) = relu(quantize(sin(x) * 300, float8_e4m3fn, mode)) with counts, on N float32 elements:
eager (three passes, lowfp's native kernel for the rounding), compiled (Inductor generates the
rounding inside its kernel, docs/design.md §3.1) and, as the floor, the compiled
relu(sin(x) * 300) without a rounding. Ratios are against that floor.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("LOWFP_INDUCTOR_FUSION", "1")  # fused on the CPU too (auto: CUDA only)

import torch

import lowfp
from lowfp.experiments.bench import machine_description

MODES = ["nearest", "toward_zero", "down", "stochastic"]


def best_ms(fn, repeats, device):
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--numel", type=int, default=1 << 22)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    print(machine_description() if device.type == "cpu" else torch.cuda.get_device_name(device))
    x = torch.randn(args.numel, device=device)
    floor_fn = torch.compile(lambda t: (torch.sin(t) * 300).relu())
    floor = best_ms(lambda: floor_fn(x), args.repeats, device)
    print(f"{args.numel} float32 elements; compiled relu(sin(x) * 300) without rounding: "
          f"{floor:.2f} ms")
    print(f"{'mode':<12} {'eager ms':>9} {'compiled ms':>12} {'eager/floor':>12} "
          f"{'compiled/floor':>15} {'compiled/eager':>15}")
    for mode in MODES:
        def f(t, stats, mode=mode):
            return lowfp.quantize(torch.sin(t) * 300, "float8_e4m3fn", mode, seed=7,
                                  stats=stats).relu()
        compiled = torch.compile(f, fullgraph=True)
        stats = lowfp.Stats(device)
        eager = best_ms(lambda: f(x, stats), args.repeats, device)
        fused = best_ms(lambda: compiled(x, stats), args.repeats, device)
        print(f"{mode:<12} {eager:>9.2f} {fused:>12.2f} {eager / floor:>12.2f} "
              f"{fused / floor:>15.2f} {fused / eager:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
