"""lowfp's default thread count beside other work: an emulated training step on an idle machine and
beside 1 and 2 busy processes, with lowfp's default threads (torch.get_num_threads()) and with each
fixed count, all measured in the same run.

    python bench/bench_threads.py [--repeats R] [--json FILE]

A busy process is a Python loop that never sleeps. Target: the default is never slower than
1.1x the best fixed thread count under any load (the best is chosen after the fact, so noise
alone makes the ratio a little above 1 sometimes).
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import lowfp
from lowfp import assign as A
from lowfp.experiments import models
from lowfp.experiments.bench import machine_description


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    model = models.ResidualCNN(3, 10, 1.0)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    assignment = A.make(A.trace(model, x, F.cross_entropy, y), "ours", r=0.5)

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    cores = os.cpu_count() or 1
    counts = sorted({1, 2, cores} & set(range(1, cores + 1)))
    rows = []
    print(f"# {machine_description()}; torch threads {torch.get_num_threads()}")
    print(f"{'busy':>4} {'default ms':>11} " + " ".join(f"{f'{n} thr ms':>9}" for n in counts)
          + f" {'default/best':>13}")
    with lowfp.emulate(model, assignment):
        for busy in (0, 1, 2):
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(busy)]
            try:
                time.sleep(0.5)
                row = {"busy": busy}
                settings = [None] + counts  # None: lowfp's default
                times = {s: [] for s in settings}
                step()  # warm-up
                for _ in range(args.repeats):  # interleaved: load changes reach every setting
                    for setting in settings:
                        lowfp.set_num_threads(setting or 0)
                        t0 = time.perf_counter()
                        step()
                        times[setting].append(time.perf_counter() - t0)
                lowfp.set_num_threads(0)
                for setting, ts in times.items():
                    row["default" if setting is None else f"{setting}"] = sorted(ts)[len(ts) // 2]
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
            best = min(row[f"{n}"] for n in counts)
            row["default_over_best"] = row["default"] / best
            rows.append(row)
            print(f"{busy:>4} {row['default'] * 1e3:>11.2f} "
                  + " ".join(f"{row[f'{n}'] * 1e3:>9.2f}" for n in counts)
                  + f" {row['default_over_best']:>13.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine_description(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
