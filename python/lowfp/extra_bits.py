"""16-bit weights plus k packed extra bits (docs/design.md §5).

>>> import torch, lowfp
>>> w = torch.tensor([1.0 + 2**-9 + 2**-20, -3.14159])
>>> w16, packed = lowfp.extra_bits.split(w, torch.bfloat16, k=16)
>>> torch.equal(lowfp.extra_bits.merge(w16, packed, k=16), w)   # bfloat16 + 16 bits = float32
True

``split`` rounds W to the 16-bit type (``rounding``: ``"toward_zero"``, ``"nearest"`` or
``"stochastic"``) and keeps the k bits of W's significand just below the 16-bit truncation's last
bit, plus a flag bit for modes other than toward_zero; ``merge`` returns W truncated to 16-bit
precision + k bits. Packing: q = k (+1) bits per element, blocks of 32 elements in q int32 words.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from . import _C, backends
from ._checks import check_choice, check_int, is_dtype_in, is_int
from .backends import inverse_order
from ._native import as_int64, call_seed, check_uint64
from .formats import Format, to_format
from .stats import Stats

__all__ = ["split", "merge", "packed_words", "bits_per_element", "EXTRA_BITS_ROUNDING", "max_extra_bits",
           "unpack", "pack"]

EXTRA_BITS_ROUNDING = ("toward_zero", "nearest", "stochastic")
_MAX_K = {torch.bfloat16: 16, torch.float16: 13}


def max_extra_bits(dtype: torch.dtype, dtype_name: str = "dtype") -> int:
    """The most extra bits a ``dtype`` (float16: 13, bfloat16: 16) takes; ``dtype_name`` is
    what an error calls the argument."""
    if not is_dtype_in(dtype, _MAX_K):
        raise TypeError(f"{dtype_name} must be torch.float16 or torch.bfloat16, got {dtype}")
    return _MAX_K[dtype]


def check_extra_bits(dtype: torch.dtype, k, rounding: str, name: str = "k",
                     dtype_name: str = "dtype") -> None:
    kmax = max_extra_bits(dtype, dtype_name)
    check_int(k, name)
    if not 1 <= k <= kmax:
        raise ValueError(f"{name} must be between 1 and {kmax} for {dtype}, got {k}")
    check_choice(rounding, EXTRA_BITS_ROUNDING, "rounding")


_OWN_FORMAT = {torch.bfloat16: Format(8, 7, specials="ieee"), torch.float16: Format(5, 10, specials="ieee")}


def _grid_key(f: Format) -> tuple:
    return f.e, f.m, f.b, f.specials, f.subnormals


def check_weight_format(weight_format, dtype: torch.dtype, k, rounding: str,
                        name: str = "weight_format", k_name: str = "k",
                        dtype_name: str = "dtype") -> Optional[str]:
    """The canonical string of a weight format F for weights of ``dtype`` with k extra bits, or
    None for the 16-bit type's own grid (``weight_format`` None, or F equal to it). F's values
    must all be ``dtype``'s; k at most 16 and 23 - F's mantissa bits, and F's smallest step over
    2^k at least 2^-126 (the merged W' is a float32)."""
    if weight_format is None:
        check_extra_bits(dtype, k, rounding, k_name, dtype_name)
        return None
    f = to_format(weight_format, name)
    max_extra_bits(dtype, dtype_name)
    limits = _OWN_FORMAT[dtype]
    if _grid_key(f) == _grid_key(limits):
        check_extra_bits(dtype, k, rounding, k_name, dtype_name)
        return None
    if f.m > limits.m or f.max > limits.max or f.smallest < limits.smallest:
        raise ValueError(f"{name} {f} does not fit {dtype}: its values must be {dtype} values "
                         f"(at most {limits.m} mantissa bits, largest {limits.max:g}, smallest "
                         f"{limits.smallest:g})")
    check_int(k, k_name)
    k_max = min(16, 23 - f.m, int(math.log2(f.smallest)) + 126)
    if not 1 <= k <= k_max:
        raise ValueError(f"{k_name} must be between 1 and {k_max} for weights on {f}'s grid, "
                         f"got {k}")
    check_choice(rounding, EXTRA_BITS_ROUNDING, "rounding")
    return str(Format(f.e, f.m, f.b, specials=f.specials, subnormals=f.subnormals))


def bits_per_element(k: int, rounding: str) -> int:
    """q: k extra bits, plus the flag bit that modes other than toward_zero need."""
    return k + (0 if rounding == "toward_zero" else 1)


def packed_words(numel: int, k: int, rounding: str) -> int:
    """int32 words holding ``numel`` elements: ceil(numel / 32) * q."""
    return (numel + 31) // 32 * bits_per_element(k, rounding)


def split(w32: torch.Tensor, dtype: torch.dtype = torch.bfloat16, k: int = 16,
          rounding: str = "toward_zero", *, seed: Optional[int] = None,
          generator: Optional[torch.Generator] = None, offset: int = 0,
          stats: Optional[Stats] = None, weight_format=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split float32 ``w32`` into a ``dtype`` tensor of the same shape and its packed extra bits
    (int32, ``packed_words(numel, k, rounding)`` words, elements in row-major order). Stochastic
    rounding draws Philox words as :func:`lowfp.quantize` does (``seed``, ``generator``,
    ``offset``); ``stats`` counts the 16-bit weights' overflows, underflows and NaNs.

    ``weight_format``: a lowfp format F whose values ``dtype`` holds (``"float8_e5m2"``,
    ``"fp(4,3,4)"``): the weights are W rounded to F (saturating at F's largest value) and the
    extra bits are the k bits below F's last bit (docs/design.md §5)."""
    if not isinstance(w32, torch.Tensor) or w32.dtype != torch.float32:
        raise TypeError(f"w32 must be a float32 torch.Tensor, got "
                        f"{w32.dtype if isinstance(w32, torch.Tensor) else type(w32).__name__}")
    grid = check_weight_format(weight_format, dtype, k, rounding)
    backends.check_operand(w32, "w32")
    if stats is not None and (not isinstance(stats, Stats) or stats.device != w32.device):
        raise ValueError(f"stats must be a lowfp.Stats on {w32.device}")
    if rounding != "stochastic":
        seed, generator = None, None
    seed, drawn = call_seed(rounding, seed, generator)
    offset = as_int64(check_uint64(offset, "offset"))
    w16, packed, counts = torch.ops.lowfp.extra_bits_split(w32, dtype, k, rounding, 32, seed, drawn,
                                                           offset, stats is not None, grid)
    if stats is not None:
        stats.accumulate(counts)
    return w16, packed


def merge(w16: torch.Tensor, packed: torch.Tensor, k: int = 16, rounding: str = "toward_zero",
          *, weight_format=None) -> torch.Tensor:
    """W' (float32, w16's shape) from a 16-bit tensor and its packed extra bits (split with the
    same ``k``, ``rounding`` and ``weight_format``)."""
    if not isinstance(w16, torch.Tensor):
        raise TypeError(f"w16 must be a torch.Tensor, got {type(w16).__name__}")
    max_extra_bits(w16.dtype, "w16's dtype")
    grid = check_weight_format(weight_format, w16.dtype, k, rounding)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int32:
        raise TypeError("packed must be an int32 torch.Tensor")
    backends.check_operand(w16, "w16")
    backends.check_operand(packed, "packed")
    if packed.device != w16.device:
        raise ValueError(f"packed is on {packed.device} but w16 is on {w16.device}")
    want = packed_words(w16.numel(), k, rounding)
    if packed.numel() != want:
        raise ValueError(f"packed has {packed.numel()} words but {w16.numel()} elements with "
                         f"k={k}, rounding={rounding!r} need {want}")
    return torch.ops.lowfp.extra_bits_merge(w16, packed, k, rounding, grid)


def _bit_positions(numel: int, q: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(word, shift) of each element's first bit: element i's q bits start at bit (i % 32) q of
    its block of 32 elements, whose q words run from word (i // 32) q (docs/design.md §5)."""
    i = torch.arange(numel, dtype=torch.int64, device=device)
    bit = (i % 32) * q
    return (i // 32) * q + bit // 32, bit % 32


def unpack(packed: torch.Tensor, numel: int, k: int, rounding: str) -> torch.Tensor:
    """The q = k (+1) bits of each of ``numel`` elements held in ``packed`` words, one int32 per
    element (the flag bit, where the rounding has one, is bit k): the per-element form in which
    sharded optimizer state is saved, so that a checkpoint reshards like the parameters."""
    q = bits_per_element(k, rounding)
    if packed.numel() != packed_words(numel, k, rounding):
        raise ValueError(f"packed has {packed.numel()} words but {numel} elements with k={k}, "
                         f"rounding={rounding!r} need {packed_words(numel, k, rounding)}")
    words = torch.cat([packed.reshape(-1), packed.new_zeros(1)]).to(torch.int64) & 0xFFFFFFFF
    word, shift = _bit_positions(numel, q, packed.device)
    window = words[word] | (words[word + 1] << 32)  # the next word only matters past bit 31
    return ((window >> shift) & ((1 << q) - 1)).to(torch.int32)


def pack(values: torch.Tensor, k: int, rounding: str) -> torch.Tensor:
    """The inverse of :func:`unpack`: int32 ``values`` (each below 2^q, in row-major order)
    packed into ``packed_words(values.numel(), k, rounding)`` int32 words."""
    q = bits_per_element(k, rounding)
    v = values.reshape(-1).to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << q):
        raise ValueError(f"extra-bit values must lie in [0, 2^{q}) for k={k}, rounding={rounding!r}")
    n = v.numel()
    word, shift = _bit_positions(n, q, values.device)
    # Elements' bits never overlap, so adding their shifted parts is or-ing them.
    acc = torch.zeros(packed_words(n, k, rounding) + 1, dtype=torch.int64, device=values.device)
    shifted = v << shift
    acc.index_add_(0, word, shifted & 0xFFFFFFFF)
    acc.index_add_(0, word + 1, shifted >> 32)
    acc = acc[:-1]
    return torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)


# -- memory order ---------------------------------------------------------------------------------
# The optimizers pack a parameter's extra bits in the order of its elements in memory
# (backends.memory_order), so that the fused step walks the weights, gradients, moments and packed
# words side by side whatever the layout (channels_last convolution weights, a transposed weight).
# split and merge above pack in row-major order: a parameter's order is recorded with its packed
# words when it is not that.

def reorder_packed(packed: torch.Tensor, shape: Sequence[int], k: int, rounding: str,
                   old: Optional[Sequence[int]], new: Optional[Sequence[int]]) -> torch.Tensor:
    """Packed extra bits of a tensor of ``shape`` whose elements were packed in memory order
    ``old`` (a :func:`lowfp.backends.memory_order`; None: row-major), repacked in order ``new``:
    the same bits per element, moved. Done on the CPU (a layout change is rare); returned on
    packed's device."""
    shape = tuple(shape)
    n = math.prod(shape)
    if not is_int(k) or not 1 <= k <= 16:
        raise ValueError(f"k must be an int between 1 and 16, got {k!r}")
    check_choice(rounding, EXTRA_BITS_ROUNDING, "rounding")
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int32:
        raise TypeError("packed must be an int32 torch.Tensor")
    if packed.numel() != packed_words(n, k, rounding):
        raise ValueError(f"packed has {packed.numel()} words but {n} elements with k={k}, "
                         f"rounding={rounding!r} need {packed_words(n, k, rounding)}")
    old, new = (tuple(range(len(shape))) if o is None else tuple(o) for o in (old, new))
    for name, order in (("old", old), ("new", new)):
        if sorted(order) != list(range(len(shape))):
            raise ValueError(f"{name} must be an order of the {len(shape)} dims of shape {shape} "
                             f"(or None: row-major), got {order}")
    # index[j]: where the element at position j of the new order sits in the old order
    positions = torch.arange(n, dtype=torch.int64).reshape([shape[d] for d in old])
    index = positions.permute(inverse_order(old)).permute(tuple(new)).reshape(-1)
    src = packed.detach().cpu().contiguous()
    dst = torch.empty_like(src)
    _C.extra_bits_gather(src.data_ptr(), index.data_ptr(), n, bits_per_element(k, rounding),
                         dst.data_ptr())
    return dst.to(packed.device)
