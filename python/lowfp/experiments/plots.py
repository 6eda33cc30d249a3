"""Plots of the library's records (matplotlib: ``pip install 'lowfp[experiments]'``)."""

from __future__ import annotations

from typing import Optional

from .optional import pyplot


def plot_history(history, path, title: Optional[str] = None) -> None:
    """An emulated run's ``lowfp.History`` (``Emulator.history``) as a PNG at ``path``: loss (when
    recorded), loss scale, ratio_lo and aggregate, and the largest overflow ratio per step, with
    promotions marked."""
    plt = pyplot("plot_history")
    steps = [s["step"] for s in history.steps]
    panels = [("loss", "loss", False), ("loss_scale", "loss scale", True),
              ("ratio_lo", "ratio_lo", False), ("aggregate_bits", "aggregate (bits)", False),
              ("max_overflow", "max overflow ratio", False)]
    series = {k: [s.get(k) for s in history.steps] for k, _, _ in panels}
    series["max_overflow"] = [max([r for _, r in s["top_overflow"]], default=0.0)
                              for s in history.steps]
    panels = [p for p in panels if any(v is not None for v in series[p[0]])]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 1.9 * len(panels) + 0.6),
                             sharex=True, squeeze=False)
    for ax, (key, label, logy) in zip(axes[:, 0], panels):
        pts = [(x, y) for x, y in zip(steps, series[key]) if y is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2)
        if logy:
            ax.set_yscale("log", base=2)
        ax.set_ylabel(label)
        for ev in history.promotions:
            ax.axvline(ev["step"], color="tab:red", lw=0.6, alpha=0.5)
    axes[-1, 0].set_xlabel("step (red: promotions)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
