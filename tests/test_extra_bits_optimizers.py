"""The ExtraBits optimizers (docs/design.md §5) against numpy references of torch.optim's
arithmetic (extra_bits_reference.py), and their state: state_dict, torch.optim checkpoints,
conversion of float32 parameters, refusals."""

import copy
import numpy as np
import pytest
import torch
from lowfp.optim import ExtraBitsAdam, ExtraBitsAdamW, ExtraBitsSGD
from lowfp.optim.state_dict import GENERATOR_STATE
from extra_bits_reference import F32, truncate_bits, RefSGD, RefAdam, small_model
from devices import on_cuda, step_on_both


def run_exactness(opt_cls, ref_cls, kwargs, dtype=torch.bfloat16, k=16, rounding="toward_zero",
                  steps=300, truncate=None, state_dtype=torch.float32):
    model = small_model()
    ref = ref_cls([p.detach().numpy().copy() for p in model.parameters()], **{
        key: v for key, v in kwargs.items()})
    opt = opt_cls(model.parameters(), extra_bits=k, rounding=rounding, param_dtype=dtype,
                  state_dtype=state_dtype, **kwargs)
    if truncate is not None:  # float32 parameters were converted with their extra bits
        ref.w = [truncate(torch.from_numpy(w)).numpy() for w in ref.w]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    y = torch.randint(0, 4, (256,), generator=g)
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
        loss.backward()
        ref.step([p.grad.float().numpy() for p in model.parameters()])
        opt.step()
        if truncate is not None:  # a master truncated to 16 + k bits after every step
            ref.w = [truncate(torch.from_numpy(w)).numpy() for w in ref.w]
        for got, want in zip(opt.master_weights(), ref.w):
            assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), step
    return model, opt


SGD_CASES = [dict(lr=0.05), dict(lr=0.05, momentum=0.9), dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
             dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
             dict(lr=0.05, momentum=0.8, dampening=0.1, maximize=True)]


ADAM_CASES = [dict(lr=1e-3), dict(lr=3e-3, weight_decay=1e-2, amsgrad=True),
              dict(lr=1e-3, betas=(0.8, 0.99), maximize=True)]


@pytest.mark.parametrize("kwargs", SGD_CASES)
def test_sgd_bfloat16_16_is_an_fp32_master(kwargs):
    run_exactness(ExtraBitsSGD, RefSGD, kwargs)


@pytest.mark.parametrize("kwargs", ADAM_CASES)
def test_adam_bfloat16_16_is_an_fp32_master(kwargs):
    run_exactness(ExtraBitsAdam, RefAdam, kwargs)


@pytest.mark.parametrize("kwargs", [dict(lr=1e-3), dict(lr=1e-3, weight_decay=0.1, amsgrad=True)])
def test_adamw_bfloat16_16_is_an_fp32_master(kwargs):
    run_exactness(ExtraBitsAdamW, lambda w, **kw: RefAdam(w, decoupled=True, **{"weight_decay": 1e-2, **kw}), kwargs)


def to_bfloat16_nearest(x):
    """float32 -> bfloat16 -> float32 by torch's cast (round to nearest even)."""
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


@pytest.mark.parametrize("opt_cls,ref_cls,kwargs", [
    (ExtraBitsSGD, RefSGD, dict(lr=0.05, momentum=0.9)),
    (ExtraBitsSGD, RefSGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    (ExtraBitsAdam, RefAdam, dict(lr=1e-3, amsgrad=True)),
    (ExtraBitsAdamW, lambda w, **kw: RefAdam(w, decoupled=True, weight_decay=1e-2, **kw), dict(lr=1e-3)),
])
def test_bfloat16_state_is_float32_state_rounded_to_nearest(opt_cls, ref_cls, kwargs):
    # the update uses the new state in float32, which is then stored rounded to bfloat16
    run_exactness(opt_cls, lambda w, **kw: ref_cls(w, state_round=to_bfloat16_nearest, **kw), kwargs,
                  steps=100, state_dtype=torch.bfloat16)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_float16_13_is_an_fp32_master(rounding):
    run_exactness(ExtraBitsAdamW, lambda w, **kw: RefAdam(w, decoupled=True, weight_decay=1e-2, **kw),
                  dict(lr=1e-3), dtype=torch.float16, k=13, rounding=rounding, steps=150)


@pytest.mark.parametrize("k", [4, 8])
def test_smaller_k_is_a_truncated_master(k):
    run_exactness(ExtraBitsSGD, RefSGD, dict(lr=0.05, momentum=0.9), k=k, rounding="nearest", steps=150,
                  truncate=lambda w: truncate_bits(w, torch.bfloat16, k))


def test_against_torch_optim():
    """Largest difference from torch.optim on an fp32 master fed the same gradients, one step at
    a time from the same weights, in units of ulp of the larger operand |W| + |update|: none."""
    for opt_cls, torch_cls, kw in [(ExtraBitsSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
                                   (ExtraBitsAdam, torch.optim.Adam, dict(lr=1e-3)),
                                   (ExtraBitsAdamW, torch.optim.AdamW, dict(lr=1e-3))]:
        model = small_model()
        master = [p.detach().clone().requires_grad_() for p in model.parameters()]
        opt = opt_cls(model.parameters(), **kw)
        topt = torch_cls(master, **kw)
        g = torch.Generator().manual_seed(2)
        worst = 0.0
        for _ in range(100):
            grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in model.parameters()]
            before = [m.detach().clone() for m in master]
            for p, m, gr in zip(model.parameters(), master, grads):
                p.grad, m.grad = gr, gr.float()
            opt.step()
            topt.step()
            for got, want, b in zip(opt.master_weights(), master, before):
                scale = b.abs() + (want.detach() - b).abs()
                ulp = torch.from_numpy(np.spacing(scale.numpy().astype(F32)))
                worst = max(worst, ((got - want.detach()).abs() / ulp).max().item())
                want.data.copy_(got)  # compare one step at a time from the same weights
        print(f"{opt_cls.__name__}: largest difference from {torch_cls.__name__} {worst} ulp")
        assert worst == 0.0, (opt_cls.__name__, worst)  # before torch's arithmetic: SGD 1, Adam 4


def test_state_dict_round_trip_into_a_fresh_optimizer():
    model = small_model()
    opt = ExtraBitsAdamW(model.parameters(), lr=1e-2, extra_bits=8, rounding="stochastic")
    x = torch.randn(32, 16)
    for _ in range(3):
        opt.zero_grad()
        model(x.bfloat16()).float().pow(2).mean().backward()
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    clone = copy.deepcopy(model)
    opt2 = ExtraBitsAdamW(clone.parameters(), lr=1e-2, extra_bits=8, rounding="stochastic")
    opt2.load_state_dict(sd)
    for p, q in zip(model.parameters(), clone.parameters()):
        s1, s2 = opt.state[p], opt2.state[q]
        assert torch.equal(s1["extra"], s2["extra"]) and s2["extra"].dtype == torch.int32
        assert s2["exp_avg"].dtype == torch.float32 and torch.equal(s1["exp_avg"], s2["exp_avg"])
    for m in (model, clone):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
    torch.manual_seed(7)
    opt.step()
    torch.manual_seed(7)
    opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt2.master_weights()))


