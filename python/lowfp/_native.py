"""The native-call toolkit the public modules share: dtype and mode codes, the checked request
the C++/CUDA drivers take, seeds, argument checks of tensors and arrays, and the launches of the
rounding and S2FP8 kernels on contiguous buffers. Nothing here is public API."""

from __future__ import annotations

import struct
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import numpy as np
import torch

from . import _C, backends
from ._checks import check_choice, check_int, is_dtype_in
from .formats import SPECIALS, Format, S2FP8, to_format, to_precision
from .stats import Stats

ROUNDING_MODES = ("nearest", "nearest_away", "toward_zero", "up", "down", "stochastic")
OVERFLOW_CODES = {"saturate": 0, "inf": 1, "nan": 2}
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
NUMPY_TO_TORCH = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
                  np.dtype(np.float64): torch.float64}
ALLOWED_DTYPES = "torch.float16, torch.bfloat16, torch.float32 or torch.float64"


@dataclass(frozen=True)
class NativeCall:
    """A fully checked request: what the C++/CUDA drivers take besides the buffers."""

    fmt: Format
    rounding: int
    sr_bits: int
    seed: int
    offset: int

    def args(self):
        return format_args(self.fmt, self.rounding, self.sr_bits) + (self.seed, self.offset)

    @property
    def index_free(self) -> bool:
        """Whether an element's result does not depend on its index (all but stochastic
        rounding, whose draws follow the logical index)."""
        return ROUNDING_MODES[self.rounding] != "stochastic"


def format_args(fmt: Format, rounding: int, sr_bits: int) -> tuple:
    """The native kernels' arguments that say the format and the rounding (before seed, offset)."""
    return (fmt.e, fmt.m, fmt.b, SPECIALS.index(fmt.specials), fmt.subnormals,
            OVERFLOW_CODES[fmt.overflow], rounding, sr_bits)


def check_uint64(value, name: str) -> int:
    value = check_int(value, name)
    if not 0 <= value < 2**64:
        raise ValueError(f"{name} must be in [0, 2**64), got {value}")
    return value


