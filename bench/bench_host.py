"""Host cost per call: lowfp.quantize on a small tensor (1024 elements by default), where the
kernel is negligible and the Python and dispatch around it is what a training step pays per
rounding, against torch's own element-wise calls on the same tensor, measured in the same run.

    python bench/bench_host.py [--device cpu|cuda] [--numel N]

The cases take turns in rounds of calls (best round reported, µs per call); on CUDA the host time is
what this measures (calls are queued, the GPU synchronised only at the end of a round). Ratios
are against ``x.to(torch.bfloat16)`` (issue 55's yardstick: a Format at most 2x, scaled formats
at most 3x). S2FP8's call includes its statistics pass and grid (about 12 µs of kernel on 1024
elements on a 2-core AMD EPYC)."""

from __future__ import annotations

import argparse
import time

import torch

import lowfp


def per_call_us(cases, device: str, calls: int = 2000, rounds: int = 7) -> dict:
    """Best µs per call of each case, the cases timed in turn within each round (so that a
    slower or faster spell of the machine meets all of them, the yardstick included)."""
    for _, fn in cases:
        for _ in range(200):
            fn()
    best = {name: float("inf") for name, _ in cases}
    for _ in range(rounds):
        for name, fn in cases:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            if device == "cuda":
                torch.cuda.synchronize()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    return {name: t * 1e6 for name, t in best.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--numel", type=int, default=1024)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(args.numel, device=args.device)
    out = torch.empty_like(x)
    x_grad = x.clone().requires_grad_()  # (autograd records its roundings)
    f = lowfp.formats.float8_e4m3fn
    g = torch.Generator().manual_seed(0)
    cases = [
        ("x.to(torch.bfloat16)", lambda: x.to(torch.bfloat16)),
        ("torch.relu(x)", lambda: torch.relu(x)),
        ("quantize(x, 'float8_e4m3fn')", lambda: lowfp.quantize(x, "float8_e4m3fn")),
        ("quantize(x, Format)", lambda: lowfp.quantize(x, f)),
        ("quantize(x, Format, out=)", lambda: lowfp.quantize(x, f, out=out)),
        ("quantize(x, Format, 'stochastic')", lambda: lowfp.quantize(x, f, "stochastic")),
        ("quantize(x, Format, 'stochastic', generator=)", lambda: lowfp.quantize(x, f, "stochastic", generator=g)),
        ("quantize(x, Format, 'stochastic', seed=)", lambda: lowfp.quantize(x, f, "stochastic", seed=12345)),
        ("quantize(x, 'mxfp8_e4m3')", lambda: lowfp.quantize(x, "mxfp8_e4m3")),
        ("quantize(x, 'nvfp4')", lambda: lowfp.quantize(x, "nvfp4")),
        ("quantize(x, 's2fp8')", lambda: lowfp.quantize(x, "s2fp8")),
        ("quantize(x requiring grad, Format)", lambda: lowfp.quantize(x_grad, f)),
        ("(x requiring grad).to(torch.bfloat16)", lambda: x_grad.to(torch.bfloat16)),
    ]
    times = per_call_us(cases, args.device)
    base = times[cases[0][0]]
    print(f"| call ({args.numel} float32 elements, {args.device}) | µs per call | vs x.to(bfloat16) |")
    print("|---|---:|---:|")
    for name, _ in cases:
        print(f"| `{name}` | {times[name]:.1f} | {times[name] / base:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