@pytest.mark.parametrize("opt_cls", [ExtraBitsSGD, ExtraBitsAdamW])
def test_a_stochastic_run_with_a_generator_resumes_from_its_state_dict(opt_cls, tmp_path):
    """The generator's state travels in state_dict (through torch.save too): save after 3 steps,
    load into an optimizer whose generator was seeded otherwise, and 2 more steps equal the
    uninterrupted run bit for bit."""
    def run(model, opt, steps):
        for i in range(steps):
            opt.zero_grad()
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(i)).bfloat16()
            model(x).float().pow(2).mean().backward()
            opt.step()

    def make(params, seed):
        return opt_cls(params, lr=1e-2, extra_bits=6, rounding="stochastic",
                       generator=torch.Generator().manual_seed(seed))
    model = small_model()
    resumed = copy.deepcopy(model)
    opt = make(model.parameters(), 1)
    run(model, opt, 3)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    for p, q in zip(model.parameters(), resumed.parameters()):
        q.data.copy_(p.data)
    run(model, opt, 2)
    opt2 = make(resumed.parameters(), 99)
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt"))
    assert all(GENERATOR_STATE not in g for g in opt2.param_groups)
    run(resumed, opt2, 2)
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt2.master_weights()))
    # without a generator to set, the loading optimizer says where its seeds come from
    with pytest.warns(UserWarning, match="pass generator= to continue"):
        opt_cls(small_model().parameters(), extra_bits=6, rounding="stochastic").load_state_dict(
            torch.load(tmp_path / "opt.pt"))


