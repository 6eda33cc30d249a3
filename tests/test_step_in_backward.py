"""Stepping each parameter inside the backward pass (lowfp.optim.step_in_backward): the same
weights as stepping after backward, loss scaling, clipping, skips, refusals."""

import copy
import pytest
import torch
import lowfp
from lowfp.optim import ExtraBitsAdam, ExtraBitsAdamW, ExtraBitsSGD
from extra_bits_reference import small_model
from devices import on_cuda


def twin_models(opt_cls, **kw):
    a = small_model()
    b = copy.deepcopy(a)
    torch.manual_seed(0)  # the same stochastic split of the float32 parameters
    opt_a = opt_cls(a.parameters(), **kw)
    torch.manual_seed(0)
    return a, b, opt_a, opt_cls(b.parameters(), **kw)


def loss_of(model, x, y, scale=1.0):
    return torch.nn.functional.cross_entropy(model(x.bfloat16()).float(), y) * scale


def steps_match_inside_backward(a, b, opt_a, opt_b, x, y, steps):
    """Steps model a normally and b (whose optimizer steps inside backward) on the same batches;
    asserts their master weights stay equal and b's gradients are freed as they are used."""
    for step in range(steps):
        torch.manual_seed(step)
        opt_a.zero_grad()
        loss_of(a, x, y).backward()
        opt_a.step()
        torch.manual_seed(step)
        loss_of(b, x, y).backward()
        assert all(p.grad is None for p in b.parameters())  # freed as they were used
        for wa, wb in zip(opt_a.master_weights(), opt_b.master_weights()):
            assert torch.equal(wa, wb), step


@pytest.mark.parametrize("opt_cls,kw", [(ExtraBitsAdamW, dict(lr=1e-2, extra_bits=8, rounding="stochastic")),
                                        (ExtraBitsSGD, dict(lr=0.1, momentum=0.9, extra_bits=16, rounding="nearest"))])
def test_step_in_backward_equals_a_normal_step(opt_cls, kw):
    a, b, opt_a, opt_b = twin_models(opt_cls, **kw)
    handle = lowfp.optim.step_in_backward(opt_b)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    steps_match_inside_backward(a, b, opt_a, opt_b, x, y, steps=5)
    handle.remove()
    loss_of(b, x, y).backward()
    assert all(p.grad is not None for p in b.parameters())  # hooks gone: ordinary gradients


@pytest.mark.filterwarnings("ignore:Using backward.. with create_graph=True:UserWarning")
def test_step_in_backward_under_create_graph_steps_as_a_normal_step():
    # backward(create_graph=True) runs the hooks with grad mode on; their unscale and clip must
    # not record autograd history, and the step must equal a normal one.
    a, b, opt_a, opt_b = twin_models(ExtraBitsSGD, lr=0.1, momentum=0.9, extra_bits=16)
    handle = lowfp.optim.step_in_backward(opt_b, scaler=DuckScaler(8.0), clip_value=0.5)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    for step in range(2):
        opt_a.zero_grad()
        loss_of(a, x, y, scale=8.0).backward()
        for p in a.parameters():
            p.grad = (p.grad * (1 / 8.0)).clamp(-0.5, 0.5)
        opt_a.step()
        seen = []
        hook = b[0].weight.register_post_accumulate_grad_hook(
            lambda p: seen.append(torch.is_grad_enabled()))
        loss_of(b, x, y, scale=8.0).backward(create_graph=True)
        hook.remove()
        assert seen == [True]  # so the hooks did run with grad mode on
        assert all(p.grad is None for p in b.parameters())
        for wa, wb in zip(opt_a.master_weights(), opt_b.master_weights()):
            assert torch.equal(wa, wb), step
    assert handle.skipped == 0
    handle.remove()


class DuckScaler:
    """Only get_scale(): what step_in_backward needs of a scaler."""

    def __init__(self, scale):
        self.scale_value = scale

    def get_scale(self):
        return self.scale_value

    def scale(self, loss):
        return loss * self.scale_value


