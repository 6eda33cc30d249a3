"""Scaled formats (docs/design.md §9): ``lowfp.Scaled`` and the named ones (MX, NVFP4, FP8 with
per-tensor, per-row and block scales).

A scaled format stores each element q on an element format E's grid together with one scale
s > 0 per block, x ≈ s · q. For a block whose largest finite magnitude is a (NaN and ±inf left
out; a block without a finite nonzero element takes the smallest scale):

- ``scale="e8m0"``: s = 2^k, k clamped to [-127, 127], by ``scale_rule``:
    ``"floor"`` (OCP MX v1.0): k = floor(log2 a) - emax_E;
    ``"ceil"``: k = ceil(log2(a / max_E)), the smallest power of two that keeps a / s <= max_E;
    ``"rceil"`` (cuBLAS, torchao RCEIL): d = a / max_E rounded to float32, k = d's exponent
    rounded up (plus 1 unless d is a power of two);
    ``"even"`` (torchao EVEN): a rounded to E's mantissa bits, halves away from zero, then floor.
- ``scale=<a lowfp format S>`` or ``"float32"``: s = round_S(a / max_E) to nearest, saturating at
  S's largest value and held at its smallest positive one. With ``tensor_scale=True`` (NVFP4) a
  float32 t = amax / (max_S · max_E) over the whole tensor is kept too: the stored block scale is
  round_S(a / (max_E · t)) and the block's scale is its product with t.

``four_over_six="mse"`` or ``"mae"`` (NVFP4 only: FP4 E2M1 elements, E4M3 scales, a tensor scale;
"4over6", arXiv 2512.02010, TransformerEngine's ``nvfp4_4over6``): the tensor scale is
t = amax / (256 · max_E) and each block weighs two scales, the usual round_S(a / (6 t)) · t and
round_S(a / (4 t)) · t, which maps a to 4; it keeps the one whose rounded elements leave the smaller
error over the block's finite elements x, the sum of (x - s·q)^2 (``"mse"``) or of |x - s·q|
(``"mae"``), each difference and square rounded to float64 and summed in float64 in row-major
order; a tie keeps 6's.

Each element becomes q = round_E(x / s) by the call's rounding mode (the exact quotient, rounded
once; stochastic rounding with the usual Philox words by element index), saturating unless
``overflow=`` says otherwise, and the result is s · q in x's dtype (rounded to nearest even when
that dtype cannot hold it).

Granularity: ``axis=None`` keeps one scale per tensor; otherwise blocks run along ``axis`` (a GEMM
operand's reduction axis): ``block=None`` for one scale per slice along it (per row for
``axis=-1``), ``block=B`` for 1-D blocks of B consecutive elements (the last block of a slice
may be shorter), ``block=(B0, B1)`` for 2-D blocks over the last two dims (``axis=-1``).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch

from .. import _C
from .._checks import check_choice, check_int
from ..formats import Format, named as _named_formats, parse_named_or_call, to_format

__all__ = ["Scaled", "E8M0_RULES", "named", "to_scaled", "layout", "scales_shape"]

# The scale rules and the element formats' widest mantissa, from the native contract
E8M0_RULES = tuple(name for name in _C.ScaleRule.__members__ if name != "nearest")
FOUR_OVER_SIX_ERRORS = ("mse", "mae")  # Scaled(four_over_six=): the error a block's choice minimises
MAX_ELEMENT_MANTISSA = _C.SCALED_MAX_ELEMENT_MANTISSA  # exact stochastic rounding of the quotient (§9)
FLOAT32 = Format(8, 23, 0, specials="ieee")  # float32 as a scale format


class Scaled:
    """A scaled format: ``element`` values times one scale per block (see the module docs).

    Args:
        element: the element format E (a lowfp Format or its string, at most 19 mantissa bits,
            fitting float32).
        block: None, an int B >= 1, or a pair (B0, B1) for 2-D blocks over the last two dims.
        axis: the axis blocks run along, or None for one scale per tensor.
        scale: ``"e8m0"`` (power-of-two scales), ``"float32"`` or a lowfp format S.
        scale_rule: ``"floor"``, ``"ceil"``, ``"rceil"`` or ``"even"`` for e8m0 scales (default
            ``"floor"``); ``"nearest"`` for the others (their only rule).
        tensor_scale: a second-level float32 tensor scale (scales in a format only).
        four_over_six: None, ``"mse"`` or ``"mae"``: each block keeps the scale mapping its
            largest magnitude to 6 or to 4, whichever leaves the smaller error (NVFP4's E2M1
            elements, E4M3 scales and tensor scale only).
    """

    __slots__ = ("_key",)

    def __init__(self, element: Union[Format, str], *, block: Union[None, int, Tuple[int, int]] = None,
                 axis: Optional[int] = -1, scale: Union[str, Format] = "e8m0",
                 scale_rule: Optional[str] = None, tensor_scale: bool = False,
                 four_over_six: Optional[str] = None):
        element = to_format(element, "element")
        if element.m > MAX_ELEMENT_MANTISSA:
            raise ValueError(f"element {element} has {element.m} mantissa bits; scaled formats take "
                             f"at most {MAX_ELEMENT_MANTISSA}")
        reason = element.fit_error(torch.float32)
        if reason:
            raise ValueError(f"element {element} does not fit float32 ({reason})")
        if block is not None:
            if isinstance(block, (tuple, list)):
                if len(block) != 2:
                    raise ValueError(f"block must be an int or a pair (B0, B1), got {block!r}")
                block = (check_int(block[0], "block[0]"), check_int(block[1], "block[1]"))
                if axis not in (-1,):
                    raise ValueError("2-D blocks run over the last two dims: axis must be -1")
            else:
                block = check_int(block, "block")
            if min(block if isinstance(block, tuple) else (block,)) < 1:
                raise ValueError(f"block sizes must be >= 1, got {block!r}")
        if axis is not None:
            axis = check_int(axis, "axis")
        elif block is not None:
            raise ValueError("block needs an axis to run along (axis=None is one scale per tensor)")
        if isinstance(scale, str) and scale in ("e8m0", "float32"):
            scale_key = scale
        else:
            scale = to_format(scale, "scale")
            scale_key = scale
            if scale == FLOAT32:
                scale_key = "float32"
        if scale_key == "e8m0":
            scale_rule = "floor" if scale_rule is None else scale_rule
            check_choice(scale_rule, E8M0_RULES, "scale_rule")
            if tensor_scale:
                raise ValueError("tensor_scale goes with scales in a format (NVFP4), not e8m0")
        else:
            scale_rule = "nearest" if scale_rule is None else scale_rule
            check_choice(scale_rule, ("nearest",), "scale_rule")
        if not isinstance(tensor_scale, bool):
            raise TypeError(f"tensor_scale must be a bool, got {tensor_scale!r}")
        if four_over_six is not None:
            check_choice(four_over_six, FOUR_OVER_SIX_ERRORS, "four_over_six")
            if not (element == _F["float4_e2m1fn"] and scale_key == _F["float8_e4m3fn"] and tensor_scale):
                raise ValueError("four_over_six is an NVFP4 option: element float4_e2m1fn, scale "
                                 "float8_e4m3fn and tensor_scale=True")
        self._key = (element, block, axis, scale_key, scale_rule, tensor_scale, four_over_six)

    element = property(lambda self: self._key[0], doc="element format E")
    block = property(lambda self: self._key[1], doc="None, B or (B0, B1)")
    axis = property(lambda self: self._key[2], doc="the axis blocks run along (None: per tensor)")
    scale = property(lambda self: self._key[3], doc='"e8m0", "float32" or the scale Format')
    scale_rule = property(lambda self: self._key[4])
    tensor_scale = property(lambda self: self._key[5])
    four_over_six = property(lambda self: self._key[6], doc='None, "mse" or "mae"')

    def with_axis(self, axis: Optional[int]) -> "Scaled":
        """This format with its blocks (or per-slice scales) along ``axis``, every other option
        kept."""
        e, block, _, scale, rule, t, choice = self._key
        return Scaled(e, block=block, axis=axis, scale=scale, scale_rule=rule, tensor_scale=t,
                      four_over_six=choice)

    @property
    def scale_format(self) -> Optional[Format]:
        """The scale format S (float32 for ``"float32"``; None for e8m0)."""
        s = self.scale
        return None if s == "e8m0" else FLOAT32 if s == "float32" else s

    @property
    def scale_bits(self) -> int:
        s = self.scale
        return 8 if s == "e8m0" else 32 if s == "float32" else s.bits

    @property
    def bits(self) -> float:
        """Storage per element with a block's scale shared out (per-tensor scales: E's bits)."""
        b = self.block
        if self.axis is None or b is None:
            return float(self.element.bits)
        n = b[0] * b[1] if isinstance(b, tuple) else b
        return self.element.bits + self.scale_bits / n

    @property
    def name(self) -> Optional[str]:
        return _NAME_OF.get(self.key)  # (a tuple of constants: Dynamo traces its hash)

    @property
    def key(self) -> Tuple:
        e, block, axis, s, rule, t, choice = self._key
        return ("scaled", e.key, block, axis, s if isinstance(s, str) else s.key, rule, t, choice)

    # (by _key, whose formats compare and hash by their own keys: what key compares, without
    # building it; formats are dict keys of every prepared rounding)
    def __eq__(self, other) -> bool:
        return isinstance(other, Scaled) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __str__(self) -> str:
        if self.name is not None:
            return self.name
        e, block, axis, s, rule, t, choice = self._key
        parts = [repr(str(e)), f"block={block!r}", f"axis={axis!r}", f"scale={str(s)!r}"]
        if rule not in ("floor", "nearest"):
            parts.append(f"scale_rule={rule!r}")
        if t:
            parts.append("tensor_scale=True")
        if choice is not None:
            parts.append(f"four_over_six={choice!r}")
        return f"Scaled({', '.join(parts)})"

    __repr__ = __str__

    def __reduce__(self):
        return (Scaled.parse, (str(self),))

    @staticmethod
    def parse(text: str) -> "Scaled":
        """A named scaled format (``"mxfp8_e4m3"``, ``"nvfp4"``) or ``"Scaled('float8_e4m3fn',
        block=32, ...)"``."""
        named, call = parse_named_or_call(text, _NAMED, "Scaled", "scaled format",
                                          "\"Scaled('float8_e4m3fn', block=32)\"")
        if named is not None:
            return named
        args, kwargs = call
        if isinstance(kwargs.get("block"), list):
            kwargs["block"] = tuple(kwargs["block"])
        return Scaled(*args, **kwargs)


