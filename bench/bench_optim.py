"""Optimizer step time of lowfp's ExtraBits optimizers against torch.optim, in the same run.

    python bench/bench_optim.py [--device cpu|cuda] [--params N] [--repeats R] [--json FILE]
                                [--skip-memory]

Baselines: torch.optim on float32 parameters followed by the copy into the 16-bit weights the
model computes with (standard mixed precision), and torch.optim directly on bfloat16 parameters
(the lowfp cases too, except the float16 + 13 extra bits ones); on a GPU also torch's fused
(single-kernel) SGD and AdamW.
Targets: ExtraBitsSGD(k=8) and ExtraBitsAdamW(k=8) at least as fast as the standard
mixed-precision step on the CPU; on a GPU, >= 80 % of the bandwidth needed for the bytes they move.
Those bytes are every byte the optimizer holds for a parameter (16-bit weight, packed extra bits,
moments: `memory_bytes()`), read once and written once, plus the 16-bit gradient read once; the
bandwidth they are compared with is `y.copy_(x)`'s (bytes read + written), measured in the same run.
Also: `lowfp.extra_bits.split` / `merge` on their own against torch's casts to and from the 16-bit
type, in the same rounds; and the peak memory of a training step of a model whose gradients are a
large share of memory, with the step inside backward or not (CPU: max RSS, separate processes;
GPU: torch's peak allocation);
and the time of a whole training iteration (forward, backward, step) of a wide model and of a
narrow one (there each parameter's work is per-call overhead) with the step after backward or
inside it, with and without a loss scaler: on a GPU the hooks never wait for the device;
steps through a loss scaler ("GradScaler": torch.amp.GradScaler, which leaves the unscale of
float16 gradients, and of any on a GPU, to the optimizer's step, in float32; "lowfp scaler":
lowfp.DynamicLossScaler, unscale_ then the step), at scale 1 so the gradients stay the same;
the step of convolution weights laid out channels_last against the same weights contiguous
(the step walks memory in order either way); the step of many small parameters (48 x 32 x 32),
where each parameter costs what its Python
costs, against torch.optim's default and fused steps on the same bfloat16 parameters; and the
non-finite check of a gradient that those hooks and DynamicLossScaler make
(`lowfp.scaler.any_non_finite`) against `torch.isfinite(g).all()`.
"""

import argparse
import json
import os
import subprocess
import sys

import torch

import lowfp
from lowfp.experiments.bench import _once_cpu, _once_cuda, machine_description, time_interleaved
from lowfp.optim import ExtraBitsAdamW, ExtraBitsSGD

SHAPES_PER_10M = [(2048, 2048)] * 2 + [(1024, 1024)] * 5 + [(4096,)] * 4  # ~13.6M


def make_params(total, dtype, device="cpu"):
    g = torch.Generator(device).manual_seed(0)
    shapes, n = [], 0
    while n < total:
        for s in SHAPES_PER_10M:
            shapes.append(s)
            n += torch.Size(s).numel()
            if n >= total:
                break
    params = [torch.nn.Parameter(torch.randn(s, generator=g, device=device).to(dtype) * 0.02)
              for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g, device=device) * 1e-3).to(dtype)
    return params


def bytes_moved(opt, params):
    """Bytes one step must move at least: what the optimizer holds, read and written once, plus
    the gradients read once. None for torch's optimizers."""
    if not hasattr(opt, "memory_bytes"):
        return None
    return 2 * opt.memory_bytes()["total"] + sum(p.grad.numel() * p.grad.element_size() for p in params)


