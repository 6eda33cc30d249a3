"""Scaled formats (docs/design.md §9): MX and NVFP4 bit for bit against torchao's reference code
where the two agree on the definition, against an exact reference (Python fractions) for every
scale rule and rounding mode, and the format objects' behaviour."""

import math
from fractions import Fraction

import pytest
import torch

import lowfp
from lowfp.scaled import Scaled
from cpu_kernels import outputs_of_each_kernel
from reference import philox_word

# torchao (a test dependency) runs its MX and NVFP4 reference code on the CPU with our torch.
import torchao.prototype.mx_formats.mx_tensor as torchao_mx
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize
from devices import DEVICES, bit_patterns, on_cuda, same_bits
from host_programs import run_host_program

MX = {  # lowfp name: torchao element dtype
    "mxfp8_e4m3": torch.float8_e4m3fn,
    "mxfp8_e5m2": torch.float8_e5m2,
    "mxfp6_e3m2": "fp6_e3m2",
    "mxfp6_e2m3": "fp6_e2m3",
    "mxfp4_e2m1": torch.float4_e2m1fn_x2,
}


def blocks_of_many_magnitudes(rows=64, cols=256, lo=-30, hi=30, seed=0):
    """Normal values times a power of two per 32-element block (log-uniform over [2^lo, 2^hi]),
    so that every block's scale differs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    exps = torch.randint(lo, hi + 1, (rows, cols // 32), generator=g).repeat_interleave(32, dim=1)
    return x * torch.exp2(exps.float())


# -- exact reference (docs/design.md §9) ---------------------------------------------------------

def grid_round(v: Fraction, fmt: lowfp.Format, rounding: str) -> Fraction:
    """v rounded to fmt's grid (saturating), exactly: nearest even, toward zero, up or down."""
    if v == 0:
        return Fraction(0)
    a = abs(v)
    # (from the bit lengths, which may be off by one: a Fraction below float64's range has no log2)
    e = max(a.numerator.bit_length() - a.denominator.bit_length(), fmt.emin)
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    e = max(e, fmt.emin)
    step = Fraction(2) ** (e - fmt.m)
    lo = (a // step) * step
    hi = lo + step
    neg = v < 0
    if rounding == "nearest":
        r = lo if a - lo < hi - a else hi if a - lo > hi - a else (lo if (lo / step) % 2 == 0 else hi)
    elif rounding == "toward_zero":
        r = lo
    elif rounding == "up":
        r = lo if a == lo else (lo if neg else hi)
    elif rounding == "down":
        r = lo if a == lo else (hi if neg else lo)
    else:
        raise ValueError(rounding)
    r = min(r, Fraction(fmt.max))
    return -r if neg else r


def ref_e8m0_exponent(a: Fraction, fmt: Scaled) -> int:
    e, rule = fmt.element, fmt.scale_rule
    fl = math.floor(math.log2(a))
    while Fraction(2) ** fl > a:
        fl -= 1
    while Fraction(2) ** (fl + 1) <= a:
        fl += 1
    if rule == "floor":
        k = fl - e.emax
    elif rule == "ceil":
        k = fl - e.emax
        if a / Fraction(2) ** k > Fraction(e.max):
            k += 1
    elif rule == "rceil":
        d = Fraction(float(torch.tensor(float(a / Fraction(e.max)), dtype=torch.float32)))
        if d == 0:  # below float32's range: the smallest scale
            return -127
        k = math.floor(math.log2(d))
        while Fraction(2) ** k > d:
            k -= 1
        while Fraction(2) ** (k + 1) <= d:
            k += 1
        if d != Fraction(2) ** k:
            k += 1
    else:  # even: a to E's mantissa bits, halves up, then floor
        v = a + Fraction(2) ** (fl - e.m - 1)
        k = math.floor(math.log2(v))
        while Fraction(2) ** (k + 1) <= v:
            k += 1
        while Fraction(2) ** k > v:
            k -= 1
        k -= e.emax
    return max(-127, min(127, k))


def reference(x: torch.Tensor, fmt: Scaled, rounding="nearest"):
    """(values, scales) of a 2-D float32 x with 1-D blocks along its last axis, exactly."""
    rows, cols = x.shape
    b = fmt.block or cols
    out = torch.empty(rows, cols, dtype=torch.float64)
    scales = []
    for r in range(rows):
        row_scales = []
        for c0 in range(0, cols, b):
            vals = [Fraction(float(v)) for v in x[r, c0:c0 + b]]
            a = max(abs(v) for v in vals)
            if fmt.scale == "e8m0":
                s = Fraction(2) ** (ref_e8m0_exponent(a, fmt) if a else -127)
            else:
                sf = fmt.scale_format
                s = grid_round(a / Fraction(fmt.element.max), sf, "nearest") if a else Fraction(0)
                if s == 0:
                    s = Fraction(2) ** (sf.emin - sf.m)
            row_scales.append(float(s))
            for j, v in enumerate(vals):
                out[r, c0 + j] = float(s * grid_round(v / s, fmt.element, rounding))
        scales.append(row_scales)
    return out.float(), torch.tensor(scales, dtype=torch.float64)


def on_cpu(parts):
    """A ScaledParts with each tensor on the CPU."""
    return type(parts)(*(t.cpu() for t in parts))


@pytest.mark.parametrize("rule", ["floor", "ceil", "rceil", "even"])
@pytest.mark.parametrize("element", ["float8_e4m3fn", "float4_e2m1fn", "float6_e2m3fn"])
@pytest.mark.parametrize("device", DEVICES)
def test_e8m0_rules_match_the_exact_reference(rule, element, device):
    fmt = Scaled(element, block=8, scale_rule=rule)
    x = blocks_of_many_magnitudes(6, 64, -10, 10, seed=1)[:, :56]  # a short last block per row
    x[0, :8] = torch.tensor([448.0, 449.0, 480.0, 500.0, 3.0, -1.0, 0.0, 1.0])  # around max_E
    x[1, :8] = torch.tensor([6.0, 6.5, 7.0, 8.0, 0.25, 0.0, -6.1, 5.9])
    for rounding in ("nearest", "toward_zero", "up", "down"):
        parts = on_cpu(lowfp.scaled.encode(x.to(device), fmt, rounding))
        want, want_scales = reference(x, fmt, rounding)
        assert torch.equal(parts.scales, want_scales), (rounding, parts.scales, want_scales)
        assert torch.equal(parts.value, want), rounding
    # float64 blocks whose largest magnitudes lie far below 2^-127 · max_E (float64 subnormals
    # among them): every rule clamps at 2^-127, and counts the block as saturated
    tiny = torch.tensor([[1e-310, 0.0] * 4 + [2.0 ** -1000] * 8 + [2.0 ** -130] * 8], dtype=torch.float64)
    st = lowfp.scaled.ScaledStats(device)
    parts = on_cpu(lowfp.scaled.encode(tiny.to(device), fmt, stats=st))
    want_k = [ref_e8m0_exponent(Fraction(float(tiny[0, c0:c0 + 8].abs().max())), fmt) for c0 in (0, 8, 16)]
    assert parts.scales.tolist() == [[2.0 ** k for k in want_k]] and st.saturated_blocks == want_k.count(-127)


@pytest.mark.parametrize("scale", ["float8_e4m3fn", "float32", "fp(5,2,0)"])
@pytest.mark.parametrize("device", DEVICES)
def test_scales_in_a_format_match_the_exact_reference(scale, device):
    fmt = Scaled("float4_e2m1fn", block=16, scale=scale)
    x = blocks_of_many_magnitudes(4, 64, -8, 8, seed=2)
    x[0, :16] = 0.0  # an empty block
    for rounding in ("nearest", "toward_zero", "up", "down"):
        parts = on_cpu(lowfp.scaled.encode(x.to(device), fmt, rounding))
        want, want_scales = reference(x, fmt, rounding)
        assert torch.equal(parts.value, want), rounding
        assert torch.equal(parts.scales[1:], want_scales[1:])


def test_a_quotient_below_float64s_range_rounds_by_its_sign():
    # 1e-310 / s underflows float64 to ±0: directed roundings still see a nonzero quotient.
    fmt = Scaled("float4_e2m1fn", block=4, scale="float32")
    x = torch.tensor([1e300, 1e-310, -1e-310, 0.0], dtype=torch.float64)
    s = float(torch.finfo(torch.float32).max)  # 1e300 / 6 saturates the float32 scale
    for rounding, want in (("up", [s * 6, s * 0.5, -0.0, 0.0]), ("down", [s * 6, 0.0, -s * 0.5, 0.0]),
                           ("nearest", [s * 6, 0.0, -0.0, 0.0])):
        got = lowfp.quantize(x, fmt, rounding)
        assert torch.equal(got, torch.tensor(want, dtype=torch.float64)), (rounding, got)
        assert torch.equal(got.signbit(), torch.tensor(want).signbit()), rounding


def exact_round(v: Fraction, fmt: lowfp.Format, rounding: str, word: int = 0) -> Fraction:
    """v rounded to fmt's grid (saturating) by any mode of §3; ``word``: stochastic rounding's
    random word (32 bits: up when word < floor(f · 2^32))."""
    if rounding in ("nearest", "toward_zero", "up", "down"):
        return grid_round(v, fmt, rounding)
    toward = grid_round(v, fmt, "toward_zero")
    if v == toward:
        return toward
    a, lo = abs(v), abs(toward)
    e = max(math.floor(math.log2(lo)) if lo else fmt.emin, fmt.emin)
    while Fraction(2) ** (e + 1) <= a and e + 1 > fmt.emin:
        e += 1
    step = Fraction(2) ** (e - fmt.m)
    f = (a - lo) / step
    up = f >= Fraction(1, 2) if rounding == "nearest_away" else word < math.floor(f * 2 ** 32)
    r = min(lo + step if up else lo, Fraction(fmt.max))
    return -r if v < 0 else r


@pytest.mark.parametrize("scale", ["e8m0", "float32"])
@pytest.mark.parametrize("rounding", ["nearest", "nearest_away", "toward_zero", "up", "down", "stochastic"])
def test_float64_quotients_at_and_beyond_float64s_subnormal_range(scale, rounding):
    # Blocks of two: a large element sets the scale (2^112 and 2^119 for e8m0), the other's
    # quotient lies in float64's subnormal range or below it, where x · (1 / s) rounds (to 0 for
    # the smallest): the exact quotient is rounded once, and counted.
    fmt = Scaled("float8_e4m3fn", block=2, scale=scale)
    tiny = [2.0 ** -1000, 2.0 ** -1074, 5 * 2.0 ** -1074, 2.0 ** -1022, 2.0 ** -950, 3 * 2.0 ** -960,
            (1 + 2.0 ** -52) * 2.0 ** -950, 2.0 ** -1022 - 2.0 ** -1074, 1e-300]
    vals = []
    for big in (2.0 ** 120, 2.0 ** 127 * 1.75):
        for t in tiny:
            vals += [big, t, -big, -t]
    x = torch.tensor([vals], dtype=torch.float64)
    st = lowfp.Stats()
    got = lowfp.quantize(x, fmt, rounding, seed=5, stats=st)
    e = fmt.element
    underflow = 0
    for c0 in range(0, x.shape[1], 2):
        block = [Fraction(float(v)) for v in x[0, c0:c0 + 2]]
        a = max(abs(v) for v in block)
        if scale == "e8m0":
            s = Fraction(2) ** ref_e8m0_exponent(a, fmt)
        else:
            s = grid_round(a / Fraction(e.max), fmt.scale_format, "nearest")
        for j, v in enumerate(block):
            i = c0 + j
            word = philox_word(5, 0, i) if rounding == "stochastic" else 0
            q = exact_round(v / s, e, rounding, word)
            underflow += q == 0 and v != 0
            want = float(q * s)
            assert got[0, i].item() == want and math.copysign(1, got[0, i].item()) == math.copysign(1, v), \
                (i, float(v), float(s), got[0, i].item(), want)
    assert st.underflow == underflow and underflow > 0
    assert st.numel == x.numel()


def _torchao_mx(x, elem, mode):
    scale, data = torchao_mx.to_mx(x, elem, 32, mode)
    return torchao_mx.to_dtype(data, scale, elem, 32, torch.float32)


@pytest.mark.parametrize("name", sorted(MX))
@pytest.mark.parametrize("rule", ["floor", "even", "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_mx_matches_torchao_bit_for_bit(name, rule, dtype, device):
    # Blocks whose largest magnitude a gives a scale of 2^-127 differ by definition (torchao
    # divides by 2^-126 there, docs/design.md §9): magnitudes here keep scales far above it.
    fmt = Scaled(lowfp.scaled.named()[name].element, block=32, scale_rule=rule)
    x = blocks_of_many_magnitudes(32, 512, -40, 40, seed=3).to(dtype)
    want = _torchao_mx(x, MX[name], ScaleCalculationMode(rule))
    got = lowfp.quantize(x.to(device), fmt).cpu()
    assert got.dtype == dtype
    assert torch.equal(got.float(), want.to(dtype).float())


def _torchao_nvfp4(x, per_tensor_scale=None):
    scales, packed = nvfp4_quantize(x, 16, per_tensor_scale)
    q = f4_unpacked_to_f32(unpack_uint4(packed)).reshape(x.shape)
    s = scales.float().repeat_interleave(16, dim=-1)
    if per_tensor_scale is not None:
        s = s * per_tensor_scale
    return q, s


def test_nvfp4_single_level_matches_torchao_where_the_definitions_agree():
    # torchao floors E4M3 block scales at 2^-6 and scales elements by a rounded reciprocal,
    # x * fl(1 / s); lowfp keeps subnormal scales and rounds the exact quotient x / s
    # (docs/design.md §9). With block scales in E4M3's normal range the scales agree exactly,
    # and the elements wherever x / s is not within a reciprocal's rounding of a tie.
    fmt = Scaled("float4_e2m1fn", block=16, scale="float8_e4m3fn")
    x = blocks_of_many_magnitudes(64, 512, -3, 7, seed=4)
    q, s = _torchao_nvfp4(x)
    parts = lowfp.scaled.encode(x, fmt)
    assert torch.equal(parts.scales.float().repeat_interleave(16, dim=-1), s)
    differ = parts.q != q
    quotient = (x.double() / s.double()).abs()
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    near_tie = ((quotient[..., None] - ties).abs() / ties).amin(-1) < 2.0 ** -22
    assert differ.sum() < 0.001 * x.numel()
    assert bool(near_tie[differ].all())


def test_mx_blocks_holding_inf_differ_from_torchao_as_stated():
    # torchao keeps ±inf in a block's amax: its scale is infinite, the block's other elements
    # become 0 and inf stays inf. lowfp leaves inf out (docs/design.md §9): the block scales as
    # its finite elements say, and inf saturates. Blocks without inf agree bit for bit.
    x = blocks_of_many_magnitudes(8, 256, -10, 10, seed=9)
    with_inf = torch.zeros(8, 8, dtype=torch.bool)
    with_inf[::3, 1::2] = True
    x.view(8, 8, 32)[with_inf] = x.view(8, 8, 32)[with_inf].index_fill(-1, torch.tensor([5]), float("-inf"))
    want = _torchao_mx(x, torch.float8_e4m3fn, ScaleCalculationMode.FLOOR).view(8, 8, 32)
    got = lowfp.quantize(x, "mxfp8_e4m3").view(8, 8, 32)
    assert torch.equal(got[~with_inf], want[~with_inf])
    finite = x.view(8, 8, 32)[with_inf].clone()
    finite[:, 5] = 0.0  # lowfp's block: as if the inf were not there, the inf itself saturating
    expect = lowfp.quantize(finite, "mxfp8_e4m3")
    expect[:, 5] = -448.0 * lowfp.scaled.encode(finite, "mxfp8_e4m3").scales[:, 0]
    assert torch.equal(got[with_inf], expect)
    assert bool((want[with_inf][:, 5] == float("-inf")).all()) and bool((want[with_inf][:, :5] == 0).all())


def test_nvfp4_block_scales_differ_from_torchao_only_at_near_ties():
    # torchao rounds the stored block scale as fl32(fl32(a / 6) / t), two float32 roundings
    # before E4M3's; lowfp rounds a / (6 t) once (docs/design.md §9). Near an E4M3 midpoint the
    # two can pick neighbouring values. Blocks built with a / (6 t) at every midpoint of E4M3's
    # normal range (to ±2 float32 steps) show how many; ordinary data shows none.
    t = float(torch.tensor(1234.567 / 2688, dtype=torch.float32))
    values = [(1 + m / 8) * 2.0 ** e for e in range(-6, 9) for m in range(8)][:-1]  # E4M3, normal
    mids = [(a + b) / 2 for a, b in zip(values, values[1:])]
    near = torch.tensor([mu * 6 * t for mu in mids], dtype=torch.float32).view(torch.int32)
    a = torch.cat([(near + k).view(torch.float32) for k in range(-2, 3)])
    x = torch.zeros(a.numel(), 16)
    x[:, 0], x[:, 1] = a, -0.3 * a
    x[0, 5] = 1234.567  # the tensor's amax: t as above
    parts = lowfp.scaled.encode(x.reshape(1, -1), "nvfp4")
    assert parts.tensor_scale.item() == t
    stored, _ = nvfp4_quantize(x.reshape(1, -1), 16, parts.tensor_scale.float())
    ours, theirs = parts.scales.view(-1) / t, stored.view(-1).double()
    differ = ours != theirs
    exact = [Fraction(float(v)) / (6 * Fraction(t)) for v in a[differ]]
    for q, ours_q, theirs_q in zip(exact, ours[differ].tolist(), theirs[differ].tolist()):
        mu = (Fraction(ours_q) + Fraction(theirs_q)) / 2  # neighbours: their midpoint is the tie
        assert values.index(max(ours_q, theirs_q)) - values.index(min(ours_q, theirs_q)) == 1
        assert abs(q - mu) <= mu * Fraction(2) ** -22, (float(q), float(mu))
    assert 0 < int(differ.sum()) < a.numel() // 4  # 74 of 590 blocks with torchao 0.18
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    parts = lowfp.scaled.encode(x, "nvfp4")
    _, s = _torchao_nvfp4(x, parts.tensor_scale.float())
    assert torch.equal(parts.scales.float().repeat_interleave(16, dim=-1), s)


def test_nvfp4_two_level_scales():
    x = blocks_of_many_magnitudes(8, 64, -6, 6, seed=5)
    parts = lowfp.scaled.encode(x, "nvfp4")
    amax = x.abs().max().double()
    t = torch.tensor(float(amax / (448.0 * 6.0)), dtype=torch.float32).double()
    assert torch.equal(parts.tensor_scale, t)
    stored = parts.scales / t  # round_E4M3(a / (6 t)), exactly representable in E4M3
    assert torch.equal(lowfp.quantize(stored.float(), "float8_e4m3fn").double(), stored)
    a = x.abs().reshape(8, 4, 16).amax(-1).double()
    assert torch.equal(stored, lowfp.quantize((a / (6.0 * t)), "float8_e4m3fn"))
    # elements: q = round_E2M1(x / s) exactly
    q_ref = lowfp.quantize((x.double() / parts.scales.repeat_interleave(16, dim=-1)), "float4_e2m1fn")
    assert torch.equal(parts.q.double(), q_ref)


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
def test_tensor_scales_beyond_float32s_range_are_held_within_it(rounding):
    # float64 tensors whose amax / (448 · 6) overflows float32, or rounds to 0 there: t is held at
    # float32's largest or smallest positive value, the blocks whose scale then leaves E4M3's range
    # saturate (and are counted), and every element stays finite, exactly rounded.
    f32 = torch.finfo(torch.float32)
    e, sf = lowfp.formats.float4_e2m1fn, lowfp.formats.float8_e4m3fn
    for x, t in ((torch.tensor([1e300, 1.0, 3e299, -2.5e297] * 4 + [5e40] * 16, dtype=torch.float64), f32.max),
                 (torch.tensor([1e-300, -1e-310] * 8 + [1e-280] * 16, dtype=torch.float64), 2.0 ** -149)):
        st = lowfp.scaled.ScaledStats()
        parts = lowfp.scaled.encode(x, "nvfp4", rounding, stats=st)
        assert parts.tensor_scale.item() == t
        assert torch.equal(lowfp.quantize(x, "nvfp4", rounding), parts.value)
        saturated = 0
        for b0 in range(0, x.numel(), 16):
            block = [Fraction(float(v)) for v in x[b0:b0 + 16]]
            ideal = max(abs(v) for v in block) / (Fraction(e.max) * Fraction(t))
            stored = grid_round(ideal, sf, "nearest")
            saturated += ideal > sf.max or stored == 0
            s = (stored or Fraction(2) ** -9) * Fraction(t)
            for j, v in enumerate(block):
                assert parts.value[b0 + j].item() == float(grid_round(v / s, e, rounding) * s), (b0 + j, rounding)
        assert parts.value.isfinite().all() and st.saturated_blocks == saturated and saturated > 0

    # E8M0 `rceil`: a / max_E rounded to float32 overflows or vanishes, and k is clamped
    fmt = Scaled("float8_e4m3fn", block=2, scale_rule="rceil")
    x = torch.tensor([1e300, 1.0, 1e-300, 0.0], dtype=torch.float64)
    st = lowfp.scaled.ScaledStats()
    parts = lowfp.scaled.encode(x, fmt, rounding, stats=st)
    assert parts.scales.tolist() == [2.0 ** 127, 2.0 ** -127] and st.saturated_blocks == 2
    for i, v in enumerate(x.tolist()):
        scale = Fraction(2) ** (127 if i < 2 else -127)
        assert parts.value[i].item() == float(grid_round(Fraction(v) / scale, sf, rounding) * scale), i


def decision_points(fmt: lowfp.Format):
    """The positive points where nearest rounding to fmt decides: its grid's midpoints below max."""
    grid = {Fraction(k, 2 ** fmt.m) * Fraction(2) ** fmt.emin for k in range(2 ** fmt.m)}
    for e in range(fmt.emin, fmt.emax + 1):
        grid |= {(1 + Fraction(k, 2 ** fmt.m)) * Fraction(2) ** e for k in range(2 ** fmt.m)}
    grid = sorted(v for v in grid if v <= Fraction(fmt.max))
    return [(a + b) / 2 for a, b in zip(grid, grid[1:])]


@pytest.mark.parametrize("name", ["nvfp4", "fp8_e4m3_tensorwise"])
@pytest.mark.parametrize("amax", [2688.0 * 3.0, 1234.567])  # tensor scales of 2 and 24 bits
def test_elements_at_and_beside_ties_match_the_exact_reference(name, amax):
    # Quotients x / s at and within two float32 steps of E's midpoints, where a quotient rounded
    # twice could decide wrongly: q must be E's nearest rounding of the exact quotient.
    fmt = lowfp.scaled.named()[name]
    rows, cols = 8, 64
    base = blocks_of_many_magnitudes(rows, cols, -4, 4, seed=8)
    base[0, 0] = amax
    scales = lowfp.scaled.encode(base, fmt).scales
    if fmt.block is None:  # one scale
        s = scales.expand(rows, cols)
    else:
        block_max = base.abs().reshape(rows, -1, fmt.block).amax(-1)
        s = scales.repeat_interleave(fmt.block, dim=-1)
    g = torch.Generator().manual_seed(9)
    mids = decision_points(fmt.element)
    mu = torch.tensor([float(v) for v in mids], dtype=torch.float64)
    x = (mu[torch.randint(len(mids), (rows, cols), generator=g)] * s).float()
    step = torch.randint(-2, 3, (rows, cols), generator=g)
    for _ in range(2):
        x = torch.where(step > 0, torch.nextafter(x, torch.tensor(math.inf)), x)
        x = torch.where(step < 0, torch.nextafter(x, torch.tensor(-math.inf)), x)
        step = step - step.sign()
    x = x * torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
    if fmt.block is None:  # each block keeps its largest magnitude, so its scale
        x[0, 0] = amax
    else:
        x[:, ::fmt.block] = block_max
    parts = lowfp.scaled.encode(x, fmt)
    assert torch.equal(parts.scales, scales)
    st32, st64 = lowfp.scaled.ScaledStats(), lowfp.scaled.ScaledStats()  # (most tiles fall back)
    want = lowfp.quantize(x.double(), fmt, stats=st64).float()
    assert torch.equal(lowfp.quantize(x, fmt, stats=st32), want)
    assert torch.equal(st32.counts, st64.counts)
    # in place, a tile that falls back must still read its inputs, not its first attempt's results
    st_in = lowfp.scaled.ScaledStats()
    assert torch.equal(lowfp.quantize_(x.clone(), fmt, stats=st_in), want)
    assert torch.equal(st_in.counts, st64.counts)
    ties = 0
    for r in range(rows):
        for c in range(cols):
            q = Fraction(float(x[r, c])) / Fraction(float(s[r, c]))
            ties += abs(q) in mids
            want = grid_round(q, fmt.element, "nearest")
            assert Fraction(float(parts.q[r, c])) == want, (r, c, q, want)
    assert ties > 0 or amax == 1234.567  # a short tensor scale makes exact ties


def test_stochastic_rounding_is_unbiased_and_seeded():
    fmt = lowfp.scaled.mxfp4_e2m1
    x = torch.full((64, 4096), 0.3)
    x[:, ::32] = 6.0  # block max: scale 1
    a = lowfp.quantize(x, fmt, "stochastic", seed=7)
    b = lowfp.quantize(x, fmt, "stochastic", seed=7)
    c = lowfp.quantize(x, fmt, "stochastic", seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    mask = x != 6.0
    # 0.3 lies between 0 and 0.5 (E2M1's grid): up with probability 0.6
    assert set(a[mask].unique().tolist()) == {0.0, 0.5}
    assert abs(a[mask].mean().item() - 0.3) < 0.003
    # the element draws follow lowfp.quantize's Philox indexing: equal to rounding x / s with
    # the same seed when s = 1
    assert torch.equal(a, lowfp.quantize(x, "float4_e2m1fn", "stochastic", seed=7))


def test_counts_and_non_finite_elements():
    x = torch.tensor([[1.0, float("nan"), float("inf"), 1e-30] + [0.5] * 28,
                      [0.0] * 32])
    st = lowfp.scaled.ScaledStats()
    y = lowfp.quantize(x, "mxfp8_e4m3", stats=st)
    assert math.isnan(y[0, 1]) and y[0, 2] == 448.0 * 2.0 ** -8  # inf saturates (scale 2^-8)
    assert y[0, 3] == 0.0 and torch.equal(y[1], x[1])
    d = st.as_dict()
    assert d == {"overflow": 1, "underflow": 1, "nan": 1, "numel": 64, "saturated_blocks": 0, "blocks": 2}
    tiny = torch.full((1, 32), 2.0 ** -140)
    lowfp.quantize(tiny, "mxfp8_e4m3", stats=st)
    assert st.saturated_blocks == 1  # 2^(-140 - 8) is below E8M0's 2^-127


def test_granularities_and_shapes():
    x = torch.randn(2, 6, 40)
    per_tensor = lowfp.scaled.encode(x, "fp8_e4m3_tensorwise")
    want = torch.tensor(float(x.abs().max()) / 448.0, dtype=torch.float32)  # a / max_E in float32
    assert per_tensor.scales.shape == () and float(per_tensor.scales) == float(want)
    rows = lowfp.scaled.encode(x, "fp8_e4m3_rowwise")
    assert rows.scales.shape == (2, 6, 1)
    cols = lowfp.scaled.encode(x, Scaled("float8_e4m3fn", block=4, axis=1, scale="float32"))
    assert cols.scales.shape == (2, 2, 40)  # 6 rows in blocks of 4: the last block is short
    want = torch.stack([lowfp.scaled.encode(x[:, :, j], Scaled("float8_e4m3fn", block=4, scale="float32")).value
                        for j in range(40)], dim=-1)
    assert torch.equal(cols.value, want)
    two_d = lowfp.scaled.encode(torch.randn(2, 8, 12), Scaled("float8_e4m3fn", block=(4, 6), scale="float32"))
    assert two_d.scales.shape == (2, 2, 2)
    with pytest.raises(ValueError, match="span the leading dims"):
        lowfp.scaled.encode(torch.randn(2, 6, 12), Scaled("float8_e4m3fn", block=(4, 6), scale="float32"))


def test_formats_print_parse_and_compare():
    for name, fmt in lowfp.scaled.named().items():
        assert str(fmt) == name and Scaled.parse(name) == fmt
        # (lowfp.formats names them too, beside the element formats)
        assert getattr(lowfp.formats, name) is fmt and name in dir(lowfp.formats)
    with pytest.raises(AttributeError, match="mxfp9"):
        _ = lowfp.formats.mxfp9
    f = Scaled("fp(4,3,4)", block=(2, 8), scale="float32")
    assert Scaled.parse(str(f)) == f and hash(Scaled.parse(str(f))) == hash(f)
    assert Scaled("float8_e4m3fn", block=32) == lowfp.scaled.mxfp8_e4m3
    assert Scaled("float8_e4m3fn", block=32, scale_rule="rceil") != lowfp.scaled.mxfp8_e4m3
    assert lowfp.scaled.mxfp8_e4m3.bits == 8 + 8 / 32 and lowfp.scaled.nvfp4.bits == 4 + 8 / 16
    with pytest.raises(ValueError, match="scale_rule"):
        Scaled("float8_e4m3fn", block=32, scale_rule="nearest")
    with pytest.raises(ValueError, match="mantissa bits"):
        Scaled("float32" if False else "fp(8,23,0)", block=32)
    with pytest.raises(ValueError, match="axis"):
        Scaled("float8_e4m3fn", block=32, axis=None)


def test_gradients_pass_straight_through_and_inputs_are_untouched():
    x = torch.randn(4, 64, requires_grad=True)
    before = x.detach().clone()
    y = lowfp.quantize(x, "nvfp4")
    (y * torch.arange(64.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(64.0).expand(4, 64))
    assert torch.equal(x.detach(), before)


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1", "mxfp6_e2m3", "nvfp4",
                                  "fp8_e4m3_rowwise"])
@pytest.mark.parametrize("rounding", ["nearest", "toward_zero", "up", "down", "stochastic"])
def test_float32_and_float64_carriers_agree(name, rounding):
    # E8M0 scales of 16/32-bit inputs run in a float32 carrier, and their quotients by scales in
    # a format are rounded once for nearest rounding (not to odd); float64 inputs run in float64,
    # dividing to odd: the same values must come out, quotients that underflow float32 included
    # (elements 2^-100 in blocks whose largest is 2^40).
    x = blocks_of_many_magnitudes(16, 256, -20, 20, seed=6)
    x[0, 1:32] = torch.tensor(2.0 ** -100) * torch.randn(31).sign()
    x[0, 0] = 2.0 ** 40
    st32, st64 = lowfp.scaled.ScaledStats(), lowfp.scaled.ScaledStats()
    narrow = lowfp.quantize(x, name, rounding, seed=3, stats=st32)
    wide = lowfp.quantize(x.double(), name, rounding, seed=3, stats=st64)
    assert torch.equal(narrow, wide.float())  # s · q: exact in float64, rounded to float32
    assert torch.equal(st32.counts, st64.counts)
    assert torch.equal(lowfp.scaled.encode(x, name, rounding, seed=3).q,
                       lowfp.scaled.encode(x.double(), name, rounding, seed=3).q)
    if rounding in ("up", "down"):  # the underflowed quotients still round away on their side
        assert (narrow[0, 1:32] != 0).sum() > 0
    # A tensor near float32's smallest values: NVFP4's tensor scale and 1 / s beyond float32's
    # range (float32 inputs then take the float64 path, tile by tile).
    tiny = x * 2.0 ** -110
    st32, st64 = lowfp.scaled.ScaledStats(), lowfp.scaled.ScaledStats()
    assert torch.equal(lowfp.quantize(tiny, name, rounding, seed=3, stats=st32),
                       lowfp.quantize(tiny.double(), name, rounding, seed=3, stats=st64).float())
    assert torch.equal(st32.counts, st64.counts)
    for dtype in (torch.bfloat16, torch.float16):
        small = x.clamp(-6e4, 6e4).to(dtype)
        got = lowfp.quantize(small, name, rounding, seed=3)
        want = lowfp.quantize(small.double(), name, rounding, seed=3)
        assert torch.equal(got.double(), lowfp.quantize(want, "float16" if dtype == torch.float16 else "bfloat16"))


def test_compiles_without_graph_breaks_and_traces_fake_and_meta_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def f(x):
        return lowfp.quantize(x, "mxfp8_e4m3") + lowfp.quantize(x, lowfp.scaled.nvfp4, "stochastic")

    x = torch.randn(4, 64)
    torch.manual_seed(0)
    eager = f(x)
    torch.manual_seed(0)
    assert torch.equal(torch.compile(f, fullgraph=True)(x), eager)
    with FakeTensorMode():
        parts = lowfp.scaled.encode(torch.randn(3, 8, 64), "nvfp4")
    assert [tuple(t.shape) for t in parts] == [(3, 8, 64), (3, 8, 64), (3, 8, 4), ()]
    meta = lowfp.scaled.encode(torch.randn(3, 8, 64, device="meta"), Scaled("float8_e4m3fn", block=4, axis=1))
    assert [tuple(t.shape) for t in meta] == [(3, 8, 64), (3, 8, 64), (3, 2, 64), ()]
    results = torch.library.opcheck(torch.ops.lowfp.scaled_quantize.default,
                                    (torch.randn(6, 40, requires_grad=True), "nvfp4", "stochastic",
                                     "saturate", 32, 3, None, 0, True, True))
    assert set(results.values()) == {"SUCCESS"}, results
    results = torch.library.opcheck(torch.ops.lowfp.scaled_quantize_in_graph.default,
                                    (torch.randn(6, 40), "nvfp4", "stochastic", "saturate", 32, 3,
                                     None, 0, True, True))
    assert set(results.values()) == {"SUCCESS"}, results


def test_out_and_in_place():
    torch.manual_seed(0)
    x = blocks_of_many_magnitudes(8, 96, -6, 6, seed=3)
    for fmt, rounding in (("mxfp8_e4m3", "nearest"), ("nvfp4", "stochastic"),
                          (Scaled("float8_e4m3fn", block=4, axis=0), "nearest")):
        want = lowfp.quantize(x, fmt, rounding, seed=7)
        out = torch.full_like(x, float("nan"))
        stats = lowfp.scaled.ScaledStats()
        assert lowfp.quantize(x, fmt, rounding, seed=7, out=out, stats=stats) is out
        assert torch.equal(out, want) and stats.numel == x.numel() and stats.blocks > 0
        y = x.clone()
        assert lowfp.quantize_(y, fmt, rounding, seed=7) is y and torch.equal(y, want)
        t = torch.empty(96, 8).t()  # a non-contiguous out
        lowfp.quantize(x, fmt, rounding, seed=7, out=t)
        assert torch.equal(t, want)
    # out overlapping x elsewhere in the same storage: the result is still x's rounding
    buf = torch.cat([x.flatten(), torch.zeros(64)])
    src, dst = buf[:x.numel()].view_as(x), buf[64:64 + x.numel()].view_as(x)
    want = lowfp.quantize(src.clone(), "mxfp8_e4m3")
    lowfp.quantize(src, "mxfp8_e4m3", out=dst)
    assert torch.equal(dst, want)
    with pytest.raises(ValueError, match="dtype"):
        lowfp.quantize(x, "mxfp8_e4m3", out=torch.empty_like(x, dtype=torch.float64))
    with pytest.raises(ValueError, match="shape"):
        lowfp.quantize(x, "mxfp8_e4m3", out=torch.empty(3))
    with pytest.raises(ValueError, match="out_dtype"):
        lowfp.quantize(x, "mxfp8_e4m3", out_dtype=torch.float64)
    results = torch.library.opcheck(torch.ops.lowfp.scaled_quantize_into.default,
                                    (x, torch.empty_like(x), "nvfp4", "stochastic", "saturate",
                                     32, 3, None, 0, True))
    assert set(results.values()) == {"SUCCESS"}, results

    def f(a, b):
        lowfp.quantize_(b, "mxfp8_e4m3")
        return a + b
    b1, b2 = x.clone(), x.clone()
    assert torch.equal(torch.compile(f, fullgraph=True)(x, b1), f(x, b2)) and torch.equal(b1, b2)


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "nvfp4", "nvfp4_4over6", "fp8_e4m3_rowwise", "mxfp4_e2m1"])
def test_blocks_along_another_axis_are_read_where_they_lie(name):
    # A rounding of a contiguous tensor along an axis that is not last reads it in place (blocks
    # B x 1 of its own layout, scaled.config.kernel_layout); a stochastic one along an axis whose
    # length is not a multiple of 4, or a layout where a block would span two positions of the
    # axes before, copies the axis last. Either way: the bits, parts and counts of the tensor
    # with the axis moved last by hand (stochastic: the words of that layout).
    from lowfp.scaled.config import kernel_layout
    g = torch.Generator().manual_seed(5)
    base = lowfp.scaled.named()[name]
    for shape, axis in (((96, 40), 0), ((70, 33), 0), ((2, 64, 7), 1), ((2, 50, 7), 1), ((3, 64, 2), 1),
                        ((0, 5), 0)):
        x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-9, 9, shape, generator=g).float())
        if x.numel():
            x.view(-1)[3] = float("inf")
        fmt = base.with_axis(axis)
        for rounding in ("nearest", "toward_zero", "stochastic"):
            column = kernel_layout(shape, fmt, True, rounding == "stochastic")[5]
            spans = axis > 0 and shape[axis] % (fmt.block or shape[axis]) != 0
            in_place = not spans and (rounding != "stochastic" or shape[axis] % 4 == 0)
            assert (column is not None) == in_place, (shape, rounding)
            st, st_ref = lowfp.scaled.ScaledStats(), lowfp.scaled.ScaledStats()
            got = lowfp.scaled.encode(x, fmt, rounding, seed=3, stats=st)
            ref = lowfp.scaled.encode(x.movedim(axis, -1).contiguous(), base, rounding, seed=3, stats=st_ref)
            for a, b in zip(got, ref):
                b = b if b.dim() == 0 else b.movedim(-1, axis)
                assert a.shape == b.shape and torch.equal(a, b), (shape, axis, rounding)
            assert torch.equal(st.counts, st_ref.counts)
            y = x.clone()
            assert torch.equal(lowfp.quantize_(y, fmt, rounding, seed=3), got.value)
    x = torch.randn(64, 24, generator=g)
    for rounding in ("nearest", "stochastic"):  # the fake's strides and shapes as the kernel's
        results = torch.library.opcheck(torch.ops.lowfp.scaled_quantize.default,
                                        (x, str(lowfp.scaled.named()["nvfp4"].with_axis(0)), rounding,
                                         "saturate", 32, 3, None, 0, True, True))
        assert set(results.values()) == {"SUCCESS"}, results


