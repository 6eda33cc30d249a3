"""``lowfp.quantize``: round tensors and arrays to a format (docs/design.md §3)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import _C, backends
from ._autograd import function_apply
from .backends import PLAIN_TYPES
from ._checks import check_choice, is_dtype_in
from ._memory import _MIN_BYTES, new_output
from ._native import (ALLOWED_DTYPES, DTYPE_CODES, NUMPY_TO_TORCH, ROUNDING_MODES, Plan,
                      as_int64, call_seed, check_tensor_args, check_uint64, check_writable,
                      into_numpy_out, make_call, numpy_as_tensor, plan_rounding, records_natively,
                      eager_seed, format_args, prepared_request, round_dense, run_rounding,
                      runs_natively, share_bytes, draw_buffer, remembered_seed)
from ._dtensor import is_dtensor, round_dtensor
from ._prepared import Prepared, PreparedFormat, PreparedS2FP8
from ._ops import s2fp8_stat_buffers
from ._inductor import register_inductor_decompositions
from .formats import Format, S2FP8, as_text, to_precision
from .scaled import quantize_scaled, to_scaled
from .scaled.config import kernel_layout as scaled_kernel_layout
from .scaled.quantize import PreparedScaled, ScaledStats, device_scratch
from .stats import S2FP8Stats, Stats

__all__ = ["quantize", "quantize_", "ROUNDING_MODES"]

Tensorish = Union[torch.Tensor, np.ndarray]
_U64 = (1 << 64) - 1


def round_tensor(x: torch.Tensor, fmt, rounding: str = "nearest", *, overflow=None,
                 subnormals=None, seed=None, generator=None, offset=0, sr_bits=32, stats=None,
                 out=None, out_dtype=None, grad_fmt=None, grad_rounding="nearest"
                 ) -> Tuple[torch.Tensor, Optional[S2FP8Stats]]:
    """lowfp.quantize of a tensor through lowfp's operators: (result, S2FP8Stats or None)."""
    if type(x) is not torch.Tensor and type(x) is not torch.nn.Parameter and is_dtensor(x):
        return round_dtensor(round_tensor, x, fmt, rounding=rounding, overflow=overflow,
                             subnormals=subnormals, seed=seed, generator=generator, offset=offset,
                             sr_bits=sr_bits, stats=stats, out=out, out_dtype=out_dtype,
                             grad_fmt=grad_fmt, grad_rounding=grad_rounding)
    check_tensor_args(x, out, stats)
    if type(x) is FakeTensor or type(out) is FakeTensor:
        mode = backends.fake_mode_of(x, out)
        if mode is not None:
            with mode:  # a FakeTensor used outside its mode: its mode makes the drawn seed fake too
                return round_tensor(x, fmt, rounding, overflow=overflow, subnormals=subnormals,
                                    seed=seed, generator=generator, offset=offset,
                                    sr_bits=sr_bits, stats=stats, out=out, out_dtype=out_dtype,
                                    grad_fmt=grad_fmt, grad_rounding=grad_rounding)
    compiling = torch.compiler.is_compiling()
    if compiling:  # a format built inside traced code reaches the plan as text
        fmt, grad_fmt = as_text(fmt), as_text(grad_fmt)
        register_inductor_decompositions()
    plan = Plan(*plan_rounding(fmt, rounding, overflow, subnormals, sr_bits, x.dtype,
                               None if out is None else out.dtype, out_dtype, grad_fmt,
                               grad_rounding))
    if not (type(offset) is int and 0 <= offset < 2**63):  # (the common case needs no conversion)
        offset = as_int64(check_uint64(offset, "offset"))
    counts = stats.counts if stats is not None else None
    if not plan.s2fp8 and out is None and records_natively(x):
        # Eager, plain tensors, a result autograd records: the operator's implementation and
        # autograd formula without the dispatcher's round trip, whose Python autograd kernel
        # costs tens of microseconds a call (the same kernel, bits, counts and gradients).
        args = plan.native + (eager_seed(plan.rounding, seed, generator), offset & _U64)
        if grad_fmt is None and x.is_contiguous():  # (as below: the next such call is remembered)
            _remember_eager(fmt, rounding, overflow, subnormals, sr_bits, x, out, out_dtype, plan)
        return _recorded_apply(x, _round_natively, (None, plan.dtype, args, plan.rounding != "stochastic", counts),
                               plan.grad_fmt, plan.grad_rounding), None
    if not plan.s2fp8 and runs_natively(x, out):
        # Eager, plain tensors, nothing to record: the operator's own implementation, called
        # without the dispatcher's round trip (the same kernel, bits and counts).
        args = plan.native + (eager_seed(plan.rounding, seed, generator), offset & _U64)
        if grad_fmt is None and x.is_contiguous():  # (seed, offset and generator: arguments of each call)
            _remember_eager(fmt, rounding, overflow, subnormals, sr_bits, x, out, out_dtype, plan)
        return _round_natively(x, out, plan.dtype, args, plan.rounding != "stochastic", counts), None
    if (plan.s2fp8 and grad_fmt is None and x.is_contiguous()
            and runs_natively(x, out)):  # (as _remember_eager's calls)
        _remember(_eager_key(fmt, rounding, overflow, subnormals, sr_bits, x, out, out_dtype),
                  lambda: PreparedS2FP8(plan.native, plan.log_max, plan.rounding == "stochastic"))
    seed, drawn = call_seed(plan.rounding, seed, generator)
    common = (plan.rounding, plan.sr_bits, seed, drawn, offset)
    if not plan.s2fp8:
        if out is not None and not compiling:
            torch.ops.lowfp.quantize_into(x, out, plan.fmt, *common, counts)
            return out, None
        y, new_counts = torch.ops.lowfp.quantize(x, plan.fmt, *common, plan.dtype, counts is not None,
                                                 plan.grad_fmt, plan.grad_rounding)
    elif out is not None:
        sums, params = s2fp8_stat_buffers(x)
        torch.ops.lowfp.s2fp8_into(x, out, plan.fmt, plan.log_max, *common, sums, params, counts)
        return out, S2FP8Stats(sums, params, x.numel())
    else:
        y, sums, params, new_counts = torch.ops.lowfp.s2fp8(
            x, plan.fmt, plan.log_max, *common, counts is not None, plan.grad_fmt,
            plan.grad_rounding)
    if counts is not None:
        stats.accumulate(new_counts)
    if out is not None:  # compiled: the functional operator (which Inductor fuses), then a copy
        return out.copy_(y), None
    return y, (S2FP8Stats(sums, params, x.numel()) if plan.s2fp8 else None)