@pytest.mark.parametrize("scaler_kind", ["duck", "torch"])
def test_step_in_backward_unscales_clips_and_skips(scaler_kind):
    a, b, opt_a, opt_b = twin_models(ExtraBitsSGD, lr=0.1, extra_bits=16)
    # torch's GradScaler keeps its scale in a tensor, read without waiting for the device.
    scaler = DuckScaler(1024.0) if scaler_kind == "duck" else torch.amp.GradScaler("cpu", init_scale=1024.0)
    handle = lowfp.optim.step_in_backward(opt_b, scaler=scaler, clip_value=0.01)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    loss_of(a, x, y).backward()
    for p in a.parameters():
        p.grad = p.grad.float().clamp(-0.01, 0.01).to(p.dtype)
    opt_a.step()
    scaler.scale(loss_of(b, x, y)).backward()
    assert all(torch.equal(wa, wb) for wa, wb in zip(opt_a.master_weights(), opt_b.master_weights()))
    assert handle.skipped == 0 and not handle.found_inf
    before = opt_b.master_weights()
    inf_hook = b[4].bias.register_hook(lambda g: torch.full_like(g, float("inf")))
    scaler.scale(loss_of(b, x, y)).backward()
    after = opt_b.master_weights()
    assert handle.skipped == 1 and handle.found_inf
    assert torch.equal(before[-1], after[-1]) and not torch.equal(before[0], after[0])
    inf_hook.remove()
    scaler.scale(loss_of(b, x, y)).backward()
    assert handle.skipped == 1 and not handle.found_inf  # found_inf is the last pass's
    assert not torch.equal(after[-1], opt_b.master_weights()[-1])


def test_step_in_backward_unscales_in_the_gradient_dtype():
    # A scale below 1 can make an unscaled float16 gradient overflow float16. Unscaled in the
    # gradient's dtype (as GradScaler.unscale_ does), it is found and that parameter skipped,
    # not stepped with an infinite gradient; the other parameter steps as without a scaler.
    p, q = (torch.nn.Parameter(torch.ones(3, dtype=torch.float16)) for _ in range(2))
    opt = ExtraBitsSGD([p, q], lr=0.1, extra_bits=13)
    handle = lowfp.optim.step_in_backward(opt, scaler=DuckScaler(1 / 16))
    big, small = torch.tensor([80000.0, 1.0, 1.0]), torch.tensor([1.0, 2.0, 3.0])
    # Scaled gradients 5000 and small / 16, exact in float16; 5000 * 16 overflows it.
    ((p.float() * big).sum() + (q.float() * small).sum()).mul(1 / 16).backward()
    assert handle.skipped == 1 and handle.found_inf
    r = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    reference = ExtraBitsSGD([r], lr=0.1, extra_bits=13)
    r.grad = small.half()
    reference.step()
    masters = opt.master_weights()
    assert torch.equal(masters[0], torch.ones(3)) and torch.equal(masters[1], reference.master_weights()[0])


@pytest.mark.parametrize("make_scaler", [lambda: torch.amp.GradScaler("cpu", enabled=False),
                                         lambda: lowfp.DynamicLossScaler(enabled=False)])
def test_step_in_backward_with_a_disabled_scaler_steps_as_without(make_scaler):
    # A disabled torch GradScaler has no scale tensor at all: its get_scale() (1.0) is used.
    a, b, opt_a, opt_b = twin_models(ExtraBitsAdamW, lr=1e-2, extra_bits=8)
    handle = lowfp.optim.step_in_backward(opt_b, scaler=make_scaler())
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    steps_match_inside_backward(a, b, opt_a, opt_b, x, y, steps=3)
    assert handle.skipped == 0


@pytest.mark.parametrize("opt_cls, kw", [
    (ExtraBitsSGD, dict(lr=0.1, momentum=0.9, dampening=0.5)),
    (ExtraBitsAdam, dict(lr=1e-2, amsgrad=True)),
    (ExtraBitsAdamW, dict(lr=1e-2)),
])
def test_step_in_backward_skip_leaves_no_state_behind(opt_cls, kw):
    """The device skips a step whose gradient is not finite; the state the host keeps (SGD's
    first momentum step, Adam's step count) is taken back at the end of the pass, so the
    parameter then steps as one that had no gradient in that pass (torch.optim's behaviour)."""
    a, b, opt_a, opt_b = twin_models(opt_cls, extra_bits=16, **kw)
    handle = lowfp.optim.step_in_backward(opt_b)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    for step in range(4):
        opt_a.zero_grad()
        loss_of(a, x, y).backward()
        inf_hook = None
        if step in (0, 2):  # the first step, then a later one
            a[4].bias.grad = None
            inf_hook = b[4].bias.register_hook(lambda g: torch.full_like(g, float("nan")))
        opt_a.step()
        loss_of(b, x, y).backward()
        if inf_hook is not None:
            inf_hook.remove()
        assert handle.found_inf == (step in (0, 2)) and handle.skipped == (1 if step < 2 else 2)
        for wa, wb in zip(opt_a.master_weights(), opt_b.master_weights()):
            assert torch.equal(wa, wb), step
        for pa, pb in zip(a.parameters(), b.parameters()):
            sa, sb = opt_a.state[pa], opt_b.state[pb]
            if "step" in sb:  # a parameter that has not stepped yet has no state in torch
                assert float(sb["step"]) == float(sa.get("step", 0.0)), step
            assert ("momentum_buffer" in sa) == ("momentum_buffer" in sb), step
    handle.remove()