@pytest.mark.parametrize("opt_cls, torch_cls, ref_cls, kw", [
    (ExtraBitsSGD, torch.optim.SGD, RefSGD, dict(lr=0.05, momentum=0.9, dampening=0.1)),
    (ExtraBitsAdam, torch.optim.Adam, RefAdam, dict(lr=1e-3, weight_decay=1e-2)),
    (ExtraBitsAdamW, torch.optim.AdamW, RefAdam, dict(lr=1e-3, amsgrad=True, weight_decay=0.1))])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_a_torch_optim_state_dict_continues_float32_training(opt_cls, torch_cls, ref_cls, kw, state_dtype):
    """A checkpoint of float32 training with torch.optim continued with extra bits: the model's
    float32 weights are loaded, the optimizer converts them (bfloat16 + 16 bits: every bit kept)
    and loads torch's state_dict, whose moments and step counts it takes. The next steps equal
    the float32 reference formulas continued from torch's weights and state (moments rounded to
    bfloat16 after every step for bfloat16 state, as test_bfloat16_state_... checks)."""
    torch.manual_seed(0)
    model = small_model()
    topt = torch_cls(model.parameters(), **kw)
    g = torch.Generator().manual_seed(5)
    grads = [[torch.randn(p.shape, generator=g) for p in model.parameters()] for _ in range(7)]
    for step in range(3):
        for p, gr in zip(model.parameters(), grads[step]):
            p.grad = gr
        topt.step()
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(topt.state_dict())
    tstate = [topt.state[p] for p in model.parameters()]

    state_round = None if state_dtype == torch.float32 else (
        lambda a: torch.from_numpy(a).bfloat16().float().numpy())
    ref = ref_cls([p.detach().numpy().copy() for p in model.parameters()], **kw, state_round=state_round)
    first = (lambda t: t.bfloat16().float().numpy()) if state_round else (lambda t: t.numpy().copy())
    if ref_cls is RefSGD:
        ref.buf = [first(s["momentum_buffer"]) for s in tstate]
    else:
        ref.t = 3
        ref.m, ref.v = [first(s["exp_avg"]) for s in tstate], [first(s["exp_avg_sq"]) for s in tstate]
        if kw.get("amsgrad"):
            ref.vmax = [first(s["max_exp_avg_sq"]) for s in tstate]
        ref.decoupled = torch_cls is torch.optim.AdamW

    fresh = small_model(seed=1)
    fresh.load_state_dict(saved_model)  # float32 weights first, then the optimizer
    opt = opt_cls(fresh.parameters(), extra_bits=16, state_dtype=state_dtype,
                  **{key: v for key, v in kw.items() if key != "lr"}, lr=0.5)  # lr: torch's, loaded
    extras = [opt.state[p]["extra"].clone() for p in fresh.parameters()]
    opt.load_state_dict(saved_opt)
    group = opt.param_groups[0]
    assert group["lr"] == kw["lr"] and group["extra_bits"] == 16 and group["state_dtype"] is state_dtype
    assert not {"foreach", "fused", "differentiable", "capturable"} & set(group)
    for p, e, s in zip(fresh.parameters(), extras, tstate):
        assert torch.equal(opt.state[p]["extra"], e)  # the converted float32 weights' cut-off bits
        for key, value in s.items():
            got = opt.state[p][key]
            want = value if key == "step" else value.to(state_dtype)
            assert got.dtype == want.dtype and torch.equal(got, want), key
    assert all(torch.equal(a, torch.from_numpy(b)) for a, b in zip(opt.master_weights(), ref.w))
    for step in range(3, 7):
        for p, gr in zip(fresh.parameters(), grads[step]):
            p.grad = gr.bfloat16()
        ref.step([gr.bfloat16().float().numpy() for gr in grads[step]])
        opt.step()
        for got, want in zip(opt.master_weights(), ref.w):
            assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), step
    # Another family's state is still refused, naming what it lacks.
    other = torch.optim.Adam if torch_cls is torch.optim.SGD else torch.optim.SGD
    with pytest.raises(ValueError, match="lacks"):
        opt.load_state_dict(other(small_model().parameters(), lr=0.1).state_dict())


def test_a_torch_optim_state_dict_keeps_the_extra_bits_of_parameters_it_has_no_state_for():
    """A parameter that never had a gradient under torch.optim has no saved state: it keeps the
    extra bits its float32 weights were converted with, and its moments start at its first step."""
    model = small_model()
    topt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    frozen = model[4].bias
    for p in model.parameters():
        p.grad = None if p is frozen else torch.randn(p.shape)
    topt.step()
    saved = topt.state_dict()
    w32 = frozen.detach().clone()
    opt = ExtraBitsAdamW(model.parameters(), lr=1e-3, extra_bits=16)
    extra = opt.state[frozen]["extra"].clone()
    opt.load_state_dict(saved)
    assert torch.equal(opt.state[frozen]["extra"], extra) and "exp_avg" not in opt.state[frozen]
    assert torch.equal(opt.master_weights()[5], w32)  # bfloat16 + 16: every bit of it
    assert float(opt.state[model[0].weight]["step"]) == 1.0
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert float(opt.state[frozen]["step"]) == 1.0 and float(opt.state[model[0].weight]["step"]) == 2.0


def steps_of(make_opt, steps=5, seed=0):
    """Master weights of small_model after `steps` steps on fixed gradients."""
    model = small_model(seed)
    opt = make_opt(model)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        opt.step()
    return opt, opt.master_weights()


