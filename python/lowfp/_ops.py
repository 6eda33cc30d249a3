"""lowfp's native rounding entry points as torch.library operators (namespace ``lowfp``).

The public functions (lowfp.quantize, quantize_, s2fp8_quantize) check their arguments, turn
them into the constants below and call these operators, so that torch.compile and torch.export
see one opaque operator per rounding, with a fake implementation for shapes and dtypes and an
autograd formula (the straight-through estimator, or a rounded gradient).

Arguments every rounding operator shares:
    fmt: the format's string (``str(lowfp.Format)``: ``"fp(4,3,4)"``, ``"float8_e4m3fn"``,
        overflow and subnormal overrides included); for S2FP8 the 8-bit format Y is rounded to.
    rounding: one of lowfp.ROUNDING_MODES.
    sr_bits, offset: as lowfp.quantize's; offset is the uint64 Philox block offset stored as the
        int64 with the same bits.
    seed, drawn_seed: the Philox key. ``drawn_seed`` (when given) is lowfp::draw_seed's result,
        two 32-bit words [lo, hi]; otherwise ``seed`` is the key as the int64 with its bits.

``lowfp::draw_seed`` draws a key from torch's default CPU generator when it runs; it is an
ordered effect, so a compiled graph draws its keys in program order, as eager code does.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from . import backends
from ._memory import new_output
from ._non_finite import check_non_finite
from ._native import (DTYPE_CODES, NativeCall, ROUNDING_MODES, format_args, prepared_request,
                      run_quantize, run_s2fp8, same_dense_layout, seed_words, share_bytes)
from .formats import Format, S2FP8, to_precision

__all__ = ["lib", "philox_key", "round_gradient", "s2fp8_stat_buffers"]

lib = torch.library.Library("lowfp", "DEF")

_COMMON = "str rounding, int sr_bits, int seed, Tensor? drawn_seed, int offset"
lib.define("draw_seed() -> Tensor")
# Element-wise results take x's layout, as torch's own element-wise operators do
# (torch.empty_like's preserve_format, in the implementations and the fake ones alike), so
# flexible_layout: torch.compile may hand them a tensor in whatever layout it keeps (channels-last
# around Inductor's convolutions) instead of copying it to the layout seen when tracing.
_ELEMENTWISE = (torch.Tag.flexible_layout,)
lib.define(f"quantize(Tensor x, str fmt, {_COMMON}, ScalarType dtype, bool count, str? grad_fmt, "
           "str grad_rounding) -> (Tensor, Tensor)", tags=_ELEMENTWISE)
lib.define(f"quantize_into(Tensor x, Tensor(a!) out, str fmt, {_COMMON}, "
           "Tensor(b!)? counts) -> ()")
# lowfp::quantize as Inductor's graphs call it where they keep lowfp's kernel (lowfp._inductor):
# the same implementation without an autograd formula, whose Python kernel would run on every
# call of a compiled step (the graph's backward is traced already).
lib.define(f"quantize_in_graph(Tensor x, str fmt, {_COMMON}, ScalarType dtype, bool count, "
           "str? grad_fmt, str grad_rounding) -> (Tensor, Tensor)", tags=_ELEMENTWISE)
lib.define(f"s2fp8(Tensor x, str fmt, float log_max, {_COMMON}, bool count, str? grad_fmt, "
           "str grad_rounding) -> (Tensor, Tensor, Tensor, Tensor)", tags=_ELEMENTWISE)
lib.define(f"s2fp8_into(Tensor x, Tensor(a!) out, str fmt, float log_max, {_COMMON}, "
           "Tensor(b!) sums, Tensor(c!) params, Tensor(d!)? counts) -> ()")

# weight_format: the weights' grid, a lowfp format's string (None: the 16-bit type's own).
lib.define(f"extra_bits_split(Tensor w32, ScalarType dtype, int k, {_COMMON}, bool count, "
           "str? weight_format=None) -> (Tensor, Tensor, Tensor)")
lib.define("extra_bits_merge(Tensor w16, Tensor packed, int k, str rounding, "
           "str? weight_format=None) -> Tensor")
lib.define("any_non_finite(Tensor t) -> Tensor")
# One fused ExtraBits optimizer step over parameters of one dtype (lowfp.optim): moments holds
# each parameter's state tensors in turn (moments_per_param of them: SGD 0 or 1, Adam 2 or 3);
# hyper and flags are the step's scalars in the order of HYPER_FIELDS[optimizer].
lib.define("extra_bits_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] extras, "
           "Tensor(c!)[] moments, int moments_per_param, str optimizer, int k, str rounding, "
           "ScalarType state_dtype, float[] hyper, bool[] flags, int seed, int[] offsets, "
           "Tensor? found_inf, Tensor? grad_scale, Tensor(d!) counts, str? weight_format=None) -> ()")

torch.library._register_effectful_op("lowfp::draw_seed", torch._library.effects.EffectType.ORDERED)

from . import _C  # noqa: E402  (after the definitions: _C only supplies a size)
from ._torch_sqrt import use_torch_sqrt  # noqa: E402

S2FP8_SUM_SIZE = _C.S2FP8_SUM_SIZE
_U64 = (1 << 64) - 1


_PRECISIONS: Dict[str, object] = {}


def _precision(text: str):
    """A format string of an operator call, parsed once."""
    p = _PRECISIONS.get(text)
    if p is None:
        p = _PRECISIONS[text] = to_precision(text, "fmt")
    return p


def philox_key(seed: int, drawn_seed: Optional[torch.Tensor]) -> int:
    """The uint64 Philox key of an operator call."""
    if drawn_seed is not None:
        lo, hi = drawn_seed.tolist()
        return lo | (hi << 32)
    return seed & _U64


def _call(fmt: str, rounding: str, sr_bits: int, seed: int, drawn_seed, offset: int) -> NativeCall:
    """The native request of an operator call's arguments."""
    return NativeCall(_precision(fmt), ROUNDING_MODES.index(rounding), sr_bits,
                      philox_key(seed, drawn_seed), offset & _U64)


