"""Host cost of one rounding's autograd node: what an emulated step pays per rounded tensor, forward
and backward, apart from the rounding kernel, against the autograd nodes torch itself offers.

    python bench/bench_autograd.py [--device cpu|cuda] [--numel N] [--links L] [--no-cpp]

Each case is a chain of L links y = f(y) on a tensor of N float32 elements that requires grad,
then backward of y.sum(): µs per link (forward and backward together), best of 7 rounds, and the
ratio to ``torch.clone`` (a torch operator whose autograd node is torch's own C++ node). The
cases:
- torch.clone;
- an identity Python ``torch.autograd.Function`` that clones forward and backward, through
  ``Function.apply`` and through torch's C++ apply beneath it (how lowfp applies its Functions,
  lowfp._autograd.function_apply);
- the same Function written in C++ (``torch::autograd::Function``), built against libtorch with
  ``torch.utils.cpp_extension.load_inline``: the node an extension linked against libtorch could
  give lowfp's roundings (left out with --no-cpp, and, said, where it cannot be built: no
  compiler or no ninja);
- lowfp's emulation rounding (``lowfp.emulate``'s ``_Round`` node: a ``BoundRounder`` forward and
  backward, with counts), to fp(6,9,0) and float8_e4m3fn, nearest.
The first compile of the C++ extension takes about half a minute (torch's extension cache keeps
it)."""

from __future__ import annotations

import argparse
import time

import torch

import lowfp
from lowfp.emulate import _round_apply
from lowfp.quantize import BoundRounder, Rounder

_CPP = r"""
#include <torch/extension.h>
struct CloneFunction : public torch::autograd::Function<CloneFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    return {g[0].clone()};
  }
};
torch::Tensor clone_function(torch::Tensor x) { return CloneFunction::apply(x); }
"""


class PythonClone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


def cpp_clone():
    """The C++ Function's apply, or (None, why it could not be built)."""
    try:
        from torch.utils.cpp_extension import load_inline
        module = load_inline("lowfp_bench_autograd", cpp_sources=_CPP, functions=["clone_function"],
                             extra_cflags=["-O2"], verbose=False)
    except Exception as e:  # (no compiler, no ninja, no headers: the case is left out, said)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return module.clone_function, None


def per_link_us(fn, x: torch.Tensor, links: int, rounds: int = 7, steps: int = 100) -> float:
    """Best µs per link of a chain of ``links`` calls of fn from x, forward and backward."""
    def step():
        y = x
        for _ in range(links):
            y = fn(y)
        y.sum().backward()
        x.grad = None
    for _ in range(10):
        step()
    best = float("inf")
    for _ in range(rounds):
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if x.is_cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / steps)
    return best / links * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--numel", type=int, default=1024)
    p.add_argument("--links", type=int, default=50)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=100, help="chains per round")
    p.add_argument("--no-cpp", action="store_true", help="leave out the C++ Function (no build)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(args.numel, device=args.device, requires_grad=True)
    cases = [("torch.clone", torch.clone),
             ("Python Function, Function.apply", PythonClone.apply),
             ("Python Function, torch's C++ apply", super(torch.autograd.Function, PythonClone).apply)]
    cpp, why = (None, "--no-cpp") if args.no_cpp else cpp_clone()
    if cpp is not None:
        cases.append(("C++ torch::autograd::Function (libtorch)", cpp))
    for name in ("fp(6,9,0)", "float8_e4m3fn"):
        fwd = BoundRounder(Rounder(name), lowfp.Stats(x.device))
        bwd = BoundRounder(Rounder(name), lowfp.Stats(x.device))
        cases.append((f"lowfp's emulation rounding, {name}",
                      lambda y, fwd=fwd, bwd=bwd: _round_apply(y, fwd, bwd, None)))
    times = {name: per_link_us(fn, x, args.links, args.rounds, args.steps) for name, fn in cases}
    base = times["torch.clone"]
    print(f"| node ({args.numel} float32 elements, {args.device}, chains of {args.links}) "
          "| µs per link, forward + backward | vs torch.clone |")
    print("|---|---:|---:|")
    for name, t in times.items():
        print(f"| {name} | {t:.2f} | {t / base:.2f} |")
    if cpp is None:
        print(f"(the C++ Function could not be built here: {why})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
