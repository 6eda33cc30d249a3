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
forward's unrounded operands (saved), as those recipes do.

Convolutions (``F.conv1d/2d/3d``, as implicit GEMMs): the forward and the input gradient reduce
over channels and kernel positions, and blocks run along the channels within a group — X and W
along the input channels, dY and W along the output channels — so that each block pairs with one
block of the other operand, as microxcaling does. The weight gradient reduces over the batch and
positions: dY and X along the batch axis. A 2-D-blocked weight format takes its blocks over
(output, input) channels at each kernel position, so that W and Wᵀ round alike. Transposed
convolutions (``F.conv_transpose1d/2d/3d``, weight (in, out / groups, *kernel)) are a
convolution's input-gradient GEMM: the forward reduces over the input channels (X's, and W's
first axis within a group), the input gradient over the output channels (dY's, W's second axis),
the weight gradient over the batch.

Attention (``F.scaled_dot_product_attention``) runs as torch's math backend computes it:
S = (Q √scale)(K √scale)ᵀ, plus the mask (a boolean one as 0 / -inf), softmax (0 for a row whose
scores are all -inf, as torch's), dropout, O = P V, the two products emulated as matmuls (Q and
K along the head dim, rounded before √scale multiplies them; P and V along the keys; their
backward GEMMs as above); softmax stays in the input's dtype. Without formats the result is
torch's math backend's, bit for bit, for float32 and float64 inputs (torch computes 16-bit ones
in float32).

``nn.MultiheadAttention`` runs torch's own ``F.multi_head_attention_forward`` with this mode
active inside it (the function otherwise hands itself to the mode whole), so its projections are
emulated linears and its products emulated matmuls (``bmm``, ``baddbmm`` as mask + product) or
attention. The bias and everything else stay as they are.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import types

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..accumulate import Accumulate, gemm as accumulated_gemm
from ..formats import add_parse_hint
from .config import Scaled, named, to_scaled
from .._native import DTYPE_CODES, runs_natively
from .quantize import PreparedScaled, quantize_scaled

__all__ = ["GemmRecipe", "RECIPES", "emulate_gemms", "GemmEmulation", "ACCUMULATE_GEMMS", "PerModule",
           "high_precision_ends", "recipe_name"]