def cases(total, device="cpu"):
    """(label, build) pairs; build() -> (step function, bytes one step moves or None)."""
    def mixed(opt_cls, kw):
        p32 = make_params(total, torch.float32, device)
        w16 = [p.detach().to(torch.bfloat16) for p in p32]
        opt = opt_cls(p32, **kw)

        def step():
            opt.step()
            for w, p in zip(w16, p32):
                w.copy_(p)
        return step, None

    def plain(opt_cls, kw, dtype=torch.bfloat16):
        params = make_params(total, dtype, device)
        opt = opt_cls(params, **kw)
        opt.step()  # creates the state, so that memory_bytes() counts it
        return opt.step, bytes_moved(opt, params)

    def scaled(opt_cls, kw, dtype, scaler_kind):
        """The step through a loss scaler (scale 1, never grown: the gradients stay as they are):
        torch.amp.GradScaler (which hands the scale to the optimizer's step for float16
        parameters and on a GPU) or lowfp.DynamicLossScaler (unscale_, then the step)."""
        params = make_params(total, dtype, device)
        opt = opt_cls(params, **kw)
        kwargs = dict(init_scale=1.0, growth_interval=10 ** 9)
        scaler = (torch.amp.GradScaler(device, **kwargs) if scaler_kind == "torch"
                  else lowfp.DynamicLossScaler(device, **kwargs))
        opt.step()
        one = torch.ones((), device=device)

        def step():
            scaler.scale(one)  # as scaling the loss does (GradScaler makes its scale there)
            scaler.step(opt)
            scaler.update()
        return step, bytes_moved(opt, params)

    sgd, adamw = dict(lr=0.01, momentum=0.9), dict(lr=1e-3)
    fp16_sgd = dict(sgd, extra_bits=13, rounding="stochastic")
    fp16_adamw = dict(adamw, extra_bits=13, rounding="stochastic")
    fused = [] if device == "cpu" else [
        ("torch SGD(momentum, fused) fp32 + copy to bf16", lambda: mixed(torch.optim.SGD, dict(sgd, fused=True))),
        ("torch AdamW(fused) fp32 + copy to bf16", lambda: mixed(torch.optim.AdamW, dict(adamw, fused=True))),
    ]
    return [
        ("torch SGD(momentum) fp32 + copy to bf16 (mixed precision)", lambda: mixed(torch.optim.SGD, sgd)),
        ("torch SGD(momentum) on bf16 params", lambda: plain(torch.optim.SGD, sgd)),
        *[c for c in fused if "SGD" in c[0]],
        ("lowfp ExtraBitsSGD k=8 toward_zero", lambda: plain(ExtraBitsSGD, dict(sgd, extra_bits=8))),
        ("lowfp ExtraBitsSGD k=8 nearest", lambda: plain(ExtraBitsSGD, dict(sgd, extra_bits=8, rounding="nearest"))),
        ("lowfp ExtraBitsSGD k=16 stochastic",
         lambda: plain(ExtraBitsSGD, dict(sgd, extra_bits=16, rounding="stochastic"))),
        ("lowfp ExtraBitsSGD float8_e5m2 weights k=8 nearest",
         lambda: plain(ExtraBitsSGD, dict(sgd, extra_bits=8, rounding="nearest",
                                          weight_format="float8_e5m2"))),
        ("lowfp ExtraBitsSGD fp16 k=13 stochastic", lambda: plain(ExtraBitsSGD, fp16_sgd, torch.float16)),
        ("lowfp ExtraBitsSGD fp16 k=13 stochastic, GradScaler",
         lambda: scaled(ExtraBitsSGD, fp16_sgd, torch.float16, "torch")),
        ("lowfp ExtraBitsSGD fp16 k=13 stochastic, lowfp scaler",
         lambda: scaled(ExtraBitsSGD, fp16_sgd, torch.float16, "lowfp")),
        # torch.amp.GradScaler checks bfloat16 gradients on the CPU only: on a GPU its check
        # (torch._amp_foreach_non_finite_check_and_unscale_) is not implemented for bfloat16,
        # for any optimizer.
        ("lowfp ExtraBitsSGD k=8 toward_zero, GradScaler" if device == "cpu" else
         "lowfp ExtraBitsSGD k=8 toward_zero, lowfp scaler",
         lambda: scaled(ExtraBitsSGD, dict(sgd, extra_bits=8), torch.bfloat16,
                        "torch" if device == "cpu" else "lowfp")),
        ("torch AdamW fp32 + copy to bf16 (mixed precision)", lambda: mixed(torch.optim.AdamW, adamw)),
        ("torch AdamW on bf16 params", lambda: plain(torch.optim.AdamW, adamw)),
        *[c for c in fused if "AdamW" in c[0]],
        ("lowfp ExtraBitsAdamW k=8 toward_zero", lambda: plain(ExtraBitsAdamW, dict(adamw, extra_bits=8))),
        ("lowfp ExtraBitsAdamW k=8 nearest",
         lambda: plain(ExtraBitsAdamW, dict(adamw, extra_bits=8, rounding="nearest"))),
        ("lowfp ExtraBitsAdamW k=8 nearest, bf16 moments",
         lambda: plain(ExtraBitsAdamW, dict(adamw, extra_bits=8, rounding="nearest", state_dtype=torch.bfloat16))),
        ("lowfp ExtraBitsAdamW float8_e5m2 weights k=8 nearest",
         lambda: plain(ExtraBitsAdamW, dict(adamw, extra_bits=8, rounding="nearest",
                                            weight_format="float8_e5m2"))),
        ("lowfp ExtraBitsAdamW fp16 k=13 stochastic", lambda: plain(ExtraBitsAdamW, fp16_adamw, torch.float16)),
        ("lowfp ExtraBitsAdamW fp16 k=13 stochastic, GradScaler",
         lambda: scaled(ExtraBitsAdamW, fp16_adamw, torch.float16, "torch")),
        ("lowfp ExtraBitsAdamW fp16 k=13 stochastic, lowfp scaler",
         lambda: scaled(ExtraBitsAdamW, fp16_adamw, torch.float16, "lowfp")),
    ]


