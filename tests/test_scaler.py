"""lowfp.DynamicLossScaler against torch.amp.GradScaler, with 16-bit parameters and lowfp's
optimizers."""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lowfp
from devices import on_cuda


def model_and_data(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
    x = torch.randn(32, 8, dtype=dtype)
    y = torch.randint(0, 4, (32,))
    return model, x, y


def test_defaults_match_grad_scaler():
    ours, theirs = lowfp.DynamicLossScaler(), torch.amp.GradScaler("cpu")
    assert ours.get_scale() == theirs.get_scale() == 2.0 ** 16
    assert ours.get_growth_factor() == theirs.get_growth_factor()
    assert ours.get_backoff_factor() == theirs.get_backoff_factor()
    assert ours.get_growth_interval() == theirs.get_growth_interval()
    assert set(ours.state_dict()) == set(theirs.state_dict())


def test_same_scales_and_steps_as_grad_scaler():
    model, x, y = model_and_data()
    twin = copy.deepcopy(model)
    kw = dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours, theirs = lowfp.DynamicLossScaler(**kw), torch.amp.GradScaler("cpu", **kw)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(twin.parameters(), lr=0.1)
    bad_steps = {2, 3, 9}
    for step in range(14):
        for m, opt, sc in ((model, opt_a, ours), (twin, opt_b, theirs)):
            loss = F.cross_entropy(m(x), y)
            if step in bad_steps:
                loss = loss * float("inf")
            opt.zero_grad()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
        assert ours.get_scale() == theirs.get_scale(), step
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q), step
    assert ours.state_dict() == {k: (float(v) if k == "scale" else v) for k, v in theirs.state_dict().items()}
    fresh = lowfp.DynamicLossScaler()
    fresh.load_state_dict(ours.state_dict())
    assert fresh.state_dict() == ours.state_dict()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sixteen_bit_parameters_with_torch_and_lowfp_optimizers(dtype):
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1),
                 lambda ps: lowfp.optim.ExtraBitsAdamW(ps, lr=3e-3, extra_bits=8)):
        model, x, y = model_and_data(dtype)
        opt = make(model.parameters())
        scaler = lowfp.DynamicLossScaler(init_scale=2.0 ** 8, growth_interval=4)
        losses = []
        for step in range(20):
            loss = F.cross_entropy(model(x).float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            before = [p.detach().clone() for p in model.parameters()]
            if step == 5:  # an overflowing gradient: the step is skipped and the scale backs off
                next(model.parameters()).grad[0, 0] = float("inf")
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if step == 5:
                assert scaler.get_scale() == scale / 2
                assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            losses.append(loss.item())
        assert all(p.dtype == dtype for p in model.parameters())
        assert losses[-1] < losses[0]


def test_step_in_backward_reports_non_finite_gradients():
    model, x, y = model_and_data(torch.bfloat16)
    opt = lowfp.optim.ExtraBitsSGD(model.parameters(), lr=0.1, extra_bits=8)
    scaler = lowfp.DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=1)
    handle = lowfp.optim.step_in_backward(opt, scaler=scaler)
    loss = F.cross_entropy(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 11  # clean pass: grows (interval 1)
    loss = F.cross_entropy(model(x).float(), y) * float("inf")
    scaler.scale(loss).backward()
    assert handle.found_inf
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 10
    handle.remove()


def test_disabled_and_errors():
    off = lowfp.DynamicLossScaler(enabled=False)
    t = torch.ones(())
    assert off.scale(t) is t and off.get_scale() == 1.0 and off.state_dict() == {}
    with pytest.raises(ValueError, match="init_scale"):
        lowfp.DynamicLossScaler(init_scale=0)
    with pytest.raises(ValueError, match="backoff_factor"):
        lowfp.DynamicLossScaler(backoff_factor=2.0)
    with pytest.raises(ValueError, match="growth_interval"):
        lowfp.DynamicLossScaler(growth_interval=0)
    with pytest.raises(ValueError, match="growth_factor"):
        lowfp.DynamicLossScaler().set_growth_factor(0.5)
    with pytest.raises(ValueError, match="backoff_factor"):
        lowfp.DynamicLossScaler().set_backoff_factor(0)
    with pytest.raises(ValueError, match="growth_interval"):
        lowfp.DynamicLossScaler().set_growth_interval(-1)
    with pytest.raises(TypeError, match="emulator"):
        lowfp.DynamicLossScaler(emulator=object())
    model, x, y = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sc = lowfp.DynamicLossScaler()
    sc.scale(F.cross_entropy(model(x), y)).backward()
    sc.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        sc.unscale_(opt)
    sc.step(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        sc.step(opt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_any_non_finite_agrees_with_isfinite(dtype):
    from lowfp._non_finite import non_finite_by_torch
    from lowfp.scaler import any_non_finite
    big = torch.finfo(dtype).max
    cases = [torch.zeros(0, dtype=dtype), torch.tensor(1.5, dtype=dtype),
             torch.full((1000,), big, dtype=dtype), -torch.full((7, 3), big, dtype=dtype),
             torch.randn(64, 48).to(dtype)[:, ::3],  # non-contiguous
             torch.randn(2, 3, 5, 7).to(dtype).to(memory_format=torch.channels_last),
             torch.tensor([big, -big], dtype=dtype),  # max - min overflows, yet all finite
             torch.tensor([-math.inf, math.inf], dtype=dtype)]
    for special in (float("nan"), float("inf"), -float("inf")):
        for where in (0, 517, 4095):
            t = torch.randn(4096).to(dtype)
            t[where] = special
            cases.append(t)
        cases.append(torch.tensor(special, dtype=dtype))
        # Dense but not row-major (read as a flat buffer): channels_last, with the special at
        # the last logical element, which is not the last in memory; a transposed one.
        t = torch.randn(2, 3, 5, 7).to(dtype).to(memory_format=torch.channels_last)
        t[1, 2, 4, 6] = special
        cases += [t, torch.randn(50, 40).to(dtype).t()]
        cases[-1][39, 0] = special
        # Not dense: a view beside the special, which must not be read (nor broadcast strides)
        base = torch.randn(40, 64).to(dtype)
        base[:, 60:] = special
        cases += [base[:, :60].t(), torch.randn(1, 5).to(dtype).expand(3, 5)]
        # Long enough for several threads: the first element, the middle, the last.
        for where in (0, 100_001, 200_002):
            t = torch.randn(200_003).to(dtype)
            t[where] = special
            cases.append(t)
    # NaNs of every sign and payload (a signalling one among them), and the smallest subnormal.
    bits, itype = {torch.float16: (0xFE01, torch.int16), torch.bfloat16: (0xFFC1, torch.int16),
                   torch.float32: (0xFF800001, torch.int32),
                   torch.float64: (0xFFF0000000000001, torch.int64)}[dtype]
    width = torch.finfo(dtype).bits
    for payload in (bits, bits & ~(1 << (width - 1))):
        raw = torch.tensor([payload - (1 << width) if payload >= 1 << (width - 1) else payload],
                           dtype=itype)
        cases.append(torch.cat([torch.ones(5, dtype=dtype), raw.view(dtype)]))
    cases.append(torch.full((9,), torch.finfo(dtype).smallest_normal, dtype=dtype) / 4)
    counts, expected = torch.tensor([5, 0, -2]), torch.tensor([5, 0, -2])
    for t in cases:
        found = any_non_finite(t)
        assert found.dtype == torch.bool and found.shape == ()
        assert bool(found) == (not bool(torch.isfinite(t).all())), t
        by_torch = non_finite_by_torch(t)  # the path of other devices
        assert by_torch.dtype == torch.bool and by_torch.shape == () and bool(by_torch) == bool(found)
        assert bool(any_non_finite(t, count_into=counts)) == bool(found)
        expected += int(found)
        assert torch.equal(counts, expected)
        # out= receives the answer (over a stale opposite value) and is what is returned; one
        # element of a larger buffer, as the hooks of step inside backward pass it.
        flags = torch.tensor([not bool(found)] * 3)
        assert any_non_finite(t, counts, out=flags[1]) is not None
        assert flags.tolist() == [not bool(found), bool(found), not bool(found)]
        expected += int(found)
        assert torch.equal(counts, expected)
        one = torch.tensor([not bool(found)])
        version = one._version, counts._version
        assert any_non_finite(t, count_into=counts, out=one) is one and bool(one) == bool(found)
        expected += int(found)
        # Written in place, as torch's out= ops do: autograd sees the new versions.
        assert one._version > version[0] and counts._version > version[1]
    for bad in (torch.zeros(2), torch.zeros(4, dtype=torch.int64)[::2], [0],
                torch.zeros(2, dtype=torch.int64, device="meta")):
        with pytest.raises(ValueError, match="count_into must be a contiguous int64 tensor"):
            any_non_finite(cases[1], count_into=bad)
    for bad in (torch.zeros(2, dtype=torch.bool), torch.zeros((), dtype=torch.int64), [False],
                torch.zeros((), dtype=torch.bool, device="meta")):
        with pytest.raises(ValueError, match="out must be a one-element bool tensor on cpu"):
            any_non_finite(cases[1], out=bad)
    with pytest.raises(TypeError, match="t must be a torch.Tensor, got list"):
        any_non_finite([1.0, float("nan")])
    with pytest.raises(TypeError, match="t must be a dense"):
        any_non_finite(torch.ones(3).to_sparse())


def test_any_non_finite_of_integer_bool_and_complex_tensors():
    from lowfp.scaler import any_non_finite
    for t in (torch.tensor([True, False]), torch.tensor([3, -7]), torch.zeros(0, dtype=torch.int32)):
        assert not bool(any_non_finite(t))
        out = torch.tensor([True])  # a stale value the answer must replace
        assert any_non_finite(t, out=out) is out and not bool(out)
    for z, expected in ((complex(1, 2), False), (complex(1, math.inf), True),
                        (complex(math.nan, 0), True), (complex(-math.inf, 1), True)):
        t = torch.tensor([complex(0.5, -0.5), z], dtype=torch.complex64)
        assert bool(any_non_finite(t)) == expected == (not bool(torch.isfinite(t).all()))
        out = torch.tensor(not expected)
        assert any_non_finite(t, out=out) is out and bool(out) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_both_unscale_paths_equal_a_multiply_then_isfinite(dtype):
    """DynamicLossScaler unscales with lowfp's check per gradient on the CPU and with torch's
    multi-tensor multiply and infinity norm elsewhere (one launch for many gradients on a
    GPU). Both, run here on the CPU, equal g * inv in g's dtype and isfinite after it: NaN,
    +-inf, a finite value that the unscale takes to infinity (inv > 1), empty and strided
    gradients, one bad element in many tensors."""
    from lowfp.scaler import _unscale_multi_tensor, _unscale_one_by_one
    gen = torch.Generator().manual_seed(5)
    big = torch.finfo(dtype).max
    for case in range(40):
        sizes = [int(s) for s in torch.randint(0, 300, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen)]
        grads = [torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) * 100 for n in sizes]
        grads.append(torch.randn(6, 4, generator=gen).to(dtype).t())  # strided
        bad = case % 5
        if bad and sizes[0] > 0:
            grads[0][int(torch.randint(0, sizes[0], (1,), generator=gen))] = (
                float("nan"), float("inf"), -float("inf"), big)[bad - 1]
        inv = 2.0 if bad == 4 else 2.0 ** -int(torch.randint(0, 20, (1,), generator=gen))
        expect = [g.double() * inv for g in grads]  # exact in float64, then rounded to dtype
        expect = [e.to(dtype) for e in expect]
        expect_found = not all(bool(torch.isfinite(e).all()) for e in expect)
        for path in (_unscale_one_by_one, _unscale_multi_tensor):
            gs = [g.clone() for g in grads]
            found = path(gs, inv)
            assert found.dtype is torch.bool and found.shape == ()
            assert bool(found) == expect_found, (case, path.__name__)
            for g, e in zip(gs, expect):
                assert torch.equal(g, e) or torch.allclose(g, e, equal_nan=True, rtol=0, atol=0)
        assert expect_found == (bad != 0 and sizes[0] > 0)


def test_multi_tensor_unscale_of_several_dtypes_and_empty_gradients():
    """One flag for gradients of several dtypes (checked in a multi-tensor call each), found in
    any of them; only empty gradients: finite."""
    from lowfp.scaler import _unscale_multi_tensor
    for bad_dtype in (None, torch.float32, torch.bfloat16, torch.float16):
        grads = [torch.full((7,), 3.0, dtype=d) for d in (torch.float32, torch.bfloat16, torch.float16)]
        grads.append(torch.empty(0))
        for g in grads:
            if g.dtype is bad_dtype and g.numel():
                g[2] = float("nan")
        found = _unscale_multi_tensor(grads, 0.5)
        assert bool(found) == (bad_dtype is not None)
        assert all(float(g[0]) == 1.5 for g in grads if g.numel())
    assert not bool(_unscale_multi_tensor([torch.empty(0), torch.empty(0, 3)], 0.5))


# On a GPU (tests/devices.py): the CPU's bits, counts and steps.

@on_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dynamic_loss_scaler_steps_extra_bits_on_gpu_as_on_cpu(dtype):
    """lowfp.DynamicLossScaler takes bfloat16 gradients on a GPU (where torch's GradScaler does
    not): the same steps and skips as on the CPU (which checks each gradient with lowfp's
    kernel, the GPU with multi-tensor calls)."""
    from lowfp import optim
    torch.manual_seed(0)
    w = torch.randn(300, 7)
    runs = []
    for device in ("cpu", "cuda"):
        p = torch.nn.Parameter(w.to(device))
        opt = optim.ExtraBitsSGD([p], lr=0.05, momentum=0.9, extra_bits=8, param_dtype=dtype)
        scaler = lowfp.DynamicLossScaler(device, init_scale=2.0 ** 10, growth_interval=2)
        torch.manual_seed(1)
        for step in range(6):
            opt.zero_grad()
            g = torch.randn(300, 7)
            if step in (1, 4):
                g[3, 2] = float("nan")
            p.grad = (g * scaler.get_scale()).to(device=device, dtype=dtype)
            scaler.step(opt)
            scaler.update()
        runs.append((scaler.get_scale(), opt.master_weights()[0].cpu()))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1])


