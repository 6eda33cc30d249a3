"""The fit rule of docs/design.md §2 and the formats at the bottom of a carrier's range.

A format fits a carrier when every one of its values is a carrier value: the grid step
2^(emin - m) included, with subnormals off too (the normals just above 2^emin are that far apart).
The formats whose grid reaches into the carrier's subnormals are the ones an engine gets wrong
most easily, so every (m, emin) at the bottom of each carrier is checked against the exact
Fraction reference, with and without subnormals, in every mode; and every format the old rule
(smallest value instead of grid step) accepted is either exact there or refused by name.
"""

import math
import random
import struct

import numpy as np
import pytest
import torch

import lowfp
from reference import (DETERMINISTIC, FLOAT32_LIMITS, FLOAT64_LIMITS, Spec, philox_word,
                       round_exact, stochastic_exact)

CARRIERS = {torch.float32: FLOAT32_LIMITS, torch.float64: FLOAT64_LIMITS}
SPECIALS = ("none", "ieee", "fn", "fnuz")


def specs_at_the_floor(limits, subnormals):
    """Every valid (e, m, b, specials) whose emin lies within the carrier's subnormal range or
    just above it: the family where the carrier's subnormals decide the rounding."""
    mant_bits, max_exp, smallest = limits
    carrier_emin = smallest + mant_bits
    for e in range(1, 12):
        for m in range(0, mant_bits + 1):
            for specials in SPECIALS:
                if (specials == "ieee" and e < 2) or (specials == "fn" and m < 1):
                    continue
                for emin in range(smallest, carrier_emin + 2):
                    b = 1 - emin - (2 ** (e - 1) - 1)
                    if not -4096 <= b <= 4096:
                        continue
                    s = Spec(e, m, b, specials, subnormals)
                    if s.emax <= max_exp:
                        yield s


def make(s: Spec, **kw) -> lowfp.Format:
    return lowfp.fp(s.e, s.m, s.b, specials=s.specials, subnormals=s.subnormals, **kw)


@pytest.mark.parametrize("dtype", list(CARRIERS))
def test_every_format_of_the_family_fits_exactly_when_its_grid_step_does(dtype):
    limits = CARRIERS[dtype]
    checked = refused = 0
    for subnormals in (True, False):
        for s in specs_at_the_floor(limits, subnormals):
            grid_fits = s.emin - s.m >= limits[2]
            if not s.fits(*FLOAT64_LIMITS):
                with pytest.raises(ValueError, match="finest grid step"):
                    make(s)
                refused += 1
                continue
            f = make(s)
            assert f.fits(dtype) == grid_fits, s
            if not grid_fits:
                assert "finest grid step 2^%d" % (s.emin - s.m) in f.fit_error(dtype)
                refused += 1
            checked += 1
    assert checked > 1000 and refused > 500


def test_a_format_too_fine_for_float32_is_refused_naming_float64():
    f = lowfp.fp(8, 23, 1, subnormals=False)  # the example: grid step 2^-150
    x = torch.tensor([struct.unpack("<f", struct.pack("<I", 0x00600000))[0]])
    with pytest.raises(ValueError, match=r"finest grid step 2\^-150.*out_dtype=torch.float64"):
        lowfp.quantize(x, f, "up")
    # in float64 it rounds exactly: 1.5 * 2^-127 is on its grid, 2^-127 is its smallest normal
    x64 = torch.tensor([1.5 * 2.0**-127, 2.0**-127, 2.0**-128], dtype=torch.float64)
    for mode in DETERMINISTIC:
        got = lowfp.quantize(x64, f, mode).tolist()
        assert got[:2] == [1.5 * 2.0**-127, 2.0**-127], mode
        assert got[2] == (2.0**-127 if mode in ("nearest_away", "up") else 0.0), mode
    with pytest.raises(ValueError, match="finest grid step 2\\^-1075"):
        lowfp.fp(11, 52, 1, subnormals=False)


def carrier_values(dtype, s: Spec, rng: random.Random, n_random: int):
    """Finite values below 2^(emin + 2): the format's grid points and midpoints there, one
    carrier ulp either side of them, and random bit patterns; random signs."""
    mant_bits, _, smallest = CARRIERS[dtype]
    step_exp = s.emin - (s.m if s.subnormals else 0)
    vals = set()
    for k in list(range(0, 6)) + [2 ** s.m - 1, 2 ** s.m, 2 ** s.m + 1, 2 ** (s.m + 1) - 1]:
        for half in (0, 1):
            e = step_exp - half
            if e >= smallest:
                vals.add(math.ldexp(2 * k + half, e - 1 + half) if half else math.ldexp(k, e))
    if dtype == torch.float32:
        pack, unpack, top = "<f", "<I", struct.unpack("<I", struct.pack("<f", math.ldexp(1, s.emin + 2)))[0]
    else:
        pack, unpack, top = "<d", "<Q", struct.unpack("<Q", struct.pack("<d", math.ldexp(1, s.emin + 2)))[0]
    bits = [struct.unpack(unpack, struct.pack(pack, v))[0] for v in vals]
    bits += [b + d for b in bits for d in (-1, 1) if 0 <= b + d <= top]
    bits += [rng.randrange(0, top + 1) for _ in range(n_random)]
    out = [struct.unpack(pack, struct.pack(unpack, b))[0] for b in set(bits)]
    return [v if rng.random() < 0.5 else -v for v in sorted(out)]


