"""Internal formats of softmax, layer norm, RMS norm, GELU and SiLU (docs/design.md §11): forward
and backward bit for bit against a reference that applies each documented operation's rounding
step by step on Python floats (reference.round_exact), with a different format for each kind of
operation so that a rounding in the wrong place shows; without formats, torch's own operators;
the F.* calls of a model inside lowfp.nonlinear.emulate."""

import math

import pytest
import torch
import torch.nn.functional as F

import lowfp
from lowfp.formats import to_format
from lowfp.nonlinear import Arithmetic
from reference import Spec, round_exact

# a different format per kind (all round float64 values; none overflows on these inputs)
KINDS = Arithmetic(add="fp(5,6,0)", mul="fp(5,5,0)", div="fp(5,4,0)", sqrt="fp(5,7,0)",
                   exp="fp(5,3,0)", erf="fp(5,8,0)", sum="fp(6,5,0)")
BACK = Arithmetic(add="fp(6,4,0)", mul="fp(6,6,0)", div="fp(6,3,0)", sqrt="fp(6,7,0)",
                  exp="fp(6,5,0)", erf="fp(6,4,0)", sum="fp(5,5,0)")


class R:
    """The reference's rounding of each kind (None: the float64 result)."""

    def __init__(self, a: Arithmetic):
        self.a = a

    def __call__(self, kind, v):
        fmt = getattr(self.a, kind)
        if fmt is None:
            return v
        f = to_format(fmt, kind)
        return round_exact(v, Spec(f.e, f.m, f.b, f.specials, f.subnormals), "nearest", f.overflow)[0]

    def sum(self, vs):
        if self.a.sum is None:
            return math.fsum(vs)
        s = self("sum", vs[0])
        for v in vs[1:]:
            s = self("sum", s + v)
        return s


def rows(t):
    return t.double().reshape(-1, t.shape[-1]).tolist()


def ref_softmax(x, dy, fwd, bwd):
    f, b = R(fwd), R(bwd)
    ys, dxs = [], []
    for xr, gr in zip(rows(x), rows(dy)):
        m = max(xr)
        e = [f("exp", math.exp(f("add", v - m))) for v in xr]
        s = f.sum(e)
        y = [f("div", v / s) for v in e]
        t = b.sum([b("mul", g * v) for g, v in zip(gr, y)])
        ys.append(y)
        dxs.append([b("mul", v * b("add", g - t)) for g, v in zip(gr, y)])
    return ys, dxs


def ref_norm(x, dy, w, bias, eps, centered, fwd, bwd):
    """(y, dx, dw, db) by the documented sequence; without a weight there are no products by it
    (y = xn, gn = dy)."""
    f, b = R(fwd), R(bwd)
    n = x.shape[-1]
    ys, dxs, dws, dbs = [], [], [], []
    for xr, gr in zip(rows(x), rows(dy)):
        if centered:
            mu = f("div", f.sum(xr) / n)
            c = [f("add", v - mu) for v in xr]
        else:
            c = xr
        var = f("div", f.sum([f("mul", v * v) for v in c]) / n)
        r = f("div", 1.0 / f("sqrt", math.sqrt(f("add", var + eps))))
        xn = [f("mul", v * r) for v in c]
        y = xn if w is None else [f("mul", v * wi) for v, wi in zip(xn, w)]
        if bias is not None:
            y = [f("add", v + bi) for v, bi in zip(y, bias)]
        ys.append(y)
        gn = gr if w is None else [b("mul", g * wi) for g, wi in zip(gr, w)]
        bb = b.sum([b("mul", g * v) for g, v in zip(gn, xn)])
        if centered:
            a = b.sum(gn)
            dxs.append([b("mul", b("div", r / n) * b("add", b("add", b("mul", n * g) - a) - b("mul", v * bb)))
                        for g, v in zip(gn, xn)])
        else:
            dxs.append([b("mul", r * b("add", g - b("mul", v * b("div", bb / n)))) for g, v in zip(gn, xn)])
        dws.append([b("mul", g * v) for g, v in zip(gr, xn)])
        dbs.append(gr)
    col_sum = lambda m: [b.sum([row[j] for row in m]) for j in range(n)]  # noqa: E731
    return ys, dxs, col_sum(dws), col_sum(dbs)


