"""Throughput of rounding to scaled formats (docs/design.md §9) against y.copy_(x) and torchao's
reference casts, in the same run.

    python bench/bench_scaled.py [--size N] [--repeats R] [--json FILE]

Each case rounds a float32 (rows, 4096) tensor of N elements, into a new result (as
lowfp.quantize returns it) and, for the "out=" cases, into an existing tensor as the copy does,
and, for the "counted" ones, with event counts (stats=), as emulation asks for them (their
cost printed against the same call uncounted, paired),
and reports the best time, its ratio to the copy's best, and the median over rounds of the ratio
of two times measured moments apart ("paired": the copy's speed drifts by half on a shared VM,
and a ratio of bests can pair a fast copy with a slow case). Target on the CPU: MXFP8 and NVFP4
≥ 0.5× the copy. A new result's fresh pages (the kernel clearing them on first touch) cost about
as much as the copy itself on a 2-core VM: "x.clone()" shows that cost for torch.
"""

import argparse
import json
import sys

import torch

import lowfp
from lowfp.experiments.bench import machine_description, paired_ratio, time_rounds

CASES = [("mxfp8_e4m3", "nearest"), ("mxfp8_e4m3", "stochastic"), ("mxfp4_e2m1", "nearest"),
         ("nvfp4", "nearest"), ("nvfp4", "stochastic"), ("fp8_e4m3_rowwise", "nearest"),
         ("fp8_e4m3_block128x128", "nearest"), ("nvfp4_4over6", "nearest"), ("nvfp4_4over6", "stochastic")]


def torchao_cases(x):
    """torchao's reference casts (quantize and dequantize, as lowfp.quantize's result is s · q)."""
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize
    except ImportError:
        return {}

    def mx():
        s, d = to_mx(x, torch.float8_e4m3fn, 32)
        return to_dtype(d, s, torch.float8_e4m3fn, 32, torch.float32)

    return {"torchao to_mx + to_dtype (MXFP8)": mx,
            "torchao nvfp4_quantize (codes only)": lambda: nvfp4_quantize(x, 16)}


def run(size: int, repeats: int):
    x = torch.randn(size // 4096, 4096)
    y = torch.empty_like(x)
    fns = {"y.copy_(x)": lambda: y.copy_(x), "x.clone()": lambda: x.clone()}
    for name, rounding in CASES:
        fns[f"{name} {rounding}"] = (lambda n=name, r=rounding: lowfp.quantize(x, n, r, seed=1))
    for name, rounding in CASES[:5]:
        fns[f"{name} {rounding} out="] = (
            lambda n=name, r=rounding: lowfp.quantize(x, n, r, seed=1, out=y))
    for name in ("mxfp8_e4m3", "nvfp4"):  # with counts, as emulation rounds every tensor
        fns[f"{name} nearest out=, counted"] = (
            lambda n=name: lowfp.quantize(x, n, out=y, stats=lowfp.scaled.ScaledStats()))
    # blocks along axis 0 (a GEMM operand along its reduction axis): read in place when
    # deterministic, copied with the axis moved last when stochastic; the transposing copy alone
    for name, rounding in (("mxfp8_e4m3", "nearest"), ("nvfp4", "nearest"), ("mxfp8_e4m3", "stochastic")):
        along0 = lowfp.scaled.named()[name].with_axis(0)
        fns[f"{name} {rounding} along axis 0"] = (
            lambda f=along0, r=rounding: lowfp.quantize(x, f, r, seed=1))
    fns["x.t().contiguous()"] = lambda: x.t().contiguous()
    fns.update(torchao_cases(x))
    rounds = time_rounds(fns, repeats)
    copy = rounds["y.copy_(x)"]
    rows = [{"case": k, "ms": min(t) * 1e3, "elements_per_s": x.numel() / min(t),
             "vs_copy_best": min(copy) / min(t), "vs_copy_paired": 1.0 / paired_ratio(t, copy)}
            for k, t in rounds.items()]
    for r in rows:  # what counting costs: against the same call uncounted, timed moments apart
        if r["case"].endswith(", counted"):
            plain = rounds[r["case"][:-len(", counted")]]
            r["counting_cost_paired"] = paired_ratio(rounds[r["case"]], plain) - 1.0
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=1 << 24)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = run(args.size, args.repeats)
    print(machine_description())
    width = max(len(r["case"]) for r in rows)
    print(f"{'case':<{width}}  {'ms':>8}  {'vs copy':>7}  {'paired':>7}")
    for r in rows:
        print(f"{r['case']:<{width}}  {r['ms']:8.2f}  {r['vs_copy_best']:7.2f}  "
              f"{r['vs_copy_paired']:7.2f}")
    print(f"({args.size} float32 elements; ms: best of {args.repeats} interleaved rounds; vs copy: "
          "the copy's best / the case's; paired: the median over rounds of the copy's time / the "
          "case's; target: MXFP8 and NVFP4 >= 0.5x the copy)")
    for r in rows:
        if "counting_cost_paired" in r:
            print(f"counting costs {r['case'][:-len(' out=, counted')]} "
                  f"{100 * r['counting_cost_paired']:+.1f} % (paired, against the same call "
                  "uncounted; docs/design.md §3 allows 10 %)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
