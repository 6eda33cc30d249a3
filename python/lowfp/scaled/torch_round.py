"""Rounding to a scaled format in torch operations, so that torch.compile fuses it.

Under ``torch.compile`` with Inductor, ``lowfp::scaled_quantize`` of a float32, bfloat16 or float16
tensor is decomposed into :func:`scaled_quantize` (where ``lowfp._torch_round.fuses`` says so):
the blocks' maxima, their scales and the elements' roundings become part of Inductor's own
kernels. float64 tensors, and the rare scale formats whose quotients need wider integers than the
ones below (:func:`fuses_format`), keep the operator.

Bit for bit the native kernels' results and counts (docs/design.md §9,
cpp/include/lowfp/scaled.hpp): each step computes what the native one computes. Where a
floating-point operation could round differently on another backend (Inductor turns a division
by a constant into a product by its reciprocal on GPUs, and Triton divides float32 numbers
approximately), the quotient is formed exactly by long division of the integer significands
(:func:`quotient`; each step's float64 estimate corrected by its integer remainder) and rounded
once, to nearest or to odd, as the native code rounds it. Products of a power of two, and
s · q (at most 48 significand bits), are exact in float64 on every backend.
"""

from __future__ import annotations

import functools
import math
import struct
from typing import NamedTuple, Optional, Tuple, Union

import torch

from .._torch_round import (FLOAT32_CARRIER, FLOAT64_CARRIER, event_counts, lanes_of,
                            random_words, round_bits, round_kind, round_params, stored, to_storage)
from ..formats import Format
from .config import Scaled, layout, scales_shape

__all__ = ["scaled_quantize", "quotient", "fuses_format"]

_MANTISSA = (1 << 52) - 1
_FLOAT32_MAX = 3.4028234663852886e38
_DIVISOR_BITS = 28  # the most significand bits quotient() takes in a divisor
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The 16-bit dtypes' grids, as the native kernels round s · q to them (nearest, overflow to inf).
_STORAGE = {torch.bfloat16: Format(8, 7, 0, specials="ieee", overflow="inf"),
            torch.float16: Format(5, 10, 0, specials="ieee", overflow="inf")}
_FLOAT32_GRID = Format(8, 23, 0, specials="ieee", overflow="inf")  # (float32's own values)


def _to_float32_grid(d: torch.Tensor) -> torch.Tensor:
    """Float64 d rounded to float32's values (nearest, ties to even), kept in float64: the
    value of d.to(torch.float32).to(torch.float64) without that pair of casts, which Inductor
    may drop as a no-op (torch 2.11's did)."""
    p = round_params(str(_FLOAT32_GRID), "nearest", 32, torch.float64, torch.float64)
    bits, _ = round_bits(d.view(torch.int64), p, FLOAT64_CARRIER, "nearest", None,
                         lanes_of(FLOAT64_CARRIER, "nearest"))
    return bits.view(torch.float64)


def _significand_bits(v: float) -> int:
    """The significant bits of a positive float64's significand (1 for a power of two)."""
    m, _ = math.frexp(v)
    n = int(m * 2**53)
    return 53 - ((n & -n).bit_length() - 1)


class _Spec(NamedTuple):
    """What the torch form needs of a (scaled format, overflow, rounding, sr_bits)."""
    fmt: Scaled
    element: str         # E with the call's overflow policy, as text
    rule: str            # "floor", "ceil", "rceil", "even" or "nearest" (scales in a format)
    emax_e: int
    max_e: float
    m_e: int
    scale: Optional[str]  # S, nearest and saturating, as text (rule "nearest")
    s_smallest: float
    s_max: float


@functools.lru_cache(maxsize=256)
def _spec(fmt: str, overflow: str) -> _Spec:
    scaled = Scaled.parse(fmt)
    e = scaled.element
    element = Format(e.e, e.m, e.b, specials=e.specials, subnormals=e.subnormals, overflow=overflow)
    s = scaled.scale_format
    scale = None if s is None else Format(s.e, s.m, s.b, specials=s.specials,
                                          subnormals=s.subnormals, overflow="saturate")
    return _Spec(scaled, str(element), scaled.scale_rule, e.emax, e.max, e.m,
                 None if scale is None else str(scale),
                 0.0 if s is None else s.smallest, 0.0 if s is None else s.max)