# -- implementations (CPU and CUDA: the native module follows x's device) -----------------------

def _draw_seed_impl() -> torch.Tensor:
    """The two words lowfp.draw_seed() would draw, as a tensor."""
    return seed_words()


def _counts(x: torch.Tensor, count: bool) -> torch.Tensor:
    return torch.zeros(4 if count else 0, dtype=torch.int64, device=x.device)


# The kernel's prepared requests of operator calls (lowfp._C.PreparedQuantize, or lowfp._C_cuda's),
# by (fmt, rounding, sr_bits, x's dtype, the result's dtype, on CUDA): a compiled graph calls the
# operator for every rounding of every step with a few such argument sets.
_REQUESTS: Dict[tuple, object] = {}


def _request(fmt: str, rounding: str, sr_bits: int, x: torch.Tensor, dtype: torch.dtype):
    key = (fmt, rounding, sr_bits, x.dtype, dtype, x.is_cuda)
    request = _REQUESTS.get(key)
    if request is None:
        if len(_REQUESTS) > 1024:
            _REQUESTS.clear()
        request = _REQUESTS[key] = prepared_request(
            x, dtype, format_args(_precision(fmt), ROUNDING_MODES.index(rounding), sr_bits))
    return request


def _round_prepared(x, y, fmt, rounding, sr_bits, seed, drawn_seed, offset, counts) -> bool:
    """Round x into y by one pointer call of the prepared request where their buffers allow it
    (plain tensors of one dense layout, element i of both buffers the same element; contiguous
    for stochastic rounding, whose words follow the logical index; y is x or shares none of its
    memory), adding the counts to ``counts`` when given; whether it did."""
    if not (backends.is_plain(x) and backends.is_plain(y)  # (a mode may make y a subclass: FakeTensorMode)
            and (x.is_contiguous() and y.is_contiguous()
                 or rounding != "stochastic" and same_dense_layout(x, y))
            and (x.data_ptr() == y.data_ptr() and x.dtype == y.dtype or not share_bytes(x, y))):
        return False
    _, device, stream = backends.native(x, "x")
    _request(fmt, rounding, sr_bits, x, y.dtype)(
        x.data_ptr(), y.data_ptr(), x.numel(), philox_key(seed, drawn_seed), offset & _U64,
        0 if counts is None else counts.data_ptr(), device, stream)
    return True


