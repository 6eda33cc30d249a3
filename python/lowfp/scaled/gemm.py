"""GEMM-operand emulation with scaled formats (docs/design.md §9): the operands of a model's
linear layers and matrix products are rounded along their own reduction axes, in forward and
in both backward GEMMs, as MX and NVFP4 training recipes (torchao's, microxcaling's MxSpecs) do.

>>> import torch, lowfp
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
>>> with lowfp.scaled.emulate_gemms(model, "mxfp8"):
...     loss = model(torch.randn(8, 64)).square().mean()
...     loss.backward()

For Y = X Wᵀ (``F.linear``; X of shape (..., K), W of shape (N, K)):
- forward: Y = Q_in(X) Q_w(W)ᵀ, both along K;
- input gradient: dX = Q_grad(dY) Q_grad_w(W), dY along N (its last axis), W along N (its first);
- weight gradient: dW = Q_grad(dY)ᵀ Q_grad_in(X), both along the rows (M, the flattened leading
  axes).
For C = A B (``matmul``, ``@``, ``mm``, ``bmm``; A (..., M, K), B (..., K, N)) likewise: forward
along K; dA = Q(dC) Q(B)ᵀ along N; dB = Q(A)ᵀ Q(dC) along M. The backward GEMMs re-round the
forward's unrounded operands (saved), as those recipes do. The bias and everything else stay as
they are; convolutions and attention are not emulated yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .config import Scaled, named, to_scaled
from .quantize import quantize_scaled

__all__ = ["GemmRecipe", "RECIPES", "emulate_gemms", "GemmEmulation"]


def _scaled(value, name: str) -> Optional[Scaled]:
    if value is None:
        return None
    s = to_scaled(value)
    if s is None:
        raise TypeError(f"{name} must be a lowfp.Scaled, its name or None, got {value!r}")
    return s


@dataclass(frozen=True)
class GemmRecipe:
    """The formats of a GEMM's operands (None: left unrounded).

    Args:
        input: the forward GEMM's activation operands (both operands of a matmul).
        weight: the forward GEMM's weight (``F.linear``'s W); default ``input``.
        grad: the output gradient in both backward GEMMs; default ``input``.
        grad_operand: the forward operands as the backward GEMMs re-round them; default
            ``weight`` for W and ``input`` for the rest.
        grad_rounding: the rounding of ``grad`` (e.g. ``"stochastic"``); the others round to
            nearest.
        hadamard_seed: the weight-gradient GEMM's operands go through the random Hadamard
            transform with these signs (the NVFP4 recipe), or not (None).

    Each format's blocks run along the operand's reduction axis whatever its ``axis`` says
    (2-D blocks stay 2-D, per-tensor scales per tensor).
    """

    input: Optional[Union[Scaled, str]] = None
    weight: Optional[Union[Scaled, str]] = None
    grad: Optional[Union[Scaled, str]] = None
    grad_operand: Optional[Union[Scaled, str]] = None
    grad_rounding: str = "nearest"
    hadamard_seed: Optional[int] = None

    def __post_init__(self):
        get = object.__getattribute__
        inp = _scaled(get(self, "input"), "input")
        object.__setattr__(self, "input", inp)
        object.__setattr__(self, "weight", _scaled(get(self, "weight"), "weight") or inp)
        object.__setattr__(self, "grad", _scaled(get(self, "grad"), "grad") or inp)
        object.__setattr__(self, "grad_operand", _scaled(get(self, "grad_operand"), "grad_operand"))
        if self.grad_rounding not in ("nearest", "stochastic", "toward_zero", "up", "down",
                                      "nearest_away"):
            raise ValueError(f"grad_rounding must be a rounding mode, got {self.grad_rounding!r}")


_N = named()
RECIPES = {
    # torchao's MX training default: E4M3 elements, 32-element blocks, for all three GEMMs.
    "mxfp8": GemmRecipe(_N["mxfp8_e4m3"]),
    "mxfp8-e5m2grad": GemmRecipe(_N["mxfp8_e4m3"], grad=_N["mxfp8_e5m2"]),
    "mxfp4": GemmRecipe(_N["mxfp4_e2m1"]),
    # The NVFP4 recipe: 16×16 weight blocks, stochastic rounding of gradients, the random
    # Hadamard transform on the weight-gradient GEMM's operands.
    "nvfp4": GemmRecipe(_N["nvfp4"], weight=Scaled("float4_e2m1fn", block=(16, 16),
                                                   scale="float8_e4m3fn", tensor_scale=True),
                        grad_rounding="stochastic", hadamard_seed=0),
    # FP8 with float32 scales: per tensor (E5M2 gradients, TransformerEngine's hybrid) and per row.
    "fp8-tensorwise": GemmRecipe(_N["fp8_e4m3_tensorwise"], grad=_N["fp8_e5m2_tensorwise"]),
    "fp8-rowwise": GemmRecipe(_N["fp8_e4m3_rowwise"]),
}


def to_recipe(value) -> GemmRecipe:
    if isinstance(value, GemmRecipe):
        return value
    if isinstance(value, str) and value in RECIPES:
        return RECIPES[value]
    raise ValueError(f"recipe must be a GemmRecipe or one of {sorted(RECIPES)}, got {value!r}")


def _q(t: torch.Tensor, fmt: Optional[Scaled], axis: int, rounding: str = "nearest",
       hadamard_seed: Optional[int] = None) -> torch.Tensor:
    """t rounded to fmt with its blocks along ``axis``."""
    if fmt is None:
        return t
    if fmt.axis is not None and not isinstance(fmt.block, tuple):
        fmt = Scaled(fmt.element, block=fmt.block, axis=axis, scale=fmt.scale,
                     scale_rule=fmt.scale_rule, tensor_scale=fmt.tensor_scale)
    use_hadamard = (hadamard_seed is not None and fmt.axis is not None
                    and not isinstance(fmt.block, tuple) and t.shape[axis] % 16 == 0)
    with torch.no_grad():
        return quantize_scaled(t, fmt, rounding, hadamard_seed=hadamard_seed if use_hadamard else None)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, recipe):
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.has_bias = recipe, b is not None
        return F.linear(_q(x, recipe.input, -1), _q(w, recipe.weight, -1), b)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        r = ctx.recipe
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (_q(g2, r.grad, -1, r.grad_rounding) @ _q(w, r.grad_operand or r.weight, 0))
            gx = gx.reshape(x.shape)
        if ctx.needs_input_grad[1]:
            h = r.hadamard_seed
            gw = (_q(g2, r.grad, 0, r.grad_rounding, h).t() @ _q(x2, r.grad_operand or r.input, 0, "nearest", h))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb, None


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, recipe):
        ctx.save_for_backward(a, b)
        ctx.recipe = recipe
        return torch.matmul(_q(a, recipe.input, -1), _q(b, recipe.input, -2))

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        r = ctx.recipe
        op = r.grad_operand or r.input
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = torch.matmul(_q(grad, r.grad, -1, r.grad_rounding), _q(b, op, -1).transpose(-1, -2))
            ga = _sum_to(ga, a.shape)
        if ctx.needs_input_grad[1]:
            h = r.hadamard_seed
            gb = torch.matmul(_q(a, op, -2, "nearest", h).transpose(-1, -2),
                              _q(grad, r.grad, -2, r.grad_rounding, h))
            gb = _sum_to(gb, b.shape)
        return ga, gb, None


def _sum_to(t: torch.Tensor, shape) -> torch.Tensor:
    """A broadcast operand's gradient summed back to its shape."""
    while t.dim() > len(shape):
        t = t.sum(0)
    for i, n in enumerate(shape):
        if n == 1 and t.shape[i] != 1:
            t = t.sum(i, keepdim=True)
    return t