def _round_natively(x: torch.Tensor, out: Optional[torch.Tensor], dtype: torch.dtype, args: tuple,
                    index_free: bool, counts: Optional[torch.Tensor]) -> torch.Tensor:
    """x rounded by the operator's implementation into ``out`` or a new tensor of ``dtype``
    (args: format_args, seed, offset)."""
    if out is None and x.is_contiguous():  # the common case: one pointer call, no layout work
        return round_dense(x, new_output(x, dtype), args, counts)
    y = out if out is not None else new_output(x, dtype, torch.preserve_format)
    run_rounding(x, y, args, index_free, counts)
    return y


class _RecordedRounding(torch.autograd.Function):
    """lowfp::quantize's implementation and autograd formula for an eager call that autograd
    records (records_natively): forward, x rounded by the plan's native arguments or by a
    remembered call's prepared rounding; backward, the gradient straight through, or rounded to
    grad_fmt with grad_rounding (its stochastic key drawn from torch's default generator when
    backward runs, as the operator's formula draws it)."""

    @staticmethod
    def forward(ctx, x, round_x, round_args, grad_fmt, grad_rounding):
        """round_x(x, *round_args): the rounding, into a new tensor (_round_natively with the
        plan's arguments, or _round_prepared with a remembered call's checked arguments)."""
        ctx.grad_rounding = (grad_fmt, grad_rounding)
        return round_x(x, *round_args)

    @staticmethod
    def backward(ctx, grad):
        grad_fmt, grad_rounding = ctx.grad_rounding
        if grad_fmt is not None:
            grad = quantize(grad, grad_fmt, grad_rounding)
        return grad, None, None, None, None


