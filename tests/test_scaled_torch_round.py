"""The torch form of scaled roundings (lowfp.scaled.torch_round), which Inductor compiles in place
of lowfp::scaled_quantize: the native kernels' values, elements, scales, tensor scale and counts
for every scale rule, granularity, mode and input dtype it covers, its exact quotients against
Fractions, and compiled code that holds no lowfp operator."""

import math
import os
import random
import re
from fractions import Fraction

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from inductor_code import compiled_code

import lowfp
from lowfp import Scaled
from lowfp.scaled import ScaledStats
from lowfp.scaled.torch_round import _divmod, fuses_format, quotient, scaled_quantize as torch_scaled

MODES = ["nearest", "nearest_away", "toward_zero", "up", "down", "stochastic"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAMED = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1", "nvfp4",
         "fp8_e4m3_tensorwise", "fp8_e5m2_rowwise", "fp8_e4m3_block128"]
# Every scale rule and granularity, with element formats beyond the named ones.
CUSTOM = [Scaled("fp(4,3,0,specials='fn')", block=32, scale_rule=rule)
          for rule in ("floor", "ceil", "rceil", "even")] + [
    Scaled("float4_e2m1fn", block=16, scale="float8_e4m3fn"),
    Scaled("float8_e5m2", block=None, scale="float32"),
    Scaled("float8_e4m3fn", block=(4, 8), scale="float32"),
    Scaled("fp(3,2,0)", block=7, axis=0, scale_rule="ceil"),
    Scaled("fp(5,10,0)", block=5, scale="fp(5,2,0)"),
    Scaled("fp(2,1,0)", block=None, axis=None, scale="float32"),
    Scaled("fp(8,19,1)", block=32, scale_rule="rceil"),
    Scaled("fp(3,2,0,overflow='inf')", block=8, scale="fp(4,3,4)", tensor_scale=True)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def decision_points(fmt: Scaled, shape, seed: int) -> torch.Tensor:
    """Elements at E's grid points and midpoints times power-of-two and 3-bit block factors, half
    of them moved one float32 step, with zeros, a subnormal, infinities and NaN."""
    g = torch.Generator().manual_seed(seed)
    e = fmt.element
    pts = []
    for ex in range(e.emin - e.m - 1, e.emax + 2):
        step = 2.0 ** (ex - e.m)
        for k in range(2 ** min(e.m, 3) + 1):
            pts += [2.0 ** ex + k * step, 2.0 ** ex + (k + 0.5) * step]
    pts = torch.tensor(pts, dtype=torch.float64)
    n = 1
    for size in shape:
        n *= size
    v = pts[torch.randint(0, len(pts), (n,), generator=g)]
    v = v * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    v = v.reshape(-1, 16) * torch.exp2(torch.randint(-20, 20, (n // 16, 1), generator=g).double()) * (
        1 + torch.randint(0, 8, (n // 16, 1), generator=g).double() / 8)
    x = v.reshape(-1).float()
    moved = (bits(x) + torch.randint(-1, 2, x.shape, generator=g, dtype=torch.int32)).view(torch.float32)
    x = torch.where(torch.rand(n, generator=g) < 0.5, moved, x)
    x[:6] = torch.tensor([0.0, -0.0, 1e-45, float("inf"), -float("inf"), float("nan")])
    return x.reshape(shape)


def native(x, fmt, mode, seed, offset, sr_bits=32, overflow="saturate"):
    stats = ScaledStats()
    parts = lowfp.scaled.encode(x, fmt, mode, seed=seed, offset=offset, sr_bits=sr_bits,
                                overflow=overflow, stats=stats)
    return parts, stats.counts


def assert_same(have, want_parts, want_counts):
    y, q, scales, tensor_scale, counts = have
    assert torch.equal(bits(y), bits(want_parts.value))
    assert torch.equal(bits(q), bits(want_parts.q))
    assert torch.equal(bits(scales), bits(want_parts.scales))
    assert torch.equal(bits(tensor_scale), bits(want_parts.tensor_scale))
    assert torch.equal(counts, want_counts)


def named_format_values() -> torch.Tensor:
    """(8, 256) float64 values over 60 binades, rows apart, with a NaN, infinities, a block of
    zeros and a block of values below float32's normal range."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 256, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-30, 30, (8, 1), generator=g).double())
    x[0, 3], x[1, 5], x[3, 7] = float("nan"), float("inf"), -float("inf")
    x[2, :40] = 0
    x[4, :16] = 1e-40
    return x


@pytest.mark.parametrize("name", NAMED)
def test_named_formats_equal_the_native_kernel(name):
    fmt = lowfp.scaled.to_scaled(name)
    x = named_format_values()
    for dtype in DTYPES:
        xd = x.to(dtype)
        for mode in MODES:
            for overflow in ("saturate", "inf", "nan"):
                seed, offset = 0x0123456789ABCDEF, 2**64 - 3
                want, want_counts = native(xd, fmt, mode, seed, offset, overflow=overflow)
                have = torch_scaled(xd, str(fmt), mode, overflow, 32, seed, None, offset, True, True)
                assert_same(have, want, want_counts)


@pytest.mark.parametrize("fmt", CUSTOM, ids=str)
def test_decision_points_of_every_rule_and_granularity(fmt):
    shape = (32, 64) if fmt.axis == 0 else (64, 32)
    for dtype in DTYPES:
        x = decision_points(fmt, shape, seed=len(str(fmt))).to(dtype)
        for mode in MODES:
            for sr_bits in ((32, 5) if mode == "stochastic" else (32,)):
                want, want_counts = native(x, fmt, mode, 77, 9, sr_bits)
                have = torch_scaled(x, str(fmt), mode, "saturate", sr_bits, 77, None, 9, True, True)
                assert_same(have, want, want_counts)


@pytest.mark.parametrize("values", [[3e38, -3.4e38, 1e-45, 1e-40, 0.0, float("nan")] * 8,
                                    [1e-45] * 32, [0.0] * 32, [float("inf")] * 32,
                                    [1e-42, 2e-45] * 16])
def test_extreme_blocks_and_the_drawn_seed(values):
    x = torch.tensor(values, dtype=torch.float32)
    drawn = torch.tensor([3, 5], dtype=torch.int64)  # the key 5 · 2^32 + 3
    for name in ("mxfp8_e4m3", "mxfp4_e2m1", "nvfp4", "fp8_e4m3_rowwise", "fp8_e5m2_tensorwise"):
        for mode in ("nearest", "up", "stochastic"):
            want, want_counts = native(x, name, mode, (5 << 32) + 3, 0)
            have = torch_scaled(x, str(lowfp.scaled.to_scaled(name)), mode, "saturate", 32, 0,
                                drawn, 0, True, True)
            assert_same(have, want, want_counts)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 32)])
def test_empty_tensors(shape):
    x = torch.empty(shape)
    want, want_counts = native(x, "mxfp8_e4m3", "nearest", 1, 0)
    y, q, scales, tensor_scale, counts = torch_scaled(x, "mxfp8_e4m3", "nearest", "saturate", 32,
                                                      1, None, 0, True, True)
    assert y.shape == x.shape and q.shape == want.q.shape and scales.shape == want.scales.shape
    assert tensor_scale.item() == 1.0 and torch.equal(counts, want_counts)


def round_to_odd(exact: Fraction) -> float:
    """A nonzero Fraction rounded to 53 significant bits by truncation, the last bit set when
    the truncation is inexact (round to odd)."""
    magnitude = abs(exact)
    e = magnitude.numerator.bit_length() - magnitude.denominator.bit_length() - 53
    while magnitude / Fraction(2) ** e >= 2**53:
        e += 1
    while magnitude / Fraction(2) ** e < 2**52:
        e -= 1
    scaled = magnitude / Fraction(2) ** e
    t = scaled.numerator // scaled.denominator
    if t != scaled:
        t |= 1
    return math.copysign(math.ldexp(t, e), exact)


def test_quotients_are_the_exact_quotient_rounded_once():
    """quotient(x, s) against Fractions: to nearest even (Python's float division), and to odd."""
    rng = random.Random(5)
    xs, ss = [], []
    for _ in range(3000):
        xs.append(rng.choice([1, -1]) * rng.getrandbits(24) * 2.0 ** rng.randint(-170, 128))
        if rng.random() < 0.2:  # quotients that are exact or ties
            ss.append(float(rng.choice([1, 3, 5, 7])) * 2.0 ** rng.randint(-20, 20))
        else:
            ss.append((rng.getrandbits(27) | (1 << 27)) * 2.0 ** rng.randint(-180, 110))
    x, s = torch.tensor(xs, dtype=torch.float64), torch.tensor(ss, dtype=torch.float64)
    nearest, odd = quotient(x, s, odd=False).tolist(), quotient(x, s, odd=True).tolist()
    for xi, si, n, o in zip(xs, ss, nearest, odd):
        assert n == xi / si, (xi, si)
        assert o == (round_to_odd(Fraction(xi) / Fraction(si)) if xi else xi), (xi, si)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")], dtype=torch.float64)
    for odd_rounding in (False, True):  # x / s is x itself
        assert torch.equal(bits(quotient(specials, 3.0, odd_rounding)), bits(specials))
    assert torch.equal(quotient(x, 3.0, odd=False), x / 3.0)  # a divisor given as a float


def test_long_division_corrects_its_estimate_either_way():
    """Each step of quotient()'s long division estimates in float64 and corrects by one where
    the remainder says so: exact against Python's divmod with an inverse off either way."""
    rng = random.Random(3)
    divisors = [(1 << 27) | rng.getrandbits(27) for _ in range(500)] + [(1 << 28) - 1, 1 << 27]
    nums = [rng.getrandbits(rng.choice([20, 40, 62])) for _ in divisors]
    nums[:len(divisors) // 2] = [d * rng.getrandbits(34) + rng.choice([0, d - 1]) for d in
                                 divisors[:len(divisors) // 2]]  # remainders at both ends
    num, divisor = torch.tensor(nums), torch.tensor(divisors)
    for skew in (1 - 2.0**-45, 1.0, 1 + 2.0**-45):
        q, r = _divmod(num, divisor, (1.0 / divisor.double()) * skew)
        assert [divmod(n, d) for n, d in zip(nums, divisors)] == list(zip(q.tolist(), r.tolist()))


def test_formats_it_does_not_cover_keep_the_operator():
    assert not fuses_format(lowfp.scaled.to_scaled("nvfp4"), torch.float64)
    wide = Scaled("float8_e4m3fn", block=16, scale="float32", tensor_scale=True)
    assert not fuses_format(wide, torch.float32)  # float32 S times a float32 t: 48 bits
    assert fuses_format(lowfp.scaled.to_scaled("nvfp4"), torch.bfloat16)


def test_compiled_scaled_roundings_are_fused_into_inductors_kernel(fused):
    """MX, NVFP4 and row scales, one with out=: no lowfp operator in the
    generated code, one kernel, and the native values and counts."""
    x = torch.randn(64, 256) * 10

    def f(t, out, stats):
        a = lowfp.quantize(t * 100 - 3, "mxfp8_e4m3", stats=stats[0]).relu()
        b = lowfp.quantize(t * 7, "nvfp4", stats=stats[1]) + 1  # (stochastic: the GEMM test)
        lowfp.quantize(t, "fp8_e4m3_rowwise", "up", out=out, stats=stats[2])
        return a, b

    outs = [torch.empty(64, 256), torch.empty(64, 256)]
    stats = [[ScaledStats() for _ in range(3)] for _ in range(2)]
    want = f(x, outs[0], stats[0])
    got, code = compiled_code(f, x, outs[1], stats[1])
    assert "lowfp" not in code
    assert code.count("async_compile.cpp_pybinding") == 1
    for w, h in zip(want + (outs[0],), got + (outs[1],)):
        assert torch.equal(bits(h), bits(w))
    for w, h in zip(*stats):
        assert torch.equal(h.counts, w.counts) and w.numel == x.numel()


def test_compiled_float64_keeps_the_operator(fused):
    x = torch.randn(4, 64, dtype=torch.float64)
    got, code = compiled_code(lambda t: lowfp.quantize(t, "mxfp8_e4m3"), x)
    assert "lowfp" in code and torch.equal(got, lowfp.quantize(x, "mxfp8_e4m3"))


def test_cpu_default_keeps_the_native_kernel(monkeypatch):
    monkeypatch.delenv("LOWFP_INDUCTOR_FUSION", raising=False)
    assert os.environ.get("LOWFP_INDUCTOR_FUSION") is None
    x = torch.randn(4, 64)
    got, code = compiled_code(lambda t: lowfp.quantize(t, "nvfp4"), x)
    assert "lowfp" in code and torch.equal(got, lowfp.quantize(x, "nvfp4"))


@pytest.mark.long
def test_compiled_gemm_emulation_is_fused_and_equals_eager(fused):
    """emulate_gemms "nvfp4" (tensor scales, stochastic gradients, the Hadamard transform of the
    weight gradient's operands) compiled: no lowfp operator in the forward or backward code, and
    eager's output and gradients."""
    def run(compiled: bool):
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 16)
        lowfp.scaled.emulate_gemms(model, "nvfp4").install()
        x = torch.randn(8, 32, requires_grad=True)
        forward = model
        if compiled:
            torch._dynamo.reset()
            forward = torch.compile(model)
        torch.manual_seed(1)  # the stochastic gradients' seeds
        with torch._inductor.config.patch(force_disable_caches=True):
            y, code = run_and_get_code(lambda: _loss_and_backward(forward, x))
        return y, x.grad, model.weight.grad, "\n".join(code)

    want = run(False)
    got = run(True)
    # (seed=None keeps lowfp::draw_seed: the stochastic gradients' keys, drawn as eager draws them)
    assert set(re.findall(r"torch\.ops\.lowfp\.(\w+)", got[3])) == {"draw_seed"}
    assert got[3].count("async_compile.cpp_pybinding") >= 2
    for w, h in zip(want[:3], got[:3]):
        assert torch.equal(bits(h), bits(w))


def _loss_and_backward(forward, x):
    y = forward(x)
    (y * torch.arange(16.0)).sum().backward()
    return y.detach()
