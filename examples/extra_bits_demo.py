"""16-bit weights + extra bits against an fp32 master, on scikit-learn's handwritten digits.

    python examples/extra_bits_demo.py [--epochs N] [--data digits|synthetic] [--model mlp|resnet]
                                       [--train-examples N]

A small version of the method's ResNet-18/CIFAR-10 table: the same model (a residual MLP, or
with --model resnet lowfp's small ResNet with BatchNorm, on the 8x8 images) trained with SGD
(momentum 0.9) from the same start, with
  fp32            torch.optim.SGD on float32 parameters (the reference curve)
  pure bfloat16   torch.optim.SGD on bfloat16 parameters (each update rounded to nearest)
  bf16 + k        lowfp.optim.ExtraBitsSGD, bfloat16 weights + k extra bits, stochastic rounding
  fp16 + k        the same with float16 weights
Printed: final training loss, test accuracy, bytes per parameter held for the weights (16-bit
weight + packed extra bits; fp32: 4), and the time of one optimizer step. The learning rate is
small enough that most updates are below half a bfloat16 ulp of the weights: pure bfloat16
training stalls there, while the extra bits accumulate them as an fp32 master would.
"""

import argparse
import copy
import time

import torch

import lowfp
import lowfp.experiments.models
from lowfp.optim import ExtraBitsSGD


def load(data: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if data == "digits":
        from sklearn.datasets import load_digits
        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32) / 16.0
        y = torch.tensor(d.target, dtype=torch.int64)
    else:  # 10 Gaussian clusters in 64 dimensions
        centers = torch.randn(10, 64, generator=g)
        y = torch.randint(0, 10, (1800,), generator=g)
        x = centers[y] + 0.8 * torch.randn(1800, 64, generator=g)
    perm = torch.randperm(len(y), generator=g)
    x, y = x[perm], y[perm]
    n_test = len(y) // 5
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(x + self.fc2(torch.relu(self.fc1(x))))


def make_model(kind="mlp", seed=0, width=128):
    torch.manual_seed(seed)
    if kind == "resnet":  # images of 1 x 8 x 8
        return torch.nn.Sequential(torch.nn.Unflatten(1, (1, 8, 8)),
                                   lowfp.experiments.models.build("resnet", 1, 10, width=0.5, image_size=8))
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), Block(width), Block(width),
                               torch.nn.Linear(width, 10))


def train(name, model, opt, dtype, train_set, test_set, epochs, batch=64, seed=0):
    x, y = train_set
    g = torch.Generator().manual_seed(seed)
    step_time, steps, loss_sum = 0.0, 0, 0.0
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=g)
        loss_sum, count = 0.0, 0
        for i in range(0, len(y), batch):
            idx = perm[i:i + batch]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[idx].to(dtype)).float(), y[idx])
            loss.backward()
            t0 = time.perf_counter()
            opt.step()
            step_time += time.perf_counter() - t0
            steps += 1
            loss_sum += loss.item() * len(idx)
            count += len(idx)
    with torch.no_grad():
        xt, yt = test_set
        acc = (model(xt.to(dtype)).float().argmax(1) == yt).float().mean().item()
    return loss_sum / count, acc, step_time / steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.002)
    p.add_argument("--data", choices=("digits", "synthetic"), default="digits")
    p.add_argument("--model", choices=("mlp", "resnet"), default="mlp")
    p.add_argument("--train-examples", type=int, default=None,
                   help="train on the first N training examples only (default: all)")
    args = p.parse_args(argv)
    if args.train_examples is not None and args.train_examples < 1:
        p.error(f"--train-examples must be at least 1, got {args.train_examples}")
    train_set, test_set = load(args.data)
    if args.train_examples is not None:
        train_set = (train_set[0][:args.train_examples], train_set[1][:args.train_examples])
    base = make_model(args.model)
    n = sum(p.numel() for p in base.parameters())
    sgd = dict(lr=args.lr, momentum=0.9)
    configs = [("fp32", torch.float32, None, None), ("pure bfloat16", torch.bfloat16, None, None),
               ("bf16 + 8", torch.bfloat16, 8, "stochastic"), ("bf16 + 16", torch.bfloat16, 16, "stochastic"),
               ("fp16 + 8", torch.float16, 8, "stochastic"), ("fp16 + 13", torch.float16, 13, "stochastic")]
    print(f"{args.data}: {len(train_set[1])} training / {len(test_set[1])} test examples, "
          f"{'residual MLP' if args.model == 'mlp' else 'ResNet'} with {n} parameters, "
          f"SGD(lr={args.lr}, momentum=0.9), {args.epochs} epochs\n")
    print(f"{'weights':16s} {'final loss':>10s} {'test acc':>9s} {'bytes/param':>12s} {'step ms':>8s}")
    for name, dtype, k, rounding in configs:
        model = copy.deepcopy(base)
        torch.manual_seed(1)
        if k is None:
            model = model.to(dtype)
            opt = torch.optim.SGD(model.parameters(), **sgd)
            per_param = torch.finfo(dtype).bits / 8
        else:
            opt = ExtraBitsSGD(model.parameters(), extra_bits=k, rounding=rounding, param_dtype=dtype, **sgd)
            model.to(dtype)  # the buffers (BatchNorm's statistics); the parameters are 16-bit already
            mem = opt.memory_bytes()
            per_param = (mem["weights"] + mem["extra_bits"]) / n
        loss, acc, sec = train(name, model, opt, dtype, train_set, test_set, args.epochs)
        print(f"{name:16s} {loss:10.4f} {acc:9.3f} {per_param:12.3f} {sec * 1e3:8.2f}")


if __name__ == "__main__":
    main()
