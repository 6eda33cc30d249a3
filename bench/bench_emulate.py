"""Time of an emulated training step against the same step without emulation, in the same run.

    python bench/bench_emulate.py [--device cpu|cuda] [--repeats R] [--json FILE]
                                  [--no-compile | --compile-only | --gemms-only | --python-opcodes]

A step is forward, cross-entropy, backward and an SGD step. Every case of a table trains its own
copy of the model (the same weights, its own optimizer) inside its emulation, entered once, and
the copies' steps are timed in the same interleaved rounds (time_side_by_side): ratios of best
steps, and the median over rounds of the per-round ratio ("paired").

Strategies: a residual CNN and a small Transformer (nn.MultiheadAttention) on 8×8 one-channel
images (the digits data of `lowfp train`) and on 32×32 three-channel images (CIFAR-sized), each
under the `uniform` and `ours(r=0.5)` assignments and, as a floor for the interception itself,
`fp32` (every operator seen, nothing rounded). Target: emulated step ≤ 1.5× the plain step on
the CPU, ≤ 1.3× on a GPU.

torch.compile: ResNet-18 on 32×32 images and a small GPT (4 blocks, width 128, 64 tokens, batch
16 each; on a GPU the sizes of issue 55's targets, ResNet-18 at batch 256 and a GPT of 6 blocks
of width 384 over 256 tokens at batch 32, whose eager emulated/plain columns are its eager
targets), each plain, compiled plain, emulated (ours(r=0.5)) and compiled inside the emulation.
Targets: compiled emulated ≤ eager emulated, and ≤ 1.2× compiled plain on the CPU (≤ 1.1× on a
GPU): under Inductor the roundings are generated inside its own kernels (docs/design.md §3.1).

Host cost: roundings per emulated step and the CPU µs of each (torch.profiler), printed after
the first table. ``--python-opcodes``: the Python bytecode instructions per step of the first
case at batch 2, plain and under each strategy (sys.settrace's opcode events; sys.monitoring's
instruction events from Python 3.12), a count of the host's Python work
that a shared machine's noise leaves as it is.

GEMM recipes (``--gemms-only``): the torch.compile cases eager under
``lowfp.scaled.emulate_gemms`` with the mxfp8 and nvfp4 recipes against the plain step, with the
operand roundings per step and the µs of each (the time inside lowfp's operand rounding: on a
GPU the host's, kernels being asynchronous; on the CPU the kernel's too). Targets on a GPU:
mxfp8 ≤ 1.5×, nvfp4 ≤ 2× the plain step.
"""

import argparse
import contextlib
import json
import sys
import time
from copy import deepcopy
from typing import List

import torch
import torch.nn.functional as F

import lowfp
from lowfp import assign as A
from lowfp.experiments import models
from lowfp.experiments.bench import (_once_cpu, _once_cuda, machine_description, paired_ratio, time_rounds)

CASES = [  # name, model factory, batch, channels, image size
    ("resnet 8x8", lambda: models.ResidualCNN(1, 10, 1.0), 64, 1, 8),
    ("transformer 8x8", lambda: models.TransformerClassifier(1, 10, 1.0, image_size=8, patch=2), 64, 1, 8),
    ("resnet 32x32", lambda: models.ResidualCNN(3, 10, 1.0), 32, 3, 32),
    ("transformer 32x32", lambda: models.TransformerClassifier(3, 10, 1.0, image_size=32, patch=4), 32, 3, 32),
]
STRATEGIES = [("fp32", {}), ("uniform", {}), ("ours", {"r": 0.5})]
def _images(n, d):
    return torch.randn(n, 3, 32, 32, device=d), torch.randint(0, 10, (n,), device=d)


def _tokens(t):
    return lambda n, d: (torch.randint(0, 96, (n, t), device=d), torch.randint(0, 96, (n, t), device=d))


COMPILE_CASES = [  # name, model factory, batch, input factory(batch, device) -> (x, target)
    ("resnet18 32x32", lambda: models.ResNet18(3, 10), 16, _images),
    ("gpt 64 tokens", lambda: models.GPT(96, 64, 128, 4, 4), 16, _tokens(64)),
]
# On a GPU, the sizes of issue 55's targets: ResNet-18 at batch 256, a GPT of 6 blocks of width
# 384 over 256 tokens at batch 32.
GPU_COMPILE_CASES = [
    ("resnet18 32x32 batch 256", lambda: models.ResNet18(3, 10), 256, _images),
    ("gpt 256 tokens", lambda: models.GPT(96, 256, 384, 6, 6), 32, _tokens(256)),
]


