"""Where a loss-scaled float16 gradient is unscaled matters: in float16 or in float32.

    python examples/unscale_precision.py [--steps N]

float16 parameters with 13 extra bits (lowfp.optim.ExtraBitsAdamW(param_dtype=torch.float16,
extra_bits=13)) step an fp32 master bit for bit while the weights stay in float16's normal range
(tests/test_extra_bits.py), so torch.optim.AdamW on float32 weights stands for them here. Each
step feeds it random gradients of one magnitude, scaled by 2^16 and rounded to float16 as a
scaled backward pass leaves them, then unscaled either
  in float16   as GradScaler.unscale_ would (it refuses float16) and lowfp.DynamicLossScaler does
  in float32   as torch's fused optimizers do, and lowfp's ExtraBits step under GradScaler
and compares the weights with those of exact (unscaled float32) gradients. Printed: the share of
float16-unscaled gradients of the last step flushed to zero, and the mean and largest weight
error of each way.
"""

import argparse

import torch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--numel", type=int, default=100_000)
    args = parser.parse_args(argv)
    scale = 2.0 ** 16
    print(f"AdamW(lr=1e-3), {args.numel} weights from 0, {args.steps} steps, loss scale 2^16")
    print(f"{'|g|':>7s} {'flushed':>8s} {'error, float16 unscale':>24s} {'error, float32 unscale':>24s} "
          f"{'mean |w|':>9s}")
    for magnitude in (1e-3, 1e-5, 1e-6, 1e-7):
        torch.manual_seed(0)
        weights = [torch.zeros(args.numel, requires_grad=True) for _ in range(3)]
        opts = [torch.optim.AdamW([w], lr=1e-3) for w in weights]
        exact, in_float16, in_float32 = weights
        for _ in range(args.steps):
            g = torch.randn(args.numel) * magnitude
            scaled = (g * scale).half()                       # what a scaled backward leaves
            unscaled16 = scaled * torch.tensor(1 / scale).half()  # rounded to float16
            exact.grad = g
            in_float16.grad = unscaled16.float()
            in_float32.grad = scaled.float() / scale
            for opt in opts:
                opt.step()
        flushed = ((unscaled16 == 0) & (g != 0)).float().mean().item()
        err16, err32 = (w.detach() - exact.detach() for w in (in_float16, in_float32))
        print(f"{magnitude:7.0e} {flushed:8.3f} {err16.abs().mean().item():11.2e} "
              f"(max {err16.abs().max().item():8.2e}) {err32.abs().mean().item():11.2e} "
              f"(max {err32.abs().max().item():8.2e}) {exact.abs().mean().item():9.2e}")


if __name__ == "__main__":
    main()
