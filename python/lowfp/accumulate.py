"""GEMMs with emulated accumulation (docs/design.md §10): ``lowfp.Accumulate`` says how each
output element's products are summed (accumulator format, rounding, order, compensation, product
format) and ``lowfp.gemm(a, b, accumulate=...)`` computes C = A·B so, bit for bit the same on the
CPU and a GPU, whatever the kernel's tiling.

>>> import torch, lowfp
>>> a, b = torch.randn(4, 4096), torch.randn(4096, 3)
>>> acc = lowfp.Accumulate("fp(8,13,0,specials='ieee')", order="blocked", block=128)  # 14-bit sums, promoted
>>> c = lowfp.gemm(a, b, accumulate=acc)
"""

from __future__ import annotations

import functools
import math
from typing import Dict, Optional, Union

import torch

from . import _C
from ._checks import check_choice, check_int
from ._native import ROUNDING_MODES, call_seed
from ._dtensor import is_dtensor
from ._ops import lib, philox_key
from .backends import native
from .formats import Format, parse_named_or_call, to_format
from .stats import Stats

__all__ = ["Accumulate", "AccumulateStats", "gemm", "HOPPER_FP8", "DEEPSEEK_V3", "PRESETS"]

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
        group, align_bits: fused groups (sequential and blocked orders, exact products): each
            group of ``group`` consecutive products is added to the sum at once, every term (the
            sum and each product) cut toward zero to a multiple of 2^(E - align_bits), E the
            largest of their exponents (a product's: the sum of its operands'), and the exact sum
            of the cut terms rounded once: how tensor cores align and add (MMA-Sim's model).
        operand_emin: with fused groups, the operands' format's smallest normal exponent: an
            operand below 2^operand_emin is aligned as if its exponent were operand_emin (E4M3
            operands: -6; default float32's, -126).
        product: a format the exact products are first rounded to (nearest), or None.
        outer: the outer sum's format of the blocked order (default float32).
        overflow: the accumulator's overflow policy (default: the format's).
        sr_bits: random bits per stochastic rounding (1 to 32).
    """

    __slots__ = ("fmt", "order", "block", "rounding", "compensated", "product", "outer", "overflow",
                 "sr_bits", "group", "align_bits", "operand_emin", "_text")

    def __init__(self, fmt: Union[Format, str], order: str = "sequential", block: Optional[int] = None,
                 rounding: str = "nearest", compensated: bool = False,
                 product: Union[Format, str, None] = None, outer: Union[Format, str] = FLOAT32,
                 overflow: Optional[str] = None, sr_bits: int = 32, group: Optional[int] = None,
                 align_bits: Optional[int] = None, operand_emin: int = -126):
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
        if (group is None) != (align_bits is None):
            raise ValueError("group and align_bits go together (fused groups)")
        if group is not None:
            group, align_bits = check_int(group, "group"), check_int(align_bits, "align_bits")
            if not 1 <= group <= _C.ACCUMULATE_MAX_GROUP:
                raise ValueError(f"group must be between 1 and {_C.ACCUMULATE_MAX_GROUP}, got {group}")
            if not 1 <= align_bits <= _C.ACCUMULATE_MAX_ALIGN_BITS:
                raise ValueError(f"align_bits must be between 1 and {_C.ACCUMULATE_MAX_ALIGN_BITS}, "
                                 f"got {align_bits}")
            if order == "pairwise" or compensated or self.product is not None:
                raise ValueError("fused groups (group=) add exact products sequentially or in blocks, "
                                 "without compensation")
        operand_emin = check_int(operand_emin, "operand_emin")
        if not -126 <= operand_emin <= 0:
            raise ValueError(f"operand_emin must be between -126 and 0, got {operand_emin}")
        self.group, self.align_bits, self.operand_emin = group, align_bits, operand_emin
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
        self._text = None

    @property
    def is_torch(self) -> bool:
        """Whether this is torch's float32 GEMM (``fmt="float32"``)."""
        return self.fmt is None

    def _key(self):
        return (self.fmt, self.order, self.block, self.rounding, self.compensated, self.product,
                self.outer, self.overflow, self.sr_bits, self.group, self.align_bits, self.operand_emin)

    def __eq__(self, other) -> bool:
        return isinstance(other, Accumulate) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        if self._text is None:  # (what the lowfp::gemm operator takes: made once)
            self._text = self._describe()
        return self._text

    def _describe(self) -> str:
        parts = [repr("float32" if self.fmt is None else str(self.fmt)), f"order={self.order!r}"]
        if self.block is not None:
            parts.append(f"block={self.block}")
        if self.rounding != "nearest":
            parts.append(f"rounding={self.rounding!r}")
        if self.compensated:
            parts.append("compensated=True")
        if self.group is not None:
            parts.append(f"group={self.group}, align_bits={self.align_bits}")
        if self.operand_emin != -126:
            parts.append(f"operand_emin={self.operand_emin}")
        if self.product is not None:
            parts.append(f"product={str(self.product)!r}")
        if self.order == "blocked" and self.outer != FLOAT32:
            parts.append(f"outer={str(self.outer)!r}")
        if self.overflow is not None:
            parts.append(f"overflow={self.overflow!r}")
        if self.sr_bits != 32:
            parts.append(f"sr_bits={self.sr_bits}")
        return "Accumulate(" + ", ".join(parts) + ")"

    @staticmethod
    def parse(text: str) -> "Accumulate":
        """A preset's name (``lowfp.accumulate.PRESETS``: ``"hopper-fp8"``, ``"deepseek-v3"``) or
        the text of a call, as ``repr`` writes it: ``"Accumulate('bfloat16', order='blocked',
        block=64)"``."""
        preset, call = parse_named_or_call(text, PRESETS, "Accumulate", "accumulation",
                                           "\"Accumulate('bfloat16', order='blocked', block=64)\"")
        return preset if preset is not None else Accumulate(*call[0], **call[1])


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
def _prepared(mod, acc: Accumulate):
    """The native request of ``acc`` (float32 operands), built once by keyword."""
    overflow = acc.fmt.overflow if acc.overflow is None else acc.overflow
    return mod.PreparedAccumulate(
        accumulator=_spec(mod, acc.fmt), overflow=mod.Overflow.__members__[overflow],
        rounding=mod.Rounding.__members__[acc.rounding], sr_bits=acc.sr_bits,
        order=mod.AccumulateOrder.__members__[acc.order], block=acc.block or 0,
        compensated=acc.compensated, group=acc.group or 0, align_bits=acc.align_bits or 0,
        operand_emin=acc.operand_emin,
        product=None if acc.product is None else _spec(mod, acc.product),
        product_overflow=mod.Overflow.__members__[(acc.product or acc.fmt).overflow],
        outer=_spec(mod, acc.outer), outer_overflow=mod.Overflow.__members__[acc.outer.overflow])


def gemm(a: torch.Tensor, b: torch.Tensor, accumulate: Optional[Accumulate] = None, *,
         seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
         stats: Optional[AccumulateStats] = None) -> torch.Tensor:
    """C = A·B (float32) with each output element's products summed as ``accumulate`` says
    (docs/design.md §10); None or ``Accumulate("float32")``: ``torch.matmul`` in float32.

    a: (..., M, K), b: (..., K, N) (batch dims broadcast as torch.matmul's), float32, bfloat16
    or float16 tensors of one dtype on one device (their products are exact in float64).
    seed/generator: stochastic rounding's Philox key (default: drawn from torch's generator
    when the GEMM runs, also inside a compiled graph).
    stats: an :class:`AccumulateStats` the roundings' counts are added to.

    One ``lowfp::gemm`` operator (torch.library: torch.compile keeps it in its graph, with a
    fake implementation for shapes). Differentiable: the gradients are the two backward GEMMs,
    dA = dC·Bᵀ and dB = Aᵀ·dC, with the output gradient in the operands' dtype, summed the same
    way (stochastic keys drawn from torch's default generator; ``stats`` counts the forward GEMM
    only), reduced over broadcast batch dims.
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
    if is_dtensor(a) or is_dtensor(b):
        raise TypeError("a and b must be local tensors, got a DTensor: lowfp.gemm sums whole "
                        "reductions, so call it on tensors that hold them (DTensor.to_local() of a "
                        "GEMM's shards, or full_tensor())")
    # (a traced autograd.Function may not read .layout; a traced tensor is strided)
    if not torch.compiler.is_compiling() and (a.layout is not torch.strided or b.layout is not torch.strided):
        raise ValueError(f"a and b must be dense (strided) tensors, got {a.layout} and {b.layout}")
    if stats is not None and stats.device != a.device:
        raise ValueError(f"stats lives on {stats.device}, the operands on {a.device}")
    seed, drawn = call_seed(accumulate.rounding, seed, generator)
    c, counts = torch.ops.lowfp.gemm(a, b, repr(accumulate), seed, drawn, stats is not None)
    if stats is not None:
        stats.accumulate(counts)
    return c


# -- the lowfp::gemm operator ------------------------------------------------------------------
# accumulate: an Accumulate's repr (Accumulate.parse reads it back); seed, drawn_seed: the Philox
# key as the rounding operators take it (lowfp._ops); count: return the roundings' 5 counts (else
# an empty tensor).
lib.define("gemm(Tensor a, Tensor b, str accumulate, int seed, Tensor? drawn_seed, bool count) -> (Tensor, Tensor)")

_parsed = functools.lru_cache(maxsize=256)(lambda text: Accumulate.parse(text))


def _shapes(a: torch.Tensor, b: torch.Tensor):
    """(broadcast batch shape, M, K, N)."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return batch, a.shape[-2], a.shape[-1], b.shape[-1]


def _gemm_impl(a, b, accumulate, seed, drawn_seed, count):
    acc = _parsed(accumulate)
    batch, m, k, n = _shapes(a, b)
    items = math.prod(batch)
    # (the kernels read float32: bfloat16 and float16 widen to it exactly, and one operand type
    # keeps the native code a third of the size)
    a, b = a.float(), b.float()
    a3 = a.expand(*batch, m, k).reshape(items, m, k)
    b3 = b.expand(*batch, k, n).reshape(items, k, n)
    c = torch.empty(*batch, m, n, dtype=torch.float32, device=a.device)
    counts = torch.zeros(5 if count else 0, dtype=torch.int64, device=a.device)
    mod, device, stream = native(a3, "a")
    if c.numel():
        _prepared(mod, acc)(
            a3.data_ptr(), b3.data_ptr(), c.data_ptr(), items, m, n, k, tuple(a3.stride()),
            tuple(b3.stride()), philox_key(seed, drawn_seed), 0, counts.data_ptr() if count else 0,
            device, stream)
    return c, counts


@torch.library.register_fake("lowfp::gemm", lib=lib)
def _gemm_fake(a, b, accumulate, seed, drawn_seed, count):
    batch, m, _, n = _shapes(a, b)
    return (a.new_empty((*batch, m, n), dtype=torch.float32),
            a.new_empty((5 if count else 0,), dtype=torch.int64))


def _gemm_setup_context(ctx, inputs, output):
    a, b, accumulate = inputs[:3]
    ctx.save_for_backward(a, b)
    ctx.accumulate = accumulate


def _gemm_backward(ctx, grad, _counts):
    a, b = ctx.saved_tensors
    acc = ctx.accumulate
    stochastic = _parsed(acc).rounding == "stochastic"
    grad = grad.to(a.dtype)
    ga = gb = None
    if ctx.needs_input_grad[0]:
        drawn = torch.ops.lowfp.draw_seed() if stochastic else None
        ga = torch.ops.lowfp.gemm(grad, b.transpose(-1, -2), acc, 0, drawn, False)[0]
        ga = ga.sum_to_size(a.shape).to(a.dtype)
    if ctx.needs_input_grad[1]:
        drawn = torch.ops.lowfp.draw_seed() if stochastic else None
        gb = torch.ops.lowfp.gemm(a.transpose(-1, -2), grad, acc, 0, drawn, False)[0]
        gb = gb.sum_to_size(b.shape).to(b.dtype)
    return ga, gb, None, None, None, None


for _dispatch_key in ("CPU", "CUDA"):
    lib.impl("gemm", _gemm_impl, _dispatch_key)
torch.library.register_autograd("lowfp::gemm", _gemm_backward, setup_context=_gemm_setup_context, lib=lib)


E8M13 = Format(8, 13, 0, specials="ieee")

# Hopper's FP8 tensor cores (wgmma with E4M3 operands and a float32 accumulator), as MMA-Sim
# (arXiv 2511.10909, microsoft/MMA-Sim) models them: each instruction adds 32 products to the
# accumulator at once, every term cut to 13 bits below the largest exponent, the sum cut
# (toward zero) to float32's exponent range with 13 mantissa bits.
HOPPER_FP8 = Accumulate(E8M13, rounding="toward_zero", group=32, align_bits=13, operand_emin=-6)
# DeepSeek-V3's FP8 GEMMs (arXiv 2412.19437, §3.3.2): Hopper's FP8 accumulation, promoted to a
# float32 sum on CUDA cores every 128 products.
DEEPSEEK_V3 = Accumulate(E8M13, order="blocked", block=128, rounding="toward_zero", group=32,
                         align_bits=13, operand_emin=-6)
PRESETS = {"hopper-fp8": HOPPER_FP8, "deepseek-v3": DEEPSEEK_V3}
