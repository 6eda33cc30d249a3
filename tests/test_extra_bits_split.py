"""Extra bits (docs/design.md §5): split, merge and packing against references written here
(float64/integer arithmetic for truncation, a Python bit string for packing)."""

import math
import numpy as np
import pytest
import torch
import lowfp
import lowfp.extra_bits as eb
from extra_bits_reference import random_float32, truncate_bits, pack_reference
from devices import bit_patterns, on_cuda, same_bits


@pytest.mark.parametrize("rounding", eb.EXTRA_BITS_ROUNDING)
def test_bfloat16_plus_16_is_float32(rounding):
    bits = torch.randint(-2**31, 2**31 - 1, (200_000,), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(1))
    w = bits.view(torch.float32)
    w = torch.where(torch.isfinite(w), w, torch.zeros_like(w))  # every finite pattern, subnormals too
    w16, packed = eb.split(w, torch.bfloat16, 16, rounding, seed=3)
    assert packed.numel() == (w.numel() + 31) // 32 * (16 if rounding == "toward_zero" else 17)
    assert torch.equal(eb.merge(w16, packed, 16, rounding).view(torch.int32), w.view(torch.int32))
    if rounding == "nearest":
        assert torch.equal(w16, w.to(torch.bfloat16))  # torch rounds to nearest even


@pytest.mark.parametrize("rounding", eb.EXTRA_BITS_ROUNDING)
def test_float16_plus_13_is_float32_in_normal_range(rounding):
    w = random_float32(200_000, seed=2, lo=-14, hi=15)
    w = w[(w.abs() >= 2.0 ** -14) & (w.abs() < 65504)]
    w16, packed = eb.split(w, torch.float16, 13, rounding, seed=4)
    assert torch.equal(eb.merge(w16, packed, 13, rounding), w)
    if rounding == "nearest":
        assert torch.equal(w16, w.to(torch.float16))


def random_patterns(n, seed, finite=True):
    """Uniformly random float32 bit patterns (every binade alike, subnormals included); only the
    finite ones unless finite=False."""
    bits = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    w = torch.from_numpy(bits.view(np.int32)).view(torch.float32)
    return w[torch.isfinite(w)] if finite else w


@pytest.mark.parametrize("dtype,ks", [(torch.bfloat16, [1, 3, 8, 12, 15]), (torch.float16, [1, 4, 8, 12, 13])])
@pytest.mark.parametrize("rounding", eb.EXTRA_BITS_ROUNDING)
def test_smaller_k_truncates(dtype, ks, rounding):
    # float16: its normal and subnormal ranges, and below (t = 0); bfloat16: all of float32's.
    # Random patterns add float32's subnormals and every binade of float32 below float16's max.
    lo, hi = (-30, 15) if dtype == torch.float16 else (-140, 120)
    w = random_float32(50_000, seed=5, lo=lo, hi=hi)
    w = torch.cat([w, random_patterns(50_000, seed=6)])
    w = w[w.abs() < 65504]  # overflow: test_overflow_and_specials
    for k in ks:
        w16, packed = eb.split(w, dtype, k, rounding, seed=k)
        assert torch.equal(eb.merge(w16, packed, k, rounding), truncate_bits(w, dtype, k)), k
        # w is t (toward_zero) or a neighbour of W on the 16-bit grid
        t = truncate_bits(w, dtype, 0)
        if rounding == "toward_zero":
            assert torch.equal(w16.float(), t)
        else:
            up = w16.float().abs() > t.abs()
            assert bool((w16.float()[~up] == t[~up]).all())


@pytest.mark.parametrize("rounding", eb.EXTRA_BITS_ROUNDING)
def test_packing_layout_matches_a_bit_string(rounding):
    # every q from 1 to 17 (k = 1..16, + 1 flag bit unless toward_zero); 5 blocks, the last one
    # partial: the CPU kernels pack whole tiles with vector code and the last block on its own
    n = 150
    for k in range(1, 17):
        q = eb.bits_per_element(k, rounding)
        w = random_float32(n, seed=k)
        w16, packed = eb.split(w, torch.bfloat16, k, rounding, seed=9)
        # values: extra bits from the truncation, flag = |w16| > |t|
        t = truncate_bits(w, torch.bfloat16, 0)
        wk = truncate_bits(w, torch.bfloat16, k)
        ulp_t = torch.from_numpy(np.exp2(np.maximum(np.floor(np.log2(np.abs(w.double().numpy()))), -126) - 7))
        extra = ((wk.double() - t.double()).abs() / ulp_t * 2 ** k).round().long().tolist()
        flags = (w16.float().abs() > t.abs()).long().tolist() if q > k else [0] * n
        assert packed.tolist() == pack_reference([e | (f << k) for e, f in zip(extra, flags)], q), (k, rounding)
        # and back: merge reads the same layout
        assert torch.equal(eb.merge(w16, packed, k, rounding), wk), (k, rounding)


