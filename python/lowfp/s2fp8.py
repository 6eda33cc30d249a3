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

from typing import Optional, Union

import numpy as np
import torch

from ._native import into_numpy_out, numpy_as_tensor
from .formats import Format, S2FP8, as_text, to_format, to_precision
from .quantize import round_tensor
from .stats import S2FP8Stats, Stats

__all__ = ["S2FP8", "S2FP8Stats", "s2fp8_quantize"]


@torch.compiler.assume_constant_result  # under torch.compile: a constant string
def _spec(fmt, log_max) -> str:
    """The S2FP8 precision (as its string) that s2fp8_quantize's fmt and log_max describe."""
    if isinstance(fmt, str):
        fmt = to_precision(fmt, "fmt")
    if isinstance(fmt, S2FP8):
        if log_max is not None and float(log_max) != fmt.log_max:
            raise ValueError(f"log_max={log_max} conflicts with fmt={fmt}")
        return str(fmt)
    return str(S2FP8(to_format(fmt, "fmt"), 15.0 if log_max is None else log_max))


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
    # (a format built inside code torch.compile traces reaches _spec as text)
    spec = _spec(as_text(fmt) if torch.compiler.is_compiling() else fmt, log_max)
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
            into_numpy_out(out, lambda t: results.append(round_tensor(xt, spec, rounding, out=t,
                                                                      **kwargs)[1]))
            return out, results[0]
        y, result = round_tensor(xt, spec, rounding, **kwargs)
        return y.numpy(), result
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    return round_tensor(x, spec, rounding, out=out, grad_fmt=spec if truncate_grad else None,
                        **kwargs)