def test_step_in_backward_settles_a_pass_that_raised():
    """Adam's step counts of a pass inside backward are applied when the pass ends. A pass that
    raises never ends: its counts are applied by the next state_dict(), load_state_dict() or
    pass; a load must not receive the counts of steps taken before it; and the next pass starts
    afresh (its own found_inf, its own end)."""
    model = small_model()
    opt = ExtraBitsAdamW(model.parameters(), lr=1e-2, extra_bits=8)
    handle = lowfp.optim.step_in_backward(opt)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    loss_of(model, x, y).backward()
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == [1.0] * 6
    saved = copy.deepcopy(opt.state_dict())

    def boom(g):
        raise RuntimeError("boom")

    def raising_pass(nan_in_last_bias):
        hooks = [model[0].weight.register_hook(boom)]  # after the later layers have stepped
        if nan_in_last_bias:
            hooks.append(model[4].bias.register_hook(lambda g: torch.full_like(g, float("nan"))))
        with pytest.raises(RuntimeError, match="boom"):
            loss_of(model, x, y).backward()
        for h in hooks:
            h.remove()

    raising_pass(nan_in_last_bias=True)
    assert handle.skipped == 1 and handle.found_inf
    steps = [float(v["step"]) for v in opt.state_dict()["state"].values()]
    # model[0].weight did not step, model[4].bias was skipped, the other layers stepped.
    assert steps[0] == 1.0 and steps[2:] == [2.0, 2.0, 2.0, 1.0]

    raising_pass(nan_in_last_bias=False)
    opt.load_state_dict(saved)  # the raised pass's steps are settled first, not onto the load
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == [1.0] * 6
    loss_of(model, x, y).backward()
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == [2.0] * 6
    assert handle.skipped == 1 and not handle.found_inf  # this pass's, not the raised one's
    handle.remove()


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_step_in_backward_through_checkpointed_layers_is_one_pass(use_reentrant):
    """With checkpoint(use_reentrant=True) the checkpointed layer's parameters get their
    gradients in a backward nested inside the pass. It is part of the pass: a skip before it
    (the last layer's, whose gradient comes first) still shows in found_inf and the scaler."""
    from torch.utils.checkpoint import checkpoint

    def model():
        torch.manual_seed(0)
        return torch.nn.ModuleList([torch.nn.Linear(16, 32), torch.nn.Linear(32, 32),
                                    torch.nn.Linear(32, 4)])

    def forward(m, x):
        h = torch.nn.functional.gelu(m[0](x.bfloat16()))
        h = checkpoint(lambda t: torch.nn.functional.gelu(m[1](t)), h, use_reentrant=use_reentrant)
        return m[2](h).float()
    a, b = model(), model()
    opt_a, opt_b = (ExtraBitsSGD(m.parameters(), lr=0.1, momentum=0.9, extra_bits=8) for m in (a, b))
    scaler = lowfp.DynamicLossScaler(init_scale=1024.0)
    handle = lowfp.optim.step_in_backward(opt_b, scaler=scaler)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    for step in range(3):
        opt_a.zero_grad()
        torch.nn.functional.cross_entropy(forward(a, x), y).backward()
        nan_hook = None
        if step == 1:
            a[2].bias.grad = None
            nan_hook = b[2].bias.register_hook(lambda g: torch.full_like(g, float("nan")))
        opt_a.step()
        scaler.scale(torch.nn.functional.cross_entropy(forward(b, x), y)).backward()
        if nan_hook is not None:
            nan_hook.remove()
        assert handle.found_inf == (step == 1) and handle.skipped == (0 if step == 0 else 1)
        scaler.update()
        assert scaler.get_scale() == (1024.0 if step == 0 else 512.0)  # backed off once
        for wa, wb in zip(opt_a.master_weights(), opt_b.master_weights()):
            assert torch.equal(wa, wb), step
    handle.remove()


@pytest.mark.parametrize("opt_cls,kw", [(ExtraBitsSGD, dict(momentum=0.9, rounding="stochastic")),
                                        (ExtraBitsAdamW, dict(rounding="nearest"))])
