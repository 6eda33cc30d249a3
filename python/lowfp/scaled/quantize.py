"""Rounding to a scaled format: the lowfp::scaled_quantize operator and the public functions.

The tensor is laid out as (rows, cols) with the block axis last (a copy when it is not), so
that a block is block_rows × block_cols of that matrix: 1-D blocks are (1, B), a per-slice scale
(1, cols), 2-D blocks (B0, B1) and a per-tensor scale the whole matrix. Stochastic rounding draws
by element index in that layout (the tensor's own row-major order when the block axis is last).
A rounding of a contiguous tensor along another axis reads it where it lies, its blocks B × 1
(config.kernel_layout; stochastic rounding where that axis' length is a multiple of 4, the kernel
finding each element's index in the moved layout from it): the same results without the copy.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .. import _C, backends
from .._checks import check_choice
from .._dtensor import is_dtensor
from .._memory import new_output
from .._ops import philox_key
from .._prepared import Prepared
from .._inductor import register_inductor_decompositions
from .._native import (DTYPE_CODES, ROUNDING_MODES, as_int64, call_seed, check_tensor_args,
                       check_uint64, eager_seed, remembered_seed, runs_natively)
from ..formats import OVERFLOW_POLICIES, Format
from ..stats import Stats
from .config import Scaled, kernel_layout, kernel_scales, layout, to_scaled, word_run

__all__ = ["ScaledStats", "ScaledParts", "quantize_scaled", "encode", "hadamard", "hadamard_signs"]

_U64 = (1 << 64) - 1

lib = torch.library.Library("lowfp", "FRAGMENT")
lib.define("scaled_quantize(Tensor x, str fmt, str rounding, str overflow, int sr_bits, int seed, "
           "Tensor? drawn_seed, int offset, bool count, bool parts) -> "
           "(Tensor, Tensor, Tensor, Tensor, Tensor)")
lib.define("scaled_quantize_into(Tensor x, Tensor(a!) out, str fmt, str rounding, str overflow, "
           "int sr_bits, int seed, Tensor? drawn_seed, int offset, bool count) -> Tensor")
# lowfp::scaled_quantize as Inductor's graphs call it where they keep lowfp's kernel (as
# lowfp::quantize_in_graph for lowfp::quantize: no autograd formula, lowfp._inductor)
lib.define("scaled_quantize_in_graph(Tensor x, str fmt, str rounding, str overflow, int sr_bits, "
           "int seed, Tensor? drawn_seed, int offset, bool count, bool parts) -> "
           "(Tensor, Tensor, Tensor, Tensor, Tensor)")


class ScaledStats(Stats):
    """:class:`lowfp.Stats` for scaled formats: element overflow, underflow, NaN and numel, plus
    ``saturated_blocks`` (blocks whose ideal scale lay outside the scale format's range) and
    ``blocks``."""

    def __init__(self, device="cpu"):
        self.counts = torch.zeros(6, dtype=torch.int64, device=device)

    saturated_blocks = property(lambda self: int(self.counts[4]))
    blocks = property(lambda self: int(self.counts[5]))

    def as_dict(self):
        return dict(zip(("overflow", "underflow", "nan", "numel", "saturated_blocks", "blocks"),
                        self.counts.tolist()))

    def __repr__(self) -> str:
        return "ScaledStats(" + ", ".join(f"{k}={v}" for k, v in self.as_dict().items()) + ")"


class ScaledParts(NamedTuple):
    """A scaled rounding's parts: ``q`` (the elements, on E's grid, float32, x's shape),
    ``scales`` (float64, one per block: x's shape with the block axis holding the blocks; per
    tensor: 0-d; the tensor scale included) and ``tensor_scale`` (float64 0-d; 1 without one).
    ``value`` is the dequantized result s · q in x's dtype."""
    value: torch.Tensor
    q: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor


@functools.lru_cache(maxsize=256)
def _parsed(fmt: str) -> Scaled:
    """An operator call's format string, parsed once."""
    return Scaled.parse(fmt)


def _spec(mod, f: Format):
    return mod.FormatSpec(e=f.e, m=f.m, b=f.b, specials=mod.Specials.__members__[f.specials],
                          subnormals=f.subnormals)


@functools.lru_cache(maxsize=1024)
def prepared(mod, fmt: Scaled, rounding: str, overflow: str, sr_bits: int, dtype: torch.dtype):
    """The native request (``mod.PreparedScaled``: lowfp._C's or lowfp._C_cuda's) of rounding
    ``dtype`` tensors to ``fmt``, built once by keyword and called with the buffers."""
    scale_format = fmt.scale_format
    return mod.PreparedScaled(
        element=_spec(mod, fmt.element), overflow=mod.Overflow.__members__[overflow],
        rounding=mod.Rounding.__members__[rounding], sr_bits=sr_bits,
        scale_rule=mod.ScaleRule.__members__[fmt.scale_rule],
        scale_format=None if scale_format is None else _spec(mod, scale_format),
        tensor_scale=fmt.tensor_scale,
        choice=mod.BlockChoice.__members__[_CHOICE_CODES[fmt.four_over_six]],
        dtype=mod.DType.__members__[str(dtype)[6:]])


_CHOICE_CODES = {None: "fixed", "mae": "four_over_six_mae", "mse": "four_over_six_mse"}


class PreparedScaled(Prepared):
    """A scaled format's rounding (lowfp._prepared): the format, the kernel's prepared request
    (``prepared``), whether it draws a stochastic seed, and for 1-D blocks along the last axis
    their length (0: one block per row), else None."""

    __slots__ = ("fmt", "request", "stochastic", "last_axis_block")
    stats_types = (Stats, ScaledStats)

    def __init__(self, fmt: Scaled, rounding: str, overflow: Optional[str], sr_bits: int,
                 x: torch.Tensor):
        self.fmt = fmt
        self.request = prepared(backends.native(x, "x")[0], fmt, rounding,
                                "saturate" if overflow is None else overflow, sr_bits, x.dtype)
        self.stochastic = rounding == "stochastic"
        self.last_axis_block = None
        if fmt.axis == -1 and not isinstance(fmt.block, tuple):
            self.last_axis_block = fmt.block or 0

    def round(self, x, counts, generator=None, out=None, seed=None, offset=0):
        """x (contiguous) rounded into a new tensor or ``out`` (contiguous, x's dtype), adding to
        counts (4 or 6 int64, or None); None, with nothing allocated, drawn or written, when the
        call needs the full path (a layout that needs a copy, a generator the per-thread draw
        does not cover). The scales and the tensor scale (last), which are not returned, go to
        one scratch buffer: on the CPU the same one each call of a thread (the kernel has finished
        with it when the call returns), on a GPU device_scratch's. Blocks along the last axis are
        laid out and run in C (lowfp._C.round_scaled); this method's own code is the definition of
        that call and runs the other layouts."""
        y = _round_scaled(self, x, counts, seed, generator, offset, out)
        if y is not None:
            return y
        if not x.is_contiguous():
            return None
        block = self.last_axis_block
        run = 0
        if block is not None and x.dim():
            cols = x.shape[-1]
            rows = x.numel() // cols if cols else 0
            block_rows, block_cols = 1, (block or cols)
        else:
            shape = tuple(x.shape)
            rows, cols, block_rows, block_cols, move, column = _kernel_layout(shape, self.fmt, True,
                                                                              self.stochastic)
            if move is not None:  # (a copy to another layout)
                return None
            run = word_run(shape, column, self.stochastic)
        # (drawn for empty tensors too, as the full path draws)
        seed = remembered_seed(self.stochastic, generator, seed)
        if seed is None:
            return None
        y = new_output(x, x.dtype) if out is None else out
        if rows and cols:
            _, device, stream = backends.native(x, "x")
            blocks = -(-rows // block_rows) * -(-cols // block_cols)
            if x.is_cpu:
                scratch = getattr(_scratch, "buffer", None)
                if scratch is None or scratch.numel() <= blocks:
                    scratch = _scratch.buffer = torch.empty(max(blocks + 1, 1024), dtype=torch.float64)
            else:
                scratch = device_scratch(x, blocks + 1)
            scratch_ptr = scratch.data_ptr()
            self.request(x.data_ptr(), y.data_ptr(), rows, cols, block_rows, block_cols, run, seed, offset,
                         scratch_ptr, 0, scratch_ptr + 8 * blocks,
                         0 if counts is None else counts.data_ptr(),
                         0 if counts is None else counts.numel(), device, stream)
        return y


_scratch = threading.local()  # each thread's float64 buffer for scales that are not returned
_round_scaled = _C.round_scaled
_kernel_layout = functools.lru_cache(maxsize=1024)(kernel_layout)  # (eager calls: shapes repeat each step)


def device_scratch(x: torch.Tensor, n: int) -> torch.Tensor:
    """A new float64 buffer of n elements on x's device, for a call's scales that it does not
    return (torch's caching allocator orders its reuse after the kernel on the stream)."""
    return torch.empty(n, dtype=torch.float64, device=x.device)


def _writes_directly(out: torch.Tensor, xm: torch.Tensor, move) -> bool:
    """Whether the kernel can write into ``out`` itself: contiguous in the kernel's layout, and
    either x itself (each element is read before it is written) or apart from x's memory."""
    if move is not None or not out.is_contiguous():
        return False
    if out.data_ptr() == xm.data_ptr():
        return True
    return out.untyped_storage().data_ptr() != xm.untyped_storage().data_ptr()


def _impl(x, fmt, rounding, overflow, sr_bits, seed, drawn_seed, offset, count, parts, out=None):
    scaled = _parsed(fmt)
    rows, cols, brows, bcols, move, column = kernel_layout(tuple(x.shape), scaled, x.is_contiguous(),
                                                           rounding == "stochastic")
    xm = (x if move is None else x.movedim(move, -1)).contiguous()
    direct = out is not None and _writes_directly(out, xm, move)
    y = out if direct else new_output(xm, xm.dtype)
    q = torch.empty(xm.shape if parts else (0,), dtype=torch.float32, device=x.device)
    grid = (-(-rows // brows) if rows else 0, -(-cols // bcols) if cols else 0)
    scales = torch.empty(grid, dtype=torch.float64, device=x.device)
    tensor_scale = torch.ones((), dtype=torch.float64, device=x.device)
    counts = torch.zeros(6 if count else 0, dtype=torch.int64, device=x.device)
    if xm.numel():
        mod, device, stream = backends.native(xm, "x")
        key = (int(drawn_seed[0]) | (int(drawn_seed[1]) << 32)) if drawn_seed is not None else seed & _U64
        prepared(mod, scaled, rounding, overflow, sr_bits, xm.dtype)(
            xm.data_ptr(), y.data_ptr(), rows, cols, brows, bcols,
            word_run(tuple(x.shape), column, rounding == "stochastic"), key, offset & _U64,
            scales.data_ptr(), q.data_ptr() if parts else 0, tensor_scale.data_ptr(),
            counts.data_ptr() if count else 0, 6, device, stream)
    scales = kernel_scales(scales, x.shape, scaled, move, column, brows)
    if move is not None:
        y = y.movedim(-1, move)
        if parts:
            q = q.movedim(-1, move)
    if out is not None and not direct:
        out.copy_(y)  # (a torch op: it marks out changed itself)
    elif direct:
        # Written through its pointer: tell autograd, as torch's in-place ops do, so that a
        # backward that saved out raises instead of reading the new values.
        torch.autograd.graph.increment_version(out)
    return y, q, scales, tensor_scale, counts


def round_in_graph(x, out, scales, tensor_scale, counts, fmt: str, rounding: str, overflow: str,
                   sr_bits: int, seed: int, offset: int, drawn_seed=None) -> None:
    """lowfp::scaled_quantize_in_graph as Inductor's generated code calls it on CPU tensors where
    its lowering has checked, once, that the kernel reads x where it lies (contiguous, not
    empty, its blocks in the kernel's layout, no q) and allocated the buffers
    (lowfp._inductor.scaled_into_planned_buffers): one pointer call of the prepared request,
    writing out (x itself, or a buffer apart from it), the scales' grid, the tensor scale and
    the counts (6, or None), without the dispatcher's round trip through Python. Inductor's
    cache keeps generated code that calls it across lowfp versions: keep its name and arguments."""
    mod, device, stream = backends.native(x, "x")  # (torch's thread count followed)
    scaled = _parsed(fmt)
    stochastic = rounding == "stochastic"
    shape = tuple(x.shape)
    rows, cols, brows, bcols, _, column = _kernel_layout(shape, scaled, True, stochastic)
    prepared(mod, scaled, rounding, overflow, sr_bits, x.dtype)(
        x.data_ptr(), out.data_ptr(), rows, cols, brows, bcols, word_run(shape, column, stochastic),
        philox_key(seed, drawn_seed), offset & _U64, scales.data_ptr(), 0, tensor_scale.data_ptr(),
        0 if counts is None else counts.data_ptr(), 6, device, stream)


def _into_impl(x, out, fmt, rounding, overflow, sr_bits, seed, drawn_seed, offset, count):
    return _impl(x, fmt, rounding, overflow, sr_bits, seed, drawn_seed, offset, count, False,
                 out=out)[4]


def _fake(x, fmt, rounding, overflow, sr_bits, seed, drawn_seed, offset, count, parts):
    scaled = Scaled.parse(fmt)
    rows, cols, brows, bcols, move, column = kernel_layout(tuple(x.shape), scaled, x.is_contiguous(),
                                                           rounding == "stochastic")
    moved = x if move is None else x.movedim(move, -1)
    grid = (-(-rows // brows) if rows else 0, -(-cols // bcols) if cols else 0)
    scales = kernel_scales(x.new_empty(grid, dtype=torch.float64), x.shape, scaled, move, column, brows)
    y = torch.empty_like(moved, memory_format=torch.contiguous_format)
    q = x.new_empty(moved.shape if parts else (0,), dtype=torch.float32)
    if move is not None:
        y = y.movedim(-1, move)
        q = q.movedim(-1, move) if parts else q
    return (y, q, scales, x.new_empty((), dtype=torch.float64),
            x.new_empty(6 if count else 0, dtype=torch.int64))


for _key in ("CPU", "CUDA"):
    lib.impl("scaled_quantize", _impl, _key)
    lib.impl("scaled_quantize_in_graph", _impl, _key)
    lib.impl("scaled_quantize_into", _into_impl, _key)
torch.library.register_fake("lowfp::scaled_quantize", _fake, lib=lib)
torch.library.register_fake("lowfp::scaled_quantize_in_graph", _fake, lib=lib)


@torch.library.register_fake("lowfp::scaled_quantize_into", lib=lib)
def _into_fake(x, out, fmt, rounding, overflow, sr_bits, seed, drawn_seed, offset, count):
    layout(tuple(x.shape), Scaled.parse(fmt))
    return x.new_empty(6 if count else 0, dtype=torch.int64)


def _backward(ctx, grad, *unused):
    return (grad,) + (None,) * 9


torch.library.register_autograd("lowfp::scaled_quantize", _backward,
                                setup_context=lambda ctx, inputs, output: None, lib=lib)


def _call(x, fmt: Scaled, rounding, overflow, seed, generator, offset, sr_bits, count, parts,
          out=None):
    """(y, q, scales, tensor scale, counts); with ``out``: only the counts, y written into out."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_tensor_args(x, out, None)
    if out is not None and out.dtype != x.dtype:
        raise ValueError(f"out must have x's dtype {x.dtype} for a scaled format (s · q is "
                         f"rounded to x's dtype), got {out.dtype}")
    check_choice(rounding, ROUNDING_MODES, "rounding")
    overflow = "saturate" if overflow is None else overflow
    check_choice(overflow, OVERFLOW_POLICIES, "overflow")
    if isinstance(sr_bits, bool) or not isinstance(sr_bits, int) or not 1 <= sr_bits <= 32:
        raise ValueError(f"sr_bits must be an int between 1 and 32, got {sr_bits!r}")
    layout(tuple(x.shape), fmt)  # shape errors before any drawing
    mode = backends.fake_mode_of(x) if type(x) is FakeTensor else None
    if mode is not None:  # a FakeTensor used outside its mode: its mode makes the drawn seed fake
        with mode:
            return _call(x, fmt, rounding, overflow, seed, generator, offset, sr_bits, count, parts,
                         out)
    offset = as_int64(check_uint64(offset, "offset"))
    if runs_natively(x, out):  # the operator's implementation, without the dispatcher
        seed = as_int64(eager_seed(rounding, seed, generator))
        res = _impl(x, str(fmt), rounding, overflow, sr_bits, seed, None, offset, count,
                    parts and out is None, out=out)
        return res[4] if out is not None else res
    seed, drawn = call_seed(rounding, seed, generator)
    compiling = torch.compiler.is_compiling()
    if compiling:
        register_inductor_decompositions()
    if out is not None and not compiling:
        return torch.ops.lowfp.scaled_quantize_into(x, out, str(fmt), rounding, overflow, sr_bits,
                                                    seed, drawn, offset, count)
    res = torch.ops.lowfp.scaled_quantize(x, str(fmt), rounding, overflow, sr_bits, seed, drawn,
                                          offset, count, parts and out is None)
    if out is not None:  # compiled: the functional operator (which Inductor fuses), then a copy
        out.copy_(res[0])
        return res[4]
    return res


HADAMARD_SIZE = 16


def hadamard_signs(seed: int, device=None) -> torch.Tensor:
    """The 16 random signs (±1.0, float32) of the Hadamard transform seeded with ``seed``: torch's
    CPU generator under that seed draws 16 bits."""
    seed = check_uint64(seed, "hadamard_seed")
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (HADAMARD_SIZE,), generator=g) * 2 - 1).float().to(device)


@functools.lru_cache(maxsize=64)
def _sign_values(seed: int) -> tuple:
    """hadamard_signs(seed) as Python floats (the native kernel's argument), drawn once."""
    return tuple(hadamard_signs(seed).tolist())


def _transform_axis(t: torch.Tensor, axis: int) -> torch.Tensor:
    """t with ``axis`` moved last, its length checked to hold whole groups."""
    work = t.movedim(axis, -1)
    if work.shape[-1] % HADAMARD_SIZE:
        raise ValueError(f"the Hadamard transform takes groups of {HADAMARD_SIZE} along axis {axis}, "
                         f"whose length {work.shape[-1]} is not a multiple")
    return work


def hadamard(t: torch.Tensor, signs: torch.Tensor, axis: int, inverse: bool = False) -> torch.Tensor:
    """The random Hadamard transform of each group of 16 consecutive elements along ``axis``:
    H16 · diag(signs) / 4 (orthonormal), or its inverse diag(signs) · H16 / 4. Butterflies of
    elementwise additions in t's dtype (float32 for 16-bit t) in the order of
    cpp/include/lowfp/hadamard.hpp, whose native kernel (eager NVFP4 roundings) gives the same
    bits, so the result is the same on every device, compiled or not."""
    work = _transform_axis(t, axis)
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    v = work.to(dtype).reshape(-1, HADAMARD_SIZE)
    signs = signs.to(device=v.device, dtype=dtype)
    if not inverse:
        v = v * signs
    h = 1
    while h < HADAMARD_SIZE:
        v = v.reshape(-1, HADAMARD_SIZE // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        v = torch.stack((a + b, a - b), dim=2)
        h *= 2
    v = v.reshape(-1, HADAMARD_SIZE) * 0.25
    if inverse:
        v = v * signs
    return v.reshape(work.shape).movedim(-1, axis)


def _hadamard_native(t: torch.Tensor, signs: tuple, axis: int, inverse: bool = False) -> torch.Tensor:
    """hadamard(t, signs, axis, inverse) by the native kernel, one pass (eager, a plain CPU or
    CUDA tensor); ``signs``: _sign_values."""
    work = _transform_axis(t, axis).contiguous()
    y = torch.empty(work.shape, dtype=torch.float64 if t.dtype == torch.float64 else torch.float32,
                    device=t.device)
    mod, device, stream = backends.native(work, "x")
    mod.hadamard16(work.data_ptr(), DTYPE_CODES[work.dtype], y.data_ptr(),
                   work.numel() // HADAMARD_SIZE, signs, inverse, device, stream)
    return y.movedim(-1, axis)


def quantize_scaled(x: torch.Tensor, fmt, rounding: str = "nearest", *, overflow=None, seed=None,
                    generator=None, offset: int = 0, sr_bits: int = 32,
                    stats: Optional[Stats] = None, hadamard_seed: Optional[int] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """s · q of every element of x under the scaled format ``fmt`` (lowfp.quantize's path for
    scaled formats; arguments as lowfp.quantize's, ``overflow`` the elements' policy, default
    ``"saturate"``). ``stats``: a lowfp.Stats (element counts) or a ScaledStats (block counts
    too). Gradients pass straight through. ``out``: write the result there instead (x's shape
    and dtype; it may be x itself) and return it.

    ``hadamard_seed``: quantize the random Hadamard transform of x instead (groups of 16 along
    the format's axis, signs from :func:`hadamard_signs`, as the NVFP4 training recipe does for
    gradients) and transform the result back; the transforms run in float32 (float64 for
    float64 x) and the result is cast to x's dtype."""
    fmt = _checked(fmt)
    if stats is not None and not isinstance(stats, Stats):
        raise TypeError(f"stats must be a lowfp.Stats or None, got {type(stats).__name__}")
    if is_dtensor(x):
        from . import dtensor
        check_choice(rounding, ROUNDING_MODES, "rounding")
        offset = check_uint64(offset, "offset")
        return dtensor.round_dtensor(
            x, fmt, rounding, hadamard_seed is not None, out, offset,
            lambda local, out_local, local_offset: quantize_scaled(
                local, fmt, rounding, overflow=overflow, seed=seed, generator=generator,
                offset=local_offset, sr_bits=sr_bits, stats=stats, hadamard_seed=hadamard_seed,
                out=out_local))
    if hadamard_seed is not None:
        if fmt.axis is None or isinstance(fmt.block, tuple):
            raise ValueError(f"the Hadamard transform runs along a 1-D block axis; {fmt} has none")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        check_tensor_args(x, out, None)
        layout(tuple(x.shape), fmt)  # (a 0-d x has no axis to transform along)
        hadamard_seed = check_uint64(hadamard_seed, "hadamard_seed")
        if runs_natively(x, out) and x.layout is torch.strided:  # one kernel per transform
            signs = _sign_values(hadamard_seed)
            transform = _hadamard_native
        else:  # torch's operators (under torch.compile: part of Inductor's kernels)
            signs = hadamard_signs(hadamard_seed, x.device)
            transform = hadamard
        z = transform(x, signs, fmt.axis)
        zq = quantize_scaled(z, fmt, rounding, overflow=overflow, seed=seed, generator=generator,
                             offset=offset, sr_bits=sr_bits, stats=stats)
        y = transform(zq, signs, fmt.axis, inverse=True).to(x.dtype)
        return y if out is None else out.copy_(y)
    res = _call(x, fmt, rounding, overflow, seed, generator, offset, sr_bits, stats is not None,
                False, out)
    y, counts = (out, res) if out is not None else (res[0], res[4])
    if stats is not None:
        stats.accumulate(counts)
    return y


def encode(x: torch.Tensor, fmt, rounding: str = "nearest", *, overflow=None, seed=None,
           generator=None, offset: int = 0, sr_bits: int = 32,
           stats: Optional[Stats] = None) -> ScaledParts:
    """The parts of x under the scaled format ``fmt``: the elements q, the block scales and the
    tensor scale, with the dequantized value (see :class:`ScaledParts`); arguments as
    :func:`quantize_scaled`."""
    fmt = _checked(fmt)
    if is_dtensor(x):
        raise TypeError("encode takes a plain tensor; a DTensor's parts: encode(x.full_tensor()) or "
                        "encode(x.to_local()) per shard (lowfp.quantize rounds the DTensor itself)")
    y, q, scales, tensor_scale, counts = _call(x, fmt, rounding, overflow, seed, generator, offset,
                                               sr_bits, stats is not None, True)
    if stats is not None:
        stats.accumulate(counts)
    return ScaledParts(y, q, scales, tensor_scale)


def _checked(fmt) -> Scaled:
    scaled = to_scaled(fmt)
    if scaled is None:
        raise TypeError(f"fmt must be a lowfp.Scaled or its name (e.g. 'mxfp8_e4m3'), got {fmt!r}")
    return scaled