GEMM_OPS = ("linear", "conv", "matmul", "attention")


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
        hadamard_seed: the operands of the GEMMs ``hadamard_gemms`` names go through the random
            Hadamard transform with these signs (the NVFP4 recipe: the weight gradient's), or
            not (None).
        hadamard_gemms: which GEMMs take the transform: a subset of ``("fprop", "dgrad",
            "wgrad")``, default ``("wgrad",)``. Each operand is transformed along the GEMM's
            reduction axis, rounded and transformed back (2-D blocks and per-tensor scales are
            not transformed).
        ops: which GEMMs to emulate, a subset of ``("linear", "conv", "matmul", "attention")``
            (default all; ``("linear",)`` is torchao's MX/NVFP4 training, which swaps linear
            layers only).
        accumulate: a ``lowfp.Accumulate``: the forward and both backward GEMMs of linear layers,
            matmuls and attention's products sum their (rounded) operands' products as it says
            (``lowfp.gemm``, docs/design.md §10; the bias added after, in float32), then round
            to the model's dtype; None: torch's GEMM. Or one per GEMM, as TransformerEngine's
            recipes name them: a mapping from ``"fprop"`` (the forward GEMM), ``"dgrad"`` (the
            input gradient's) and ``"wgrad"`` (the weight gradient's: a matmul's second operand,
            summed over its rows) to an Accumulate or None (an absent name: torch's), kept as a
            tuple of (name, Accumulate) pairs so that the recipe stays hashable. Convolutions
            sum over their im2col windows, transposed convolutions as the convolution they
            transpose (docs/design.md §10).

    Each format's blocks run along the operand's reduction axis whatever its ``axis`` says
    (2-D blocks stay 2-D, per-tensor scales per tensor).
    """

    input: Optional[Union[Scaled, str]] = None
    weight: Optional[Union[Scaled, str]] = None
    grad: Optional[Union[Scaled, str]] = None
    grad_operand: Optional[Union[Scaled, str]] = None
    grad_rounding: str = "nearest"
    hadamard_seed: Optional[int] = None
    hadamard_gemms: Tuple[str, ...] = ("wgrad",)
    ops: Tuple[str, ...] = GEMM_OPS
    accumulate: Union[Accumulate, Mapping[str, Optional[Accumulate]], Tuple, None] = None

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
        hg = (self.hadamard_gemms,) if isinstance(self.hadamard_gemms, str) else self.hadamard_gemms
        if not isinstance(hg, (tuple, list, set, frozenset)) or not set(hg) <= set(ACCUMULATE_GEMMS):
            raise ValueError(f"hadamard_gemms must be a subset of {ACCUMULATE_GEMMS}, got {self.hadamard_gemms!r}")
        object.__setattr__(self, "hadamard_gemms", tuple(g for g in ACCUMULATE_GEMMS if g in hg))
        ops = (self.ops,) if isinstance(self.ops, str) else self.ops
        if not isinstance(ops, (tuple, list, set, frozenset)) or not set(ops) <= set(GEMM_OPS):
            raise ValueError(f"ops must be a subset of {GEMM_OPS}, got {self.ops!r}")
        object.__setattr__(self, "ops", tuple(o for o in GEMM_OPS if o in ops))
        acc = self.accumulate
        if isinstance(acc, Mapping) or (isinstance(acc, tuple) and all(isinstance(p, tuple) for p in acc)):
            acc = dict(acc)
            object.__setattr__(self, "accumulate", tuple((g, acc[g]) for g in ACCUMULATE_GEMMS if g in acc))
        object.__setattr__(self, "_per_gemm", _per_gemm(acc))

    def hadamard(self, gemm: str) -> Optional[int]:
        """The Hadamard signs' seed for the ``"fprop"``, ``"dgrad"`` or ``"wgrad"`` GEMM (None:
        no transform)."""
        return self.hadamard_seed if gemm in self.hadamard_gemms else None

    def accumulation(self, gemm: str) -> Optional[Accumulate]:
        """The Accumulate of the ``"fprop"``, ``"dgrad"`` or ``"wgrad"`` GEMM (None: torch's)."""
        return self._per_gemm[ACCUMULATE_GEMMS.index(gemm)]


ACCUMULATE_GEMMS = ("fprop", "dgrad", "wgrad")


def _per_gemm(accumulate) -> Tuple[Optional[Accumulate], ...]:
    """GemmRecipe.accumulate as one Accumulate (or None) per GEMM of ACCUMULATE_GEMMS; torch's
    float32 (``Accumulate("float32")``) as None."""
    def checked(acc, name):
        if acc is not None and not isinstance(acc, Accumulate):
            raise TypeError(f"{name} must be a lowfp.Accumulate or None, got {acc!r}")
        return None if acc is None or acc.is_torch else acc
    if isinstance(accumulate, Mapping):
        unknown = set(accumulate) - set(ACCUMULATE_GEMMS)
        if unknown:
            raise ValueError(f"accumulate's keys must be among {ACCUMULATE_GEMMS}, got {sorted(map(str, unknown))}")
        return tuple(checked(accumulate.get(g), f"accumulate[{g!r}]") for g in ACCUMULATE_GEMMS)
    return (checked(accumulate, "accumulate"),) * len(ACCUMULATE_GEMMS)


_N = named()
RECIPES = {
    # torchao's MX training default: E4M3 elements, 32-element blocks, for all three GEMMs.
    "mxfp8": GemmRecipe(_N["mxfp8_e4m3"]),
    "mxfp8-e5m2grad": GemmRecipe(_N["mxfp8_e4m3"], grad=_N["mxfp8_e5m2"]),
    # torchao's mxfp8_cublas_rceil: the same with cuBLAS's rceil scale rule, which rounds the
    # scale up where floor can push a block's largest element past E4M3's range (arXiv 2506.08027).
    "mxfp8-rceil": GemmRecipe(Scaled("float8_e4m3fn", block=32, scale_rule="rceil")),
    "mxfp4": GemmRecipe(_N["mxfp4_e2m1"]),
    # The NVFP4 recipe: 16×16 weight blocks, stochastic rounding of gradients, the random
    # Hadamard transform on the weight-gradient GEMM's operands.
    "nvfp4": GemmRecipe(_N["nvfp4"], weight=Scaled("float4_e2m1fn", block=(16, 16),
                                                   scale="float8_e4m3fn", tensor_scale=True),
                        grad_rounding="stochastic", hadamard_seed=0),
    # The same with 4over6 block scales on every operand (TransformerEngine's nvfp4_4over6="all").
    "nvfp4-4over6": GemmRecipe(_N["nvfp4_4over6"], weight=Scaled("float4_e2m1fn", block=(16, 16),
                                                                  scale="float8_e4m3fn", tensor_scale=True,
                                                                  four_over_six="mse"),
                               grad_rounding="stochastic", hadamard_seed=0),
    # FP8 with float32 scales: per tensor (E5M2 gradients, TransformerEngine's hybrid) and per row.
    "fp8-tensorwise": GemmRecipe(_N["fp8_e4m3_tensorwise"], grad=_N["fp8_e5m2_tensorwise"]),
    "fp8-rowwise": GemmRecipe(_N["fp8_e4m3_rowwise"]),
}


def _parse_hint(text: str) -> str:
    """What a format's parse error adds: the scaled formats, and what a GEMM recipe's name is."""
    hint = f"; where scaled formats are taken, also {sorted(named())}"
    if text in RECIPES:
        hint += (f"; {text!r} is a GEMM recipe (the formats of a GEMM's operands, lowfp formats "
                 f"{text}): lowfp.scaled.emulate_gemms(model, {text!r}), or "
                 f"lowfp.emulate(..., gemm_recipe={text!r})")
    return hint


add_parse_hint(_parse_hint)


def to_recipe(value) -> GemmRecipe:
    if isinstance(value, GemmRecipe):
        return value
    if isinstance(value, str) and value in RECIPES:
        return RECIPES[value]
    raise ValueError(f"recipe must be a GemmRecipe or one of {sorted(RECIPES)}, got {value!r}")


def _aimed(fmt: Scaled, axis: int) -> Scaled:
    """fmt with its 1-D blocks (or per-slice scales) along ``axis``; 2-D blocks and per-tensor
    scales as they are."""
    if fmt.axis is None or isinstance(fmt.block, tuple):
        return fmt
    return fmt.with_axis(axis)


_along = functools.lru_cache(maxsize=256)(_aimed)  # eager calls (Dynamo traces _aimed itself)


def _q(t: torch.Tensor, fmt: Optional[Scaled], axis: int, rounding: str = "nearest",
       hadamard_seed: Optional[int] = None) -> torch.Tensor:
    """t rounded to fmt with its blocks along ``axis``."""
    if fmt is None:
        return t
    fmt = _aimed(fmt, axis) if torch.compiler.is_compiling() else _along(fmt, axis)
    use_hadamard = (hadamard_seed is not None and fmt.axis is not None
                    and not isinstance(fmt.block, tuple) and t.shape[axis] % 16 == 0)
    if (not use_hadamard and t.is_contiguous() and t.dtype in DTYPE_CODES
            and runs_natively(t, None)):  # the prepared request, as lowfp.quantize's remembered calls
        y = _prepared(fmt, rounding, t).round(t, None)
        if y is not None:
            return y
    with torch.no_grad():
        return quantize_scaled(t, fmt, rounding, hadamard_seed=hadamard_seed if use_hadamard else None)


_PREPARED: dict = {}


def _prepared(fmt: Scaled, rounding: str, t: torch.Tensor) -> PreparedScaled:
    """The prepared rounding of tensors like t (dtype, backend) to fmt."""
    key = (fmt, rounding, t.dtype, t.is_cuda)
    entry = _PREPARED.get(key)
    if entry is None:
        entry = _PREPARED[key] = PreparedScaled(fmt, rounding, None, 32, t)
    return entry


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in ``dtype``, t itself where it has it: a Function's forward returns no .to() of a
    tensor to its own dtype (traced, an alias of it, whose gradients torch 2.11's compiled
    autograd.Function loses: zeros for every input)."""
    return t if t.dtype == dtype else t.to(dtype)


def _mm(a: torch.Tensor, b: torch.Tensor, recipe: GemmRecipe, gemm: str) -> torch.Tensor:
    """a @ b (torch.matmul's broadcasting; a and b of at least 2 dims for an emulated
    accumulation), summed as the recipe's accumulation of ``gemm`` says, in a's dtype."""
    acc = recipe.accumulation(gemm)
    if acc is None or a.dim() < 2 or b.dim() < 2:
        return torch.matmul(a, b)
    with torch.no_grad():  # (promote_types: torch.result_type's dtype would break a compiled graph)
        return _in_dtype(accumulated_gemm(a, b, acc), torch.promote_types(a.dtype, b.dtype))


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, recipe):
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.has_bias = recipe, b is not None
        h = recipe.hadamard("fprop")
        xq, wq = _q(x, recipe.input, -1, "nearest", h), _q(w, recipe.weight, -1, "nearest", h)
        if recipe.accumulation("fprop") is None:
            return F.linear(xq, wq, b)
        y = _mm(xq, wq.t(), recipe, "fprop")
        return y if b is None else _in_dtype(y.float() + b, y.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        r = ctx.recipe
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            h = r.hadamard("dgrad")
            gx = _mm(_q(g2, r.grad, -1, r.grad_rounding, h), _q(w, r.grad_operand or r.weight, 0, "nearest", h),
                     r, "dgrad")
            gx = gx.reshape(x.shape)
        if ctx.needs_input_grad[1]:
            h = r.hadamard("wgrad")
            gw = _mm(_q(g2, r.grad, 0, r.grad_rounding, h).t(), _q(x2, r.grad_operand or r.input, 0, "nearest", h),
                     r, "wgrad")
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb, None


class _Matmul(torch.autograd.Function):
    """C = (Q(a) · fa) (Q(b) · fb): the operands rounded along the reduction axis, then multiplied
    by the factors (1.0: none; attention's √scale, as torch's math computes it)."""

    @staticmethod
    def forward(ctx, a, b, recipe, fa=1.0, fb=1.0):
        ctx.save_for_backward(a, b)
        ctx.recipe, ctx.factors = recipe, (fa, fb)
        h = recipe.hadamard("fprop")
        return _mm(_times(_q(a, recipe.input, -1, "nearest", h), fa), _times(_q(b, recipe.input, -2, "nearest", h), fb),
                   recipe, "fprop")

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        r = ctx.recipe
        fa, fb = ctx.factors
        op = r.grad_operand or r.input
        ga = gb = None
        if ctx.needs_input_grad[0]:
            h = r.hadamard("dgrad")
            bq = _times(_q(b, op, -1, "nearest", h), fb)
            ga = _mm(_q(grad, r.grad, -1, r.grad_rounding, h), bq.transpose(-1, -2), r, "dgrad")
            ga = _times(ga, fa).sum_to_size(a.shape)
        if ctx.needs_input_grad[1]:
            h = r.hadamard("wgrad")
            gb = _mm(_times(_q(a, op, -2, "nearest", h), fa).transpose(-1, -2),
                     _q(grad, r.grad, -2, r.grad_rounding, h), r, "wgrad")
            gb = _times(gb, fb).sum_to_size(b.shape)
        return ga, gb, None, None, None


def _times(t: torch.Tensor, factor: float) -> torch.Tensor:
    return t if factor == 1.0 else t * factor


def _q_grouped(t: torch.Tensor, fmt, dim: int, groups: int, rounding: str = "nearest",
               hadamard_seed: Optional[int] = None) -> torch.Tensor:
    """t rounded along its channel axis ``dim`` within each of ``groups`` groups."""
    if groups == 1:
        return _q(t, fmt, dim, rounding, hadamard_seed)
    tg = t.unflatten(dim, (groups, t.shape[dim] // groups))
    return _q(tg, fmt, dim + 1, rounding, hadamard_seed).flatten(dim, dim + 1)


def _q_conv_weight(w: torch.Tensor, fmt, dim: int, groups: int,
                   hadamard_seed: Optional[int] = None) -> torch.Tensor:
    """A conv weight (O, C/groups, *kernel) rounded along ``dim`` (1: input channels, 0: output
    channels within a group); 2-D blocks over (output, input) channels at each kernel position."""
    if fmt is None or not isinstance(fmt.block, tuple):
        return _q_grouped(w, fmt, dim, groups if dim == 0 else 1, "nearest", hadamard_seed)
    wg = w.unflatten(0, (groups, w.shape[0] // groups)).movedim((1, 2), (-2, -1))
    rows, short = wg.shape[-2], -wg.shape[-2] % fmt.block[0]
    if short:  # zero rows complete the last row of blocks without changing any block's amax
        wg = F.pad(wg, (0, 0, 0, short))
    wq = _q(wg, fmt, -1)[..., :rows, :]
    return wq.movedim((-2, -1), (1, 2)).flatten(0, 1)


def _conv_args(x, w, stride, padding, dilation):
    """Integer stride, padding and dilation lists (and x padded explicitly for an asymmetric
    ``padding="same"``, as torch does)."""
    nd = w.dim() - 2

    def ints(v):
        return [int(v)] * nd if isinstance(v, int) else [int(i) for i in v]
    stride, dilation = ints(stride), ints(dilation)
    if padding == "valid":
        padding = 0
    elif padding == "same":
        total = [d * (k - 1) for d, k in zip(dilation, w.shape[2:])]
        padding = [t // 2 for t in total]
        extra = [t - 2 * p for t, p in zip(total, padding)]
        if any(extra):
            pad = []
            for e in reversed(extra):
                pad += [0, e]
            x = F.pad(x, pad)
    return x, stride, ints(padding), dilation


def _windows(x: torch.Tensor, kernel, stride, dilation) -> torch.Tensor:
    """The windows of a padded x (N, C, *S) a convolution multiplies its weight with, as a view
    (N, C, *L, *kernel): L output positions per spatial dim."""
    for i, (k, s, d) in enumerate(zip(kernel, stride, dilation)):
        x = x.unfold(2 + i, d * (k - 1) + 1, s)
    return x[(...,) + tuple(slice(None, None, d) for d in dilation)]


def _padded(x: torch.Tensor, pad) -> torch.Tensor:
    return F.pad(x, [p for p in reversed(pad) for _ in range(2)]) if any(pad) else x


def _columns(x: torch.Tensor, kernel, stride, pad, dilation, groups) -> torch.Tensor:
    """im2col: (N, G, positions, C/G · prod(kernel)), each row a window in the weight's
    (channel, *kernel) order."""
    win = _windows(_padded(x, pad), kernel, stride, dilation)
    n, c, nd = x.shape[0], x.shape[1], len(kernel)
    positions = math.prod(win.shape[2:2 + nd])
    win = win.unflatten(1, (groups, c // groups))  # (N, G, C/G, *L, *k)
    order = (0, 1) + tuple(range(3, 3 + nd)) + (2,) + tuple(range(3 + nd, 3 + 2 * nd))
    return win.permute(order).reshape(n, groups, positions, -1)


def _conv_accumulated(x, w, stride, pad, dilation, groups, recipe, gemm="fprop") -> torch.Tensor:
    """The forward convolution (no bias) as a GEMM per group (``gemm``'s accumulation; a
    transposed convolution's input gradient is one): each output element sums its window's
    products in the weight's (channel, *kernel) order."""
    kernel = w.shape[2:]
    cols = _columns(x, kernel, stride, pad, dilation, groups)
    wt = w.reshape(groups, w.shape[0] // groups, -1).transpose(-1, -2)  # (G, C/G·k, O/G)
    y = _mm(cols, wt, recipe, gemm)  # (N, G, positions, O/G)
    out = [(s + 2 * p - d * (k - 1) - 1) // st + 1
           for s, p, d, k, st in zip(x.shape[2:], pad, dilation, kernel, stride)]
    return y.transpose(-1, -2).reshape(x.shape[0], w.shape[0], *out)


def _conv_weight_grad_accumulated(grad, x, w, stride, pad, dilation, groups, recipe) -> torch.Tensor:
    """dW as a GEMM per group (the "wgrad" accumulation): each element sums over the batch and
    the output positions, batch-major (a transposed convolution's: grad its input, x the
    incoming gradient)."""
    cols = _columns(x, w.shape[2:], stride, pad, dilation, groups)  # (N, G, P, C/G·k)
    n, g = cols.shape[:2]
    dy = grad.reshape(n, g, grad.shape[1] // g, -1).permute(1, 2, 0, 3).flatten(2)  # (G, O/G, N·P)
    gw = _mm(dy, cols.transpose(0, 1).flatten(1, 2), recipe, "wgrad")  # (G, O/G, C/G·k)
    return gw.reshape(w.shape)


def _conv_input_grad_accumulated(grad, x_shape, w, stride, pad, dilation, groups, recipe,
                                 gemm="dgrad") -> torch.Tensor:
    """dX (of the padded input, padding then cut off): per output position the GEMM
    dY·W (``gemm``'s accumulation, over the group's output channels; a transposed
    convolution's forward is one), then the contributions of the overlapping windows to each
    input element added in float32 (col2im, as torch does)."""
    kernel = w.shape[2:]
    n, c = x_shape[:2]
    dy = grad.reshape(n, groups, grad.shape[1] // groups, -1).transpose(-1, -2)  # (N, G, P, O/G)
    dcols = _mm(dy, w.reshape(groups, w.shape[0] // groups, -1), recipe, gemm)  # (N, G, P, C/G·k)
    spatial = [s + 2 * p for s, p in zip(x_shape[2:], pad)]
    where = _windows(torch.arange(math.prod(spatial), device=w.device).view(1, 1, *spatial),
                     kernel, stride, dilation)  # (1, 1, *L, *k): the flat input index of each product
    where = where.reshape(-1, math.prod(kernel))  # (P, k)
    contrib = dcols.unflatten(-1, (c // groups, math.prod(kernel))).permute(0, 1, 3, 2, 4)  # (N, G, C/G, P, k)
    gx = grad.new_zeros(n, c, math.prod(spatial), dtype=torch.float32)
    gx.index_add_(2, where.flatten(), contrib.reshape(n, c, -1).float())
    gx = gx.view(n, c, *spatial)
    return gx[(slice(None), slice(None)) + tuple(slice(p, p + s) for p, s in zip(pad, x_shape[2:]))].to(grad.dtype)


class _Conv(torch.autograd.Function):
    """A convolution, its operands rounded as the recipe says; with an accumulation, each of
    its three GEMMs is lowfp.gemm over the im2col windows (docs/design.md §10)."""

    @staticmethod
    def forward(ctx, x, w, b, stride, padding, dilation, groups, recipe):
        xp, stride, pad, dilation = _conv_args(x, w, stride, padding, dilation)
        ctx.save_for_backward(xp, w)
        ctx.args = (stride, pad, dilation, groups)
        ctx.recipe, ctx.has_bias, ctx.x_shape = recipe, b is not None, x.shape
        h = recipe.hadamard("fprop")
        xq = _q_grouped(xp, recipe.input, 1, groups, "nearest", h)
        wq = _q_conv_weight(w, recipe.weight, 1, groups, h)
        if recipe.accumulation("fprop") is not None:
            y = _conv_accumulated(xq, wq, stride, pad, dilation, groups, recipe)
            return y if b is None else _in_dtype(y.float() + b.view(-1, *[1] * (w.dim() - 2)), y.dtype)
        conv = (F.conv1d, F.conv2d, F.conv3d)[w.dim() - 3]
        return conv(xq, wq, b, stride, pad, dilation, groups)

    @staticmethod
    def backward(ctx, grad):
        xp, w = ctx.saved_tensors
        stride, pad, dilation, groups = ctx.args
        r = ctx.recipe
        out_pad = [0] * (w.dim() - 2)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            h = r.hadamard("dgrad")
            gq = _q_grouped(grad, r.grad, 1, groups, r.grad_rounding, h)
            wq = _q_conv_weight(w, r.grad_operand or r.weight, 0, groups, h)
            if r.accumulation("dgrad") is not None:
                gx = _conv_input_grad_accumulated(gq, xp.shape, wq, stride, pad, dilation, groups, r)
            else:
                gx = torch.ops.aten.convolution_backward(gq, xp, wq, None, stride, pad, dilation, False,
                                                         out_pad, groups, (True, False, False))[0]
            gx = gx[tuple(slice(0, n) for n in ctx.x_shape)]  # drop an asymmetric "same" pad
        if ctx.needs_input_grad[1]:
            h = r.hadamard("wgrad")
            gq = _q(grad, r.grad, 0, r.grad_rounding, h)
            xq = _q(xp, r.grad_operand or r.input, 0, "nearest", h)
            if r.accumulation("wgrad") is not None:
                gw = _conv_weight_grad_accumulated(gq, xq, w, stride, pad, dilation, groups, r)
            else:
                gw = torch.ops.aten.convolution_backward(gq, xq, w, None, stride, pad, dilation, False,
                                                         out_pad, groups, (False, True, False))[1]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = grad.sum([0] + list(range(2, grad.dim())))
        return gx, gw, gb, None, None, None, None, None


class _ConvTranspose(torch.autograd.Function):
    """F.conv_transpose1d/2d/3d, the input-gradient GEMM of a convolution with the same weight
    (in, out / groups, *kernel): its forward reduces over the input channels (X's, and W's first
    axis within a group), its input gradient over the output channels (dY's, and W's second
    axis), its weight gradient over the batch. With an accumulation each GEMM is that
    convolution's (docs/design.md §10): forward its input gradient, input gradient its forward,
    weight gradient its weight gradient with X and dY in each other's place."""

    @staticmethod
    def forward(ctx, x, w, b, stride, padding, output_padding, groups, dilation, recipe):
        nd = w.dim() - 2

        def ints(v):
            return [int(v)] * nd if isinstance(v, int) else [int(i) for i in v]
        args = (ints(stride), ints(padding), ints(dilation), True, ints(output_padding), groups)
        ctx.save_for_backward(x, w)
        ctx.args, ctx.recipe, ctx.has_bias = args, recipe, b is not None
        if any(recipe.accumulation(gm) is not None for gm in ACCUMULATE_GEMMS) and any(
                op >= st for op, st in zip(args[4], args[0])):
            # (torch allows it below the dilation: the equivalent convolution then has windows
            # that no input position maps to)
            raise ValueError(f"an emulated accumulation takes transposed convolutions with "
                             f"output_padding smaller than stride; got output_padding {args[4]}, "
                             f"stride {args[0]}")
        h = recipe.hadamard("fprop")
        xq, wq = _q_grouped(x, recipe.input, 1, groups, "nearest", h), _q_conv_weight(w, recipe.weight, 0, groups, h)
        if recipe.accumulation("fprop") is None:
            return torch.ops.aten.convolution(xq, wq, b, *args)
        stride_, pad, dilation_, _, out_pad, _ = args
        out = [(s - 1) * st - 2 * p + d * (k - 1) + op + 1
               for s, st, p, d, k, op in zip(x.shape[2:], stride_, pad, dilation_, w.shape[2:], out_pad)]
        y_shape = (x.shape[0], w.shape[1] * groups, *[o + 2 * p for o, p in zip(out, pad)])
        y = _conv_input_grad_accumulated(xq, y_shape, wq, stride_, [0] * nd, dilation_, groups, recipe, "fprop")
        y = y[(slice(None), slice(None)) + tuple(slice(p, p + o) for p, o in zip(pad, out))]
        return y if b is None else _in_dtype(y.float() + b.view(-1, *[1] * nd), y.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        r, args, groups = ctx.recipe, ctx.args, ctx.args[-1]
        stride, pad, dilation = args[0], args[1], args[2]
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            h = r.hadamard("dgrad")
            gq = _q_grouped(grad, r.grad, 1, groups, r.grad_rounding, h)
            wq = _q_conv_weight(w, r.grad_operand or r.weight, 1, groups, h)
            if r.accumulation("dgrad") is not None:
                gx = _conv_accumulated(gq, wq, stride, pad, dilation, groups, r, "dgrad")
            else:
                gx = torch.ops.aten.convolution_backward(gq, x, wq, None, *args, (True, False, False))[0]
        if ctx.needs_input_grad[1]:
            h = r.hadamard("wgrad")
            gq = _q(grad, r.grad, 0, r.grad_rounding, h)
            xq = _q(x, r.grad_operand or r.input, 0, "nearest", h)
            if r.accumulation("wgrad") is not None:
                gw = _conv_weight_grad_accumulated(xq, _padded(gq, pad), w, stride, [0] * len(pad), dilation,
                                                   groups, r)
            else:
                gw = torch.ops.aten.convolution_backward(gq, xq, w, None, *args, (False, True, False))[1]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = grad.sum([0] + list(range(2, grad.dim())))
        return gx, gw, gb, None, None, None, None, None, None


def _attention(recipe, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    """F.scaled_dot_product_attention as torch's math backend computes it, with the two products
    emulated: the scale's square root multiplies each rounded operand of Q Kᵀ, a boolean or causal
    mask becomes an additive one (0 or -inf), and a row of scores that are all -inf softmaxes to 0
    (torch's _safe_softmax: a fully masked query gives 0, not NaN, and passes no gradient)."""
    L, S = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    root = math.sqrt(abs(scale))
    if enable_gqa and k.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    if is_causal:
        attn_mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(
            ~attn_mask, float("-inf"))
    s = _Matmul.apply(q, k.transpose(-2, -1), recipe, -root if scale < 0 else root, root)
    if attn_mask is not None:
        s = s + attn_mask
    p = _safe_softmax(s)
    if dropout_p > 0.0:
        p = F.dropout(p, dropout_p)
    return _Matmul.apply(p, v, recipe)


def _safe_softmax(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, 0 in rows whose entries are all -inf."""
    safe = getattr(torch.ops.aten, "_safe_softmax", None)  # (torch 2.5 on)
    if safe is not None:
        return safe(s, -1)
    dead = (s == float("-inf")).all(-1, keepdim=True)
    return torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)


_CONVS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_CONV_TRANSPOSES = {F.conv_transpose1d: 1, F.conv_transpose2d: 2, F.conv_transpose3d: 3}
# (name, default) of each argument, in order, after input, weight and bias
_CONV_ARGS = (("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1))
_CONV_TRANSPOSE_ARGS = (("stride", 1), ("padding", 0), ("output_padding", 0), ("groups", 1),
                        ("dilation", 1))


def _convolve(function, nd: int, rest, args, kwargs, recipe):
    """An nd-dimensional convolution's call through ``function`` (_Conv or _ConvTranspose), an
    unbatched input as a batch of one; None where the arguments are not a floating input and
    weight of its dimensions (the call then runs as it is)."""
    names = ("input", "weight", "bias") + tuple(n for n, _ in rest)
    a = dict(zip(names, (None, None, None) + tuple(d for _, d in rest)))
    a.update(zip(names, args))
    a.update(kwargs)
    x, w = a["input"], a["weight"]
    if not (isinstance(x, torch.Tensor) and x.is_floating_point() and isinstance(w, torch.Tensor)
            and w.dim() == nd + 2 and x.dim() in (nd + 1, nd + 2)):
        return None
    batched = x.dim() == nd + 2
    y = function.apply(x if batched else x.unsqueeze(0), w, a["bias"],
                       *(a[n] for n, _ in rest), recipe)
    return y if batched else y.squeeze(0)


@functools.lru_cache(maxsize=None)
def _entered(func):
    """``func``, a composite of torch.nn.functional that hands itself whole to a torch-function
    mode (``F.multi_head_attention_forward``), as a function that skips that hand-over: torch's
    own body, whose products a mode pushed again around it then sees one by one."""
    env = dict(func.__globals__, has_torch_function=lambda *args: False)
    body = types.FunctionType(func.__code__, env, func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    return body


_BADDBMMS = {torch.baddbmm, torch.Tensor.baddbmm}
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm,
            torch.Tensor.mm, torch.Tensor.bmm}
# The kind of GEMM each function is (GemmEmulation.table's "GEMMs run").
_KIND = {F.linear: "linear", F.scaled_dot_product_attention: "attention",
         F.multi_head_attention_forward: "attention",
         **{f: "conv" for f in (*_CONVS, *_CONV_TRANSPOSES)}, **{f: "matmul" for f in (*_MATMULS, *_BADDBMMS)}}


class GemmHandler:
    """A recipe's GEMMs, emulated: ``handler(func, args, kwargs)`` is the emulated result of a
    call of a GEMM the recipe covers (``func`` a torch function, as a torch-function mode sees
    it), or NotImplemented for any other call. The runtime of :func:`emulate_gemms` and of
    ``lowfp.emulate(..., gemm_recipe=)`` (whose interception calls it for the functions named in
    ``lowfp._intercept.GEMM_NAMES``) alike. With ``per_module`` the recipe is the one of the
    module running the call (None: the call runs as it is)."""

    def __init__(self, recipe: Optional[GemmRecipe], per_module: Optional["PerModule"] = None):
        self.recipe, self.per_module = recipe, per_module
        self.mode = _Mode(self)  # pushed around composites whose inner products it must see

    def __call__(self, func, args=(), kwargs=None):
        if self.per_module is None:
            recipe = self.recipe
        else:
            recipe = self.per_module.current()
            kind = _KIND.get(func)
            if kind is not None:
                self.per_module.note(kind)
        if recipe is None:
            return NotImplemented
        kwargs = kwargs or {}
        ops = recipe.ops
        if func is F.linear and "linear" in ops:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dim() >= 1 and x.is_floating_point():
                return _Linear.apply(x, w, b, recipe)
        elif func in _CONVS and "conv" in ops:
            y = _convolve(_Conv, _CONVS[func], _CONV_ARGS, args, kwargs, recipe)
            if y is not None:
                return y
        elif func in _CONV_TRANSPOSES and "conv" in ops:
            y = _convolve(_ConvTranspose, _CONV_TRANSPOSES[func], _CONV_TRANSPOSE_ARGS, args, kwargs, recipe)
            if y is not None:
                return y
        elif func is F.scaled_dot_product_attention and "attention" in ops:
            if args[0].is_floating_point():
                return _attention(recipe, *args, **kwargs)
        elif func is F.multi_head_attention_forward:
            with self.mode:  # torch's body, its projections and products seen by the mode
                return _entered(func)(*args, **kwargs)
        elif func in _BADDBMMS and "matmul" in ops and not kwargs and len(args) == 3:
            c, a, b = args  # baddbmm(c, a, b) = c + a @ b (beta = alpha = 1)
            if a.is_floating_point() and b.is_floating_point():
                return c + _Matmul.apply(a, b, recipe)
        elif func in _MATMULS and "matmul" in ops and not kwargs and len(args) == 2:
            a, b = args
            if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 2
                    and b.dim() >= 2 and a.is_floating_point()):
                return _Matmul.apply(a, b, recipe)
        return NotImplemented


def recipe_name(recipe: Optional[GemmRecipe]) -> str:
    """A recipe's name in RECIPES, "none" for None, else its repr."""
    if recipe is None:
        return "none"
    return next((n for n, r in RECIPES.items() if r == recipe), repr(recipe))


class PerModule:
    """Recipes by module name: ``{pattern: recipe}`` (fnmatch patterns against
    ``model.named_modules()`` names, ``""`` the model itself; for each module the first pattern
    that matches its name gives its recipe, None leaving its GEMMs as they are). A GEMM takes the
    recipe of the innermost running module that a pattern matched (modules no pattern matches
    pass their parent's on), and runs as it is where none did. Forward hooks on the matched
    modules keep the running ones on a stack while installed."""

    def __init__(self, model: torch.nn.Module, recipes: Mapping):
        entries = []
        for pattern, value in recipes.items():
            if not isinstance(pattern, str):
                raise TypeError(f"recipe patterns must be strings, got {pattern!r}")
            entries.append((pattern, None if value is None else to_recipe(value)))
        self.matched: Dict[torch.nn.Module, Tuple[str, str, Optional[GemmRecipe]]] = {}
        for name, module in model.named_modules():
            for pattern, recipe in entries:
                if fnmatch.fnmatchcase(name, pattern):
                    self.matched[module] = (name, pattern, recipe)
                    break
        used = {pattern for _, pattern, _ in self.matched.values()}
        unused = [p for p, _ in entries if p not in used]
        if unused:
            names = [n for n, _ in model.named_modules()][:8]
            raise ValueError(f"recipe pattern(s) {unused} match no module of the model (or only modules an "
                             f"earlier pattern took); its module names begin {names}")
        self._stack: List[Tuple[str, Optional[GemmRecipe]]] = []
        self._handles: list = []
        self._model = model
        self.ran: Dict[str, set] = {}  # module name -> the kinds of GEMM its recipe was asked for

    def current(self) -> Optional[GemmRecipe]:
        return self._stack[-1][1] if self._stack else None

    def note(self, kind: str) -> None:
        name = self._stack[-1][0] if self._stack else None
        kinds = self.ran.get(name)
        if kinds is None:
            kinds = self.ran[name] = set()
        kinds.add(kind)

    def install(self) -> None:
        if self._handles:
            return
        stack = self._stack

        def leave(module, args, out):  # (returns None: the module's output stays as it is)
            stack.pop()
        for module, (name, _, recipe) in self.matched.items():
            self._handles.append(module.register_forward_pre_hook(
                lambda m, args, entry=(name, recipe): stack.append(entry)))
            self._handles.append(module.register_forward_hook(leave, always_call=True))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()

    def table(self) -> str:
        """The recipe of each module that holds GEMMs (linear, convolution and attention layers,
        and every matched module whose recipe GEMMs have taken: "GEMMs run" names their kinds,
        listed under that module), and the pattern (of which module) that gave it."""
        rows = [("module", "GEMMs run", "pattern", "recipe")]
        by_name = {name: (pattern, recipe) for name, pattern, recipe in self.matched.values()}
        for name, module in self._model.named_modules():
            if name not in self.ran and not isinstance(module, _GEMM_MODULES):
                continue
            owner = name
            while owner not in by_name and owner:
                owner = owner.rpartition(".")[0]
            pattern, recipe = by_name.get(owner, ("-", None))
            source = pattern if owner == name or pattern == "-" else f"{pattern} (of {owner or '(model)'})"
            rows.append((name or "(model)", ",".join(sorted(self.ran.get(name, ()))) or "-", source,
                         recipe_name(recipe)))
        if None in self.ran:
            rows.append(("(no module matched)", ",".join(sorted(self.ran[None])), "-", "none"))
        width = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join(f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]:<{width[2]}}  {r[3]}" for r in rows)


_GEMM_MODULES = (torch.nn.Linear, torch.nn.modules.conv._ConvNd, torch.nn.MultiheadAttention)


def high_precision_ends(model: torch.nn.Module, first: int = 0, last: int = 0, fraction: float = 0.0,
                        types: Tuple[type, ...] = (torch.nn.Linear,)) -> Dict[str, None]:
    """``{name: None}`` for the first ``first`` and the last ``last`` modules of ``types`` (in
    ``model.named_modules()`` order), and the last ``round(fraction × count)`` of them (the NVFP4
    pretraining report keeps about 15 % of the linear layers, mostly the last, in BF16): put it
    before the other patterns, ``{**high_precision_ends(model, last=1), "*": "nvfp4"}``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for value, name in ((first, "first"), (last, "last")):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be between 0 and 1, got {fraction!r}")
    names = [n for n, m in model.named_modules() if isinstance(m, types)]
    tail = max(last, round(fraction * len(names)))
    keep = names[:first] + names[max(0, len(names) - tail):] if tail else names[:first]
    return {n: None for n in names if n in set(keep)}


class _Mode(TorchFunctionMode):
    """A torch-function mode that emulates its handler's GEMMs and passes every other call."""

    def __init__(self, handler: GemmHandler):
        super().__init__()
        self.handler = handler

    def __torch_function__(self, func, types, args=(), kwargs=None):
        y = self.handler(func, args, kwargs)
        return func(*args, **(kwargs or {})) if y is NotImplemented else y


class GemmEmulation:
    """The runtime of :func:`emulate_gemms`: while installed, ``model``'s forward runs with its
    linear layers and matrix products emulated (context manager, or ``install()``/``close()``)."""

    def __init__(self, model: torch.nn.Module, recipe):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.per_module = PerModule(model, recipe) if isinstance(recipe, Mapping) else None
        self.recipe = None if self.per_module is not None else to_recipe(recipe)
        self._handler = GemmHandler(self.recipe, self.per_module)
        self._saved = None
        self._installed = False

    def table(self) -> str:
        """The recipe of each module a pattern matched (a single recipe: its name)."""
        return self.per_module.table() if self.per_module is not None else recipe_name(self.recipe)

    def install(self) -> "GemmEmulation":
        if self._installed:
            return self
        if self.per_module is not None:
            self.per_module.install()
        model, mode = self.model, self._handler.mode
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
        if self.per_module is not None:
            self.per_module.close()
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


def emulate_gemms(model: torch.nn.Module, recipe: Union[GemmRecipe, str, Mapping]) -> GemmEmulation:
    """Round the operands of ``model``'s GEMMs (``F.linear``, ``F.conv1d/2d/3d``,
    ``F.conv_transpose1d/2d/3d``, ``matmul``/``@``, ``mm``, ``bmm``, the two products of
    ``F.scaled_dot_product_attention``)
    to the scaled formats of ``recipe`` (a :class:`GemmRecipe` or a name of ``RECIPES``: mxfp8,
    mxfp8-e5m2grad, mxfp4, nvfp4, fp8-tensorwise, fp8-rowwise) in forward and in both backward
    GEMMs, each along its reduction axis (see the module docs). Any optimizer trains the model.

    Or one recipe per module: a mapping from fnmatch patterns of ``model.named_modules()`` names
    to recipes (or None: left as they are), the first match winning, ``{"head": None,
    "blocks.*": "nvfp4"}`` (:class:`PerModule`; a pattern matches a module's whole name and
    ``*`` crosses dots, so ``"blocks.0*"`` is block 0 and all within it; ``high_precision_ends``
    lists the first and last layers; ``GemmEmulation.table()`` says which module got which
    recipe, and which kinds of GEMM ran under it).
    """
    return GemmEmulation(model, recipe)
