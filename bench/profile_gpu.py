"""Per-kernel GPU times (torch.profiler, CUPTI) of S2FP8 and the ExtraBits steps, beside each
call's wall time, to tell kernel time from host time. Needs a GPU and the CUDA build.

    python bench/profile_gpu.py
"""

import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import lowfp
from lowfp.optim import ExtraBitsAdamW, ExtraBitsSGD

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_optim import make_params  # noqa: E402


def report(label, fn, calls=5):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / calls
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(ev.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    print(f"\n{label}: wall {wall * 1e3:.3f} ms per call")
    for name, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
        print(f"  {us / calls / 1e3:8.3f} ms/call  x{count // calls:<3d} {name}")


def main():
    n = 1 << 28
    x = torch.randn(n, device="cuda") * 2.0 ** -20
    y = torch.empty_like(x)
    report("quantize float8_e5m2 nearest out=", lambda x=x, y=y: lowfp.quantize(x, "float8_e5m2", out=y))
    for mode in ("nearest", "stochastic"):
        spec = lowfp.S2FP8("float8_e5m2", 15.0)
        report(f"S2FP8 float8_e5m2 {mode} out=",
               lambda x=x, y=y: lowfp.quantize(x, spec, mode, seed=1, out=y))
    # Stochastic S2FP8's fast form (from kGpuHostFormMin = 2^24 elements) against the float64
    # kernel around that cut.
    for log2_n in (23, 24, 25):
        xs, ys = x[: 1 << log2_n], y[: 1 << log2_n]
        for wide in ("0", "1"):
            os.environ["LOWFP_S2FP8_FLOAT64"] = wide
            report(f"S2FP8 float8_e5m2 stochastic out=, 2^{log2_n}, LOWFP_S2FP8_FLOAT64={wide}",
                   lambda: lowfp.s2fp8_quantize(xs, rounding="stochastic", seed=1, out=ys))
    os.environ["LOWFP_S2FP8_FLOAT64"] = "0"
    for dtype in (torch.float16, torch.bfloat16):
        xd, yd = (x * 2.0 ** 20).to(dtype), torch.empty(n, device="cuda", dtype=dtype)
        report(f"S2FP8 float8_e5m2 nearest out=, {dtype}",
               lambda: lowfp.s2fp8_quantize(xd, "float8_e5m2", out=yd))
        report(f"quantize float8_e5m2 nearest out=, {dtype}", lambda: lowfp.quantize(xd, "float8_e5m2", out=yd))
    del x, y
    for cls, kw in ((ExtraBitsSGD, dict(lr=0.01, momentum=0.9, extra_bits=8)),
                    (ExtraBitsAdamW, dict(lr=1e-3, extra_bits=8))):
        params = make_params(100_000_000, torch.bfloat16, "cuda")
        opt = cls(params, **kw)
        report(f"{cls.__name__} k=8 toward_zero, {len(params)} tensors, "
               f"{sum(p.numel() for p in params)} params", opt.step)
        del params, opt
    return 0


if __name__ == "__main__":
    sys.exit(main())
