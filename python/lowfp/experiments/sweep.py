"""``lowfp sweep``: train under fp32, uniform, op, op_io and ours(r) for a list of r, with and
without promotion, over several seeds, and draw the memory–accuracy trade-off.

Outputs in ``--out`` (default ``lowfp-sweep/``):

- ``results.json``: every finished run (its full TrainConfig, accuracies, ratio_lo and aggregate
  before and after promotions, per-epoch records, promotions). It is rewritten after each run, so
  an interrupted sweep resumes where it stopped: the same command skips the runs whose
  configuration is already there. Runs of other grids stay in the file and are reused when asked
  for again.
- ``results.csv``: one row per run of this grid; ``summary.csv``: one row per (strategy, r,
  promotion) with the mean, min and max over seeds.
- ``tradeoff.png``: best test accuracy against ratio_lo and against the aggregate memory of the
  assigned tensors (mean over seeds, bars from the lowest to the highest seed).
- ``curves.png``: training loss and test accuracy per epoch (mean over seeds).

Runs go to ``--jobs`` worker processes, each with ``cores / jobs`` torch threads; a run's result
depends only on its configuration, never on the scheduling.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

from .optional import pyplot
from . import train
from . import description

__all__ = ["Cell", "plan", "run_sweep", "summarise", "main", "STRATEGIES", "DEFAULT_R"]

STRATEGIES = ("fp32", "uniform", "op", "op_io", "ours")
DEFAULT_R = tuple(i / 10 for i in range(11))
RESULTS_FORMAT = "lowfp-sweep/1"


@dataclass(frozen=True)
class Cell:
    """One point of the grid, before seeds: a strategy, its r (ours only) and promotion."""
    strategy: str
    r: Optional[float]
    promote: bool

    @property
    def label(self) -> str:
        name = self.strategy if self.r is None else f"ours(r={self.r:g})"
        return name if self.strategy == "fp32" else f"{name}, {'promotion' if self.promote else 'no promotion'}"


def _cell_of(cfg: dict) -> Cell:
    s = cfg["assignment"]
    return Cell(s, cfg["r"] if s == "ours" else None, bool(cfg["promote"]) if s != "fp32" else False)


def plan(base: train.TrainConfig, strategies: Sequence[str] = STRATEGIES, rs: Sequence[float] = DEFAULT_R,
         promotions: Sequence[bool] = (True, False), seeds: Sequence[int] = (0, 1, 2)) -> List[train.TrainConfig]:
    """The runs of a sweep, seed-major so that an interrupted sweep has whole seeds done. fp32
    rounds nothing, so it runs once per seed (with ``promote=False``); the other strategies run
    once per promotion setting. Fields that a strategy ignores are normalised (r is 0 except for
    ours) so that equal runs have equal configurations."""
    runs = []
    for seed in seeds:
        for s in strategies:
            for r in (rs if s == "ours" else [0.0]):
                for promote in ([False] if s == "fp32" else promotions):
                    runs.append(train.TrainConfig(**{**asdict(base), "assignment": s, "r": float(r),
                                                 "promote": promote, "seed": seed}))
    return runs


def _by_cell(runs: Sequence[dict]) -> Dict[Cell, List[dict]]:
    """Runs grouped by cell (their seeds together), cells in order of first appearance."""
    cells: Dict[Cell, List[dict]] = {}
    for run in runs:
        cells.setdefault(_cell_of(run["config"]), []).append(run)
    return cells


def config_key(cfg: dict) -> str:
    """A run configuration as the key that identifies its run in a sweep's results."""
    return json.dumps(cfg, sort_keys=True)


def _compact(result: dict, seconds: float) -> dict:
    """What a sweep keeps of a ``train.run`` result (the per-step history stays out)."""
    epochs = result["epochs"]
    return {"config": result["config"], "assignment": result["assignment"],
            "initial_ratio_lo": result["initial_ratio_lo"], "ratio_lo": result["ratio_lo"],
            "initial_aggregate_bits": result["initial_aggregate_bits"],
            "aggregate_bits": result["aggregate_bits"], "best_acc": result["best_acc"],
            "final_acc": result["final_acc"], "final_train_loss": epochs[-1]["train_loss"],
            "final_loss": epochs[-1].get("test_loss"),
            "diverged": result["diverged"], "promotions": result["promotions"], "epochs": epochs,
            "seconds": seconds}


