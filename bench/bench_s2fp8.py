"""S2FP8 throughput against plain lowfp.quantize to the same format, measured in the same run.

    python bench/bench_s2fp8.py [--device cpu|cuda|all] [--size N] [--gpu-size N] [--json FILE]

Both sides round to float8_e5m2 (and float8_e4m3fn with log_max 8) on the same float32 data
(gradient-like values around 2^-20). Target: S2FP8 >= 0.4x plain quantize.

On the CPU it also times S2FP8 (float8_e5m2, nearest, out=) per input dtype on its two paths:
the threshold path (x' read from per-call intervals of |x|; float32 and 16-bit x, deterministic
modes) and the float64 path (per-element log2/exp2) that LOWFP_S2FP8_FLOAT64=1 forces; both give
the same bits. float64 x has no threshold form, so its two columns time the same path.
"""

import argparse
import json
import os
import sys

import torch

import lowfp
from lowfp.experiments.bench import (_once_cpu, _once_cuda, _time, machine_description, paired_ratio,
                         time_interleaved, time_rounds)

CASES = [("float8_e5m2", 15.0), ("float8_e4m3fn", 8.0)]


def run(device: str, size: int, repeats: int):
    """Rows (label, best seconds, S2FP8 / quantize or None). Each case's quantize and S2FP8 are
    timed in alternating rounds (lowfp.experiments.bench.time_rounds); the ratio is the median over rounds
    of the two times measured moments apart."""
    once = _once_cpu if device == "cpu" else _once_cuda
    if device == "cuda":
        torch.cuda.synchronize()
    torch.manual_seed(0)
    x = torch.randn(size, device=device) * 2.0 ** -20
    y = torch.empty_like(x)
    rows = [("y.copy_(x)", time_interleaved({"": lambda: y.copy_(x)}, repeats, once)[""], None)]
    for fmt, log_max in CASES:
        spec = lowfp.S2FP8(fmt, log_max)
        for mode in ("nearest", "stochastic"):
            for alloc in (True, False):
                out = None if alloc else y
                how = "allocating" if alloc else "out="
                t = time_rounds({"q": lambda: lowfp.quantize(x, fmt, mode, seed=1, out=out),
                                 "s": lambda: lowfp.quantize(x, spec, mode, seed=1, out=out)},
                                repeats, once)
                rows.append((f"quantize {fmt} {mode} {how}", min(t["q"]), None))
                rows.append((f"S2FP8 {fmt} {mode} {how}", min(t["s"]), paired_ratio(t["q"], t["s"])))
    return rows


def run_paths(size: int, repeats: int):
    """(dtype, float64-path seconds, default-path seconds) for S2FP8 float8_e5m2 nearest out=."""
    torch.manual_seed(0)
    x = torch.randn(size) * 2.0 ** -20
    rows = []
    old = os.environ.get("LOWFP_S2FP8_FLOAT64")
    try:
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            xd = (x * 2.0 ** 20).to(dtype) if dtype == torch.float16 else x.to(dtype)  # float16: in range
            yd = torch.empty_like(xd)
            times = []
            for wide in ("1", "0"):
                os.environ["LOWFP_S2FP8_FLOAT64"] = wide
                times.append(_time(lambda: lowfp.s2fp8_quantize(xd, "float8_e5m2", out=yd), repeats))
            rows.append((str(dtype).replace("torch.", ""), *times))
    finally:
        if old is None:
            os.environ.pop("LOWFP_S2FP8_FLOAT64", None)
        else:
            os.environ["LOWFP_S2FP8_FLOAT64"] = old
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda", "all"), default="all")
    p.add_argument("--size", type=int, default=1 << 24, help="float32 elements on the CPU")
    p.add_argument("--gpu-size", type=int, default=1 << 28, help="float32 elements on the GPU")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if args.device == "all" and not (torch.cuda.is_available() and lowfp.cuda_built()):
        devices = ["cpu"]
    print("machine:", machine_description())
    results = {}
    for dev in devices:
        size = args.size if dev == "cpu" else args.gpu_size
        name = torch.cuda.get_device_name() if dev == "cuda" else "CPU"
        print(f"\n{name}: {size} float32 elements, best of {args.repeats} rounds; "
              "S2FP8 / quantize: median over rounds of the pair's throughput ratio")
        print(f"{'what':50s} {'elements/s':>11s} {'S2FP8 / quantize':>17s}")
        rows = run(dev, size, args.repeats)
        ratios = [r for _, _, r in rows if r is not None]
        for label, sec, ratio in rows:
            print(f"{label:50s} {size / sec:11.3e} {'' if ratio is None else f'{ratio:17.2f}'}")
        print(f"S2FP8 / quantize, min over cases (target >= 0.4): {min(ratios):.2f}")
        results[dev] = [{"label": label, "seconds": s, "elements_per_s": size / s, "ratio": r}
                        for label, s, r in rows]
        if dev == "cpu":
            print("\nCPU S2FP8 float8_e5m2 nearest out=, by input dtype: float64 path vs default")
            print(f"{'dtype':10s} {'float64 path /s':>16s} {'default /s':>16s} {'speed-up':>9s}")
            paths = run_paths(size, args.repeats)
            for dtype, wide, default in paths:
                print(f"{dtype:10s} {size / wide:16.3e} {size / default:16.3e} {wide / default:8.2f}x")
            results["cpu_paths"] = [{"dtype": d, "float64_path_s": w, "default_path_s": n}
                                    for d, w, n in paths]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_description(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
