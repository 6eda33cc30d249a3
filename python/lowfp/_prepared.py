"""Prepared roundings: one interface for applying a checked precision many times.

A prepared rounding holds what one native call needs besides the buffers: the kernel's request,
built once (by keyword, in C++) when its precision, rounding mode, overflow policy, sr_bits,
dtypes and backend first passed every check. ``prepared.round(x, counts)`` is then one native
call. ``lowfp.quantize`` remembers them per argument set, the emulation's ``Rounder`` per dtype
and backend, and ``emulate_gemms`` per operand format:

- :class:`PreparedFormat`: a plain format (``lowfp._C.PreparedQuantize``);
- ``lowfp.scaled.quantize.PreparedScaled``: a scaled format (``lowfp._C.PreparedScaled``).

S2FP8 has none: its grid follows each tensor's statistics, which its operator computes.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import backends
from ._memory import new_output
from ._native import remembered_seed
from .stats import Stats

__all__ = ["Prepared", "PreparedFormat"]


class Prepared:
    """A rounding whose arguments passed every check once. ``stats_types``: the Stats classes
    whose counts its kernel adds to directly."""

    __slots__ = ()
    stats_types: tuple = (Stats,)

    def round(self, x: torch.Tensor, counts: Optional[torch.Tensor],
              generator: Optional[torch.Generator] = None,
              out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """x (eager, plain, of the prepared dtype and backend) rounded into a new tensor or
        ``out`` (checked by the caller), adding to ``counts`` (a stats_types' counts or None);
        None, with nothing drawn or written, when the call needs the full path."""
        raise NotImplementedError


class PreparedFormat(Prepared):
    """A plain format's rounding: the kernel's prepared request (``PreparedQuantize`` of lowfp._C
    or lowfp._C_cuda), the result's dtype, and whether it draws a stochastic seed."""

    __slots__ = ("request", "dtype", "stochastic")

    def __init__(self, request, dtype: torch.dtype, stochastic: bool):
        self.request, self.dtype, self.stochastic = request, dtype, stochastic

    def round(self, x, counts, generator=None, out=None):
        """One pass over x's memory: x contiguous, or, without out= and for a rounding that does
        not depend on an element's index (not stochastic), densely laid out in another order
        (channels-last, a transpose, attention's heads), whose strides the result takes (as
        torch.empty_like gives them). Stochastic rounding draws by logical index, so any other
        layout takes the full path."""
        if x.is_contiguous():
            layout = torch.contiguous_format
        elif out is None and not self.stochastic and backends.is_dense(x):
            layout = torch.preserve_format
        else:
            return None
        if self.stochastic:
            seed = remembered_seed(True, generator)
            if seed is None:
                return None
        else:
            seed = 0
        if x.is_cpu and x.layout is torch.strided and not x.is_nested:  # backends.native's CPU case
            backends.follow_torch_threads()
            device, stream = -1, 0
        else:
            _, device, stream = backends.native(x, "x")
        y = new_output(x, self.dtype, layout) if out is None else out
        self.request(x.data_ptr(), y.data_ptr(), x.numel(), seed, 0,
                     0 if counts is None else counts.data_ptr(), device, stream)
        return y
