"""Slow, obviously-correct references written from docs/design.md, sharing no code with the engine."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import List, NamedTuple

MASK32 = 0xFFFFFFFF


class Spec(NamedTuple):
    e: int
    m: int
    b: int
    specials: str = "none"
    subnormals: bool = True

    @property
    def bias(self):
        return 2 ** (self.e - 1) - 1 + self.b

    @property
    def emin(self):
        return 1 - self.bias

    @property
    def top_code_reserved(self) -> bool:
        """The all-ones code is NaN ("fn") or ±inf ("p3109"), not a number of the grid."""
        return self.specials in ("fn", "p3109")

    @property
    def emax(self):
        top = 2**self.e - 1 - self.bias
        # (with m = 0 the reserved all-ones code is the top exponent's only code)
        return top - 1 if self.specials == "ieee" or (self.top_code_reserved and self.m == 0) else top

    @property
    def max(self) -> Fraction:
        drop = 1 - self.m if self.top_code_reserved and self.m > 0 else -self.m
        return Fraction(2) ** self.emax * (2 - Fraction(2) ** drop)

    @property
    def max_significand(self) -> int:
        """max = max_significand * 2^(emax - m)."""
        return 2 ** (self.m + 1) - (2 if self.top_code_reserved and self.m > 0 else 1)

    @property
    def unsigned_zero(self) -> bool:
        return self.specials in ("fnuz", "p3109")

    @property
    def smallest_exp(self):
        return self.emin - (self.m if self.subnormals else 0)

    def fits(self, mant_bits, max_exp, smallest_exp):
        """Every value is a carrier value: the grid step 2^(emin - m) too, subnormals or not."""
        return self.m <= mant_bits and self.emax <= max_exp and self.emin - self.m >= smallest_exp


FLOAT32_LIMITS = (23, 127, -149)
FLOAT64_LIMITS = (52, 1023, -1074)


def decompose(a: float):
    """(M, E) with a == M * 2**E exactly, M an int (a finite, >= 0)."""
    mant, ex = math.frexp(a)
    return int(mant * 2**53), ex - 53


def grid_exponent(a: float, spec: Spec) -> int:
    """Exponent of the format's grid step at a > 0: 2^(E - m) at or above 2^emin (E = floor(log2 a)),
    2^(emin - m) below it with subnormals, 2^emin below it without."""
    e = math.frexp(a)[1] - 1
    if e >= spec.emin:
        return e - spec.m
    return spec.emin - (spec.m if spec.subnormals else 0)


def split_at_grid(a: float, spec: Spec):
    """(k, rem, unit, qe): a = (k + rem / unit) * 2**qe, 0 <= rem < unit, all ints."""
    mant, e2 = decompose(a)
    qe = grid_exponent(a, spec)
    if qe <= e2:
        return mant << (e2 - qe), 0, 1, qe
    shift = qe - e2
    return mant >> shift, mant & ((1 << shift) - 1), 1 << shift, qe


DETERMINISTIC = ("nearest", "nearest_away", "toward_zero", "up", "down")


def overflow_result(x: float, spec: Spec, mode: str, policy: str) -> float:
    """What an overflowing x becomes under an overflow policy (docs/design.md §3)."""
    neg = math.copysign(1.0, x) < 0
    mx = math.ldexp(spec.max_significand, spec.emax - spec.m)
    mx = -mx if neg else mx
    inf = -math.inf if neg else math.inf
    if policy == "saturate":
        return mx
    if policy == "nan":
        return math.nan
    if math.isinf(x):
        return x
    to_max = {"toward_zero": True, "up": neg, "down": not neg}.get(mode, False)
    return mx if to_max else inf


def code_is_odd(k: int, qe: int, spec: Spec) -> bool:
    """Whether the encoding of k * 2^qe (a value of the grid) ends in 1: its mantissa's last bit,
    or with m = 0, where k is 0 or 1, its exponent code qe + bias (docs/design.md §3)."""
    if spec.m > 0:
        return k % 2 == 1
    return k == 1 and (qe + spec.bias) % 2 == 1


def round_exact(x: float, spec: Spec, mode: str, policy: str):
    """(result as float, event) with event in {None, 'overflow', 'underflow', 'nan'}.

    Rounds x to the format's values extended upward without bound, then applies the overflow
    policy (docs/design.md §3).
    """
    if math.isnan(x):
        return math.nan, "nan"
    if math.isinf(x):
        return overflow_result(x, spec, mode, policy), "overflow"
    if x == 0:
        return (0.0 if spec.unsigned_zero else x), None
    neg = x < 0
    k, rem, unit, qe = split_at_grid(abs(x), spec)
    if mode == "nearest":
        up = 2 * rem > unit or (2 * rem == unit and code_is_odd(k, qe, spec))
    elif mode == "nearest_away":
        up = 2 * rem >= unit
    elif mode == "toward_zero":
        up = False
    elif mode == "up":
        up = rem > 0 and not neg
    elif mode == "down":
        up = rem > 0 and neg
    else:
        raise ValueError(mode)
    if exceeds_max(k + up, qe, spec):
        return overflow_result(x, spec, mode, policy), "overflow"
    if k + up == 0:
        return (0.0 if spec.unsigned_zero else math.copysign(0.0, x)), "underflow"
    val = math.ldexp(k + up, qe)
    return (-val if neg else val), None


def positive_values(spec: Spec) -> List[Fraction]:
    """Every finite non-negative value of the format, by decoding each code; sorted."""
    vals = set()
    for ec in range(2**spec.e):
        for mc in range(2**spec.m):
            if spec.specials == "ieee" and ec == 2**spec.e - 1:
                continue
            if spec.top_code_reserved and ec == 2**spec.e - 1 and mc == 2**spec.m - 1:
                continue
            if ec == 0:
                if mc and not spec.subnormals:
                    continue
                vals.add(mc * Fraction(2) ** (spec.emin - spec.m))
            else:
                vals.add((2**spec.m + mc) * Fraction(2) ** (ec - spec.bias - spec.m))
    return sorted(vals)


# -- float32 arithmetic as torch's CPU kernels do it -----------------------------------------------


def fma32(a, b, c):
    """a * b + c rounded once to float32 (numpy float32 arrays or scalars), exactly: the product
    is exact in float64, the sum is rounded to float64 with its error kept (TwoSum), and a sum
    that lands on a float32 midpoint with a nonzero error is moved one float64 ulp toward the
    true value before the final rounding, so it never rounds twice."""
    import numpy as np
    a, b, c = (np.asarray(v, dtype=np.float32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    # the float32 neighbour on s's other side; s is a midpoint when it lies halfway between them
    other = np.where(s > r64, np.nextafter(r, np.float32(np.inf)),
                     np.nextafter(r, np.float32(-np.inf))).astype(np.float64)
    midpoint = (s != r64) & (s == (r64 + other) / 2)
    nudged = np.where(midpoint & (err != 0), np.nextafter(s, s + err), s)
    return nudged.astype(np.float32)


# -- Philox4x32-10, written from the paper's description ------------------------------------


def philox4x32_10(ctr, key):
    c = list(ctr)
    k0, k1 = key
    for r in range(10):
        if r:
            k0 = (k0 + 0x9E3779B9) & MASK32
            k1 = (k1 + 0xBB67AE85) & MASK32
        p0 = 0xD2511F53 * c[0]
        p1 = 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & MASK32, p1 & MASK32, ((p0 >> 32) ^ c[3] ^ k1) & MASK32,
             p0 & MASK32]
    return c


def philox_word(seed: int, offset: int, i: int) -> int:
    """The random word docs/design.md §3 assigns to element i."""
    block = offset + i // 4
    words = philox4x32_10([block & MASK32, block >> 32, 0, 0], [seed & MASK32, seed >> 32])
    return words[i % 4]


def exceeds_max(k: int, qe: int, spec: Spec) -> bool:
    """k * 2^qe > max, in integers."""
    top = spec.emax - spec.m
    if qe >= top:
        return (k << (qe - top)) > spec.max_significand
    return k > (spec.max_significand << (top - qe))


def stochastic_exact(x: float, spec: Spec, word: int, sr_bits: int = 32) -> float:
    """Stochastic rounding of finite x with a given random word, per docs/design.md §3 (no overflow):
    up with probability floor(f * 2^R) / 2^R, decided by the word's top R bits."""
    if x == 0:
        return x
    k, rem, unit, qe = split_at_grid(abs(x), spec)
    threshold = (rem << sr_bits) // unit  # floor(f * 2^R), f = rem / unit
    up = (word >> (32 - sr_bits)) < threshold
    return math.copysign(math.ldexp(k + up, qe), x)


def round_fraction(v: Fraction, fmt) -> Fraction:
    """v rounded to nearest (ties to the even step) on the grid of fmt (anything with emin, m
    and max, as a lowfp Format), saturating at ±max."""
    if v == 0:
        return v
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    step = Fraction(2) ** (max(e, fmt.emin) - fmt.m)
    lo = (a // step) * step
    hi = lo + step
    r = lo if a - lo < hi - a else hi if a - lo > hi - a else (lo if (lo / step) % 2 == 0 else hi)
    r = min(r, Fraction(fmt.max))
    return -r if v < 0 else r
