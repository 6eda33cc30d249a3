"""S2FP8 (docs/design.md §4) against a float64 reference of its equations written here.

Reference: mu = mean log2|x| (math.fsum), m = max log2|x| over finite nonzero x, alpha =
log_max / (m - mu), beta = -alpha mu, Y = sign(x) 2^(alpha log2|x| + beta), Y rounded to the
format (ml_dtypes for float8_e5m2 to nearest; lowfp.quantize, tested against exact references
elsewhere, for other formats and modes), x' = sign(Y_r) 2^((log2|Y_r| - beta) / alpha) in float64,
then cast to x's dtype.

Bound stated and checked: lowfp computes log2 and exp2 with its own deterministic double
routines (a few ulp from numpy's), so its float64 x' is within 1e-13 relative of the reference's
(the exponent (log2|Y_r| - beta) / alpha is up to ~1000 in size, and an ulp of it moves 2^t by
~1e-13 relative); after the final cast to a narrower dtype the results are equal except where the
reference lies that close to a rounding boundary, where they differ by one ulp of that dtype.
"""

import math
import pickle

import ml_dtypes
import numpy as np
import pytest
import torch

import lowfp
from devices import bit_patterns, on_cuda, same_bits

FP8 = "float8_e5m2"


def reference(x: np.ndarray, log_max=15.0, fmt=FP8, rounding="nearest", seed=None):
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    use = np.isfinite(a) & (a > 0)
    logs = np.log2(a[use])
    if logs.size == 0:
        return dict(alpha=1.0, beta=0.0, mu=0.0, m=0.0, y=None, xr=x.copy(), use=use)
    mu = math.fsum(logs) / logs.size
    m = float(logs.max())
    if m - mu > 2.0 ** -32:
        alpha = log_max / (m - mu)
        beta = -alpha * mu
    else:  # one magnitude (lowfp's threshold: 2^-32 of a binade)
        alpha, beta = 1.0, -mu
    y = np.zeros_like(x)
    with np.errstate(over="ignore"):
        y[use] = np.sign(x[use]) * np.exp2(alpha * logs + beta)
    if fmt == FP8 and rounding == "nearest":
        yr = y.astype(ml_dtypes.float8_e5m2).astype(np.float64)
    else:
        yr = lowfp.quantize(y, fmt, rounding, seed=seed)
    xr = x.copy()
    back = use & np.isfinite(yr) & (yr != 0)
    with np.errstate(over="ignore"):
        xr[back] = np.sign(yr[back]) * np.exp2((np.log2(np.abs(yr[back])) - beta) * (1.0 / alpha))
    xr[use & ~back] = yr[use & ~back]
    return dict(alpha=alpha, beta=beta, mu=mu, m=m, y=y, yr=yr, xr=xr, use=use)


def check_stats(st, ref):
    for name in ("alpha", "beta", "mu", "m"):
        # mu is summed in 2^-48 steps of log2: up to 2^-49 absolute besides the relative error.
        assert getattr(st, name) == pytest.approx(ref[name], rel=1e-12, abs=2.0 ** -45), name


def ulps_apart(a: np.ndarray, b: np.ndarray, dtype) -> np.ndarray:
    """Distance in ulps of `dtype` between two arrays of that dtype (finite, same sign)."""
    it = {np.float32: np.int32, np.float64: np.int64, np.float16: np.int16}[dtype]
    return np.abs(a.astype(dtype).view(it).astype(np.int64) - b.astype(dtype).view(it).astype(np.int64))


def gradients_like(n, seed=0):
    g = np.random.default_rng(seed)
    return (g.standard_normal(n) * 2.0 ** -20).astype(np.float32)


def activations_like(n, seed=1):
    g = np.random.default_rng(seed)
    return (np.sign(g.standard_normal(n)) * np.exp2(g.uniform(-10, 10, n))).astype(np.float32)


@pytest.mark.parametrize("make", [gradients_like, activations_like])
def test_float32_against_reference(make):
    x = make(1 << 20)
    y, st = lowfp.s2fp8_quantize(torch.from_numpy(x))
    ref = reference(x)
    check_stats(st, ref)
    assert st.count == x.size and st.numel == x.size
    want = ref["xr"].astype(np.float32)
    got = y.numpy()
    d = ulps_apart(got, want, np.float32)
    assert d.max() <= 1
    assert (d == 0).mean() > 0.999  # equal except at float32 rounding boundaries
    # log2|Y| has mean 0 and max log_max before rounding.
    assert st.alpha * ref["mu"] + st.beta == pytest.approx(0.0, abs=1e-9)
    assert st.alpha * ref["m"] + st.beta == pytest.approx(15.0, rel=1e-12)


