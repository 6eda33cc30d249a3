"""ExtraBits optimizers against torch.optim on an fp32 master, bit for bit (docs/design.md §5).

bfloat16 + 16 extra bits is exactly float32, and float16 + 13 extra bits is exactly float32 in
float16's normal range, so with the same gradients ExtraBitsSGD / Adam / AdamW must give the very
float32 weights torch.optim's SGD / Adam / AdamW give, step after step. Each case trains a small
model for real: the 16-bit model computes the gradients, which both optimizers receive (the
float32 master as ``g.float()``, exact). Every torch.optim option is covered.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lowfp.optim import ExtraBitsAdam, ExtraBitsAdamW, ExtraBitsSGD

STEPS = 200  # bit-for-bit from the first step on: more steps add CI time, not coverage

SGD_CASES = [
    dict(),
    dict(momentum=0.9),
    dict(momentum=0.9, dampening=0.1),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.8, weight_decay=1e-2),
    dict(momentum=0.9, nesterov=True, weight_decay=1e-2, maximize=True),
    dict(weight_decay=1e-2, maximize=True),
]
ADAM_CASES = [
    dict(),
    dict(weight_decay=1e-2),
    dict(amsgrad=True),
    dict(maximize=True, weight_decay=1e-2, amsgrad=True),
    dict(decoupled_weight_decay=True, weight_decay=1e-2),
    dict(betas=(0.5, 0.9), eps=1e-6),
]
ADAMW_CASES = [dict(), dict(amsgrad=True, weight_decay=0.1), dict(maximize=True, weight_decay=0.0)]

PAIRS = ([("SGD", ExtraBitsSGD, torch.optim.SGD, dict(lr=0.05, **c)) for c in SGD_CASES]
         + [("Adam", ExtraBitsAdam, torch.optim.Adam, dict(lr=1e-3, **c)) for c in ADAM_CASES]
         + [("AdamW", ExtraBitsAdamW, torch.optim.AdamW, dict(lr=1e-3, **c)) for c in ADAMW_CASES])


def model_and_data(seed, away_from_zero=False):
    """A two-layer MLP with widths that leave vector tails (37, 19), and a fixed task."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(24, 37), torch.nn.GELU(), torch.nn.Linear(37, 19),
                                torch.nn.Tanh(), torch.nn.Linear(19, 5))
    with torch.no_grad():
        for p in model.parameters():
            u = torch.rand(p.shape, generator=g) * 0.4 - 0.2
            if away_from_zero:  # |w| in [0.1, 0.3]: float16's normal range throughout
                u = u + 0.1 * torch.sign(u)
            p.copy_(u)
    x = torch.randn(64, 24, generator=g)
    y = torch.randint(0, 5, (64,), generator=g)
    return model, x, y


def run_pair(extra_cls, torch_cls, kwargs, param_dtype, k, rounding="toward_zero", steps=STEPS,
             away_from_zero=False):
    model, x, y = model_and_data(0, away_from_zero)
    master = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    ref = torch_cls(master, **kwargs)
    opt = extra_cls(model.parameters(), extra_bits=k, rounding=rounding, param_dtype=param_dtype,
                    **kwargs)
    for w, m in zip(opt.master_weights(), master):  # the conversion keeps every bit
        assert torch.equal(w, m.detach())
    xs = x.to(param_dtype)
    for step in range(steps):
        opt.zero_grad()
        batch = slice((step * 16) % 64, (step * 16) % 64 + 16)
        F.cross_entropy(model(xs[batch]).float(), y[batch]).backward()
        for p, m in zip(model.parameters(), master):
            m.grad = p.grad.float()
        opt.step()
        ref.step()
        if step % 100 == 99 or step == steps - 1:
            for i, (w, m) in enumerate(zip(opt.master_weights(), master)):
                if not torch.equal(w, m.detach()):
                    bad = (w != m.detach()).sum().item()
                    pytest.fail(f"step {step}: parameter {i} differs in {bad} of {w.numel()} "
                                f"elements")
    return opt, ref


@pytest.mark.parametrize("name,extra_cls,torch_cls,kwargs", PAIRS,
                         ids=[f"{n}-{i}" for i, (n, *_rest) in enumerate(PAIRS)])
def test_bfloat16_with_16_extra_bits_is_torch_optim_on_fp32(name, extra_cls, torch_cls, kwargs):
    opt, ref = run_pair(extra_cls, torch_cls, kwargs, torch.bfloat16, 16)
    for p, m in zip(opt.param_groups[0]["params"], ref.param_groups[0]["params"]):  # moments too
        for key, value in ref.state[m].items():
            assert torch.equal(opt.state[p][key], value), key


