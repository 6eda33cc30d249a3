"""Named formats: properties and bit-exactness against ml_dtypes and torch's own casts."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import lowfp
from devices import bit_patterns, cpu_and_gpu, on_cuda, same_bits

NAMES = ["float16", "bfloat16", "float8_e5m2", "float8_e4m3fn", "float8_e4m3", "float8_e3m4",
         "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float6_e3m2fn",
         "float6_e2m3fn", "float4_e2m1fn"]
ML_TYPES = {n: (np.float16 if n == "float16" else getattr(ml_dtypes, n)) for n in NAMES}
# ml_dtypes' conversions: ieee formats overflow to inf, fn/fnuz float8 to NaN, fp6/fp4 saturate.
ML_OVERFLOW = {n: ("inf" if lowfp.formats.named()[n].specials == "ieee" else
                   "saturate" if n.startswith(("float6", "float4")) else "nan") for n in NAMES}


def random_float32(n, seed):
    """Uniformly random bit patterns: every binade, both signs, subnormals, inf and NaN."""
    bits = np.random.default_rng(seed).integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    return bits.view(np.float32)


def boundary_float32(fmt):
    """max, ties at max + ulp/2, min normal, min subnormal, half of it, zeros, inf, NaN."""
    ulp_max = math.ldexp(1.0, fmt.emax - fmt.m)
    v = [fmt.max, fmt.max + ulp_max / 2, fmt.max + ulp_max / 4, fmt.max + ulp_max,
         fmt.min_normal, fmt.min_normal * 0.75, fmt.smallest, fmt.smallest / 2,
         fmt.smallest * 0.75, fmt.smallest * 1.5, 0.0, -0.0, math.inf, -math.inf, math.nan, 1.0,
         1.0 + fmt.eps / 2, 1.0 + fmt.eps * 1.5]
    with np.errstate(over="ignore"):  # bfloat16's max + ulp is inf in float32
        x = np.array(v, dtype=np.float32)
    return np.concatenate([x, -x, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(0))])


def assert_same_bits(got, want, where):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(got) & np.isnan(want)
    ok = nan | (got.view(np.uint32) == want.view(np.uint32))
    if not ok.all():
        i = np.flatnonzero(~ok)[:5]
        pytest.fail(f"{where}: x={i} got {got[i]} want {want[i]}")


@pytest.mark.parametrize("name", NAMES)
def test_properties_match_ml_dtypes_finfo(name):
    fmt = getattr(lowfp.formats, name)
    fi = ml_dtypes.finfo(ML_TYPES[name])
    assert fmt.max == float(fi.max)
    assert fmt.min_normal == float(fi.smallest_normal)
    assert fmt.min_subnormal == float(fi.smallest_subnormal)
    assert fmt.eps == float(fi.eps)
    assert fmt.bits == fi.bits
    assert str(fmt) == name and lowfp.Format.parse(name) is fmt


@pytest.mark.parametrize("name", NAMES)
def test_bit_exact_with_ml_dtypes(name):
    fmt = getattr(lowfp.formats, name)
    x = np.concatenate([random_float32(1 << 20, 7), boundary_float32(fmt)])
    got = lowfp.quantize(x, fmt, overflow=ML_OVERFLOW[name])
    with np.errstate(invalid="ignore"):
        want = x.astype(ML_TYPES[name]).astype(np.float32)
    # fp6/fp4 have no NaN: ml_dtypes maps NaN to a number, lowfp keeps NaN (docs/design.md §3).
    assert np.isnan(got[np.isnan(x)]).all()
    keep = ~np.isnan(x)
    assert_same_bits(got[keep], want[keep], name)


@pytest.mark.parametrize("name,dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16),
                                        ("float8_e4m3fn", torch.float8_e4m3fn),
                                        ("float8_e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, torch.float16])
def test_bit_exact_with_torch_casts(name, dtype, source):
    fmt = getattr(lowfp.formats, name)
    x = torch.from_numpy(np.concatenate([random_float32(1 << 20, 11), boundary_float32(fmt)]))
    x = x.to(source)
    # Each format's default overflow policy is torch's cast's (docs/design.md §3). torch 2.11 (seen on
    # the GPU machine) casts an overflowing float8_e4m3fn to NaN where 2.13 saturates: compare
    # with the "nan" policy under a torch that does.
    kw = {"overflow": "nan"} if torch.isnan(torch.tensor(1e6).to(dtype).float()) else {}
    if not fmt.fits(source) and source != torch.float32:
        got = lowfp.quantize(x, fmt, out_dtype=torch.float32, **kw)
    else:
        got = lowfp.quantize(x, fmt, **kw).float()
    want = x.to(dtype).float()
    assert_same_bits(got.numpy(), want.numpy(), f"{name} from {source}")


def test_seed_formats_of_the_precision_assignment_paper():
    assert lowfp.fp(4, 3, 4).max == 30
    assert lowfp.fp(5, 2, 0).max == 114688
    assert lowfp.fp(6, 9, 0).max == pytest.approx(8.58e9, rel=1e-3)
    assert lowfp.fp(6, 9, 0).max == 2**32 * (2 - 2**-9)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "bfloat16", "float16"])
def test_float64_input_is_never_double_rounded(name):
    fmt = getattr(lowfp.formats, name)
    # Just above a tie in float64; the tie itself in float32. Direct rounding must go up.
    tie = fmt.smallest / 2
    x = np.array([tie * (1 + 2**-30), -tie * (1 + 2**-30)])
    assert np.float32(x[0]) == np.float32(tie)  # via float32 this would round to 0
    np.testing.assert_array_equal(lowfp.quantize(x, fmt), [fmt.smallest, -fmt.smallest])


def test_float64_no_double_rounding_named_cases():
    e4m3 = lowfp.formats.float8_e4m3fn
    x = np.array([2.0**-10 * (1 + 2**-30), 464 + 2.0**-20, 464.0])
    s = lowfp.Stats()
    got = lowfp.quantize(x, e4m3, stats=s)
    # 2^-10(1+2^-30) is above the 0 / 2^-9 tie; 464+2^-20 above the 448 / 480 tie, so it
    # overflows (saturating to 448 and counted), while 464 itself ties to even 448.
    np.testing.assert_array_equal(got, [2.0**-9, 448.0, 448.0])
    assert s.overflow == 1
    assert np.isnan(lowfp.quantize(x, e4m3, overflow="nan")[1])
    # Through float32 both would have tied: the first to 0, the second to 448 without overflow.
    assert lowfp.quantize(x.astype(np.float32), e4m3, overflow="nan")[1] == 448


# On a GPU (tests/devices.py): the CPU's bits, counts and steps.

@on_cuda
@pytest.mark.parametrize("mode", lowfp.ROUNDING_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_named_formats_match_cpu(mode, dtype):
    x = bit_patterns(1 << 20, dtype)
    for name in lowfp.formats.named():
        fmt = lowfp.formats.named()[name]
        out_dtype = dtype if fmt.fits(dtype) else torch.float32
        for policy in ("saturate", "inf", "nan"):
            a, b, ca, cb = cpu_and_gpu(x, fmt, mode, overflow=policy, out_dtype=out_dtype)
            assert same_bits(a, b), (name, mode, policy, dtype)
            assert ca == cb


@on_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["nearest", "stochastic"])
def test_16_bit_inputs_over_many_grid_strides_match_cpu(dtype, mode):
    # A GPU thread loads two groups of four 16-bit elements a stride apart before rounding them:
    # enough elements for several strides of a whole grid, a last group of three, and a buffer
    # one element off the vector alignment (element by element).
    base = bit_patterns(3 * 2**22 + 8, dtype, seed=4)
    base_gpu = base.cuda()
    fmt = lowfp.formats.float8_e4m3fn
    for start in (0, 1):
        x, x_gpu = base[start:start + len(base) - 1], base_gpu[start:start + len(base) - 1]
        s_cpu, s_gpu = lowfp.Stats(), lowfp.Stats("cuda")
        a = lowfp.quantize(x, fmt, mode, seed=77, stats=s_cpu)
        b = lowfp.quantize(x_gpu, fmt, mode, seed=77, stats=s_gpu)
        assert same_bits(a, b), (dtype, mode, start)
        assert s_cpu.as_dict() == s_gpu.as_dict()
