"""Output allocation for the CPU path.

A fresh result buffer is mostly page faults: on a 2-core VM, first-touching 64 MB costs more than
rounding it. For buffers lowfp allocates itself (never for a user's out=), ask Linux for
transparent huge pages before the kernel first writes them (as PyTorch's THP_MEM_ALLOC_ENABLE
does for its own allocator): 512 times fewer faults. Where madvise is unavailable this is a plain
torch.empty.
"""

from __future__ import annotations

import ctypes
import sys

import torch

_HUGE_PAGE = 1 << 21
_MIN_BYTES = 2 * _HUGE_PAGE
_MADV_HUGEPAGE = 14

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty(shape, dtype, device), backed by huge pages where that helps."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if _madvise is not None and device.type == "cpu":
        nbytes = t.numel() * t.element_size()
        if nbytes >= _MIN_BYTES:
            start = (t.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
            end = (t.data_ptr() + nbytes) & ~(_HUGE_PAGE - 1)
            if end > start:
                _madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: failure changes nothing
    return t