def test_numpy_out():
    x = activations_like(1000).astype(np.float32)
    want, st = lowfp.s2fp8_quantize(x)
    for out in (np.empty(1000, np.float32), np.empty(2000, np.float32)[::-2],
                np.empty(1000, ">f4")):
        got, st2 = lowfp.s2fp8_quantize(x, out=out)
        assert got is out and np.array_equal(out, want) and st2.as_dict() == st.as_dict()
    with pytest.raises(ValueError, match="out has dtype torch.float64"):  # as for tensors
        lowfp.s2fp8_quantize(x, out=np.empty(1000))
    with pytest.raises(ValueError, match="out has shape"):
        lowfp.s2fp8_quantize(x, out=np.empty(10, np.float32))


def test_float64_spanning_more_than_float32_range():
    g = np.random.default_rng(2)
    logs = np.concatenate([g.uniform(-1000, -900, 2000), g.normal(0, 60, 198_000)])
    x = np.sign(g.standard_normal(logs.size)) * np.exp2(logs)  # magnitudes 2^-1000 .. 2^250
    stats = lowfp.Stats()
    y, st = lowfp.s2fp8_quantize(x, stats=stats)
    assert isinstance(y, np.ndarray) and y.dtype == np.float64
    ref = reference(x)
    check_stats(st, ref)
    nz = ref["xr"] != 0
    assert np.array_equal(y == 0, ~nz)  # the same elements underflow in Y
    rel = np.abs(y[nz] - ref["xr"][nz]) / np.abs(ref["xr"][nz])
    assert rel.max() < 1e-13
    # Y's underflows are counted: finite nonzero x whose Y rounds to zero.
    assert stats.underflow == int((ref["use"] & (ref["yr"] == 0)).sum()) > 0
    assert stats.overflow == 0 and stats.nan == 0 and stats.numel == x.size


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_inputs(dtype):
    x = torch.from_numpy(activations_like(100_000) / 64).to(dtype)
    y, st = lowfp.s2fp8_quantize(x)
    assert y.dtype == dtype
    ref = reference(x.double().numpy())
    check_stats(st, ref)
    want = torch.from_numpy(ref["xr"]).to(dtype)  # torch rounds float64 to 16 bits directly
    diff = (y.float() - want.float()).abs()
    ulp = torch.from_numpy(np.spacing(np.abs(want.float().numpy())))
    one_ulp = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    assert bool((diff <= want.float().abs() * one_ulp + ulp).all())
    assert (y == want).float().mean().item() > 0.999


@pytest.mark.parametrize("fmt,rounding,log_max", [
    ("float8_e4m3fn", "nearest", 8.0),
    ("fp(4,3,4)", "nearest", 4.0),
    (FP8, "toward_zero", 15.0),
    (FP8, "up", 15.0),
    (FP8, "down", 12.0),
    (FP8, "nearest_away", 15.0),
    (FP8, "stochastic", 15.0),
    ("float8_e4m3fn", "stochastic", 8.0),
])
def test_other_formats_and_modes(fmt, rounding, log_max):
    x = activations_like(200_000, seed=3)
    y, st = lowfp.s2fp8_quantize(torch.from_numpy(x), fmt, log_max=log_max, rounding=rounding,
                                 seed=11)
    ref = reference(x, log_max, fmt, rounding, seed=11)
    check_stats(st, ref)
    d = ulps_apart(y.numpy(), ref["xr"].astype(np.float32), np.float32)
    assert d.max() <= 1 and (d == 0).mean() > 0.999


def test_stochastic_depends_on_seed_only():
    x = torch.from_numpy(gradients_like(300_000))
    a, _ = lowfp.s2fp8_quantize(x, rounding="stochastic", seed=5)
    b, _ = lowfp.s2fp8_quantize(x, rounding="stochastic", seed=5)
    c, _ = lowfp.s2fp8_quantize(x, rounding="stochastic", seed=6)
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(1)
    d, _ = lowfp.s2fp8_quantize(x, rounding="stochastic")
    torch.manual_seed(1)
    e, _ = lowfp.s2fp8_quantize(x, rounding="stochastic")
    assert torch.equal(d, e)


def test_results_do_not_depend_on_thread_count():
    x = torch.from_numpy(activations_like(1 << 20, seed=4))
    try:
        outs = []
        for n in (1, 2, 3):
            lowfp.set_num_threads(n)
            y, st = lowfp.s2fp8_quantize(x, rounding="stochastic", seed=3)
            outs.append((y, st.sums.clone(), st.params.clone()))
    finally:
        lowfp.set_num_threads(0)  # back to following torch
    for y, sums, params in outs[1:]:
        assert torch.equal(y, outs[0][0])
        assert torch.equal(sums, outs[0][1]) and torch.equal(params, outs[0][2])


def _reduction_sums_model(x):
    """The reduction's five integer sums for numpy x, from s2fp8.hpp's definition: exponents
    summed, significands multiplied per group of 128 (lane i % 8, row i // 8, rows paired as a
    binary tree), one fixed-point log2 (lowfp's log2_det, 2^-48 steps) per lane product."""
    n = x.size
    a = np.abs(x.astype(np.float64))
    use = np.isfinite(a) & (a > 0)
    mant, exp = np.frexp(np.where(use, a, 1.0))
    f, e = np.where(use, 2 * mant, 1.0), np.where(use, exp - 1, 0)
    rows = np.concatenate([f, np.ones(-n % 128)]).reshape(-1, 16, 8)
    while rows.shape[1] > 1:
        rows = rows[:, 0::2, :] * rows[:, 1::2, :]
    total = sum(int(lowfp._C.log2_det(float(p)) * 2.0 ** 48 + 0.5) for p in rows.ravel())
    max_bits = int(np.float64(a[use].max()).view(np.int64)) if use.any() else 0
    return [total >> 32, total & 0xFFFFFFFF, int(use.sum()), max_bits, int(e.sum())]