def seed_words(generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Two 32-bit words [lo, hi] (int64) drawn from ``generator`` (default: torch's default CPU
    generator): a 64-bit seed lo | hi << 32."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    device = generator.device if generator is not None else "cpu"
    return torch.randint(0, 2**32, (2,), dtype=torch.int64, generator=generator, device=device)


def draw_seed(generator: Optional[torch.Generator] = None) -> int:
    """A 64-bit seed from ``generator`` (default: torch's default CPU generator); 0 under
    FakeTensorMode, where nothing is rounded and torch's generators do not advance."""
    words = seed_words(generator)
    if type(words) in backends.TRACING_TYPES:
        return 0
    lo, hi = words.tolist()
    return lo | (hi << 32)


_draws = threading.local()  # each thread's two-word buffer for draw_seed_eager (draw_buffer)
# The low 32 bits of each of the buffer's two int64 words, as Python ints (native byte order).
_LOW_WORDS = struct.Struct("=I4xI4x" if sys.byteorder == "little" else "=4xI4xI")


def draw_buffer() -> tuple:
    """The calling thread's draw buffer: (two int64 words, a view of their bytes, the words'
    random_, their address), made on the thread's first draw. lowfp._C's remembered calls draw
    through it too (cpp/bindings/def_bound_round.hpp)."""
    try:
        return _draws.buffer
    except AttributeError:
        words = torch.empty(2, dtype=torch.int64)
        _draws.buffer = (words, memoryview(words.numpy()), words.random_, words.data_ptr())
        return _draws.buffer


def draw_seed_eager(generator: Optional[torch.Generator] = None) -> int:
    """draw_seed(generator) for a CPU generator (default: torch's) in an eager call with no mode
    active, into the thread's draw buffer instead of a new tensor per draw. The same words and
    the same advance of the generator as seed_words: torch.randint(0, 2**32) takes each word as
    the low 32 bits of one random64() of the generator, and random_() with no range takes one
    random64() per int64 element too, keeping its low 63 bits (fewer arguments to parse); the
    buffer is read back through its bytes, which costs less than tolist."""
    words, view, random_, _ = draw_buffer()
    if generator is None:
        random_()
    else:
        random_(generator=generator)
    lo, hi = _LOW_WORDS.unpack_from(view)
    return lo | (hi << 32)


def remembered_seed(stochastic: bool, generator: Optional[torch.Generator],
                    seed: Optional[int] = None) -> Optional[int]:
    """The seed of a rounding that skips the argument checks (a remembered call): 0 for a
    deterministic rounding, else the caller's ``seed``, or one drawn from a CPU generator
    (default: torch's) by draw_seed_eager; None for another generator, or a seed that is not an
    int in [0, 2**64) or comes with a generator (the call takes the full path, which raises)."""
    if seed is not None:
        if type(seed) is not int or not 0 <= seed < 2**64 or generator is not None:
            return None
        return seed if stochastic else 0
    if not stochastic:
        return 0
    if generator is not None and generator.device.type != "cpu":
        return None
    return draw_seed_eager(generator)


def stochastic_seed(seed: Optional[int], generator: Optional[torch.Generator]) -> int:
    """The Philox key of a stochastic call: ``seed``, or one drawn from ``generator``."""
    if seed is None:
        return draw_seed(generator)
    if generator is not None:
        raise ValueError("pass seed= or generator=, not both: seed is the Philox key itself, "
                         "generator draws one")
    return check_uint64(seed, "seed")


def make_call(fmt, rounding, overflow, subnormals, seed, generator, offset, sr_bits) -> NativeCall:
    fmt = to_format(fmt, "fmt")
    fmt, rounding, sr_bits = _checked_rounding(fmt, rounding, overflow, subnormals, sr_bits)
    offset = check_uint64(offset, "offset")
    if rounding == "stochastic":
        seed = stochastic_seed(seed, generator)
    else:
        seed = 0 if seed is None else check_uint64(seed, "seed")
    return NativeCall(fmt, ROUNDING_MODES.index(rounding), sr_bits, seed, offset)


def _checked_rounding(fmt: Format, rounding, overflow, subnormals, sr_bits):
    if overflow is not None or subnormals is not None:
        check_choice(overflow, tuple(OVERFLOW_CODES), "overflow", none_ok=True)
        if subnormals is not None and not isinstance(subnormals, bool):
            raise TypeError(f"subnormals must be a bool or None, got {subnormals!r}")
        fmt = fmt.replace(overflow=overflow, subnormals=subnormals)
    check_choice(rounding, ROUNDING_MODES, "rounding")
    sr_bits = check_int(sr_bits, "sr_bits")
    if not 1 <= sr_bits <= 32:
        raise ValueError(f"sr_bits must be between 1 and 32, got {sr_bits}")
    return fmt, rounding, sr_bits


class Plan(NamedTuple):
    """What a rounding call decides before it reads a tensor, in the constants lowfp's operators
    take (lowfp._ops)."""

    s2fp8: bool            # S2FP8 (fmt is then the 8-bit format Y is rounded to)
    fmt: str               # the format's string, overflow/subnormal overrides applied
    log_max: float         # S2FP8's (0.0 for a format)
    rounding: str
    sr_bits: int
    dtype: torch.dtype     # the result's
    grad_fmt: Optional[str]
    grad_rounding: str
    native: tuple          # format_args of fmt and the rounding, for the kernels


_PLANS: dict = {}


@torch.compiler.assume_constant_result  # under torch.compile: run once, at trace time
def plan_rounding(fmt, rounding, overflow, subnormals, sr_bits, x_dtype, out_dtype_given,
                  out_dtype, grad_fmt, grad_rounding) -> tuple:
    """The checked Plan (as a tuple) of a rounding of an ``x_dtype`` tensor into an out= of
    dtype ``out_dtype_given`` (None: no out=) or a new tensor of ``out_dtype``. Every argument
    error is raised here, naming the argument."""
    # With the types: True == 1 == 1.0 as keys, but only some of them pass the checks.
    key = (fmt, rounding, overflow, subnormals, type(subnormals), sr_bits, type(sr_bits), x_dtype,
           out_dtype_given, out_dtype, grad_fmt, grad_rounding)
    try:
        return _PLANS[key]
    except (KeyError, TypeError):  # (TypeError: an unhashable argument, refused below)
        pass
    precision = to_precision(fmt, "fmt")
    if isinstance(precision, S2FP8):
        inner, rounding, sr_bits = _checked_rounding(precision.fmt, rounding, overflow, subnormals,
                                                     sr_bits)
        if out_dtype_given is not None and out_dtype_given != x_dtype:
            raise ValueError(f"S2FP8 returns x's dtype {x_dtype}, but out has dtype {out_dtype_given}")
        if out_dtype is not None and out_dtype != x_dtype:
            raise ValueError(f"S2FP8 returns x's dtype {x_dtype}; out_dtype={out_dtype} is not supported")
        reason = inner.fit_error(torch.float64)
        if reason:
            raise ValueError(f"fmt {inner} cannot be used by S2FP8: {reason}")
        plan = Plan(True, str(inner), precision.log_max, rounding, sr_bits, x_dtype, None, "nearest",
                    format_args(inner, ROUNDING_MODES.index(rounding), sr_bits))
    else:
        precision, rounding, sr_bits = _checked_rounding(precision, rounding, overflow, subnormals,
                                                         sr_bits)
        dtype = result_dtype(x_dtype, precision, out_dtype_given, out_dtype)
        plan = Plan(False, str(precision), 0.0, rounding, sr_bits, dtype, None, "nearest",
                    format_args(precision, ROUNDING_MODES.index(rounding), sr_bits))
    if grad_fmt is not None:
        plan = plan._replace(grad_fmt=str(_checked_grad_precision(grad_fmt, plan.dtype)),
                             grad_rounding=grad_rounding)
        check_choice(grad_rounding, ROUNDING_MODES, "grad_rounding")
    plan = tuple(plan)
    if len(_PLANS) > 4096:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def _checked_grad_precision(grad_fmt, dtype: torch.dtype):
    """grad_fmt as a precision that can round gradients of ``dtype`` (the result's)."""
    precision = to_precision(grad_fmt, "grad_fmt")
    fmt = precision.fmt if isinstance(precision, S2FP8) else precision
    reason = fmt.fit_error(torch.float64 if isinstance(precision, S2FP8) else dtype)
    if reason:
        raise ValueError(f"grad_fmt {precision} cannot round the {dtype} gradient of the result: "
                         f"{reason}")
    return precision


def call_seed(rounding: str, seed, generator) -> Tuple[int, Optional[torch.Tensor]]:
    """(seed, drawn_seed) operator arguments: a stochastic call without seed or generator draws
    its key from torch's default generator through the lowfp::draw_seed operator (when the call
    runs, also inside a compiled graph); otherwise as make_call decides it."""
    if rounding != "stochastic":
        return (0 if seed is None else as_int64(check_uint64(seed, "seed"))), None
    if seed is None and generator is None:
        return 0, torch.ops.lowfp.draw_seed()
    return as_int64(stochastic_seed(seed, generator)), None


def eager_seed(rounding: str, seed, generator) -> int:
    """The uint64 Philox key of a call that runs natively (runs_natively): call_seed's key, with
    a stochastic call's draw made here (the words lowfp::draw_seed would draw)."""
    if rounding == "stochastic":
        return stochastic_seed(seed, generator)
    return 0 if seed is None else check_uint64(seed, "seed")


def as_int64(value: int) -> int:
    """The int64 with the bits of a uint64 (operator schemas carry int64)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def result_dtype(x_dtype: torch.dtype, fmt: Format, out_dtype_given, out_dtype) -> torch.dtype:
    if out_dtype is not None and not is_dtype_in(out_dtype, DTYPE_CODES):
        raise TypeError(f"out_dtype must be {ALLOWED_DTYPES}, got {out_dtype}")
    if out_dtype_given is not None:
        if out_dtype is not None and out_dtype_given != out_dtype:
            raise ValueError(f"out has dtype {out_dtype_given} but out_dtype is {out_dtype}")
        dtype = out_dtype_given
    else:
        dtype = out_dtype if out_dtype is not None else x_dtype
    wide = torch.float64 in (x_dtype, dtype)
    carrier = torch.float64 if wide else torch.float32
    reason = fmt.fit_error(carrier)
    if reason:
        raise ValueError(f"fmt {fmt} does not fit the float32 carrier used for {x_dtype} input: "
                         f"{reason}; pass out_dtype=torch.float64 to round in float64")
    reason = fmt.fit_error(dtype)
    if reason:
        if out_dtype_given is not None:
            where = f"out has dtype {dtype}, which cannot hold every value of fmt {fmt}"
        elif out_dtype is not None:
            where = f"out_dtype {dtype} cannot hold every value of fmt {fmt}"
        else:
            where = f"x has dtype {dtype}, which cannot hold every value of fmt {fmt}"
        wider = "torch.float64" if dtype == torch.float32 else "torch.float32"
        raise ValueError(f"{where} ({reason}); pass out_dtype={wider}")
    return dtype


def share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether contiguous a and b overlap in memory."""
    return a.data_ptr() < b.data_ptr() + b.nbytes and b.data_ptr() < a.data_ptr() + a.nbytes


def dense_layout(t: torch.Tensor) -> bool:
    """Whether t's elements fill numel() consecutive slots from data_ptr() in some order
    (contiguous, channels-last, any permutation of a contiguous tensor)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_dense_layout(x: torch.Tensor, y: torch.Tensor) -> bool:
    """x and y (same shape) are dense and keep each element at the same offset."""
    return (all(a == b for a, b, n in zip(x.stride(), y.stride(), x.shape) if n != 1)
            and dense_layout(x))


def run_elementwise(x: torch.Tensor, y: torch.Tensor, launch, memory_order: bool = False) -> torch.Tensor:
    """launch(src, dst) on buffers for x and y (same shape, any layouts) whose elements the
    kernel walks in the same order; returns y. That order is x's logical (row-major) order, or
    with ``memory_order`` (for element-wise work that does not depend on an element's index) the
    order in memory when x and y share a dense layout, so that a channels-last tensor is rounded
    where it lies. An out= that overlaps x without being x itself (say x[:-1] into x[1:]) reads
    a copy of x, so the result is what it would be without the overlap (NumPy's rule for ufuncs)."""
    if memory_order and same_dense_layout(x, y):
        src, dst = x, y
    else:
        src = x.contiguous()
        dst = y if y.is_contiguous() else torch.empty(y.shape, dtype=y.dtype, device=y.device)
    # A mode can make the buffers lowfp allocates tensor subclasses (FakeTensorMode with plain
    # inputs allowed): refuse before the kernel writes through their pointers.
    backends.check_dense(src, "x")
    backends.check_dense(dst, "the result buffer")
    if (dst is y and share_bytes(src, dst)
            and not (src.data_ptr() == dst.data_ptr() and src.dtype == dst.dtype)):
        src = src.clone()
    launch(src, dst)
    if dst is not y:
        y.copy_(dst)  # a torch op: it marks y changed itself
    else:
        # Written through its pointer: tell autograd, as torch's in-place ops do, so a backward
        # that saved y raises instead of reading the new values.
        torch.autograd.graph.increment_version(y)
    return y


def run_quantize(x: torch.Tensor, y: torch.Tensor, call: NativeCall,
                 counts: Optional[torch.Tensor]) -> torch.Tensor:
    """Round x into y (same shape, any layout) on x's device, adding the event counts to
    ``counts`` (lowfp.Stats's tensor) when given."""
    return run_rounding(x, y, call.args(), call.index_free, counts)


def run_rounding(x: torch.Tensor, y: torch.Tensor, args: tuple, index_free: bool,
                 counts: Optional[torch.Tensor]) -> torch.Tensor:
    """run_quantize with the kernel's format, rounding, seed and offset arguments given."""
    mod, device, stream = backends.native(x, "x")
    counts_ptr = counts.data_ptr() if counts is not None else 0
    return run_elementwise(x, y, lambda src, dst: mod.quantize(
        src.data_ptr(), DTYPE_CODES[src.dtype], dst.data_ptr(), DTYPE_CODES[dst.dtype], src.numel(),
        *args, counts_ptr, device, stream), index_free)


def prepared_request(x: torch.Tensor, y_dtype: torch.dtype, native: tuple):
    """The kernel's prepared request (lowfp._C.PreparedQuantize, or lowfp._C_cuda's) for rounding
    tensors of x's dtype on x's backend into ``y_dtype`` with ``native`` (format_args)."""
    module = backends.native(x, "x")[0]
    return module.PreparedQuantize(DTYPE_CODES[x.dtype], DTYPE_CODES[y_dtype], *native)


def round_dense(x: torch.Tensor, y: torch.Tensor, args: tuple,
                counts: Optional[torch.Tensor]) -> torch.Tensor:
    """One pointer call rounding x into y, which share a dense layout and no memory (a new y):
    element i of both buffers is the same element. args: format_args, seed, offset."""
    mod, device, stream = backends.native(x, "x")
    code = DTYPE_CODES[x.dtype]
    mod.quantize(x.data_ptr(), code, y.data_ptr(), DTYPE_CODES[y.dtype], x.numel(), *args,
                 0 if counts is None else counts.data_ptr(), device, stream)
    return y


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _eager_and_unobserved(x: torch.Tensor) -> bool:
    """Not traced, a plain CPU or CUDA x, and no torch-function or dispatch mode or torch.func
    transform that must see lowfp's operator."""
    return (not torch.compiler.is_compiling()
            and type(x) in _PLAIN and (x.is_cpu or x.is_cuda)  # (not x.device.type: it builds a torch.device)
            and not torch._C._is_torch_function_mode_enabled()
            and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._are_functorch_transforms_active())


def runs_natively(x: torch.Tensor, out: Optional[torch.Tensor]) -> bool:
    """Whether a call may skip lowfp's operator for its implementation (the same kernel, bits
    and counts, without the dispatcher's round trip): eager (not traced, no torch-function or
    dispatch mode that would want to see the operator, no torch.func transform), plain CPU or
    CUDA tensors, and no autograd graph to record."""
    return ((out is None or type(out) in _PLAIN) and not (x.requires_grad and torch.is_grad_enabled())
            and _eager_and_unobserved(x))


def records_natively(x: torch.Tensor) -> bool:
    """Whether a call whose result autograd records may skip lowfp's operator, as runs_natively's
    calls do (eager, plain CPU or CUDA x, nothing that must see the operator): x requires grad
    and grad mode is on."""
    return x.requires_grad and torch.is_grad_enabled() and _eager_and_unobserved(x)


def check_writable(t: torch.Tensor, name: str) -> None:
    """What torch's own in-place ops refuse to write: an inference tensor outside inference mode
    (it has no version counter to tell autograd about the write), and a tensor whose elements
    overlap in memory."""
    if torch.compiler.is_compiling():  # (Dynamo cannot ask; compiled code has no inference tensors)
        return
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(f"{name} is an inference tensor, which cannot be written in place outside "
                         "torch.inference_mode(); write into a clone of it")
    if (t.layout == torch.strided and not t.is_nested
            and any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))):
        raise ValueError(f"{name} has elements that share memory (an expanded tensor, stride 0), "
                         f"so it cannot be written element by element; write into {name}.clone() "
                         "or a contiguous tensor")


def check_tensor_args(x: torch.Tensor, out, stats):
    backends.check_operand(x, "x")
    if x.dtype not in DTYPE_CODES:
        raise TypeError(f"x must have dtype {ALLOWED_DTYPES}, got {x.dtype}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor for tensor input, got {type(out).__name__}")
        backends.check_operand(out, "out")
        if out.dtype not in DTYPE_CODES:
            raise TypeError(f"out must have dtype {ALLOWED_DTYPES}, got {out.dtype}")
        if out.shape != x.shape:
            raise ValueError(f"out has shape {tuple(out.shape)} but x has shape {tuple(x.shape)}")
        if out.device != x.device:
            raise ValueError(f"out is on {out.device} but x is on {x.device}")
        check_writable(out, "out")
        if torch.is_grad_enabled() and (x.requires_grad or out.requires_grad):
            # torch's out= functions refuse this too: autograd cannot record a write into out.
            raise ValueError(f"out= does not support automatic differentiation "
                             f"({'x' if x.requires_grad else 'out'} requires grad); drop out= or "
                             "run under torch.no_grad()")
    if stats is not None:
        if not isinstance(stats, Stats):
            raise TypeError(f"stats must be a lowfp.Stats or None, got {type(stats).__name__}")
        if stats.device != x.device:
            raise ValueError(f"stats lives on {stats.device} but x is on {x.device}; "
                             f"use lowfp.Stats(device={str(x.device)!r})")


def numpy_as_tensor(a: np.ndarray, name: str) -> torch.Tensor:
    """A tensor viewing a, or a native-order contiguous copy of it where torch cannot view it
    (negative strides, non-native byte order)."""
    if a.dtype.newbyteorder("=") not in NUMPY_TO_TORCH:
        raise TypeError(f"{name} must have dtype float16, float32 or float64, got numpy {a.dtype}")
    if any(s < 0 for s in a.strides) or not a.dtype.isnative:
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("="))
    with warnings.catch_warnings():  # read-only arrays are only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def into_numpy_out(out, write) -> np.ndarray:
    """write(t) puts a result into t, a tensor for the numpy array ``out``: a view of it, or else
    a copy that is then copied back, so every check on t is the one a tensor out= gets."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray for array input, got {type(out).__name__}")
    if not out.flags.writeable:
        raise ValueError("out is a read-only array")
    out_t = numpy_as_tensor(out, "out")
    write(out_t)
    if out_t.data_ptr() != out.ctypes.data and out.size != 0:  # a copy (e.g. negative strides)
        np.copyto(out, out_t.numpy())
    return out




def run_s2fp8(x: torch.Tensor, y: torch.Tensor, log_max: float, call: NativeCall,
              sums: torch.Tensor, params: torch.Tensor, counts: Optional[torch.Tensor]) -> torch.Tensor:
    """S2FP8 of x into y on x's device; its statistics go to ``sums`` and ``params``
    (lowfp.S2FP8Stats's tensors), its event counts to ``counts`` when given. Always in logical
    order: the statistics' reduction groups consecutive elements."""
    mod, device, stream = backends.native(x, "x")
    counts_ptr = counts.data_ptr() if counts is not None else 0
    return run_elementwise(x, y, lambda src, dst: mod.s2fp8(
        src.data_ptr(), DTYPE_CODES[src.dtype], dst.data_ptr(), src.numel(), *call.args(),
        log_max, sums.data_ptr(), params.data_ptr(), counts_ptr, device, stream))


def add_one_to_float32s(counts: List[torch.Tensor]) -> None:
    """count += 1 for each count (lowfp.optim's Adam step counts). torch.optim keeps them as
    one-element float32 CPU tensors, as lowfp's optimizers do: those are added to by one native
    call, where torch._foreach_add_ dispatches an add per tensor; any other kind of count (state
    edited by hand) by torch."""
    addresses = []
    for t in counts:
        if (t.dtype is not torch.float32 or not t.is_cpu or t.numel() != 1
                or type(t) is not torch.Tensor):  # (fake tensors while torch traces)
            torch._foreach_add_(counts, 1)
            return
        addresses.append(t.data_ptr())
    _C.add_to_float32s(addresses, 1.0)
    torch.autograd.graph.increment_version(counts)  # written through their pointers