def ref_gelu(x, dy, fwd, bwd):
    f, b = R(fwd), R(bwd)
    ys, dxs = [], []
    for v, g in zip(x.double().flatten().tolist(), dy.double().flatten().tolist()):
        p = f("add", 1.0 + f("erf", math.erf(f("mul", v * math.sqrt(0.5)))))
        ys.append(f("mul", f("mul", 0.5 * v) * p))
        pb = b("add", 1.0 + b("erf", math.erf(b("mul", v * math.sqrt(0.5)))))
        q = b("mul", b("exp", math.exp(b("mul", -0.5 * b("mul", v * v)))) * (1.0 / math.sqrt(2 * math.pi)))
        dxs.append(b("mul", g * b("add", b("mul", 0.5 * pb) + b("mul", v * q))))
    return ys, dxs


def ref_silu(x, dy, fwd, bwd):
    f, b = R(fwd), R(bwd)
    ys, dxs = [], []
    for v, g in zip(x.double().flatten().tolist(), dy.double().flatten().tolist()):
        s = f("div", 1.0 / f("add", 1.0 + f("exp", math.exp(-v))))
        ys.append(f("mul", v * s))
        dxs.append(b("mul", g * b("mul", s * b("add", 1.0 + b("mul", v * b("add", 1.0 - s))))))
    return ys, dxs


def data(*shape, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).double()


def run(fn, x, dy, *params):
    x = x.clone().requires_grad_()
    params = [p.clone().requires_grad_() if p is not None else None for p in params]
    y = fn(x, *params)
    y.backward(dy)
    return y.detach(), x.grad, [p.grad for p in params if p is not None]


def equal(t, want):
    return torch.equal(t.double().flatten(), torch.tensor(want, dtype=torch.float64).flatten())


@pytest.mark.parametrize("fwd,bwd", [(KINDS, BACK), (KINDS, None), (None, BACK)])
def test_softmax_step_by_step(fwd, bwd):
    x, dy = data(6, 12), data(6, 12, seed=1)
    y, dx, _ = run(lambda v: lowfp.nonlinear.softmax(v, -1, forward=fwd, backward=bwd), x, dy)
    want_y, want_dx = ref_softmax(x, dy, fwd or Arithmetic(), bwd or Arithmetic())
    close = lambda t, want, tol: torch.allclose(  # noqa: E731
        t.flatten(), torch.tensor(want, dtype=torch.float64).flatten(), rtol=tol, atol=1e-15)
    # float64 steps agree to float64's rounding (libm's exp against torch's, fsum against sum)
    assert equal(y, want_y) if fwd is not None else close(y, want_y, 1e-12)
    assert equal(dx, want_dx) if bwd is not None else close(dx, want_dx, 1e-9)
    # along another dim: the same as moving it last
    y0 = lowfp.nonlinear.softmax(x.t().contiguous(), 0, forward=fwd)
    assert torch.equal(y0.t(), lowfp.nonlinear.softmax(x, 1, forward=fwd))