_F = _named_formats()
_NAMED: Dict[str, Scaled] = {
    # OCP MX v1.0: 32 elements share a power-of-two scale, floor rule.
    "mxfp8_e4m3": Scaled(_F["float8_e4m3fn"], block=32),
    "mxfp8_e5m2": Scaled(_F["float8_e5m2"], block=32),
    "mxfp6_e3m2": Scaled(_F["float6_e3m2fn"], block=32),
    "mxfp6_e2m3": Scaled(_F["float6_e2m3fn"], block=32),
    "mxfp4_e2m1": Scaled(_F["float4_e2m1fn"], block=32),
    # NVFP4: 16 FP4 elements share an E4M3 scale under a float32 tensor scale.
    "nvfp4": Scaled(_F["float4_e2m1fn"], block=16, scale=_F["float8_e4m3fn"], tensor_scale=True),
    # NVFP4 with 4over6 block scales, choosing by squared error as its paper's reference does.
    "nvfp4_4over6": Scaled(_F["float4_e2m1fn"], block=16, scale=_F["float8_e4m3fn"], tensor_scale=True,
                           four_over_six="mse"),
    # FP8 with float32 scales: per tensor (TransformerEngine's current scaling), per row
    # (torchao's rowwise), 1×128 blocks (activations) and 128×128 blocks (weights) as in
    # DeepSeek-V3.
    "fp8_e4m3_tensorwise": Scaled(_F["float8_e4m3fn"], axis=None, scale="float32"),
    "fp8_e5m2_tensorwise": Scaled(_F["float8_e5m2"], axis=None, scale="float32"),
    "fp8_e4m3_rowwise": Scaled(_F["float8_e4m3fn"], scale="float32"),
    "fp8_e5m2_rowwise": Scaled(_F["float8_e5m2"], scale="float32"),
    "fp8_e4m3_block128": Scaled(_F["float8_e4m3fn"], block=128, scale="float32"),
    "fp8_e4m3_block128x128": Scaled(_F["float8_e4m3fn"], block=(128, 128), scale="float32"),
}
_NAME_OF = {f.key: name for name, f in _NAMED.items()}