_recorded_apply = function_apply(_RecordedRounding)


class _RememberedRecordedRounding(torch.autograd.Function):
    """_RecordedRounding for a remembered call (no grad_fmt): forward, entry's rounding of x into
    a new tensor, its arguments checked by the caller (counts: stats' buffer; seed:
    remembered_seed's), in C where it takes x, else entry.round; backward, the gradient straight
    through. (Its own Function: fewer arguments and no state on ctx cost less a call.)"""

    @staticmethod
    def forward(ctx, x, entry, stats, counts, seed, offset):
        y = _round_remembered_in_c(entry.request, entry.dtype, x, stats, seed, None, offset, None)
        return y if y is not None else entry.round(x, counts, None, None, seed, offset)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None, None


_remembered_apply = function_apply(_RememberedRecordedRounding)


# The eager calls that are one pointer call (a contiguous plain tensor, a contiguous out= or none,
# no grad_fmt, a CPU generator or none), by the arguments as the caller passed them (_eager_key,
# in C: lowfp._C.eager_key; seed and offset are each call's own): such a call skips the argument
# checks and the plan lookup (quantize's look-up: lowfp._C.quantize_remembered).
_EAGER: Dict[tuple, Prepared] = {}
_is_compiling = torch.compiler.is_compiling
_eager_key = _C.eager_key


def _remember_eager(fmt, rounding, overflow, subnormals, sr_bits, x, out, out_dtype, plan) -> None:
    _remember(_eager_key(fmt, rounding, overflow, subnormals, sr_bits, x, out, out_dtype),
              lambda: PreparedFormat(prepared_request(x, plan.dtype, plan.native), plan.dtype,
                                     plan.rounding == "stochastic"))


def _remember_scaled(fmt, scaled, rounding, overflow, sr_bits, x, out) -> None:
    """Remember a scaled call that passed the full path: eager, a plain contiguous x and out=
    (or none), and a layout the kernel reads where it lies (no copy: scaled.config.kernel_layout)."""
    if not (type(x) is torch.Tensor and x.is_contiguous() and runs_natively(x, out)
            and (out is None or type(out) is torch.Tensor)
            and scaled_kernel_layout(tuple(x.shape), scaled, True, rounding == "stochastic")[4] is None):
        return
    _remember(_eager_key(fmt, rounding, overflow, None, sr_bits, x, out, None),
              lambda: PreparedScaled(scaled, rounding, overflow, sr_bits, x))


def _remember(key: tuple, entry) -> None:
    try:
        if key in _EAGER:
            return
    except TypeError:  # an unhashable argument (a list for sr_bits...): checked each call
        return
    if len(_EAGER) > 1024:
        _EAGER.clear()
    _EAGER[key] = entry()


_FULL_PATH = object()  # (_one_call_counts: this call cannot be one pointer call)


def _one_call_counts(x: torch.Tensor, out, stats, stats_types: tuple, recorded: bool = False):
    """The counts buffer of a remembered call (None without stats), or _FULL_PATH when the call
    needs the full path: a layout, mode, autograd or out= that one pointer call does not cover,
    stats of another type than ``stats_types`` or on another device. ``recorded``: a call whose
    result autograd records (records_natively, checked by the caller)."""
    if not (x.layout is torch.strided and not x.is_nested and x.is_contiguous()
            and (recorded or runs_natively(x, out))):
        return _FULL_PATH
    if out is not None and not _writable_in_one_call(x, out):
        return _FULL_PATH
    if stats is None:
        return None
    if type(stats) not in stats_types or not backends.same_device(stats.counts, x):
        return _FULL_PATH
    return stats.counts


