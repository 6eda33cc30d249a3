"""Stochastic rounding and its random numbers (docs/design.md §3)."""

import math

import numpy as np
import pytest
import torch

import lowfp
from lowfp._native import DTYPE_CODES, ROUNDING_MODES, format_args
from reference import Spec, philox4x32_10, philox_word, stochastic_exact
from devices import DEVICES

E4M3FN = Spec(4, 3, 0, "fn")


# Known-answer vectors of Philox4x32-10 (Random123's kat_vectors).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_known_answers(ctr, key, want):
    assert tuple(philox4x32_10(ctr, key)) == want  # the test's own implementation
    assert lowfp._C.philox4x32_10(*ctr, *key) == want  # the engine's


@pytest.mark.parametrize("sr_bits", [32, 1, 2, 5, 13])
# offset 2^32 - 5: the counter's low word wraps inside the CPU driver's first SIMD group of blocks
@pytest.mark.parametrize("seed,offset", [(0, 0), (0x123456789ABCDEF0, 7), (2**64 - 1, 2**40),
                                         (5, 2**32 - 5), (6, 2**33 - 17)])
@pytest.mark.parametrize("device", DEVICES)
def test_results_follow_the_specified_stream_exactly(seed, offset, sr_bits, device):
    """Every element equals the spec: up iff (word >> (32-R)) < floor(f 2^R), word from (seed, offset, i)."""
    rng = np.random.default_rng(seed % 1000 + sr_bits)
    n = 1003
    # normal and subnormal range of float8_e4m3fn, both signs, some exact grid values
    x = rng.uniform(-300, 300, n) * 2.0 ** rng.integers(-14, 1, n)
    x[::17] = np.round(x[::17])
    x = x.astype(np.float32)
    got = lowfp.quantize(torch.from_numpy(x).to(device), lowfp.formats.float8_e4m3fn, "stochastic",
                         seed=seed, offset=offset, sr_bits=sr_bits).cpu().numpy()
    want = [stochastic_exact(float(v), E4M3FN, philox_word(seed, offset, i), sr_bits)
            for i, v in enumerate(x)]
    np.testing.assert_array_equal(got, np.array(want, dtype=np.float32))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sr_bits", [32, 9])
def test_bfloat16_follows_the_specified_stream_exactly(out_dtype, sr_bits):
    """The bfloat16 format from float32 (the CPU kernel's folded form where sr_bits is 32): every
    element as the spec says, subnormals and overflow included, and the counts."""
    rng = np.random.default_rng(sr_bits)
    n = 5003  # three CPU tiles
    x = rng.standard_normal(n) * 2.0 ** rng.integers(-140, 120, n)  # finite in float32
    x[::13] = 3.398e38  # between bfloat16's max and the step above it: overflow or max
    x = x.astype(np.float32)
    stats = lowfp.Stats()
    got = lowfp.quantize(torch.from_numpy(x), lowfp.formats.bfloat16, "stochastic", seed=11,
                         offset=3, sr_bits=sr_bits, stats=stats, out_dtype=out_dtype)
    spec = Spec(8, 7, 0, "ieee")
    bf16_max = float(lowfp.formats.bfloat16.max)
    want = np.array([stochastic_exact(float(v), spec, philox_word(11, 3, i), sr_bits)
                     for i, v in enumerate(x)])
    want = np.where(np.abs(want) > bf16_max, np.copysign(np.inf, want), want)  # overflow to inf
    np.testing.assert_array_equal(got.float().numpy(), want.astype(np.float32))
    assert stats.as_dict() == {"overflow": int(np.isinf(want).sum()), "nan": 0, "numel": n,
                               "underflow": int(((want == 0) & (x != 0)).sum())}
    assert stats.overflow > 0 and stats.underflow > 0


# Formats whose float32 rounding the kernels take by steps (round.hpp's round_stochastic_by_steps:
# True) or by round_bits (False: fnuz has no symmetric overflow form), m = 0 among them.
STEPS_CASES = {
    "fp(4,3,4)": (Spec(4, 3, 4, "none"), True),
    "float8_e5m2": (Spec(5, 2, 0, "ieee"), True),
    "fp(5,0,3)": (Spec(5, 0, 3, "none"), True),
    "fp(6,9,0)": (Spec(6, 9, 0, "none"), True),
    "float8_e4m3fnuz": (Spec(4, 3, 1, "fnuz"), False),
}