@pytest.mark.parametrize("name,extra_cls,torch_cls,kwargs",
                         [PAIRS[1], PAIRS[3], PAIRS[len(SGD_CASES)], PAIRS[len(SGD_CASES) + 2],
                          PAIRS[-2]],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_float16_with_13_extra_bits_in_the_normal_range(name, extra_cls, torch_cls, kwargs):
    kwargs = dict(kwargs, lr=kwargs["lr"] / 20)  # small steps: no weight nears zero
    opt, ref = run_pair(extra_cls, torch_cls, kwargs, torch.float16, 13, steps=300,
                        away_from_zero=True)
    for m in ref.param_groups[0]["params"]:
        assert m.detach().abs().min() >= 2.0**-14  # the premise held throughout


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_other_weight_roundings_keep_the_master_exact(rounding):
    """With a flag bit, merge undoes the 16-bit weights' rounding: still torch.optim's master."""
    run_pair(ExtraBitsAdamW, torch.optim.AdamW, dict(lr=1e-3, weight_decay=1e-2), torch.bfloat16,
             16, rounding=rounding, steps=200)


def test_square_roots_are_torchs():
    """torch's CPU float32 sqrt is its vector math library's (where it has one), not always
    correctly rounded; the Adam step takes its roots from the same routine, so that a
    denominator is torch's even where a correctly rounded root would differ."""
    from lowfp import _torch_sqrt
    g = torch.randn(65536, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    v = (0.5 * g.float()) * g.float()  # exp_avg_sq after one step with beta2 = 0.5
    if torch.equal(v.sqrt(), v.double().sqrt().float()):
        pytest.skip("this torch's sqrt is correctly rounded: nothing to follow")
    assert _torch_sqrt.use_torch_sqrt()
    p = torch.zeros(g.numel(), dtype=torch.bfloat16, requires_grad=True)
    opt = ExtraBitsAdam([p], lr=1.0, betas=(0.0, 0.5), eps=1e-30)
    p.grad = g
    opt.step()
    master = torch.zeros(g.numel(), requires_grad=True)
    ref = torch.optim.Adam([master], lr=1.0, betas=(0.0, 0.5), eps=1e-30)
    master.grad = g.float()
    ref.step()
    assert torch.equal(opt.master_weights()[0], master.detach())


@pytest.mark.parametrize("kwargs", [dict(momentum=0.9), dict(momentum=0.9, nesterov=True,
                                                             weight_decay=1e-2),
                                    dict(momentum=0.8, dampening=0.3, maximize=True)])
def test_bfloat16_momentum_is_torchs_bfloat16_buffer(kwargs):
    """torch.optim.SGD steps a float32 parameter with a bfloat16 momentum buffer (its in-place
    updates round the buffer to bfloat16); state_dtype=torch.bfloat16 does the same. torch's first
    buffer is a float32 clone of the gradient, converted here after the first step, as lowfp
    stores it. (torch's Adam refuses bfloat16 moments beside float32 parameters: lerp_ wants
    equal dtypes, so there is nothing to compare its bfloat16 moments with.)"""
    model, x, y = model_and_data(1)
    master = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    ref = torch.optim.SGD(master, lr=0.05, **kwargs)
    opt = ExtraBitsSGD(model.parameters(), lr=0.05, extra_bits=16, state_dtype=torch.bfloat16,
                       **kwargs)
    xs = x.to(torch.bfloat16)
    for step in range(300):
        opt.zero_grad()
        F.cross_entropy(model(xs[:16]).float(), y[:16]).backward()
        for p, m in zip(model.parameters(), master):
            m.grad = p.grad.float()
        opt.step()
        ref.step()
        if step == 0:
            for m in master:
                ref.state[m]["momentum_buffer"] = ref.state[m]["momentum_buffer"].bfloat16()
    for p, m, w in zip(model.parameters(), master, opt.master_weights()):
        assert torch.equal(w, m.detach())
        assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[m]["momentum_buffer"])


@pytest.mark.parametrize("cls,kwargs", [
    (ExtraBitsAdam, dict(lr=1e-3)),
    (ExtraBitsAdam, dict(lr=1e-3, weight_decay=1e-2, amsgrad=True, maximize=True)),
    (ExtraBitsAdamW, dict(lr=1e-3, weight_decay=1e-2)),
])
def test_torchs_cuda_association_on_the_cpu(cls, kwargs):
    """On CUDA torch.optim's default foreach kernels associate Adam's addcmul and addcdiv as
    self + value * (t1 op t2) with one fused multiply-add, and take correctly rounded square
    roots; the GPU step does the same. A CPU optimizer told to step as on CUDA
    (_cuda_association) equals a numpy reference of those formulas over 300 steps, so the
    formulas are checked here and a GPU run only adds the kernel (the cuda tests of
    tests/test_extra_bits_optimizers.py compare it with torch on the GPU); it differs from the CPU
    association."""
    from extra_bits_reference import RefAdam
    model, x, y = model_and_data(2)
    decoupled = cls is ExtraBitsAdamW
    ref = RefAdam([p.detach().numpy().copy() for p in model.parameters()], cuda=True,
                  decoupled=decoupled, **dict(dict(weight_decay=1e-2) if decoupled else {}, **kwargs))
    twins = [p.detach().clone().requires_grad_(True) for p in model.parameters()]  # float32 yet
    opt = cls(model.parameters(), extra_bits=16, **kwargs)
    opt._cuda_association = True
    cpu_style = cls(twins, extra_bits=16, **kwargs)
    for a, b in zip(opt.master_weights(), cpu_style.master_weights()):
        assert torch.equal(a, b)
    xs = x.to(torch.bfloat16)
    differed = False
    for step in range(300):
        opt.zero_grad()
        F.cross_entropy(model(xs[:16]).float(), y[:16]).backward()
        grads = [p.grad for p in model.parameters()]
        ref.step([g.float().numpy() for g in grads])
        for q, g in zip(cpu_style.param_groups[0]["params"], grads):
            q.grad = g.clone()
        opt.step()
        cpu_style.step()
        for got, want in zip(opt.master_weights(), ref.w):
            assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), step
        differed |= any(not torch.equal(a, b) for a, b in
                        zip(opt.master_weights(), cpu_style.master_weights()))
    assert differed  # the two associations are not the same arithmetic