def named() -> Dict[str, Scaled]:
    """The named scaled formats, by name."""
    return dict(_NAMED)


def to_scaled(value) -> Optional[Scaled]:
    """value as a Scaled when it is one or names one (its string), else None."""
    if isinstance(value, Scaled):
        return value
    if isinstance(value, str):
        s = value.strip()
        if s in _NAMED:
            return _NAMED[s]
        if s.startswith("Scaled("):
            return Scaled.parse(s)
    return None


def layout(shape, fmt: Scaled):
    """(rows, cols, block_rows, block_cols, axis to move last or None) of a tensor of ``shape``."""
    numel = 1
    for n in shape:
        numel *= n
    dim = len(shape)
    if fmt.axis is None:
        cols = shape[-1] if dim >= 2 else numel
        rows = numel // cols if cols else 0
        return rows, cols, max(rows, 1), max(cols, 1), None
    if dim == 0:
        raise ValueError(f"{fmt} scales along axis {fmt.axis}; x is a 0-d tensor")
    if not -dim <= fmt.axis < dim:
        raise ValueError(f"{fmt} scales along axis {fmt.axis}; x has {dim} dims")
    axis = fmt.axis % dim
    cols = shape[axis]
    rows = numel // cols if cols else 0
    block = fmt.block
    if isinstance(block, tuple):
        if dim < 2:
            raise ValueError(f"{fmt} has 2-D blocks; x has {dim} dim")
        if dim > 2 and shape[-2] % block[0]:
            raise ValueError(f"{fmt}: 2-D blocks of {block[0]} rows would span the leading dims "
                             f"of a tensor of shape {tuple(shape)} (dim -2 is not a multiple)")
        return rows, cols, block[0], block[1], None
    return rows, cols, 1, max(cols if block is None else block, 1), (axis if axis != dim - 1 else None)