def fuses_format(fmt: Scaled, dtype: torch.dtype) -> bool:
    """Whether :func:`scaled_quantize` computes roundings of ``dtype`` tensors to ``fmt``: x of at
    most 24 significand bits, and every divisor of at most 28 (a scale in a format S times the
    float32 tensor scale, max_E times it, max_S · max_E)."""
    if dtype not in _DTYPES or fmt.four_over_six is not None:
        return False
    s = fmt.scale_format
    if s is None:
        return True
    t_bits = 24 if fmt.tensor_scale else 0
    e_max = fmt.element.max
    return (s.m + 1 + t_bits <= _DIVISOR_BITS
            and _significand_bits(e_max) + t_bits <= _DIVISOR_BITS
            and (not fmt.tensor_scale or _significand_bits(s.max * e_max) <= _DIVISOR_BITS))


def _fields(v: Union[torch.Tensor, float]):
    """The biased exponent and the 53-bit significand (hidden bit set) of normal float64s."""
    if isinstance(v, float):
        b = struct.unpack("<q", struct.pack("<d", v))[0]
    else:
        b = v.view(torch.int64)
    return (b >> 52) & 0x7FF, (b & _MANTISSA) | (1 << 52)


def _divmod(num: torch.Tensor, divisor, inverse) -> Tuple[torch.Tensor, torch.Tensor]:
    """num // divisor and num % divisor for int64 0 <= num < 2^63 - 2^39 (exact in float64) and
    divisor < 2^28, from the float64 estimate num · inverse (inverse within a few units of 1 /
    divisor's last place: the estimate is then within 2^-16 of the quotient, below 2^36), corrected
    by one either way where its remainder says so. No integer division: GPUs have none."""
    q = stored(torch.floor(num.to(torch.float64) * inverse).to(torch.int64))
    r = stored(num - q * divisor)
    low = r < 0
    q, r = torch.where(low, q - 1, q), stored(torch.where(low, r + divisor, r))
    high = r >= divisor
    return stored(torch.where(high, q + 1, q)), stored(torch.where(high, r - divisor, r))


def quotient(x: torch.Tensor, s: Union[torch.Tensor, float], odd: bool) -> torch.Tensor:
    """x / s as a float64, rounded to odd (``odd``) or to nearest even, from the exact quotient.

    x: float64 values of at most 24 significand bits (any, zeros, infinities and NaN too, which
    return themselves), s: positive normal float64s of at most 28 (a tensor broadcasting with x,
    or a float). The quotient, between 2^-400 and 2^400 for such operands, is normal.
    With X and S the integer significands (X in [2^23, 2^24), S in [2^27, 2^28)), X · 2^c // S
    for c = 38 or 39 has exactly 35 bits, and 18 more come from the remainder: 53 bits and a
    remainder that says the rest exactly."""
    xe, xm = _fields(x)
    se, sm = _fields(s)
    big_x, big_s = xm >> 29, sm >> 25
    inverse = 1.0 / big_s if isinstance(big_s, int) else 1.0 / big_s.to(torch.float64)
    shift = 38 + ((big_x << 4) < big_s).to(torch.int64)  # the first quotient in [2^34, 2^35)
    q1, r1 = _divmod(big_x << shift, big_s, inverse)
    q2, r2 = _divmod(r1 << 18, big_s, inverse)
    top = (q1 << 18) | q2  # in [2^52, 2^53): the quotient's first 53 bits
    if odd:
        m = top | (r2 != 0).to(torch.int64)
    else:
        twice = r2 << 1
        m = top + ((twice > big_s) | ((twice == big_s) & ((top & 1) == 1))).to(torch.int64)
    # x / s = (X / S) 2^(xe - se + 4) and X / S = (top + r2 / S) 2^-(shift + 18)
    power = ((xe - se + 4 - shift - 18 + 1023) << 52).view(torch.float64)
    q = m.to(torch.float64) * power  # m <= 2^53: exact
    q = torch.where(x < 0, -q, q)
    return torch.where(torch.isfinite(x) & (x != 0), q, x)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) of positive normal float64s."""
    return ((a.view(torch.int64) >> 52) & 0x7FF) - 1023


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k (k in [-1022, 1023]) as float64."""
    return ((k + 1023) << 52).view(torch.float64)