def _run_one(cfg: dict) -> dict:
    t0 = time.perf_counter()
    result = train.run(train.TrainConfig(**cfg), log=lambda *a, **k: None)
    return _compact(result, time.perf_counter() - t0)


def _init_worker(threads: int) -> None:
    import torch
    torch.set_num_threads(threads)


def _load(path: str) -> Dict[str, dict]:
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("format") != RESULTS_FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, not {RESULTS_FORMAT!r}")
        return {config_key(run["config"]): run for run in doc["runs"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"cannot resume from {path}: {err}. Use another --out, or --fresh to "
                         f"start over") from None


def _save(path: str, runs: Dict[str, dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"format": RESULTS_FORMAT, "runs": list(runs.values())}, f, indent=1)
    os.replace(tmp, path)  # an interruption never leaves a half-written results file


RUN_COLUMNS = ("strategy", "r", "promote", "seed", "initial_ratio_lo", "ratio_lo",
               "initial_aggregate_mib", "aggregate_mib", "best_acc", "final_acc",
               "final_train_loss", "diverged", "promotions", "seconds")


def _row(run: dict) -> dict:
    c = run["config"]
    cell = _cell_of(c)
    return {"strategy": cell.strategy, "r": "" if cell.r is None else cell.r,
            "promote": "" if cell.strategy == "fp32" else int(cell.promote), "seed": c["seed"],
            "initial_ratio_lo": run["initial_ratio_lo"], "ratio_lo": run["ratio_lo"],
            "initial_aggregate_mib": run["initial_aggregate_bits"] / 8 / 2 ** 20,
            "aggregate_mib": run["aggregate_bits"] / 8 / 2 ** 20, "best_acc": run["best_acc"],
            "final_acc": run["final_acc"], "final_train_loss": run["final_train_loss"],
            "diverged": int(run["diverged"]), "promotions": len(run["promotions"]),
            "seconds": run["seconds"]}


def summarise(runs: Sequence[dict]) -> List[dict]:
    """One record per cell, in the order the cells first appear: mean/min/max over seeds of the
    best test accuracy and of the last epoch's training loss, mean ratio_lo and aggregate
    (initial and after promotions), diverged runs and mean promotions."""
    cells = _by_cell(runs)
    out = []
    for cell, rs in cells.items():
        mean = lambda k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        rec = {"strategy": cell.strategy, "r": "" if cell.r is None else cell.r,
               "promote": "" if cell.strategy == "fp32" else int(cell.promote), "seeds": len(rs),
               "initial_ratio_lo": mean("initial_ratio_lo"), "ratio_lo": mean("ratio_lo"),
               "aggregate_mib": mean("aggregate_bits") / 8 / 2 ** 20}
        for key, name in (("best_acc", "best_acc"), ("final_train_loss", "train_loss")):
            vals = [r[key] for r in rs]
            rec.update({f"{name}_mean": sum(vals) / len(vals), f"{name}_min": min(vals),
                        f"{name}_max": max(vals)})
        rec.update({"diverged": sum(int(r["diverged"]) for r in rs),
                    "promotions_mean": sum(len(r["promotions"]) for r in rs) / len(rs), "label": cell.label})
        out.append(rec)
    return out


def _write_csv(path: str, rows: Sequence[dict], columns: Sequence[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def summary_table(summary: Sequence[dict]) -> str:
    head = ("run", "seeds", "ratio_lo", "aggregate MiB", "best acc mean", "min", "max",
            "train loss", "diverged", "promotions")
    rows = [head] + [(s["label"], str(s["seeds"]),
                      f"{s['initial_ratio_lo']:.3f}" + ("" if abs(s["ratio_lo"] - s["initial_ratio_lo"]) < 5e-4
                                                        else f"->{s['ratio_lo']:.3f}"),
                      f"{s['aggregate_mib']:.3f}", f"{s['best_acc_mean']:.4f}", f"{s['best_acc_min']:.4f}",
                      f"{s['best_acc_max']:.4f}", f"{s['train_loss_mean']:.4f}", f"{s['diverged']}/{s['seeds']}",
                      f"{s['promotions_mean']:.1f}") for s in summary]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + ("\n(ratio_lo a->b: as assigned -> after promotions; aggregate: after "
                               "promotions; best acc: best test accuracy over epochs; train loss: last "
                               "epoch's; all over seeds)")


_COLORS = {"uniform": "tab:red", "op": "tab:green", "op_io": "tab:purple"}
_MARKERS = {"uniform": "s", "op": "^", "op_io": "D"}


def _spread_bar(ax, cells: Sequence[dict], xkey: str, y: str, fmt: str, **kwargs) -> None:
    """Mean of ``y`` over seeds against ``xkey``, with a bar from the lowest to the highest seed."""
    ax.errorbar([c[xkey] for c in cells], [c[f"{y}_mean"] for c in cells],
                yerr=[[c[f"{y}_mean"] - c[f"{y}_min"] for c in cells],
                      [c[f"{y}_max"] - c[f"{y}_mean"] for c in cells]], fmt=fmt, capsize=2, **kwargs)


def plot_tradeoff(summary: Sequence[dict], path: str, title: str) -> None:
    """Best test accuracy and final training loss against ratio_lo, and best test accuracy
    against the aggregate memory."""
    plt = pyplot("the sweep's plots")
    panels = (("ratio_lo", "best_acc", "ratio_lo (after promotions)", "best test accuracy"),
              ("ratio_lo", "train_loss", "ratio_lo (after promotions)", "training loss, last epoch"),
              ("aggregate_mib", "best_acc", "aggregate memory of the assigned tensors (MiB)", "best test accuracy"))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, (xkey, y, xlabel, ylabel) in zip(axes, panels):
        for s in summary:
            if s["strategy"] == "fp32":
                ax.axhspan(s[f"{y}_min"], s[f"{y}_max"], color="0.88", zorder=0)
                ax.axhline(s[f"{y}_mean"], color="k", lw=1, label="fp32 (band: min-max)")
        for promote, style in ((1, "-"), (0, "--")):
            where = "promotion" if promote else "no promotion"
            ours = sorted((s for s in summary if s["strategy"] == "ours" and s["promote"] == promote),
                          key=lambda s: s[xkey])
            if ours:
                _spread_bar(ax, ours, xkey, y, "o" + style, ms=4, label=f"ours(r), {where}",
                            color="tab:blue" if promote else "tab:orange")
            for s in summary:
                if s["strategy"] in _COLORS and s["promote"] == promote:
                    color = _COLORS[s["strategy"]]
                    _spread_bar(ax, [s], xkey, y, _MARKERS[s["strategy"]], ms=7, color=color,
                                mfc=color if promote else "none", label=f"{s['strategy']}, {where}")
        for s in summary:
            if s["diverged"]:
                ax.plot([s[xkey]], [s[f"{y}_min"]], "x", color="red", ms=10, mew=2,
                        label="a seed diverged")
        if y == "train_loss":
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    labelled = {}
    for h, lab in zip(*axes[0].get_legend_handles_labels()):
        labelled.setdefault(lab, h)
    fig.legend(labelled.values(), labelled.keys(), loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle(title + "\nmarkers: mean over seeds; bars: lowest to highest seed", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(runs: Sequence[dict], path: str, title: str) -> None:
    import numpy as np
    plt = pyplot("the sweep's plots")
    cells = _by_cell(runs)
    promotions = sorted({c.promote for c in cells if c.strategy != "fp32"}, reverse=True) or [False]
    fig, axes = plt.subplots(len(promotions), 2, figsize=(12, 3.8 * len(promotions)), squeeze=False)
    rs = sorted({c.r for c in cells if c.r is not None})
    cmap = plt.get_cmap("viridis")
    for row, promote in zip(axes, promotions):
        for cell, group in cells.items():
            if cell.strategy != "fp32" and cell.promote != promote:
                continue
            n = max(len(g["epochs"]) for g in group)

            def mean_of(key):  # diverged runs stop early: their missing epochs are left out
                a = np.full((len(group), n), np.nan)
                for i, g in enumerate(group):
                    vals = [e[key] if e[key] is not None and math.isfinite(e[key]) else np.nan for e in g["epochs"]]
                    a[i, :len(vals)] = vals
                with np.errstate(all="ignore"):
                    return np.nanmean(a, axis=0) if np.isfinite(a).any() else a[0]
            if cell.strategy == "ours":
                color, style = cmap(rs.index(cell.r) / max(1, len(rs) - 1)), "-"
            else:
                color, style = _COLORS.get(cell.strategy, "k"), "-" if cell.strategy == "fp32" else "--"
            label = None if cell.strategy == "ours" else cell.strategy
            epochs = np.arange(1, n + 1)
            row[0].plot(epochs, mean_of("train_loss"), style, color=color, lw=1.3, label=label)
            row[1].plot(epochs, mean_of("test_acc"), style, color=color, lw=1.3, label=label)
        losses = [v for line in row[0].get_lines() for v in line.get_ydata() if v > 0]
        if losses and max(losses) > 10 * min(losses):
            row[0].set_yscale("log")
        row[0].set_ylabel(f"train loss ({'promotion' if promote else 'no promotion'})")
        row[1].set_ylabel("test accuracy")
        for ax in row:
            ax.set_xlabel("epoch")
            ax.grid(alpha=0.3)
        if rs:
            sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(min(rs), max(rs)))
            fig.colorbar(sm, ax=row[1], label="ours: r")
        row[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(title + " (mean over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_configs(configs: Sequence[dict], path: str, *, jobs: int = 0, fresh: bool = False,
                log=None, describe=None, name: str = "lowfp") -> Dict[str, dict]:
    """Train every TrainConfig (as dicts) not yet in the results file ``path`` (resumable: each
    finished run is saved at once), in ``jobs`` processes (0: one per CPU on the CPU); returns
    all runs in the file by config key. ``describe(run)`` names a finished run in the log."""
    log = log or functools.partial(print, flush=True)
    done = {} if fresh else _load(path)
    unique = {config_key(cfg): cfg for cfg in configs}  # (experiments may share a run)
    todo = [cfg for k, cfg in unique.items() if k not in done]
    total = len(unique)
    cpus = os.cpu_count() or 1
    on_cpu = all(c.get("device", "cpu") == "cpu" for c in configs)
    if jobs <= 0:
        jobs = min(cpus, max(1, len(todo))) if on_cpu else 1
    threads = max(1, cpus // jobs)
    log(f"{name}: {total} runs ({total - len(todo)} already in {path}), "
        f"{jobs} job(s) x {threads} thread(s)")
    t0 = time.perf_counter()
    trained = 0

    def finished(run: dict) -> None:
        nonlocal trained
        done[config_key(run["config"])] = run
        _save(path, done)
        trained += 1
        eta = (time.perf_counter() - t0) / trained * (len(todo) - trained)
        text = describe(run) if describe else f"seed {run['config']['seed']}"
        log(f"[{total - len(todo) + trained}/{total}] {text}"
            + (", DIVERGED" if run["diverged"] else "")
            + f" ({run['seconds']:.1f} s, ~{eta / 60:.1f} min left)")

    if todo and jobs == 1:
        for cfg in todo:
            finished(_run_one(cfg))
    elif todo:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed
        # spawn: forked children of a process that has run torch's thread pools can hang
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_init_worker, initargs=(threads,)) as pool:
            futures = [pool.submit(_run_one, cfg) for cfg in todo]
            try:
                for fut in as_completed(futures):
                    finished(fut.result())
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise
    return done


def run_sweep(base: train.TrainConfig, out: str, *, strategies: Sequence[str] = STRATEGIES,
              rs: Sequence[float] = DEFAULT_R, promotions: Sequence[bool] = (True, False),
              seeds: Sequence[int] = (0, 1, 2), jobs: int = 0, fresh: bool = False,
              log=None) -> dict:
    """Run (or resume) a sweep into ``out``; returns {"runs": runs of this grid in plan order,
    "summary": summarise(runs), "ran": how many runs this call trained}. ``log``: called with
    each message line (default: print, flushed)."""
    log = log or functools.partial(print, flush=True)
    configs = plan(base, strategies, rs, promotions, seeds)
    for cfg in configs:
        train.check_config(cfg)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "results.json")
    before = 0 if fresh else len(_load(path))

    def describe(run: dict) -> str:
        c = run["config"]
        return (f"{_cell_of(c).label}, seed {c['seed']}: best acc {run['best_acc']:.4f}, "
                f"ratio_lo {run['ratio_lo']:.3f}"
                + (f", {len(run['promotions'])} promotions" if run["promotions"] else ""))
    done = run_configs([asdict(c) for c in configs], path, jobs=jobs, fresh=fresh, log=log,
                       describe=describe, name="lowfp sweep")
    ran = len(done) - before
    keys = [config_key(asdict(c)) for c in configs]
    runs = [done[k] for k in keys]
    summary = summarise(runs)
    _write_csv(os.path.join(out, "results.csv"), [_row(r) for r in runs], RUN_COLUMNS)
    _write_csv(os.path.join(out, "summary.csv"), summary,
               [k for k in summary[0] if k != "label"] if summary else [])
    title = (f"{base.model} (width {base.width:g}) on {base.data}, {base.epochs} epochs, {base.optimizer}; "
             f"hi {base.hi or 'fp(6,9,0) (16-bit tensors: their own)'}, "
             f"lo {base.lo_forward} (forward) / {base.lo_backward} (backward); "
             f"{len(seeds)} seed(s)")
    plot_tradeoff(summary, os.path.join(out, "tradeoff.png"), title)
    plot_curves(runs, os.path.join(out, "curves.png"), title)
    return {"runs": runs, "summary": summary, "ran": ran}


def _list(kind, text: str, name: str):
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} must be a comma-separated list of {kind.__name__}s, "
                                         f"got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{name} must not be empty")
    return values


def _r_list(text: str) -> List[float]:
    values = _list(float, text, "--r")
    bad = [v for v in values if not 0.0 <= v <= 1.0]
    if bad:
        raise argparse.ArgumentTypeError(f"--r values must lie in [0, 1], got {bad}")
    return values


def _strategy_list(text: str) -> List[str]:
    values = _list(str, text, "--strategies")
    bad = [v for v in values if v not in STRATEGIES]
    if bad:
        raise argparse.ArgumentTypeError(f"--strategies must be taken from {STRATEGIES}, got {bad}")
    return values


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="lowfp sweep", description=description(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--out", default="lowfp-sweep", help="folder for results and plots (default: %(default)s)")
    p.add_argument("--strategies", type=_strategy_list, default=list(STRATEGIES),
                   help="comma-separated, from " + ",".join(STRATEGIES) + " (default: all)")
    p.add_argument("--r", type=_r_list, default=list(DEFAULT_R),
                   help="comma-separated low-precision ratios for ours (default: 0,0.1,...,1)")
    p.add_argument("--promotion", choices=("both", "on", "off"), default="both",
                   help="run with promotion, without, or both (default)")
    p.add_argument("--seeds", type=lambda t: _list(int, t, "--seeds"), default=[0, 1, 2],
                   help="comma-separated seeds (default: 0,1,2)")
    p.add_argument("--jobs", type=int, default=0,
                   help="worker processes (default: one per core on cpu, 1 on other devices)")
    p.add_argument("--fresh", action="store_true", help="ignore the runs already in --out")
    train.add_arguments(p, skip=("assignment", "r", "promote", "seed"))
    args = p.parse_args(argv)
    promotions = {"both": (True, False), "on": (True,), "off": (False,)}[args.promotion]
    try:
        base = train.config_from_args(args, assignment="fp32", r=0.0, promote=False, seed=0)
        result = run_sweep(base, args.out, strategies=args.strategies, rs=args.r, promotions=promotions,
                           seeds=args.seeds, jobs=args.jobs, fresh=args.fresh)
    except ValueError as err:
        print(f"lowfp sweep: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nlowfp sweep: interrupted; finished runs are in {os.path.join(args.out, 'results.json')}. "
              f"Run the same command again to resume.", file=sys.stderr)
        return 130
    print(summary_table(result["summary"]))
    written = ("results.json", "results.csv", "summary.csv", "tradeoff.png", "curves.png")
    print(f"wrote {', '.join(os.path.join(args.out, f) for f in written)}")
    return 0
