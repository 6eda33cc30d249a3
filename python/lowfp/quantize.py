"""``lowfp.quantize``: round tensors and arrays to a format (docs/design.md §3)."""

from __future__ import annotations

from typing import Callable, Optional, Union

import numpy as np
import torch

from . import backends
from ._checks import check_choice, is_dtype_in
from ._memory import new_output
from ._native import (ALLOWED_DTYPES, DTYPE_CODES, NUMPY_TO_TORCH, ROUNDING_MODES, NativeCall,
                      check_tensor_args, check_writable, draw_seed, into_numpy_out, make_call,
                      numpy_as_tensor, result_dtype, run_quantize)
from ._straight_through import StraightThrough
from .formats import Format, S2FP8, to_precision
from .s2fp8 import apply_s2fp8
from .stats import Stats

__all__ = ["quantize", "quantize_", "ROUNDING_MODES"]

Tensorish = Union[torch.Tensor, np.ndarray]


def gradient_rounding(grad_fmt, grad_rounding: str) -> Optional[Callable]:
    """What a straight-through rounding does to the gradient: nothing (None), or round it to
    ``grad_fmt`` (a format or S2FP8) by ``grad_rounding``. Checked here, used in backward."""
    if grad_fmt is None:
        return None
    grad_fmt = to_precision(grad_fmt, "grad_fmt")
    check_choice(grad_rounding, ROUNDING_MODES, "grad_rounding")
    return lambda grad: quantize(grad, grad_fmt, grad_rounding)


def _quantize_numpy(x: np.ndarray, fmt, rounding, out, out_dtype, kwargs):
    xt = numpy_as_tensor(x, "x")
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        np_dtype = np.dtype(out_dtype)
        if np_dtype not in NUMPY_TO_TORCH:
            raise TypeError(f"out_dtype must be float16, float32 or float64, got {out_dtype}")
        out_dtype = NUMPY_TO_TORCH[np_dtype]
    if out is None:
        return quantize(xt, fmt, rounding, out_dtype=out_dtype, **kwargs).numpy()
    return into_numpy_out(out, lambda t: quantize(xt, fmt, rounding, out=t, out_dtype=out_dtype,
                                                  **kwargs))


def quantize(x: Tensorish, fmt: Union[Format, str], rounding: str = "nearest", *,
             overflow: Optional[str] = None, subnormals: Optional[bool] = None,
             seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
             offset: int = 0, sr_bits: int = 32, stats: Optional[Stats] = None,
             out: Optional[Tensorish] = None, out_dtype: Optional[torch.dtype] = None,
             grad_fmt: Optional[Union[Format, str]] = None,
             grad_rounding: str = "nearest") -> Tensorish:
    """Round every element of ``x`` to ``fmt`` and return the result as a new tensor/array.

    Args:
        x: torch tensor or numpy array of float16, bfloat16 (torch only), float32 or float64,
            any shape or layout; never modified (unless it is also ``out``).
        fmt: a :class:`lowfp.Format` or its string (``"fp(4,3,4)"``, ``"float8_e4m3fn"``), or a
            :class:`lowfp.S2FP8` (``"s2fp8"``): x is then truncated with its own statistics
            (the result keeps x's dtype; :func:`lowfp.s2fp8_quantize` also returns them).
        rounding: ``"nearest"`` (ties to even), ``"nearest_away"``, ``"toward_zero"``, ``"up"``,
            ``"down"`` or ``"stochastic"``.
        overflow, subnormals: override the format's overflow policy / subnormal setting.
        seed, generator, offset, sr_bits: stochastic rounding. Element ``i`` uses Philox4x32-10
            word ``i % 4`` of block ``offset + i // 4`` under key ``seed``; ``seed=None`` draws one
            from ``generator`` (default: torch's default generator, so ``torch.manual_seed``
            makes runs reproducible); pass one of the two, not both. ``sr_bits`` random bits
            decide each rounding.
        stats: a :class:`lowfp.Stats` that accumulates overflow/underflow/nan/numel counts.
        out: write the result here (same shape; dtype ``out_dtype`` if given).
        out_dtype: result dtype. float16/bfloat16 inputs are rounded in float32 and returned
            in their own dtype when the format's values fit it; otherwise pass a wider one.
        grad_fmt, grad_rounding: the gradient passes straight through, or is rounded to
            ``grad_fmt`` with ``grad_rounding`` when given.
    """
    if isinstance(x, np.floating):  # numpy scalar in, numpy scalar out (as numpy ufuncs do)
        if out is not None:
            raise TypeError("out= is not supported for numpy scalar x")
        return quantize(np.asarray(x), fmt, rounding, overflow=overflow, subnormals=subnormals,
                        seed=seed, generator=generator, offset=offset, sr_bits=sr_bits,
                        stats=stats, out_dtype=out_dtype)[()]
    if isinstance(x, np.ndarray):
        if grad_fmt is not None:
            raise ValueError("grad_fmt applies to torch tensors only (numpy arrays have no gradients)")
        kwargs = dict(overflow=overflow, subnormals=subnormals, seed=seed, generator=generator,
                      offset=offset, sr_bits=sr_bits, stats=stats)
        return _quantize_numpy(x, fmt, rounding, out, out_dtype, kwargs)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    fmt = to_precision(fmt, "fmt")
    if isinstance(fmt, S2FP8):
        round_grad = gradient_rounding(grad_fmt, grad_rounding)
        return apply_s2fp8(x, fmt, rounding, overflow=overflow, subnormals=subnormals, seed=seed,
                           generator=generator, offset=offset, sr_bits=sr_bits, stats=stats,
                           out=out, out_dtype=out_dtype, round_grad=round_grad)[0]
    check_tensor_args(x, out, stats)
    call = make_call(fmt, rounding, overflow, subnormals, seed, generator, offset, sr_bits)
    dtype = result_dtype(x, call.fmt, out, out_dtype)
    round_grad = gradient_rounding(grad_fmt, grad_rounding)
    if x.requires_grad and torch.is_grad_enabled():  # (out= was refused for it above)
        return StraightThrough.apply(
            x, lambda t: run_quantize(t, new_output(t, dtype), call, stats), round_grad)
    y = out if out is not None else new_output(x, dtype)
    return run_quantize(x, y, call, stats)


