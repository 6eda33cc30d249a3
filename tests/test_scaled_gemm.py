"""GEMM-operand emulation (lowfp.scaled.emulate_gemms): each operand of the forward and of both
backward GEMMs rounded along its own reduction axis, checked against explicit reference GEMMs."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lowfp
from lowfp.scaled import GemmRecipe, Scaled, emulate_gemms


def q(t, fmt, axis, rounding="nearest"):
    """The reference rounding: fmt with its blocks along axis (2-D blocks and per-tensor scales
    as they are)."""
    if fmt.axis is not None and not isinstance(fmt.block, tuple):
        fmt = Scaled(fmt.element, block=fmt.block, axis=axis, scale=fmt.scale,
                     scale_rule=fmt.scale_rule, tensor_scale=fmt.tensor_scale)
    return lowfp.quantize(t, fmt, rounding)


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-e5m2grad", "fp8-tensorwise", "fp8-rowwise",
                                    "nvfp4-no-sr"])
def test_linear_operands_are_rounded_along_their_reduction_axes(recipe):
    if recipe == "nvfp4-no-sr":  # deterministic: the NVFP4 formats without SR and the transform
        r = lowfp.scaled.RECIPES["nvfp4"]
        r = GemmRecipe(r.input, weight=r.weight, grad=r.grad)
    else:
        r = lowfp.scaled.RECIPES[recipe]
    torch.manual_seed(0)
    layer = nn.Linear(64, 48)
    x = torch.randn(2, 16, 64, requires_grad=True)
    g = torch.randn(2, 16, 48)
    with emulate_gemms(layer, r):
        y = layer(x)
    y.backward(g)
    w, b = layer.weight.detach(), layer.bias.detach()
    xd = x.detach()
    assert torch.equal(y, F.linear(q(xd, r.input, -1), q(w, r.weight, -1), b))
    g2, x2 = g.reshape(-1, 48), xd.reshape(-1, 64)
    want_dx = (q(g2, r.grad, -1) @ q(w, r.weight, 0)).reshape(x.shape)
    want_dw = q(g2, r.grad, 0).t() @ q(x2, r.input, 0)
    assert torch.equal(x.grad, want_dx)
    assert torch.equal(layer.weight.grad, want_dw)
    assert torch.equal(layer.bias.grad, g2.sum(0))
    # the operands were rounded: the emulated forward differs from the plain one
    assert not torch.equal(y, layer(x))


def test_matmul_operands_and_broadcasting():
    r = lowfp.scaled.RECIPES["mxfp8"]

    class Products(nn.Module):
        def forward(self, a, b):
            return (a @ b) + torch.bmm(a, b)

    a = torch.randn(3, 8, 64, requires_grad=True)
    b = torch.randn(3, 64, 32, requires_grad=True)
    g = torch.randn(3, 8, 32)
    model = Products()
    with emulate_gemms(model, r):
        out = model(a, b)
    out.backward(g)
    ad, bd = a.detach(), b.detach()
    one = q(ad, r.input, -1) @ q(bd, r.input, -2)
    assert torch.equal(out, one + one)
    want_da = q(g, r.grad, -1) @ q(bd, r.input, -1).transpose(-1, -2)
    want_db = q(ad, r.input, -2).transpose(-1, -2) @ q(g, r.grad, -2)
    assert torch.equal(a.grad, want_da + want_da)
    assert torch.equal(b.grad, want_db + want_db)
    # a broadcast operand's gradient is summed back to its shape
    class ByWeight(nn.Module):
        def forward(self, a, w):
            return a @ w

    w = torch.randn(64, 32, requires_grad=True)
    with emulate_gemms(ByWeight(), r) as em:
        out = em.model(a.detach(), w)
    out.backward(g)
    assert w.grad.shape == (64, 32)
    assert torch.equal(w.grad, (q(ad, r.input, -2).transpose(-1, -2) @ q(g, r.grad, -2)).sum(0))


@pytest.mark.parametrize("recipe", sorted(lowfp.scaled.RECIPES))
def test_recipes_train_a_small_mlp(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    x, y = torch.randn(128, 32), torch.randint(0, 4, (128,))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    with emulate_gemms(model, recipe):
        for _ in range(30):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert "forward" not in model.__dict__  # taken off the model


def test_stochastic_gradients_follow_the_seed_and_bad_recipes_are_refused():
    torch.manual_seed(0)
    layer = nn.Linear(32, 32)
    x = torch.randn(16, 32)

    def grads():
        layer.zero_grad()
        with emulate_gemms(layer, "nvfp4"):
            layer(x).square().sum().backward()
        return layer.weight.grad.clone()

    torch.manual_seed(5)
    a = grads()
    torch.manual_seed(5)
    assert torch.equal(a, grads())
    torch.manual_seed(6)
    assert not torch.equal(a, grads())
    with pytest.raises(ValueError, match="recipe"):
        emulate_gemms(layer, "mxfp9")
    with pytest.raises(TypeError, match="input"):
        GemmRecipe(input=lowfp.formats.float8_e4m3fn)


def test_scaled_formats_as_assignment_candidates():
    # Tensor-level: each tensor of the step rounded to a scaled format along its last axis.
    from lowfp import assign as A
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    tr = A.trace(model, x, F.cross_entropy, y)
    cand = A.Candidates(lo_forward="mxfp8_e4m3", lo_backward=lowfp.scaled.mxfp8_e5m2)
    a = A.uniform(tr, candidates=cand)
    assert a["v:0:linear"] == lowfp.scaled.mxfp8_e4m3
    bits = {n: (32 if f is None else f.bits) for n, f in a.formats.items()}
    assert a.aggregate_bits == round(sum(t.numel * bits[n] for n, t in tr.tensors.items()))
    assert A.Assignment.from_dict(a.to_dict()).formats == a.formats
    seen = {}
    with lowfp.emulate(model, a) as em:
        em.observer = lambda n, t: seen.setdefault(n, t.detach().clone())
        F.cross_entropy(model(x), y).backward()
    out = seen["v:0:linear"]
    assert torch.equal(out, lowfp.quantize(out, "mxfp8_e4m3"))  # on the MXFP8 grid of its blocks
    grad = seen["dv:0:linear"]
    assert torch.equal(grad, lowfp.quantize(grad, "mxfp8_e5m2", overflow="inf"))