@pytest.mark.parametrize("n", [1, 127, 129, 2048 * 3 + 77])
def test_reduction_sums_follow_their_definition(n):
    x = _mixed_tensor(n, torch.float32, seed=n).numpy()
    x[::13] = np.float32(1e-42)  # float32 subnormals
    _, st = lowfp.s2fp8_quantize(torch.from_numpy(x))
    assert st.sums.tolist() == _reduction_sums_model(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("special", [None, "subnormal", "inf", "nan", "huge"])
def test_reduction_sums_with_specials_in_one_tile(dtype, special):
    """The CPU loop takes a shorter path for a tile of zeros and float32 normals only and redoes
    a tile that holds a float32 subnormal, an infinity or a NaN: sums with one such element in
    one tile (the others plain, zeros among them) against the model."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(512 * 9 + 100, generator=g) * 2.0 ** -10).to(dtype)
    x[::37] = 0.0
    x[5::41] = -0.0
    value = {None: None, "subnormal": 1e-42, "inf": -float("inf"), "nan": float("nan"),
             "huge": 3e38}[special]
    if value is not None:
        x[512 * 4 + 300] = value  # a float16 rounds 1e-42 to 0 and 3e38 to inf; both are covered
    _, st = lowfp.s2fp8_quantize(x)
    assert st.sums.tolist() == _reduction_sums_model(x.double().numpy())


def _mixed_tensor(n, dtype, seed):
    """Magnitudes over several binades plus a cluster 2^-20 below the rest (whose Y underflows),
    both signs, zeros of both signs, infinities and NaN of both signs with random payloads, quiet
    and signalling (the float64 path quiets them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-4, 4, (n,), generator=g).double())
    x[5::10] *= 2.0 ** -20
    x[::97] = 0.0
    x[1::97] = -0.0
    x[2::501] = float("inf")
    x[3::503] = -float("inf")
    x = x.to(dtype)
    bits = x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
    width = 8 * x.element_size()
    mant = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}[dtype]
    nans = bits[4::509]
    payload = torch.randint(1, 1 << min(mant, 30), nans.shape, generator=g).to(bits.dtype)
    sign = torch.randint(0, 2, nans.shape, generator=g).to(bits.dtype) << (width - 1)
    bits[4::509] = sign | (((1 << (width - 1 - mant)) - 1) << mant) | payload
    assert x[4::509].isnan().all()
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_threshold_path_equals_float64_path(dtype, monkeypatch):
    """For float32 and 16-bit x in the deterministic modes, the CPU reads x' from per-call
    intervals of |x| (s2fp8_thresholds.cpp; docs/design.md §4 unchanged): every output bit, count and
    statistic must equal the float64 path's, for every deterministic mode, overflow policy and a
    range of formats (fp(6,9,0) is too fine for the threshold form and float64 x has none: those
    compare the float64 path with itself)."""
    x = _mixed_tensor(6000, dtype, seed=11)
    cases = [(f, r, o) for f in ("float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz", "fp(4,3,4)",
                                 lowfp.fp(5, 2, 0, subnormals=False), "fp(6,9,0)")
             for r in ("nearest", "nearest_away", "toward_zero", "up", "down")
             for o in ("saturate", "inf", "nan")]
    compared = 0
    for fmt, rounding, overflow in cases:
        results = []
        for wide in ("0", "1"):
            monkeypatch.setenv("LOWFP_S2FP8_FLOAT64", wide)
            stats = lowfp.Stats()
            try:
                y, st = lowfp.s2fp8_quantize(x, fmt, log_max=12.0, rounding=rounding,
                                             overflow=overflow, stats=stats)
            except ValueError:  # an overflow policy the format cannot express
                break
            bits = y.view(torch.int16 if y.element_size() == 2 else
                          torch.int32 if y.element_size() == 4 else torch.int64)
            results.append((bits, st.params.clone(), (stats.overflow, stats.underflow, stats.nan)))
        if len(results) < 2:
            continue
        (b0, p0, c0), (b1, p1, c1) = results
        assert torch.equal(b0, b1), (fmt, rounding, overflow, int((b0 != b1).sum()))
        assert torch.equal(p0, p1) and c0 == c1, (fmt, rounding, overflow, c0, c1)
        compared += 1
    assert compared >= 60
    # the mixture really makes Y underflow, and overflow beyond the infinite elements
    monkeypatch.setenv("LOWFP_S2FP8_FLOAT64", "0")
    stats = lowfp.Stats()
    lowfp.s2fp8_quantize(x, "fp(4,3,4)", log_max=12.0, stats=stats)
    infinite = int(torch.isinf(x).sum())
    assert stats.underflow > 100 and stats.overflow > infinite + 100 and stats.nan >= 1