def same(got, want) -> bool:
    return all(g == w and math.copysign(1, g) == math.copysign(1, w) for g, w in zip(got, want))


@pytest.mark.parametrize("dtype", list(CARRIERS))
def test_formats_at_the_carrier_floor_round_exactly(dtype):
    """Each (m, emin) at the bottom of the carrier, with and without subnormals: every
    deterministic mode and stochastic rounding against the Fraction reference, with counts."""
    rng = random.Random(7)
    limits = CARRIERS[dtype]
    by_grid = {}
    for subnormals in (True, False):
        for s in specs_at_the_floor(limits, subnormals):
            if s.fits(*limits):
                by_grid.setdefault((s.m, s.emin, subnormals), []).append(s)
    assert len(by_grid) > (300 if dtype == torch.float32 else 2000)
    seed = 99
    for _, specs in sorted(by_grid.items()):
        s = rng.choice(specs)  # e and specials only move the top of the range
        xs = carrier_values(dtype, s, rng, 8)
        x = torch.tensor(xs, dtype=dtype)
        for mode in DETERMINISTIC:
            stats = lowfp.Stats()
            got = lowfp.quantize(x, make(s, overflow="saturate"), mode, stats=stats).tolist()
            ref = [round_exact(v, s, mode, "saturate") for v in xs]
            want = [r for r, _ in ref]
            if not same(got, want):
                bad = [(v, g, w) for v, g, w in zip(xs, got, want) if not same([g], [w])]
                pytest.fail(f"{make(s)} {dtype} {mode}: (x, got, want) {bad[:4]}")
            assert stats.as_dict()["underflow"] == sum(ev == "underflow" for _, ev in ref), (s, mode)
        got = lowfp.quantize(x, make(s), "stochastic", seed=seed).tolist()
        want = [stochastic_exact(v, s, philox_word(seed, 0, i)) for i, v in enumerate(xs)]
        if s.specials == "fnuz":  # nor fnuz's unsigned zero
            want = [w if w != 0 else 0.0 for w in want]
        below_max = [abs(v) <= s.max for v in xs]  # stochastic_exact knows no overflow
        assert same([g for g, k in zip(got, below_max) if k],
                    [w for w, k in zip(want, below_max) if k]), (make(s), dtype)


def gfloat_format(e: int, b: int):
    """fp(e, 0, b) (specials none) as a gfloat format: precision 1, every code finite."""
    import gfloat
    return gfloat.FormatInfo(f"fp({e},0,{b})", k=1 + e, precision=1, bias=2 ** (e - 1) - 1 + b,
                             is_signed=True, domain=gfloat.Domain.Finite, has_nz=True,
                             num_high_nans=0, has_subnormals=True, is_twos_complement=False)


@pytest.mark.parametrize("e,b", [(1, 0), (2, 0), (2, 3), (3, -1), (4, 0), (5, 7), (8, -3), (8, 0)])
def test_m0_ties_go_to_the_even_code_as_gfloat(e, b):
    gfloat = pytest.importorskip("gfloat")
    fi = gfloat_format(e, b)
    f = lowfp.fp(e, 0, b)
    assert fi.max == f.max
    values = sorted({float(gfloat.decode_float(fi, c).fval) for c in range(2 ** e)})
    pts = [0.0] + values + [2 * values[-1], 4 * values[-1]]
    xs = set(pts)
    for lo, hi in zip(pts[:-1], pts[1:]):
        mid = (lo + hi) / 2
        xs.update([mid, np.nextafter(mid, 0.0), np.nextafter(mid, math.inf), (lo + 3 * hi) / 4])
    xs = sorted(xs) + [-v for v in sorted(xs)]
    x = torch.tensor(xs, dtype=torch.float64)
    # gfloat computes in float64 (its TiesToAway tests delta + 0.5 >= 1, which rounds one ulp
    # below a tie up, and its directed modes lose float64 subnormals), so only its nearest and
    # toward_zero are compared; every mode is checked against the Fraction reference below.
    for mode, rnd in (("nearest", gfloat.RoundMode.TiesToEven),
                      ("toward_zero", gfloat.RoundMode.TowardZero)):
        want = [gfloat.round_float(fi, v, rnd, sat=True) for v in xs]
        got = lowfp.quantize(x, f, mode).tolist()
        assert same(got, want), (f, mode, [(v, g, w) for v, g, w in zip(xs, got, want) if g != w][:4])
        if not f.fits(torch.float32):
            continue
        x32 = x.float()
        want32 = [gfloat.round_float(fi, v, rnd, sat=True) for v in x32.tolist()]
        assert same(lowfp.quantize(x32, f, mode).tolist(), want32), (f, mode, "float32")
    spec = Spec(e, 0, b)
    for mode in DETERMINISTIC:
        want = [round_exact(v, spec, mode, "saturate")[0] for v in xs]
        assert same(lowfp.quantize(x, f, mode).tolist(), want), (f, mode)
    # ties really occur: x = 3 sits between 2 (code 2) and 4 (code 3) in fp(2,0,0)
    if (e, b) == (2, 0):
        assert lowfp.quantize(torch.tensor([3.0, 1.5, 0.5]), f).tolist() == [2.0, 2.0, 0.0]