def kernel_layout(shape, fmt: Scaled, contiguous: bool, stochastic: bool):
    """(rows, cols, block_rows, block_cols, move, column_axis) of the kernel's call on a tensor of
    ``shape``: layout()'s (column_axis None), except for 1-D blocks (or per-slice scales) along an
    axis that is not last in a rounding of a contiguous tensor, where no block spans two positions
    of the axes before that axis (there is one, or the axis holds whole blocks). Such a tensor is
    read where it lies, as a (rows, cols) matrix of its own row-major order whose blocks are
    block_rows × 1 (one position of the axes after the axis, block_rows of its elements;
    column_axis the axis), not copied with the axis moved last. Stochastic rounding draws its
    words by the element indices of the moved layout (docs/design.md §9), which the kernel finds
    from the axis' length (word_run) when it is a multiple of 4; other lengths keep the copy."""
    rows, cols, brows, bcols, move = layout(shape, fmt)
    if move is None or not contiguous or (stochastic and shape[move] % 4):
        return rows, cols, brows, bcols, move, None
    along = shape[move]
    outer = 1
    for n in shape[:move]:
        outer *= n
    block = bcols  # (the axis's length for a per-slice scale)
    if outer > 1 and along % block:
        return rows, cols, brows, bcols, move, None
    inner = 1
    for n in shape[move + 1:]:
        inner *= n
    return outer * along, inner, block, 1, None, move


def word_run(shape, column_axis, stochastic: bool) -> int:
    """The kernel's word_run for kernel_layout's answer: the length of the column layout's axis
    for a stochastic rounding (its words by the moved layout's indices), else 0."""
    return shape[column_axis] if stochastic and column_axis is not None else 0


def column_scales(scales, shape, axis: int, block: int):
    """kernel_layout's scales of a column layout (its grid of blocks) shaped as the tensor, ``axis``
    holding the blocks."""
    return scales.reshape(*shape[:axis], -(-shape[axis] // block), *shape[axis + 1:])


def kernel_scales(grid_scales, shape, fmt: Scaled, move, column_axis, block_rows: int):
    """The grid of scales of kernel_layout's call on a tensor of ``shape`` (its move, column
    axis and block rows) shaped as the tensor's scales: column_scales or scales_shape."""
    if column_axis is not None:
        return column_scales(grid_scales, shape, column_axis, block_rows)
    moved = tuple(shape) if move is None else (*shape[:move], *shape[move + 1:], shape[move])
    return scales_shape(grid_scales, moved, fmt, move)


def scales_shape(scales, moved_shape, fmt: Scaled, move):
    """The (grid rows, grid cols) scales shaped as the tensor, its block axis (axes) holding the
    blocks; 0-d for a per-tensor scale."""
    if fmt.axis is None:
        return scales.reshape(())
    if isinstance(fmt.block, tuple):
        if len(moved_shape) <= 2:
            return scales
        return scales.reshape(*moved_shape[:-2], moved_shape[-2] // fmt.block[0], scales.shape[1])
    s = scales.reshape(*moved_shape[:-1], scales.shape[1])
    return s if move is None else s.movedim(-1, move)