@on_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_multi_tensor_unscale_on_gpu_finds_each_non_finite_value_without_waiting(dtype):
    """DynamicLossScaler's GPU unscale (multi-tensor multiply and infinity norm): the CPU's
    gradients and flag for NaN, +-inf or an overflow by the unscale at any place of any of many
    gradients (some past the first multi-tensor chunk), and unscale_ does not wait."""
    from lowfp.scaler import _unscale_multi_tensor, _unscale_one_by_one
    gen = torch.Generator().manual_seed(3)
    sizes = [0, 1, 5, 70000, 33, 2 ** 20 + 3] + [17] * 200
    for case in range(12):
        grads = [(torch.randn(n, generator=gen) * 50).to(dtype) for n in sizes]
        inv = 0.25
        if case:
            i = int(torch.randint(1, len(sizes), (1,), generator=gen))
            j = int(torch.randint(0, sizes[i], (1,), generator=gen))
            bad = (float("nan"), float("inf"), -float("inf"), torch.finfo(dtype).max)[case % 4]
            grads[i][j] = bad
            if case % 4 == 3:
                inv = 4.0  # the finite largest value overflows once unscaled
        gpu = [g.cuda() for g in grads]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            found_gpu = _unscale_multi_tensor(gpu, inv)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        found_cpu = _unscale_one_by_one(grads, inv)
        assert bool(found_gpu) == bool(found_cpu) == (case != 0), case
        for g, h in zip(grads, gpu):
            # (a GPU's NaN has no payload to keep: NaN equals NaN here, all else exactly)
            assert torch.allclose(g.double(), h.cpu().double(), rtol=0, atol=0, equal_nan=True)