@pytest.mark.parametrize("centered", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_norms_step_by_step(centered, affine):
    x, dy = data(5, 16, scale=3.0) + 1.0, data(5, 16, seed=1)
    w = data(16, seed=2, scale=0.5) + 1.0 if affine else None
    bias = data(16, seed=3, scale=0.5) if affine and centered else None
    if centered:
        fn = lambda v, *p: lowfp.nonlinear.layer_norm(v, 16, *p, eps=1e-5, forward=KINDS, backward=BACK)  # noqa: E731
        params = (w, bias)
    else:
        fn = lambda v, *p: lowfp.nonlinear.rms_norm(v, (16,), *p, eps=1e-5, forward=KINDS, backward=BACK)  # noqa: E731
        params = (w,)
    y, dx, grads = run(fn, x, dy, *params)
    want = ref_norm(x, dy, None if w is None else w.tolist(), None if bias is None else bias.tolist(),
                    1e-5, centered, KINDS, BACK)
    assert equal(y, want[0]) and equal(dx, want[1])
    if affine:
        assert equal(grads[0], want[2])
        if bias is not None:
            assert equal(grads[1], want[3])


@pytest.mark.parametrize("op,ref", [("gelu", ref_gelu), ("silu", ref_silu)])
def test_activations_step_by_step(op, ref):
    x, dy = data(200, scale=3.0), data(200, seed=1)
    fn = getattr(lowfp.nonlinear, op)
    y, dx, _ = run(lambda v: fn(v, forward=KINDS, backward=BACK), x, dy)
    want_y, want_dx = ref(x, dy, KINDS, BACK)
    assert equal(y, want_y) and equal(dx, want_dx)


def test_without_formats_they_are_torchs_operators():
    x = data(4, 3, 10, seed=4).requires_grad_()
    w, b = data(10, seed=5).requires_grad_(), data(10, seed=6).requires_grad_()
    cases = [(lambda v: lowfp.nonlinear.softmax(v, 1), lambda v: F.softmax(v, 1)),
             (lambda v: lowfp.nonlinear.layer_norm(v, (10,), w, b), lambda v: F.layer_norm(v, (10,), w, b)),
             (lambda v: lowfp.nonlinear.layer_norm(v, (3, 10)), lambda v: F.layer_norm(v, (3, 10))),
             (lambda v: lowfp.nonlinear.rms_norm(v, (10,), w), lambda v: F.rms_norm(v, (10,), w)),
             (lowfp.nonlinear.gelu, F.gelu), (lowfp.nonlinear.silu, F.silu)]
    dy = data(4, 3, 10, seed=7)
    for ours, theirs in cases:
        got = torch.autograd.grad(ours(x), (x, w, b), dy, allow_unused=True)
        want = torch.autograd.grad(theirs(x), (x, w, b), dy, allow_unused=True)
        assert torch.allclose(ours(x), theirs(x), rtol=1e-12, atol=1e-14)
        for g, h in zip(got, want):
            assert (g is None) == (h is None)
            if g is not None:
                assert torch.allclose(g, h, rtol=1e-10, atol=1e-12)
    # float32 and bfloat16 inputs: the float64 result cast to their dtype (torch's float32 GELU
    # loses the tail to cancellation in 1 + erf: -4.65e-7 at x = -5.2 where x·Φ(x) = -5.07e-7)
    x32 = x.detach().float()
    assert torch.allclose(lowfp.nonlinear.gelu(x32), F.gelu(x32.double()).float(), rtol=1e-6, atol=0)
    assert lowfp.nonlinear.silu(x32.bfloat16()).dtype == torch.bfloat16


def test_a_models_functional_calls_inside_emulate():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                                torch.nn.Linear(16, 16), torch.nn.RMSNorm(16), torch.nn.SiLU(),
                                torch.nn.Softmax(-1))
    x = torch.randn(4, 8)
    with lowfp.nonlinear.emulate(forward="bfloat16", backward="bfloat16"):
        y = model(x)
        (y * torch.arange(16.0)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # the same as calling lowfp.nonlinear's functions by hand, in forward and backward
    h = model[0](x)
    h = lowfp.nonlinear.layer_norm(h, (16,), model[1].weight, model[1].bias, forward="bfloat16", backward="bfloat16")
    h = lowfp.nonlinear.gelu(h, forward="bfloat16", backward="bfloat16")
    h = model[3](h)
    h = lowfp.nonlinear.rms_norm(h, (16,), model[4].weight, model[4].eps, forward="bfloat16", backward="bfloat16")
    h = lowfp.nonlinear.silu(h, forward="bfloat16", backward="bfloat16")
    want = lowfp.nonlinear.softmax(h, -1, forward="bfloat16", backward="bfloat16")
    assert torch.equal(y, want)
    (want * torch.arange(16.0)).sum().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert not torch.equal(y, model(x))  # and not torch's own
    # only the ops named; the others stay torch's
    with lowfp.nonlinear.emulate(forward="bfloat16", ops=("gelu",)):
        assert torch.equal(torch.nn.functional.silu(x), F.silu(x))
        assert torch.equal(F.gelu(x), lowfp.nonlinear.gelu(x, forward="bfloat16"))
        assert torch.equal(F.gelu(x, approximate="tanh"), torch.nn.functional.gelu(x, approximate="tanh"))
    # formats per operator: softmax its own, layer norm left to torch
    with lowfp.nonlinear.emulate(forward="bfloat16", softmax=("fp(5,2,0)", None), layer_norm=None):
        assert torch.equal(F.softmax(x, -1), lowfp.nonlinear.softmax(x, -1, forward="fp(5,2,0)"))
        assert torch.equal(F.layer_norm(x, (8,)), torch.layer_norm(x, (8,)))
        assert torch.equal(F.silu(x), lowfp.nonlinear.silu(x, forward="bfloat16"))


def test_bad_arguments():
    x = torch.randn(3, 4)
    with pytest.raises(TypeError, match="input must be"):
        lowfp.nonlinear.softmax(torch.arange(4), 0)
    with pytest.raises(ValueError, match="dim must be"):
        lowfp.nonlinear.softmax(x, 2)
    with pytest.raises(ValueError, match="normalized_shape"):
        lowfp.nonlinear.layer_norm(x, (3,))
    with pytest.raises(ValueError, match="weight must have shape"):
        lowfp.nonlinear.rms_norm(x, (4,), torch.ones(3))
    with pytest.raises(ValueError, match="eps"):
        lowfp.nonlinear.layer_norm(x, 4, eps=-1.0)
    with pytest.raises(TypeError, match="forward must be"):
        lowfp.nonlinear.gelu(x, forward=3)
    with pytest.raises(ValueError, match="cannot parse|format"):
        Arithmetic(exp="fp(9,99)")
    with pytest.raises(ValueError, match="ops must be among"):
        lowfp.nonlinear.emulate(ops=("tanh",))
    with pytest.raises(ValueError, match="ops must be among"):
        lowfp.nonlinear.emulate(tanh="bfloat16")
    with pytest.raises(TypeError, match="softmax"):
        lowfp.nonlinear.emulate(softmax=(3, None))
    before = x.clone()
    lowfp.nonlinear.silu(x, forward="fp(4,3,0)")
    assert torch.equal(x, before)


def test_compiled_code_runs_them_as_eager_does():
    # no torch form yet: torch.compile breaks its graph around them, with the same results
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.GELU())
    x = torch.randn(4, 16)
    compiled = torch.compile(model)
    with lowfp.nonlinear.emulate(forward="bfloat16", backward="bfloat16"):
        assert torch.equal(compiled(x), model(x))


def test_empty_non_contiguous_meta_and_fake_inputs():
    from torch._subclasses.fake_tensor import FakeTensorMode
    for x in (torch.empty(0, 6), torch.empty(3, 0)):
        assert lowfp.nonlinear.softmax(x, -1, forward="bfloat16").shape == x.shape
        assert lowfp.nonlinear.layer_norm(x, x.shape[-1], forward="bfloat16").shape == x.shape
        assert lowfp.nonlinear.rms_norm(x, (x.shape[-1],), forward="bfloat16").shape == x.shape
        assert lowfp.nonlinear.gelu(x, forward="bfloat16").shape == x.shape
    x = data(6, 4, seed=8).float()
    assert torch.equal(lowfp.nonlinear.softmax(x.t(), 0, forward="bfloat16"),
                       lowfp.nonlinear.softmax(x.t().contiguous(), 0, forward="bfloat16"))
    assert lowfp.nonlinear.silu(torch.randn(3, 4, device="meta"), forward="bfloat16").device.type == "meta"
    with FakeTensorMode():
        f = torch.randn(3, 4)
        assert lowfp.nonlinear.layer_norm(f, 4, forward="bfloat16").shape == (3, 4)
