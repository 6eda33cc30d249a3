"""lowfp: emulated low-precision floating point for PyTorch training loops.

>>> import torch, lowfp
>>> x = torch.tensor([0.1, 1.0, 3.3, 100.0])
>>> lowfp.quantize(x, "fp(4,3,4)")
tensor([ 0.1016,  1.0000,  3.2500, 30.0000])
"""

import torch  # noqa: F401  (before _C: lowfp's kernels then run on torch's OpenMP runtime and threads)

from . import _C
from ._checks import check_int
from . import assign, extra_bits, formats, optim, scaled
from . import backends
from .backends import cuda_built
from .formats import Format, S2FP8, fp
from .scaled import Scaled
from ._native import ROUNDING_MODES, draw_seed
from .quantize import quantize, quantize_
from .s2fp8 import S2FP8Stats, s2fp8_quantize
from .stats import Stats
from .emulate import Emulator, History, emulate
from .scaler import DynamicLossScaler
from .accumulate import Accumulate, AccumulateStats, gemm
from . import nonlinear

# lowfp.formats names the scaled formats too (mxfp8_e4m3, nvfp4, ...), beside the element formats
# lowfp.scaled builds them from (so set here, where both modules exist, not imported there)
for _name, _fmt in scaled.named().items():
    setattr(formats, _name, _fmt)
formats.__all__ += list(scaled.named())
del _name, _fmt

__version__ = "0.1.0"

__all__ = ["Format", "fp", "formats", "extra_bits", "optim", "quantize", "quantize_", "Stats", "ROUNDING_MODES",
           "S2FP8", "S2FP8Stats", "s2fp8_quantize", "Scaled", "scaled",
           "assign", "emulate", "Emulator", "History", "DynamicLossScaler",
           "Accumulate", "AccumulateStats", "gemm", "nonlinear",
           "draw_seed", "cuda_built", "set_num_threads", "get_num_threads", "cpu_kernel"]


def set_num_threads(n: int) -> None:
    """Threads used by lowfp's CPU kernels; 0 (the default) follows torch.get_num_threads().
    Results never depend on it."""
    n = check_int(n, "n")
    if not 0 <= n < 2**31:
        raise ValueError(f"n must be between 0 and 2**31 - 1, got {n}")
    _C.set_num_threads(n)


def cpu_kernel() -> str:
    """The instruction-set level of the CPU kernels lowfp runs: "avx512", "avx2" or "baseline"
    (the best this CPU supports, unless ``LOWFP_CPU_KERNEL``, read when the first CPU kernel
    runs, names another it supports). Results never depend on it."""
    return _C.cpu_kernel()


def get_num_threads() -> int:
    """Threads lowfp's CPU kernels use: set_num_threads's, else torch.get_num_threads()."""
    backends.follow_torch_threads()
    return _C.get_num_threads()