def split_merge_cases(n, device="cpu"):
    """(label, call, baseline label) for split and merge of n elements, with torch's casts."""
    import lowfp.extra_bits as eb
    w32 = torch.randn(n, generator=torch.Generator(device).manual_seed(1), device=device) * 0.02
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype)[6:]
        w16 = w32.to(dtype)
        rows += [(f"torch w32.to({name})", lambda d=dtype: w32.to(d), None),
                 (f"torch w16.float() ({name})", w16.float, None)]
        for k, rounding in ((8, "nearest"),) if dtype == torch.bfloat16 else \
                ((13, "toward_zero"), (13, "nearest"), (13, "stochastic")):
            parts = eb.split(w32, dtype, k, rounding)
            rows += [(f"lowfp split {name} k={k} {rounding}",
                      lambda d=dtype, k=k, r=rounding: eb.split(w32, d, k, r, seed=1),
                      f"torch w32.to({name})"),
                     (f"lowfp merge {name} k={k} {rounding}",
                      lambda parts=parts, k=k, r=rounding: eb.merge(*parts, k, r),
                      f"torch w16.float() ({name})")]
    return rows


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


def peak_memory_cuda(mode, width=4096, depth=12):
    """(allocated before, peak) bytes on the GPU over the second training step (the first
    creates the optimizer state) of the same model as peak_memory, in this process."""
    from lowfp.optim import ExtraBitsAdamW, step_in_backward
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).cuda().bfloat16()
    opt = ExtraBitsAdamW(model.parameters(), extra_bits=8)
    x = torch.randn(8, width, device="cuda").bfloat16()
    handle = step_in_backward(opt) if mode == "in_backward" else None
    for i in range(2):
        if i == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        model(x).float().square().mean().backward()
        if handle is None:
            opt.step()
            opt.zero_grad()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    if handle is not None:
        handle.remove()
    del model, opt
    torch.cuda.empty_cache()
    return base, peak