def quantize_(x: Tensorish, fmt: Union[Format, str], rounding: str = "nearest", **kwargs) -> Tensorish:
    """In-place :func:`quantize`: rounds ``x`` in its own dtype and returns it."""
    for bad in ("out", "out_dtype", "grad_fmt"):
        if bad in kwargs:
            raise TypeError(f"quantize_() does not take {bad}=")
    if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
        raise ValueError("quantize_() cannot run in place on a tensor that requires grad; "
                         "use lowfp.quantize or torch.no_grad()")
    if isinstance(x, torch.Tensor):
        check_writable(x, "x")
    return quantize(x, fmt, rounding, out=x, **kwargs)


class Rounder:
    """A precision, rounding mode and overflow policy checked once and applied many times.

    The emulation runtime rounds every tensor of every training step; validating arguments on each
    of those calls would cost more than the rounding of a small tensor. ``rounder(x, stats)``
    returns a new tensor with x's shape, dtype and (dense) layout, adding its counts to ``stats``
    (a :class:`lowfp.Stats` on x's device, or None). No autograd.
    """

    def __init__(self, precision, rounding: str = "nearest", overflow: Optional[str] = None):
        self.precision = to_precision(precision, "precision")
        check_choice(rounding, ROUNDING_MODES, "rounding")
        self.rounding = rounding
        self.overflow = overflow
        fmt = self.precision.fmt if isinstance(self.precision, S2FP8) else self.precision
        self._call = make_call(fmt, rounding, overflow, None, 0, None, 0, 32)
        self._args = self._call.args()
        self._fits: dict = {}

    def _check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in self._fits:  # (None: it fits)
            reason = None
            if not is_dtype_in(dtype, DTYPE_CODES):
                reason = f"tensors of dtype {dtype} cannot be rounded (allowed: {ALLOWED_DTYPES})"
            elif isinstance(self.precision, Format):
                reason = self._call.fmt.fit_error(dtype)
                if reason:
                    reason = f"{self.precision} does not fit {dtype} tensors ({reason})"
            self._fits[dtype] = reason
        reason = self._fits[dtype]
        if reason:
            raise ValueError(reason)

    def __call__(self, x: torch.Tensor, stats: Optional[Stats] = None) -> torch.Tensor:
        self._check_dtype(x.dtype)
        if isinstance(self.precision, S2FP8):
            with torch.no_grad():
                return apply_s2fp8(x, self.precision, self.rounding, overflow=self.overflow,
                                   stats=stats)[0]
        if not (x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))):
            x = x.contiguous()
        y = torch.empty_like(x)  # same dense strides: element i of both buffers is the same element
        args = self._args
        if self.rounding == "stochastic":
            args = NativeCall(self._call.fmt, self._call.rounding, 32, draw_seed(), 0).args()
        code = DTYPE_CODES[x.dtype]
        counts = stats.counts.data_ptr() if stats is not None else 0
        mod, device, stream = backends.native(x, "x")
        mod.quantize(x.data_ptr(), code, y.data_ptr(), code, x.numel(), *args, counts, device, stream)
        return y

    def __repr__(self) -> str:
        return f"Rounder({self.precision}, {self.rounding!r}, overflow={self.overflow!r})"
