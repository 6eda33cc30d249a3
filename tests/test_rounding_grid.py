"""Arbitrary fp(e,m,b) against the exact Fraction reference (docs/design.md §2-3).

Grid: e 2-8, m 0-10, b -3..+6, every specials convention that is valid, subnormals on and off;
every deterministic mode and every overflow policy; float64 and (where the format fits) float32
carriers; counts compared with the reference's events.
"""

import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch

import lowfp
from reference import (DETERMINISTIC, FLOAT32_LIMITS, FLOAT64_LIMITS, Spec, overflow_result,
                       round_exact)
from devices import DEVICES, bit_patterns, cpu_and_gpu, on_cuda, same_bits

POLICIES = ("saturate", "inf", "nan")


def specs_for_e(e):
    for m in range(0, 11):
        for b in range(-3, 7):
            for specials in ("none", "ieee", "fn", "fnuz", "p3109"):
                if (specials == "fn" and m == 0) or (specials == "p3109" and e + m < 2):
                    continue
                for sub in (True, False):
                    s = Spec(e, m, b, specials, sub)
                    if s.fits(*FLOAT64_LIMITS):
                        yield s


def sample_values(spec: Spec, rng: random.Random):
    """Targeted values: grid points, ties, just off ties, near max/min, specials, and random."""
    two = Fraction(2)
    vals = [0.0, -0.0, math.inf, -math.inf, math.nan]
    mx = spec.max
    top_step = two ** (spec.emax - spec.m)
    for v in (mx, mx + top_step / 2, mx + top_step / 2 + top_step / 8, mx + top_step / 2 - top_step / 8,
              mx + top_step, two ** spec.smallest_exp, two ** (spec.smallest_exp - 1),
              two ** (spec.smallest_exp - 1) * Fraction(5, 4), two ** (spec.smallest_exp - 2),
              two ** spec.emin, two ** spec.emin * Fraction(3, 4)):
        vals.append(float(v))
    for _ in range(10):
        e = rng.randint(spec.smallest_exp - 2, spec.emax + 1)
        q = two ** (max(e, spec.emin) - spec.m) if (spec.subnormals or e >= spec.emin) else two ** spec.emin
        base = two ** e
        k = rng.randint(0, 2 ** (spec.m + 1))
        frac = rng.choice([Fraction(0), Fraction(1, 2), Fraction(1, 2) + Fraction(1, 8),
                           Fraction(1, 2) - Fraction(1, 8), Fraction(rng.randint(1, 63), 64)])
        vals.append(float(base + (k + frac) * q if e >= spec.emin else (k + frac) * q))
    return [v if rng.random() < 0.5 else -v for v in vals]


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit patterns, except that any NaN equals any NaN."""
    nan = np.isnan(a) & np.isnan(b)
    return bool(np.all(nan | ((a == b) & (np.signbit(a) == np.signbit(b)))))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("e", range(2, 9))
def test_grid_against_fraction_reference(e, device):
    rng = random.Random(1234 + e)
    checked = 0
    for spec in specs_for_e(e):
        values = sample_values(spec, rng)
        carriers = [torch.float64] + ([torch.float32] if spec.fits(*FLOAT32_LIMITS) else [])
        for dtype in carriers:
            x = torch.tensor(values, dtype=dtype, device=device)
            xs = [float(v) for v in x.tolist()]
            for mode in DETERMINISTIC:
                base = [round_exact(v, spec, mode, "saturate") for v in xs]
                for policy in POLICIES:
                    fmt = lowfp.fp(spec.e, spec.m, spec.b, specials=spec.specials,
                                   subnormals=spec.subnormals, overflow=policy)
                    stats = lowfp.Stats(device)
                    got = lowfp.quantize(x, fmt, mode, stats=stats).cpu()
                    want = [overflow_result(v, spec, mode, policy) if ev == "overflow" else r
                            for v, (r, ev) in zip(xs, base)]
                    want_t = torch.tensor(want, dtype=dtype).numpy()
                    if not same(got.numpy(), want_t):
                        bad = [(v, g, w) for v, g, w in zip(xs, got.tolist(), want)
                               if not same(np.array([g]), np.array([w]))]
                        pytest.fail(f"{fmt} {dtype} {mode}: (x, got, want) {bad[:5]}")
                    events = [ev for _, ev in base]
                    assert stats.as_dict() == {
                        "overflow": events.count("overflow"), "underflow": events.count("underflow"),
                        "nan": events.count("nan"), "numel": len(xs)}, (fmt, dtype, mode)
                    checked += len(xs)
    assert checked > 10000


# On a GPU (tests/devices.py): the CPU's bits, counts and steps.

@on_cuda
@pytest.mark.parametrize("mode", lowfp.ROUNDING_MODES)
def test_grid_matches_cpu(mode):
    x32 = bit_patterns(1 << 16, torch.float32, seed=1)
    x64 = bit_patterns(1 << 16, torch.float64, seed=2)
    for e in range(2, 9):
        for m in (0, 1, 3, 7, 10):
            for b in (-3, 0, 4, 6):
                for specials in ("none", "ieee", "fn", "fnuz"):
                    for sub in (True, False):
                        try:
                            fmt = lowfp.fp(e, m, b, specials=specials, subnormals=sub)
                        except ValueError:
                            continue
                        for x in ((x32, x64) if fmt.fits(torch.float32) else (x64,)):
                            a, b_, ca, cb = cpu_and_gpu(x, fmt, mode, sr_bits=13 if e % 2 else 32)
                            assert same_bits(a, b_) and ca == cb, (str(fmt), mode, x.dtype)
