"""lowfp.Format: derived properties, parsing, equality, validation (docs/design.md §2)."""

import math
import pickle

import pytest
import torch

import lowfp
from lowfp.formats import Format, fp
from reference import FLOAT32_LIMITS, Spec


@pytest.mark.parametrize("e,m,b,specials", [(4, 3, 4, "none"), (5, 2, 0, "none"), (6, 9, 0, "none"),
                                             (5, 10, 0, "ieee"), (4, 3, 0, "fn"), (5, 2, 1, "fnuz"),
                                             (3, 0, -2, "none"), (8, 7, 0, "ieee"), (2, 1, 6, "fn")])
@pytest.mark.parametrize("subnormals", [True, False])
def test_derived_properties_follow_the_definition(e, m, b, specials, subnormals):
    f = fp(e, m, b, specials=specials, subnormals=subnormals)
    s = Spec(e, m, b, specials, subnormals)
    assert (f.bias, f.emin, f.emax) == (s.bias, s.emin, s.emax)
    assert f.max == float(s.max)
    assert f.min_normal == 2.0**s.emin
    assert f.min_subnormal == (2.0 ** (s.emin - m) if subnormals else None)
    assert f.smallest == 2.0**s.smallest_exp
    assert f.eps == 2.0**-m and f.bits == 1 + e + m
    assert f.range_binades == pytest.approx(math.log2(f.max / f.smallest))
    assert f.fits(torch.float32) == s.fits(*FLOAT32_LIMITS)


def test_default_overflow_policy_per_convention():
    assert fp(4, 3, 4).overflow == "saturate"
    assert fp(5, 10, 0, specials="ieee").overflow == "inf"
    assert fp(4, 3, 0, specials="fn").overflow == "saturate"
    assert fp(4, 3, 1, specials="fnuz").overflow == "nan"
    assert lowfp.formats.float4_e2m1fn.overflow == "saturate"
    assert fp(5, 10, 0, specials="ieee") == lowfp.formats.float16  # compare by value


@pytest.mark.parametrize("f", [fp(4, 3, 4), fp(5, 2, 0), fp(3, 0, -3), fp(5, 10, 0, specials="ieee"),
                               fp(4, 3, 0, specials="fn", overflow="nan"), fp(6, 9, 0, subnormals=False),
                               fp(4, 3, 1, specials="fnuz", subnormals=False, overflow="saturate")]
                         + list(lowfp.formats.named().values()))
def test_str_repr_parse_roundtrip_and_hash(f):
    assert Format.parse(str(f)) == f
    assert Format.parse(repr(f)) == f
    assert hash(Format.parse(str(f))) == hash(f)
    assert pickle.loads(pickle.dumps(f)) == f
    assert f.replace(overflow="nan").overflow == "nan"


def test_string_forms():
    assert str(fp(4, 3, 4)) == "fp(4,3,4)"
    assert str(fp(4, 3, 0, specials="fn")) == "float8_e4m3fn"
    assert str(fp(4, 3, 0, specials="fn", overflow="nan")) == "fp(4,3,0,specials='fn',overflow='nan')"
    assert Format.parse(" fp(4, 3) ") == fp(4, 3, 0)
    assert Format.parse("fp(5,2,b=1,specials='fnuz')") == lowfp.formats.float8_e5m2fnuz
    assert len({fp(4, 3, 4), fp(4, 3, 4), Format.parse("fp(4,3,4)")}) == 1
    assert fp(4, 3, 4) != fp(4, 3, 4, overflow="nan")
    assert fp(4, 3, 4) != "fp(4,3,4)"


@pytest.mark.parametrize("args,kwargs,exc,match", [
    ((0, 3), {}, ValueError, "e must be between 1 and 11"),
    ((12, 3), {}, ValueError, "e must be between 1 and 11"),
    ((4, -1), {}, ValueError, "m must be between 0 and 52"),
    ((4, 3, 9999), {}, ValueError, "b must be between"),
    ((4.0, 3), {}, TypeError, "e must be an int"),
    ((4, True), {}, TypeError, "m must be an int"),
    ((4, 3), {"specials": "IEEE"}, ValueError, "specials must be one of"),
    ((4, 3), {"overflow": "clip"}, ValueError, "overflow must be one of"),
    ((4, 3), {"subnormals": "yes"}, TypeError, "subnormals must be a bool"),
    ((4, 0), {"specials": "fn"}, ValueError, "needs m >= 1"),
    ((1, 3), {"specials": "ieee"}, ValueError, "needs e >= 2"),
    ((11, 52, 0), {}, ValueError, "emax=1024; float64 allows at most 1023"),
    ((11, 52, -5), {"specials": "ieee"}, ValueError, "float64"),
])
def test_invalid_formats(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fp(*args, **kwargs)


def test_fit_error_takes_floating_dtypes_only():
    for bad in (torch.int32, "float32", None, [torch.float32]):
        with pytest.raises(TypeError, match="dtype must be one of"):
            fp(4, 3, 4).fit_error(bad)
    assert fp(4, 3, 4).fit_error(torch.float16) is None and fp(4, 3, 4).fits(torch.bfloat16)


def test_carrier_fit_errors_name_the_limit():
    assert fp(8, 7, 0).fit_error(torch.float32).endswith("float32 allows at most 127")
    assert fp(8, 7, 0, specials="ieee").fits(torch.float32)  # bfloat16
    assert "mantissa bits" in fp(5, 30, 0).fit_error(torch.float32)
    assert "finest grid step 2^-150" in fp(8, 20, 4, specials="ieee").fit_error(torch.float32)
    assert fp(8, 20, 4, specials="ieee").fits(torch.float64)


@pytest.mark.parametrize("text", ["", "fp", "fp()", "fp(4,3,4", "float8", "fp(4,3,x)", "__import__('os')",
                                  "fp(4,3,4,specials=ieee)"])
def test_unparseable_strings(text):
    with pytest.raises((ValueError, TypeError)):
        Format.parse(text)
