"""Weights on a lowfp format's grid with extra bits below its last bit (weight_format,
docs/design.md §5): split, merge and the optimizers against float64 references."""

import ml_dtypes
import numpy as np
import pytest
import torch

import lowfp
from lowfp import extra_bits
from lowfp.optim import ExtraBitsAdam, ExtraBitsSGD
from extra_bits_reference import RefAdam, RefSGD, random_float32, small_model


def grid_truncate(w: torch.Tensor, fmt: lowfp.Format, k: int) -> torch.Tensor:
    """W truncated toward zero to F's precision + k bits (float64 arithmetic, exact here): steps
    of ulp_F(|W|) / 2^k; from F's largest value + one ulp up, F's largest value."""
    x = w.double().numpy()
    a = np.abs(x)
    _, e = np.frexp(np.where(np.isfinite(a) & (a > 0), a, 1.0))
    below = fmt.emin - fmt.m if fmt.subnormals else fmt.emin
    ulp = np.exp2(np.where(a >= 2.0 ** fmt.emin, (e - 1) - fmt.m, below))
    top = fmt.max + 2.0 ** (fmt.emax - fmt.m)
    with np.errstate(invalid="ignore"):
        r = np.where(a >= top, fmt.max, np.floor(a / (ulp / 2.0 ** k)) * (ulp / 2.0 ** k))
    return torch.from_numpy(np.copysign(np.where(np.isnan(a), np.nan, r), x)).float()


FORMATS = [("float8_e5m2", torch.bfloat16), ("float8_e5m2", torch.float16),
           ("float8_e4m3fn", torch.bfloat16), ("fp(4,3,4)", torch.float16),
           ("fp(5,2,0,subnormals=False)", torch.bfloat16)]


@pytest.mark.parametrize("name,dtype", FORMATS)
@pytest.mark.parametrize("rounding", ["toward_zero", "nearest", "stochastic"])
def test_split_and_merge_against_the_exact_reference(name, dtype, rounding):
    fmt = lowfp.Format.parse(name)
    w = torch.cat([random_float32(4000, seed=1, lo=-12, hi=12) * 2.0 ** (fmt.emin + fmt.emax) / 4,
                   torch.tensor([0.0, -0.0, fmt.max, -fmt.max, fmt.max * 1.01, fmt.smallest,
                                 fmt.smallest / 3, 2.0 ** fmt.emin, float("inf"), float("nan")])])
    for k in (3, 8, 16):
        stats = lowfp.Stats()
        w16, packed = extra_bits.split(w, dtype, k, rounding, seed=5, weight_format=name,
                                       stats=stats)
        assert w16.dtype == dtype
        want = lowfp.quantize(w, fmt, rounding, overflow="saturate", seed=5)
        finite = torch.isfinite(w)
        assert torch.equal(w16.float()[finite], want[finite])
        on_grid = lowfp.quantize(w16.float(), fmt)
        assert torch.equal(on_grid[~w.isnan()], w16.float()[~w.isnan()])  # on F's grid
        back = extra_bits.merge(w16, packed, k, rounding, weight_format=name)
        ref = grid_truncate(w, fmt, k)
        assert torch.equal(back.isnan(), ref.isnan())
        assert torch.equal(back[~ref.isnan()], ref[~ref.isnan()]), (k, rounding)
        assert stats.overflow > 0  # fmt.max * 1.01 (and inf) beyond F's range


def test_float8_e5m2_weights_are_ml_dtypes_casts():
    w = random_float32(5000, seed=2, lo=-14, hi=14)
    w16, _ = extra_bits.split(w, torch.bfloat16, 8, "nearest", weight_format="float8_e5m2")
    want = w.numpy().astype(ml_dtypes.float8_e5m2).astype(np.float32)
    keep = np.isfinite(want)  # ml_dtypes overflows to inf where lowfp's weights saturate
    assert np.array_equal(w16.float().numpy()[keep], want[keep])