def test_random_hadamard_transform():
    from lowfp.scaled import hadamard, hadamard_signs
    g = torch.Generator().manual_seed(9)
    x = torch.randn(8, 64, generator=g, dtype=torch.float64)
    signs = hadamard_signs(3)
    assert set(signs.tolist()) == {-1.0, 1.0} and torch.equal(signs, hadamard_signs(3))
    # against the matrix: H16 · diag(signs) / 4, H16 by Sylvester's construction
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 16:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    want = (x.reshape(-1, 16) * signs.double()) @ h.T / 4
    z = hadamard(x, signs, -1)
    assert torch.allclose(z.reshape(-1, 16), want, rtol=0, atol=1e-12)
    assert torch.allclose(hadamard(z, signs, -1, inverse=True), x, rtol=0, atol=1e-12)
    # quantizing through it: the transformed values are rounded, the result is transformed back
    y = lowfp.scaled.quantize_scaled(x.float(), "nvfp4", hadamard_seed=3)
    zq = lowfp.quantize(hadamard(x.float(), signs, -1), "nvfp4")
    assert torch.equal(y, hadamard(zq, signs, -1, inverse=True))
    with pytest.raises(ValueError, match="multiple"):
        lowfp.scaled.quantize_scaled(torch.randn(4, 40), "nvfp4", hadamard_seed=1)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "nvfp4", Scaled("fp(4,3,4)", axis=None),
                                 Scaled("float8_e4m3fn", block=(2, 16)),
                                 Scaled("fp(4,3,4)", block=8, axis=0)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_rounder_of_a_scaled_format_rounds_as_quantize(fmt, rounding):
    """The emulation's Rounder takes a scaled format's prepared request once it has rounded a
    tensor of the dtype: the bits, counts (a Stats or a ScaledStats) and seed draws of
    quantize_scaled, for contiguous and other layouts."""
    from lowfp.quantize import Rounder
    rounder = Rounder(fmt, rounding)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 64, generator=g) * torch.logspace(-4, 4, 64)
    x[2, 5] = float("nan")
    for t in (x, x, x.t().contiguous().t(), x[:, :32]):
        for stats_type in (lowfp.Stats, lowfp.scaled.ScaledStats):
            s_got, s_want = stats_type(), stats_type()
            torch.manual_seed(3)
            got = rounder(t, s_got)
            torch.manual_seed(3)
            want = lowfp.scaled.quantize_scaled(t, fmt, rounding, stats=s_want)
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)) and got.shape == t.shape
            assert torch.equal(s_got.counts, s_want.counts), (s_got, s_want)
    assert rounder._requests  # (remembered)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_native_hadamard_transform_gives_the_bits_of_the_torch_form(dtype):
    """The one-pass kernel (eager roundings) and the butterflies in torch operators (compiled
    code, other devices) perform the same operations in the same order: the same bits, specials,
    subnormals and sums that overflow included, along either axis, forward and inverse."""
    from lowfp.scaled.quantize import _hadamard_native, _sign_values, hadamard, hadamard_signs
    g = torch.Generator().manual_seed(4)
    info = torch.finfo(dtype)
    # 50 groups: the CPU kernel's chunks of 16 groups and a tail
    x = torch.randn(25, 32, generator=g, dtype=torch.float64) * torch.logspace(-40, 30, 32, dtype=torch.float64)
    x = x.clamp(-info.max, info.max).to(dtype)
    x[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), info.tiny / 4, -0.0]).to(dtype)
    x[1, :16] = info.max  # sums overflow to inf
    x[24, 16:] = -info.max
    ints = torch.int64 if dtype == torch.float64 else torch.int32
    for seed in (0, 7):
        for t, axis in ((x, -1), (x.t().contiguous(), 0), (x.t(), 0)):
            for inverse in (False, True):
                want = hadamard(t, hadamard_signs(seed), axis, inverse)
                got = _hadamard_native(t, _sign_values(seed), axis, inverse)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert torch.equal(got.isnan(), want.isnan())
                assert torch.equal(got.nan_to_num(0.0).view(ints),
                                   want.nan_to_num(0.0).view(ints)), (seed, axis, inverse)
    if dtype in (torch.float32, torch.float64):  # (16-bit inputs are transformed in float32)
        assert torch.isinf(hadamard(x, hadamard_signs(0), -1)[1]).any()  # the overflow case is there
    # quantize_scaled takes the kernel eagerly and the torch form under a dispatch mode: same bits
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    x = (torch.randn(32, 64, generator=g) * 100).to(dtype)
    eager = lowfp.scaled.quantize_scaled(x, "nvfp4", "stochastic", seed=5, hadamard_seed=2)
    with Passthrough():
        moded = lowfp.scaled.quantize_scaled(x, "nvfp4", "stochastic", seed=5, hadamard_seed=2)
    assert torch.equal(eager, moded)


