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
        fmt = fmt.with_axis(axis)
    return lowfp.quantize(t, fmt, rounding)


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-e5m2grad", "fp8-tensorwise", "fp8-rowwise",
                                    "nvfp4-no-sr", "nvfp4-4over6-no-sr"])
def test_linear_operands_are_rounded_along_their_reduction_axes(recipe):
    if recipe.endswith("-no-sr"):  # deterministic: the NVFP4 formats without SR and the transform
        r = lowfp.scaled.RECIPES[recipe[:-len("-no-sr")]]
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


@pytest.mark.parametrize("gemms", [("fprop",), ("dgrad",), ("fprop", "dgrad", "wgrad")])
def test_the_hadamard_transform_on_the_gemms_named(gemms):
    # Each named GEMM's operands are transformed along its reduction axis, rounded and
    # transformed back (lowfp.scaled.quantize_scaled with hadamard_seed), the others not.
    r = GemmRecipe("mxfp4_e2m1", hadamard_seed=5, hadamard_gemms=gemms)
    assert r.hadamard_gemms == tuple(gemms) and r.hadamard("fprop") == (5 if "fprop" in gemms else None)

    def qh(t, axis, gemm):
        fmt = Scaled("float4_e2m1fn", block=32, axis=axis)
        return lowfp.scaled.quantize_scaled(t, fmt, hadamard_seed=5 if gemm in gemms else None)

    torch.manual_seed(1)
    layer = nn.Linear(64, 48, bias=False)
    x = torch.randn(32, 64, requires_grad=True)
    g = torch.randn(32, 48)
    with emulate_gemms(layer, r):
        y = layer(x)
    y.backward(g)
    w, xd = layer.weight.detach(), x.detach()
    assert torch.equal(y, F.linear(qh(xd, -1, "fprop"), qh(w, -1, "fprop")))
    assert torch.equal(x.grad, qh(g, -1, "dgrad") @ qh(w, 0, "dgrad"))
    assert torch.equal(layer.weight.grad, qh(g, 0, "wgrad").t() @ qh(xd, 0, "wgrad"))
    with pytest.raises(ValueError, match="hadamard_gemms"):
        GemmRecipe("mxfp4_e2m1", hadamard_seed=5, hadamard_gemms=("bprop",))


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


