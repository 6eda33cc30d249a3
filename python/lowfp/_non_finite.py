"""The non-finite check's kernels, below the loss scaler and the operators (docs/design.md §7):
lowfp's kernel for a dense floating tensor on the CPU or CUDA, torch's reductions otherwise."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from . import _C, backends
from ._native import DTYPE_CODES


def check_non_finite(t: torch.Tensor, out: Optional[torch.Tensor],
                     count_into: Optional[torch.Tensor]) -> torch.Tensor:
    """Whether real tensor t holds a NaN or an infinity (a bool on t's device, not waited for),
    written to ``out`` and added to ``count_into`` when they are given."""
    if t.dtype in DTYPE_CODES and backends.is_plain(t) and backends.is_dense(t) and (t.is_cpu or (
            t.is_cuda and backends.cuda_built())):  # each element alike: read in memory order
        found = torch.empty((), dtype=torch.bool, device=t.device) if out is None else out
        counts = (0, 0) if count_into is None else (count_into.data_ptr(), count_into.numel())
        if t.is_cpu:
            _C.any_non_finite(t.data_ptr(), DTYPE_CODES[t.dtype], t.numel(), found.data_ptr(),
                              *counts)
        else:  # one launch, where the torch path takes four
            module, device, stream = backends.native(t, "t")
            module.any_non_finite(t.data_ptr(), DTYPE_CODES[t.dtype], t.numel(),
                                  found.data_ptr(), *counts, _zeroed_scratch(device, stream),
                                  device, stream)
        return found
    found = non_finite_by_torch(t, out)
    if count_into is not None:
        count_into.add_(found.reshape(()))
    return found


_SCRATCH: Dict[Tuple[int, int], torch.Tensor] = {}


def _zeroed_scratch(device: int, stream: int) -> int:
    """The address of two int32 on CUDA device `device`, zero, that the CUDA any_non_finite
    leaves zero: one pair per stream, as calls on one stream run one after another."""
    scratch = _SCRATCH.get((device, stream))
    if scratch is None:
        scratch = _SCRATCH[(device, stream)] = torch.zeros(2, dtype=torch.int32,
                                                           device=torch.device("cuda", device))
    return scratch.data_ptr()


def non_finite_by_torch(t: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """any_non_finite in four torch calls on any device: one min/max reduction, which propagates
    NaN, then min * 0 != max * 0, which is false exactly when both are finite (inf * 0 is NaN,
    and NaN != anything). out: a one-element bool on t's device that receives it, or None."""
    backends.check_dense(t, "t")
    if t.is_complex():
        t = torch.view_as_real(t)  # not finite when its real or imaginary part is not
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=t.device) if out is None else out.fill_(False)
    low, high = torch.aminmax(t)
    if out is None:
        return torch.ne(low * 0, high * 0)
    torch.ne(low * 0, high * 0, out=out.view(()))  # a 0-d view: ne's result shape, no resize
    return out