@pytest.mark.parametrize("fmt", [
    "nvfp4",
    Scaled("float4_e2m1fn", block=32, scale="float8_e4m3fn"),  # E4M3 scales, no tensor scale
    Scaled("float4_e2m1fn", block=16, scale="float32", tensor_scale=False),
    Scaled(lowfp.fp(2, 1, 0, subnormals=False), block=16, scale="float8_e4m3fn", tensor_scale=True),
    Scaled(lowfp.fp(1, 2, 0), block=32, scale="float8_e4m3fn"),
])
def test_few_valued_elements_round_by_comparisons_as_the_float64_path_does(fmt):
    # float32 FP4-like elements with scales in a format take the comparison path (scaled.hpp's
    # FewMagnitudes); float64 inputs divide. Every decision point times its block's scale, the
    # float32 values beside it, a ragged last block, zeros, subnormal inputs and non-finite ones:
    # the same values and counts.
    fmt = lowfp.scaled.named()[fmt] if isinstance(fmt, str) else fmt
    rows, cols = 6, 200
    x = blocks_of_many_magnitudes(rows, 224, -12, 12, seed=11)[:, :cols].contiguous()
    scales = lowfp.scaled.encode(x, fmt).scales
    s = scales.repeat_interleave(fmt.block, dim=-1)[:, :cols].double()
    grid = sorted({abs(float(v)) for v in lowfp.quantize(torch.linspace(-8, 8, 4097), fmt.element)})
    mids = torch.tensor([(a + b) / 2 for a, b in zip(grid, grid[1:])] + [1.5 * grid[-1]], dtype=torch.float64)
    g = torch.Generator().manual_seed(12)
    probe = (mids[torch.randint(len(mids), (rows, cols), generator=g)] * s).float()
    side = torch.randint(-1, 2, (rows, cols), generator=g)
    probe = torch.where(side > 0, torch.nextafter(probe, torch.tensor(math.inf)),
                        torch.where(side < 0, torch.nextafter(probe, torch.tensor(0.0)), probe))
    keep = x.abs() == x.abs().reshape(rows, -1).amax(-1, keepdim=True)  # (each block's largest: its scale)
    keep |= torch.rand(rows, cols, generator=g) < 0.3
    x = torch.where(keep, x, probe * torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0))
    x[1, :8] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -1e-45, 2.0 ** -140])
    st32, st64 = lowfp.scaled.ScaledStats(), lowfp.scaled.ScaledStats()
    y32 = lowfp.quantize(x, fmt, stats=st32)
    y64 = lowfp.quantize(x.double(), fmt, stats=st64)
    assert torch.equal(y32.view(torch.int32), y64.float().view(torch.int32))  # (signed zeros too)
    assert torch.equal(st32.counts, st64.counts)
    assert st32.overflow > 0 and st32.underflow > 0 and st32.nan == 1
    assert torch.equal(lowfp.quantize(x, fmt, out=torch.empty_like(x)).view(torch.int32), y32.view(torch.int32))