def _s2fp8_both_paths(x, monkeypatch, **kw):
    """(bits, params, counts) of one S2FP8 call on the default path, then on the float64 path."""
    results = []
    for wide in ("0", "1"):
        monkeypatch.setenv("LOWFP_S2FP8_FLOAT64", wide)
        stats = lowfp.Stats()
        y, st = lowfp.s2fp8_quantize(x, stats=stats, **kw)
        bits = y.view(torch.int16 if y.element_size() == 2 else torch.int32)
        results.append((bits, st.params.clone(), (stats.overflow, stats.underflow, stats.nan)))
    monkeypatch.setenv("LOWFP_S2FP8_FLOAT64", "0")
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stochastic_fast_form_float32_subnormals(dtype, monkeypatch):
    """x around float32's smallest normal, most of it subnormal (bfloat16 has the same range),
    which the fast form scales into the normal range: every bit and count must equal the float64
    path's; Y of most elements is nonzero, so a wrong logarithm of a subnormal would show."""
    g = torch.Generator().manual_seed(3)
    n = 4000
    low = -140 if dtype == torch.float32 else -133  # (bfloat16's smallest subnormal: 2^-133)
    x = torch.exp2(torch.empty(n, dtype=torch.float64).uniform_(low, low + 12, generator=g))
    x = (x * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()).to(dtype)
    subnormal = (x != 0) & (x.abs() < torch.finfo(torch.float32).tiny)
    assert subnormal.sum() > n // 2
    for fmt in ("float8_e5m2", "float8_e4m3fn"):
        (b0, p0, c0), (b1, p1, c1) = _s2fp8_both_paths(x, monkeypatch, fmt=fmt, log_max=8.0,
                                                       rounding="stochastic", seed=5)
        assert torch.equal(b0, b1), (fmt, int((b0 != b1).sum()))
        assert torch.equal(p0, p1) and c0 == c1, (fmt, c0, c1)
        assert (b0[subnormal] != 0).sum() > subnormal.sum() // 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_stochastic_fast_form_equals_float64_path(dtype, monkeypatch):
    """With stochastic rounding, float32 and 16-bit x take a float32 form of the transform
    (lowfp/s2fp8_stochastic.hpp) that hands the elements it cannot decide to the float64 path:
    every output bit, count and statistic must equal the float64 path's, for a range of formats
    (fnuz, no subnormals, fp(6,9,0) which is too fine for the form), overflow policies (log_max
    above the format's range makes Y overflow), random-bit counts (the form keeps the top 24 of
    32 random bits, all of 24 or 3) and seeds."""
    x = _mixed_tensor(6000, dtype, seed=12)
    cases = [(f, o, r) for f in ("float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz", "fp(4,3,4)",
                                 lowfp.fp(5, 2, 0, subnormals=False), "fp(6,9,0)")
             for o in ("saturate", "inf", "nan") for r in (32, 24, 3)]
    compared = 0
    for fmt, overflow, sr_bits in cases:
        try:
            (b0, p0, c0), (b1, p1, c1) = _s2fp8_both_paths(
                x, monkeypatch, fmt=fmt, log_max=12.0, rounding="stochastic", overflow=overflow,
                sr_bits=sr_bits, seed=compared)
        except ValueError:  # an overflow policy the format cannot express
            continue
        assert torch.equal(b0, b1), (fmt, overflow, sr_bits, int((b0 != b1).sum()))
        assert torch.equal(p0, p1) and c0 == c1, (fmt, overflow, sr_bits, c0, c1)
        compared += 1
    assert compared >= 24
    stats = lowfp.Stats()  # the mixture makes Y underflow and overflow
    lowfp.s2fp8_quantize(x, "fp(4,3,4)", log_max=12.0, rounding="stochastic", seed=1, stats=stats)
    assert stats.underflow > 100 and stats.overflow > int(torch.isinf(x).sum()) + 100


@pytest.mark.parametrize("spread", [20.0, 0.25, 0.05])
def test_stochastic_fast_form_bands_hold(spread, monkeypatch):
    """The float32 form decides an element only when g + r' is farther from an integer than twice
    its error bound (s2fp8_stochastic.cpp). A bound too small by a factor of 2 would leave about
    one element in a thousand on the wrong side: 2^20 elements per case, alpha from ~0.8 to ~600
    (magnitudes spanning `spread` binades), all must equal the float64 path. Outliers 2^-40 below
    put Y far below the format (with alpha ~100, below float64's range: the float64 path decides
    those)."""
    g = torch.Generator().manual_seed(int(spread * 100))
    n = 1 << 20
    x = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * spread - 10.0)
    x = (x * torch.sign(torch.randn(n, generator=g, dtype=torch.float64))).float()
    x[::4099] *= 2.0 ** -40
    for fmt, log_max in (("float8_e5m2", 15.0), ("float8_e4m3fn", 8.0)):
        (b0, p0, c0), (b1, p1, c1) = _s2fp8_both_paths(x, monkeypatch, fmt=fmt, log_max=log_max,
                                                       rounding="stochastic", seed=3)
        assert torch.equal(p0, p1) and c0 == c1
        assert torch.equal(b0, b1), (fmt, float(p0[0]), int((b0 != b1).sum()))