def round_in_graph(x, out, counts, fmt: str, rounding: str, sr_bits: int, seed: int,
                   offset: int, drawn_seed=None) -> None:
    """lowfp::quantize_into as Inductor's generated code calls it on CPU tensors where its
    lowering has checked, once, what _round_prepared checks on every call (lowfp._inductor):
    one pointer call of the prepared request, without the dispatcher's round trip through
    Python. Inductor's cache keeps generated code that calls it across lowfp versions: keep its
    name and arguments."""
    backends.ready_on_cpu(x)  # (torch's thread count followed)
    _request(fmt, rounding, sr_bits, x, out.dtype)(
        x.data_ptr(), out.data_ptr(), x.numel(), philox_key(seed, drawn_seed), offset & _U64,
        0 if counts is None else counts.data_ptr(), -1, 0)


def _quantize_impl(x, fmt, rounding, sr_bits, seed, drawn_seed, offset, dtype, count, grad_fmt,
                   grad_rounding):
    counts = _counts(x, count)
    y = new_output(x, dtype, torch.preserve_format)  # (x's layout where x is dense)
    if not _round_prepared(x, y, fmt, rounding, sr_bits, seed, drawn_seed, offset,
                           counts if count else None):
        run_quantize(x, y, _call(fmt, rounding, sr_bits, seed, drawn_seed, offset),
                     counts if count else None)
    return y, counts


