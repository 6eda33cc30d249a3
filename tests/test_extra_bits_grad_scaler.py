"""torch.amp.GradScaler with the ExtraBits optimizers: the scale handed to the step, float16
gradients unscaled in float32, refusals; and the extra-bits demo end to end."""

import numpy as np
import pytest
import torch
import lowfp.extra_bits as eb
from lowfp.optim import ExtraBitsAdamW, ExtraBitsSGD
from extra_bits_reference import F32, random_float32, RefAdam, small_model
from devices import on_cuda


def amp_twin(opt_cls, fused):
    """opt_cls with GradScaler's path chosen. Unfused: torch.amp.GradScaler unscales the
    gradients itself (GradScaler.unscale_) and skips a step with a non-finite one on the host,
    as for torch.optim's unfused optimizers. Fused (the optimizers' own choice): GradScaler sets
    grad_scale / found_inf and the step unscales and skips."""
    return type(("F" if fused else "Unf") + "used" + opt_cls.__name__, (opt_cls,),
                {"_step_supports_amp_scaling": fused})


def grad_scaler_steps(models_and_opts, scalers, steps, bad_steps, dtype, unscale_first=False):
    """Trains each (model, optimizer) with its scaler on the same batches; at bad_steps the last
    layer's bias gradient is made infinite. Asserts the master weights, optimizer state and
    scales stay equal across the pairs, and that GradScaler's attributes are gone after a step."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
    for step in range(steps):
        for (model, opt), scaler in zip(models_and_opts, scalers):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
            scaler.scale(loss).backward()
            if step in bad_steps:
                model[4].bias.grad[1] = float("inf")
            if unscale_first:  # unscaled once, then clipped, as in torch's AMP recipe
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            torch.manual_seed(step)  # the same stochastic rounding seed for every optimizer
            scaler.step(opt)
            scaler.update()
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        (a, opt_a), sa = models_and_opts[0], scalers[0]
        for (b, opt_b), sb in zip(models_and_opts[1:], scalers[1:]):
            assert sa.get_scale() == sb.get_scale(), step
            for wa, wb in zip(opt_a.master_weights(), opt_b.master_weights()):
                assert torch.equal(wa, wb), step
            for pa, pb in zip(a.parameters(), b.parameters()):
                st_a, st_b = opt_a.state[pa], opt_b.state[pb]
                assert ("momentum_buffer" in st_a) == ("momentum_buffer" in st_b), step
                # A skipped first step leaves Adam's state at step 0 with zero moments (as
                # torch's fused Adam does); an unfused step is never called and leaves none.
                assert float(st_a.get("step", 0)) == float(st_b.get("step", 0)), step
    return scalers[0]


@pytest.mark.parametrize("opt_cls,kw", [
    (ExtraBitsSGD, dict(lr=0.1, momentum=0.9, extra_bits=8, rounding="stochastic")),
    (ExtraBitsAdamW, dict(lr=1e-2, extra_bits=16, amsgrad=True)),
])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_torch_grad_scaler_hands_the_scale_to_the_step(opt_cls, kw, unscale_first):
    # bfloat16, which GradScaler can also unscale itself: the fused path (GradScaler sets
    # grad_scale / found_inf and the step unscales and skips) skips, takes back and scales as
    # its unfused path, the one taken on the CPU, does; with power-of-two scales, bfloat16
    # gradients unscaled in bfloat16 (unfused) or in float32 (fused) are the same numbers. A
    # bad first step checks that SGD's first momentum buffer and Adam's count are taken back.
    assert not opt_cls([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))])._step_supports_amp_scaling
    pairs = []
    for cls in (amp_twin(opt_cls, fused=True), amp_twin(opt_cls, fused=False)):
        model = small_model()
        torch.manual_seed(0)  # the same stochastic split of the float32 parameters
        pairs.append((model, cls(model.parameters(), **kw)))
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2) for _ in pairs]
    scaler = grad_scaler_steps(pairs, scalers, steps=7, bad_steps={0, 3, 4}, dtype=torch.bfloat16,
                               unscale_first=unscale_first)
    assert scaler.get_scale() == 2.0 ** 10 / 8 * 4  # three back-offs, two growths


def test_torch_grad_scaler_with_float16_parameters_unscales_in_float32():
    """float16 + 13 through GradScaler (which refuses to unscale float16 gradients itself): the
    step divides each float16 gradient by the scale in float32, as torch's fused optimizers do,
    so its master is, bit for bit, an fp32 master stepped with those quotients (the weights
    stay in float16's normal range). That includes the quotients below float16's normal range,
    which unscaling in float16 would round or flush to zero (checked to happen here). After the
    step p.grad holds the quotient rounded to float16, as torch's fused kernels leave it."""
    model = small_model()
    ref = RefAdam([p.detach().numpy().copy() for p in model.parameters()], lr=1e-3,
                  decoupled=True, weight_decay=1e-2)
    opt = ExtraBitsAdamW(model.parameters(), lr=1e-3, weight_decay=1e-2, extra_bits=13,
                         param_dtype=torch.float16, rounding="nearest")
    assert opt._step_supports_amp_scaling  # a float16 parameter: the fused path
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=10 ** 6)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g)
    lost_in_float16 = 0
    for step in range(60):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x.half()).float(), y)).backward()
        scaled = [p.grad.float().numpy() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 2.0 ** 10  # no step skipped
        quotients = [q / F32(2.0 ** 10) for q in scaled]
        ref.step(quotients)
        for p, q, gs in zip(model.parameters(), quotients, scaled):
            assert torch.equal(p.grad, torch.from_numpy(q).half()), step
            in_float16 = (torch.from_numpy(gs).half() * torch.tensor(2.0 ** -10).half()).float()
            lost_in_float16 += int((in_float16 != torch.from_numpy(q)).sum())
        for got, want in zip(opt.master_weights(), ref.w):
            assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), step
    assert lost_in_float16 > 0
    with pytest.raises(ValueError, match="FP16"):  # torch's own unscale_ still refuses them
        scaler.unscale_(opt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_grad_scaler_unscales_every_gradient_pattern_in_float32(dtype):
    # Every finite 16-bit gradient pattern, subnormals included, unscaled by a scale that is not
    # a power of two (so the quotient rounds) through GradScaler's fused path (the CPU keeps
    # GradScaler's own path for bfloat16 parameters; a GPU takes this one): the update is that of
    # the float32 quotient g / 3 (SGD, lr 1, from 0: the new master is -(g / 3) split with 4
    # extra bits), and p.grad is left as that quotient rounded to the dtype. A float32 gradient
    # is divided in float32 before the step converts it (converting it scaled could overflow).
    patterns = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    g = patterns[torch.isfinite(patterns.float())]
    three = torch.tensor(3.0)
    for grad in (g, random_float32(g.numel(), seed=5, lo=-30, hi=14)):
        p = torch.nn.Parameter(torch.zeros(g.numel(), dtype=dtype))
        opt = amp_twin(ExtraBitsSGD, fused=True)([p], lr=1.0, extra_bits=4)
        scaler = torch.amp.GradScaler("cpu", init_scale=3.0)
        scaler.scale(torch.ones(()))
        p.grad_dtype = None  # torch 2.13: a gradient of another dtype needs this
        p.grad = grad.clone()
        scaler.step(opt)
        quotient = grad.float() / three
        if grad.dtype != dtype:
            quotient = quotient.to(dtype).float()  # the step converts the unscaled gradient
        want = eb.merge(*eb.split(-quotient, dtype, 4), 4)
        assert torch.equal(opt.master_weights()[0], want)
        assert torch.equal(p.grad, (grad.float() / three).to(grad.dtype))


def test_torch_grad_scaler_with_a_sparse_gradient_raises_before_changing_any():
    p, q = (torch.nn.Parameter(torch.ones(4, 2, dtype=torch.bfloat16)) for _ in range(2))
    opt = amp_twin(ExtraBitsSGD, fused=True)([p, q], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # makes its scale tensor, as scaling the loss does
    p.grad = torch.full((4, 2), 8.0, dtype=torch.bfloat16)
    q.grad = torch.ones(4, 2, dtype=torch.bfloat16).to_sparse()
    with pytest.raises(ValueError, match="dense gradients"):
        scaler.step(opt)
    assert torch.equal(p.grad, torch.full((4, 2), 8.0, dtype=torch.bfloat16))  # as it was
    assert torch.equal(p, torch.ones(4, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize("model", ["mlp", "resnet"])
def test_demo_runs(model):
    import subprocess
    import sys
    from pathlib import Path
    demo = Path(__file__).resolve().parents[1] / "examples" / "extra_bits_demo.py"
    out = subprocess.run([sys.executable, str(demo), "--data", "synthetic", "--epochs", "1",
                          "--model", model, "--train-examples", "320"],
                         capture_output=True, text=True, check=True).stdout
    assert "320 training" in out and "pure bfloat16" in out and "fp16 + 13" in out and out.count("\n") >= 8
    assert ("ResNet" in out) == (model == "resnet")


# On a GPU (tests/devices.py): the CPU's bits, counts and steps.

@on_cuda
@pytest.mark.parametrize("opt_name,kw", [
    ("ExtraBitsSGD", dict(lr=0.05, momentum=0.9, rounding="stochastic", extra_bits=13,
                          param_dtype=torch.float16)),
    ("ExtraBitsAdamW", dict(lr=1e-2, rounding="nearest", extra_bits=13, param_dtype=torch.float16)),
])
def test_torch_grad_scaler_on_gpu_equals_cpu(opt_name, kw):
    """torch.amp.GradScaler hands its scale and found_inf to the ExtraBits step (the fused
    path, float16 parameters included): on the GPU bit for bit what it is on the CPU, a
    non-finite gradient skipped in both. Once SGD's momentum exists (its first taken step
    settled), a whole scaler step and update never waits for the GPU (Adam waits at the next
    step for the step counts). bfloat16 parameters: see the test below."""
    import copy
    from lowfp import optim
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(33, 70), torch.nn.Tanh(), torch.nn.Linear(70, 3))
    gpu_model = copy.deepcopy(cpu_model).cuda()
    opts, scalers = [], []
    for model, device in ((cpu_model, "cpu"), (gpu_model, "cuda")):
        torch.manual_seed(1)
        opts.append(getattr(optim, opt_name)(model.parameters(), **kw))
        opts[-1]._cuda_association = True  # the CPU twin steps with torch's CUDA arithmetic
        scalers.append(torch.amp.GradScaler(device, init_scale=2.0 ** 12, growth_interval=2))
    dtype = kw.get("param_dtype", torch.bfloat16)
    x, y = torch.randn(64, 33).to(dtype), torch.randint(0, 3, (64,))
    for step in range(6):
        # The CPU's scaled gradients for both: a GPU's matmuls may sum in another order.
        opts[0].zero_grad()
        scalers[0].scale(torch.nn.functional.cross_entropy(cpu_model(x).float(), y)).backward()
        if step in (0, 3):
            cpu_model[2].bias.grad[0] = float("inf")
        for p, q in zip(cpu_model.parameters(), gpu_model.parameters()):
            q.grad = p.grad.cuda()
        scalers[1].scale(torch.ones((), device="cuda"))  # makes its scale, as scaling a loss does
        for model, opt, scaler in zip((cpu_model, gpu_model), opts, scalers):
            device = next(model.parameters()).device
            # SGD's first momentum step that was taken (step 1: step 0 is skipped) is
            # settled at step 2, which waits for its skip flag; after it nothing waits.
            never_waits = device.type == "cuda" and opt_name == "ExtraBitsSGD" and step >= 3
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if never_waits else "default")
            try:
                torch.manual_seed(step)
                scaler.step(opt)
                scaler.update()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert scalers[0].get_scale() == scalers[1].get_scale(), step
        for wc, wg in zip(opts[0].master_weights(), opts[1].master_weights()):
            assert torch.equal(wc, wg.cpu()), step
    sd_cpu, sd_gpu = opts[0].state_dict(), opts[1].state_dict()  # the GPU's skips settled
    for pc, pg in zip(sd_cpu["state"].values(), sd_gpu["state"].values()):
        assert set(pc) == set(pg) and float(pc.get("step", 0)) == float(pg.get("step", 0))


@on_cuda
def test_torch_grad_scaler_refuses_bfloat16_gradients_on_gpu_for_torch_optimizers_too():
    """torch's GradScaler checks gradients with _amp_foreach_non_finite_check_and_unscale_,
    which has no bfloat16 CUDA kernel: it refuses bfloat16 gradients for torch's fused AdamW
    as for the ExtraBits optimizers (README: use lowfp.DynamicLossScaler there). When torch
    adds the kernel this test fails, and the ExtraBits bfloat16 case belongs in the test above."""
    from lowfp import optim
    for make in (lambda ps: torch.optim.AdamW(ps, fused=True),
                 lambda ps: optim.ExtraBitsAdamW(ps, extra_bits=8)):
        p = torch.nn.Parameter(torch.randn(40, device="cuda", dtype=torch.bfloat16))
        opt = make([p])
        scaler = torch.amp.GradScaler("cuda")
        scaler.scale(p.float().sum()).backward()
        before = p.detach().clone()
        with pytest.raises(NotImplementedError, match="BFloat16"):
            scaler.step(opt)
        assert torch.equal(p.detach(), before)
