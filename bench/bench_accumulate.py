"""Throughput of GEMMs with emulated accumulation (docs/design.md §10) against torch's float32
GEMM, in the same run.

    python bench/bench_accumulate.py [--device cpu|cuda] [--size M K N] [--repeats R] [--json FILE]

Each case computes C = A·B for float32 A (M × K) and B (K × N) by ``lowfp.gemm`` with one
``lowfp.Accumulate``; the table gives the best time of R interleaved rounds, accumulated products
per second (M · K · N / time) and the ratio of torch's float32 GEMM's time to the case's (paired:
the median over rounds). Targets (issue 58): at least 1e9 products per second with a rounding per
addition on a 2-core CPU (1e12 on an H100/H200), and blocked promotion into float32 within 3× of
that.
"""

import argparse
import json
import sys

import torch

import lowfp
from lowfp.accumulate import DEEPSEEK_V3, HOPPER_FP8
from lowfp.experiments.bench import _once_cuda, machine_description, paired_ratio, time_rounds

E8M13 = lowfp.Format(8, 13, 0, specials="ieee")  # ~14-bit sums, as DeepSeek-V3 reports for FP8 GEMMs
CASES = [
    ("sequential, nearest", lowfp.Accumulate(E8M13)),
    ("sequential, toward_zero", lowfp.Accumulate(E8M13, rounding="toward_zero")),
    ("sequential, stochastic", lowfp.Accumulate(E8M13, rounding="stochastic")),
    ("sequential, fp8 products", lowfp.Accumulate(E8M13, product="float8_e4m3fn")),
    ("blocked 128 (promoted to float32)", lowfp.Accumulate(E8M13, order="blocked", block=128)),
    ("pairwise", lowfp.Accumulate(E8M13, order="pairwise")),
    ("compensated (Kahan)", lowfp.Accumulate(E8M13, compensated=True)),
    ("hopper-fp8 (fused groups of 32)", HOPPER_FP8),
    ("deepseek-v3 (hopper-fp8, promoted every 128)", DEEPSEEK_V3),
]


PER_ADD = ("sequential, nearest", "sequential, toward_zero", "sequential, stochastic")


def target_lines(rows, device: str):
    """Issue 58's targets, met or missed, from the table's rows: a rounding per addition at least
    1e9 products per second on the CPU (1e12 on a GPU) in each mode, and the blocked promotion
    into float32 within 3× of the sequential nearest sums."""
    rate = {r["case"]: r["products_per_s"] for r in rows}
    target = 1e12 if device == "cuda" else 1e9
    lines = [f"target: {name} >= {target:.0e} products/s: {rate[name]:.3g} "
             f"({'met' if rate[name] >= target else 'missed'})" for name in PER_ADD]
    slower = rate[PER_ADD[0]] / rate["blocked 128 (promoted to float32)"]
    lines.append(f"target: blocked 128 within 3x of sequential, nearest: {slower:.2f}x "
                 f"({'met' if slower <= 3 else 'missed'})")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--size", nargs=3, type=int, default=None, metavar=("M", "K", "N"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    m, k, n = args.size or ((64, 4096, 64) if args.device == "cpu" else (2048, 4096, 2048))
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(args.device)
    b = torch.randn(k, n, generator=g).to(args.device)
    fns = {"torch float32 (a @ b)": lambda: a @ b}
    for name, acc in CASES:
        fns[name] = lambda acc=acc: lowfp.gemm(a, b, acc, seed=1)
    once = {} if args.device == "cpu" else {"once": _once_cuda}
    times = time_rounds(fns, args.repeats, **once)
    base = times["torch float32 (a @ b)"]
    print(machine_description())
    print(f"{'case':46s} {'ms':>9s} {'products/s':>11s} {'torch / case (paired)':>22s}")
    rows = []
    for name, ts in times.items():
        best = min(ts)
        rate = m * k * n / best
        ratio = min(base) / best
        print(f"{name:46s} {best * 1e3:9.2f} {rate:11.3g} {ratio:10.4f} ({paired_ratio(base, ts):.4f})")
        rows.append(dict(case=name, ms=best * 1e3, products_per_s=rate, vs_torch=ratio))
    print(f"({m} x {k} x {n} float32 GEMM on {args.device}; best of {args.repeats} interleaved rounds)")
    for line in target_lines(rows, args.device):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
