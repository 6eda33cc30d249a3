"""S2FP8: shifted-and-squeezed 8-bit truncation with per-tensor statistics (docs/design.md §4).

>>> import torch, lowfp
>>> g = torch.tensor([3e-7, -1e-6, 2.5e-6, 0.0])
>>> y, st = lowfp.s2fp8_quantize(g)
>>> round(st.m - st.mu, 6) > 0, (y == 0).tolist()
(True, [False, False, False, True])

One reduction pass computes μ = mean log2|x| and m = max log2|x| over the finite nonzero
elements (in double, order-independent, so every thread count and the GPU agree bit for bit);
one element pass maps x to Y = sign(x) 2^β |x|^α, rounds Y to the 8-bit format and maps it back.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import numpy as np
import torch

from . import _C
from ._memory import new_output
from ._native import check_tensor_args, into_numpy_out, make_call, numpy_as_tensor, run_s2fp8
from ._straight_through import StraightThrough
from .formats import Format, S2FP8, to_format
from .stats import Stats

__all__ = ["S2FP8", "S2FP8Stats", "s2fp8_quantize"]


class S2FP8Stats:
    """α, β, μ, m of one S2FP8 call and the number of finite nonzero elements they were taken
    over (``count``). The values live in device tensors (``params``: float64 [α, β, μ, m];
    ``sums``: the reduction's int64 accumulators) and are read only when a property is used, so a
    GPU call does not synchronise."""

    def __init__(self, device: Union[str, torch.device], numel: int):
        self.sums = torch.zeros(_C.S2FP8_SUM_SIZE, dtype=torch.int64, device=device)
        self.params = torch.zeros(4, dtype=torch.float64, device=device)
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


def apply_s2fp8(x: torch.Tensor, spec: S2FP8, rounding: str, *, overflow=None, subnormals=None,
                seed=None, generator=None, offset=0, sr_bits=32, stats=None, out=None,
                out_dtype=None, round_grad: Optional[Callable] = None
                ) -> Tuple[torch.Tensor, S2FP8Stats]:
    """S2FP8 on a tensor (``quantize`` and ``s2fp8_quantize`` both end here); the gradient
    passes straight through, or through ``round_grad``."""
    check_tensor_args(x, out, stats)
    if out is not None and out.dtype != x.dtype:
        raise ValueError(f"S2FP8 returns x's dtype {x.dtype}, but out has dtype {out.dtype}")
    if out_dtype is not None and out_dtype != x.dtype:
        raise ValueError(f"S2FP8 returns x's dtype {x.dtype}; out_dtype={out_dtype} is not supported")
    call = make_call(spec.fmt, rounding, overflow, subnormals, seed, generator, offset, sr_bits)
    reason = call.fmt.fit_error(torch.float64)
    if reason:
        raise ValueError(f"fmt {call.fmt} cannot be used by S2FP8: {reason}")
    result = S2FP8Stats(x.device, x.numel())

    def run(t, y):
        return run_s2fp8(t, y, spec, call, result.sums, result.params, stats)

    if x.requires_grad and torch.is_grad_enabled():  # (out= was refused for it above)
        return StraightThrough.apply(x, lambda t: run(t, new_output(t, t.dtype)), round_grad), result
    return run(x, out if out is not None else new_output(x, x.dtype)), result


def s2fp8_quantize(x, fmt: Union[Format, S2FP8, str] = "float8_e5m2", *,
                   log_max: Optional[float] = None, rounding: str = "nearest",
                   overflow: Optional[str] = None, subnormals: Optional[bool] = None,
                   seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
                   offset: int = 0, sr_bits: int = 32, stats: Optional[Stats] = None, out=None,
                   truncate_grad: bool = False):
    """Truncate ``x`` with S2FP8 and return ``(x', S2FP8Stats)``; x' has x's shape and dtype.

    Args:
        x: torch tensor (CPU or CUDA) or numpy array of float16, bfloat16 (torch), float32 or
            float64; never modified (unless it is also ``out``).
        fmt: the 8-bit format Y is rounded to (default float8_e5m2; any format that fits
            float64), or a :class:`lowfp.S2FP8`, which also gives ``log_max``.
        log_max: the maximum of log2|Y| (default 15).
        rounding, overflow, subnormals, seed, generator, offset, sr_bits: how Y is rounded, as
            in :func:`lowfp.quantize`.
        stats: a :class:`lowfp.Stats` that accumulates the overflow/underflow/nan counts of Y's
            rounding (an infinite x counts as an overflow, a NaN as a nan).
        out: write x' here (same shape and dtype).
        truncate_grad: the gradient passes straight through (default) or, when True, is itself
            truncated by S2FP8 with its own statistics (round to nearest).
    """
    if isinstance(fmt, S2FP8):
        if log_max is not None and float(log_max) != fmt.log_max:
            raise ValueError(f"log_max={log_max} conflicts with fmt={fmt}")
        spec = fmt
    else:
        spec = S2FP8(to_format(fmt, "fmt"), 15.0 if log_max is None else log_max)
    if not isinstance(truncate_grad, bool):
        raise TypeError(f"truncate_grad must be a bool, got {type(truncate_grad).__name__}")
    kwargs = dict(overflow=overflow, subnormals=subnormals, seed=seed, generator=generator,
                  offset=offset, sr_bits=sr_bits, stats=stats)
    if isinstance(x, np.ndarray):
        if truncate_grad:
            raise ValueError("truncate_grad applies to torch tensors only")
        xt = numpy_as_tensor(x, "x")
        if out is not None:
            results = []
            into_numpy_out(out, lambda t: results.append(apply_s2fp8(xt, spec, rounding, out=t,
                                                                     **kwargs)[1]))
            return out, results[0]
        y, result = apply_s2fp8(xt, spec, rounding, **kwargs)
        return y.numpy(), result
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    truncate = (lambda grad: apply_s2fp8(grad, spec, "nearest")[0]) if truncate_grad else None
    return apply_s2fp8(x, spec, rounding, out=out, round_grad=truncate, **kwargs)
