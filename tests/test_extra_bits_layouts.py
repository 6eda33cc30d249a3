"""ExtraBits optimizers over parameters laid out in memory other than row-major (channels_last,
transposed): the step walks memory order, and layouts changed later are matched exactly."""

import copy
import numpy as np
import pytest
import torch
import lowfp
import lowfp.extra_bits as eb
from lowfp.optim import ExtraBitsAdam, ExtraBitsAdamW, ExtraBitsSGD
from extra_bits_reference import pack_reference, small_model
from devices import on_cuda, step_on_both


def bf16_param(n):
    p = torch.nn.Parameter(torch.randn(n).bfloat16())
    p.grad = torch.randn(n).bfloat16()
    return p


def laid_out_params(seed=0):
    """bfloat16 parameters in three layouts: a channels_last convolution weight, a transposed
    weight (strides (1, 4)) and a contiguous bias."""
    torch.manual_seed(seed)
    conv = torch.randn(8, 3, 3, 3).bfloat16().to(memory_format=torch.channels_last)
    return [torch.nn.Parameter(conv), torch.nn.Parameter(torch.randn(6, 4).bfloat16().t()),
            torch.nn.Parameter(torch.randn(5).bfloat16())]


def in_memory_order(t, order):
    """A contiguous copy of t's elements in memory order (order: lowfp's memory order)."""
    return (t if order is None else t.permute(order)).clone(memory_format=torch.contiguous_format)


def test_memory_order_of_dense_layouts():
    cl = torch.empty(8, 3, 3, 3).to(memory_format=torch.channels_last)
    assert lowfp.backends.memory_order(cl) == (0, 2, 3, 1) and cl.permute(0, 2, 3, 1).is_contiguous()
    assert lowfp.backends.memory_order(torch.empty(6, 4).t()) == (1, 0)
    assert lowfp.backends.memory_order(torch.empty(5)) is None
    # a size-1 dim goes last, whatever its stride
    assert lowfp.backends.memory_order(torch.empty(4, 1, 6).permute(2, 1, 0)) == (2, 0, 1)
    for bad in (torch.empty(6, 4)[:, ::2], torch.empty(10)[::3], torch.empty(1, 3).expand(4, 3)):
        with pytest.raises(ValueError, match="dense in memory"):
            lowfp.backends.memory_order(bad)
    for order in [(0, 1, 2), (2, 0, 1), (1, 2, 0)]:
        assert lowfp.backends.inverse_order(order) == tuple(int(i) for i in np.argsort(order))


@pytest.mark.parametrize("rounding", eb.EXTRA_BITS_ROUNDING)
def test_reorder_packed_moves_each_elements_bits(rounding):
    """Against pack_reference: arbitrary q-bit values packed in one memory order of a (3, 5, 7, 2)
    tensor (210 elements, a partial last block), repacked in another, equal those values packed
    in the new order; and back."""
    shape = (3, 5, 7, 2)
    orders = [None, (0, 2, 3, 1), (3, 1, 0, 2)]
    for k in range(1, 17):
        q = eb.bits_per_element(k, rounding)
        logical = torch.randint(0, 2 ** q, shape, generator=torch.Generator().manual_seed(k))
        for old in orders:
            packed = torch.tensor(pack_reference(in_memory_order(logical, old).reshape(-1).tolist(), q),
                                  dtype=torch.int32)
            for new in orders:
                want = pack_reference(in_memory_order(logical, new).reshape(-1).tolist(), q)
                moved = eb.reorder_packed(packed, shape, k, rounding, old, new)
                assert moved.tolist() == want, (k, old, new)
                assert torch.equal(eb.reorder_packed(moved, shape, k, rounding, new, old), packed)