def _round_remembered(x: torch.Tensor, entry: Prepared, stats, out,
                      generator: Optional[torch.Generator], seed, offset: int) -> Optional[torch.Tensor]:
    """The rounding of a remembered call, or None when this call needs the full path (a layout,
    mode, autograd, out=, stats, seed or generator that the one pointer call does not cover, or
    an error to raise). The caller tells autograd about a write into ``out``."""
    if out is None and type(entry) is PreparedFormat and records_natively(x):
        # a result autograd records: the prepared rounding in lowfp's autograd Function (the
        # gradient straight through: remembered calls have no grad_fmt)
        counts = _one_call_counts(x, None, stats, entry.stats_types, recorded=True)
        seed = None if counts is _FULL_PATH else remembered_seed(entry.stochastic, generator, seed)
        if seed is None:
            return None
        return _remembered_apply(x, entry, stats, counts, seed, offset)
    counts = _one_call_counts(x, out, stats, entry.stats_types)
    if counts is _FULL_PATH:
        return None
    return entry.round(x, counts, generator, out, seed, offset)


def _writable_in_one_call(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether out= (of the remembered dtype) takes x's rounding by one pointer call: a plain
    contiguous tensor of x's shape and device, writable (not an inference tensor outside
    inference mode, no autograd to record), either x itself or apart from it in memory."""
    if not (type(out) is torch.Tensor and out.is_contiguous() and out.shape == x.shape
            and backends.same_device(out, x) and not out.requires_grad
            and not (out.is_inference() and not torch.is_inference_mode_enabled())):
        return False
    return (x.data_ptr() == out.data_ptr() and x.dtype == out.dtype) or not share_bytes(x, out)


def _quantize_numpy(x: np.ndarray, fmt, rounding, out, out_dtype, kwargs):
    xt = numpy_as_tensor(x, "x")
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        np_dtype = np.dtype(out_dtype)
        if np_dtype not in NUMPY_TO_TORCH:
            raise TypeError(f"out_dtype must be float16, float32 or float64, got {out_dtype}")
        out_dtype = NUMPY_TO_TORCH[np_dtype]
    if out is None:
        return quantize(xt, fmt, rounding, out_dtype=out_dtype, **kwargs).numpy()
    return into_numpy_out(out, lambda t: quantize(xt, fmt, rounding, out=t, out_dtype=out_dtype,
                                                  **kwargs))


def quantize(x: Tensorish, fmt: Union[Format, str], rounding: str = "nearest", *,
             overflow: Optional[str] = None, subnormals: Optional[bool] = None,
             seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
             offset: int = 0, sr_bits: int = 32, stats: Optional[Stats] = None,
             out: Optional[Tensorish] = None, out_dtype: Optional[torch.dtype] = None,
             grad_fmt: Optional[Union[Format, str]] = None,
             grad_rounding: str = "nearest") -> Tensorish:
    """Round every element of ``x`` to ``fmt`` and return the result as a new tensor/array.

    Args:
        x: torch tensor or numpy array of float16, bfloat16 (torch only), float32 or float64,
            any shape or layout; never modified (unless it is also ``out``).
        fmt: a :class:`lowfp.Format` or its string (``"fp(4,3,4)"``, ``"float8_e4m3fn"``), a
            :class:`lowfp.S2FP8` (``"s2fp8"``): x is then truncated with its own statistics
            (the result keeps x's dtype; :func:`lowfp.s2fp8_quantize` also returns them), or a
            :class:`lowfp.Scaled` (``"mxfp8_e4m3"``, ``"nvfp4"``): the result is s · q in x's
            dtype (torch tensors; see :mod:`lowfp.scaled`).
        rounding: ``"nearest"`` (ties to even), ``"nearest_away"``, ``"toward_zero"``, ``"up"``,
            ``"down"`` or ``"stochastic"``.
        overflow, subnormals: override the format's overflow policy / subnormal setting.
        seed, generator, offset, sr_bits: stochastic rounding. Element ``i`` uses Philox4x32-10
            word ``i % 4`` of block ``offset + i // 4`` under key ``seed``; ``seed=None`` draws one
            from ``generator`` (default: torch's default generator, so ``torch.manual_seed``
            makes runs reproducible); pass one of the two, not both. ``sr_bits`` random bits
            decide each rounding.
        stats: a :class:`lowfp.Stats` that accumulates overflow/underflow/nan/numel counts.
        out: write the result here (same shape; dtype ``out_dtype`` if given).
        out_dtype: result dtype. float16/bfloat16 inputs are rounded in float32 and returned
            in their own dtype when the format's values fit it; otherwise pass a wider one.
        grad_fmt, grad_rounding: the gradient passes straight through, or is rounded to
            ``grad_fmt`` with ``grad_rounding`` when given.
    """
    if not _is_compiling():  # see _EAGER (whose keys a tracing Dynamo may not hash)
        # a remembered call: rounded in C where it takes it (a plain format on a contiguous CPU
        # or CUDA x: _round_remembered's checks and call), else its table entry for the Python path
        found = _quantize_remembered(_EAGER, x, fmt, rounding, overflow, subnormals, seed, generator,
                                     offset, sr_bits, stats, out, out_dtype, grad_fmt)
        if found is not None:
            y = found if type(found) is torch.Tensor else _round_remembered(
                x, found, stats, out, generator, seed, offset)
            if y is not None:
                if out is not None:  # written through its pointer: tell autograd, as torch's
                    torch.autograd.graph.increment_version(out)  # out= ops do
                return y
    if isinstance(x, np.floating):  # numpy scalar in, numpy scalar out (as numpy ufuncs do)
        if out is not None:
            raise TypeError("out= is not supported for numpy scalar x")
        return quantize(np.asarray(x), fmt, rounding, overflow=overflow, subnormals=subnormals,
                        seed=seed, generator=generator, offset=offset, sr_bits=sr_bits,
                        stats=stats, out_dtype=out_dtype)[()]
    if isinstance(x, np.ndarray):
        if grad_fmt is not None:
            raise ValueError("grad_fmt applies to torch tensors only (numpy arrays have no gradients)")
        kwargs = dict(overflow=overflow, subnormals=subnormals, seed=seed, generator=generator,
                      offset=offset, sr_bits=sr_bits, stats=stats)
        return _quantize_numpy(x, fmt, rounding, out, out_dtype, kwargs)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    scaled = to_scaled(fmt)
    if scaled is not None:
        for name, value in (("subnormals", subnormals), ("out_dtype", out_dtype),
                            ("grad_fmt", grad_fmt)):
            if value is not None:
                raise ValueError(f"{name}= does not apply to the scaled format {scaled}")
        y = quantize_scaled(x, scaled, rounding, overflow=overflow, seed=seed,
                            generator=generator, offset=offset, sr_bits=sr_bits, stats=stats,
                            out=out)
        if generator is None or type(generator) is torch.Generator:  # see _EAGER
            _remember_scaled(fmt, scaled, rounding, overflow, sr_bits, x, out)
        return y
    return round_tensor(x, fmt, rounding, overflow=overflow, subnormals=subnormals, seed=seed,
                        generator=generator, offset=offset, sr_bits=sr_bits, stats=stats, out=out,
                        out_dtype=out_dtype, grad_fmt=grad_fmt, grad_rounding=grad_rounding)[0]


def quantize_(x: Tensorish, fmt: Union[Format, str], rounding: str = "nearest", **kwargs) -> Tensorish:
    """In-place :func:`quantize`: rounds ``x`` in its own dtype and returns it."""
    for bad in ("out", "out_dtype", "grad_fmt"):
        if bad in kwargs:
            raise TypeError(f"quantize_() does not take {bad}=")
    if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
        raise ValueError("quantize_() cannot run in place on a tensor that requires grad; "
                         "use lowfp.quantize or torch.no_grad()")
    if isinstance(x, torch.Tensor):
        check_writable(x, "x")
    return quantize(x, fmt, rounding, out=x, **kwargs)


class Rounder:
    """A precision, rounding mode and overflow policy checked once and applied many times.

    The emulation runtime rounds every tensor of every training step; validating arguments on each
    of those calls would cost more than the rounding of a small tensor. ``rounder(x, stats)``
    returns a new tensor with x's shape, dtype and (dense) layout, adding its counts to ``stats``
    (a :class:`lowfp.Stats` on x's device, or None). No autograd.
    """

    def __init__(self, precision, rounding: str = "nearest", overflow: Optional[str] = None):
        check_choice(rounding, ROUNDING_MODES, "rounding")
        # The prepared rounding per (dtype, on CUDA): eager calls pass only buffers
        # (lowfp._prepared; none for S2FP8, whose grid follows each tensor).
        self._requests: Dict[tuple, Prepared] = {}
        self.rounding = rounding
        self.overflow = overflow
        self.scaled = to_scaled(precision)
        if self.scaled is not None:  # a scaled format: lowfp::scaled_quantize does the checks
            self.precision = self.scaled
            self.idempotent = False  # (its scales follow each tensor's blocks)
            return
        self.precision = to_precision(precision, "precision")
        fmt = self.precision.fmt if isinstance(self.precision, S2FP8) else self.precision
        # Rounding a result again returns it unchanged, counting only its NaNs: a fixed value set
        # (S2FP8 takes its grid from each tensor) and saturation (no infinite results).
        self.idempotent = isinstance(self.precision, Format) and (overflow or fmt.overflow) == "saturate"
        self._call = make_call(fmt, rounding, overflow, None, 0, None, 0, 32)
        self._fmt = str(self._call.fmt)
        # The dtypes whose tensors this format fits, found once: a graph that torch.compile
        # records reads a constant rather than tracing fit_error.
        self._fitting = frozenset(d for d in DTYPE_CODES if self.fit_error(d) is None)

    def fit_error(self, dtype: torch.dtype) -> Optional[str]:
        """Why tensors of ``dtype`` cannot be rounded by this rounder in their own dtype, or None."""
        if not is_dtype_in(dtype, DTYPE_CODES):
            return f"tensors of dtype {dtype} cannot be rounded (allowed: {ALLOWED_DTYPES})"
        if isinstance(self.precision, Format):
            reason = self._call.fmt.fit_error(dtype)
            if reason:
                return f"{self.precision} does not fit {dtype} tensors ({reason})"
        return None

    def _check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in self._fitting:
            raise ValueError(self.fit_error(dtype))

    def __call__(self, x: torch.Tensor, stats: Optional[Stats] = None) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # (first: Dynamo would guard on the table below)
            # A dtype this rounder has rounded (checked then) on a backend it has used, for a
            # tensor whose memory the kernel reads (subclasses: FakeTensor, DTensor, the full path),
            # with stats whose counts the kernel adds to (a type it takes, on x's device).
            # (keyed by is_cuda: a meta tensor, which no kernel reads, takes the full path)
            prepared = (self._requests.get((x.dtype, x.is_cuda))
                        if type(x) in PLAIN_TYPES and not x.is_meta else None)
            if prepared is not None:
                if stats is None:
                    y = prepared.round(x, None)
                elif type(stats) in prepared.stats_types and (
                        stats.counts.is_cpu if x.is_cpu else backends.same_device(stats.counts, x)):
                    y = prepared.round(x, stats.counts)
                else:
                    y = None
                if y is not None:
                    return y
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if self.scaled is None:
            self._check_dtype(x.dtype)
        if torch.compiler.is_compiling() and type(self.precision) is Format:
            y, counts = self._operator_node(x, stats is not None)
            if stats is not None:
                stats.accumulate(counts)
            return y
        with torch.no_grad():  # the full path: every layout, stats type, mode and device
            if self.scaled is not None:
                y = quantize_scaled(x, self.scaled, self.rounding, overflow=self.overflow, stats=stats)
            else:
                y = round_tensor(x, self.precision, self.rounding, overflow=self.overflow,
                                 stats=stats)[0]
        if (not torch.compiler.is_compiling() and type(x) in (torch.Tensor, torch.nn.Parameter)
                and (x.is_cpu or x.is_cuda)):
            self._prepare(x)  # checked: its later calls are one native call
        return y

    def in_graph(self, x: torch.Tensor, count: bool):
        """(x rounded, its counts) where torch.compile records a graph: counts an int64 tensor of
        overflow, underflow, NaN and numel, or of no element when not ``count``. A format's
        rounding is the operator's node itself, its dtype checked against a set made at
        construction (a few steps to trace where ``self(x, stats)`` builds a Stats and checks
        the format again); other precisions take ``self(x, stats)``."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if type(self.precision) is Format:
            self._check_dtype(x.dtype)
            return self._operator_node(x, count)
        stats = Stats(x.device) if count else None
        y = self(x, stats)
        return y, (stats.counts if count else x.new_zeros(0, dtype=torch.int64))

    def _operator_node(self, x: torch.Tensor, count: bool):
        """lowfp::quantize of x (its dtype checked) by this format: a graph node, one Inductor
        fuses, with the checked format's string."""
        register_inductor_decompositions()
        drawn = torch.ops.lowfp.draw_seed() if self.rounding == "stochastic" else None
        return torch.ops.lowfp.quantize(x, self._fmt, self.rounding, 32, 0, drawn, 0, x.dtype, count,
                                        None, "nearest")

    def round_in_place(self, x: torch.Tensor, stats: Optional[Stats] = None) -> bool:
        """Round x into its own memory, adding its counts to ``stats``, where this rounder's
        prepared call takes it (eager; a plain, contiguous tensor of a dtype it has rounded on that
        backend; a format, or S2FP8, not a scaled format; stats of a type the kernel adds to).
        False, with nothing drawn or written, otherwise. No autograd: the caller makes sure no
        other tensor, and nothing autograd saved, holds x's memory."""
        if self.scaled is not None or type(x) is not torch.Tensor or torch.compiler.is_compiling():
            return False
        prepared = self._requests.get((x.dtype, x.is_cuda)) if not x.is_meta else None
        if prepared is None or not x.is_contiguous():
            return False
        if stats is None:
            counts = None
        elif type(stats) in prepared.stats_types and backends.same_device(stats.counts, x):
            counts = stats.counts
        else:
            return False
        return prepared.round(x, counts, out=x) is not None

    def _prepare(self, x: torch.Tensor) -> None:
        """Remember the prepared rounding of x's dtype into itself on x's backend."""
        if self.scaled is not None:
            prepared = PreparedScaled(self.scaled, self.rounding, self.overflow, 32, x)
        elif isinstance(self.precision, S2FP8):
            prepared = PreparedS2FP8(format_args(self._call.fmt, self._call.rounding, self._call.sr_bits),
                                     self.precision.log_max, self.rounding == "stochastic")
        else:
            prepared = PreparedFormat(prepared_request(x, x.dtype, format_args(
                self._call.fmt, self._call.rounding, self._call.sr_bits)), x.dtype,
                self.rounding == "stochastic")
        self._requests[(x.dtype, x.is_cuda)] = prepared

    def __repr__(self) -> str:
        return f"Rounder({self.precision}, {self.rounding!r}, overflow={self.overflow!r})"


# BoundRounder's native call (cpp/bindings/def_bound_round.hpp): a plain contiguous tensor on its
# prepared request's backend (a CPU tensor that backends.ready_on_cpu passes, or a CUDA tensor),
# rounded by its dtype's request into a tensor that new_output would make (torch.empty_like below
# its huge-page size).
# quantize's remembered call of a plain format, the same checks and call in C where they take it
# (runs_natively's, PreparedFormat.round's on a contiguous x, a Stats on x's device), and of a
# scaled format with blocks along the last axis (PreparedScaled.round's, in lowfp._C.round_scaled);
# a stochastic request draws its seed as draw_seed_eager does, from the thread's draw_buffer. CUDA
# tensors run lowfp._C_cuda's kernels (handed over as ROUNDING_KERNELS) on torch's current stream.
_C.round_bound_setup(
    tensor=torch.Tensor, parameter=torch.nn.Parameter, stats_type=Stats, backends=backends,
    get_num_threads=torch.get_num_threads, strided=torch.strided, empty_like=torch.empty_like,
    new_output=new_output, min_bytes=_MIN_BYTES, preserve_format=torch.preserve_format,
    draw_buffer=draw_buffer, is_grad_enabled=torch.is_grad_enabled,
    unobserved=(torch._C._is_torch_function_mode_enabled, torch._C._len_torch_dispatch_stack,
                torch._C._are_functorch_transforms_active),
    generator_type=torch.Generator, cpu_device=torch.device("cpu"), prepared_format=PreparedFormat,
    writable_in_one_call=_writable_in_one_call, remembered_apply=_remembered_apply,
    prepared_scaled=PreparedScaled, scaled_stats_type=ScaledStats, device_scratch=device_scratch,
    cuda_kernels=None if backends._C_cuda is None else backends._C_cuda.ROUNDING_KERNELS,
    cuda_raw_stream=backends._cuda_raw_stream)
_round_bound = _C.round_bound
_round_remembered_in_c = _C.round_remembered
_quantize_remembered = _C.quantize_remembered


class BoundRounder:
    """``rounder(x, stats)`` with ``stats`` fixed, as a one-argument callable (a gradient's tensor
    hook; an emulated tensor's rounding), and ``round_in_place(x)``.

    The emulation makes one per tensor and direction, so what a call of the rounder checks each
    time is known here once: a contiguous tensor or Parameter of a dtype that the rounder has
    rounded with a plain format (its prepared request learned then), on the device of the counts
    (any CPU or CUDA device without stats), takes one native call, with the counts' address taken
    at construction (stochastic rounding draws its seed there, as the rounder's own call would).
    Any other call is the rounder's own (other layouts, devices, tensor subclasses)."""

    __slots__ = ("rounder", "stats", "_counts", "_counts_device", "_requests")

    def __init__(self, rounder: Rounder, stats: Optional[Stats] = None):
        self.rounder, self.stats = rounder, stats
        # the counts' address and device (-1: the CPU, else a CUDA device's index) for the kernels;
        # 0 and -1 without stats; None for counts they cannot add to directly
        counts = None if stats is None else stats.counts
        self._counts = (0 if counts is None else counts.data_ptr()
                        if type(stats) is Stats and (counts.is_cpu or counts.is_cuda) else None)
        self._counts_device = -1 if counts is None else counts.get_device()
        # dtype -> the prepared request (of lowfp._C or lowfp._C_cuda) that one native call runs
        self._requests: Dict[torch.dtype, object] = {}

    def _learn(self, x: torch.Tensor) -> None:
        """Remember the rounder's prepared request for x's dtype and backend, once it has one: on
        the counts' backend, or without stats the first backend seen."""
        if self._counts is None or torch.compiler.is_compiling() or x.dtype in self._requests:
            return
        if self.stats is not None and x.is_cuda != (self._counts_device >= 0):
            return
        prepared = self.rounder._requests.get((x.dtype, x.is_cuda))
        if type(prepared) is PreparedFormat and prepared.dtype is x.dtype:
            self._requests[x.dtype] = prepared.request

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # (lowfp._C.round_bound: the native call where it takes x, else None)
        y = (None if self._counts is None
             else _round_bound(self._requests, x, self._counts, self._counts_device, None))
        if y is None:
            y = self.rounder(x, self.stats)
            self._learn(x)
        return y

    def round_in_place(self, x: torch.Tensor) -> bool:
        """``rounder.round_in_place(x, stats)``."""
        if (self._counts is not None
                and _round_bound(self._requests, x, self._counts, self._counts_device, x) is not None):
            return True
        done = self.rounder.round_in_place(x, self.stats)
        if done:
            self._learn(x)
        return done
