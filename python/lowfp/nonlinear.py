"""Internal formats of the operators between the GEMMs (docs/design.md §11): softmax, layer norm,
RMS norm, GELU and SiLU computed as a fixed sequence of arithmetic operations, each operation's
result rounded to the format its kind names, in forward and in backward, as mptorch's
QSoftmaxFormats / QLayerNormFormats and microxcaling's vector ops do.

    >>> fwd = lowfp.nonlinear.Arithmetic(exp="bfloat16", sum="bfloat16", div="bfloat16")
    >>> y = lowfp.nonlinear.softmax(x, -1, forward=fwd)
    >>> with lowfp.nonlinear.emulate(forward=fwd, backward=fwd):   # F.softmax, F.layer_norm, ...
    ...     loss = model(x).sum()

Every operation runs on float64 values (16/32-bit inputs widened exactly), its result rounded to
nearest in its kind's format (None: left in float64); a sum is taken in index order along the
reduction, each partial sum rounded in the ``sum`` format (None: torch's float64 sum). The result
is cast to the input's dtype. Each function's docstring lists its operations, kind by kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .formats import Format, to_format
from .quantize import quantize

__all__ = ["Arithmetic", "softmax", "layer_norm", "rms_norm", "gelu", "silu", "emulate", "OPERATORS"]

OPERATORS = ("softmax", "layer_norm", "rms_norm", "gelu", "silu")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SQRT_HALF = math.sqrt(0.5)                # rounded to float64 once: a constant of the sequence
_INV_SQRT_2PI = 1.0 / math.sqrt(2 * math.pi)


@dataclass(frozen=True)
class Arithmetic:
    """The format each kind of arithmetic operation rounds its result to (None: float64).

    ``add`` (additions and subtractions), ``mul``, ``div``, ``sqrt``, ``exp``, ``erf`` and ``sum``
    (each partial sum of a reduction, in index order). Formats are lowfp Formats or their
    strings, rounded to nearest (with the format's overflow policy)."""

    add: Optional[Union[Format, str]] = None
    mul: Optional[Union[Format, str]] = None
    div: Optional[Union[Format, str]] = None
    sqrt: Optional[Union[Format, str]] = None
    exp: Optional[Union[Format, str]] = None
    erf: Optional[Union[Format, str]] = None
    sum: Optional[Union[Format, str]] = None

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None:
                fmt = to_format(v, f.name)
                reason = fmt.fit_error(torch.float64)
                if reason:
                    raise ValueError(f"{f.name}: {fmt} does not fit float64 ({reason})")
                object.__setattr__(self, f.name, fmt)

    @staticmethod
    def of(value, name: str) -> "Arithmetic":
        """value as an Arithmetic: one, None (nothing rounded), or a format for every kind."""
        if value is None:
            return _NONE
        if isinstance(value, Arithmetic):
            return value
        if isinstance(value, (Format, str)):
            fmt = to_format(value, name)
            return Arithmetic(*([fmt] * len(fields(Arithmetic))))
        raise TypeError(f"{name} must be a lowfp.nonlinear.Arithmetic, a format or None, got {value!r}")


_NONE = Arithmetic()


class _Steps:
    """The rounding of each operation of one pass (forward or backward) under an Arithmetic."""

    def __init__(self, a: Arithmetic):
        self.a = a

    def __call__(self, kind: str, v: torch.Tensor) -> torch.Tensor:
        fmt = getattr(self.a, kind)
        return v if fmt is None else quantize(v, fmt)

    def sum(self, v: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
        """v summed over dims (kept, size 1): in index order (row-major over dims), each partial
        sum rounded in the sum format; torch's float64 sum without one."""
        if self.a.sum is None:
            return v.sum(dim=tuple(dims), keepdim=True)
        dims = sorted(d % v.dim() for d in dims)
        moved = v.movedim(dims, list(range(v.dim() - len(dims), v.dim())))
        lead = moved.shape[:v.dim() - len(dims)]
        flat = moved.reshape(*lead, math.prod(moved.shape[len(lead):]))
        if flat.shape[-1] == 0:  # a sum of nothing: +0
            return v.new_zeros(v.shape).sum(dim=tuple(dims), keepdim=True)
        s = self("sum", flat[..., 0])
        for i in range(1, flat.shape[-1]):
            s = self("sum", s + flat[..., i])
        for d in dims:
            s = s.unsqueeze(d)
        return s


def _check_x(x, name="input"):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")


# -- softmax ---------------------------------------------------------------------------------------

class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, fwd, bwd):
        r = _Steps(fwd)
        x64 = x.double()
        m = x64.amax(dim, keepdim=True)
        e = r("exp", torch.exp(r("add", x64 - m)))
        y = r("div", e / r.sum(e, (dim,)))
        ctx.save_for_backward(y)
        ctx.dim, ctx.bwd = dim, bwd
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        r = _Steps(ctx.bwd)
        g = dy.double()
        t = r.sum(r("mul", g * y), (ctx.dim,))
        return r("mul", y * r("add", g - t)).to(dy.dtype), None, None, None


def softmax(x: torch.Tensor, dim: int, *, forward=None, backward=None) -> torch.Tensor:
    """Softmax along ``dim``. Forward: m = max x (exact); d = add(x − m); e = exp(exp(d));
    s = sum(e); y = div(e / s). Backward (y the forward's rounded result, dy the incoming
    gradient): p = mul(dy · y); t = sum(p); g = add(dy − t); dx = mul(y · g).
    ``forward`` / ``backward``: an Arithmetic, a format for every kind, or None."""
    _check_x(x)
    if not isinstance(dim, int) or isinstance(dim, bool) or not -max(x.dim(), 1) <= dim < max(x.dim(), 1):
        raise ValueError(f"dim must be an int within the input's {x.dim()} dims, got {dim!r}")
    if x.numel() == 0:  # (nothing to round: torch's empty result and gradient)
        return F.softmax(x, dim)
    return _Softmax.apply(x, dim % max(x.dim(), 1) if x.dim() else 0,
                          Arithmetic.of(forward, "forward"), Arithmetic.of(backward, "backward"))


# -- layer norm and RMS norm -----------------------------------------------------------------------

class _Norm(torch.autograd.Function):
    """Layer norm (centered) or RMS norm over the last k dims."""

    @staticmethod
    def forward(ctx, x, k, weight, bias, eps, centered, fwd, bwd):
        r = _Steps(fwd)
        x64 = x.double()
        dims = tuple(range(x.dim() - k, x.dim()))
        n = float(math.prod(x.shape[x.dim() - k:]))
        if centered:
            mu = r("div", r.sum(x64, dims) / n)
            c = r("add", x64 - mu)
        else:
            c = x64
        var = r("div", r.sum(r("mul", c * c), dims) / n)
        rstd = r("div", 1.0 / r("sqrt", torch.sqrt(r("add", var + eps))))
        normed = r("mul", c * rstd)
        y = normed
        w64 = None if weight is None else weight.double()
        if w64 is not None:
            y = r("mul", y * w64)
        if bias is not None:
            y = r("add", y + bias.double())
        ctx.save_for_backward(normed, rstd, w64)
        ctx.k, ctx.n, ctx.centered, ctx.bwd = k, n, centered, bwd
        ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
        ctx.dtypes = (x.dtype, None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        normed, rstd, w64 = ctx.saved_tensors
        r = _Steps(ctx.bwd)
        g = dy.double()
        k, n = ctx.k, ctx.n
        dims = tuple(range(g.dim() - k, g.dim()))
        lead = tuple(range(g.dim() - k))
        gn = r("mul", g * w64) if ctx.has_weight else g  # the gradient of the normalised values
        b = r.sum(r("mul", gn * normed), dims)
        if ctx.centered:
            a = r.sum(gn, dims)
            w = r("add", r("add", r("mul", n * gn) - a) - r("mul", normed * b))
            dx = r("mul", r("div", rstd / n) * w)
        else:
            w = r("add", gn - r("mul", normed * r("div", b / n)))
            dx = r("mul", rstd * w)
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dw = db = None
        if ctx.has_weight and ctx.needs_input_grad[2]:
            dw = (r.sum(r("mul", g * normed), lead).reshape(normed.shape[g.dim() - k:]) if lead
                  else r("mul", g * normed)).to(w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = (r.sum(g, lead).reshape(normed.shape[g.dim() - k:]) if lead else g).to(b_dtype)
        return dx.to(x_dtype), None, dw, db, None, None, None, None


def _norm_args(x, normalized_shape, weight, bias, eps, name):
    _check_x(x)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    k = len(shape)
    if k == 0 or k > x.dim() or tuple(x.shape[x.dim() - k:]) != shape:
        raise ValueError(f"{name}: normalized_shape {shape} must be the input's last dims "
                         f"(input shape {tuple(x.shape)})")
    for t, what in ((weight, "weight"), (bias, "bias")):
        if t is not None:
            _check_x(t, what)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: {what} must have shape {shape}, got {tuple(t.shape)}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"{name}: eps must be a non-negative number, got {eps!r}")
    return k


def layer_norm(x: torch.Tensor, normalized_shape, weight=None, bias=None, eps: float = 1e-5, *,
               forward=None, backward=None) -> torch.Tensor:
    """F.layer_norm over the last dims (N elements). Forward: mu = div(sum(x) / N);
    c = add(x − mu); v = div(sum(mul(c · c)) / N); r = div(1 / sqrt(sqrt(add(v + eps))));
    xn = mul(c · r); y = add(mul(xn · weight) + bias) (each part only with its tensor).
    Backward: gn = mul(dy · weight) (dy without one); a = sum(gn); b = sum(mul(gn · xn));
    dx = mul(div(r / N) · add(add(mul(N · gn) − a) − mul(xn · b))); dweight = sum over the leading
    dims of mul(dy · xn); dbias = sum of dy."""
    k = _norm_args(x, normalized_shape, weight, bias, eps, "layer_norm")
    if x.numel() == 0:
        return F.layer_norm(x, x.shape[x.dim() - k:], weight, bias, eps)
    return _Norm.apply(x, k, weight, bias, float(eps), True, Arithmetic.of(forward, "forward"),
                       Arithmetic.of(backward, "backward"))


def rms_norm(x: torch.Tensor, normalized_shape, weight=None, eps: Optional[float] = None, *,
             forward=None, backward=None) -> torch.Tensor:
    """F.rms_norm over the last dims (N elements; eps None: x's dtype's machine epsilon, as torch).
    Forward: v = div(sum(mul(x · x)) / N); r = div(1 / sqrt(sqrt(add(v + eps)))); xn = mul(x · r);
    y = mul(xn · weight). Backward: gn = mul(dy · weight); b = sum(mul(gn · xn));
    dx = mul(r · add(gn − mul(xn · div(b / N)))); dweight = sum over the leading dims of
    mul(dy · xn)."""
    if eps is None and isinstance(x, torch.Tensor) and x.dtype in _FLOATS:
        eps = torch.finfo(x.dtype).eps
    k = _norm_args(x, normalized_shape, weight, None, eps, "rms_norm")
    if x.numel() == 0:
        return F.rms_norm(x, x.shape[x.dim() - k:], weight, eps)
    return _Norm.apply(x, k, weight, None, float(eps), False, Arithmetic.of(forward, "forward"),
                       Arithmetic.of(backward, "backward"))


# -- GELU and SiLU ---------------------------------------------------------------------------------

class _Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd, bwd):
        r = _Steps(fwd)
        x64 = x.double()
        phi2 = r("add", 1.0 + r("erf", torch.erf(r("mul", x64 * _SQRT_HALF))))
        y = r("mul", r("mul", 0.5 * x64) * phi2)
        ctx.save_for_backward(x64)
        ctx.bwd = bwd
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        (x64,) = ctx.saved_tensors
        r = _Steps(ctx.bwd)
        phi2 = r("add", 1.0 + r("erf", torch.erf(r("mul", x64 * _SQRT_HALF))))
        density = r("mul", r("exp", torch.exp(r("mul", -0.5 * r("mul", x64 * x64)))) * _INV_SQRT_2PI)
        d = r("add", r("mul", 0.5 * phi2) + r("mul", x64 * density))
        return r("mul", dy.double() * d).to(dy.dtype), None, None


def gelu(x: torch.Tensor, *, forward=None, backward=None) -> torch.Tensor:
    """F.gelu (``approximate='none'``). Forward: p = add(1 + erf(erf(mul(x · √½))));
    y = mul(mul(0.5 · x) · p). Backward: p as in forward, q = mul(exp(exp(mul(−0.5 · mul(x · x))))
    · 1/√(2π)); dx = mul(dy · add(mul(0.5 · p) + mul(x · q))). (√½ and 1/√(2π) are float64.)"""
    _check_x(x)
    return _Gelu.apply(x, Arithmetic.of(forward, "forward"), Arithmetic.of(backward, "backward"))


class _Silu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd, bwd):
        r = _Steps(fwd)
        x64 = x.double()
        s = r("div", 1.0 / r("add", 1.0 + r("exp", torch.exp(-x64))))
        ctx.save_for_backward(x64, s)
        ctx.bwd = bwd
        return r("mul", x64 * s).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x64, s = ctx.saved_tensors
        r = _Steps(ctx.bwd)
        d = r("mul", s * r("add", 1.0 + r("mul", x64 * r("add", 1.0 - s))))
        return r("mul", dy.double() * d).to(dy.dtype), None, None