def test_reorder_packed_errors():
    packed = torch.zeros(eb.packed_words(30, 8, "nearest"), dtype=torch.int32)
    for args, error, match in [
            ((packed[:-1], (5, 6), 8, "nearest", None, (1, 0)), ValueError, "packed has 8 words but 30"),
            ((packed.long(), (5, 6), 8, "nearest", None, (1, 0)), TypeError, "int32"),
            ((packed, (5, 6), 17, "nearest", None, (1, 0)), ValueError, "k must be an int between 1 and 16"),
            ((packed, (5, 6), 8, "up", None, (1, 0)), ValueError, "rounding must be one of"),
            ((packed, (5, 6), 8, "nearest", (0, 0), None), ValueError, "old must be an order of the 2 dims"),
            ((packed, (5, 6), 8, "nearest", None, (1, 0, 2)), ValueError, "new must be an order")]:
        with pytest.raises(error, match=match):
            eb.reorder_packed(*args)


@pytest.mark.parametrize("opt_cls,kw", [
    (ExtraBitsSGD, dict(lr=0.1, momentum=0.9, extra_bits=8, rounding="stochastic")),
    (ExtraBitsAdamW, dict(lr=1e-2, extra_bits=16, rounding="nearest", amsgrad=True)),
    (ExtraBitsAdam, dict(lr=1e-2, extra_bits=5, rounding="toward_zero", state_dtype=torch.bfloat16))])
def test_parameters_in_any_dense_layout_step_in_memory_order(opt_cls, kw):
    """A channels_last or transposed parameter steps element by element in memory order: exactly
    as contiguous twins holding its elements in that order, with the same gradients (stochastic
    rounding included: Philox words follow the position in memory). Its moments take its layout,
    and master_weights() returns its elements where they belong."""
    params = laid_out_params()
    orders = [lowfp.backends.memory_order(p) for p in params]
    assert orders == [(0, 2, 3, 1), (1, 0), None]
    twins = [torch.nn.Parameter(in_memory_order(p.detach(), o)) for p, o in zip(params, orders)]
    opt, opt_twin = opt_cls(params, **kw), opt_cls(twins, **kw)
    for step in range(4):
        for p, t, o in zip(params, twins, orders):
            g = torch.randn(p.shape).bfloat16()  # contiguous: copied into p's layout by the step
            p.grad = torch.empty_like(p).copy_(g) if step % 2 else g
            t.grad = in_memory_order(g, o)
        torch.manual_seed(step)
        opt.step()
        torch.manual_seed(step)
        opt_twin.step()
        for p, t, o, w, wt in zip(params, twins, orders, opt.master_weights(), opt_twin.master_weights()):
            assert p.stride() == torch.empty_like(p).stride() and lowfp.backends.memory_order(p) == o  # kept
            assert torch.equal(in_memory_order(p.detach(), o).view(torch.int16), t.detach().view(torch.int16))
            assert torch.equal(in_memory_order(w, o), wt)
            state, state_twin = opt.state[p], opt_twin.state[t]
            assert torch.equal(state["extra"], state_twin["extra"])
            assert state.get("extra_dim_order") == o and "extra_dim_order" not in state_twin
            for key in ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in state:
                    assert lowfp.backends.memory_order(state[key]) == o, key
                    assert torch.equal(in_memory_order(state[key], o), state_twin[key]), key


def test_float32_channels_last_model_keeps_its_layout_and_every_bit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    model = model.to(memory_format=torch.channels_last)
    w32 = [p.detach().clone() for p in model.parameters()]
    opt = ExtraBitsSGD(model.parameters(), lr=0.1, extra_bits=16)
    for p, w in zip(model.parameters(), w32):
        assert p.dtype == torch.bfloat16 and p.stride() == w.stride()
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), w32))  # nothing lost
    assert opt.state[model[0].weight]["extra_dim_order"] == (0, 2, 3, 1)
    x = torch.randn(2, 3, 10, 10).bfloat16().to(memory_format=torch.channels_last)
    model(x).sum().backward()
    opt.step()  # the gradients autograd gives are channels_last too
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    with torch.no_grad():
        for p, w in zip(ref.parameters(), w32):
            p.copy_(w)
    ref_opt = ExtraBitsSGD(ref.parameters(), lr=0.1, extra_bits=16)  # contiguous
    for p, q in zip(ref.parameters(), model.parameters()):
        p.grad = q.grad.contiguous()  # (a contiguous convolution may sum in another order)
    ref_opt.step()
    for a, b in zip(opt.master_weights(), ref_opt.master_weights()):
        assert torch.equal(a, b)  # toward_zero: the same numbers in any layout