def _quantize_into_impl(x, out, fmt, rounding, sr_bits, seed, drawn_seed, offset, counts):
    if out.shape != x.shape:  # (the public functions check this first; the operator is reachable too)
        raise ValueError(f"out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    if _round_prepared(x, out, fmt, rounding, sr_bits, seed, drawn_seed, offset, counts):
        # Written through its pointer: tell autograd, as torch's in-place ops do.
        torch.autograd.graph.increment_version(out)
    else:
        run_quantize(x, out, _call(fmt, rounding, sr_bits, seed, drawn_seed, offset), counts)


def s2fp8_stat_buffers(x: torch.Tensor):
    """New (sums, params) for lowfp.S2FP8Stats of a call on x's device."""
    return (torch.zeros(S2FP8_SUM_SIZE, dtype=torch.int64, device=x.device),
            torch.zeros(4, dtype=torch.float64, device=x.device))


def _s2fp8_impl(x, fmt, log_max, rounding, sr_bits, seed, drawn_seed, offset, count, grad_fmt,
                grad_rounding):
    sums, params = s2fp8_stat_buffers(x)
    counts = _counts(x, count)
    y = run_s2fp8(x, new_output(x, x.dtype, torch.preserve_format), log_max,
                  _call(fmt, rounding, sr_bits, seed, drawn_seed, offset), sums, params,
                  counts if count else None)
    return y, sums, params, counts


def _s2fp8_into_impl(x, out, fmt, log_max, rounding, sr_bits, seed, drawn_seed, offset, sums,
                     params, counts):
    run_s2fp8(x, out, log_max, _call(fmt, rounding, sr_bits, seed, drawn_seed, offset), sums,
              params, counts)


def weight_grid(weight_format: Optional[str]) -> tuple:
    """The native kernels' grid argument: () or the weight format's (e, m, b, specials,
    subnormals)."""
    if weight_format is None:
        return ()
    from .formats import SPECIALS
    f = Format.parse(weight_format)
    return (f.e, f.m, f.b, SPECIALS.index(f.specials), f.subnormals)


def _extra_bits_split_impl(w32, dtype, k, rounding, sr_bits, seed, drawn_seed, offset, count,
                           weight_format=None):
    from .extra_bits import packed_words
    mod, device, stream = backends.native(w32, "w32")
    src = w32.contiguous()
    w16 = torch.empty(w32.shape, dtype=dtype, device=w32.device)
    packed = torch.empty(packed_words(src.numel(), k, rounding), dtype=torch.int32,
                         device=w32.device)
    counts = _counts(w32, count)
    for t, name in ((src, "w32"), (w16, "the result buffer"), (packed, "the packed buffer")):
        backends.check_dense(t, name)
    mod.extra_bits_split(src.data_ptr(), w16.data_ptr(), DTYPE_CODES[dtype], packed.data_ptr(),
                         src.numel(), k, weight_grid(weight_format), ROUNDING_MODES.index(rounding),
                         philox_key(seed, drawn_seed),
                         offset & _U64,
                         counts.data_ptr() if count else 0, device, stream)
    return w16, packed, counts


def _extra_bits_merge_impl(w16, packed, k, rounding, weight_format=None):
    mod, device, stream = backends.native(w16, "w16")
    src, words = w16.contiguous(), packed.contiguous()
    out = torch.empty(w16.shape, dtype=torch.float32, device=w16.device)
    for t, name in ((src, "w16"), (words, "packed"), (out, "the result buffer")):
        backends.check_dense(t, name)
    mod.extra_bits_merge(src.data_ptr(), DTYPE_CODES[w16.dtype], words.data_ptr(), out.data_ptr(),
                         src.numel(), k, weight_grid(weight_format), ROUNDING_MODES.index(rounding),
                         device, stream)
    return out


# The scalars of one optimizer step: (the module's class, its float fields, its bool fields).
HYPER_FIELDS = {
    "sgd": ("SgdHyper", ("neg_lr", "momentum", "one_minus_dampening", "weight_decay"),
            ("nesterov", "maximize", "first_step", "has_momentum")),
    "adam": ("AdamHyper", ("decay", "weight_decay", "lerp_weight", "beta2", "one_minus_beta2",
                           "bias_correction2_sqrt", "eps", "neg_step_size"),
             ("decoupled", "amsgrad", "maximize", "cuda_association")),
}
_OPTIMIZER_CODES = {"sgd": 0, "adam": 1}
_UNUSED_STATE = (0, 0, 0)  # the pointers of a step's unused state slots (three in all)


def extra_bits_step_impl(params, grads, extras, moments, moments_per_param, optimizer, k,
                         rounding, state_dtype, hyper, flags, seed, offsets, found_inf,
                         grad_scale, counts, weight_format=None):
    """One native call (lowfp.optim's buffers are checked by the optimizer before it)."""
    mod, device, stream = backends.native(params[0], "parameter")
    cls, float_names, bool_names = HYPER_FIELDS[optimizer]
    values = dict(zip(float_names, hyper))
    values.update(zip(bool_names, flags))
    if device < 0 and optimizer == "adam":
        use_torch_sqrt()  # once: the CPU step's square roots as torch.sqrt's
    m = moments_per_param
    slots = [(p.data_ptr(), g.data_ptr(), e.data_ptr(),
              *[t.data_ptr() for t in moments[i * m:(i + 1) * m]], *_UNUSED_STATE[m:],
              p.numel(), offset)
             for i, (p, g, e, offset) in enumerate(zip(params, grads, extras, offsets))]
    mod.extra_bits_step(_OPTIMIZER_CODES[optimizer], DTYPE_CODES[params[0].dtype], k,
                        weight_grid(weight_format), ROUNDING_MODES.index(rounding), DTYPE_CODES[state_dtype],
                        getattr(mod, cls)(**values), seed & _U64, slots,
                        0 if found_inf is None else found_inf.data_ptr(),
                        0 if grad_scale is None else grad_scale.data_ptr(), counts.data_ptr(),
                        device, stream)
    # Written through their pointers: tell autograd, as torch.optim's in-place updates do, so
    # a backward through a graph that saved a parameter before this step raises.
    torch.autograd.graph.increment_version([*params, *extras, *moments])


def _any_non_finite_impl(t):
    return check_non_finite(t, None, None)


for _name, _impl in (("draw_seed", _draw_seed_impl),):
    lib.impl(_name, _impl, "CompositeExplicitAutograd")
for _name, _impl in (("quantize", _quantize_impl), ("quantize_in_graph", _quantize_impl),
                     ("quantize_into", _quantize_into_impl),
                     ("s2fp8", _s2fp8_impl), ("s2fp8_into", _s2fp8_into_impl),
                     ("extra_bits_split", _extra_bits_split_impl),
                     ("extra_bits_merge", _extra_bits_merge_impl),
                     ("any_non_finite", _any_non_finite_impl),
                     ("extra_bits_step", extra_bits_step_impl)):
    for _dispatch_key in ("CPU", "CUDA"):
        lib.impl(_name, _impl, _dispatch_key)


# -- fake implementations: shapes, dtypes and devices only -------------------------------------

@torch.library.register_fake("lowfp::draw_seed", lib=lib)
def _draw_seed_fake():
    return torch.empty(2, dtype=torch.int64)


@torch.library.register_fake("lowfp::quantize_in_graph", lib=lib)
@torch.library.register_fake("lowfp::quantize", lib=lib)
def _quantize_fake(x, fmt, rounding, sr_bits, seed, drawn_seed, offset, dtype, count, grad_fmt,
                   grad_rounding):
    return (torch.empty_like(x, dtype=dtype, memory_format=torch.preserve_format),
            x.new_empty(4 if count else 0, dtype=torch.int64))


@torch.library.register_fake("lowfp::quantize_into", lib=lib)
def _quantize_into_fake(x, out, fmt, rounding, sr_bits, seed, drawn_seed, offset, counts):
    return None


@torch.library.register_fake("lowfp::s2fp8", lib=lib)
def _s2fp8_fake(x, fmt, log_max, rounding, sr_bits, seed, drawn_seed, offset, count, grad_fmt,
                grad_rounding):
    return (torch.empty_like(x, memory_format=torch.preserve_format),
            x.new_empty(S2FP8_SUM_SIZE, dtype=torch.int64),
            x.new_empty(4, dtype=torch.float64),
            x.new_empty(4 if count else 0, dtype=torch.int64))


@torch.library.register_fake("lowfp::s2fp8_into", lib=lib)
def _s2fp8_into_fake(x, out, fmt, log_max, rounding, sr_bits, seed, drawn_seed, offset, sums,
                     params, counts):
    return None


@torch.library.register_fake("lowfp::extra_bits_split", lib=lib)
def _extra_bits_split_fake(w32, dtype, k, rounding, sr_bits, seed, drawn_seed, offset, count,
                           weight_format=None):
    from .extra_bits import packed_words
    return (w32.new_empty(w32.shape, dtype=dtype),
            w32.new_empty(packed_words(w32.numel(), k, rounding), dtype=torch.int32),
            w32.new_empty(4 if count else 0, dtype=torch.int64))


@torch.library.register_fake("lowfp::any_non_finite", lib=lib)
def _any_non_finite_fake(t):
    return t.new_empty((), dtype=torch.bool)


@torch.library.register_fake("lowfp::extra_bits_step", lib=lib)
def _extra_bits_step_fake(params, grads, extras, moments, moments_per_param, optimizer, k,
                          rounding, state_dtype, hyper, flags, seed, offsets, found_inf,
                          grad_scale, counts, weight_format=None):
    return None


@torch.library.register_fake("lowfp::extra_bits_merge", lib=lib)
def _extra_bits_merge_fake(w16, packed, k, rounding, weight_format=None):
    return w16.new_empty(w16.shape, dtype=torch.float32)


# -- autograd: straight through, or the gradient rounded to grad_fmt ----------------------------

def round_gradient(grad: torch.Tensor, grad_fmt: Optional[str], grad_rounding: str) -> torch.Tensor:
    """The gradient a rounding hands back: ``grad``, or grad rounded to ``grad_fmt`` (a format
    or S2FP8 string checked when the forward call was made) with ``grad_rounding``."""
    if grad_fmt is None:
        return grad
    drawn = torch.ops.lowfp.draw_seed() if grad_rounding == "stochastic" else None
    precision = _precision(grad_fmt)
    if isinstance(precision, S2FP8):
        return torch.ops.lowfp.s2fp8(grad, str(precision.fmt), precision.log_max, grad_rounding,
                                     32, 0, drawn, 0, False, None, "nearest")[0]
    assert isinstance(precision, Format)
    return torch.ops.lowfp.quantize(grad, grad_fmt, grad_rounding, 32, 0, drawn, 0, grad.dtype,
                                    False, None, "nearest")[0]


def _setup_context(ctx, inputs, output):
    ctx.grad_fmt, ctx.grad_rounding = inputs[-2], inputs[-1]


def _backward(ctx, grad, *unused):
    n_inputs = 11
    return (round_gradient(grad, ctx.grad_fmt, ctx.grad_rounding),) + (None,) * (n_inputs - 1)


torch.library.register_autograd("lowfp::quantize", _backward, setup_context=_setup_context, lib=lib)
torch.library.register_autograd("lowfp::s2fp8", _backward, setup_context=_setup_context, lib=lib)