@pytest.mark.parametrize("fmt,log_max", [("float8_e5m2", 15.0), ("float8_e4m3fn", 8.0),
                                         (lowfp.fp(5, 2, 0, subnormals=False), 15.0)])
def test_stochastic_fast_form_at_binade_boundaries(fmt, log_max, monkeypatch):
    """Where t = log2|Y| is within its float32 error of an integer, the float32 form may measure
    g in the steps of the binade on the other side; it has no band for that, as the index before
    the floor is the same continuous function of Y in both binades (s2fp8_stochastic.cpp).
    Elements within 1024 ulp of the preimage of every power of two 2^B, |B| < log_max (emin
    among them), each drawn 8 times, both signs: t within 2^-10 of B, tens of them per B within
    its error bound (~2^-17) of B. All must equal the float64 path. (Taking the wrong binade for
    t up to 2^-10 below B, where the index errs by more than band_w, fails here by the dozen.)
    The powers are symmetric about t = 0, so the placed elements leave mu (and the maximum) as
    the base's and the placement needs no iteration."""
    f = lowfp.formats.to_format(fmt)
    base = activations_like(20_000, seed=4).astype(np.float32)
    _, st = lowfp.s2fp8_quantize(torch.from_numpy(base), fmt, log_max=log_max)
    powers = np.arange(-int(log_max) + 1, int(log_max))
    assert f.emin in powers
    offsets = np.arange(-1024, 1025, dtype=np.int32)
    pre = np.exp2((powers - st.beta) / st.alpha).astype(np.float32)
    placed = (pre.view(np.int32)[:, None] + offsets).reshape(-1).view(np.float32)
    x = np.concatenate([base, np.tile(np.concatenate([placed, -placed]), 8)])
    (b0, p0, c0), (b1, p1, c1) = _s2fp8_both_paths(torch.from_numpy(x), monkeypatch, fmt=fmt,
                                                   log_max=log_max, rounding="stochastic", seed=8)
    assert torch.equal(p0, p1) and c0 == c1
    assert torch.equal(b0, b1), int((b0 != b1).sum())
    # the placed elements straddle the powers of two under the statistics of x itself
    alpha, beta = float(p0[0]), float(p0[1])
    t = alpha * np.log2(placed.astype(np.float64)) + beta - np.repeat(powers, offsets.size)
    t = t.reshape(powers.size, offsets.size)
    assert (t[:, 0] < 0).all() and (t[:, -1] > 0).all() and np.abs(t).max() < 2.0 ** -10
    assert ((np.abs(t) < 2.0 ** -17).sum(axis=1) >= 10).all()


def _near_boundaries(x, fmt, rounding, log_max):
    """Magnitudes of x's dtype within 3 ulp of the preimage, under x's own statistics, of every
    boundary between two results of rounding Y (midpoints for nearest, values for toward_zero)
    up to 2^log_max, both signs."""
    _, st = lowfp.s2fp8_quantize(torch.from_numpy(x), fmt, log_max=log_max, rounding=rounding)
    f = lowfp.formats.to_format(fmt)
    grid = np.unique(lowfp.quantize(np.exp2(np.linspace(math.log2(f.smallest) - 1,
                                                        math.log2(f.max) + 1, 200_000)), fmt))
    grid = grid[np.isfinite(grid)]  # every value of the format from its smallest to its max
    bounds = (grid[1:] + grid[:-1]) / 2 if rounding == "nearest" else grid[1:]
    # |Y| <= 2^log_max: a preimage of a boundary above would become the new max and move alpha
    bounds = bounds[bounds < 2.0 ** log_max * 0.99]
    pre = np.exp2((np.log2(bounds) - st.beta) / st.alpha).astype(x.dtype)
    near = [pre]
    for _ in range(3):
        near = [np.nextafter(near[0], x.dtype.type(0))] + near + [np.nextafter(near[-1], x.dtype.type(np.inf))]
    m = np.concatenate(near)
    assert np.isfinite(m).all() and (m > 0).all()  # (the reshape in the test relies on it)
    return np.concatenate([m, -m])