def test_stochastic_split_is_unbiased_and_flag_restores():
    f = (2.0 ** -9 + 2.0 ** -12) / 2.0 ** -7  # 0.28125 of a bfloat16 ulp above 1
    x = torch.full((400_000,), 1.0 + f * 2.0 ** -7)
    w16, packed = eb.split(x, torch.bfloat16, 8, "stochastic", seed=123)
    up = (w16.float() > 1).double().mean().item()
    sd = math.sqrt(f * (1 - f) / x.numel())
    assert abs(up - f) < 5 * sd
    assert abs(w16.double().mean().item() - x[0].item()) < 5 * sd * 2 ** -7
    assert torch.equal(eb.merge(w16, packed, 8, "stochastic"), x)


def test_overflow_and_specials():
    w = torch.tensor([1e5, -7e4, 65504.0, 65519.0, 65520.0, float("inf"), float("nan"), 0.0, -0.0, 1e-9])
    w16, packed = eb.split(w, torch.float16, 10, "nearest")
    assert w16[0].item() == math.inf and w16[1].item() == -math.inf and w16[4].item() == math.inf
    back = eb.merge(w16, packed, 10, "nearest")
    assert back[0].item() == 65504 and back[1].item() == -65504  # beyond 2^16: the largest value
    assert back[3].item() == 65519 and back[4].item() == 65520   # same binade as max: kept
    assert back[5].item() == math.inf and math.isnan(back[6].item())
    assert math.copysign(1, back[8].item()) == -1 and back[9].item() == math.floor(1e-9 / 2.0 ** -34) * 2.0 ** -34
    w16z, pz = eb.split(w, torch.float16, 10, "toward_zero")
    assert w16z[0].item() == 65504 and eb.merge(w16z, pz, 10, "toward_zero")[0].item() == 65504


SPLIT_SPECIALS = {
    torch.bfloat16: [0x7F7FFFFF, 0xFF7F8000, 0x7F7F7FFF,  # to inf when rounded up; a tie with odd 0x7f7f
                     0x00000001, 0x80008000, 0x00008001, 0x0000FFFF, 0x00010000,  # below its min
                     0x3F808000, 0x3F818000, 0xBF80FFFF],  # ties to even, down and up
    torch.float16: [0x477FE000, 0x477FEFFF, 0xC77FF000, 0x477FF001, 0x47800000,  # max, to inf, 2^16
                    0x387FE000, 0x387FF000, 0x38800000, 0xB87FFFFF,  # largest subnormal, 2^-14
                    0x33800000, 0x33000000, 0x33000001, 0x33C00000, 0x00000001,  # 2^-24, ties to 0 / up
                    0x3F801000, 0x3F803000, 0xBF801FFF],  # ties to even, down and up
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rounding", eb.EXTRA_BITS_ROUNDING)
def test_split_rounds_as_quantize_with_counts(dtype, rounding):
    # The split rounds by forms with every parameter folded in: they must give lowfp.quantize's
    # general rounding to the 16-bit grid (overflow to inf, the same random words for the same
    # seed) bit for bit, with the same event counts; nearest is torch's cast.
    special = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F800001, 0xFFC00000] + SPLIT_SPECIALS[dtype]
    special = torch.from_numpy(np.array(special, dtype=np.uint32).view(np.int32)).view(torch.float32)
    x = torch.cat([special, random_patterns(100_000, seed=2, finite=False)])
    if dtype == torch.float16:  # most random patterns overflow float16: half of them at its scale
        x = torch.cat([x, x[len(special):][::2] * 2.0 ** -100])
    s_split, s_ref = lowfp.Stats(), lowfp.Stats()
    w16, _ = eb.split(x, dtype, 8, rounding, seed=4, stats=s_split)
    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    ref = lowfp.quantize(x, name, rounding, overflow="inf", seed=4, stats=s_ref)
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(w16), nan)
    assert torch.equal(w16.float()[~nan].view(torch.int32), ref[~nan].view(torch.int32))
    assert torch.equal(s_split.counts, s_ref.counts)
    assert s_split.overflow > 0 and s_split.nan > 0 and (rounding == "stochastic" or s_split.underflow > 0)
    if rounding == "nearest":
        assert torch.equal(w16[~nan].view(torch.int16), x[~nan].to(dtype).view(torch.int16))


@pytest.mark.parametrize("dtype,k", [(torch.bfloat16, 16), (torch.bfloat16, 5), (torch.float16, 13),
                                     (torch.float16, 7), (torch.float16, 1)])