def test_bad_weight_formats_are_refused():
    w = torch.randn(8)
    with pytest.raises(ValueError, match="does not fit"):
        extra_bits.split(w, torch.bfloat16, 8, weight_format="float16")
    with pytest.raises(ValueError, match="does not fit"):
        extra_bits.split(w, torch.float16, 8, weight_format="bfloat16")
    with pytest.raises(ValueError, match="k must be between 1 and 16"):
        extra_bits.split(w, torch.bfloat16, 17, weight_format="float8_e5m2")
    with pytest.raises(ValueError, match="weight_format"):
        extra_bits.split(w, torch.bfloat16, 8, weight_format="mxfp8_e4m3")
    with pytest.raises(TypeError, match="weight_format"):
        ExtraBitsSGD(small_model().parameters(), weight_format=8)
    # the 16-bit type's own format is its own grid
    a = extra_bits.split(w, torch.bfloat16, 8, "nearest", weight_format="bfloat16")
    b = extra_bits.split(w, torch.bfloat16, 8, "nearest")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("opt_cls,ref_cls,kwargs", [
    (ExtraBitsSGD, RefSGD, dict(lr=0.05, momentum=0.9)),
    (ExtraBitsAdam, RefAdam, dict(lr=3e-3, weight_decay=1e-2)),
])
@pytest.mark.parametrize("name,k", [("float8_e5m2", 8), ("float8_e4m3fn", 4), ("fp(4,3,4)", 12)])
def test_optimizers_step_an_fp32_master_truncated_to_the_format_plus_k(opt_cls, ref_cls, kwargs,
                                                                        name, k):
    fmt = lowfp.Format.parse(name)
    model = small_model()
    ref = ref_cls([grid_truncate(p.detach(), fmt, k).numpy() for p in model.parameters()], **kwargs)
    opt = opt_cls(model.parameters(), extra_bits=k, rounding="nearest", weight_format=name, **kwargs)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g)
    for step in range(40):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.bfloat16()).float(), y).backward()
        ref.step([p.grad.float().numpy() for p in model.parameters()])
        opt.step()
        ref.w = [grid_truncate(torch.from_numpy(w), fmt, k).numpy() for w in ref.w]
        for got, want in zip(opt.master_weights(), ref.w):
            assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), step
    for p in model.parameters():  # the model's weights stay on F's grid
        assert torch.equal(lowfp.quantize(p.float(), fmt), p.float())
    # state_dict round trip: a fresh optimizer continues bit for bit
    state = opt.state_dict()
    assert state["param_groups"][0]["weight_format"] == str(fmt)
    model2 = small_model()
    with torch.no_grad():
        for a, b in zip(model2.parameters(), model.parameters()):
            a.data = b.detach().clone()
    opt2 = opt_cls(model2.parameters(), extra_bits=k, rounding="nearest", weight_format=name, **kwargs)
    opt2.load_state_dict(state)
    for o, m in ((opt, model), (opt2, model2)):
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x.bfloat16()).float(), y).backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt2.master_weights()))
    with pytest.raises(ValueError, match="weight_format"):
        other = opt_cls(model2.parameters(), extra_bits=k, rounding="nearest", **kwargs)
        other.load_state_dict(opt2.state_dict())
        other.param_groups[0]["weight_format"] = None
        other.zero_grad()
        torch.nn.functional.cross_entropy(model2(x.bfloat16()).float(), y).backward()
        other.step()


def test_step_in_backward_and_stochastic_rounding_with_a_weight_format():
    def run(in_backward):
        model = small_model()
        opt = ExtraBitsSGD(model.parameters(), lr=0.05, momentum=0.9, extra_bits=6,
                           rounding="stochastic", weight_format="float8_e5m2",
                           generator=torch.Generator().manual_seed(3))
        handle = lowfp.optim.step_in_backward(opt) if in_backward else None
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
        for _ in range(5):
            if handle is None:
                opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x.bfloat16()).float(), y).backward()
            if handle is None:
                opt.step()
        return opt.master_weights()
    a, b = run(False), run(True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
