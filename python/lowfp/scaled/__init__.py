"""Scaled formats (docs/design.md §9): per-tensor, per-axis and block scales (MX, NVFP4, FP8).

>>> import torch, lowfp
>>> x = torch.randn(4, 64)
>>> y = lowfp.quantize(x, "mxfp8_e4m3")                  # dequantized: s · q, x's shape and dtype
>>> parts = lowfp.scaled.encode(x, lowfp.scaled.nvfp4)   # q, block scales, tensor scale
>>> tuple(parts.scales.shape)
(4, 4)
"""

from .config import E8M0_RULES, Scaled, named, to_scaled
from .quantize import ScaledParts, ScaledStats, encode, hadamard, hadamard_signs, quantize_scaled
from .gemm import (ACCUMULATE_GEMMS, RECIPES, GemmEmulation, GemmRecipe, PerModule, emulate_gemms,
                   high_precision_ends)

__all__ = ["Scaled", "ScaledStats", "ScaledParts", "encode", "quantize_scaled", "hadamard",
           "hadamard_signs", "named", "to_scaled", "E8M0_RULES", "GemmRecipe", "RECIPES",
           "emulate_gemms", "GemmEmulation", "ACCUMULATE_GEMMS", "PerModule", "high_precision_ends"]

globals().update(named())
__all__ += list(named())
