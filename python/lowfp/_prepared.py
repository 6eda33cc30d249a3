"""Prepared roundings: one interface for applying a checked precision many times.

A prepared rounding holds what one native call needs besides the buffers: the kernel's request,
built once (by keyword, in C++) when its precision, rounding mode, overflow policy, sr_bits,
dtypes and backend first passed every check. ``prepared.round(x, counts)`` is then one native
call. ``lowfp.quantize`` remembers them per argument set, the emulation's ``Rounder`` per dtype
and backend, and ``emulate_gemms`` per operand format:

- :class:`PreparedFormat`: a plain format (``lowfp._C.PreparedQuantize``);
- :class:`PreparedS2FP8`: S2FP8 (one native call computes each tensor's statistics and rounds
  it with them);
- ``lowfp.scaled.quantize.PreparedScaled``: a scaled format (``lowfp._C.PreparedScaled``).
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from . import _C, backends
from ._memory import new_output
from ._native import DTYPE_CODES, remembered_seed
from .stats import Stats

__all__ = ["Prepared", "PreparedFormat", "PreparedS2FP8"]


class Prepared:
    """A rounding whose arguments passed every check once. ``stats_types``: the Stats classes
    whose counts its kernel adds to directly."""

    __slots__ = ()
    stats_types: tuple = (Stats,)

    def round(self, x: torch.Tensor, counts: Optional[torch.Tensor],
              generator: Optional[torch.Generator] = None, out: Optional[torch.Tensor] = None,
              seed: Optional[int] = None, offset: int = 0) -> Optional[torch.Tensor]:
        """x (eager, plain, of the prepared dtype and backend) rounded into a new tensor or
        ``out`` (checked by the caller), adding to ``counts`` (a stats_types' counts or None),
        stochastic rounding keyed by ``seed`` (remembered_seed) from Philox block ``offset`` (an
        int in [0, 2**64), checked by the caller); None, with nothing drawn or written, when the
        call needs the full path."""
        raise NotImplementedError


class PreparedFormat(Prepared):
    """A plain format's rounding: the kernel's prepared request (``PreparedQuantize`` of lowfp._C
    or lowfp._C_cuda), the result's dtype, and whether it draws a stochastic seed."""

    __slots__ = ("request", "dtype", "stochastic")

    def __init__(self, request, dtype: torch.dtype, stochastic: bool):
        self.request, self.dtype, self.stochastic = request, dtype, stochastic

    def round(self, x, counts, generator=None, out=None, seed=None, offset=0):
        """One pass over x's memory: x contiguous, or, without out= and for a rounding that does
        not depend on an element's index (not stochastic), densely laid out in another order
        (channels-last, a transpose, attention's heads), whose strides the result takes (as
        torch.empty_like gives them). Stochastic rounding draws by logical index, so any other
        layout takes the full path."""
        if not x.is_contiguous() and (out is not None or self.stochastic or not backends.is_dense(x)):
            return None
        seed = remembered_seed(self.stochastic, generator, seed)
        if seed is None:
            return None
        if backends.ready_on_cpu(x):
            device, stream = -1, 0
        else:
            _, device, stream = backends.native(x, "x")
        y = new_output(x, self.dtype, torch.preserve_format) if out is None else out  # (x's layout)
        self.request(x.data_ptr(), y.data_ptr(), x.numel(), seed, offset,
                     0 if counts is None else counts.data_ptr(), device, stream)
        return y


_scratch = threading.local()  # each CPU thread's S2FP8 statistics, which the caller does not get
_S2FP8_SCRATCH_WORDS = _C.S2FP8_SUM_SIZE + 4  # the sums (int64) and the parameters (float64)


class PreparedS2FP8(Prepared):
    """S2FP8's rounding (docs/design.md §4): the native call's format and rounding arguments
    (``format_args`` of its 8-bit format), ``log_max``, and whether it draws a stochastic seed.
    The statistics, which these calls do not return, go to a scratch buffer: on the CPU the same
    one each call of a thread (the kernel writes every entry before it reads any), on a GPU a
    zeroed new one (its reduction adds into it)."""

    __slots__ = ("args", "log_max", "stochastic")

    def __init__(self, args: tuple, log_max: float, stochastic: bool):
        self.args, self.log_max, self.stochastic = args, log_max, stochastic

    def round(self, x, counts, generator=None, out=None, seed=None, offset=0):
        """x (contiguous) rounded into a new tensor of x's dtype or ``out``; None for any other
        layout (the statistics group consecutive elements in logical order) or a generator the
        per-thread draw does not cover."""
        if not x.is_contiguous():
            return None
        seed = remembered_seed(self.stochastic, generator, seed)
        if seed is None:
            return None
        module, device, stream = backends.native(x, "x")
        # One buffer: the int64 sums, then the 4 float64 parameters (8-byte words each)
        if x.is_cpu:
            scratch = getattr(_scratch, "buffer", None)
            if scratch is None:
                scratch = _scratch.buffer = torch.empty(_S2FP8_SCRATCH_WORDS, dtype=torch.int64)
        else:  # (zeroed by one fill: float64 zeros are all-zero words)
            scratch = torch.zeros(_S2FP8_SCRATCH_WORDS, dtype=torch.int64, device=x.device)
        sums_at = scratch.data_ptr()
        y = new_output(x, x.dtype) if out is None else out
        module.s2fp8(x.data_ptr(), DTYPE_CODES[x.dtype], y.data_ptr(), x.numel(), *self.args, seed, offset,
                     self.log_max, sums_at, sums_at + 8 * _C.S2FP8_SUM_SIZE,
                     0 if counts is None else counts.data_ptr(), device, stream)
        return y
