"""Throughput of rounding to scaled formats (docs/design.md §9) against y.copy_(x) and torchao's
reference casts, in the same run.

    python bench/bench_scaled.py [--device cpu|cuda] [--size N] [--repeats R] [--json FILE]

Each case rounds a float32 (rows, 4096) tensor of N elements (default 2^24 on the CPU, 2^26 on a
GPU), into a new result (as lowfp.quantize returns it) and into an existing tensor ("out=") as
the copy does, and, for the "counted" ones, with event counts (stats=), as emulation asks for
them (their cost printed against the same call uncounted, paired). It reports the best time, its
ratio to the copy's best, and the median over rounds of the ratio of two times measured moments
apart ("paired": the copy's speed drifts by half on a shared VM, and a ratio of bests can pair a
fast copy with a slow case). torchao's MXFP8, MXFP4 and NVFP4 casts run eager and, on a GPU,
compiled by torch.compile (Inductor), the reference a user compares with (Inductor's CPU backend
has no float8_e8m0fnu, the MX scales' type).

On a GPU, times are CUDA events around a few calls queued back to back (the kernels' time, the
host queueing ahead). Targets: on the CPU, MXFP8 and NVFP4 >= 0.5x the copy; on a GPU (issue 56),
out= against the copy: MXFP8 and MXFP4 nearest >= 0.8, stochastic >= 0.7, NVFP4 nearest >= 0.7,
stochastic >= 0.6, rowwise and 128x128 FP8 >= 0.6; each >= 1.5x torchao's compiled cast of the
same format; counting <= 10 % more. A new result's fresh pages (the kernel clearing them on first
touch) cost about as much as the copy itself on a 2-core VM: "x.clone()" shows that cost for
torch.
"""

import argparse
import json
import sys

import torch

import lowfp
from lowfp.experiments.bench import cuda_timer, machine_description, paired_ratio, time_rounds

CASES = [("mxfp8_e4m3", "nearest"), ("mxfp8_e4m3", "stochastic"), ("mxfp4_e2m1", "nearest"),
         ("mxfp4_e2m1", "stochastic"), ("nvfp4", "nearest"), ("nvfp4", "stochastic"),
         ("fp8_e4m3_rowwise", "nearest"), ("fp8_e4m3_block128x128", "nearest"),
         ("nvfp4_4over6", "nearest"), ("nvfp4_4over6", "stochastic")]
# Issue 56's GPU targets: out= at least this fraction of the copy's rate.
GPU_TARGETS = {("mxfp8_e4m3", "nearest"): 0.8, ("mxfp8_e4m3", "stochastic"): 0.7,
               ("mxfp4_e2m1", "nearest"): 0.8, ("mxfp4_e2m1", "stochastic"): 0.7,
               ("nvfp4", "nearest"): 0.7, ("nvfp4", "stochastic"): 0.6,
               ("fp8_e4m3_rowwise", "nearest"): 0.6, ("fp8_e4m3_block128x128", "nearest"): 0.6}
COUNTED = ("mxfp8_e4m3", "nvfp4")
# The torchao cast of each format that has one (the same blocks and element format).
TORCHAO_OF = {"mxfp8_e4m3": "MXFP8", "mxfp4_e2m1": "MXFP4", "nvfp4": "NVFP4"}


def torchao_casts():
    """torchao's reference casts, {name: f(x)}: MX quantized and dequantized (as lowfp.quantize's
    result is s · q), NVFP4's codes and scales (nvfp4_quantize); {} without torchao."""
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize
    except ImportError:
        return {}

    def mx(elem):
        def cast(x):
            s, d = to_mx(x, elem, 32)
            return to_dtype(d, s, elem, 32, torch.float32)
        return cast

    return {"MXFP8": mx(torch.float8_e4m3fn), "MXFP4": mx(torch.float4_e2m1fn_x2),
            "NVFP4": lambda x: nvfp4_quantize(x, 16)}


def torchao_cases(x):
    """The timed torchao cases: each cast eager and, on a GPU, torch.compile'd (compiled by its
    first call, outside the timings)."""
    fns = {}
    for name, cast in torchao_casts().items():
        fns[f"torchao {name}"] = lambda c=cast: c(x)
        if x.is_cuda:
            c = torch.compile(cast)
            c(x)
            fns[f"torchao {name} compiled"] = lambda c=c: c(x)
    return fns


