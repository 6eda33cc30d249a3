"""A rounding between two element-wise operations, eager and compiled by Inductor, in one run.

    python bench/bench_fused.py [--device cpu|cuda] [--numel N] [--repeats R] [--lane-bitcasts]

f(x) = relu(quantize(sin(x) * 300, fmt, mode)) with counts, on N float32 elements shaped (N / 4096,
4096): eager (three passes, lowfp's native kernel for the rounding), compiled (Inductor generates
the rounding inside its kernels, docs/design.md §3.1) and, as the floor, the compiled
relu(sin(x) * 300) without a rounding. Ratios are against that floor. Formats: float8_e4m3fn in
four modes, and scaled formats (MX, NVFP4, per-row FP8), whose blocks' maxima Inductor reduces
before it rounds. ``--lane-bitcasts`` leaves Inductor's CPU bitcasts lane by lane, as Inductor
makes them without lowfp._inductor.vectorize_cpu_bitcasts (the comparison behind it). Inductor's
cache is off: every case is generated under this run's settings.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("LOWFP_INDUCTOR_FUSION", "1")  # fused on the CPU too (auto: CUDA only)

import torch

import lowfp
from lowfp import _inductor
from lowfp.experiments.bench import machine_description

CASES = [("float8_e4m3fn", mode) for mode in ("nearest", "toward_zero", "down", "stochastic")] + [
    ("mxfp8_e4m3", "nearest"), ("mxfp4_e2m1", "stochastic"), ("nvfp4", "nearest"),
    ("nvfp4", "stochastic"), ("fp8_e4m3_rowwise", "nearest")]


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
    ap.add_argument("--lane-bitcasts", action="store_true",
                    help="keep Inductor's lane-by-lane CPU bitcasts (no vectorize_cpu_bitcasts)")
    args = ap.parse_args(argv)
    if args.lane_bitcasts:
        _inductor.vectorize_cpu_bitcasts = lambda: False  # read when lowfp registers
    torch._inductor.config.force_disable_caches = True
    device = torch.device(args.device)
    print(machine_description() if device.type == "cpu" else torch.cuda.get_device_name(device))
    x = torch.randn(args.numel // 4096, 4096, device=device)
    floor_fn = torch.compile(lambda t: (torch.sin(t) * 300).relu())
    floor = best_ms(lambda: floor_fn(x), args.repeats, device)
    print(f"{args.numel} float32 elements; compiled relu(sin(x) * 300) without rounding: "
          f"{floor:.2f} ms")
    print(f"{'format':<17} {'mode':<11} {'eager ms':>9} {'compiled ms':>12} {'eager/floor':>12} "
          f"{'compiled/floor':>15} {'compiled/eager':>15}")
    for fmt, mode in CASES:
        def f(t, stats, fmt=fmt, mode=mode):
            return lowfp.quantize(torch.sin(t) * 300, fmt, mode, seed=7, stats=stats).relu()
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True)
        stats = lowfp.scaled.ScaledStats(device) if lowfp.scaled.to_scaled(fmt) is not None else lowfp.Stats(device)
        eager = best_ms(lambda: f(x, stats), args.repeats, device)
        fused = best_ms(lambda: compiled(x, stats), args.repeats, device)
        print(f"{fmt:<17} {mode:<11} {eager:>9.2f} {fused:>12.2f} {eager / floor:>12.2f} "
              f"{fused / floor:>15.2f} {fused / eager:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