def iteration_cases(device, width, depth, batch=64):
    """One training iteration (forward, backward, ExtraBitsSGD(momentum) k=8 step) of
    depth x Linear(width, width) in bfloat16, stepped after backward or inside it, the latter
    also with lowfp.DynamicLossScaler (its update() reads the pass's skip count: one wait an
    iteration); and the same two with ExtraBitsAdamW k=8 (whose step counts are host state,
    settled at the end of each pass). The baseline for the hooks' cost is torch's own recipe
    for stepping inside backward: one torch.optim.SGD per parameter, stepped in its
    post-accumulate-grad hook. Returns {label: fn}; each label's model and optimizer are its own."""
    from lowfp.optim import step_in_backward
    fns = {}
    torch_recipe = "torch.optim.SGD per parameter inside backward"
    for mode in ("step after backward", "step inside backward",
                 "step inside backward + DynamicLossScaler", torch_recipe,
                 "AdamW: step after backward", "AdamW: step inside backward"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
        model = model.to(device=device, dtype=torch.bfloat16)
        x = torch.randn(batch, width, device=device).bfloat16()
        scaler = lowfp.DynamicLossScaler(device) if "Scaler" in mode else None
        if mode == torch_recipe:
            opt = {p: torch.optim.SGD([p], lr=1e-3, momentum=0.9) for p in model.parameters()}

            def torch_hook(p, opt=opt):
                opt[p].step()
                opt[p].zero_grad()
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(torch_hook)
        elif mode.startswith("AdamW"):
            opt = ExtraBitsAdamW(model.parameters(), lr=1e-3, extra_bits=8)
        else:
            opt = ExtraBitsSGD(model.parameters(), lr=1e-3, momentum=0.9, extra_bits=8)
        after = mode.endswith("step after backward")
        if not after and mode != torch_recipe:
            step_in_backward(opt, scaler=scaler)

        def one(model=model, opt=opt, x=x, scaler=scaler, after=after):
            loss = model(x).float().square().mean()
            (loss if scaler is None else scaler.scale(loss)).backward()
            if after:
                opt.step()
                opt.zero_grad()
            if scaler is not None:
                scaler.update()
        for _ in range(3):  # optimizer state created, kernels and allocator warm
            one()
        fns[mode] = one
    return fns


def layout_cases(total, device="cpu", shape=(256, 256, 3, 3)):
    """The step of >= total parameters in convolution weights of `shape` (bfloat16, bfloat16
    gradients of the same layout), contiguous or channels_last: ExtraBitsSGD(momentum) and
    ExtraBitsAdamW k=8, and torch.optim on the channels_last weights. Returns {label: fn}."""
    count = -(-total // torch.Size(shape).numel())
    sgd, adamw = dict(lr=0.01, momentum=0.9), dict(lr=1e-3)
    builds = {
        "torch SGD(momentum) on bf16 params, channels_last": (torch.optim.SGD, sgd, True),
        "lowfp ExtraBitsSGD k=8, contiguous": (ExtraBitsSGD, dict(sgd, extra_bits=8), False),
        "lowfp ExtraBitsSGD k=8, channels_last": (ExtraBitsSGD, dict(sgd, extra_bits=8), True),
        "torch AdamW on bf16 params, channels_last": (torch.optim.AdamW, adamw, True),
        "lowfp ExtraBitsAdamW k=8, contiguous": (ExtraBitsAdamW, dict(adamw, extra_bits=8), False),
        "lowfp ExtraBitsAdamW k=8, channels_last": (ExtraBitsAdamW, dict(adamw, extra_bits=8), True),
    }
    fns = {}
    for label, (opt_cls, kw, channels_last) in builds.items():
        g = torch.Generator(device).manual_seed(0)
        layout = torch.channels_last if channels_last else torch.contiguous_format
        params = [torch.nn.Parameter((torch.randn(shape, generator=g, device=device) * 0.02)
                                     .bfloat16().to(memory_format=layout)) for _ in range(count)]
        for p in params:
            p.grad = torch.empty_like(p).copy_(torch.randn(shape, generator=g, device=device) * 1e-3)
        opt = opt_cls(params, **kw)
        opt.step()  # creates the state
        fns[label] = opt.step
    return fns


def small_step_cases(device, count=48, shape=(32, 32), steps=20):
    """The step of many small parameters, where a step costs what its Python costs per
    parameter: count bfloat16 parameters of the given shape with bfloat16 gradients, each
    function making `steps` steps. torch.optim on the same bfloat16 parameters, by its default
    implementation (foreach) and fused, against ExtraBitsSGD(momentum) / ExtraBitsAdamW k=8.
    Returns {label: fn}."""
    sgd, adamw = dict(lr=1e-3, momentum=0.9), dict(lr=1e-3)
    builds = {
        "torch SGD(momentum) on bf16 params": (torch.optim.SGD, sgd),
        "torch SGD(momentum, fused) on bf16 params": (torch.optim.SGD, dict(sgd, fused=True)),
        "lowfp ExtraBitsSGD k=8": (ExtraBitsSGD, dict(sgd, extra_bits=8)),
        "torch AdamW on bf16 params": (torch.optim.AdamW, adamw),
        "torch AdamW(fused) on bf16 params": (torch.optim.AdamW, dict(adamw, fused=True)),
        "lowfp ExtraBitsAdamW k=8": (ExtraBitsAdamW, dict(adamw, extra_bits=8)),
    }
    fns = {}
    for label, (opt_cls, kw) in builds.items():
        g = torch.Generator(device).manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, generator=g, device=device).bfloat16())
                  for _ in range(count)]
        for p in params:
            p.grad = (torch.randn(shape, generator=g, device=device) * 1e-3).bfloat16()
        opt = opt_cls(params, **kw)
        opt.step()  # creates the state

        def run(opt=opt):
            for _ in range(steps):
                opt.step()
        fns[label] = run
    return fns