def test_merge_of_every_16_bit_pattern(dtype, k):
    # W' = t + extra * ulp(t) / 2^k for every weight pattern (no flag: toward_zero) and random
    # extra bits, against float64 arithmetic. For inf and NaN (whose extra bits split makes 0):
    # float16's stay as they are (a NaN's payload kept, not quieted); bfloat16's take the bits
    # below them, as float32 patterns.
    w16 = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    extra = np.random.default_rng(k).integers(0, 2**k, w16.numel())
    packed = torch.tensor(pack_reference(extra.tolist(), k), dtype=torch.int32)
    got = eb.merge(w16, packed, k, "toward_zero")
    m16, emin = (7, -126) if dtype == torch.bfloat16 else (10, -14)
    t = w16.double().numpy()
    a = np.abs(t)
    finite = np.isfinite(t)
    e = np.floor(np.log2(np.where(finite & (a > 0), a, 1.0)))
    ulp = np.exp2(np.maximum(np.where(a > 0, e, emin), emin) - m16)
    want = torch.from_numpy(np.copysign(a + extra * ulp * 2.0 ** -k, t)).float()
    if dtype == torch.bfloat16:
        concatenated = (w16.view(torch.int16).int() << 16) | torch.from_numpy(extra << (16 - k)).int()
        want = torch.where(torch.from_numpy(finite), want, concatenated.view(torch.float32))
    else:
        h = w16.view(torch.int16).int()
        widened = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13)
        want = torch.where(torch.from_numpy(finite), want, widened.view(torch.float32))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_split_merge_errors():
    w = torch.ones(10)
    with pytest.raises(ValueError, match="between 1 and 13"):
        eb.split(w, torch.float16, 14)
    with pytest.raises(ValueError, match="between 1 and 16"):
        eb.split(w, torch.bfloat16, 0)
    with pytest.raises(TypeError, match="float16 or torch.bfloat16"):
        eb.split(w, torch.float32, 8)
    with pytest.raises(ValueError, match="rounding"):
        eb.split(w, torch.bfloat16, 8, "up")
    with pytest.raises(TypeError, match="w32"):
        eb.split(w.double(), torch.bfloat16, 8)
    with pytest.raises(TypeError, match="w32 must be a dense"):
        eb.split(w.to_sparse(), torch.bfloat16, 8)
    w16, packed = eb.split(w, torch.bfloat16, 8)
    with pytest.raises(ValueError, match="words"):
        eb.merge(w16, packed[:-1], 8)
    with pytest.raises(TypeError, match="w16 must be a dense"):
        eb.merge(w16.to_sparse(), packed, 8)
    with pytest.raises(TypeError, match="packed must be a dense"):
        eb.merge(w16, packed.to_sparse(), 8)
    keep = w.clone()
    eb.split(w, torch.bfloat16, 8, "stochastic")
    assert torch.equal(w, keep)


@pytest.mark.parametrize("k,rounding", [(16, "stochastic"), (13, "toward_zero"), (5, "nearest"),
                                        (1, "toward_zero")])
@pytest.mark.parametrize("n", [0, 1, 31, 33, 1000])
def test_pack_and_unpack_are_the_packing_per_element(k, rounding, n):
    # The per-element form sharded optimizer state is saved in, against the bit-string reference.
    q = eb.bits_per_element(k, rounding)
    values = np.random.default_rng(n + k).integers(0, 2**q, n).tolist()
    packed = torch.tensor(pack_reference(values, q), dtype=torch.int32).reshape(-1)
    assert eb.pack(torch.tensor(values, dtype=torch.int32), k, rounding).tolist() == packed.tolist()
    assert eb.unpack(packed, n, k, rounding).tolist() == values
    with pytest.raises(ValueError, match="must lie in"):
        eb.pack(torch.tensor([2**q], dtype=torch.int32), k, rounding)
    with pytest.raises(ValueError, match="words but"):
        eb.unpack(packed, n + 32, k, rounding)


# On a GPU (tests/devices.py): the CPU's bits, counts and steps.

@on_cuda
@pytest.mark.parametrize("dtype,k", [(torch.bfloat16, 16), (torch.bfloat16, 5), (torch.float16, 13),
                                     (torch.float16, 8)])
@pytest.mark.parametrize("rounding", ["toward_zero", "nearest", "stochastic"])
def test_extra_bits_split_merge_match_cpu(dtype, k, rounding):
    import lowfp.extra_bits as eb
    w = bit_patterns(100_003, torch.float32, seed=5)
    w = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
    s_cpu, s_gpu = lowfp.Stats(), lowfp.Stats("cuda")
    a16, ap = eb.split(w, dtype, k, rounding, seed=3, stats=s_cpu)
    b16, bp = eb.split(w.cuda(), dtype, k, rounding, seed=3, stats=s_gpu)
    assert same_bits(a16, b16.cpu()) and torch.equal(ap, bp.cpu())
    assert s_cpu.as_dict() == s_gpu.as_dict()
    assert torch.equal(eb.merge(a16, ap, k, rounding), eb.merge(b16, bp, k, rounding).cpu())