@pytest.mark.parametrize("fmt", [
    "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1", "nvfp4", "fp8_e4m3_rowwise", "fp8_e4m3_block128x128",
    Scaled("float8_e4m3fn", block=16),                # E8M0 scales, blocks of 16
    Scaled("float8_e4m3fn", block=20),                # blocks of 20: ragged vectors
    Scaled(lowfp.fp(4, 3, 4, subnormals=False), block=32, scale="float8_e4m3fn", tensor_scale=True),
    Scaled("float8_e4m3fnuz", block=32),              # no -0: a zero result drops x's sign
    ("mxfp8_e5m2", "inf"), ("mxfp8_e4m3", "nan"),     # overflow policies: inf stays inf; NaN
])
@pytest.mark.parametrize("rounding", ["nearest", "nearest_away"])
def test_nearest_counts_by_comparison_match_each_elements_events(fmt, rounding):
    # Float32 inputs rounded to nearest count their events by comparing |x| with each block's
    # event points times its scale, before the rounding when it writes in place and after it
    # otherwise; float64 inputs count each element's events as it rounds. Overflows (E8M0's
    # floor rule lets a block's largest element pass max_E), underflows, NaN and infinities.
    x = blocks_of_many_magnitudes(130, 160, -16, 16, seed=13)
    g = torch.Generator().manual_seed(14)
    tiny = torch.rand(x.shape, generator=g) < 0.1
    x = torch.where(tiny, x * 2.0 ** -40, x)
    x[3, 5], x[7, 9], x[9, 40], x[100, 150] = float("nan"), float("inf"), -float("inf"), float("nan")
    fmt, overflow = fmt if isinstance(fmt, tuple) else (fmt, "saturate")
    st64 = lowfp.scaled.ScaledStats()
    want = lowfp.quantize(x.double(), fmt, rounding, overflow=overflow, stats=st64).float()
    assert st64.overflow > 0 and st64.underflow > 0 and st64.nan == 2
    for how in ("new", "out", "in place"):
        st = lowfp.scaled.ScaledStats()
        if how == "new":
            got = lowfp.quantize(x, fmt, rounding, overflow=overflow, stats=st)
        elif how == "out":
            got = lowfp.quantize(x, fmt, rounding, overflow=overflow, stats=st, out=torch.empty_like(x))
        else:
            got = lowfp.quantize_(x.clone(), fmt, rounding, overflow=overflow, stats=st)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), how
        assert torch.equal(st.counts, st64.counts), (how, st.counts, st64.counts)


