"""Event counts of rounding calls (docs/design.md §3): overflow, underflow, nan, numel."""

from __future__ import annotations

from typing import Dict, Union

import torch

__all__ = ["Stats"]

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

    def reset(self) -> "Stats":
        self.counts.zero_()
        return self

    def __repr__(self) -> str:
        return "Stats(" + ", ".join(f"{k}={v}" for k, v in self.as_dict().items()) + ")"