def test_step_in_backward_under_emulation_equals_a_normal_step(opt_cls, kw):
    """lowfp.emulate rounds each weight gradient before it is accumulated into .grad, so the
    hooks step with the rounded gradient, as a step after backward does."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(32, 8).bfloat16(), torch.randint(0, 4, (32,))
    a, b = model(), model()
    torch.manual_seed(9)  # the same draws for the stochastic conversion to bfloat16
    opt_a = opt_cls(a.parameters(), lr=0.05, **kw)
    torch.manual_seed(9)
    opt_b = opt_cls(b.parameters(), lr=0.05, **kw)

    def loss_fn(out, y):
        return torch.nn.functional.cross_entropy(out.float(), y)
    assignment = lowfp.assign.uniform(lowfp.assign.trace(a, x, loss_fn, y),
                                      lowfp.assign.Candidates(hi=lowfp.fp(6, 6, 0)))
    handle = lowfp.optim.step_in_backward(opt_b)
    with lowfp.emulate(a, assignment), lowfp.emulate(b, assignment) as em_b:
        for step in range(4):
            torch.manual_seed(step)
            loss_a = loss_fn(a(x), y)
            opt_a.zero_grad()
            loss_a.backward()
            opt_a.step()
            torch.manual_seed(step)
            loss_b = loss_fn(b(x), y)
            loss_b.backward()
            assert torch.equal(loss_a, loss_b), step
            for wa, wb in zip(opt_a.master_weights(), opt_b.master_weights()):
                assert torch.equal(wa, wb), step
    assert len(em_b.history.steps) == 4 and all(p.grad is None for p in b.parameters())
    handle.remove()


def test_step_in_backward_of_a_weight_backward_still_reads_raises_as_torchs_recipe():
    """A node that reads w without producing its gradient (here through w.detach()) and runs
    after w's gradient is complete would differentiate with the stepped w: not what a normal
    step gives. Autograd must see the step and raise, as it does for torch's own recipe
    (torch.optim stepped in the post-accumulate-grad hook), not return a silently wrong x.grad."""
    def run(make_hook):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4, 4).bfloat16())
        x = torch.randn(3, 4).bfloat16().requires_grad_()
        handle = make_hook(w)
        late = (x @ w.detach()).square().sum()  # made first: its backward runs after w's
        early = (x.detach() @ w).sum()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (early + late).backward()
        return handle

    def torch_recipe(w):
        opt = torch.optim.SGD([w], lr=0.1)
        return w.register_post_accumulate_grad_hook(lambda p: (opt.step(), opt.zero_grad()) and None)
    run(torch_recipe).remove()  # the control: torch's recipe raises here
    run(lambda w: lowfp.optim.step_in_backward(ExtraBitsSGD([w], lr=0.1))).remove()


def test_step_in_backward_refusals():
    opt = ExtraBitsSGD(small_model().parameters())
    with pytest.raises(ValueError, match="clip_norm"):
        lowfp.optim.step_in_backward(opt, clip_norm=1.0)
    with pytest.raises(ValueError, match="accumulation"):
        lowfp.optim.step_in_backward(opt, accumulation_steps=4)
    with pytest.raises(TypeError, match="ExtraBits"):
        lowfp.optim.step_in_backward(torch.optim.SGD(small_model().parameters(), lr=0.1))
    with pytest.raises(TypeError, match="get_scale"):
        lowfp.optim.step_in_backward(opt, scaler=object())
    handle = lowfp.optim.step_in_backward(opt)
    with pytest.raises(ValueError, match="already steps inside backward"):
        lowfp.optim.step_in_backward(opt, clip_value=1.0)  # each parameter would step twice
    handle.remove()
    with pytest.raises(ValueError, match="clip_value must be a positive number"):
        lowfp.optim.step_in_backward(opt, clip_value=True)
    lowfp.optim.step_in_backward(opt, clip_value=1.0).remove()


def test_group_added_while_stepping_inside_backward_steps_too():
    # A group added after step_in_backward() gets its hooks; without them its parameters would
    # silently never step (step() is not called in that mode).
    kw = dict(lr=0.1, momentum=0.9, extra_bits=8, rounding="stochastic")
    a, b = small_model(), small_model()
    opts = []
    for model, inside in ((a, False), (b, True)):
        torch.manual_seed(0)
        opt = ExtraBitsSGD(list(model[0].parameters()) + list(model[2].parameters()), **kw)
        handle = lowfp.optim.step_in_backward(opt) if inside else None
        torch.manual_seed(1)
        opt.add_param_group({"params": list(model[4].parameters()), "lr": 0.05})
        opts.append((opt, handle))
    (opt_a, _), (opt_b, handle) = opts
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    before = opt_b.master_weights()
    steps_match_inside_backward(a, b, opt_a, opt_b, x, y, steps=3)
    assert not torch.equal(before[-1], opt_b.master_weights()[-1])  # the added group stepped
    handle.remove()
    loss_of(b, x, y).backward()
    assert all(p.grad is not None for p in b.parameters())  # the added group's hooks went too


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_optimizer_pickles_and_deep_copies(how):
    """torch.optim.Optimizer pickles only defaults, state and param_groups; the copy must keep the
    weight counts and each parameter's Philox offset (keyed by the new parameters)."""
    import pickle
    model = small_model()
    opt = ExtraBitsAdamW(model.parameters(), lr=1e-2, extra_bits=8, rounding="stochastic")
    x = torch.randn(32, 16)
    model(x.bfloat16()).float().pow(2).mean().backward()
    opt.step()
    model2, opt2 = (pickle.loads(pickle.dumps((model, opt))) if how == "pickle"
                    else copy.deepcopy((model, opt)))
    assert opt2.weight_stats.as_dict() == opt.weight_stats.as_dict()
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x.bfloat16()).float().pow(2).mean().backward()
        torch.manual_seed(11)
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt2.master_weights()))
    assert opt2.weight_stats.as_dict() == opt.weight_stats.as_dict()