@pytest.mark.parametrize("fmt", [
    "mxfp8_e4m3", "mxfp4_e2m1", Scaled("float8_e4m3fn", block=16), Scaled("float8_e4m3fn", block=20),
    Scaled("float8_e4m3fnuz", block=32), ("mxfp8_e5m2", "inf"),
])
@pytest.mark.parametrize("sr_bits", [32, 13, 3])
def test_stochastic_float32_inputs_match_the_float64_path(fmt, sr_bits):
    # Float32 inputs under E8M0 scales round stochastically in the float32 carrier, a loop written
    # lane by lane that counts from its own masks; float64 inputs take the float64 carrier. Same
    # seed, same values and counts, whether the result is new, in out= or x itself.
    x = blocks_of_many_magnitudes(70, 160, -16, 16, seed=15)[:, :150].contiguous()  # (ragged blocks)
    g = torch.Generator().manual_seed(16)
    tiny = torch.rand(x.shape, generator=g) < 0.1
    x = torch.where(tiny, x * 2.0 ** -40, x)
    x[3, 5], x[7, 9], x[9, 40], x[60, 149] = float("nan"), float("inf"), -float("inf"), 0.0
    fmt, overflow = fmt if isinstance(fmt, tuple) else (fmt, "saturate")
    kw = dict(seed=17, sr_bits=sr_bits, overflow=overflow)
    st64 = lowfp.scaled.ScaledStats()
    want = lowfp.quantize(x.double(), fmt, "stochastic", stats=st64, **kw).float()
    assert st64.overflow > 0 and st64.underflow > 0 and st64.nan == 1
    for how in ("new", "out", "in place"):
        st = lowfp.scaled.ScaledStats()
        if how == "new":
            got = lowfp.quantize(x, fmt, "stochastic", stats=st, **kw)
        elif how == "out":
            got = lowfp.quantize(x, fmt, "stochastic", stats=st, out=torch.empty_like(x), **kw)
        else:
            got = lowfp.quantize_(x.clone(), fmt, "stochastic", stats=st, **kw)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), how
        assert torch.equal(st.counts, st64.counts), (how, st.counts, st64.counts)