def _stochastic_reference(x: np.ndarray, fmt: "lowfp.Format", spec: Spec, seed: int, offset: int,
                          sr_bits: int):
    """(result, counts) of docs/design.md §3 for every element of float32 x: stochastic_exact's
    value, then the overflow policy beyond max, fnuz's unsigned zero, NaN kept."""
    out, counts = [], {"overflow": 0, "underflow": 0, "nan": 0, "numel": len(x)}
    mx = float(fmt.max)
    for i, v in enumerate(x.tolist()):
        if math.isnan(v):
            out.append(v)
            counts["nan"] += 1
            continue
        r = v if math.isinf(v) else stochastic_exact(v, spec, philox_word(seed, offset, i), sr_bits)
        if abs(r) > mx:
            r = {"saturate": math.copysign(mx, v), "inf": math.copysign(math.inf, v),
                 "nan": math.nan}[fmt.overflow]
            counts["overflow"] += 1
        elif r == 0 and v != 0:
            counts["underflow"] += 1
        if r == 0 and spec.unsigned_zero:
            r = 0.0
        out.append(r)
    return np.array(out, dtype=np.float32), counts


def _same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal bit patterns, the sign of zero included; any NaN equals any NaN."""
    nan = np.isnan(want)
    return bool(np.array_equal(np.isnan(got), nan)
                and np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32)))


@pytest.mark.parametrize("sr_bits", [32, 9, 1])
@pytest.mark.parametrize("name", list(STEPS_CASES))
def test_formats_follow_the_specified_stream_exactly(name, sr_bits):
    """float32 inputs across the whole range (carrier subnormals, below the format's smallest step,
    its subnormals, normals, the band above max, infinities, NaN, zeros of both signs): every
    element and the counts as the spec says, and the same as the float64 carrier's rounding."""
    spec, by_steps = STEPS_CASES[name]
    fmt = lowfp.Format.parse(name)
    f32 = DTYPE_CODES[torch.float32]
    params = lowfp._C.round_params(f32, f32, *format_args(fmt, ROUNDING_MODES.index("stochastic"), sr_bits))
    assert params["stochastic_by_steps"] == by_steps  # (the form this case exercises)
    rng = np.random.default_rng(sr_bits)
    n = 5003  # three CPU tiles
    smallest = 2.0 ** (spec.emin - spec.m)
    x = rng.standard_normal(n) * np.exp2(rng.uniform(math.log2(smallest) - 40, math.log2(float(fmt.max)) + 2, n))
    x[::29] = rng.uniform(-1, 1, len(x[::29])) * smallest  # below the smallest step
    x[::31] = rng.uniform(-1, 1, len(x[::31])) * 2.0**-126  # carrier subnormals
    x[::37] = np.round(x[::37])
    x[5:11] = [0.0, -0.0, np.inf, -np.inf, np.nan, float(fmt.max)]
    x = x.astype(np.float32)
    seed, offset = 0x9E3779B97F4A7C15 + sr_bits, 5
    stats = lowfp.Stats()
    got = lowfp.quantize(torch.from_numpy(x), fmt, "stochastic", seed=seed, offset=offset,
                         sr_bits=sr_bits, stats=stats).numpy()
    want, counts = _stochastic_reference(x, fmt, spec, seed, offset, sr_bits)
    assert _same_bits(got, want)
    assert stats.as_dict() == counts
    assert counts["overflow"] > 0 and counts["underflow"] > 0
    wide = lowfp.quantize(torch.from_numpy(x).double(), fmt, "stochastic", seed=seed, offset=offset,
                          sr_bits=sr_bits).float().numpy()
    assert _same_bits(wide, got)


@pytest.mark.parametrize("x", [0.3, 1.0 + 2**-5, -5.1, 300.0, 2.0**-8, 3 * 2.0**-11, -2.0**-10 * 1.7])
def test_only_neighbours_and_unbiased_mean(x):
    """Results are the two neighbours; the mean of many draws is within 5 sigma of x."""
    fmt = lowfp.formats.float8_e4m3fn
    n = 200_000
    xs = torch.full((n,), x, dtype=torch.float64)
    got = lowfp.quantize(xs, fmt, "stochastic", seed=99)
    lo = lowfp.quantize(xs[:1], fmt, "toward_zero").item()
    hi = lowfp.quantize(xs[:1], fmt, "up" if x > 0 else "down").item()
    assert set(got.unique().tolist()) <= {lo, hi}
    p = (abs(x) - abs(lo)) / (abs(hi) - abs(lo)) if hi != lo else 0.0
    sigma = abs(hi - lo) * math.sqrt(p * (1 - p) / n)
    assert abs(got.mean().item() - x) <= 5 * sigma + 1e-12 * abs(x)