# On a GPU (tests/devices.py): the CPU's bits, counts and steps.

@on_cuda
@pytest.mark.parametrize("opt_name,kw,scaler_kind", [
    ("ExtraBitsSGD", dict(lr=0.05, momentum=0.9, dampening=0.1, rounding="stochastic"), "lowfp"),
    ("ExtraBitsSGD", dict(lr=0.05, momentum=0.9, rounding="nearest"), "torch"),
    ("ExtraBitsAdamW", dict(lr=1e-2, rounding="stochastic"), "lowfp"),
])
def test_step_in_backward_on_gpu_never_waits(opt_name, kw, scaler_kind):
    """Stepping inside backward on the GPU: the hooks unscale, check and skip on the device, so
    a backward pass never waits for it (CUDA's sync debug mode "error" raises on any wait). Adam
    waits once at the end of a pass, to apply the step counts of the steps not skipped, and SGD
    after its first momentum step, to take back a skipped one; those passes run outside the
    debug mode. Bit for bit equal
    to a twin model stepped normally on the same GPU, a non-finite gradient skipped in both."""
    import copy
    from lowfp import optim
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(33, 70), torch.nn.Tanh(), torch.nn.Linear(70, 3)).cuda()
    b = copy.deepcopy(a)
    torch.manual_seed(1)
    opt_a = getattr(optim, opt_name)(a.parameters(), extra_bits=8, **kw)
    torch.manual_seed(1)
    opt_b = getattr(optim, opt_name)(b.parameters(), extra_bits=8, **kw)
    scaler = (lowfp.DynamicLossScaler("cuda", init_scale=256.0, growth_interval=10 ** 6)
              if scaler_kind == "lowfp" else torch.amp.GradScaler("cuda", init_scale=256.0))
    handle = optim.step_in_backward(opt_b, scaler=scaler)
    x, y = torch.randn(64, 33, device="cuda").bfloat16(), torch.randint(0, 3, (64,), device="cuda")

    def loss_of(model):
        return torch.nn.functional.cross_entropy(model(x).float(), y)
    for step in range(4):
        opt_a.zero_grad()
        loss_of(a).backward()
        skip = step == 2
        if skip:
            a[2].bias.grad = None
            inf_hook = b[2].bias.register_hook(lambda g: torch.full_like(g, float("inf")))
        torch.manual_seed(step)
        opt_a.step()
        waits = step == 0 or opt_name == "ExtraBitsAdamW"
        torch.manual_seed(step)
        scaled = scaler.scale(loss_of(b))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("default" if waits else "error")
        try:
            scaled.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if skip:
            inf_hook.remove()
        assert handle.found_inf == skip and handle.skipped == int(step >= 2)
        for wa, wb in zip(opt_a.master_weights(), opt_b.master_weights()):
            assert torch.equal(wa, wb), step
        for pa, pb in zip(a.parameters(), b.parameters()):
            if "step" in opt_b.state[pb]:
                assert float(opt_b.state[pb]["step"]) == float(opt_a.state[pa].get("step", 0.0))
    handle.remove()