def test_every_cpu_kernel_gives_the_same_bits(tmp_path):
    # The scaled loops are compiled once per instruction-set level (baseline, AVX2, AVX-512) and
    # picked at run time; each level, forced with LOWFP_CPU_KERNEL in a child process, must give
    # the same values and counts: every rounding mode, 16/32/64-bit inputs, E8M0 scales and scales
    # in a format (with a tensor scale), counted or not, and the elements' codes.
    script = r"""
import sys, torch, lowfp
from lowfp.scaled import Scaled
g = torch.Generator().manual_seed(4)
x = torch.randn(24, 160, generator=g) * torch.exp2(torch.randint(-12, 12, (24, 1), generator=g).float())
x[0, :4] = torch.tensor([float("nan"), float("inf"), 0.0, 1e-42])
outs = [lowfp._C.cpu_kernel()]
fmts = ["mxfp8_e4m3", "mxfp4_e2m1", "nvfp4", "fp8_e4m3_rowwise",
        Scaled("float4_e2m1fn", block=32, scale="float8_e4m3fn")]
for fmt in fmts:
    for rounding in ("nearest", "toward_zero", "up", "stochastic"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            xs = x.clamp(-6e4, 6e4).to(dtype)
            st = lowfp.scaled.ScaledStats()
            outs += [lowfp.quantize(xs, fmt, rounding, seed=5),
                     lowfp.quantize(xs, fmt, rounding, seed=5, stats=st), st.counts.clone()]
        outs.append(lowfp.scaled.encode(x, fmt, rounding, seed=5).q)
torch.save(outs, sys.argv[1])
"""
    results = outputs_of_each_kernel(script, tmp_path)
    ref = results["baseline"][1:]
    for kernel, r in results.items():
        assert len(r) - 1 == len(ref)
        for i, (a, b) in enumerate(zip(r[1:], ref)):
            assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                               b.view(torch.uint8) if b.is_floating_point() else b), (kernel, i)


