"""Optimizer moments in low precision (docs/design.md §5.1, lowfp.optim.low_precision_states):
torch's own optimizers and an ExtraBits one step for step, bit for bit, against the same
optimizer whose moments this test rounds after each step by an independent reference (exact
fractions; stochastic rounding with reference.py's Philox words); state_dict resumes exactly;
memory_bytes; the arguments refused."""

import math
from fractions import Fraction

import pytest
import torch

import lowfp
from lowfp.formats import to_format
from lowfp.scaled import Scaled
from lowfp.optim.states import ROUNDS_KEY
from reference import Spec, philox_word, round_exact, round_fraction, stochastic_exact

FLOAT32 = lowfp.Format(8, 23, 0, specials="ieee")


def ref_round(t: torch.Tensor, fmt, rounding: str, seed: int = 0, offset: int = 0) -> torch.Tensor:
    """The moment t (float32) rounded as the handle documents, element by element."""
    flat = t.reshape(-1).tolist()
    scaled = fmt if isinstance(fmt, Scaled) else None
    if scaled is None:
        f = to_format(fmt, "fmt")
        spec = Spec(f.e, f.m, f.b, f.specials, f.subnormals)
        if rounding == "nearest":
            out = [round_exact(v, spec, "nearest", f.overflow)[0] for v in flat]
        else:
            out = [stochastic_exact(v, spec, philox_word(seed, offset, i)) for i, v in enumerate(flat)]
        return torch.tensor(out, dtype=torch.float64).float().reshape(t.shape)
    # float32 scales, nearest: s = round_float32(amax / max_E), q = round_E(x / s) exactly
    assert scaled.scale == "float32" and rounding == "nearest"
    e, b = scaled.element, scaled.block
    out = []
    for c0 in range(0, len(flat), b):
        vals = [Fraction(v) for v in flat[c0:c0 + b]]
        a = max(abs(v) for v in vals)
        s = round_fraction(a / Fraction(e.max), FLOAT32) if a else Fraction(2) ** -149
        out += [float(s * round_fraction(v / s, e)) for v in vals]
    return torch.tensor(out, dtype=torch.float64).float().reshape(t.shape)


