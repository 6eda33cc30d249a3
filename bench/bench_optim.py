"""Optimizer step time of lowfp's ExtraBits optimizers against torch.optim, in the same run.

    python bench/bench_optim.py [--params N] [--repeats R] [--json FILE] [--skip-memory]

Baselines: torch.optim on float32 parameters followed by the copy into the 16-bit weights the
model computes with (standard mixed precision), and torch.optim directly on bfloat16 parameters.
Targets (issue 5): ExtraBitsSGD(k=8) and ExtraBitsAdamW(k=8) at least as fast as the standard
mixed-precision step on the CPU. Also: peak memory (max RSS, separate processes) of a training
step of a model whose gradients are a large share of memory, with the step inside backward or not.
"""

import argparse
import json
import os
import resource
import subprocess
import sys

import torch

import lowfp
from lowfp.bench import machine_description, time_interleaved
from lowfp.optim import ExtraBitsAdamW, ExtraBitsSGD

SHAPES_PER_10M = [(2048, 2048)] * 2 + [(1024, 1024)] * 5 + [(4096,)] * 4  # ~13.6M


def make_params(total, dtype):
    g = torch.Generator().manual_seed(0)
    shapes, n = [], 0
    while n < total:
        for s in SHAPES_PER_10M:
            shapes.append(s)
            n += torch.Size(s).numel()
            if n >= total:
                break
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype) * 0.02) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(dtype)
    return params


def cases(total):
    def mixed(opt_cls, kw):
        p32 = make_params(total, torch.float32)
        w16 = [p.detach().to(torch.bfloat16) for p in p32]
        opt = opt_cls(p32, **kw)

        def step():
            opt.step()
            for w, p in zip(w16, p32):
                w.copy_(p)
        return step

    def plain(opt_cls, kw, dtype=torch.bfloat16):
        opt = opt_cls(make_params(total, dtype), **kw)
        return opt.step

    sgd, adamw = dict(lr=0.01, momentum=0.9), dict(lr=1e-3)
    return [
        ("torch SGD(momentum) fp32 + copy to bf16 (mixed precision)", lambda: mixed(torch.optim.SGD, sgd)),
        ("torch SGD(momentum) on bf16 params", lambda: plain(torch.optim.SGD, sgd)),
        ("lowfp ExtraBitsSGD k=8 toward_zero", lambda: plain(ExtraBitsSGD, dict(sgd, extra_bits=8))),
        ("lowfp ExtraBitsSGD k=8 nearest", lambda: plain(ExtraBitsSGD, dict(sgd, extra_bits=8, rounding="nearest"))),
        ("lowfp ExtraBitsSGD k=16 stochastic", lambda: plain(ExtraBitsSGD, dict(sgd, extra_bits=16, rounding="stochastic"))),
        ("torch AdamW fp32 + copy to bf16 (mixed precision)", lambda: mixed(torch.optim.AdamW, adamw)),
        ("torch AdamW on bf16 params", lambda: plain(torch.optim.AdamW, adamw)),
        ("lowfp ExtraBitsAdamW k=8 toward_zero", lambda: plain(ExtraBitsAdamW, dict(adamw, extra_bits=8))),
        ("lowfp ExtraBitsAdamW k=8 nearest", lambda: plain(ExtraBitsAdamW, dict(adamw, extra_bits=8, rounding="nearest"))),
        ("lowfp ExtraBitsAdamW k=8 nearest, bf16 moments",
         lambda: plain(ExtraBitsAdamW, dict(adamw, extra_bits=8, rounding="nearest", state_dtype=torch.bfloat16))),
    ]


MEMORY_CHILD = """
import sys, torch, lowfp
from lowfp.optim import ExtraBitsAdamW, step_in_backward
torch.manual_seed(0)
width, depth = int(sys.argv[1]), int(sys.argv[2])
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
opt = ExtraBitsAdamW(model.parameters(), extra_bits=8)
x = torch.randn(8, width).bfloat16()
if sys.argv[3] == "in_backward":
    step_in_backward(opt)
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
for i in range(2):
    if i == 1:  # the optimizer state exists now: measure the second step alone
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak RSS
        base = hwm()
    model(x).float().square().mean().backward()
    if sys.argv[3] == "normal":
        opt.step(); opt.zero_grad()
print(base, hwm())
"""


def peak_memory(mode, width=2048, depth=12):
    # A fixed mmap threshold: glibc then returns every freed tensor to the system at once, so the
    # resident set follows the live tensors (its default threshold grows and keeps them).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(width), str(depth), mode],
                         capture_output=True, text=True, check=True, env=env).stdout
    base, peak = map(int, out.split()[-2:])
    return base, peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=10_000_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--skip-memory", action="store_true")
    args = p.parse_args(argv)
    print("machine:", machine_description())
    rows = []
    all_cases = cases(args.params)
    for family in ("SGD", "AdamW"):  # each family's cases timed in interleaved rounds
        steps = {label: build() for label, build in all_cases if family in label}
        best = time_interleaved(steps, args.repeats)
        rows += [{"label": label, "seconds": best[label]} for label in steps]
        del steps
    print(f"\noptimizer step, >= {args.params} parameters, best of {args.repeats} interleaved rounds")
    base = {"SGD": rows[0]["seconds"], "AdamW": rows[5]["seconds"]}
    print(f"{'what':58s} {'ms':>8s} {'vs mixed precision':>19s}")
    for r in rows:
        ref = base["SGD"] if "SGD" in r["label"] else base["AdamW"]
        r["speedup_vs_mixed"] = ref / r["seconds"]
        print(f"{r['label']:58s} {r['seconds'] * 1e3:8.1f} {r['speedup_vs_mixed']:19.2f}")
    result = {"machine": machine_description(), "steps": rows}
    if not args.skip_memory:
        (b0, normal), (b1, inside) = peak_memory("normal"), peak_memory("in_backward")
        print("\npeak RSS of a training step (the second; the first allocates the optimizer "
              "state), 12 x Linear(2048, 2048) bf16 + ExtraBitsAdamW k=8, gradients 96 MiB:")
        print(f"  step after backward: {normal / 2**20:.0f} MiB (before the step {b0 / 2**20:.0f}); "
              f"step inside backward: {inside / 2**20:.0f} MiB (before {b1 / 2**20:.0f}); "
              f"{(normal - inside) / 2**20:.0f} MiB less")
        result["peak_rss"] = {"normal": normal, "in_backward": inside, "before": [b0, b1]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
