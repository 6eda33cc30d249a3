"""GEMMs with emulated accumulation (docs/design.md §10): ``lowfp.Accumulate`` says how each
output element's products are summed (accumulator format, rounding, order, compensation, product
format) and ``lowfp.gemm(a, b, accumulate=...)`` computes C = A·B so, bit for bit the same on the
CPU and a GPU, whatever the kernel's tiling.

>>> import torch, lowfp
>>> a, b = torch.randn(4, 4096), torch.randn(4096, 3)
>>> acc = lowfp.Accumulate("fp(8,13,0)", order="blocked", block=128)   # ~14-bit sums, promoted
>>> c = lowfp.gemm(a, b, accumulate=acc)
"""

from __future__ import annotations

import functools
import math
from typing import Dict, Optional, Union

import torch

from . import _C
from ._checks import check_choice, check_int
from ._native import ROUNDING_MODES, stochastic_seed
from .backends import native
from .formats import Format, to_format
from .stats import Stats

__all__ = ["Accumulate", "AccumulateStats", "gemm"]

ORDERS = ("sequential", "pairwise", "blocked")
OPERAND_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLOAT32 = Format(8, 23, 0, specials="ieee")


class Accumulate:
    """How a GEMM sums each output element's K products (docs/design.md §10).

    Args:
        fmt: the accumulator format (a lowfp format of at most 19 mantissa bits, within
            float32's range), or ``"float32"``: torch's own float32 GEMM, whose order of
            additions torch does not specify.
        order: ``"sequential"`` (s_0 = +0, s_k = round(s_{k-1} + p_k) for k = 1..K),
            ``"pairwise"`` (a tree: round(p_k) at the leaves, round(left + right) at the nodes,
            each left subtree holding a power of two of leaves) or ``"blocked"`` (blocks of
            ``block`` products summed sequentially, each block's sum added to an ``outer`` sum
            rounded to nearest: "promotion every block").
        block: products per block (``order="blocked"`` only).
        rounding: the accumulator's rounding mode (lowfp.ROUNDING_MODES); stochastic rounding
            takes Philox words by output element and addition (design §10).
        compensated: Kahan's compensated summation in the accumulator format (sequential and
            blocked orders): y = round(p - c), t = round(s + y), c = round(round(t - s) - y).
        product: a format the exact products are first rounded to (nearest), or None.
        outer: the outer sum's format of the blocked order (default float32).
        overflow: the accumulator's overflow policy (default: the format's).
        sr_bits: random bits per stochastic rounding (1 to 32).
    """

    __slots__ = ("fmt", "order", "block", "rounding", "compensated", "product", "outer", "overflow",
                 "sr_bits")

    def __init__(self, fmt: Union[Format, str], order: str = "sequential", block: Optional[int] = None,
                 rounding: str = "nearest", compensated: bool = False,
                 product: Union[Format, str, None] = None, outer: Union[Format, str] = FLOAT32,
                 overflow: Optional[str] = None, sr_bits: int = 32):
        self.fmt = None if fmt == "float32" else to_format(fmt, "fmt")
        check_choice(order, ORDERS, "order")
        check_choice(rounding, ROUNDING_MODES, "rounding")
        if not isinstance(compensated, bool):
            raise TypeError(f"compensated must be a bool, got {compensated!r}")
        if order == "blocked":
            if block is None:
                raise ValueError("order='blocked' needs block= (products per block)")
            block = check_int(block, "block")
            if block < 1:
                raise ValueError(f"block must be at least 1, got {block}")
        elif block is not None:
            raise ValueError(f"block= goes with order='blocked', not order={order!r}")
        if compensated and order == "pairwise":
            raise ValueError("compensated accumulation is sequential or blocked, not pairwise")
        sr_bits = check_int(sr_bits, "sr_bits")
        if not 1 <= sr_bits <= 32:
            raise ValueError(f"sr_bits must be between 1 and 32, got {sr_bits}")
        self.order, self.block, self.rounding, self.compensated = order, block, rounding, compensated
        self.product = None if product is None else to_format(product, "product")
        self.outer = to_format(outer, "outer")
        self.overflow = overflow
        self.sr_bits = sr_bits
        if self.fmt is not None:
            if overflow is not None:
                check_choice(overflow, ("saturate", "inf", "nan"), "overflow")
            if self.fmt.m > _C.ACCUMULATE_MAX_MANTISSA:
                raise ValueError(f"fmt: an accumulator format has at most {_C.ACCUMULATE_MAX_MANTISSA} "
                                 f"mantissa bits (exact stochastic rounding from a float64 sum), got "
                                 f"{self.fmt}")
            for name, f in (("fmt", self.fmt), ("product", self.product), ("outer", self.outer)):
                if f is not None and not f.fits(torch.float32):
                    raise ValueError(f"{name}: {f} does not fit float32's range")

    @property
    def is_torch(self) -> bool:
        """Whether this is torch's float32 GEMM (``fmt="float32"``)."""
        return self.fmt is None

    def _key(self):
        return (self.fmt, self.order, self.block, self.rounding, self.compensated, self.product,
                self.outer, self.overflow, self.sr_bits)

    def __eq__(self, other) -> bool:
        return isinstance(other, Accumulate) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        parts = [repr("float32" if self.fmt is None else str(self.fmt)), f"order={self.order!r}"]
        if self.block is not None:
            parts.append(f"block={self.block}")
        if self.rounding != "nearest":
            parts.append(f"rounding={self.rounding!r}")
        if self.compensated:
            parts.append("compensated=True")
        if self.product is not None:
            parts.append(f"product={str(self.product)!r}")
        if self.order == "blocked" and self.outer != FLOAT32:
            parts.append(f"outer={str(self.outer)!r}")
        return "Accumulate(" + ", ".join(parts) + ")"