def _pow2_scales(sp: _Spec, a: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """pow2_block_scale's exponent k (clamped to [-127, 127]) and whether it was clamped, for
    block maxima a > 0."""
    if sp.rule == "rceil":
        d = _to_float32_grid(quotient(a, sp.max_e, odd=False))
        above = ~(d <= _FLOAT32_MAX)
        dn = torch.where((d == 0) | above, 1.0, d)
        not_pow2 = ((dn.view(torch.int64) & _MANTISSA) != 0).to(torch.int64)
        k = torch.where(d == 0, -150, torch.where(above, 128, _floor_log2(dn) + not_pow2))
    else:
        v = a
        if sp.rule == "even":  # a rounded to E's m bits, ties away: the exact sum's exponent
            v = a + _pow2(_floor_log2(a) - sp.m_e - 1)
        k = _floor_log2(v) - sp.emax_e
        if sp.rule == "ceil":
            k = k + (a > sp.max_e * _pow2(torch.clamp(k, -1022, 1023))).to(torch.int64)
    saturated = (k > 127) | (k < -127)
    return torch.clamp(k, -127, 127), saturated


def _format_scales(sp: _Spec, a: torch.Tensor, t) -> Tuple[torch.Tensor, torch.Tensor]:
    """format_block_scale: round_S(a / (max_E · t)) (nearest, saturating, held at S's smallest
    value) times t, and whether it saturated or was held, for block maxima a > 0."""
    want = quotient(a, sp.max_e * t, odd=True)  # max_E · t: exact
    lanes = lanes_of(FLOAT64_CARRIER, "nearest")
    p = round_params(sp.scale, "nearest", 32, torch.float64, torch.float64)
    bits, events = round_bits(want.view(torch.int64), p, FLOAT64_CARRIER, "nearest", None, lanes)
    s = bits.view(torch.float64)
    return torch.where(s == 0, sp.s_smallest, s) * t, events.above_max | (s == 0)


def _tensor_scale(sp: _Spec, amax: torch.Tensor) -> torch.Tensor:
    """tensor_scale: amax / (max_S · max_E) rounded to float32, held within float32's positive
    range; 1 without a finite nonzero value."""
    d = quotient(torch.where(amax > 0, amax, 1.0), sp.s_max * sp.max_e, odd=False)
    held = torch.where(d >= _FLOAT32_MAX, _FLOAT32_MAX,
                       torch.clamp_min(_to_float32_grid(d), 2.0**-149))
    return torch.where(amax > 0, held, 1.0)


def _store(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """store_scaled: s · q (exact in float64) in x's dtype."""
    if dtype == torch.float32:
        return v.to(torch.float32)
    p = round_params(str(_STORAGE[dtype]), "nearest", 32, torch.float64, torch.float64)
    bits, _ = round_bits(v.view(torch.int64), p, FLOAT64_CARRIER, "nearest", None,
                         lanes_of(FLOAT64_CARRIER, "nearest"))
    narrow = bits.view(torch.float64).to(torch.float32).view(torch.int32)
    return to_storage(narrow, FLOAT32_CARRIER, dtype)


def scaled_quantize(x: torch.Tensor, fmt: str, rounding: str, overflow: str, sr_bits: int,
                    seed: int, drawn_seed: Optional[torch.Tensor], offset: int, count: bool,
                    parts: bool):
    """``lowfp::scaled_quantize``'s results (value, q, scales, tensor scale, counts) in torch
    operations, for the tensors and formats :func:`fuses_format` accepts (the arguments are the
    operator's; docs/design.md §9)."""
    sp = _spec(fmt, overflow)
    rows, cols, brows, bcols, move = layout(tuple(x.shape), sp.fmt)
    moved = x if move is None else x.movedim(move, -1)
    grid_rows, grid_cols = (-(-rows // brows) if rows else 0), (-(-cols // bcols) if cols else 0)
    if x.numel() == 0:  # (the native operator's results for an empty tensor)
        return (torch.empty_like(moved, memory_format=torch.contiguous_format).movedim(-1, move)
                if move is not None else torch.empty_like(x, memory_format=torch.contiguous_format),
                x.new_empty(moved.shape if parts else (0,), dtype=torch.float32),
                scales_shape(x.new_zeros((grid_rows, grid_cols), dtype=torch.float64), moved.shape,
                              sp.fmt, move),
                x.new_ones((), dtype=torch.float64), x.new_zeros((6 if count else 0,), dtype=torch.int64))
    xm = moved.reshape(rows, cols)

    # The blocks' largest finite magnitudes (x's own dtype holds them), then their scales.
    magnitude = torch.where(torch.isfinite(xm), xm.abs(), 0)
    padded = torch.nn.functional.pad(magnitude, (0, grid_cols * bcols - cols, 0, grid_rows * brows - rows))
    a = padded.reshape(grid_rows, brows, grid_cols, bcols).amax(dim=(1, 3)).to(torch.float64)
    nonempty = a > 0
    a_or_1 = torch.where(nonempty, a, 1.0)
    t = torch.ones((), dtype=torch.float64, device=x.device)
    if sp.rule == "nearest":
        if sp.fmt.tensor_scale:
            t = _tensor_scale(sp, a.amax() if a.numel() else t.new_zeros(()))
        s, saturated = _format_scales(sp, a_or_1, t)
        scales = torch.where(nonempty, s, sp.s_smallest * t)
        inverse = None
    else:
        k, saturated = _pow2_scales(sp, a_or_1)
        k = torch.where(nonempty, k, -127)
        scales, inverse = _pow2(k), _pow2(-k)
    saturated = saturated & nonempty

    def per_element(blockwise: torch.Tensor) -> torch.Tensor:
        expanded = blockwise[:, None, :, None].expand(grid_rows, brows, grid_cols, bcols)
        return expanded.reshape(grid_rows * brows, grid_cols * bcols)[:rows, :cols]

    # The elements: q = round_E(x / s), the exact quotient rounded once.
    x64 = xm.to(torch.float64)
    q = x64 * per_element(inverse) if inverse is not None else quotient(x64, per_element(scales), odd=True)
    kind = round_kind(rounding)
    lanes = lanes_of(FLOAT64_CARRIER, kind)
    rand = (random_words(torch.Size((rows, cols)), x.device, seed, drawn_seed, offset)
            if kind == "stochastic" else None)
    p = round_params(sp.element, rounding, sr_bits, torch.float64, torch.float64)
    bits, events = round_bits(stored(q.view(torch.int64)), p, FLOAT64_CARRIER, kind, rand, lanes)
    qv = bits.view(torch.float64)
    y = _store(qv * per_element(scales), x.dtype).reshape(moved.shape)
    q_part = (qv.to(torch.float32).reshape(moved.shape) if parts
              else x.new_empty((0,), dtype=torch.float32))
    if move is not None:
        y = y.movedim(-1, move)
        if parts:
            q_part = q_part.movedim(-1, move)
    counts = x.new_empty((0,), dtype=torch.int64)
    if count:
        counts = torch.stack(event_counts(events, x.numel()) + [
            saturated.sum(dtype=torch.int64),
            torch.full((), grid_rows * grid_cols, dtype=torch.int64, device=x.device)])
    return y, q_part, scales_shape(scales, moved.shape, sp.fmt, move), t, counts
