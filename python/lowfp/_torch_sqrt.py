"""torch's own float32 square root for lowfp's CPU Adam step.

torch.optim.Adam divides by ``exp_avg_sq.sqrt()``. On the CPU torch takes that square root from
MKL's vector math library (``vmsSqrt``, high-accuracy mode), whose results are within one ulp but
not always correctly rounded (about one element in six differs from ``math.sqrt``). To step as
torch.optim steps bit for bit, the CPU Adam kernel takes its square roots from the same routine:
it is looked up in torch's own library and used only after it has reproduced ``torch.sqrt`` on a
probe of 65536 values. Where torch has no such routine, or it does not reproduce ``torch.sqrt``,
the kernel keeps the correctly rounded square root, which is then what ``torch.sqrt`` computes
(or the closest lowfp can do).
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np
import torch

from . import _C

# The mode ATen passes to MKL's VML (aten/src/ATen/cpu/vml.h): VML_HA | VML_ERRMODE_IGNORE |
# VML_FTZDAZ_OFF.
_VML_MODE = 0x2 | 0x100 | 0x140000
_LIBRARIES = ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll")


def _vml_sqrt():
    """(ctypes function, address) of torch's vmsSqrt, or None."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in _LIBRARIES:
        path = os.path.join(lib_dir, name)
        if not os.path.exists(path):
            continue
        try:
            fn = ctypes.CDLL(path).vmsSqrt
        except (OSError, AttributeError):
            return None
        fn.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn.restype = None
        return fn, ctypes.cast(fn, ctypes.c_void_p).value
    return None


def _probe() -> np.ndarray:
    """65536 positive float32 values: every 2^-16-spaced significand over four binades, plus
    values near the top and bottom of the range."""
    sig = 1.0 + np.arange(16384, dtype=np.float64) / 16384.0
    vals = np.concatenate([sig * 2.0**e for e in (-3, 0, 1, 40)])
    return vals.astype(np.float32)


@functools.lru_cache(maxsize=None)
def use_torch_sqrt() -> bool:
    """Hands torch's float32 square root to lowfp's CPU Adam step when it reproduces
    torch.sqrt; returns whether it did. Runs once per process."""
    found = _vml_sqrt()
    if found is None:
        return False
    fn, address = found
    x = _probe()
    theirs = torch.from_numpy(x).sqrt().numpy()
    ours = np.empty_like(x)
    fn(x.size, x.ctypes.data, ours.ctypes.data, _VML_MODE)
    if not np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)):
        return False
    _C.set_cpu_sqrt(address, _VML_MODE)
    return True