def run(size: int, repeats: int, device: str = "cpu"):
    x = torch.randn(size // 4096, 4096, device=device)
    y = torch.empty_like(x)
    fns = {"y.copy_(x)": lambda: y.copy_(x), "x.clone()": lambda: x.clone()}
    for name, rounding in CASES:
        fns[f"{name} {rounding}"] = (lambda n=name, r=rounding: lowfp.quantize(x, n, r, seed=1))
        fns[f"{name} {rounding} out="] = (
            lambda n=name, r=rounding: lowfp.quantize(x, n, r, seed=1, out=y))
    for name in COUNTED:  # with counts, as emulation rounds every tensor
        stats = lowfp.scaled.ScaledStats(device)
        fns[f"{name} nearest out=, counted"] = (
            lambda n=name, s=stats: lowfp.quantize(x, n, out=y, stats=s))
    # blocks along axis 0 (a GEMM operand along its reduction axis): read in place (stochastic
    # too: axis 0's length is a multiple of 4); the transposing copy alone, which they replace
    for name, rounding in (("mxfp8_e4m3", "nearest"), ("nvfp4", "nearest"), ("mxfp8_e4m3", "stochastic"),
                           ("nvfp4", "stochastic")):
        along0 = lowfp.scaled.named()[name].with_axis(0)
        fns[f"{name} {rounding} along axis 0"] = (
            lambda f=along0, r=rounding: lowfp.quantize(x, f, r, seed=1))
    fns["x.t().contiguous()"] = lambda: x.t().contiguous()
    fns.update(torchao_cases(x))
    if device == "cuda":
        torch.cuda.synchronize()
    rounds = time_rounds(fns, repeats, *(() if device == "cpu" else (cuda_timer(3),)))
    copy = rounds["y.copy_(x)"]
    rows = [{"case": k, "ms": min(t) * 1e3, "elements_per_s": x.numel() / min(t),
             "vs_copy_best": min(copy) / min(t), "vs_copy_paired": 1.0 / paired_ratio(t, copy)}
            for k, t in rounds.items()]
    for r in rows:  # what counting costs: against the same call uncounted, timed moments apart
        if r["case"].endswith(", counted"):
            plain = rounds[r["case"][:-len(", counted")]]
            r["counting_cost_paired"] = paired_ratio(rounds[r["case"]], plain) - 1.0
    return rows


def gpu_summary(rows):
    """Issue 56's targets from one run's rows: [(what, value, target, met)]."""
    by = {r["case"]: r for r in rows}
    out = []
    for (name, rounding), target in GPU_TARGETS.items():
        r = by[f"{name} {rounding} out="]
        out.append((f"{name} {rounding} out= / copy", r["vs_copy_paired"], target, r["vs_copy_paired"] >= target))
        ref = by.get(f"torchao {TORCHAO_OF.get(name)} compiled")
        if ref is not None:
            speedup = ref["ms"] / r["ms"]
            out.append((f"{name} {rounding} out= / torchao {TORCHAO_OF[name]} compiled", speedup, 1.5,
                        speedup >= 1.5))
    for name in COUNTED:
        cost = by[f"{name} nearest out=, counted"]["counting_cost_paired"]
        out.append((f"{name} counting cost", cost, 0.10, cost <= 0.10))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--size", type=int, default=None,
                    help="float32 elements, a multiple of 4096 (default 2^24 on the CPU, 2^26 on a GPU)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    size = args.size or (1 << 24 if args.device == "cpu" else 1 << 26)
    if size <= 0 or size % 4096 or args.repeats <= 0:
        ap.error("--size must be a positive multiple of 4096 and --repeats positive")
    if args.device == "cuda" and not (torch.cuda.is_available() and lowfp.cuda_built()):
        ap.error("--device cuda needs a CUDA GPU and lowfp built with nvcc")
    rows = run(size, args.repeats, args.device)
    machine = machine_description() + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else "")
    print(machine)
    width = max(len(r["case"]) for r in rows)
    print(f"{'case':<{width}}  {'ms':>8}  {'vs copy':>7}  {'paired':>7}")
    for r in rows:
        print(f"{r['case']:<{width}}  {r['ms']:8.3f}  {r['vs_copy_best']:7.2f}  "
              f"{r['vs_copy_paired']:7.2f}")
    timing = "CUDA events around 3 queued calls" if args.device == "cuda" else "wall clock"
    print(f"({size} float32 elements on {args.device}; ms: best of {args.repeats} interleaved rounds, "
          f"{timing}; vs copy: the copy's best / the case's; paired: the median over rounds of the "
          "copy's time / the case's)")
    for r in rows:
        if "counting_cost_paired" in r:
            print(f"counting costs {r['case'][:-len(' out=, counted')]} "
                  f"{100 * r['counting_cost_paired']:+.1f} % (paired, against the same call "
                  "uncounted; docs/design.md §3 allows 10 %)")
    summary = None
    if args.device == "cuda":
        summary = gpu_summary(rows)
        print("GPU targets (issue 56; paired ratios to the copy, speedups over torchao's compiled "
              "cast by best times):")
        for what, value, target, met in summary:
            bound = "<=" if what.endswith("counting cost") else ">="
            print(f"  {what}: {value:.2f} (target {bound} {target}: {'met' if met else 'missed'})")
    else:
        print("CPU target: MXFP8 and NVFP4 >= 0.5x the copy")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "device": args.device, "size": size, "rows": rows,
                       "gpu_targets": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