def test_adam_decoupled_weight_decay_is_adamw_and_per_group():
    # torch.optim.Adam(decoupled_weight_decay=True) is AdamW; so here, also for one group only.
    kw = dict(lr=1e-2, weight_decay=0.1, extra_bits=8)
    adam, decoupled = steps_of(lambda m: ExtraBitsAdam(m.parameters(), decoupled_weight_decay=True, **kw))
    adamw, reference = steps_of(lambda m: ExtraBitsAdamW(m.parameters(), **kw))
    _, coupled = steps_of(lambda m: ExtraBitsAdam(m.parameters(), **kw))
    assert all(torch.equal(a, b) for a, b in zip(decoupled, reference))
    assert not any(torch.equal(a, b) for a, b in zip(coupled, reference))
    assert adam.param_groups[0]["decoupled_weight_decay"] and adamw.param_groups[0]["decoupled_weight_decay"]
    _, mixed = steps_of(lambda m: ExtraBitsAdam(
        [{"params": m[0].parameters(), "decoupled_weight_decay": True},
         {"params": list(m[2].parameters()) + list(m[4].parameters())}], **kw))
    assert all(torch.equal(a, b) for a, b in zip(mixed[:2], reference[:2]))
    assert all(torch.equal(a, b) for a, b in zip(mixed[2:], coupled[2:]))
    with pytest.raises(TypeError, match="decoupled_weight_decay must be a bool"):
        ExtraBitsAdam(small_model().parameters(), decoupled_weight_decay=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'decoupled_weight_decay'"):
        ExtraBitsAdamW(small_model().parameters(), decoupled_weight_decay=False)


@pytest.mark.parametrize("opt_cls, expected", [(ExtraBitsAdam, False), (ExtraBitsAdamW, True)])
def test_state_dict_saved_before_decoupled_weight_decay_loads(opt_cls, expected):
    # A state_dict from before the setting existed keeps its class's old behaviour, and the
    # caller's dict is not changed; so does a pickle.
    opt, _ = steps_of(lambda m: opt_cls(m.parameters(), lr=1e-2, weight_decay=0.1, extra_bits=8))
    old = copy.deepcopy(opt.state_dict())
    for g in old["param_groups"]:
        del g["decoupled_weight_decay"]
    kept = copy.deepcopy(old)
    other = {"decoupled_weight_decay": not expected} if opt_cls is ExtraBitsAdam else {}
    fresh = opt_cls(small_model().parameters(), lr=1e-2, weight_decay=0.1, extra_bits=8, **other)
    fresh.load_state_dict(old)
    assert fresh.param_groups[0]["decoupled_weight_decay"] is expected
    assert old["param_groups"][0].keys() == kept["param_groups"][0].keys()
    state = opt.__getstate__()
    for g in state["param_groups"]:
        del g["decoupled_weight_decay"]
    revived = opt_cls.__new__(opt_cls)
    revived.__setstate__(state)
    assert revived.param_groups[0]["decoupled_weight_decay"] is expected


@pytest.mark.parametrize("opt_cls", [ExtraBitsSGD, ExtraBitsAdam, ExtraBitsAdamW])
def test_torch_implementation_switches(opt_cls):
    # foreach / fused are accepted so torch.optim code runs unchanged, and change nothing.
    kw = dict(lr=1e-2, extra_bits=8)
    _, plain = steps_of(lambda m: opt_cls(m.parameters(), **kw))
    for switches in (dict(foreach=True), dict(foreach=False, fused=True), dict(fused=False),
                     dict(differentiable=False)):
        _, got = steps_of(lambda m: opt_cls(m.parameters(), **switches, **kw))
        assert all(torch.equal(a, b) for a, b in zip(got, plain)), switches
    params = small_model().parameters()
    with pytest.raises(TypeError, match="foreach must be a bool or None, got 'yes'"):
        opt_cls(params, foreach="yes")
    with pytest.raises(ValueError, match="differentiable=True is not supported"):
        opt_cls(params, differentiable=True)
    if opt_cls is ExtraBitsSGD:
        with pytest.raises(TypeError, match="capturable"):  # torch's SGD has no such argument
            opt_cls(params, capturable=False)
    else:
        _, got = steps_of(lambda m: opt_cls(m.parameters(), capturable=False, **kw))
        assert all(torch.equal(a, b) for a, b in zip(got, plain))
        with pytest.raises(ValueError, match="capturable=True is not supported"):
            opt_cls(params, capturable=True)


def test_float32_model_conversion_and_memory():
    model = small_model()
    w32 = [p.detach().clone() for p in model.parameters()]
    opt = ExtraBitsSGD(model.parameters(), lr=0.1, momentum=0.9, extra_bits=16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), w32))  # nothing lost
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    mem = opt.memory_bytes()
    n = sum(p.numel() for p in model.parameters())
    assert mem["weights"] == 2 * n
    assert mem["extra_bits"] == sum(opt.state[p]["extra"].numel() * 4 for p in model.parameters())
    assert mem["moments"] == sum(opt.state[p]["momentum_buffer"].numel() * 4 for p in model.parameters())
    assert mem["total"] == mem["weights"] + mem["extra_bits"] + mem["moments"]
    opt16 = ExtraBitsAdam(small_model().bfloat16().parameters(), extra_bits=8, state_dtype=torch.bfloat16)
    for group in opt16.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    opt16.step()
    assert opt16.memory_bytes()["moments"] == sum(2 * 2 * p.numel() for g in opt16.param_groups for p in g["params"])


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_a_float32_model_with_buffers_is_converted_by_to_after_the_optimizer(param_dtype):
    """The optimizer converts only parameters: BatchNorm's float32 running statistics then meet
    16-bit weights, which torch's batch_norm refuses. model.to(param_dtype) after the optimizer
    converts the buffers and leaves the already 16-bit parameters, their identity and their
    extra bits as they are, so nothing of the float32 weights is lost."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4))
    w32 = [p.detach().clone() for p in model.parameters()]
    opt = ExtraBitsAdamW(model.parameters(), lr=1e-3, extra_bits=16 if param_dtype == torch.bfloat16
                         else 13, param_dtype=param_dtype)
    x = torch.randn(5, 3, 8, 8)
    with pytest.raises(RuntimeError):  # torch's own error: float32 running statistics
        model(x.to(param_dtype))
    params = list(model.parameters())
    extras = [opt.state[p]["extra"].clone() for p in params]
    assert model.to(param_dtype) is model
    assert list(model.parameters()) == params and all(p.dtype == param_dtype for p in params)
    assert model[1].running_var.dtype == param_dtype
    assert all(torch.equal(opt.state[p]["extra"], e) for p, e in zip(params, extras))
    # bfloat16 + 16 is float32; float16 + 13 too in float16's normal range
    normal = [w.abs() >= 2.0 ** -14 if param_dtype == torch.float16 else torch.ones_like(w, dtype=torch.bool)
              for w in w32]
    assert all(torch.equal(a[m], b[m]) for a, b, m in zip(opt.master_weights(), w32, normal))
    assert sum(m.sum().item() for m in normal) > 0.99 * sum(w.numel() for w in w32)
    for _ in range(2):
        opt.zero_grad()
        model(x.to(param_dtype)).float().square().mean().backward()
        opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(opt.master_weights(), w32))


def test_param_groups_schedulers_and_zero_grad():
    model = small_model().bfloat16()
    opt = ExtraBitsSGD([{"params": model[0].parameters(), "lr": 0.5},
                        {"params": model[2].parameters()}, {"params": model[4].parameters(), "extra_bits": 4}],
                       lr=0.1, extra_bits=12)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = [w.clone() for w in opt.master_weights()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    after = opt.master_weights()
    assert opt.param_groups[0]["lr"] == 0.25 and opt.param_groups[1]["lr"] == 0.05
    assert opt.state[model[4].weight]["extra"].numel() == (model[4].weight.numel() + 31) // 32 * 4
    d0 = (after[0] - before[0]).abs().max().item()
    assert d0 == pytest.approx(0.5, rel=1e-2)  # group 0 stepped with its own lr
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("opt_cls, kw", [(ExtraBitsSGD, dict(momentum=0.9)), (ExtraBitsAdamW, {}),
                                         (ExtraBitsAdam, dict(betas=(0.8, 0.99)))])
def test_tensor_lr_and_betas_step_as_floats(opt_cls, kw):
    """torch.optim takes lr (and Adam's betas) as 1-element tensors, which LR schedulers fill in
    place; the step reads them as floats, so it equals the float run under the same schedule."""
    def run(as_tensor):
        model = small_model()
        # 1-element: torch accepts any shape; float64, so the scheduler's values stay the floats'
        lr = torch.tensor([0.02], dtype=torch.float64) if as_tensor else 0.02
        kws = dict(kw)
        if as_tensor and "betas" in kws:
            kws["betas"] = tuple(torch.tensor(b, dtype=torch.float64) for b in kws["betas"])
        opt = opt_cls(model.parameters(), lr=lr, extra_bits=8, rounding="nearest", **kws)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=6)
        g = torch.Generator().manual_seed(3)
        for _ in range(5):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            opt.step()
            sched.step()
        return opt
    tensor_run, float_run = run(True), run(False)
    lr = tensor_run.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.shape == () and float(lr) == float_run.param_groups[0]["lr"]
    assert all(torch.equal(a, b) for a, b in zip(tensor_run.master_weights(), float_run.master_weights()))
    loaded = opt_cls(small_model().parameters(), lr=torch.tensor(1.0), extra_bits=8, rounding="nearest",
                     **kw)
    loaded.load_state_dict(tensor_run.state_dict())
    assert float(loaded.param_groups[0]["lr"]) == float(lr)
    for bad in (torch.tensor([0.1, 0.2]), torch.tensor(1)):
        with pytest.raises(ValueError, match="Tensor lr must be 1-element and floating-point"):
            opt_cls(small_model().parameters(), lr=bad, **kw)
    with pytest.raises(TypeError, match="lr must be a float or a 1-element tensor"):
        opt_cls(small_model().parameters(), lr="0.1", **kw)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt_cls([{"params": small_model().parameters(), "lr": torch.tensor(-1.0)}], **kw)
    if opt_cls is not ExtraBitsSGD:
        with pytest.raises(ValueError, match="both floats or both Tensors"):
            opt_cls(small_model().parameters(), betas=(0.9, torch.tensor(0.99)))
        with pytest.raises(ValueError, match=r"Tensor betas\[1\] must be 1-element"):
            opt_cls(small_model().parameters(), betas=(torch.tensor(0.9), torch.tensor([0.9, 0.99])))


def test_optimizer_errors():
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        ExtraBitsSGD([torch.nn.Parameter(torch.ones(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="between 1 and 13"):
        ExtraBitsSGD([torch.nn.Parameter(torch.ones(3, dtype=torch.float16))], extra_bits=14)
    with pytest.raises(ValueError, match="rounding"):
        ExtraBitsAdam([torch.nn.Parameter(torch.ones(3))], rounding="up")
    with pytest.raises(TypeError, match="state_dtype"):
        ExtraBitsAdam([torch.nn.Parameter(torch.ones(3))], state_dtype=torch.float16)
    with pytest.raises(ValueError, match="Nesterov"):
        ExtraBitsSGD([torch.nn.Parameter(torch.ones(3))], nesterov=True)
    with pytest.raises(ValueError, match="betas must be a pair"):
        ExtraBitsAdam([torch.nn.Parameter(torch.ones(3))], betas=(0.9,))
    nan = float("nan")
    for cls, kw, what in [(ExtraBitsSGD, dict(lr=nan), "learning rate"),
                          (ExtraBitsAdamW, dict(lr=-1e-3), "learning rate"),
                          (ExtraBitsSGD, dict(momentum=nan), "momentum"),
                          (ExtraBitsSGD, dict(weight_decay=nan), "weight_decay"),
                          (ExtraBitsAdam, dict(eps=nan), "epsilon"),
                          (ExtraBitsAdam, dict(betas=(0.9, nan)), "beta")]:
        with pytest.raises(ValueError, match=f"Invalid {what}"):  # as torch.optim
            cls([torch.nn.Parameter(torch.ones(3))], **kw)
    sgd = ExtraBitsSGD([torch.nn.Parameter(torch.ones(3))], momentum=0.9)
    with pytest.raises(ValueError, match=r"lacks \['amsgrad', 'betas', 'eps'\].*another optimizer"):
        ExtraBitsAdamW([torch.nn.Parameter(torch.ones(3))]).load_state_dict(sgd.state_dict())


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate parameters")
def test_a_refused_param_group_leaves_the_optimizer_as_it_was():
    """A group that fails its checks is not added, and none of its float32 parameters is
    converted; a parameter listed twice in a group (which torch.optim only warns about) is
    refused: one fused call would update its memory from two slots at once."""
    first = torch.nn.Parameter(torch.randn(3).bfloat16())
    opt = ExtraBitsSGD([first], lr=0.1)
    p32 = torch.nn.Parameter(torch.randn(4))
    bad = [[p32, torch.nn.Parameter(torch.ones(3, dtype=torch.float64))],
           [p32, torch.nn.Parameter(torch.ones(4, 2).bfloat16()[::2])],  # every other row
           [p32, p32]]
    for params, error, match in zip(bad, (TypeError, ValueError, ValueError),
                                    ("float16 or bfloat16", "dense in memory", "more than once")):
        with pytest.raises(error, match=match):
            opt.add_param_group({"params": params})
        assert len(opt.param_groups) == 1 and p32.dtype == torch.float32 and p32 not in opt.state
    with pytest.raises(ValueError, match="more than once"):
        ExtraBitsAdamW([first, torch.nn.Parameter(torch.ones(2).bfloat16()), first])
    opt.add_param_group({"params": [p32], "lr": 0.5})  # a good group still goes in
    assert len(opt.param_groups) == 2 and p32.dtype == torch.bfloat16


def test_a_parameter_appended_to_a_group_by_hand_steps():
    """torch.optim steps whatever group["params"] holds, also a parameter appended to it after
    the optimizer was built; so does this one, with the stochastic draws of an optimizer built
    with both. An appended float32 parameter was never converted: a clear error."""
    def params():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in (5, 40)]
    (a, b), (c, d) = params(), params()
    kw = dict(lr=0.1, momentum=0.9, extra_bits=8, rounding="stochastic")
    opt, ref = ExtraBitsSGD([a], **kw), ExtraBitsSGD([c, d], **kw)
    opt.param_groups[0]["params"].append(b)
    for step in range(3):
        for p, q in ((a, c), (b, d)):
            p.grad = q.grad = torch.randn(p.shape).bfloat16()
        torch.manual_seed(step)
        opt.step()
        torch.manual_seed(step)
        ref.step()
        assert all(torch.equal(x, y) for x, y in zip(opt.master_weights(), ref.master_weights()))
    opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.randn(3)))
    opt.param_groups[0]["params"][-1].grad = torch.randn(3)
    with pytest.raises(TypeError, match="now has dtype torch.float32"):
        opt.step()


def test_gradients_of_another_dtype_or_layout():
    """A float32 or non-contiguous gradient steps as its contiguous bfloat16 rounding does (as
    p.grad.to(p.dtype)); a sparse one (Embedding(sparse=True)) is a clear error, before any
    parameter has stepped."""
    torch.manual_seed(0)
    g32 = torch.randn(6, 4)
    a, b = torch.nn.Parameter(torch.randn(4, 6).bfloat16()), None
    b = torch.nn.Parameter(a.detach().clone())
    opt_a, opt_b = ExtraBitsAdamW([a], lr=0.1), ExtraBitsAdamW([b], lr=0.1)
    a.grad_dtype = None  # torch refuses a gradient of another dtype unless told to accept it
    a.grad = g32.t()  # float32, transposed
    b.grad = g32.t().bfloat16().contiguous()
    opt_a.step()
    opt_b.step()
    assert torch.equal(a, b) and torch.equal(opt_a.state[a]["extra"], opt_b.state[b]["extra"])
    emb = torch.nn.Embedding(10, 3, sparse=True)
    dense = torch.nn.Parameter(torch.randn(3).bfloat16())
    opt = ExtraBitsSGD([dense, emb.weight], lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    dense.grad = torch.ones(3).bfloat16()
    before = dense.detach().clone()
    with pytest.raises(ValueError, match="dense gradients, got a torch.sparse_coo one"):
        opt.step()
    assert torch.equal(dense, before)


@pytest.mark.parametrize("start", [1, 2, 3, 6, 37])
@pytest.mark.parametrize("opt_cls,kw", [(ExtraBitsAdamW, {}), (ExtraBitsSGD, dict(momentum=0.9))])
def test_a_shard_steps_as_its_part_of_the_whole_tensor(start, opt_cls, kw):
    # A DTensor shard that starts at global element `start` draws its stochastic rounding words
    # from there (element i: word (start + i) % 4 of Philox block (start + i) // 4), so it steps
    # bit for bit as those elements of the unsharded parameter do. The element offset is set
    # directly here, as the optimizer sets it from a shard's placement.
    g = torch.Generator().manual_seed(start)
    whole = torch.nn.Parameter(torch.randn(300, generator=g).bfloat16())
    part = torch.nn.Parameter(whole.detach()[start:].clone())
    opts = [opt_cls([p], lr=0.1, extra_bits=6, rounding="stochastic",
                    generator=torch.Generator().manual_seed(3), **kw) for p in (whole, part)]
    opts[1]._philox_offset[id(part)] = start
    for _ in range(3):
        grad = torch.randn(300, generator=g).bfloat16()
        whole.grad, part.grad = grad, grad[start:].clone()
        for opt in opts:
            opt.step()
        assert torch.equal(part.detach().view(torch.int16), whole.detach()[start:].view(torch.int16))
    assert torch.equal(opts[1].master_weights()[0], opts[0].master_weights()[0][start:])


# On a GPU (tests/devices.py): the CPU's bits, counts and steps.

@on_cuda
@pytest.mark.parametrize("opt_name,kw", [
    ("ExtraBitsSGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, extra_bits=8,
                          rounding="stochastic")),
    ("ExtraBitsSGD", dict(lr=0.05, momentum=0.9, extra_bits=8, rounding="toward_zero")),
    ("ExtraBitsSGD", dict(lr=0.1, extra_bits=4, rounding="nearest")),
    ("ExtraBitsAdam", dict(lr=1e-3, amsgrad=True, extra_bits=16, rounding="nearest", state_dtype=torch.bfloat16)),
    ("ExtraBitsAdamW", dict(lr=1e-3, weight_decay=0.05, extra_bits=8, rounding="toward_zero")),
    ("ExtraBitsAdamW", dict(lr=1e-3, extra_bits=8, rounding="nearest", state_dtype=torch.bfloat16)),
    ("ExtraBitsAdamW", dict(lr=1e-3, extra_bits=13, rounding="stochastic", param_dtype=torch.float16)),
])
def test_extra_bits_optimizers_match_cpu(opt_name, kw):
    import copy
    from lowfp import optim
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 70), torch.nn.Tanh(), torch.nn.Linear(70, 3))
    gpu_model = copy.deepcopy(model).cuda()
    torch.manual_seed(1)
    cpu_opt = getattr(optim, opt_name)(model.parameters(), **kw)
    torch.manual_seed(1)
    gpu_opt = getattr(optim, opt_name)(gpu_model.parameters(), **kw)
    step_on_both(cpu_opt, gpu_opt, list(model.parameters()), list(gpu_model.parameters()),
                 torch.Generator().manual_seed(2), steps=5, seed=10)


@on_cuda
def test_extra_bits_state_dict_from_cpu_to_gpu():
    """A CPU checkpoint loaded into a GPU optimizer: the packed words and moments move to the
    GPU (Adam's step count stays on the CPU, as in torch.optim), and both go on equally. State
    left on the wrong device is refused, not handed to the kernel."""
    import copy
    from lowfp import optim
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 70), torch.nn.Tanh(), torch.nn.Linear(70, 3))
    cpu_opt = optim.ExtraBitsAdamW(model.parameters(), lr=1e-3, extra_bits=8, rounding="stochastic")
    g = torch.Generator().manual_seed(5)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    cpu_opt.step()
    gpu_model = copy.deepcopy(model).cuda()
    gpu_opt = optim.ExtraBitsAdamW(gpu_model.parameters(), lr=1e-3, extra_bits=8, rounding="stochastic")
    gpu_opt.load_state_dict(cpu_opt.state_dict())
    for q in gpu_model.parameters():
        state = gpu_opt.state[q]
        assert state["extra"].is_cuda and state["exp_avg"].is_cuda and not state["step"].is_cuda
    cpu_opt.weight_stats.reset()  # the counts are the optimizer's, not part of its state_dict
    step_on_both(cpu_opt, gpu_opt, list(model.parameters()), list(gpu_model.parameters()), g,
                 steps=3, seed=30)
    q = next(gpu_model.parameters())
    gpu_opt.state[q]["exp_avg"] = gpu_opt.state[q]["exp_avg"].cpu()
    q.grad = torch.ones_like(q)
    with pytest.raises(ValueError, match="'exp_avg' .* on cpu, but the step needs .* on cuda"):
        gpu_opt.step()


@on_cuda
def test_extra_bits_continue_a_torch_fused_adamw_checkpoint_on_gpu_as_on_cpu():
    """A CUDA torch.optim.AdamW(fused=True) state_dict (step counts on the device) loads into
    ExtraBitsAdamW on the GPU as its CPU copy loads into the CPU optimizer, and both continue
    alike, with the seeds from a generator= of their own (torch's global one draws nothing)."""
    import copy
    from lowfp import optim
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.Tanh(), torch.nn.Linear(48, 5)).cuda()
    topt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        topt.step()
    saved = topt.state_dict()
    assert saved["state"][0]["step"].is_cuda
    cpu_model = copy.deepcopy(model).cpu()
    kw = dict(lr=1e-3, extra_bits=8, rounding="stochastic")
    gpu_opt = optim.ExtraBitsAdamW(model.parameters(), generator=torch.Generator().manual_seed(4), **kw)
    cpu_opt = optim.ExtraBitsAdamW(cpu_model.parameters(), generator=torch.Generator().manual_seed(4), **kw)
    gpu_opt.load_state_dict(saved)
    cpu_opt.load_state_dict(copy.deepcopy(saved))
    assert gpu_opt.state[model[0].weight]["step"].device.type == "cpu"
    g = torch.Generator().manual_seed(2)
    step_on_both(cpu_opt, gpu_opt, list(cpu_model.parameters()), list(model.parameters()), g,
                 steps=3, seed=10)


@on_cuda
@pytest.mark.parametrize("opt_name,rounding", [("ExtraBitsSGD", "stochastic"), ("ExtraBitsAdamW", "nearest")])
def test_extra_bits_step_of_a_large_group_matches_cpu(opt_name, rounding):
    # 5.2e4 chunks of 128 elements: about 3 per warp on an H100 (132 SMs x 16 blocks x 8 warps),
    # so warps step several, crossing from one parameter to the next (their forward scan of the
    # slot table); sizes that end in full and in partial chunks.
    from lowfp import optim
    sizes = [4_000_007, 128, 3, 2_500_000, 4_096 * 33 + 31]
    g = torch.Generator().manual_seed(4)
    cpu_params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    gpu_params = [torch.nn.Parameter(p.detach().cuda()) for p in cpu_params]
    kw = dict(lr=0.01, extra_bits=8, rounding=rounding)
    kw.update(momentum=0.9) if opt_name == "ExtraBitsSGD" else kw.update(weight_decay=0.01)
    cpu_opt = getattr(optim, opt_name)(cpu_params, **kw)
    gpu_opt = getattr(optim, opt_name)(gpu_params, **kw)
    step_on_both(cpu_opt, gpu_opt, cpu_params, gpu_params, g, steps=2, seed=20)


@on_cuda
def test_extra_bits_step_of_more_parameters_than_one_launch_holds():
    # The slot table is the kernel's argument (384 parameters a launch): 900 parameters take
    # three launches; empty parameters are skipped, and a table of empty ones launches nothing.
    from lowfp import optim
    g = torch.Generator().manual_seed(6)
    sizes = [int(n) for n in torch.randint(0, 700, (900,), generator=g)] + [0, 0]
    cpu_params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    gpu_params = [torch.nn.Parameter(p.detach().cuda()) for p in cpu_params]
    kw = dict(lr=0.01, momentum=0.9, extra_bits=8, rounding="stochastic")
    cpu_opt = optim.ExtraBitsSGD(cpu_params, **kw)
    gpu_opt = optim.ExtraBitsSGD(gpu_params, **kw)
    step_on_both(cpu_opt, gpu_opt, cpu_params, gpu_params, g, steps=2, seed=40)
    assert gpu_opt.weight_stats.numel == 2 * sum(sizes)
    empty = [torch.nn.Parameter(torch.zeros(0, device="cuda")) for _ in range(3)]
    opt = optim.ExtraBitsSGD(empty, lr=0.1)
    for p in empty:
        p.grad = torch.zeros_like(p)
    opt.step()
    torch.cuda.synchronize()


@on_cuda
@pytest.mark.parametrize("opt_name,torch_name,kw", [
    ("ExtraBitsSGD", "SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)),
    ("ExtraBitsSGD", "SGD", dict(lr=0.05, momentum=0.8, dampening=0.1, maximize=True)),
    ("ExtraBitsAdam", "Adam", dict(lr=1e-3, weight_decay=1e-2, amsgrad=True)),
    ("ExtraBitsAdamW", "AdamW", dict(lr=1e-3, weight_decay=1e-2)),
    ("ExtraBitsAdam", "Adam", dict(lr=1e-3, maximize=True, decoupled_weight_decay=True,
                                   weight_decay=0.1)),
])
def test_extra_bits_on_gpu_equal_torch_optim_foreach_on_gpu(opt_name, torch_name, kw):
    """bfloat16 + 16 extra bits on the GPU equals torch.optim's default CUDA path (foreach) on a
    float32 master bit for bit, fed the same gradients (docs/design.md §5)."""
    from lowfp import optim
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 70), torch.nn.Tanh(), torch.nn.Linear(70, 3)).cuda()
    master = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    ref = getattr(torch.optim, torch_name)(master, **kw)
    opt = getattr(optim, opt_name)(model.parameters(), extra_bits=16, **kw)
    g = torch.Generator().manual_seed(3)
    for step in range(200):
        for p, m in zip(model.parameters(), master):
            grad = torch.randn(p.shape, generator=g).to(torch.bfloat16).cuda()
            p.grad, m.grad = grad, grad.float()
        opt.step()
        ref.step()
        for w, m in zip(opt.master_weights(), master):
            assert torch.equal(w, m.detach()), step


@on_cuda
@pytest.mark.parametrize("start", [1, 2, 3])
def test_extra_bits_step_from_an_element_offset_matches_cpu(start):
    # A DTensor shard's step starts inside a Philox block: each 128-element chunk then reads a
    # 33rd block (the kernel's phase path), and must draw as the CPU does.
    from lowfp import optim
    g = torch.Generator().manual_seed(start)
    cpu_params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (1000, 129, 5)]
    gpu_params = [torch.nn.Parameter(p.detach().cuda()) for p in cpu_params]
    kw = dict(lr=0.01, extra_bits=8, rounding="stochastic", weight_decay=0.01)
    cpu_opt = optim.ExtraBitsAdamW(cpu_params, **kw)
    gpu_opt = optim.ExtraBitsAdamW(gpu_params, **kw)
    for opt, params in ((cpu_opt, cpu_params), (gpu_opt, gpu_params)):
        for p in params:
            opt._philox_offset[id(p)] += start
    step_on_both(cpu_opt, gpu_opt, cpu_params, gpu_params, g, steps=2, seed=60)