# On a GPU (tests/devices.py): the CPU's bits, counts and steps.

@on_cuda
@pytest.mark.parametrize("name", sorted(lowfp.scaled.named()) + ["rceil", "ceil", "even", "e5m2 2-D",
                                                                  "4over6 mae 2-D", "columns"])
@pytest.mark.parametrize("mode", ["nearest", "down", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_scaled_formats_match_cpu(name, mode, dtype):
    fmt = {"rceil": lowfp.Scaled("float8_e4m3fn", block=32, scale_rule="rceil"),
           "ceil": lowfp.Scaled("float6_e2m3fn", block=17, scale_rule="ceil"),
           "even": lowfp.Scaled("float4_e2m1fn", block=32, axis=0, scale_rule="even"),
           "e5m2 2-D": lowfp.Scaled("float8_e5m2", block=(8, 16), scale="fp(5,2,0)"),
           "4over6 mae 2-D": lowfp.Scaled("float4_e2m1fn", block=(16, 16), scale="float8_e4m3fn",
                                          tensor_scale=True, four_over_six="mae"),
           # (blocks down the columns, a GPU kernel of their own, in every mode)
           "columns": lowfp.Scaled("float4_e2m1fn", block=(16, 1), scale="float8_e4m3fn",
                                   tensor_scale=True)}.get(name, name)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 384, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g).float()))
    x[0, :5] = torch.tensor([float("nan"), float("inf"), 0.0, -0.0, 1e-30])
    x = x.to(dtype)
    cpu_stats, gpu_stats = lowfp.scaled.ScaledStats(), lowfp.scaled.ScaledStats("cuda")
    cpu = lowfp.scaled.encode(x, fmt, mode, seed=5, stats=cpu_stats)
    gpu = lowfp.scaled.encode(x.cuda(), fmt, mode, seed=5, stats=gpu_stats)
    for a, b in zip(cpu, gpu):  # value, q, scales, tensor scale
        assert same_bits(a, b.cpu())
    assert torch.equal(cpu_stats.counts, gpu_stats.counts.cpu())