@pytest.mark.parametrize("fmt,rounding,log_max,dtype", [
    (FP8, "nearest", 15.0, np.float32),
    (FP8, "toward_zero", 15.0, np.float32),
    ("float8_e4m3fn", "nearest", 8.0, np.float32),
    (FP8, "nearest", 15.0, np.float16),
])
def test_threshold_path_at_the_thresholds(fmt, rounding, log_max, dtype, monkeypatch):
    """Elements placed within 3 ulp of every rounding boundary's preimage, where the threshold
    form's search decides: the output bits and counts must still equal the float64 path's. The
    statistics include the placed elements, so placing is repeated until they are stable (moving
    elements by an ulp changes mu by ~1e-13, far less than an ulp of the preimages)."""
    base = (activations_like(50_000, seed=9) / (64 if dtype == np.float16 else 1)).astype(dtype)
    x = base
    for _ in range(8):  # each round moves the statistics ~30 times less than the one before
        x = np.concatenate([base, _near_boundaries(x, fmt, rounding, log_max)])
    results = []
    for wide in ("0", "1"):
        monkeypatch.setenv("LOWFP_S2FP8_FLOAT64", wide)
        stats = lowfp.Stats()
        y, st = lowfp.s2fp8_quantize(torch.from_numpy(x), fmt, log_max=log_max, rounding=rounding,
                                     stats=stats)
        results.append((y, st.params.clone(), (stats.overflow, stats.underflow, stats.nan)))
    (y0, p0, c0), (y1, p1, c1) = results
    assert torch.equal(p0, p1) and c0 == c1
    assert torch.equal(y0.view(torch.int32 if dtype == np.float32 else torch.int16),
                       y1.view(torch.int32 if dtype == np.float32 else torch.int16))
    # the placed elements straddle the boundaries: of the 7 around a boundary, the first and the
    # last have different results (for float16, whose ulp is coarser, most do)
    placed = y0[base.size:].float().numpy()
    around = placed[: placed.size // 2].reshape(7, -1)
    straddled = (around[0] != around[-1]).mean()
    assert straddled > (0.99 if dtype == np.float32 else 0.5), straddled


def test_zeros_signs_nan_inf():
    x = torch.tensor([0.0, -0.0, 1e-3, -2e-3, float("nan"), float("inf"), -float("inf"), 5.0, -7.0])
    stats = lowfp.Stats()
    y, st = lowfp.s2fp8_quantize(x, stats=stats)
    assert st.count == 4  # finite nonzero only
    assert y[0].item() == 0 and math.copysign(1, y[0].item()) == 1
    assert y[1].item() == 0 and math.copysign(1, y[1].item()) == -1
    assert math.isnan(y[4].item()) and y[5].item() == math.inf and y[6].item() == -math.inf
    assert bool((torch.sign(y[2:4]) == torch.sign(x[2:4])).all()) and y[8].item() < 0
    assert stats.nan == 1 and stats.overflow == 2 and stats.numel == 9
    ref = reference(x.numpy())
    check_stats(st, ref)


def test_no_finite_nonzero_element():
    for x in (torch.zeros(10), torch.tensor([0.0, float("nan"), -float("inf")]), torch.empty(0)):
        y, st = lowfp.s2fp8_quantize(x)
        assert (st.alpha, st.beta, st.count) == (1.0, 0.0, 0)
        assert torch.equal(y.isnan(), x.isnan())
        assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(x)) and y.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_one_repeated_magnitude(dtype):
    x = torch.tensor([3.3e-3, -3.3e-3] * 500, dtype=dtype)
    y, st = lowfp.s2fp8_quantize(x)
    assert st.alpha == 1.0 and st.beta == pytest.approx(-math.log2(abs(x[0].item())), rel=1e-12)
    if dtype == torch.float64:
        assert torch.allclose(y, x, rtol=1e-14, atol=0)
    else:
        assert torch.equal(y, x)


def test_layouts_out_and_inplace():
    base = torch.from_numpy(activations_like(40_000, seed=5)).reshape(200, 200)
    view = base.t()[::2]  # non-contiguous
    want, st_want = lowfp.s2fp8_quantize(view.contiguous())
    got, st = lowfp.s2fp8_quantize(view)
    assert torch.equal(got, want) and torch.equal(st.params, st_want.params)
    out = torch.empty(100, 200).t()
    r, _ = lowfp.s2fp8_quantize(view, out=out.t())
    assert torch.equal(r, want)
    x0 = torch.tensor(5.0)
    assert lowfp.s2fp8_quantize(x0)[0].shape == ()
    c = view.clone()
    lowfp.quantize_(c, lowfp.S2FP8())
    assert torch.equal(c, want)
    keep = base.clone()
    lowfp.s2fp8_quantize(base)
    assert torch.equal(base, keep)  # the input is not modified


def test_quantize_accepts_s2fp8_as_a_format():
    x = torch.from_numpy(gradients_like(10_000))
    want, _ = lowfp.s2fp8_quantize(x, "float8_e4m3fn", log_max=8)
    spec = lowfp.S2FP8("float8_e4m3fn", log_max=8)
    assert torch.equal(lowfp.quantize(x, spec), want)
    assert torch.equal(lowfp.quantize(x, str(spec)), want)
    assert torch.equal(lowfp.quantize(x, "s2fp8"), lowfp.s2fp8_quantize(x)[0])
    assert lowfp.S2FP8.parse(str(spec)) == spec and hash(lowfp.S2FP8()) == hash(lowfp.S2FP8.parse("s2fp8"))
    assert pickle.loads(pickle.dumps(spec)) == spec and spec.bits == 8
    assert torch.equal(lowfp.s2fp8_quantize(x, spec)[0], want)


