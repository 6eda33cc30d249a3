"""lowfp's rounding to a format written in torch operations, so that torch.compile fuses it.

Under ``torch.compile`` with Inductor, ``lowfp::quantize`` is decomposed into the functions here
(docs/design.md §3.1): Inductor then generates the rounding inside its own kernels, fused with
the operations that produce and consume the tensor, instead of calling lowfp's native kernel
from Python. Eager code, ``torch.export`` and other backends keep the operator.

Bit for bit the native kernels' results and counts: the functions compute, operation for
operation, what ``round_bits`` or ``round_nearest_by_addition`` (cpp/include/lowfp/round.hpp)
and Philox4x32-10 (cpp/include/lowfp/philox.hpp) compute, from the same constants
(``lowfp._C.round_params``, the kernel's own RoundParams and its choice of form). The carrier's
bits travel as their signed value in integer lanes: int32 for the float32 carrier's
deterministic modes, int64 for the float64 carrier and for stochastic rounding (whose thresholds
reach 2^32). Every intermediate stays inside its lane, so no operation depends on how a backend
wraps.

Inductor inlines an operation into each of its uses; the rounded magnitude and the carrier bits,
used by the result and by every count, are therefore stored (``stored``), so that each is
generated once per kernel and a chain of roundings is not regenerated inside each later one.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional, Tuple

import torch

from ._native import DTYPE_CODES, ROUNDING_MODES, format_args
from .formats import Format

__all__ = ["quantize", "philox_block_words", "philox_words", "fuses",
           "round_bits", "round_by_addition", "keeps_sign_on_overflow", "Events",
           "rounds_by_addition", "round_params", "to_storage", "stored",
           "lanes_of", "round_kind", "random_words", "event_counts", "Carrier", "FLOAT32_CARRIER",
           "FLOAT64_CARRIER"]

_MASK32 = 0xFFFFFFFF
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


class Carrier:
    """A binary floating-point carrier as round.hpp's CarrierTraits states it."""

    def __init__(self, float_dtype, int_dtype, mant_bits, exp_bias):
        self.float_dtype, self.int_dtype = float_dtype, int_dtype
        self.bits = torch.finfo(float_dtype).bits
        self.mant_bits, self.exp_bias = mant_bits, exp_bias
        self.sign = 1 << (self.bits - 1)
        self.inf = ((1 << (self.bits - 1 - mant_bits)) - 1) << mant_bits
        self.mant_mask = (1 << mant_bits) - 1

    def signed(self, pattern: int) -> int:
        """An unsigned bit pattern as the lane's signed value."""
        return pattern - (1 << self.bits) if pattern >= self.sign else pattern


FLOAT32_CARRIER = Carrier(torch.float32, torch.int32, 23, 127)
FLOAT64_CARRIER = Carrier(torch.float64, torch.int64, 52, 1023)


class Lanes(NamedTuple):
    """The integer lanes a rounding computes in, and the largest shift it makes: round_bits
    clamps shifts at the carrier's width minus one, but every shift at or past
    ``max_shift`` gives the same result here (one past the significand's top bit for the
    modes that compare the remainder with the unit; 62, the most an int64 lane shifts safely,
    for stochastic rounding, whose threshold shifts by up to the full difference)."""
    dtype: torch.dtype
    max_shift: int


def lanes_of(c: Carrier, kind: str) -> Lanes:
    if kind == "stochastic" or c.bits == 64:
        return Lanes(torch.int64, 62)
    # A float32 significand has 24 bits: a shift of 25 already leaves no bit of it in the
    # truncation, and (rem << 1) + 1 < 2^25 = unit: the same decisions as any larger shift.
    return Lanes(torch.int32, 25)


@functools.lru_cache(maxsize=None)
def round_params(fmt: str, rounding: str, sr_bits: int, x_dtype: torch.dtype,
                  y_dtype: torch.dtype) -> dict:
    from . import _C
    args = format_args(Format.parse(fmt), ROUNDING_MODES.index(rounding), sr_bits)
    return _C.round_params(DTYPE_CODES[x_dtype], DTYPE_CODES[y_dtype], *args)


