"""IEEE P3109 formats (lowfp.formats.p3109, names p3109_k{K}p{P}s{e,f}) against gfloat, an
independent implementation: the value sets code by code, and every deterministic rounding mode
with and without saturation on the values around every grid point, past max, and special values."""

import math

import gfloat
import gfloat.formats as gf
import gfloat.types as gt
import numpy as np
import pytest
import torch

import lowfp

CASES = [(k, p, d) for k in range(3, 9) for p in range(1, k) for d in ("extended", "finite")]
MODES = {"nearest": gfloat.RoundMode.TiesToEven, "nearest_away": gfloat.RoundMode.TiesToAway,
         "toward_zero": gfloat.RoundMode.TowardZero, "up": gfloat.RoundMode.TowardPositive,
         "down": gfloat.RoundMode.TowardNegative}


def gfloat_format(k, p, domain):
    return gf.format_info_p3109(k, p, gt.Signedness.Signed,
                                gt.Domain.Extended if domain == "extended" else gt.Domain.Finite)


def finite_values(fi):
    values = [gfloat.decode_float(fi, code).fval for code in range(2 ** fi.k)]
    return sorted({v for v in values if math.isfinite(v)})


def probes(values):
    """Every value, the midpoints and quarter points between neighbours, and beyond max."""
    v = np.array(values, dtype=np.float64)
    gaps = np.diff(v)
    pts = [v, v[:-1] + gaps / 2, v[:-1] + gaps / 4, v[:-1] + 3 * gaps / 4,
           np.array([v[-1] * 1.01, v[-1] * 1.5, v[-1] * 4, 1e30, v[1] / 3, v[1] / 2, v[1] * 0.75])]
    x = np.concatenate(pts)
    return np.concatenate([x, -x, [np.inf, -np.inf, np.nan, 0.0, -0.0]])


@pytest.mark.parametrize("k, p, domain", CASES)
def test_value_sets_equal_gfloats(k, p, domain):
    fmt = lowfp.formats.p3109(k, p, domain)
    fi = gfloat_format(k, p, domain)
    assert fmt == lowfp.Format.parse(fi.name)
    assert (fmt.e, fmt.m, fmt.b) == (k - p, p - 1, 1)
    values = finite_values(fi)
    assert fmt.max == fi.max == values[-1] and fmt.min_subnormal == min(v for v in values if v > 0)
    # every finite value of gfloat's is a value of lowfp's: rounding it changes nothing
    x = torch.tensor(values, dtype=torch.float64)
    assert torch.equal(lowfp.quantize(x, fmt), x)
    if k == 8:
        assert lowfp.formats.named()[fi.name] == fmt


@pytest.mark.parametrize("k, p, domain", CASES)
def test_roundings_equal_gfloats(k, p, domain):
    fmt = lowfp.formats.p3109(k, p, domain)
    fi = gfloat_format(k, p, domain)
    x = probes(finite_values(fi))
    xt = torch.from_numpy(x)
    for mode, rnd in MODES.items():
        for sat in (True, False):
            if domain == "finite" and not sat and mode not in ("nearest", "nearest_away"):
                # gfloat's unsaturated finite domain makes an overflow NaN only where IEEE would
                # give inf (directed modes stop at max); lowfp's "nan" policy makes every
                # overflow NaN (docs/design.md §3)
                continue
            overflow = "saturate" if sat else ("inf" if domain == "extended" else "nan")
            got = lowfp.quantize(xt, fmt, mode, overflow=overflow).numpy()
            want = np.array([gfloat.round_float(fi, float(v), rnd, sat) for v in x])
            same = (got == want) | (np.isnan(got) & np.isnan(want))
            assert same.all(), (fi.name, mode, sat, x[~same][:4], got[~same][:4], want[~same][:4])
            # no negative zero: gfloat's -0 rounds to +0 in every P3109 format
            assert not np.signbit(got[got == 0]).any()