def compile_cases(device: torch.device):
    return GPU_COMPILE_CASES if device.type == "cuda" else COMPILE_CASES


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def sgd_step(model, x, y, device: torch.device, loss=F.cross_entropy, forward=None):
    """step() for ``model``: ``forward`` (default: the model itself; or its compiled form),
    ``loss``, backward and an SGD step, waiting for the device."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    forward = model if forward is None else forward

    def step():
        value = loss(forward(x), y)
        opt.zero_grad()
        value.backward()
        opt.step()
        sync(device)
    return step


def training_step(case, device: torch.device):
    """(model, x, y, step) for one of CASES (step: sgd_step's)."""
    _, make, n, c, hw = case
    torch.manual_seed(0)
    model = make().to(device)
    x = torch.randn(n, c, hw, hw, device=device)
    y = torch.randint(0, 10, (n,), device=device)
    return model, x, y, sgd_step(model, x, y, device)


def time_side_by_side(model, x, y, device: torch.device, setups, repeats: int, loss=F.cross_entropy):
    """({name: [seconds of one step per round]}, {name: seconds of its first step}): each entry
    of ``setups`` (name: setup(copy, stack), which enters into the ExitStack what the copy trains
    in, such as lowfp.emulate(copy, assignment), and returns its forward, the copy or its
    compiled form; None for the plain step) trains its own copy of ``model`` (the same weights,
    its own optimizer) inside contexts entered once for all its steps, as a training run is.
    The first steps (compilation, prepared roundings) are timed apart; then the copies' steps
    in interleaved rounds (time_rounds), so that every case meets the same spells of a shared
    machine and their ratios per round pair steps timed moments apart (paired_ratio)."""
    once = _once_cuda if device.type == "cuda" else _once_cpu
    with contextlib.ExitStack() as stack:
        steps, firsts = {}, {}
        for name, setup in setups.items():
            copy = deepcopy(model)
            forward = copy if setup is None else setup(copy, stack)
            steps[name] = sgd_step(copy, x, y, device, loss, forward)
            t0 = time.perf_counter()
            steps[name]()
            firsts[name] = time.perf_counter() - t0
        return time_rounds(steps, repeats, once), firsts


def in_context(make):
    """A setup for time_side_by_side: the copy trained inside make(copy)."""
    def setup(copy, stack):
        stack.enter_context(make(copy))
        return copy
    return setup


def run(device: torch.device, repeats: int):
    rows = []
    for case in CASES:
        name, n = case[0], case[2]
        model, x, y, _ = training_step(case, device)
        tr = A.trace(model, x, F.cross_entropy, y)
        assignments = {strategy: A.make(tr, strategy, **kw) for strategy, kw in STRATEGIES}
        setups = {"plain": None,
                  **{s: in_context(lambda m, a=a: lowfp.emulate(m, a)) for s, a in assignments.items()}}
        t, _ = time_side_by_side(model, x, y, device, setups, repeats)
        row = {"case": name, "batch": n, "operators": len(tr.ops), "tensors": len(tr.tensors),
               "plain_ms": min(t["plain"]) * 1e3}
        for strategy, _ in STRATEGIES:
            row[f"{strategy}_ms"] = min(t[strategy]) * 1e3
            row[f"{strategy}_ratio"] = row[f"{strategy}_ms"] / row["plain_ms"]
            row[f"{strategy}_ratio_paired"] = paired_ratio(t[strategy], t["plain"])
        rows.append(row)
    return rows


def compile_case_model(make, n, inputs, device: torch.device):
    """(model, x, y) for one of compile_cases(device) (its steps: sgd_step with _loss)."""
    torch.manual_seed(0)
    model = make().to(device)
    x, y = inputs(n, device)
    return model, x, y


def run_compile(device: torch.device, repeats: int, cases):
    """Plain, compiled plain, emulated and compiled emulated steps of ``cases``, each on its own
    copy of the model, timed side by side (time_side_by_side): the ratios are of best steps and,
    per round, of steps timed moments apart (their median)."""
    import torch._dynamo
    rows = []
    for name, make, n, inputs in cases:
        model, x, y = compile_case_model(make, n, inputs, device)
        assignment = A.ours(A.trace(model, x, _loss, y), 0.5)
        counters = torch._dynamo.utils.counters
        torch._dynamo.reset()

        def recompiles():
            return sum(counters["recompiles"].values()) if "recompiles" in counters else 0

        before = {}

        def emulated(copy, stack):
            # (set up after the compiled plain copy's first step: what Dynamo counts from here
            # on is the emulation's)
            before.setdefault("graphs", counters["stats"]["unique_graphs"])
            before.setdefault("recompiles", recompiles())
            stack.enter_context(lowfp.emulate(copy, assignment))
            return copy

        def compiled_emulated(copy, stack):
            return torch.compile(emulated(copy, stack))

        counters.clear()
        setups = {"plain": None, "compiled_plain": lambda copy, stack: torch.compile(copy),
                  "emulated": emulated, "compiled_emulated": compiled_emulated}
        t, firsts = time_side_by_side(model, x, y, device, setups, repeats, _loss)
        row = {"case": name, "batch": n, "compile_plain_first_s": firsts["compiled_plain"],
               "compile_emulated_first_s": firsts["compiled_emulated"]}
        for k, times in t.items():
            row[f"{k}_s"] = min(times)
        row["graphs"] = counters["stats"]["unique_graphs"] - before["graphs"]
        row["recompiles"] = recompiles() - before["recompiles"]
        row["compiled_emulated/emulated"] = row["compiled_emulated_s"] / row["emulated_s"]
        row["compiled_emulated/emulated paired"] = paired_ratio(t["compiled_emulated"], t["emulated"])
        row["compiled_emulated/compiled_plain"] = row["compiled_emulated_s"] / row["compiled_plain_s"]
        row["compiled_emulated/compiled_plain paired"] = paired_ratio(t["compiled_emulated"],
                                                                      t["compiled_plain"])
        rows.append(row)
    return rows


def host_per_rounding(device: torch.device, steps: int = 5):
    """Roundings per step and the CPU time of each (torch.profiler's ``_Round`` and
    ``_RoundBackward`` events, which hold the rounding call from Python down to the kernel: on
    a GPU the host's time, which the GPU waits for when the step is host-bound; on the CPU the
    kernel's too) for the first CASES model under ours(r=0.5). Skipped roundings (ReLU's output,
    docs/design.md §6) are not events, nor are results rounded in their own memory (no node of
    lowfp's: counted apart, as ``in_place_per_step``: the native calls that round a tensor in
    its own memory, and BoundRounder.round_in_place's that do)."""
    import importlib

    from torch.profiler import ProfilerActivity, profile
    from lowfp.quantize import BoundRounder
    emulation = importlib.import_module("lowfp.emulate")
    model, x, y, step = training_step(CASES[0], device)
    in_place, native = BoundRounder.round_in_place, emulation._NATIVE_ROUND_OBJECTS
    done = []

    def counted(self, t):
        result = in_place(self, t)
        done.append(result)
        return result

    def round_bound(requests, t, counts, counts_device, out):
        result = native["round_bound"](requests, t, counts, counts_device, out)
        done.append(out is t and result is not None)
        return result
    with lowfp.emulate(model, A.ours(A.trace(model, x, F.cross_entropy, y), 0.5)):
        for _ in range(3):
            step()
        BoundRounder.round_in_place = counted
        lowfp._C.emulator_round_setup(**{**native, "round_bound": round_bound})
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    step()
        finally:
            BoundRounder.round_in_place = in_place
            lowfp._C.emulator_round_setup(**native)
    row = {"case": CASES[0][0], "in_place_per_step": sum(done) / steps}
    for key, label in (("_Round", "forward"), ("_RoundBackward", "backward")):
        events = [e for e in prof.key_averages() if e.key == key]
        row[f"{label}_per_step"] = events[0].count / steps if events else 0
        row[f"{label}_cpu_us"] = events[0].cpu_time_total / events[0].count if events else 0.0
    return row


def bytecode_counts(fn, calls: int):
    """Counter of the Python bytecode instructions that ``calls`` calls of fn run, by
    "file:function": sys.settrace's opcode events before Python 3.12, sys.monitoring's INSTRUCTION
    events from 3.12 on (where a frame's f_trace_opcodes set in its call event no longer turns its
    opcode events on)."""
    import collections
    counts = collections.Counter()

    def key(code):
        return f"{code.co_filename.rsplit('site-packages/', 1)[-1]}:{code.co_name}"
    if sys.version_info >= (3, 12):
        mon = sys.monitoring
        tool = next(t for t in range(6) if mon.get_tool(t) is None)
        mon.use_tool_id(tool, "lowfp bytecode counts")
        mon.register_callback(tool, mon.events.INSTRUCTION, lambda code, offset: counts.update((key(code),)))
        mon.set_events(tool, mon.events.INSTRUCTION)
        try:
            for _ in range(calls):
                fn()
        finally:
            mon.set_events(tool, 0)
            mon.register_callback(tool, mon.events.INSTRUCTION, None)
            mon.free_tool_id(tool)
        return counts

    def tracer(frame, event, arg):
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            counts[key(frame.f_code)] += 1
        return tracer
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        for _ in range(calls):
            fn()
    finally:
        sys.settrace(previous)
    return counts


def python_opcodes(case=None, batch: int = 2, steps: int = 5, top: int = 8) -> List[dict]:
    """Python bytecode instructions per training step (bytecode_counts: a count of
    the host's Python work that no other load on the machine changes) of a CASES model at a small
    batch, plain and under each of STRATEGIES, and the functions that run most of them."""
    name, make, _, c, hw = case or CASES[0]
    rows = []
    for strategy, kw in [("plain", None)] + STRATEGIES:
        torch.manual_seed(0)
        model = make()
        x, y = torch.randn(batch, c, hw, hw), torch.randint(0, 10, (batch,))
        step = sgd_step(model, x, y, torch.device("cpu"))
        with contextlib.ExitStack() as stack:
            if kw is not None:
                stack.enter_context(lowfp.emulate(model, A.make(A.trace(model, x, F.cross_entropy, y),
                                                                strategy, **kw)))
            for _ in range(3):  # (the first steps prepare the roundings)
                step()
            counts = bytecode_counts(step, steps)
        rows.append({"case": name, "batch": batch, "setup": strategy,
                     "opcodes_per_step": sum(counts.values()) / steps,
                     "top": [(f, n / steps) for f, n in counts.most_common(top)]})
    return rows


GEMM_RECIPES = ("mxfp8", "nvfp4")


def run_gemms(device: torch.device, repeats: int, cases, steps: int = 3):
    """Plain steps and steps under emulate_gemms(model, recipe) of ``cases``, eager, timed side by
    side (time_side_by_side); then, per recipe, the operand roundings per step and the µs of each."""
    from lowfp.scaled import gemm
    rows = []
    for name, make, n, inputs in cases:
        model, x, y = compile_case_model(make, n, inputs, device)
        step = sgd_step(model, x, y, device, _loss)

        setups = {"plain": None,
                  **{r: in_context(lambda m, r=r: lowfp.scaled.emulate_gemms(m, r)) for r in GEMM_RECIPES}}
        t, _ = time_side_by_side(model, x, y, device, setups, repeats, _loss)
        row = {"case": name, "batch": n, "plain_s": min(t["plain"])}
        original = gemm._q
        for recipe in GEMM_RECIPES:
            row[f"{recipe}_s"] = min(t[recipe])
            row[f"{recipe}/plain paired"] = paired_ratio(t[recipe], t["plain"])
            spent = []

            def timed(*args, **kwargs):
                t0 = time.perf_counter()
                result = original(*args, **kwargs)
                spent.append(time.perf_counter() - t0)
                return result
            with lowfp.scaled.emulate_gemms(model, recipe):
                step()
                gemm._q = timed
                try:
                    for _ in range(steps):
                        step()
                finally:
                    gemm._q = original
            row[f"{recipe}_roundings"] = len(spent) / steps
            row[f"{recipe}_us"] = 1e6 * sum(spent) / max(len(spent), 1)
        rows.append(row)
    return rows


def gemm_table(rows):
    head = ["case", "plain ms"] + [f"{r} ms (×, paired)" for r in GEMM_RECIPES] + \
        [f"{r} roundings/step, µs each" for r in GEMM_RECIPES]
    lines = [head]
    for r in rows:
        lines.append([r["case"], f"{r['plain_s'] * 1e3:.1f}"] +
                     [f"{r[g + '_s'] * 1e3:.1f} ({r[g + '_s'] / r['plain_s']:.2f}×, {r[g + '/plain paired']:.2f}×)"
                      for g in GEMM_RECIPES] +
                     [f"{r[g + '_roundings']:.0f}, {r[g + '_us']:.0f}" for g in GEMM_RECIPES])
    return _format(lines)


def compile_table(rows):
    head = ["case", "plain ms", "compiled ms", "emulated ms", "compiled emulated ms",
            "c.em/em", "paired", "c.em/compiled", "paired", "graphs", "first step s (plain / emulated)"]
    lines = [head]
    for r in rows:
        lines.append([r["case"]] + [f"{r[k] * 1e3:.1f}" for k in ("plain_s", "compiled_plain_s", "emulated_s",
                                                                  "compiled_emulated_s")] +
                     [f"{r['compiled_emulated/emulated']:.2f}", f"{r['compiled_emulated/emulated paired']:.2f}",
                      f"{r['compiled_emulated/compiled_plain']:.2f}",
                      f"{r['compiled_emulated/compiled_plain paired']:.2f}", str(r["graphs"]),
                      f"{r['compile_plain_first_s']:.0f} / {r['compile_emulated_first_s']:.0f}"])
    return _format(lines)


def _format(lines):
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def table(rows):
    head = ["case", "ops", "plain ms"] + [f"{s} ms (×, paired)" for s, _ in STRATEGIES]
    lines = [head]
    for r in rows:
        lines.append([r["case"], str(r["operators"]), f"{r['plain_ms']:.2f}"] +
                     [f"{r[s + '_ms']:.2f} ({r[s + '_ratio']:.2f}×, {r[s + '_ratio_paired']:.2f}×)"
                      for s, _ in STRATEGIES])
    return _format(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--no-compile", action="store_true", help="skip the torch.compile table")
    which.add_argument("--compile-only", action="store_true", help="only the torch.compile table")
    which.add_argument("--gemms-only", action="store_true", help="only the GEMM recipes table")
    which.add_argument("--python-opcodes", action="store_true",
                       help="only the Python bytecode instructions per step of the first case, at batch 2")
    ap.add_argument("--compile-case", action="append",
                    help="run only this torch.compile case (repeatable): " +
                    ", ".join(name for name, *_ in COMPILE_CASES + GPU_COMPILE_CASES))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    print(machine_description() if device.type == "cpu" else torch.cuda.get_device_name(device))
    result = {"device": str(device)}
    if args.python_opcodes:
        result["python_opcodes"] = rows = python_opcodes()
        plain = rows[0]["opcodes_per_step"]
        print(f"| setup ({rows[0]['case']}, batch {rows[0]['batch']}, cpu) | Python opcodes per step | "
              "added to plain | most of them |")
        print("|---|---:|---:|---|")
        for r in rows:
            print(f"| {r['setup']} | {r['opcodes_per_step']:.0f} | {r['opcodes_per_step'] - plain:.0f} | "
                  + ", ".join(f"{f} {n:.0f}" for f, n in r["top"][:3]) + " |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    if args.gemms_only:
        result["gemm_rows"] = rows = run_gemms(device, args.repeats, compile_cases(device))
        print(gemm_table(rows))
        print("(best of", args.repeats, "interleaved rounds, a copy of the model per case, and the median",
              "of per-round ratios; roundings:",
              "operand roundings per step, µs each: host time inside them",
              f"({'kernels asynchronous' if device.type == 'cuda' else 'kernels included'});",
              "targets on a GPU: mxfp8 ≤ 1.5×, nvfp4 ≤ 2×)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    if not args.compile_only:
        result["rows"] = rows = run(device, args.repeats)
        print(table(rows))
        print("(×: the best emulated step / the best plain step, each case a copy of the model in its",
              "own emulation, their steps in", args.repeats, "interleaved rounds; paired: the median",
              "over rounds of their ratio; target ≤ 1.5× on CPU, 1.3× on GPU)")
        result["host"] = h = host_per_rounding(device)
        print(f"{h['case']}, ours(r=0.5), per step: {h['in_place_per_step']:.0f} forward roundings in "
              f"place (no node of lowfp's), {h['forward_per_step']:.0f} forward and "
              f"{h['backward_per_step']:.0f} backward roundings through lowfp's node; CPU µs per rounding "
              f"of the node (torch.profiler, with its overhead): forward {h['forward_cpu_us']:.1f}, backward "
              f"{h['backward_cpu_us']:.1f} ({'host time' if device.type == 'cuda' else 'host and kernel'})")
    if not args.no_compile:
        known = compile_cases(device)
        cases = [c for c in known if not args.compile_case or c[0] in args.compile_case]
        if not cases:
            ap.error(f"--compile-case must name one of: {', '.join(n for n, *_ in known)}")
        result["compile_rows"] = rows = run_compile(device, args.repeats, cases)
        print(compile_table(rows))
        print("(best of", args.repeats, "interleaved rounds, a copy of the model per case; c.em/em: compiled",
              "emulated / emulated, target ≤ 1, of the best steps and, paired, the median over rounds;",
              "c.em/compiled: compiled emulated / compiled plain, target ≤ 1.2 on CPU, 1.1 on GPU; graphs:",
              "Dynamo graphs of the compiled emulated model)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
