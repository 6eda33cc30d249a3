"""Random interleavings of what a training script does around an ExtraBits optimizer: layout
changes, state_dict reloads into a fresh optimizer (through torch.save / torch.load with
weights_only), pickling, both zero_grad forms and stepping inside backward switched on and off.
Model A goes through them; model B only steps, with the same gradients. After every step their
float32 masters must be equal bit for bit, and so must the 16-bit weights (stochastically rounded
ones only in the same layout: their Philox words follow memory positions)."""

import copy
import io
import pickle
import random

import pytest
import torch

from lowfp.optim import ExtraBitsAdamW, ExtraBitsSGD, step_in_backward


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.Conv2d(8, 4, 3), torch.nn.Flatten(), torch.nn.Linear(64, 5))


def build(cls, kw, model, generator):
    opt = cls(model.parameters(), generator=generator, **kw)
    model.to(torch.bfloat16)
    return opt


@pytest.mark.parametrize("cls, kw, seed", [
    (ExtraBitsSGD, dict(lr=0.05, momentum=0.9, extra_bits=8, rounding="stochastic"), 4),
    (ExtraBitsAdamW, dict(lr=1e-2, amsgrad=True, extra_bits=8, rounding="stochastic"), 5),
    (ExtraBitsAdamW, dict(lr=1e-2, extra_bits=16, rounding="nearest", state_dtype=torch.bfloat16), 6)])
def test_random_interleavings_step_as_plain_steps(cls, kw, seed):
    rng = random.Random(seed)
    a, b = make_model(), make_model()
    opt_a = build(cls, kw, a, torch.Generator().manual_seed(1))
    opt_b = build(cls, kw, b, torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(seed)
    handle, done = None, []
    for _ in range(40):
        what = rng.choice(["step", "step", "step", "layout", "reload", "pickle", "inside", "zero"])
        done.append(what)
        if what in ("reload", "pickle", "step") and handle is not None:
            handle.remove()
            handle = None
        if what == "layout":
            a.to(memory_format=rng.choice([torch.channels_last, torch.contiguous_format]))
            continue
        if what == "reload":
            buf = io.BytesIO()
            torch.save(opt_a.state_dict(), buf)
            buf.seek(0)
            opt_a = cls(a.parameters(), generator=copy.deepcopy(opt_a._generator), **kw)
            opt_a.load_state_dict(torch.load(buf, weights_only=True))
            continue
        if what == "pickle":
            a, opt_a = pickle.loads(pickle.dumps((a, opt_a)))
            continue
        if what == "zero":
            opt_a.zero_grad(set_to_none=rng.random() < 0.5)
            continue
        grads = [torch.randn(p.shape, generator=g).bfloat16() for p in b.parameters()]
        for p, grad in zip(b.parameters(), grads):
            p.grad = grad
        opt_b.step()
        if what == "inside":
            if handle is None:
                handle = step_in_backward(opt_a)
            for p in a.parameters():
                p.grad = None
            sum((p * grad).float().sum() for p, grad in zip(a.parameters(), grads)).backward()
        else:
            for p, grad in zip(a.parameters(), grads):  # in either layout
                p.grad = (grad.contiguous(memory_format=torch.channels_last)
                          if grad.dim() == 4 and rng.random() < 0.5 else grad)
            opt_a.step()
        for i, (x, y) in enumerate(zip(opt_a.master_weights(), opt_b.master_weights())):
            assert torch.equal(x, y), (done, i)
        for i, (p, q) in enumerate(zip(a.parameters(), b.parameters())):
            if kw["rounding"] != "stochastic" or p.is_contiguous():
                assert torch.equal(p.view(torch.int16), q.view(torch.int16)), (done, i)
    assert {"layout", "reload", "pickle", "inside"} <= set(done)