def test_gradients():
    x = torch.from_numpy(gradients_like(1000)).requires_grad_()
    up = torch.from_numpy(activations_like(1000))
    y, _ = lowfp.s2fp8_quantize(x)
    y.backward(up)
    assert torch.equal(x.grad, up)  # straight through
    x.grad = None
    y, _ = lowfp.s2fp8_quantize(x, truncate_grad=True)
    y.backward(up)
    assert torch.equal(x.grad, lowfp.s2fp8_quantize(up)[0]) and not torch.equal(x.grad, up)
    x.grad = None
    lowfp.quantize(x, "s2fp8", grad_fmt="s2fp8").backward(up)
    assert torch.equal(x.grad, lowfp.s2fp8_quantize(up)[0])


def test_bad_arguments():
    x = torch.ones(4)
    with pytest.raises(ValueError, match="log_max"):
        lowfp.s2fp8_quantize(x, log_max=-1)
    with pytest.raises(TypeError, match="log_max"):
        lowfp.S2FP8(log_max="15")
    with pytest.raises(ValueError, match="dtype"):
        lowfp.s2fp8_quantize(x, out=torch.empty(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="out_dtype"):
        lowfp.quantize(x, "s2fp8", out_dtype=torch.float64)
    with pytest.raises(TypeError, match="x must have dtype"):
        lowfp.s2fp8_quantize(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="rounding"):
        lowfp.s2fp8_quantize(x, rounding="bad")
    with pytest.raises(ValueError, match="S2FP8"):
        lowfp.quantize(x, "S2FP8(float8_e5m2")
    with pytest.raises(ValueError, match="conflicts"):
        lowfp.s2fp8_quantize(x, lowfp.S2FP8(log_max=8), log_max=15)


def test_deterministic_log2_exp2_accuracy():
    g = np.random.default_rng(7)
    xs = np.concatenate([np.exp2(g.uniform(-1074, 1023, 20000)), 1 + g.uniform(-1e-3, 1e-3, 2000),
                         [5e-324, 2.2e-308, 1.0, 2.0, 0.5, 1.7976931348623157e308]])
    for v in xs:
        got, want = lowfp._C.log2_det(float(v)), math.log2(v)
        assert abs(got - want) <= 4 * math.ulp(want) + 1e-300, v
    for t in np.concatenate([g.uniform(-1022, 1023, 20000), [-0.5, 0.5, 0.0, 1023.9]]):
        got, want = lowfp._C.exp2_det(float(t)), 2.0 ** float(t)
        assert abs(got - want) <= 3 * math.ulp(want), t
    assert lowfp._C.exp2_det(1024.5) == math.inf and lowfp._C.exp2_det(-1080.0) == 0.0
    for t in (1100.5, 4097.0, 3e5, 1e9, 2.0 ** 31, 1e300):  # beyond the clamp at +-1100 too
        assert lowfp._C.exp2_det(t) == math.inf and lowfp._C.exp2_det(-t) == 0.0, t
    assert lowfp._C.exp2_det(-1074.0) == 5e-324


def test_demo_runs():
    import subprocess
    import sys
    from pathlib import Path
    demo = Path(__file__).resolve().parents[1] / "examples" / "s2fp8_demo.py"
    out = subprocess.run([sys.executable, str(demo), "--size", "4096"], capture_output=True,
                         text=True, check=True).stdout
    assert out.count("S2FP8 (alpha=") == 5 and "loss scale 2^" in out


# On a GPU (tests/devices.py): the CPU's bits, counts and steps.

def s2fp8_cpu_and_gpu(x, fmt="float8_e5m2", mode="nearest", **kw):
    s_cpu, s_gpu = lowfp.Stats(), lowfp.Stats("cuda")
    y_cpu, st_cpu = lowfp.s2fp8_quantize(x, fmt, rounding=mode, seed=21, stats=s_cpu, **kw)
    y_gpu, st_gpu = lowfp.s2fp8_quantize(x.cuda(), fmt, rounding=mode, seed=21, stats=s_gpu, **kw)
    assert st_gpu.params.is_cuda and y_gpu.is_cuda
    assert torch.equal(st_cpu.sums, st_gpu.sums.cpu())
    assert same_bits(st_cpu.params, st_gpu.params.cpu())
    assert s_cpu.as_dict() == s_gpu.as_dict()
    return y_cpu, y_gpu.cpu()


@on_cuda
@pytest.mark.parametrize("mode", lowfp.ROUNDING_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_s2fp8_matches_cpu(dtype, mode):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(300_001, generator=g, dtype=torch.float64)
         * torch.exp2(torch.randint(-12, 12, (300_001,), generator=g).double())).to(dtype)
    x[::1000] = 0
    x[5] = float("nan")
    x[7] = float("inf")
    y_cpu, y_gpu = s2fp8_cpu_and_gpu(x, mode=mode)
    assert same_bits(y_cpu, y_gpu)


@on_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt,mode", [("float8_e5m2", m)
                                      for m in ("nearest", "nearest_away", "toward_zero", "up", "down")]
                         + [("float8_e4m3fn", "nearest"), ("fp(4,3,4)", "toward_zero")])