def reference_rounding(opt, formats, rounding, sqrt_second, seed, index_of):
    """Round opt's moments after a step as low_precision_states documents, by ref_round."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            rounds = state.get(ROUNDS_KEY, 0)
            for key, fmt in formats.items():
                if key not in state:
                    continue
                t = state[key]
                compand = sqrt_second and key in ("exp_avg_sq", "max_exp_avg_sq")
                v = torch.sqrt(t) if compand else t
                pseed = (seed * 0x9E3779B97F4A7C15 + index_of[p] * 4 +
                         ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq").index(key)) & ((1 << 64) - 1)
                q = ref_round(v, fmt, rounding, pseed, rounds * ((v.numel() + 3) // 4))
                t.copy_(q * q if compand else q)
            state[ROUNDS_KEY] = rounds + 1


def twin_params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(24, 40, generator=g), torch.randn(40, generator=g)
    make = lambda: [torch.nn.Parameter(w.clone().to(dtype)), torch.nn.Parameter(b.clone().to(dtype))]  # noqa: E731
    return make(), make()


def grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.01 * (1 + step)).to(p.dtype)


CASES = [
    # (optimizer, its kwargs, formats, rounding, sqrt companding)
    (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True),
     dict(exp_avg="fp(5,3,0)", exp_avg_sq=Scaled("float8_e4m3fn", block=32, scale="float32"),
          max_exp_avg_sq="fp(7,4,0)"), "nearest", True),
    (torch.optim.Adam, dict(lr=1e-2), dict(exp_avg="fp(5,4,0)", exp_avg_sq="fp(7,3,0)"), "stochastic", False),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9), dict(momentum_buffer="fp(4,3,2)"), "stochastic", False),
    (lowfp.optim.ExtraBitsAdamW, dict(lr=1e-2, extra_bits=8),
     dict(exp_avg="fp(5,3,0)", exp_avg_sq="fp(7,3,0)"), "nearest", True),
]


@pytest.mark.parametrize("cls,kw,formats,rounding,sqrt_second", CASES)
def test_steps_match_a_reference_rounding_bit_for_bit(cls, kw, formats, rounding, sqrt_second):
    ours_p, ref_p = twin_params()
    ours, ref = cls(ours_p, **kw), cls(ref_p, **kw)
    handle = lowfp.optim.low_precision_states(ours, **formats, rounding=rounding,
                                              sqrt_second_moment=sqrt_second, seed=7)
    index_of = {p: i for i, p in enumerate(ref_p)}
    for step in range(4):
        grads(ours_p, step)
        grads(ref_p, step)
        ours.step()
        ref.step()
        reference_rounding(ref, formats, rounding, sqrt_second, 7, index_of)
        for p, q in zip(ours_p, ref_p):
            assert torch.equal(p, q), step
            for key in formats:
                if key in ref.state[q]:
                    assert torch.equal(ours.state[p][key], ref.state[q][key]), (step, key)
    # the states are on their formats' grids and were rounded (not left as torch's)
    plain_p, _ = twin_params()
    plain = cls(plain_p, **kw)
    for step in range(4):
        grads(plain_p, step)
        plain.step()
    key = next(iter(formats))
    assert not torch.equal(plain.state[plain_p[0]][key], ours.state[ours_p[0]][key])
    handle.remove()
    grads(ours_p, 9)
    ours.step()  # no longer rounded: the moment leaves the grid
    m = ours.state[ours_p[0]][key]
    fmt = formats[key]
    if not isinstance(fmt, Scaled):
        assert not torch.equal(lowfp.quantize(m, fmt), m)


def test_state_dict_resumes_the_same_draws():
    def train(opt, params, steps, start=0):
        for step in range(start, start + steps):
            grads(params, step)
            opt.step()

    kw = dict(exp_avg="fp(5,2,0)", exp_avg_sq="fp(7,2,0)", rounding="stochastic", seed=3)
    p1, p2 = twin_params()
    a = torch.optim.AdamW(p1, lr=1e-2)
    lowfp.optim.low_precision_states(a, **kw)
    train(a, p1, 5)
    b = torch.optim.AdamW(p2, lr=1e-2)
    lowfp.optim.low_precision_states(b, **kw)
    train(b, p2, 2)
    saved = b.state_dict()
    c_params = [torch.nn.Parameter(p.detach().clone()) for p in p2]
    c = torch.optim.AdamW(c_params, lr=1e-2)
    lowfp.optim.low_precision_states(c, **kw)
    c.load_state_dict(saved)
    train(c, c_params, 3, start=2)
    for x, y in zip(p1, c_params):
        assert torch.equal(x, y)
    assert a.state[p1[0]][ROUNDS_KEY] == c.state[c_params[0]][ROUNDS_KEY] == 5


def test_memory_bytes():
    p = [torch.nn.Parameter(torch.randn(64, 32))]
    opt = torch.optim.AdamW(p)
    handle = lowfp.optim.low_precision_states(opt, exp_avg="mxfp8_e4m3", exp_avg_sq="fp(4,3,0)")
    p[0].grad = torch.randn(64, 32)
    opt.step()
    m = handle.memory_bytes()
    n = 64 * 32
    assert m["weights"] == 4 * n and m["moments"] == n * (8 + 8 / 32) / 8 + n * 1
    assert m["per_parameter"] == m["total"] / n == 4 + 8.25 / 8 + 1
    # 4-bit moments with blocks: on E2M1's grid times each block's power-of-two scale
    p4 = [torch.nn.Parameter(torch.randn(64, 32))]
    opt4 = torch.optim.Adam(p4)
    h4 = lowfp.optim.low_precision_states(opt4, exp_avg="mxfp4_e2m1", exp_avg_sq="mxfp4_e2m1",
                                          sqrt_second_moment=True)
    p4[0].grad = torch.randn(64, 32)
    opt4.step()
    m4 = opt4.state[p4[0]]["exp_avg"]
    assert torch.equal(m4, lowfp.quantize(m4.reshape(-1), "mxfp4_e2m1").reshape(m4.shape))
    assert h4.memory_bytes()["moments"] == 2 * n * 4.25 / 8
    # an ExtraBits optimizer's extra bits count too
    q = [torch.nn.Parameter(torch.randn(64, 32))]
    eb = lowfp.optim.ExtraBitsAdamW(q, extra_bits=8)
    h = lowfp.optim.low_precision_states(eb, exp_avg="float8_e4m3fn")
    q[0].grad = torch.randn(64, 32).bfloat16()
    eb.step()
    mb = h.memory_bytes()
    assert mb["weights"] == 2 * n and mb["extra_bits"] == eb.memory_bytes()["extra_bits"] > 0
    assert mb["moments"] == n * 1 + n * 4  # exp_avg in 8 bits, exp_avg_sq float32


def test_bad_arguments():
    p = [torch.nn.Parameter(torch.randn(4, 4))]
    opt = torch.optim.Adam(p)
    with pytest.raises(ValueError, match="at least one"):
        lowfp.optim.low_precision_states(opt)
    with pytest.raises(ValueError, match="rounding"):
        lowfp.optim.low_precision_states(opt, exp_avg="bfloat16", rounding="up")
    with pytest.raises(ValueError, match="2-D blocks"):
        lowfp.optim.low_precision_states(opt, exp_avg="fp8_e4m3_block128x128")
    with pytest.raises(ValueError, match="cannot parse|format"):
        lowfp.optim.low_precision_states(opt, exp_avg="fp(9,99)")
    with pytest.raises(ValueError, match="exp_avg_sq: fp.8,4,0. does not fit the float32"):
        lowfp.optim.low_precision_states(opt, exp_avg_sq="fp(8,4,0)")
    with pytest.raises(TypeError, match="optimizer"):
        lowfp.optim.low_precision_states(p, exp_avg="bfloat16")
    h = lowfp.optim.low_precision_states(opt, exp_avg="bfloat16")
    with pytest.raises(ValueError, match="already"):
        lowfp.optim.low_precision_states(opt, exp_avg="bfloat16")
    h.remove()
    lowfp.optim.low_precision_states(opt, exp_avg="bfloat16")  # after remove(): allowed again
    half = torch.optim.Adam([torch.nn.Parameter(torch.randn(4).bfloat16())])
    with pytest.raises(ValueError, match="float32 moment"):
        lowfp.optim.low_precision_states(half, exp_avg="float8_e4m3fn")
    eb = lowfp.optim.ExtraBitsAdamW([torch.nn.Parameter(torch.randn(4))], state_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="state_dtype=torch.float32"):
        lowfp.optim.low_precision_states(eb, exp_avg="float8_e4m3fn")
    eb32 = lowfp.optim.ExtraBitsAdamW([torch.nn.Parameter(torch.randn(4))])
    lowfp.optim.low_precision_states(eb32, exp_avg="float8_e4m3fn")
    with pytest.raises(ValueError, match="low precision"):
        lowfp.optim.step_in_backward(eb32)


def test_adamw_against_a_float64_reference_of_its_formulas():
    # AdamW's formulas in float64, the moments rounded (√v companded) after each step: torch's
    # float32 AdamW with low_precision_states keeps to it (float32's rounding of the update aside,
    # which moves a moment across a midpoint of its format now and then)
    fmt_m, fmt_v = "fp(5,4,0)", "fp(7,5,0)"
    params, _ = twin_params(seed=4)
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    lowfp.optim.low_precision_states(opt, exp_avg=fmt_m, exp_avg_sq=fmt_v, sqrt_second_moment=True)
    ref = [p.detach().double() for p in params]
    m = [torch.zeros_like(p) for p in ref]
    v = [torch.zeros_like(p) for p in ref]
    b1, b2, lr, wd, eps = 0.9, 0.999, 1e-2, 0.1, 1e-8
    for step in range(1, 6):
        grads(params, step)
        opt.step()
        for i, p in enumerate(params):
            g = p.grad.double()
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            ref[i] = ref[i] * (1 - lr * wd)
            ref[i] = ref[i] - lr / (1 - b1 ** step) * m[i] / (v[i].sqrt() / math.sqrt(1 - b2 ** step) + eps)
            m[i] = ref_round(m[i], fmt_m, "nearest").double()
            v[i] = ref_round(v[i].sqrt(), fmt_v, "nearest").double() ** 2
            state = opt.state[p]
            assert (state["exp_avg"].double() == m[i]).double().mean() > 0.99
            assert (state["exp_avg_sq"].double().sqrt() == v[i].sqrt().float().double()).double().mean() > 0.99
            assert torch.allclose(p.double(), ref[i], rtol=1e-4, atol=1e-6)