def silu(x: torch.Tensor, *, forward=None, backward=None) -> torch.Tensor:
    """F.silu. Forward: s = div(1 / add(1 + exp(exp(−x)))); y = mul(x · s). Backward (s the
    forward's): dx = mul(dy · mul(s · add(1 + mul(x · add(1 − s)))))."""
    _check_x(x)
    return _Silu.apply(x, Arithmetic.of(forward, "forward"), Arithmetic.of(backward, "backward"))


# -- the torch.nn.functional calls of a model -------------------------------------------------------

class _Mode(TorchFunctionMode):
    def __init__(self, formats):
        super().__init__()
        self.formats = formats  # {op: dict(forward=Arithmetic, backward=Arithmetic)}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _FUNCTIONS.get(func)
        kw = self.formats.get(op)
        if kw is None:
            return func(*args, **kwargs)
        if op == "softmax":
            x, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else None)
            dtype = kwargs.get("dtype", args[3] if len(args) > 3 else None)
            if dim is not None and isinstance(x, torch.Tensor) and x.dtype in _FLOATS:
                return softmax(x if dtype is None else x.to(dtype), dim, **kw)
        elif op in ("layer_norm", "rms_norm"):
            return (layer_norm if op == "layer_norm" else rms_norm)(*args, **kwargs, **kw)
        elif op == "gelu":
            if kwargs.get("approximate", args[1] if len(args) > 1 else "none") == "none":
                return gelu(args[0], **kw)
        elif not kwargs.get("inplace", args[1] if len(args) > 1 else False):  # silu
            return silu(args[0], **kw)
        return func(*args, **kwargs)