@pytest.mark.parametrize("rounding", eb.EXTRA_BITS_ROUNDING)
def test_a_layout_change_moves_the_extra_bits_and_moments(rounding):
    """model.to(memory_format=torch.channels_last) after the optimizer was made, as Module.to
    does it (param.data replaced): nothing is lost, and the next steps go on as those of a model
    that stayed contiguous (deterministic rounding; stochastic words follow memory positions).
    Then back, by loading the state into a contiguous model's optimizer."""
    torch.manual_seed(0)
    kw = dict(lr=1e-2, extra_bits=7, rounding=rounding)
    conv = torch.nn.Conv2d(4, 6, 3).bfloat16()
    twin = copy.deepcopy(conv)
    opt, opt_twin = ExtraBitsAdam(conv.parameters(), **kw), ExtraBitsAdam(twin.parameters(), **kw)
    x = torch.randn(2, 4, 7, 7).bfloat16()

    def step(model, optimizer, memory_format, seed):
        optimizer.zero_grad()
        model(x.to(memory_format=memory_format)).square().sum().backward()
        torch.manual_seed(seed)
        optimizer.step()

    for i in range(2):
        step(conv, opt, torch.contiguous_format, i)
        step(twin, opt_twin, torch.contiguous_format, i)
    conv.to(memory_format=torch.channels_last)
    assert lowfp.backends.memory_order(conv.weight) == (0, 2, 3, 1)
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt_twin.master_weights()))
    opt.load_state_dict(opt.state_dict())  # moves the state to the new layout
    state = opt.state[conv.weight]
    assert state["extra_dim_order"] == (0, 2, 3, 1) and lowfp.backends.memory_order(state["exp_avg"]) == (0, 2, 3, 1)
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt_twin.master_weights()))
    assert torch.equal(conv.weight, twin.weight)
    if rounding != "stochastic":
        for i in range(2, 4):
            step(conv, opt, torch.channels_last, i)
            step(twin, opt_twin, torch.contiguous_format, i)
            assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt_twin.master_weights()))
    else:
        step(conv, opt, torch.channels_last, 2)  # moved at the step, without load_state_dict
    # and back: a contiguous model's optimizer loads the channels_last state
    back = copy.deepcopy(twin)
    with torch.no_grad():
        for p, q in zip(back.parameters(), conv.parameters()):
            p.copy_(q)
    opt_back = ExtraBitsAdam(back.parameters(), **kw)
    saved = opt.state_dict()
    assert saved["state"][0]["extra_dim_order"] == (0, 2, 3, 1)
    opt_back.load_state_dict(saved)
    assert "extra_dim_order" not in opt_back.state[back.weight]
    assert opt_back.state[back.weight]["exp_avg"].is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt_back.master_weights()))
    assert saved["state"][0]["extra_dim_order"] == (0, 2, 3, 1)  # the caller's dict unchanged


