"""Time of an emulated training step against the same step without emulation, in the same run.

    python bench/bench_emulate.py [--device cpu|cuda] [--repeats R] [--json FILE]

A step is forward, cross-entropy, backward and an SGD step. Cases: a residual CNN and a small
Transformer (nn.MultiheadAttention) on 8×8 one-channel images (the digits data of `lowfp train`)
and on 32×32 three-channel images (CIFAR-sized), each under the `uniform` and `ours(r=0.5)`
assignments and, as a floor for the interception itself, `fp32` (every operator seen, nothing
rounded). Target: emulated step ≤ 3× the plain step on the CPU.
"""

import argparse
import json
import sys

import torch
import torch.nn.functional as F

import lowfp
from lowfp import assign as A
from lowfp.experiments import models
from lowfp.experiments.bench import _time as best, machine_description

CASES = [  # name, model factory, batch, channels, image size
    ("resnet 8x8", lambda: models.ResidualCNN(1, 10, 1.0), 64, 1, 8),
    ("transformer 8x8", lambda: models.TransformerClassifier(1, 10, 1.0, image_size=8, patch=2), 64, 1, 8),
    ("resnet 32x32", lambda: models.ResidualCNN(3, 10, 1.0), 32, 3, 32),
    ("transformer 32x32", lambda: models.TransformerClassifier(3, 10, 1.0, image_size=32, patch=4), 32, 3, 32),
]
STRATEGIES = [("fp32", {}), ("uniform", {}), ("ours", {"r": 0.5})]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(device: torch.device, repeats: int):
    rows = []
    for name, make, n, c, hw in CASES:
        torch.manual_seed(0)
        model = make().to(device)
        x = torch.randn(n, c, hw, hw, device=device)
        y = torch.randint(0, 10, (n,), device=device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sync(device)

        plain = best(step, repeats)
        tr = A.trace(model, x, F.cross_entropy, y)
        row = {"case": name, "batch": n, "operators": len(tr.ops), "tensors": len(tr.tensors),
               "plain_ms": plain * 1e3}
        for strategy, kw in STRATEGIES:
            with lowfp.emulate(model, A.make(tr, strategy, **kw)):
                row[f"{strategy}_ms"] = best(step, repeats) * 1e3
            row[f"{strategy}_ratio"] = row[f"{strategy}_ms"] / row["plain_ms"]
        rows.append(row)
    return rows


def table(rows):
    head = ["case", "ops", "plain ms"] + [f"{s} ms (×)" for s, _ in STRATEGIES]
    lines = [head]
    for r in rows:
        lines.append([r["case"], str(r["operators"]), f"{r['plain_ms']:.2f}"] +
                     [f"{r[s + '_ms']:.2f} ({r[s + '_ratio']:.2f}×)" for s, _ in STRATEGIES])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    rows = run(device, args.repeats)
    print(machine_description() if device.type == "cpu" else torch.cuda.get_device_name(device))
    print(table(rows))
    print("(×: emulated step time / plain step time, best of", args.repeats, "; target ≤ 3× on CPU)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