_FUNCTIONS = {F.softmax: "softmax", F.layer_norm: "layer_norm", F.rms_norm: "rms_norm", F.gelu: "gelu",
              F.silu: "silu"}


def emulate(forward=None, backward=None, ops: Sequence[str] = OPERATORS, **per_op) -> TorchFunctionMode:
    """A context in which ``F.softmax``, ``F.layer_norm``, ``F.rms_norm``, ``F.gelu`` and
    ``F.silu`` (and so nn.Softmax, nn.LayerNorm, nn.RMSNorm, nn.GELU, nn.SiLU) run as this
    module's functions: those named in ``ops`` with ``forward`` and ``backward``, and any named as
    a keyword with its own, ``softmax=(forward, backward)`` (or one Arithmetic or format for both
    passes; None: torch's). Calls the functions do not cover pass through to torch: a softmax
    without ``dim``, GELU's tanh approximation, an in-place SiLU."""
    if isinstance(ops, str):
        ops = (ops,)
    ops = tuple(ops)
    for name in list(ops) + list(per_op):
        if name not in OPERATORS:
            raise ValueError(f"ops must be among {OPERATORS}, got {name!r}")
    both = dict(forward=Arithmetic.of(forward, "forward"), backward=Arithmetic.of(backward, "backward"))
    formats = {op: both for op in ops}
    for op, value in per_op.items():
        if value is None:
            formats.pop(op, None)
            continue
        fwd, bwd = value if isinstance(value, tuple) else (value, value)
        formats[op] = dict(forward=Arithmetic.of(fwd, f"{op}[0]"), backward=Arithmetic.of(bwd, f"{op}[1]"))
    return _Mode(formats)