_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm,
            torch.Tensor.mm, torch.Tensor.bmm}


class _Mode(TorchFunctionMode):
    def __init__(self, recipe: GemmRecipe):
        super().__init__()
        self.recipe = recipe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dim() >= 1 and x.is_floating_point():
                return _Linear.apply(x, w, b, self.recipe)
        elif func in _MATMULS and not kwargs and len(args) == 2:
            a, b = args
            if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 2
                    and b.dim() >= 2 and a.is_floating_point()):
                return _Matmul.apply(a, b, self.recipe)
        return func(*args, **kwargs)


class GemmEmulation:
    """The runtime of :func:`emulate_gemms`: while installed, ``model``'s forward runs with its
    linear layers and matrix products emulated (context manager, or ``install()``/``close()``)."""

    def __init__(self, model: torch.nn.Module, recipe):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model, self.recipe = model, to_recipe(recipe)
        self._saved = None
        self._installed = False

    def install(self) -> "GemmEmulation":
        if self._installed:
            return self
        model, mode = self.model, _Mode(self.recipe)
        self._saved = model.__dict__.get("forward")
        inner = model.forward

        def forward(*args, **kwargs):
            with mode:
                return inner(*args, **kwargs)
        model.forward = forward
        self._installed = True
        return self

    def close(self) -> None:
        if not self._installed:
            return
        if self._saved is not None:
            self.model.forward = self._saved
        else:
            del self.model.forward
        self._installed = False

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.close()
        return False


def emulate_gemms(model: torch.nn.Module, recipe: Union[GemmRecipe, str]) -> GemmEmulation:
    """Round the operands of ``model``'s GEMMs (``F.linear``, ``matmul``/``@``, ``mm``, ``bmm``)
    to the scaled formats of ``recipe`` (a :class:`GemmRecipe` or a name of ``RECIPES``: mxfp8,
    mxfp8-e5m2grad, mxfp4, nvfp4, fp8-tensorwise, fp8-rowwise) in forward and in both backward
    GEMMs, each along its reduction axis (see the module docs). Any optimizer trains the model.
    """
    return GemmEmulation(model, recipe)