def family_table(best, unit, scale, fmt, against, base_label):
    """Prints {label: seconds} as a table, each row against the row base_label(family) of its
    family (SGD or AdamW) in the same run; returns the rows for the JSON result."""
    print(f"{'what':58s} {unit:>8s} {against:>17s}")
    rows = []
    for label, sec in best.items():
        base = best[base_label("SGD" if "SGD" in label else "AdamW")]
        print(f"{label:58s} {sec * scale:8{fmt}} {base / sec:17.2f}")
        rows.append({"label": label, "seconds": sec})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--params", type=int, default=None,
                   help="parameters per optimizer (default 10M on the CPU, 100M on a GPU)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--split-elements", type=int, default=None,
                   help="elements of the split/merge timings (default 2^22 on the CPU: above 2^23 "
                        "every call's new 32 MB output costs page faults, torch's casts' too; "
                        "2^26 on a GPU)")
    p.add_argument("--json", default=None)
    p.add_argument("--skip-memory", action="store_true")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not (torch.cuda.is_available() and lowfp.cuda_built()):
        p.error("--device cuda needs a CUDA GPU and lowfp built with nvcc")
    total = args.params or (100_000_000 if cuda else 10_000_000)
    once = _once_cuda if cuda else _once_cpu
    print("machine:", machine_description())
    if cuda:
        print("GPU:", torch.cuda.get_device_name())
    result = {"machine": machine_description(), "device": args.device, "params": total}
    copy_bw = None
    if cuda:  # the bandwidth the steps are compared with, measured in this run
        x = torch.randn(1 << 28, device="cuda")
        y = torch.empty_like(x)
        sec = time_interleaved({"copy": lambda: y.copy_(x)}, max(args.repeats, 5), once)["copy"]
        copy_bw = 2 * x.numel() * 4 / sec
        del x, y
        print(f"y.copy_(x), 2^28 float32: {copy_bw / 1e9:.0f} GB/s (read + written)")
        result["copy_bytes_per_s"] = copy_bw
    rows = []
    all_cases = cases(total, args.device)
    for family in ("SGD", "AdamW"):  # each family's cases timed in interleaved rounds
        built = {label: build() for label, build in all_cases if family in label}
        best = time_interleaved({label: b[0] for label, b in built.items()}, args.repeats, once)
        rows += [{"label": label, "seconds": best[label], "bytes": built[label][1]} for label in built]
        del built
        if cuda:
            torch.cuda.empty_cache()
    print(f"\noptimizer step, >= {total} parameters, best of {args.repeats} interleaved rounds")
    base = {"SGD": rows[0]["seconds"],
            "AdamW": next(r["seconds"] for r in rows if r["label"].startswith("torch AdamW fp32"))}
    head = f"{'what':58s} {'ms':>8s} {'vs mixed precision':>19s}"
    if cuda:
        head += f" {'GB/s moved':>11s} {'of copy':>8s}"
    print(head)
    for r in rows:
        ref = base["SGD"] if "SGD" in r["label"] else base["AdamW"]
        r["speedup_vs_mixed"] = ref / r["seconds"]
        line = f"{r['label']:58s} {r['seconds'] * 1e3:8.2f} {r['speedup_vs_mixed']:19.2f}"
        if cuda and r["bytes"] is not None:
            r["bytes_per_s"] = r["bytes"] / r["seconds"]
            r["fraction_of_copy"] = r["bytes_per_s"] / copy_bw
            line += f" {r['bytes_per_s'] / 1e9:11.0f} {r['fraction_of_copy']:8.2f}"
        print(line)
    result["steps"] = rows
    fns = layout_cases(total, args.device)
    best = time_interleaved(fns, args.repeats, once)
    del fns
    print(f"\noptimizer step, >= {total} parameters in 256 x 256 x 3 x 3 convolution weights "
          f"(bfloat16), best of {args.repeats} interleaved rounds")
    result["layouts"] = family_table(best, "ms", 1e3, ".2f", "vs contiguous",
                                     lambda family: f"lowfp ExtraBits{family} k=8, contiguous")
    n_split = args.split_elements or (1 << 26 if cuda else 1 << 22)
    split_rows = split_merge_cases(n_split, args.device)
    best = time_interleaved({label: call for label, call, _ in split_rows}, max(args.repeats, 11), once)
    print(f"\nlowfp.extra_bits split / merge alone, {n_split} elements, best of "
          f"{max(args.repeats, 11)} interleaved rounds")
    print(f"{'what':58s} {'ms':>8s} {'vs torch cast':>14s}")
    result["split_merge"] = []
    for label, _, baseline in split_rows:
        row = {"label": label, "seconds": best[label]}
        line = f"{label:58s} {best[label] * 1e3:8.3f}"
        if baseline is not None:
            row["vs_torch_cast"] = best[baseline] / best[label]
            line += f" {row['vs_torch_cast']:14.2f}"
        print(line)
        result["split_merge"].append(row)
    if not args.skip_memory:
        if cuda:
            (b0, normal), (b1, inside) = peak_memory_cuda("normal"), peak_memory_cuda("in_backward")
            print("\npeak GPU memory allocated in a training step (the second; the first allocates the "
                  "optimizer state), 12 x Linear(4096, 4096) bf16 + ExtraBitsAdamW k=8, gradients 384 MiB:")
        else:
            (b0, normal), (b1, inside) = peak_memory("normal"), peak_memory("in_backward")
            print("\npeak RSS of a training step (the second; the first allocates the optimizer "
                  "state), 12 x Linear(2048, 2048) bf16 + ExtraBitsAdamW k=8, gradients 96 MiB:")
        print(f"  step after backward: {normal / 2**20:.0f} MiB (before the step {b0 / 2**20:.0f}); "
              f"step inside backward: {inside / 2**20:.0f} MiB (before {b1 / 2**20:.0f}); "
              f"{(normal - inside) / 2**20:.0f} MiB less")
        result["peak_memory"] = {"normal": normal, "in_backward": inside, "before": [b0, b1]}
    # A wide model, where the matmuls dominate, and a narrow one, where each parameter's work
    # is the per-call overhead (of the hooks inside backward, of the one step after it).
    result["iteration"] = []
    for width, depth in ((1024, 48), (64, 48)) if cuda else ((256, 24), (32, 24)):
        fns = iteration_cases(args.device, width, depth)
        best = time_interleaved(fns, max(args.repeats, 11), once)
        print(f"\ntraining iteration, {depth} x Linear({width}, {width}) bf16, batch 64, "
              f"ExtraBitsSGD momentum k=8 (AdamW: ExtraBitsAdamW k=8), best of "
              f"{max(args.repeats, 11)} interleaved rounds")
        print(f"{'what':58s} {'ms':>8s} {'vs step after':>14s}")
        for label, sec in best.items():
            base = best["AdamW: step after backward" if label.startswith("AdamW") else
                        "step after backward"]
            print(f"{label:58s} {sec * 1e3:8.3f} {base / sec:14.2f}")
            result["iteration"].append({"label": label, "width": width, "depth": depth,
                                        "seconds": sec, "vs_step_after": base / sec})
    del fns
    from lowfp.scaler import any_non_finite
    count, shape, steps = 48, (32, 32), 20
    fns = small_step_cases(args.device, count, shape, steps)
    best = time_interleaved(fns, max(args.repeats, 11), once)
    print(f"\noptimizer step of {count} parameters of {shape[0]} x {shape[1]} (bfloat16), "
          f"best of {max(args.repeats, 11)} interleaved rounds of {steps} steps")
    result["small_steps"] = family_table(
        {label: sec / steps for label, sec in best.items()}, "us/step", 1e6, ".0f",
        "vs torch default",
        lambda family: f"torch {family}{'(momentum)' if family == 'SGD' else ''} on bf16 params")
    print(f"\nnon-finite check of one gradient, best of {max(args.repeats, 11)} interleaved rounds")
    print(f"{'what':58s} {'ms':>8s} {'vs isfinite.all':>16s}")
    result["non_finite_check"] = []
    for n in (64, 1 << 16, 1 << 22):
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.randn(n, device=args.device).to(dtype)
            name = str(dtype).replace("torch.", "")
            fns = {"isfinite": lambda g=g: torch.isfinite(g).all(), "ours": lambda g=g: any_non_finite(g)}
            best = time_interleaved(fns, max(args.repeats, 11), once)
            label = f"any_non_finite, {n} {name}"
            print(f"{label:58s} {best['ours'] * 1e3:8.3f} {best['isfinite'] / best['ours']:16.2f}")
            result["non_finite_check"].append({"label": label, "seconds": best["ours"],
                                               "isfinite_seconds": best["isfinite"]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