@on_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_any_non_finite_on_gpu(dtype):
    """The GPU's paths against isfinite, with count_into and out= (one element of a larger
    buffer, as step inside backward passes it): lowfp's one-launch kernel for dense tensors
    (its last block resets its scratch: found and clean calls alternate here; a transposed
    tensor; one past a grid's worth of threads), torch's aminmax path for a strided one.
    Neither waits for the device."""
    from lowfp.scaler import any_non_finite
    big = torch.finfo(dtype).max
    cases = [torch.zeros(0, dtype=dtype), torch.tensor([big, -big], dtype=dtype),
             torch.randn(64, 48).to(dtype)[:, ::3], torch.randn(48, 64).to(dtype).t()]
    for special in (float("nan"), float("inf"), -float("inf")):
        for where in (0, 100_001, 200_002):
            t = torch.randn(200_003).to(dtype)
            t[where] = special
            cases.append(t)
            cases.append(torch.randn(3, 5).to(dtype))
        t = torch.randn(96, 64).to(dtype)
        t[95, 0] = special
        cases.append(t.t())  # dense, transposed: its last element in memory
        t = torch.randn(3_000_017).to(dtype)
        t[-1] = special
        cases.append(t)
    counts = torch.zeros(2, dtype=torch.int64, device="cuda")
    flags = torch.zeros(3, dtype=torch.bool, device="cuda")
    expected = 0
    for t in cases:
        want = not bool(torch.isfinite(t).all())
        g = t.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            found = any_non_finite(g, counts, out=flags[1])
            alone = any_non_finite(g)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert found.device.type == "cuda" and bool(found) == want == bool(alone)
        assert flags.tolist() == [False, want, False]
        expected += int(want)
        assert counts.tolist() == [expected, expected]
        flags.zero_()
    with pytest.raises(ValueError, match="out must be a one-element bool tensor on cuda"):
        any_non_finite(cases[1].cuda(), out=torch.zeros((), dtype=torch.bool))