def test_sr_bits_sets_the_resolution():
    """With R bits, P(up) = floor(f 2^R) / 2^R: for f = 0.3, R=1 never rounds up, R=2 does 1/4."""
    fmt = lowfp.fp(4, 3, 4)
    x = torch.full((100_000,), 1.0 + 0.3 * 2**-3, dtype=torch.float64)  # f = 0.3 of a 2^-3 step
    up = 1.0 + 2**-3
    frac = {r: (lowfp.quantize(x, fmt, "stochastic", seed=5, sr_bits=r) == up).double().mean().item()
            for r in (1, 2, 3, 32)}
    assert frac[1] == 0.0
    assert abs(frac[2] - 0.25) < 0.01
    assert abs(frac[3] - 0.25) < 0.01  # floor(0.3 * 8) / 8 = 2/8
    assert abs(frac[32] - 0.3) < 0.01


def test_same_bits_for_any_thread_count_and_chunking():
    x = torch.randn(300_001) * 10
    fmt = "fp(5,2,0)"
    ref = lowfp.quantize(x, fmt, "stochastic", seed=1234)
    try:
        for t in (1, 2, 3):
            lowfp.set_num_threads(t)
            assert torch.equal(lowfp.quantize(x, fmt, "stochastic", seed=1234), ref)
    finally:
        lowfp.set_num_threads(0)  # back to following torch
    # chunks that start at multiples of 4 continue the stream with offset = start / 4
    for cuts in ([0, 4, 1000, 77_776, 300_001], [0, 65_536 * 3, 300_001]):
        parts = [lowfp.quantize(x[a:b], fmt, "stochastic", seed=1234, offset=a // 4)
                 for a, b in zip(cuts[:-1], cuts[1:])]
        assert torch.equal(torch.cat(parts), ref)
    # and a non-contiguous view gives the same as its contiguous copy
    assert torch.equal(lowfp.quantize(x[::3], fmt, "stochastic", seed=1234),
                       lowfp.quantize(x[::3].contiguous(), fmt, "stochastic", seed=1234))


def test_seeds_and_generators():
    x = torch.randn(10_000)
    f = lowfp.fp(4, 3, 4)
    a = lowfp.quantize(x, f, "stochastic", seed=1)
    assert not torch.equal(a, lowfp.quantize(x, f, "stochastic", seed=2))
    torch.manual_seed(0)
    b = lowfp.quantize(x, f, "stochastic")
    c = lowfp.quantize(x, f, "stochastic")
    assert not torch.equal(b, c)  # seed=None draws a fresh seed each call
    torch.manual_seed(0)
    assert torch.equal(b, lowfp.quantize(x, f, "stochastic"))
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(lowfp.quantize(x, f, "stochastic", generator=g1),
                       lowfp.quantize(x, f, "stochastic", generator=g2))
    # deterministic modes do not consume the generator
    state = torch.get_rng_state()
    lowfp.quantize(x, f, "nearest")
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("generator", [None, "cpu"])
def test_the_eager_draw_takes_the_words_and_advance_of_torch_randint(generator):
    """The remembered calls' draw (a per-thread buffer filled by random_()) against
    draw_seed (torch.randint(0, 2**32)): the same seeds, words at and above 2**31 included, and
    the generator left where it leaves it."""
    from lowfp._native import draw_seed, draw_seed_eager

    def draws(fn):
        torch.manual_seed(11)
        g = torch.Generator().manual_seed(5) if generator else None
        seeds = [fn(g) for _ in range(2000)]
        return seeds, (torch.get_rng_state() if g is None else g.get_state())

    (want, want_state), (got, got_state) = draws(draw_seed), draws(draw_seed_eager)
    assert got == want and torch.equal(got_state, want_state)
    assert all(0 <= s < 2**64 for s in got)
    assert any(s >> 63 for s in got) and any(s & 0x80000000 for s in got)  # (the words' high bits)


def test_stochastic_in_each_carrier_dtype_agrees():
    """float16/bfloat16/float32/float64 inputs of the same values give the same draws."""
    x32 = (torch.randn(5000) * 4).bfloat16().float()  # representable in every dtype
    want = lowfp.quantize(x32, "fp(4,3,4)", "stochastic", seed=3)
    for dt in (torch.bfloat16, torch.float64):
        got = lowfp.quantize(x32.to(dt), "fp(4,3,4)", "stochastic", seed=3)
        assert torch.equal(got.float(), want)
    x16 = (torch.randn(5000)).half().float()
    want = lowfp.quantize(x16, "fp(4,3,4)", "stochastic", seed=3)
    assert torch.equal(lowfp.quantize(x16.half(), "fp(4,3,4)", "stochastic", seed=3).float(), want)