def test_s2fp8_threshold_form_on_gpu(dtype, fmt, mode, monkeypatch):
    # From 2^24 elements the GPU reads x' from thresholds built on the host (deterministic modes,
    # 16/32-bit x): the same bits as the CPU and as the GPU's float64 kernel.
    n = 2**24 + 5
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-8, 8, (n,), generator=g).float())
    x = x.to(dtype)
    x[::4099] = 0
    x[3], x[10], x[11] = float("nan"), float("inf"), -float("inf")
    y_cpu, y_gpu = s2fp8_cpu_and_gpu(x, fmt, mode)
    assert same_bits(y_cpu, y_gpu)
    monkeypatch.setenv("LOWFP_S2FP8_FLOAT64", "1")
    s_wide = lowfp.Stats("cuda")
    y_wide, _ = lowfp.s2fp8_quantize(x.cuda(), fmt, rounding=mode, seed=21, stats=s_wide)
    assert same_bits(y_wide.cpu(), y_gpu)
    s_cpu = lowfp.Stats()
    lowfp.s2fp8_quantize(x, fmt, rounding=mode, seed=21, stats=s_cpu)
    assert s_wide.as_dict() == s_cpu.as_dict()


@on_cuda
@pytest.mark.parametrize("fmt,log_max", [("float8_e4m3fn", 8.0), ("fp(4,3,4)", 4.0), ("fp(5,2,0)", 15.0)])
def test_s2fp8_formats_match_cpu(fmt, log_max):
    x = bit_patterns(100_003, torch.float32, seed=4)
    y_cpu, y_gpu = s2fp8_cpu_and_gpu(x, fmt, "stochastic", log_max=log_max)
    assert same_bits(y_cpu, y_gpu)


@on_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt,log_max", [("float8_e5m2", 15.0), ("float8_e4m3fn", 8.0), ("fp(4,3,4)", 4.0)])
def test_s2fp8_stochastic_form_on_gpu(dtype, fmt, log_max, monkeypatch):
    # From 2^24 elements, stochastic rounding of 16/32-bit x takes the fast form on the GPU (a
    # table built on the host, the float64 path for the ambiguous elements): the same bits and
    # counts as the CPU and as the GPU's float64 kernel. Random bit patterns (every binade, NaN
    # payloads: alpha ~0.1) and magnitudes within a quarter binade (alpha in the hundreds, many
    # elements near a band).
    n = 2**24 + 7
    g = torch.Generator().manual_seed(13)
    narrow = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * 0.25 - 3.0)
    narrow = narrow * torch.sign(torch.randn(n, generator=g, dtype=torch.float64))
    for x in (bit_patterns(n, dtype, seed=13), narrow.to(dtype)):
        y_cpu, y_gpu = s2fp8_cpu_and_gpu(x, fmt, "stochastic", log_max=log_max)
        assert same_bits(y_cpu, y_gpu)
        monkeypatch.setenv("LOWFP_S2FP8_FLOAT64", "1")
        s_wide, s_fast = lowfp.Stats("cuda"), lowfp.Stats("cuda")
        y_wide, _ = lowfp.s2fp8_quantize(x.cuda(), fmt, log_max=log_max, rounding="stochastic",
                                         seed=21, stats=s_wide)
        monkeypatch.setenv("LOWFP_S2FP8_FLOAT64", "0")
        lowfp.s2fp8_quantize(x.cuda(), fmt, log_max=log_max, rounding="stochastic", seed=21,
                             stats=s_fast)
        assert same_bits(y_wide.cpu(), y_gpu)
        assert s_wide.as_dict() == s_fast.as_dict()


@on_cuda
def test_s2fp8_edge_cases_on_gpu():
    for x in (torch.zeros(7), torch.empty(0), torch.tensor([2.5] * 9), torch.tensor(3.0)):
        y_cpu, y_gpu = s2fp8_cpu_and_gpu(x)
        assert same_bits(y_cpu, y_gpu)
    base = torch.randn(300, 300, device="cuda")
    view = base.t()[::3]
    want, _ = lowfp.s2fp8_quantize(view.contiguous())
    got, _ = lowfp.s2fp8_quantize(view)
    assert torch.equal(got, want)
    c = base.clone()
    lowfp.quantize_(c, "s2fp8")
    assert torch.equal(c, lowfp.quantize(base, "s2fp8"))
    x = torch.randn(1000, device="cuda", requires_grad=True)
    up = torch.randn(1000, device="cuda")
    lowfp.s2fp8_quantize(x, truncate_grad=True)[0].backward(up)
    assert torch.equal(x.grad.cpu(), lowfp.s2fp8_quantize(up.cpu())[0])