def test_a_layout_change_moves_the_state_at_the_step():
    """Without load_state_dict: the step finds the new layout and moves the state first."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 6, 3).bfloat16()
    twin = copy.deepcopy(conv)
    kw = dict(lr=0.1, momentum=0.9, extra_bits=9, rounding="nearest")
    opt, opt_twin = ExtraBitsSGD(conv.parameters(), **kw), ExtraBitsSGD(twin.parameters(), **kw)
    for i in range(3):
        if i == 1:
            conv.to(memory_format=torch.channels_last)
        for p, q in zip(conv.parameters(), twin.parameters()):
            g = torch.randn(p.shape).bfloat16()
            p.grad, q.grad = torch.empty_like(p).copy_(g), g
        opt.step()
        opt_twin.step()
        assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt_twin.master_weights()))
    assert lowfp.backends.memory_order(opt.state[conv.weight]["momentum_buffer"]) == (0, 2, 3, 1)


def test_a_recorded_layout_that_does_not_fit_is_refused():
    p = laid_out_params()[0]
    opt = ExtraBitsSGD([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    saved["state"][0]["extra_dim_order"] = (0, 2, 3)
    with pytest.raises(ValueError, match="dim order \\(0, 2, 3\\), which is not an order of its dims"):
        ExtraBitsSGD([torch.nn.Parameter(p.detach().clone())], lr=0.1).load_state_dict(saved)


def test_step_in_backward_of_a_channels_last_model_equals_a_normal_step():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.GELU(), torch.nn.Conv2d(8, 4, 3))
    a = a.to(memory_format=torch.channels_last)
    b = copy.deepcopy(a)
    kw = dict(lr=1e-2, extra_bits=8, rounding="stochastic")
    torch.manual_seed(1)  # the same stochastic split of the float32 parameters
    opt_a = ExtraBitsAdamW(a.parameters(), **kw)
    torch.manual_seed(1)
    opt_b = ExtraBitsAdamW(b.parameters(), **kw)
    handle = lowfp.optim.step_in_backward(opt_b, clip_value=0.5)
    x = torch.randn(2, 3, 9, 9).bfloat16().to(memory_format=torch.channels_last)
    for step in range(3):
        opt_a.zero_grad()
        a(x).square().mean().backward()
        for p in a.parameters():
            p.grad.clamp_(-0.5, 0.5)
        torch.manual_seed(step)
        opt_a.step()
        torch.manual_seed(step)
        b(x).square().mean().backward()
        assert all(torch.equal(u, v) for u, v in zip(opt_a.master_weights(), opt_b.master_weights()))
    assert lowfp.backends.memory_order(b[0].weight) == (0, 2, 3, 1)
    handle.remove()


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, ExtraBitsSGD, ExtraBitsAdamW])
def test_step_is_seen_by_autograd_as_torch_optim_steps_are(opt_cls):
    """The fused step writes parameters through their pointers. A backward through a graph
    built before the step must raise, as it does after torch.optim's step, not differentiate
    with the new weights; every tensor the step wrote has a new version."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).bfloat16()
    opt = opt_cls(model.parameters(), lr=0.1, **({"momentum": 0.9} if opt_cls is not ExtraBitsAdamW else {}))
    loss = model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).sum()
    loss.backward(retain_graph=True)
    opt.step()  # creates the state
    versions = {id(t): t._version for p in model.parameters()
                for t in [p, *[v for v in opt.state[p].values() if torch.is_tensor(v) and v.dim()]]}
    opt.step()
    assert all(t._version > versions[id(t)] for p in model.parameters()
               for t in [p, *[v for v in opt.state[p].values() if torch.is_tensor(v) and v.dim()]])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_adam_step_counts_are_float32_cpu_tensors_and_hand_edited_ones_count_on():
    """Step counts are kept as torch.optim.Adam keeps them (one-element float32 CPU tensors,
    added to in place, versions bumped); a count edited by hand into another kind of tensor goes
    on counting in its own dtype, and the step reads it as its step number."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3).bfloat16()) for _ in range(4)]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = ExtraBitsAdam(params, lr=0.1), ExtraBitsAdam(ref_params, lr=0.1)
    for step in range(3):
        for p, q in zip(params, ref_params):
            p.grad = q.grad = torch.randn(5, 3).bfloat16()
        versions = [opt.state[p]["step"]._version for p in params if p in opt.state]
        opt.step()
        ref.step()
        counts = [opt.state[p]["step"] for p in params]
        assert all(c.dtype == torch.float32 and c.device.type == "cpu" and c.shape == () for c in counts)
        assert [float(c) for c in counts] == [step + 1.0] * 4
        assert all(c._version > v for c, v in zip(counts, versions))
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    # Edited by hand: one to float64, one to int64, and one skipped ahead to 10.
    opt.state[params[0]]["step"] = torch.tensor(3.0, dtype=torch.float64)
    opt.state[params[1]]["step"] = torch.tensor(3, dtype=torch.int64)
    opt.state[params[2]]["step"] = torch.tensor(10.0)
    ref.state[ref_params[2]]["step"] = torch.tensor(10.0)
    for p, q in zip(params, ref_params):
        p.grad = q.grad = torch.randn(5, 3).bfloat16()
    opt.step()
    ref.step()
    assert [(c.dtype, float(c)) for c in (opt.state[p]["step"] for p in params)] == [
        (torch.float64, 4.0), (torch.int64, 4.0), (torch.float32, 11.0), (torch.float32, 4.0)]
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))


def test_optimizer_refuses_buffers_that_no_longer_fit():
    """The fused step trusts every buffer's size, dtype and device; without these checks each
    case below read or wrote past a buffer (heap corruption) or misread float32 state as bfloat16."""
    small = bf16_param(5)
    opt = ExtraBitsAdam([small])
    opt.step()
    big = bf16_param(20)  # the same 16 packed words as 5 elements
    with pytest.raises(ValueError, match="'exp_avg'.* needs .* tensor of 20 elements"):
        ExtraBitsAdam([big]).load_state_dict(opt.state_dict())

    p = bf16_param(32)
    opt = ExtraBitsSGD([p], lr=0.1, momentum=0.9, extra_bits=8)
    opt.step()
    p.data = torch.zeros(1000, dtype=torch.bfloat16)  # 32 elements' extra bits no longer fit
    p.grad = torch.ones(1000, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="extra bits of a parameter of shape \\(1000,\\).* needs 256"):
        opt.step()
    p.data = torch.zeros(32)
    p.grad = torch.ones(32)
    with pytest.raises(TypeError, match="now has dtype torch.float32"):
        opt.step()
    p.data = torch.zeros(64, dtype=torch.bfloat16)[::2]
    p.grad = torch.ones(32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dense in memory .* has strides \\(2,\\)"):
        opt.step()
    # Changes that keep every object, and some the data pointers too: each is refused at the
    # next step (so no shortcut may take "same objects, same pointers" for "nothing changed").
    p = bf16_param(32)
    opt = ExtraBitsAdam([p], lr=0.1)
    opt.step()
    opt.step()
    p.data = p.data.view(torch.float16)  # the same memory read as float16
    with pytest.raises(TypeError, match="is now torch.float16, but its extra bits extend torch.bfloat16"):
        opt.step()
    p.data = p.data.view(torch.bfloat16)
    opt.step()
    opt.state[p]["exp_avg"].data = torch.zeros(3)  # the same tensor object, other memory
    with pytest.raises(ValueError, match="'exp_avg' .* is a \\(3,\\)"):
        opt.step()
    opt.state[p]["exp_avg"].data = torch.zeros(32)
    opt.step()
    opt.param_groups[0]["rounding"] = "nearest"
    with pytest.raises(ValueError, match="changed from 16/'toward_zero' to 16/'nearest'"):
        opt.step()
    # model.to(device) after the optimizer: checked as for an optimizer on cuda:0 (index 0)
    from lowfp.optim.state import check_buffers
    q = bf16_param(32)
    with pytest.raises(ValueError, match="must be on cuda:0.* is on cpu .*move the model before"):
        check_buffers(q, {}, opt.param_groups[0], 0)

    p = bf16_param(8)
    opt = ExtraBitsSGD([p], lr=0.1, momentum=0.9)
    opt.step()
    opt.param_groups[0]["state_dtype"] = torch.bfloat16  # the buffer is float32
    with pytest.raises(ValueError, match="'momentum_buffer'.*needs a torch.bfloat16 tensor"):
        opt.step()
    opt.param_groups[0]["state_dtype"] = torch.float32
    opt.param_groups[0]["extra_bits"] = 8
    with pytest.raises(ValueError, match="changed from 16/'toward_zero' to 8"):
        opt.step()
    opt.param_groups[0]["extra_bits"] = 16
    opt.state[p]["momentum_buffer"] = torch.zeros(7)
    with pytest.raises(ValueError, match="'momentum_buffer' .* is a \\(7,\\)"):
        opt.step()


def test_a_model_converted_to_another_16_bit_type_is_refused():
    """Extra bits extend the 16-bit type they were split from. After model.half() on a bfloat16
    model they would read as float16's and give a wrong master weight: the step,
    master_weights() and load_state_dict() refuse, and the step changes nothing first."""
    model = small_model().bfloat16()
    opt = ExtraBitsSGD(model.parameters(), lr=0.1, extra_bits=8)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    assert saved["state"][0]["param_dtype"] == torch.bfloat16
    model.half()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    weights = [p.detach().clone() for p in model.parameters()]
    match = "is now torch.float16, but its extra bits extend torch.bfloat16 weights"
    with pytest.raises(TypeError, match=match):
        opt.step()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    with pytest.raises(TypeError, match=match):
        opt.master_weights()
    fresh = ExtraBitsSGD(small_model().half().parameters(), lr=0.1, extra_bits=8)
    with pytest.raises(TypeError, match=match):
        fresh.load_state_dict(saved)
    # a state_dict saved before the dtype was recorded loads, and records it from then on
    for state in saved["state"].values():
        del state["param_dtype"]
    model16 = small_model().bfloat16()
    opt16 = ExtraBitsSGD(model16.parameters(), lr=0.1, extra_bits=8)
    opt16.load_state_dict(saved)
    assert all(opt16.state[p]["param_dtype"] == torch.bfloat16 for p in model16.parameters())


def test_amsgrad_switched_on_later_starts_its_maximum_at_zero():
    """torch.optim.Adam raises KeyError here; the maximum starts from zero, as it would have if
    amsgrad had been on from a zero state."""
    a, b = bf16_param(100), bf16_param(100)
    b.data.copy_(a.data)
    late = ExtraBitsAdam([a], lr=1e-2)
    always = ExtraBitsAdam([b], lr=1e-2, amsgrad=True)
    for step in range(6):
        g = torch.randn(100).bfloat16() * (10.0 if step == 3 else 1.0)
        a.grad, b.grad = g.clone(), g.clone()
        if step == 3:
            late.param_groups[0]["amsgrad"] = True
            always.state[b]["max_exp_avg_sq"].zero_()
        late.step()
        always.step()
        assert torch.equal(a, b)
    assert torch.equal(late.state[a]["max_exp_avg_sq"], always.state[b]["max_exp_avg_sq"])


# On a GPU (tests/devices.py): the CPU's bits, counts and steps.

@on_cuda
def test_extra_bits_channels_last_parameters_on_gpu_equal_cpu():
    """Parameters laid out channels_last step in memory order on the GPU as on the CPU (stochastic
    words by memory position), and a layout change made after some steps moves the state alike
    (the packed words are reordered on the CPU and copied back)."""
    import copy
    from lowfp import optim
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(5, 40, 3), torch.nn.Tanh(), torch.nn.Conv2d(40, 6, 3))
    model = model.to(memory_format=torch.channels_last)
    gpu_model = copy.deepcopy(model).cuda()
    kw = dict(lr=0.05, momentum=0.9, extra_bits=8, rounding="stochastic")
    torch.manual_seed(1)
    cpu_opt = optim.ExtraBitsSGD(model.parameters(), **kw)
    torch.manual_seed(1)
    gpu_opt = optim.ExtraBitsSGD(gpu_model.parameters(), **kw)
    assert gpu_model[0].weight.is_contiguous(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(2)
    step_on_both(cpu_opt, gpu_opt, list(model.parameters()), list(gpu_model.parameters()), g,
                 steps=3, seed=10)
    model.to(memory_format=torch.contiguous_format)
    gpu_model.to(memory_format=torch.contiguous_format)
    step_on_both(cpu_opt, gpu_opt, list(model.parameters()), list(gpu_model.parameters()), g,
                 steps=2, seed=20)
    state = gpu_opt.state[gpu_model[0].weight]
    assert "extra_dim_order" not in state and state["extra"].is_cuda
    assert state["momentum_buffer"].is_contiguous()
