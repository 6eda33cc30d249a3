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


def new_output(like: torch.Tensor, dtype: torch.dtype,
               memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """An uninitialised tensor of like's shape and device and of ``dtype`` (contiguous, or as
    torch.empty_like's ``memory_format`` says), backed by huge pages where that helps.
    (empty_like: half the time of torch.empty(shape, ...) on a small tensor, whose shape
    argument torch parses on each call.)"""
    nbytes = like.numel() * dtype.itemsize  # (the size first: most outputs are small)
    if dtype is like.dtype and (memory_format is torch.preserve_format or like.is_contiguous()):
        t = torch.empty_like(like)  # (fewer arguments to parse: preserve_format keeps like's layout)
        if nbytes < _MIN_BYTES:
            return t
    else:
        t = torch.empty_like(like, dtype=dtype, memory_format=memory_format)
    if nbytes >= _MIN_BYTES and _madvise is not None and t.is_cpu:
        start = (t.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
        end = (t.data_ptr() + nbytes) & ~(_HUGE_PAGE - 1)
        if end > start:
            _madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: failure changes nothing
    return t