def q_grouped(t, fmt, dim, groups):
    """The reference rounding along a channel axis within each group."""
    tg = t.unflatten(dim, (groups, t.shape[dim] // groups))
    return q(tg, fmt, dim + 1).flatten(dim, dim + 1)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("groups,padding,stride,kernel", [(1, 1, 1, 3), (2, 0, 2, 3),
                                                          (1, "same", 1, 4)])
def test_conv_operands_are_rounded_along_channels_and_batch(groups, padding, stride, kernel):
    r = lowfp.scaled.RECIPES["mxfp8-e5m2grad"]
    torch.manual_seed(0)
    conv = nn.Conv2d(64, 64, kernel, stride, padding, groups=groups)
    x = torch.randn(32, 64, 9, 9, requires_grad=True)
    with emulate_gemms(conv, r):
        y = conv(x)
    g = torch.randn_like(y)
    y.backward(g)
    w, b, xd = conv.weight.detach(), conv.bias.detach(), x.detach()

    def ref(xx, ww):
        return F.conv2d(xx, ww, b, stride, padding, 1, groups)
    # forward: X along its input channels, W along its input channels (within a group)
    assert torch.equal(y, ref(q_grouped(xd, r.input, 1, groups), q(w, r.weight, 1)))
    # input gradient: dY and W along the output channels within a group
    x0 = xd.clone().requires_grad_()
    w_out = q_grouped(w, r.weight, 0, groups)
    want_dx, = torch.autograd.grad(ref(x0, w_out), x0, q_grouped(g, r.grad, 1, groups))
    assert torch.equal(x.grad, want_dx)
    # weight gradient: dY and X along the batch
    w0 = w.clone().requires_grad_()
    want_dw, = torch.autograd.grad(ref(q(xd, r.input, 0), w0), w0, q(g, r.grad, 0))
    assert torch.equal(conv.weight.grad, want_dw)
    assert torch.allclose(conv.bias.grad, g.sum((0, 2, 3)))
    # an unbatched input is one batch of one
    with emulate_gemms(conv, r):
        assert torch.equal(conv(xd[0]), ref(q_grouped(xd[:1], r.input, 1, groups), q(w, r.weight, 1))[0])


@pytest.mark.parametrize("groups,stride,output_padding,dim", [(1, 1, 0, 2), (2, 2, 1, 2), (4, 2, 1, 1),
                                                              (1, 2, 0, 3)])
def test_transposed_conv_operands_are_rounded_along_channels_and_batch(groups, stride,
                                                                        output_padding, dim):
    r = lowfp.scaled.RECIPES["mxfp8-e5m2grad"]
    torch.manual_seed(0)
    kind = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[dim]
    func = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[dim]
    conv = kind(64, 96, 3, stride, padding=1, output_padding=output_padding, groups=groups)
    x = torch.randn((8, 64) + (5,) * dim, requires_grad=True)
    with emulate_gemms(conv, r):
        y = conv(x)
    g = torch.randn_like(y)
    y.backward(g)
    w, b, xd = conv.weight.detach(), conv.bias.detach(), x.detach()  # w: (64, 96 / groups, ...)

    def ref(xx, ww):
        return func(xx, ww, b, stride, 1, output_padding, groups)
    # forward: X along its channels, W along its first axis (input channels), within a group
    assert torch.equal(y, ref(q_grouped(xd, r.input, 1, groups), q_grouped(w, r.weight, 0, groups)))
    # input gradient: dY along its channels within a group, W along its second axis
    x0 = xd.clone().requires_grad_()
    want_dx, = torch.autograd.grad(ref(x0, q(w, r.weight, 1)), x0, q_grouped(g, r.grad, 1, groups))
    assert torch.equal(x.grad, want_dx)
    # weight gradient: dY and X along the batch
    w0 = w.clone().requires_grad_()
    want_dw, = torch.autograd.grad(ref(q(xd, r.input, 0), w0), w0, q(g, r.grad, 0))
    assert torch.equal(conv.weight.grad, want_dw)
    assert torch.allclose(conv.bias.grad, g.sum([0] + list(range(2, g.dim()))))
    # an unbatched input is one batch of one (compared with the emulation's batch of one: torch
    # may sum a batch of one in another order than its reference's layout leads it to)
    with emulate_gemms(conv, r):
        assert torch.equal(conv(xd[0]), conv(xd[:1])[0])


def test_conv_weight_with_2d_blocks_rounds_each_kernel_position_as_a_matrix():
    fmt = Scaled("float4_e2m1fn", block=(16, 16), scale="float8_e4m3fn", tensor_scale=True)
    r = GemmRecipe(lowfp.scaled.mxfp8_e4m3, weight=fmt)
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 32, 3, padding=1, bias=False)
    x = torch.randn(4, 32, 6, 6)
    with emulate_gemms(conv, r):
        y = conv(x)
    w = conv.weight.detach()
    # the (kh, kw) stack of (out, in) matrices, one tensor scale for the whole weight
    wq = lowfp.quantize(w.permute(2, 3, 0, 1), fmt).permute(2, 3, 0, 1)
    assert torch.equal(y, F.conv2d(q(x, r.input, 1), wq, None, 1, 1))
    # fewer output channels than a block's rows: each position's matrix has a short last block
    conv = nn.Conv2d(32, 8, 2, bias=False)
    with torch.no_grad():
        conv.weight.mul_(torch.logspace(-2, 0, 32).view(1, 32, 1, 1))  # blocks of unlike amax
    with emulate_gemms(conv, r):
        y = conv(x)
    w = conv.weight.detach()
    # one tall matrix: each position's 8 rows then 8 zero rows, so 16-row blocks align with it
    tall = torch.cat([w.permute(2, 3, 0, 1).reshape(4, 8, 32), torch.zeros(4, 8, 32)], 1)
    wq = lowfp.quantize(tall.reshape(64, 32), fmt).reshape(4, 16, 32)[:, :8]
    assert torch.equal(y, F.conv2d(q(x, r.input, 1), wq.reshape(2, 2, 8, 32).permute(2, 3, 0, 1)))


def test_attention_products_are_emulated_as_matmuls():
    r = lowfp.scaled.RECIPES["mxfp8"]
    torch.manual_seed(0)
    qq, k, v = (torch.randn(2, 3, 32, 32, requires_grad=True) for _ in range(3))
    mask = torch.rand(32, 32) > 0.2
    mask.fill_diagonal_(True)

    class Attention(nn.Module):
        def forward(self, a, b, c):
            return (F.scaled_dot_product_attention(a, b, c, is_causal=True)
                    + F.scaled_dot_product_attention(a, b, c, attn_mask=mask, scale=0.3))
    with emulate_gemms(Attention(), r) as em:
        out = em.model(qq, k, v)
    g = torch.randn_like(out)
    out.backward(g)
    Q, K, V = (t.detach() for t in (qq, k, v))
    causal = torch.ones(32, 32, dtype=torch.bool).tril()
    want_dv = torch.zeros_like(V)
    want_dq = torch.zeros_like(Q)
    total = 0
    for keep, scale in ((causal, 32 ** -0.5), (mask, 0.3)):
        # as torch's math backend: √scale multiplies each (rounded) operand of Q Kᵀ
        root = scale ** 0.5
        s0 = ((q(Q, r.input, -1) * root) @ (q(K, r.input, -1) * root).transpose(-1, -2)).requires_grad_()
        p = s0.masked_fill(~keep, float("-inf")).softmax(-1)
        total = total + q(p.detach(), r.input, -1) @ q(V, r.input, -2)
        # dV = Pᵀ dO along the queries; dQ = dS K along the keys, dS through softmax's backward
        want_dv += q(p.detach(), r.input, -2).transpose(-1, -2) @ q(g, r.grad, -2)
        dp = q(g, r.grad, -1) @ q(V, r.input, -1).transpose(-1, -2)
        ds, = torch.autograd.grad(p, s0, dp)
        want_dq += (q(ds, r.grad, -1) @ (q(K, r.input, -2) * root)) * root
    assert torch.equal(out, total)
    assert torch.equal(v.grad, want_dv)
    assert torch.equal(qq.grad, want_dq)


def _blank_rows(n, seed):
    """A boolean (n, n) mask that keeps a random 70 % and blanks query rows 1 and 5."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(n, n, generator=g) > 0.3
    keep[1] = keep[5] = False
    return keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mask_form", ["bool", "additive", "causal", "causal_wide", "none"])
def test_attention_without_formats_is_torchs_math_backend_bit_for_bit(mask_form, dtype):
    # Fully masked query rows (padding) give 0 and pass no gradient, as torch's SDPA does; the
    # rest equals torch's math backend (forward and every gradient) bit for bit.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(1)
    n, d = 12, 16
    qq, k, v = (torch.randn(2, 3, n, d, dtype=dtype, requires_grad=True) for _ in range(3))
    keep = _blank_rows(n, 3)
    additive = torch.zeros(n, n, dtype=dtype).masked_fill(~keep, float("-inf"))
    additive[0, :4] = -1.5  # finite entries too
    kwargs = {"bool": dict(attn_mask=keep), "additive": dict(attn_mask=additive, scale=0.2),
              "causal": dict(is_causal=True), "causal_wide": dict(is_causal=True, scale=-0.7),
              "none": dict()}[mask_form]

    class Attention(nn.Module):
        def forward(self, a, b, c):
            return F.scaled_dot_product_attention(a, b, c, **kwargs)
    g = torch.randn(2, 3, n, d, dtype=dtype)
    results = []
    for recipe in (GemmRecipe(None), None):  # emulated without formats, then torch's own
        for t in (qq, k, v):
            t.grad = None
        if recipe is None:
            with sdpa_kernel(SDPBackend.MATH):
                out = Attention()(qq, k, v)
        else:
            with emulate_gemms(Attention(), recipe) as em:
                out = em.model(qq, k, v)
        out.backward(g)
        results.append([out.detach()] + [t.grad.clone() for t in (qq, k, v)])
    for got, want, name in zip(*results, ("out", "dq", "dk", "dv")):
        assert torch.equal(got, want), (name, (got - want).abs().max())
    assert all(r.isfinite().all() for r in results[0])
    if mask_form in ("bool", "additive"):
        assert (results[0][0][..., [1, 5], :] == 0).all() and (results[0][1][..., [1, 5], :] == 0).all()
        default = F.scaled_dot_product_attention(qq, k, v, **kwargs)  # torch's default backend agrees
        assert (default[..., [1, 5], :] == 0).all()


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_fully_masked_attention_rows_stay_finite_under_formats(recipe):
    torch.manual_seed(2)
    qq, k, v = (torch.randn(2, 4, 32, 32, requires_grad=True) for _ in range(3))
    keep = _blank_rows(32, 4)

    class Attention(nn.Module):
        def forward(self, a, b, c):
            return F.scaled_dot_product_attention(a, b, c, attn_mask=keep)
    with emulate_gemms(Attention(), recipe) as em:
        out = em.model(qq, k, v)
    out.backward(torch.randn_like(out))
    assert out.isfinite().all() and (out[..., [1, 5], :] == 0).all()
    assert all(t.grad.isfinite().all() for t in (qq, k, v)) and (qq.grad[..., [1, 5], :] == 0).all()


def test_recipe_ops_choose_the_gemms():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3), nn.Flatten(), nn.Linear(32 * 4 * 4, 10))
    x = torch.randn(2, 3, 6, 6)
    plain = model(x)
    linear_only = GemmRecipe("mxfp4_e2m1", ops=("linear",))
    with emulate_gemms(model[0], linear_only):
        assert torch.equal(model[0](x), model[0].forward(x))
        plain_conv = model[0](x)
    with emulate_gemms(model, GemmRecipe("mxfp4_e2m1", ops="conv")) as em:
        conv_only = em.model(x)
    assert not torch.equal(conv_only, plain)
    assert torch.equal(conv_only, model[2](model[1](
        F.conv2d(q(x, linear_only.input, 1), q(model[0].weight, linear_only.input, 1),
                 model[0].bias))))
    assert plain_conv.shape == (2, 32, 4, 4)
    with pytest.raises(ValueError, match="ops"):
        GemmRecipe("mxfp8_e4m3", ops=("linear", "einsum"))


@pytest.mark.parametrize("model_name", ["gpt", "resnet"])
def test_recipes_cover_convolutions_and_attention_in_models(model_name):
    from lowfp.experiments import models
    torch.manual_seed(0)
    if model_name == "gpt":
        model = models.GPT(16, block_size=16, dim=32, depth=1, heads=2)
        x = torch.randint(0, 16, (4, 16))
        op = "attention"
    else:
        model = models.ResNet18(num_classes=10)
        x = torch.randn(2, 3, 16, 16)
        op = "conv"
    model.eval()  # batch norm as a fixed map: runs compare

    def run(ops):
        model.zero_grad()
        with emulate_gemms(model, GemmRecipe("mxfp8_e4m3", ops=ops)):
            out = model(x)
        out.float().square().mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]
    out_all, grads = run(lowfp.scaled.gemm.GEMM_OPS)
    out_without, _ = run(tuple(o for o in lowfp.scaled.gemm.GEMM_OPS if o != op))
    assert not torch.equal(out_all, out_without)  # the model's convs / attention were emulated
    assert all(torch.isfinite(g).all() for g in grads)


def _mlp_task():
    """A two-layer MLP, a batch and its uniform assignment."""
    from lowfp import assign as A
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    return model, x, y, A.uniform(A.trace(model, x, F.cross_entropy, y))


def _emulated_step(model, a, x, y, by_hand=None, **kw):
    """(output, the linear layers' weight gradients, the emulation's counts) of one step under
    lowfp.emulate(model, a, **kw); by_hand=(module, recipe): emulate_gemms(module, recipe)
    installed inside the emulation instead."""
    model.zero_grad()
    with lowfp.emulate(model, a, **kw) as em:
        if by_hand is not None:
            emulate_gemms(*by_hand).install()
        out = model(x)
        F.cross_entropy(out, y).backward()
        counts = em.counts.clone()
    if by_hand is not None:
        by_hand[0].__dict__.pop("forward", None)
    return out.detach(), [m.weight.grad.clone() for m in model if isinstance(m, nn.Linear)], counts


def test_emulate_takes_a_gemm_recipe():
    model, x, y, a = _mlp_task()
    modes = []
    hook = model[0].register_forward_pre_hook(
        lambda *_: modes.append(torch._C._len_torch_function_stack()))
    out, grads, counts = _emulated_step(model, a, x, y, gemm_recipe="mxfp4")
    assert modes == [1]  # one interception: the GEMMs are a handler of the assignment's mode
    hook.remove()
    assert "forward" not in model.__dict__
    # the same by hand: GEMM operands inside the assignment's interception
    out2, grads2, counts2 = _emulated_step(model, a, x, y, by_hand=(model, "mxfp4"))
    assert torch.equal(out, out2) and torch.equal(grads[0], grads2[0]) and torch.equal(counts, counts2)
    with lowfp.emulate(model, a):
        plain = model(x).detach()
    assert not torch.equal(out, plain)
    with pytest.raises(ValueError, match="recipe"):
        lowfp.emulate(model, a, gemm_recipe="mxfp5")


def test_emulate_takes_recipes_per_module():
    # gemm_recipe={pattern: recipe}: as emulate_gemms of the matched layer inside the emulation
    model, x, y, a = _mlp_task()
    got = _emulated_step(model, a, x, y, gemm_recipe={"0": "mxfp4", "2": None})
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with pytest.warns(UserWarning, match="was not in the recorded step"):  # (the operands by hand)
        want = _emulated_step(model, a, x, y, by_hand=(model[0], "mxfp4"))
    assert torch.equal(got[0], want[0]) and all(torch.equal(g, w) for g, w in zip(got[1], want[1]))
    # one interception sees every tensor (the layer emulated by hand hides its GEMM's operands
    # from the assignment's): the rounded elements are plain emulation's
    plain = _emulated_step(model, a, x, y, gemm_recipe={"*": None})
    assert torch.equal(got[2][:, 3], plain[2][:, 3])
    with pytest.raises(ValueError, match="match no module"):
        lowfp.emulate(model, a, gemm_recipe={"head": "mxfp4"})


def test_multihead_attention_is_entered():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 2, batch_first=True)
    x = torch.randn(2, 16, 32)
    pad = torch.zeros(2, 16, dtype=torch.bool)
    pad[1, 12:] = True
    causal = torch.ones(16, 16, dtype=torch.bool).triu(1)
    # without formats it is torch's own computation: bit for bit where torch multiplies by bmm
    # and baddbmm (need_weights), to float rounding where torch calls its fused attention kernel
    for kw in (dict(), dict(need_weights=False), dict(key_padding_mask=pad, attn_mask=causal),
               dict(key_padding_mask=pad, need_weights=False)):
        want = mha(x, x, x, **kw)
        with emulate_gemms(mha, GemmRecipe(None)):
            got = mha(x, x, x, **kw)
        if kw.get("need_weights", True):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        else:
            assert torch.allclose(got[0], want[0], rtol=0, atol=1e-6) and got[1] is None
    # with MXFP8: the packed in-projection, both products and the out-projection are rounded
    r = lowfp.scaled.RECIPES["mxfp8"]
    with emulate_gemms(mha, r):
        out, _ = mha(x, x, x, need_weights=False)
    w_in, b_in = mha.in_proj_weight.detach(), mha.in_proj_bias.detach()
    qkv = F.linear(q(x, r.input, -1), q(w_in, r.weight, -1), b_in)
    Q, K, V = (t.unflatten(-1, (2, 16)).transpose(1, 2) for t in qkv.chunk(3, -1))
    p = ((q(Q, r.input, -1) @ q(K, r.input, -1).transpose(-1, -2)) * 16 ** -0.5).softmax(-1)
    o = (q(p, r.input, -1) @ q(V, r.input, -2)).transpose(1, 2).reshape(2, 16, 32)
    want = F.linear(q(o, r.input, -1), q(mha.out_proj.weight.detach(), r.weight, -1),
                    mha.out_proj.bias.detach())
    assert torch.equal(out.detach(), want)


def test_every_emulated_gemm_is_a_gemm_of_the_interception():
    """lowfp.emulate(..., gemm_recipe=) hands the handler the calls whose names the interception
    counts as GEMMs: every function the handler emulates must be one of them."""
    from lowfp._intercept import GEMM_NAMES, OP, classify
    from lowfp.scaled import gemm
    funcs = ([F.linear, F.scaled_dot_product_attention, F.multi_head_attention_forward]
             + list(gemm._CONVS) + list(gemm._CONV_TRANSPOSES) + list(gemm._BADDBMMS)
             + list(gemm._MATMULS))
    for func in funcs:
        kind, name = classify(func)
        assert kind == OP and name in GEMM_NAMES, func


# -- recipes per module --------------------------------------------------------------------------

def _two_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.GELU(), nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8)))


def _run(model, em, x):
    with em:
        y = model(x)
    y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
    return [y.detach()] + [p.grad for p in model.parameters()]


def test_recipes_per_module_equal_each_module_emulated_alone():
    # {pattern: recipe}: each module's first matching pattern; modules no pattern matches take
    # their parent's; None leaves a module as it is
    x = torch.randn(16, 64)
    model = _two_layers()
    em = emulate_gemms(model, {"2.1": None, "0": "mxfp8", "2*": "fp8-rowwise"})
    got = _run(model, em, x)
    ref = _two_layers()
    a, b = emulate_gemms(ref[0], "mxfp8"), emulate_gemms(ref[2][0], "fp8-rowwise")
    a.install(), b.install()
    want = _run(ref, emulate_gemms(nn.Identity(), "mxfp8"), x)
    a.close(), b.close()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert not torch.equal(got[0], _run(_two_layers(), emulate_gemms(nn.Identity(), "mxfp8"), x)[0])
    rows = [line.split() for line in em.table().splitlines()]
    assert rows[0] == ["module", "GEMMs", "run", "pattern", "recipe"]
    assert ["0", "linear", "0", "mxfp8"] in rows and ["2.0", "linear", "2*", "fp8-rowwise"] in rows
    assert ["2.1", "linear", "2.1", "none"] in rows
    # closed: no hook left, and the model is torch's again
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    model.zero_grad()
    assert torch.equal(model(x), _two_layers()(x))


def test_a_module_without_a_pattern_takes_its_parents_recipe_or_none():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(8, 8)

        def forward(self, x):
            return self.inner(x) @ x.t()  # a matmul in Outer's own forward

    model = nn.Sequential(Outer(), nn.Linear(8, 8))
    x = torch.randn(8, 8)
    em = emulate_gemms(model, {"0": "mxfp8"})
    with em:
        y = model(x)
    ref = Outer()
    ref.load_state_dict(model[0].state_dict())
    with emulate_gemms(ref, "mxfp8"):
        want = model[1](ref(x))
    assert torch.equal(y, want)
    rows = [line.split() for line in em.table().splitlines()]
    # (the GEMMs that ran are listed under the matched module whose recipe they took)
    assert ["0", "linear,matmul", "0", "mxfp8"] in rows and ["0.inner", "-", "0", "(of", "0)", "mxfp8"] in rows
    assert ["1", "-", "-", "none"] in rows and ["(no", "module", "matched)", "linear", "-", "none"] in rows


def test_the_stack_survives_an_exception_in_a_module():
    model = _two_layers()
    em = emulate_gemms(model, {"0": "mxfp8"})
    with em:
        with pytest.raises(RuntimeError):
            model(torch.randn(2, 63))
        assert em.per_module.current() is None
        model(torch.randn(2, 64))


def test_recipe_patterns_are_checked():
    model = _two_layers()
    with pytest.raises(ValueError, match=r"recipe pattern\(s\) \['head'\] match no module"):
        emulate_gemms(model, {"0": "mxfp8", "head": None})
    with pytest.raises(ValueError, match=r"\['2\.0'\] match no module .*or only modules an earlier pattern took"):
        emulate_gemms(model, {"2*": "mxfp8", "2.0": None})
    with pytest.raises(TypeError, match="recipe patterns must be strings"):
        emulate_gemms(model, {0: "mxfp8"})
    with pytest.raises(ValueError, match="recipe must be a GemmRecipe or one of"):
        emulate_gemms(model, {"0": "mxfp9"})


def test_high_precision_ends():
    from lowfp.experiments import models
    from lowfp.scaled import high_precision_ends
    model = models.GPT(32, 16, 32, 2, 2)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 9 and linears[-1] == "head"
    assert high_precision_ends(model) == {}
    assert list(high_precision_ends(model, first=1, last=2)) == [linears[0], linears[-2], linears[-1]]
    assert list(high_precision_ends(model, fraction=0.15)) == linears[-1:]  # round(1.35)
    assert list(high_precision_ends(model, last=1, fraction=0.3)) == linears[-3:]
    assert list(high_precision_ends(model, first=9)) == linears
    for bad in (dict(first=-1), dict(last=1.5), dict(fraction=2.0), dict(first=True), dict(fraction=True)):
        with pytest.raises(ValueError):
            high_precision_ends(model, **bad)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        high_precision_ends(3)