@on_cuda
@pytest.mark.parametrize("layout, name", [
    (layout, name)
    for layout in ["rows", "short last block", "misaligned", "in place", "one row", "1-D", "along axis 0",
                   "odd row length"]
    for name in ["mxfp8_e4m3", "nvfp4", "fp8_e4m3_block128", "fp8_e4m3_tensorwise", "fp8_e4m3_rowwise",
                 "fp8_e4m3_block128x128"]
    # (2-D blocks need two dims and lie along the last two)
    if not (layout in ("1-D", "along axis 0") and name == "fp8_e4m3_block128x128")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scaled_layouts_match_cpu(layout, name, dtype):
    # The GPU rounds 1-D blocks that cut each row evenly, from aligned buffers, in one pass (MX,
    # NVFP4, 1×128), blocks down the columns (along axis 0, in place) in one pass, blocks of 256
    # to 2^16 elements in rows of whole quads, aligned, in one pass a block (rowwise, 128×128,
    # the rows and the short last block here), and every other layout in passes over the blocks'
    # maxima, the scales and the elements (a tensor's scale: its elements in groups of four, the
    # odd row length's last one short): all give the CPU's bits, scales and counts.
    fmt = lowfp.scaled.named()[name]
    if layout == "along axis 0" and fmt.axis is not None:
        name = fmt.with_axis(0)
    g = torch.Generator().manual_seed(3)
    shape = {"short last block": (48, 200), "one row": (1, 4096), "1-D": (1000,),
             "odd row length": (41, 203)}.get(layout, (48, 256))
    numel = 1
    for d in shape:
        numel *= d
    base = torch.randn(numel + 1, generator=g) * torch.exp2(torch.randint(-12, 12, (numel + 1,), generator=g).float())
    base[7] = float("inf")
    base = base.to(dtype)
    x = (base[1:] if layout == "misaligned" else base[:-1]).reshape(shape)
    for mode in ("nearest", "stochastic"):
        cpu_stats, gpu_stats = lowfp.scaled.ScaledStats(), lowfp.scaled.ScaledStats("cuda")
        cpu = lowfp.scaled.quantize_scaled(x, name, mode, seed=9, stats=cpu_stats)
        xg = x.cuda() if layout != "misaligned" else base.cuda()[1:].reshape(shape)
        if layout == "in place":
            gpu = lowfp.scaled.quantize_scaled(xg, name, mode, seed=9, stats=gpu_stats, out=xg)
            assert gpu.data_ptr() == xg.data_ptr()
        else:
            gpu = lowfp.scaled.quantize_scaled(xg, name, mode, seed=9, stats=gpu_stats)
        assert same_bits(cpu, gpu.cpu()), (layout, mode)
        assert torch.equal(cpu_stats.counts, gpu_stats.counts.cpu()), (layout, mode)
        cpu_parts = lowfp.scaled.encode(x, name, mode, seed=9)
        gpu_parts = lowfp.scaled.encode(x.cuda(), name, mode, seed=9)
        for a, b in zip(cpu_parts, gpu_parts):  # value, q, scales, tensor scale
            assert same_bits(a, b.cpu()), (layout, mode)


@on_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_hadamard_kernel_on_gpu_equals_cpu_and_the_torch_form(dtype):
    from lowfp.scaled.quantize import _hadamard_native, _sign_values, hadamard, hadamard_signs
    x = bit_patterns(64 * 48, dtype, seed=3).reshape(64, 48)
    for axis in (-1, 0):
        for inverse in (False, True):
            cpu = _hadamard_native(x, _sign_values(5), axis, inverse)
            gpu = _hadamard_native(x.cuda(), _sign_values(5), axis, inverse).cpu()
            ref = hadamard(x.cuda(), hadamard_signs(5, "cuda"), axis, inverse).cpu()
            for got in (gpu, ref):
                assert torch.equal(got.isnan(), cpu.isnan())
                assert same_bits(got.nan_to_num(0.0), cpu.nan_to_num(0.0)), (axis, inverse)
    y = lowfp.scaled.quantize_scaled(x.cuda(), "nvfp4", "stochastic", seed=1, hadamard_seed=4)
    assert same_bits(y.cpu().nan_to_num(0.0), lowfp.scaled.quantize_scaled(
        x, "nvfp4", "stochastic", seed=1, hadamard_seed=4).nan_to_num(0.0))


def test_the_gpu_row_blocks_schedule_holds_each_quad_once_in_its_blocks_shuffle_group(tmp_path):
    # cpp/src/cuda/row_blocks_schedule.hpp, which lanes of row_blocks_kernel (MX, NVFP4 on a GPU)
    # hold which quads, followed lane by lane on the CPU for every block width (tests/cpp/).
    out = run_host_program(tmp_path, "row_blocks_schedule.cpp")
    assert out.strip() == "0 failures in 420 cases", out


def test_the_gpu_one_pass_kernels_on_cpu_lanes_give_the_float64_carriers_bits_and_counts(tmp_path):
    # row_blocks_kernel's turns warp by warp, column_blocks_kernel's blocks and tile_blocks_kernel's
    # thread blocks thread by thread, with their own per-thread code (cpp/src/cuda/
    # scaled_one_pass.hpp: the loads, the block's maximum, the scale, the rounding in the carrier
    # the call takes, the words) on the CPU, for MX, NVFP4, 1 × 128 and blocks of 4 and 8 along
    # the rows, down the columns with and without a word_run, and in 2-D tiles, float32,
    # bfloat16 and float64 inputs, four modes, against each block rounded in the float64
    # carrier without faster forms (tests/cpp/).
    out = run_host_program(tmp_path, "scaled_one_pass_on_lanes.cpp", "cpp/src/host/scaled_call.cpp")
    assert out.strip().endswith("0 of 1144 cases differ"), out
    taken = {line.split(":")[0].removeprefix("instance ") for line in out.splitlines()
             if line.startswith("instance ")}
    assert taken == {"checked", "narrow", "narrow faster", "float64", "float64 faster", "float64 faster once"}, out