def philox_block_words(block: torch.Tensor, key, offset: int):
    """The four words of Philox4x32-10 block ``offset + block`` under ``key`` (a uint64 int,
    or a pair of int64 tensors [lo, hi]): four int64 tensors holding uint32 values."""
    low = (offset & _MASK32) + (block & _MASK32)
    c0 = low & _MASK32
    c1 = ((offset >> 32) + (block >> 32) + (low >> 32)) & _MASK32
    if isinstance(key, int):
        k0, k1 = key & _MASK32, key >> 32
    else:
        k0, k1 = key
    # Round 1 by hand: the counter's upper words are 0, so the second product is 0.
    hi0, lo0 = _mulhilo(_PHILOX_M0, c0)
    c0, c1, c2, c3 = c1 ^ k0, torch.zeros_like(c0), hi0 ^ k1, lo0
    for r in range(9):
        if r % 3 == 2:  # each round uses c0 and c2 twice: inlined, ten rounds nest 2.4^10 deep
            c0, c1, c2, c3 = (stored(c) for c in (c0, c1, c2, c3))
        k0, k1 = (k0 + _PHILOX_W0) & _MASK32, (k1 + _PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def stored(t: torch.Tensor) -> torch.Tensor:
    """t, which Inductor computes into a buffer (as_strided needs one) instead of inlining its
    expression into each use; a buffer used only inside one generated kernel stays in it."""
    return torch.as_strided(t, t.shape, t.stride())


def philox_words(shape: torch.Size, device, key, offset: int) -> torch.Tensor:
    """The random word of each element of a tensor of ``shape`` (int64 holding a uint32):
    element i (row-major) takes word ``i mod 4`` of block ``offset + i div 4``."""
    n = 1
    for size in shape:
        n *= size
    blocks = (n + 3) // 4
    words = torch.stack(philox_block_words(
        torch.arange(blocks, device=device, dtype=torch.int64), key, offset), dim=-1)
    # Stored as int32, each block's four words computed once rather than once per element.
    words = stored((words - ((words >> 31) << 32)).to(torch.int32).reshape(-1))
    return (words[:n].to(torch.int64) & _MASK32).view(shape)


def _mulhilo(m: int, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """hi, lo of the 64-bit product of the constant m and 32-bit words x. An int64 lane cannot
    hold m x, but holds p = x (m - 2^32) (|p| < 2^62 for lowfp's two multipliers), and
    m x = p + x 2^32: the low word is p's, the high word p's arithmetic upper half plus x."""
    p = x * (m - (1 << 32))
    return (p >> 32) + x, p & _MASK32


def _round_magnitude(a: torch.Tensor, negative: torch.Tensor, p: dict, c: Carrier, kind: str,
                     rand: Optional[torch.Tensor], lanes: Lanes) -> torch.Tensor:
    """round_bits' rounded magnitude of the carrier magnitudes a (sign cleared, at most
    infinity's bits: a NaN's rounding is discarded, and so cannot overflow a lane)."""
    ex = a >> c.mant_bits
    e_eff = torch.clamp_min(ex, 1) - c.exp_bias
    normal = ex != 0
    sig = (a & c.mant_mask) | (normal.to(lanes.dtype) << c.mant_bits)
    e_true = e_eff
    if p["subnormal_exponent"]:  # the leading bit of a carrier subnormal, by exact conversion
        lead = (sig.to(c.float_dtype).view(c.int_dtype).to(lanes.dtype) >> c.mant_bits) - c.exp_bias
        e_true = torch.where(normal, e_eff, e_eff - c.mant_bits + lead)
    if p["fixed_drop"]:
        d = dm = p["normal_drop"]
        unit = 1 << dm
    else:
        emin = p["emin"]
        normal_d = p["normal_drop"] if e_true is e_eff else p["normal_drop"] + (e_true - e_eff)
        d = torch.where(e_true < emin, p["below_drop"] + (emin - e_eff), normal_d)
        dm = torch.clamp_max(d, lanes.max_shift)
        unit = torch.ones_like(dm) << dm
    trunc = sig >> dm
    rem = sig & (unit - 1)

    if kind == "nearest":
        if p["parity_mask"] != 0:
            odd = trunc
        else:  # m = 0: the even neighbour is the one with an even exponent code
            odd = trunc & (e_true + p["parity_bias"])
        tie_up = (odd | int(p["ties_away"])) & 1
        up = ((rem << 1) + tie_up > unit).to(lanes.dtype)
    elif kind == "directed":
        rounds_away = (rem != 0).to(lanes.dtype)
        if p["away_pos"] == p["away_neg"]:
            up = rounds_away if p["away_pos"] else torch.zeros_like(rounds_away)
        else:  # away from zero on one side only: up is 1 on that side
            up = rounds_away & (negative if p["away_neg"] else ~negative).to(lanes.dtype)
    else:
        r_bits = 32 - p["sr_shift"]
        if p["fixed_drop"]:
            threshold = rem << (r_bits - d) if d <= r_bits else rem >> (d - r_bits)
        else:
            widened = rem << torch.clamp(r_bits - d, 0, lanes.max_shift)
            narrowed = rem >> torch.clamp(d - r_bits, 0, lanes.max_shift)
            threshold = torch.where(d <= r_bits, widened, narrowed)
        up = ((rand >> p["sr_shift"]) < threshold).to(lanes.dtype)

    stepped = (a & ~(unit - 1)) + (up << dm)
    if p["fixed_drop"]:
        return stepped
    # -up is all ones where up is 1: below_step or 0 without a (slow vector) multiply
    return torch.where(d <= c.mant_bits, stepped, (-up) & p["below_step"])


def rounds_by_addition(p: dict, c: Carrier, kind: str) -> bool:
    """Whether the rounded magnitude is taken by addition, as the native kernel takes it
    (round.hpp's round_nearest_by_addition, where ``p["nearest_by_addition"]`` says the kernel
    does), and only where half the format's smallest step, the least magnitude that can round
    to it, is a normal carrier value: a subnormal input then rounds to zero and every other
    operand and result of the additions is normal, so a backend that flushes subnormals (a GPU
    compiler may) gives the same bits."""
    if kind != "nearest" or not p.get("nearest_by_addition") or c.bits != 32:
        return False
    m = c.mant_bits - p["normal_drop"]
    return p["emin"] - m - 1 >= 1 - c.exp_bias


def _magnitude_by_addition(a: torch.Tensor, p: dict, c: Carrier) -> torch.Tensor:
    """round.hpp's magnitude_by_addition: (|x| + k) - k in the carrier's own rounding to
    nearest, k = 2^(e + MB - m) for |x|'s exponent e held in [emin, addition_cap], whose ulp is
    the format's step at |x| (a: the carrier magnitudes, signed int32 lanes)."""
    field = torch.clamp(a >> c.mant_bits, p["emin"] + c.exp_bias, p["addition_cap"] + c.exp_bias)
    k = ((field + p["normal_drop"]) << c.mant_bits).view(c.float_dtype)
    return ((a.view(c.float_dtype) + k) - k).view(c.int_dtype)


def keeps_sign_on_overflow(p: dict, c: Carrier) -> bool:
    """Whether an overflow gives the input's sign on one magnitude (saturation to max, or
    infinity, which an infinite input then overflows to as well) and zeros keep their sign:
    round_bits' result is then the sign bit over a magnitude, and its choices can be taken by
    masks (round_by_addition)."""
    pos, neg = p["overflow_pos"], p["overflow_neg"]
    return (neg == pos | c.sign and not p["no_negative_zero"]
            and (not p["inf_stays_inf"] or pos == c.inf))


def _take(mask: torch.Tensor, new, old: torch.Tensor) -> torch.Tensor:
    """new where the lane mask (-1 or 0) is -1, else old: torch.where without a boolean, which
    Inductor's CPU vector code converts between mask registers and vectors on every use."""
    return old ^ ((old ^ new) & mask)


class Events(NamedTuple):
    """A rounding's events, each a tensor over the elements. In flag form (``masks`` false):
    booleans (above_max, underflow, nan), above_max excluding NaN. In mask form: int lanes, -1
    where the event happened and 0 elsewhere, whose above_max also holds the NaNs (subtracted
    from its sum): a mask is summed as it is, with no conversion from a boolean."""
    above_max: torch.Tensor
    underflow: torch.Tensor
    nan: torch.Tensor
    masks: bool = False


def round_by_addition(bits: torch.Tensor, p: dict, c: Carrier) -> Tuple[torch.Tensor, Events]:
    """round_bits where rounds_by_addition and keeps_sign_on_overflow hold, its choices made with
    lane masks: the result's bits and the Events in mask form (int32 lanes, float32 carrier)."""
    top = c.bits - 1
    a = bits & (c.sign - 1)
    mag = stored(_magnitude_by_addition(a, p, c))  # (a NaN stays a NaN, above max_bits)
    nan = (c.inf - a) >> top
    above_max = (p["max_bits"] - mag) >> top
    if p["overflow_pos"] == p["max_bits"]:  # saturation
        limited = torch.clamp_max(mag, p["max_bits"])
    else:
        limited = _take(above_max, p["overflow_pos"], mag)
    rounded = (bits & c.signed(c.sign)) | limited
    underflow = ((mag - 1) & -a) >> top  # mag is 0 and a is not
    return _take(nan, bits, rounded), Events(above_max, underflow, nan, masks=True)


def round_bits(bits: torch.Tensor, p: dict, c: Carrier, kind: str, rand, lanes: Lanes):
    """round_bits and rounded_result: the result's bits and the Events, in flag form, of the
    carrier values ``bits`` (signed, in ``lanes``)."""
    negative = bits < 0
    a = bits & (c.sign - 1)
    nan = a > c.inf
    if rounds_by_addition(p, c, kind):  # (int32 lanes: float32 carrier, nearest)
        mag = stored(_magnitude_by_addition(a, p, c))  # (inf and NaN stay above max_bits)
    else:
        mag = stored(_round_magnitude(torch.clamp_max(a, c.inf), negative, p, c, kind, rand, lanes))
    above_max = mag > p["max_bits"]
    underflow = (a != 0) & (mag == 0)
    sign = bits & c.signed(c.sign)  # the sign bit alone
    if p["no_negative_zero"]:
        sign = torch.where(mag == 0, 0, sign)
    rounded = sign | mag
    overflowed = torch.where(negative, c.signed(p["overflow_neg"]),
                             torch.full_like(bits, c.signed(p["overflow_pos"])))
    if p["inf_stays_inf"]:
        overflowed = torch.where(a == c.inf, bits, overflowed)
    result = torch.where(nan, bits, torch.where(above_max, overflowed, rounded))
    return result, Events(above_max, underflow, nan)


def to_storage(result: torch.Tensor, c: Carrier, dtype: torch.dtype) -> torch.Tensor:
    """The carrier bits ``result`` as a tensor of ``dtype``, as the kernels store them
    (half.hpp): values convert exactly; a NaN keeps its sign, and bfloat16 its upper payload,
    quieted (torch's own float32-to-bfloat16 conversion makes every NaN +NaN)."""
    if c.bits == 32 and dtype in (torch.float16, torch.bfloat16):
        nan = (result & 0x7FFFFFFF) > c.inf
        upper = (result >> 16) & 0xFFFF
        if dtype == torch.bfloat16:  # truncation is exact for the values the rounding gives
            bits = torch.where(nan, upper | 0x0040, upper)
        else:
            y = result.to(torch.int32).view(torch.float32).to(dtype)
            bits = torch.where(nan, (upper & 0x8000) | 0x7E00, y.view(torch.int16).to(result.dtype))
        return stored_as((bits - ((bits >> 15) << 16)).to(torch.int16), dtype)
    return result.to(c.int_dtype).view(c.float_dtype).to(dtype)


def stored_as(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """16-bit patterns ``bits`` (int16) as a tensor of the 16-bit float ``dtype``, the patterns
    themselves. Inductor's Triton code computes 16-bit floats in float32 registers: a view of
    values in registers widens them there and stores them by a conversion back, which makes
    every NaN the canonical one on a GPU. So where Inductor generates Triton (CUDA, or a CPU
    whose Inductor backend is Triton), the patterns are stored first, in bits's own layout, and
    the view is of that memory (Inductor's reinterpretation of a stored buffer: no copy, no
    conversion)."""
    if _stores_through_float32(bits.device):
        from torch._inductor import inductor_prims  # noqa: F401 (registers the prim)
        bits = torch.ops.prims.inductor_force_stride_order(bits, bits.stride())
    return bits.view(dtype)


def _stores_through_float32(device: torch.device) -> bool:
    """Whether Inductor's code for ``device`` is Triton's (see stored_as)."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    from torch._inductor import config
    return config.cpu_backend == "triton"


def round_kind(rounding: str) -> str:
    """The kind of decision a rounding mode makes: "nearest", "directed" or "stochastic"."""
    return {"nearest": "nearest", "nearest_away": "nearest", "stochastic": "stochastic"}.get(
        rounding, "directed")


def random_words(shape, device, seed: int, drawn_seed: Optional[torch.Tensor],
                 offset: int) -> torch.Tensor:
    """philox_words of a tensor of ``shape`` under the operator's seed arguments: the drawn seed
    tensor (int64 [lo, hi]) when there is one, else ``seed`` (an int)."""
    key = seed & ((1 << 64) - 1) if drawn_seed is None else (drawn_seed[0], drawn_seed[1])
    return philox_words(shape, device, key, offset & ((1 << 64) - 1))


def event_counts(events: Events, numel: int) -> list:
    """The rounding counts (overflow, underflow, NaN, numel) of ``numel`` elements' Events as
    four int64 0-d tensors."""
    # Summed in int32 lanes where no count can pass them (half the vector work of int64).
    acc = torch.int32 if numel < 2**31 else torch.int64
    above_max, underflow, nan = events.above_max, events.underflow, events.nan
    if not events.masks:
        above_max = above_max & ~nan
    above, under, nans = (t.to(acc).sum(dtype=acc).to(torch.int64)
                          for t in (above_max, underflow, nan))
    if events.masks:  # sums of -1s, the NaNs among the overflows
        above, under, nans = nans - above, -under, -nans
    return [above, under, nans, torch.full((), numel, dtype=torch.int64, device=nan.device)]


def quantize(x: torch.Tensor, fmt: str, rounding: str, sr_bits: int, seed: int,
             drawn_seed: Optional[torch.Tensor], offset: int, dtype: torch.dtype,
             count: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``lowfp::quantize``'s result and counts in torch operations (the arguments are the
    operator's; docs/design.md §3)."""
    p = round_params(fmt, rounding, sr_bits, x.dtype, dtype)
    c = FLOAT64_CARRIER if p["carrier_bits"] == 64 else FLOAT32_CARRIER
    kind = round_kind(rounding)
    lanes = lanes_of(c, kind)
    # x itself is stored, not its bits: a GEMM's result, already a buffer, is then read in
    # place instead of copied into a buffer of its bits
    bits = stored(x).to(c.float_dtype).view(c.int_dtype).to(lanes.dtype)
    rand = random_words(x.shape, x.device, seed, drawn_seed, offset) if kind == "stochastic" else None
    if rounds_by_addition(p, c, kind) and keeps_sign_on_overflow(p, c):
        result, events = round_by_addition(bits, p, c)
    else:
        result, events = round_bits(bits, p, c, kind, rand, lanes)
    y = to_storage(result, c, dtype)
    if not count:
        return y, x.new_empty(0, dtype=torch.int64)
    return y, torch.stack(event_counts(events, x.numel()))


_FUSION_CHOICES = ("auto", "1", "0")


def fuses(device: torch.device) -> bool:
    """Whether Inductor generates lowfp's roundings of tensors on ``device`` inside its kernels
    (``LOWFP_INDUCTOR_FUSION``, read when a graph is traced): ``1`` always, ``0`` never (the
    compiled code calls lowfp's native kernel), ``auto`` (the default) on CUDA devices only.

    Why auto: on a GPU each call of the operator from compiled code costs host time that the
    GPU waits for, which fusion removes. On a CPU lowfp's own vectorised kernel rounds faster
    than the code Inductor generates from integer operations, and each fused rounding adds
    compile time (docs/design.md §3.1 and bench/RESULTS.md have the figures)."""
    choice = os.environ.get("LOWFP_INDUCTOR_FUSION", "auto")
    if choice not in _FUSION_CHOICES:
        raise ValueError(f"LOWFP_INDUCTOR_FUSION must be one of {', '.join(_FUSION_CHOICES)}, "
                         f"got {choice!r}")
    return choice == "1" or (choice == "auto" and device.type == "cuda")