class AccumulateStats(Stats):
    """:class:`lowfp.Stats` for accumulation: the roundings' overflow, underflow and NaN counts and
    their number (``numel``, products and outer sums included), plus ``swamped``: additions of a
    nonzero addend that left the sum as it was."""

    def __init__(self, device="cpu"):
        self.counts = torch.zeros(5, dtype=torch.int64, device=device)

    swamped = property(lambda self: int(self.counts[4]))

    def as_dict(self) -> Dict[str, int]:
        return dict(zip(("overflow", "underflow", "nan", "numel", "swamped"), self.counts.tolist()))

    def __repr__(self) -> str:
        return "AccumulateStats(" + ", ".join(f"{k}={v}" for k, v in self.as_dict().items()) + ")"


def _spec(mod, f: Format):
    return mod.FormatSpec(e=f.e, m=f.m, b=f.b, specials=mod.Specials.__members__[f.specials],
                          subnormals=f.subnormals)


@functools.lru_cache(maxsize=256)
def _prepared(mod, acc: Accumulate, dtype: torch.dtype):
    """The native request of ``acc`` for ``dtype`` operands, built once by keyword."""
    overflow = acc.fmt.overflow if acc.overflow is None else acc.overflow
    return mod.PreparedAccumulate(
        accumulator=_spec(mod, acc.fmt), overflow=mod.Overflow.__members__[overflow],
        rounding=mod.Rounding.__members__[acc.rounding], sr_bits=acc.sr_bits,
        order=mod.AccumulateOrder.__members__[acc.order], block=acc.block or 0,
        compensated=acc.compensated, product=None if acc.product is None else _spec(mod, acc.product),
        product_overflow=mod.Overflow.__members__[(acc.product or acc.fmt).overflow],
        outer=_spec(mod, acc.outer), outer_overflow=mod.Overflow.__members__[acc.outer.overflow],
        dtype=mod.DType.__members__[str(dtype)[6:]])


def gemm(a: torch.Tensor, b: torch.Tensor, accumulate: Optional[Accumulate] = None, *,
         seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
         stats: Optional[AccumulateStats] = None) -> torch.Tensor:
    """C = A·B (float32) with each output element's products summed as ``accumulate`` says
    (docs/design.md §10); None or ``Accumulate("float32")``: ``torch.matmul`` in float32.

    a: (..., M, K), b: (..., K, N) (batch dims broadcast as torch.matmul's), float32, bfloat16
    or float16 tensors of one dtype on one device (their products are exact in float64).
    seed/generator: stochastic rounding's Philox key (default: drawn from torch's generator).
    stats: an :class:`AccumulateStats` the roundings' counts are added to.
    """
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"a and b must be tensors, got {type(a).__name__} and {type(b).__name__}")
    if accumulate is not None and not isinstance(accumulate, Accumulate):
        raise TypeError(f"accumulate must be a lowfp.Accumulate or None, got {type(accumulate).__name__}")
    if a.dtype not in OPERAND_DTYPES or b.dtype != a.dtype:
        raise TypeError(f"a and b must share a dtype of torch.float32, torch.bfloat16 or torch.float16, "
                        f"got {a.dtype} and {b.dtype}")
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(f"a and b must have at least 2 dims, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"a's last dim ({a.shape[-1]}) must equal b's second-to-last ({b.shape[-2]})")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")
    if stats is not None and not isinstance(stats, AccumulateStats):
        raise TypeError(f"stats must be a lowfp.AccumulateStats or None, got {type(stats).__name__}")
    if accumulate is None or accumulate.is_torch:
        return torch.matmul(a.float(), b.float())
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    (m, k), n = a.shape[-2:], b.shape[-1]
    count = math.prod(batch)
    a3 = a.expand(*batch, m, k).reshape(count, m, k)
    b3 = b.expand(*batch, k, n).reshape(count, k, n)
    mod, device, stream = native(a3, "a")
    c = torch.empty(*batch, m, n, dtype=torch.float32, device=a.device)
    seed = stochastic_seed(seed, generator) if accumulate.rounding == "stochastic" else 0
    if stats is not None and stats.device != a.device:
        raise ValueError(f"stats lives on {stats.device}, the operands on {a.device}")
    if c.numel():
        _prepared(mod, accumulate, a.dtype)(
            a3.data_ptr(), b3.data_ptr(), c.data_ptr(), a3.shape[0], m, n, k, tuple(a3.stride()),
            tuple(b3.stride()), seed, 0, 0 if stats is None else stats.counts.data_ptr(), device, stream)
    return c
