"""S2FP8 against plain float8_e5m2 on the tensors the method was made for.

    python examples/s2fp8_demo.py [--size N]

For each distribution: the mean relative error |x' - x| / |x| over nonzero x, the largest one, and
the share of elements flushed to zero, for
  - plain float8_e5m2 (round to nearest, overflow to inf),
  - float8_e5m2 after the best power-of-two loss scale 2^k (k chosen per tensor to minimise the mean
    error, then divided back out; the error of an oracle loss scaler), and
  - S2FP8 on float8_e5m2 (log_max 15).
"""

import argparse

import numpy as np
import torch

import lowfp


def distributions(n, g):
    return {
        "gradients ~ N(0, 2^-20)": torch.randn(n, generator=g) * 2.0 ** -20,
        "gradients ~ N(0, 2^-30)": torch.randn(n, generator=g) * 2.0 ** -30,
        "activations 2^-10..2^10 (log-uniform)":
            torch.sign(torch.randn(n, generator=g)) * torch.exp2(torch.rand(n, generator=g) * 20 - 10),
        "weights ~ N(0, 0.05)": torch.randn(n, generator=g) * 0.05,
        "heavy tail: N(0,1)^3 * 2^-8": torch.randn(n, generator=g) ** 3 * 2.0 ** -8,
    }


def errors(x: torch.Tensor, xq: torch.Tensor):
    nz = x != 0
    rel = ((xq[nz].double() - x[nz].double()).abs() / x[nz].double().abs())
    rel = torch.nan_to_num(rel, nan=np.inf, posinf=np.inf)
    return rel.mean().item(), rel.max().item(), (xq[nz] == 0).double().mean().item()


def best_loss_scale(x: torch.Tensor):
    best = None
    for k in range(-40, 60):
        xq = lowfp.quantize(x * 2.0 ** k, "float8_e5m2") / 2.0 ** k
        e = errors(x, xq)
        if best is None or e[0] < best[1][0]:
            best = (k, e)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1 << 18)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"{args.size} elements per tensor; relative error over nonzero elements\n")
    header = f"{'tensor':40s} {'method':36s} {'mean rel err':>12s} {'max rel err':>12s} {'to zero':>8s}"
    print(header)
    print("-" * len(header))
    for name, x in distributions(args.size, g).items():
        plain = errors(x, lowfp.quantize(x, "float8_e5m2"))
        k, scaled = best_loss_scale(x)
        s2, st = lowfp.s2fp8_quantize(x)
        rows = [("float8_e5m2", plain), (f"float8_e5m2, loss scale 2^{k}", scaled),
                (f"S2FP8 (alpha={st.alpha:.3g}, beta={st.beta:.3g})", errors(x, s2))]
        for method, (mean, mx, zero) in rows:
            print(f"{name:40s} {method:36s} {mean:12.3e} {mx:12.3e} {zero:8.2%}")
        print()


if __name__ == "__main__":
    main()
