"""What rounding calls report: event counts (docs/design.md §3: overflow, underflow, nan, numel)
and S2FP8's per-tensor statistics (§4)."""

from __future__ import annotations

from typing import Dict, Union

import torch

__all__ = ["Stats", "S2FP8Stats"]

_FIELDS = ("overflow", "underflow", "nan", "numel")


class Stats:
    """Accumulates int64 counts across ``quantize(..., stats=s)`` calls.

    The counts live in a 4-element int64 tensor on ``device`` (on a GPU they stay there, with no
    host synchronisation, until a property is read). Not safe to share between threads that
    quantize concurrently.
    """

    def __init__(self, device: Union[str, torch.device] = "cpu"):
        self.counts = torch.zeros(4, dtype=torch.int64, device=device)

    @classmethod
    def view(cls, counts: torch.Tensor) -> "Stats":
        """A Stats whose counters are ``counts`` (4 contiguous int64 values, e.g. one row of a
        table that holds the counts of many tensors and is read with one synchronisation)."""
        if counts.dtype != torch.int64 or counts.shape != (4,) or not counts.is_contiguous():
            raise ValueError("counts must be a contiguous int64 tensor of shape (4,)")
        stats = cls.__new__(cls)
        stats.counts = counts
        return stats

    @property
    def device(self) -> torch.device:
        return self.counts.device

    overflow = property(lambda self: int(self.counts[0]), doc="values that overflowed (incl. ±inf inputs)")
    underflow = property(lambda self: int(self.counts[1]), doc="finite nonzero values rounded to 0")
    nan = property(lambda self: int(self.counts[2]), doc="NaN inputs")
    numel = property(lambda self: int(self.counts[3]), doc="elements rounded")

    def as_dict(self) -> Dict[str, int]:
        return dict(zip(_FIELDS, self.counts.tolist()))

    def ratio(self, field: str) -> float:
        """counts[field] / numel (0.0 before any element was counted)."""
        if field not in _FIELDS[:3]:
            raise ValueError(f"field must be one of {_FIELDS[:3]}, got {field!r}")
        d = self.as_dict()
        return d[field] / d["numel"] if d["numel"] else 0.0

    def accumulate(self, counts: torch.Tensor) -> None:
        """Add one rounding's counts (overflow, underflow, NaN, numel, and from a scaled format
        saturated blocks and blocks): those that both this Stats and ``counts`` hold (a plain
        Stats takes a scaled rounding's element counts, a ScaledStats a plain one's)."""
        if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int64 or counts.dim() != 1:
            raise TypeError(f"counts must be a 1-D int64 tensor of a rounding's counts, got {counts!r}")
        n = min(self.counts.numel(), counts.numel())
        if counts.device != self.counts.device:
            counts = counts.to(self.counts.device)
        self.counts[:n].add_(counts[:n])

    def reset(self) -> "Stats":
        self.counts.zero_()
        return self

    def __repr__(self) -> str:
        return "Stats(" + ", ".join(f"{k}={v}" for k, v in self.as_dict().items()) + ")"


class S2FP8Stats:
    """α, β, μ, m of one S2FP8 call and the number of finite nonzero elements they were taken
    over (``count``). The values live in device tensors (``params``: float64 [α, β, μ, m];
    ``sums``: the reduction's int64 accumulators), the lowfp::s2fp8 operator's outputs, and are
    read only when a property is used, so a GPU call does not synchronise."""

    def __init__(self, sums: torch.Tensor, params: torch.Tensor, numel: int):
        self.sums = sums
        self.params = params
        self.numel = numel

    alpha = property(lambda self: float(self.params[0]), doc="squeeze exponent α")
    beta = property(lambda self: float(self.params[1]), doc="shift β (log2 units)")
    mu = property(lambda self: float(self.params[2]), doc="mean log2|x| over finite nonzero x")
    m = property(lambda self: float(self.params[3]), doc="max log2|x| over finite nonzero x")
    count = property(lambda self: int(self.sums[2]), doc="finite nonzero elements")

    def as_dict(self) -> Dict[str, float]:
        alpha, beta, mu, m = self.params.tolist()
        return {"alpha": alpha, "beta": beta, "mu": mu, "m": m, "count": self.count,
                "numel": self.numel}

    def __repr__(self) -> str:
        d = self.as_dict()
        return ("S2FP8Stats(alpha={alpha!r}, beta={beta!r}, mu={mu!r}, m={m!r}, count={count}, "
                "numel={numel})").format(**d)
