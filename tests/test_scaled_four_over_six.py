"""NVFP4 with 4over6 block scales (docs/design.md §9, ``Scaled(four_over_six=)``): bit for bit
against a slow reference of the rule written from the paper (arXiv 2512.02010) in Python
fractions and floats, in every rounding mode, for 1-D and 2-D blocks; the selection against the
exact errors; and against the paper's own float32 formulation on most blocks."""

import math
from fractions import Fraction

import pytest
import torch

import lowfp
from lowfp.scaled import Scaled
from reference import philox_word, round_fraction as round_to

E2M1 = [Fraction(v) for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]
FLOAT32 = lowfp.Format(8, 23, 0, specials="ieee")
E4M3 = lowfp.formats.named()["float8_e4m3fn"]


def e2m1(v: Fraction, rounding: str, word: int = 0) -> Fraction:
    """v rounded to E2M1, saturating: nearest (ties to the even code), toward zero, or
    stochastically with a 32-bit word (up when its value is below f · 2^32, f the fraction of the
    way to the next value)."""
    a = abs(v)
    if a >= 6:
        r = Fraction(6)
    else:
        k = max(i for i, g in enumerate(E2M1) if g <= a)
        lo, hi = E2M1[k], E2M1[k + 1]
        if rounding == "nearest":
            r = lo if a - lo < hi - a else hi if a - lo > hi - a else (lo if k % 2 == 0 else hi)
        elif rounding == "toward_zero":
            r = lo
        else:
            f = (a - lo) / (hi - lo)
            r = hi if word < math.floor(f * 2**32) else lo
    return -r if v < 0 else r


def reference(x: torch.Tensor, block, error: str, rounding: str = "nearest", seed: int = 0):
    """(values, block scales, chose 4) of 2-D float32 x under NVFP4 with 4over6, by the rule: t =
    float32(amax / (256 · 6)), candidates round_E4M3(a / (6 t)) · t and round_E4M3(a / (4 t)) · t,
    each block's errors summed in float64 in row-major order, a tie to 6."""
    rows, cols = x.shape
    br, bc = (1, block) if isinstance(block, int) else block
    xs = x.tolist()
    amax = max(abs(v) for row in xs for v in row if math.isfinite(v))
    t = round_to(Fraction(amax) / (256 * 6), FLOAT32) if amax else Fraction(1)
    out = [[0.0] * cols for _ in range(rows)]
    scales, fours = [], []
    for r0 in range(0, rows, br):
        scale_row, four_row = [], []
        for c0 in range(0, cols, bc):
            cells = [(r, c) for r in range(r0, min(rows, r0 + br)) for c in range(c0, min(cols, c0 + bc))]
            finite = [(r, c) for r, c in cells if math.isfinite(xs[r][c])]
            a = max((abs(Fraction(xs[r][c])) for r, c in finite), default=Fraction(0))
            if a == 0:
                s = Fraction(2) ** (E4M3.emin - E4M3.m) * t
                candidates = [(s, False)]
            else:
                candidates = []
                for target, four in ((6, False), (4, True)):
                    stored = round_to(a / (target * t), E4M3)
                    candidates.append(((stored or Fraction(2) ** (E4M3.emin - E4M3.m)) * t, four))
            best = None
            for s, four in candidates:
                q = {(r, c): e2m1(Fraction(xs[r][c]) / s, rounding,
                                  philox_word(seed, 0, r * cols + c) if rounding == "stochastic" else 0)
                     for r, c in finite}
                err = 0.0
                for r, c in finite:  # float64 arithmetic, as the rule says
                    d = xs[r][c] - float(s * q[r, c])
                    err += d * d if error == "mse" else abs(d)
                if best is None or err < best[0]:
                    best = (err, s, four, q)
            _, s, four, q = best
            for r, c in cells:
                out[r][c] = float(s * q[r, c]) if (r, c) in q else xs[r][c]
            scale_row.append(float(s))
            four_row.append(four)
        scales.append(scale_row)
        fours.append(four_row)
    return (torch.tensor(out, dtype=torch.float32), torch.tensor(scales, dtype=torch.float64),
            torch.tensor(fours))


def nvfp4_data(rows, cols, seed, block_rows=1):
    """Blocks (block_rows × 16) of varied magnitude, with an outlier now and then, so that both
    candidates win."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[rows // 2:] = torch.rand(rows - rows // 2, cols, generator=g) * 2 - 1  # (4 wins most of these)
    exps = torch.randint(-6, 7, (rows // block_rows, cols // 16), generator=g).float()
    x = x * torch.exp2(exps).repeat_interleave(block_rows, 0).repeat_interleave(16, 1)
    spikes = torch.rand(rows, cols, generator=g) < 0.02
    return torch.where(spikes, x * 8, x)


@pytest.mark.parametrize("error", ["mse", "mae"])
@pytest.mark.parametrize("block", [16, (16, 16)])
@pytest.mark.parametrize("rounding", ["nearest", "toward_zero", "stochastic"])
def test_matches_the_rule_bit_for_bit(error, block, rounding):
    fmt = Scaled("float4_e2m1fn", block=block, scale="float8_e4m3fn", tensor_scale=True, four_over_six=error)
    x = nvfp4_data(32, 64, seed=1) if isinstance(block, int) else nvfp4_data(96, 96, seed=1, block_rows=16)
    x[3, 5] = float("nan")  # left out of the errors, and kept
    want, want_scales, fours = reference(x, block, error, rounding, seed=11)
    parts = lowfp.scaled.encode(x, fmt, rounding, seed=11)
    assert torch.isnan(parts.value[3, 5])
    assert torch.equal(torch.nan_to_num(parts.value, nan=7.0), torch.nan_to_num(want, nan=7.0))
    assert torch.equal(parts.scales, want_scales)
    assert 0 < fours.float().mean() < 1  # both candidates chosen: the test tells them apart
    # the stored elements are the chosen candidate's
    finite = torch.isfinite(x)
    per_element = torch.repeat_interleave(
        torch.repeat_interleave(want_scales, 1 if isinstance(block, int) else 16, 0), 16, 1)
    assert torch.equal(parts.value[finite], (parts.q.double() * per_element)[finite].float())


def test_the_choice_has_the_smaller_exact_error():
    # The float64 errors decide as the exact ones do, except at ties too close to tell.
    x = nvfp4_data(64, 128, seed=2)
    for error in ("mse", "mae"):
        fmt = Scaled("float4_e2m1fn", block=16, scale="float8_e4m3fn", tensor_scale=True, four_over_six=error)
        parts = lowfp.scaled.encode(x, fmt)
        t = Fraction(float(parts.tensor_scale))
        decided = 0
        for r in range(x.shape[0]):
            for b in range(x.shape[1] // 16):
                vals = [Fraction(v) for v in x[r, 16 * b:16 * b + 16].tolist()]
                a = max(abs(v) for v in vals)
                errs = []
                for target in (6, 4):
                    s = round_to(a / (target * t), E4M3) * t
                    d = [v - s * e2m1(v / s, "nearest") for v in vals]
                    errs.append(sum(v * v for v in d) if error == "mse" else sum(abs(v) for v in d))
                chosen = Fraction(float(parts.scales[r, b]))
                if abs(errs[0] - errs[1]) > Fraction(1, 10**9) * max(errs):
                    best = round_to(a / ((6 if errs[0] <= errs[1] else 4) * t), E4M3) * t
                    assert chosen == best, (r, b, errs)
                    decided += 1
        assert decided > 0.9 * x.numel() / 16


def test_lower_error_than_nvfp4_and_the_papers_float32_rule_mostly_agrees():
    x = nvfp4_data(128, 256, seed=3)
    plain = lowfp.quantize(x, "nvfp4")
    four = lowfp.quantize(x, "nvfp4_4over6")
    assert ((four - x) ** 2).sum() < ((plain - x) ** 2).sum()
    # The paper's reference in float32 (tensor scale amax / (6 · 256), block scales by a float32
    # product and quotient cast to E4M3, elements x · 6 · 256 / (amax · s)): the same stored block
    # scales for nearly every block (they differ where float32's roundings cross a tie).
    blocks = x.reshape(-1, 16)
    amax = x.abs().max()
    s6 = (blocks.abs().amax(-1) * 256 / amax).to(torch.float8_e4m3fn).float()
    s4 = (blocks.abs().amax(-1) * 256 / amax * 1.5).to(torch.float8_e4m3fn).float()
    grid = torch.tensor([float(v) for v in E2M1])

    def fake(v):
        idx = (v.abs()[..., None] - grid).abs().argmin(-1)  # (nearest; ties to the lower: rare here)
        return v.sign() * grid[idx]

    deq = [fake(blocks * 6 * 256 / (amax * s[:, None])) * s[:, None] * amax / (6 * 256) for s in (s6, s4)]
    err = [((d - blocks) ** 2).sum(-1) for d in deq]
    paper = torch.where(err[1] < err[0], s4, s6).double()
    parts = lowfp.scaled.encode(x, "nvfp4_4over6")
    ours = (parts.scales / parts.tensor_scale).reshape(-1)  # the stored E4M3 scales (exact)
    assert (ours == paper).double().mean() > 0.99 and (ours != s6.double()).any()


def test_format_option_checks_and_round_trips():
    fmt = lowfp.scaled.named()["nvfp4_4over6"]
    assert fmt.four_over_six == "mse" and fmt.name == "nvfp4_4over6"
    assert Scaled.parse(str(fmt)) == fmt
    mae = Scaled("float4_e2m1fn", block=16, scale="float8_e4m3fn", tensor_scale=True, four_over_six="mae")
    assert Scaled.parse(str(mae)) == mae and mae != fmt and "four_over_six='mae'" in str(mae)
    with pytest.raises(ValueError, match="four_over_six"):
        Scaled("float4_e2m1fn", block=16, scale="float8_e4m3fn", tensor_scale=True, four_over_six="l2")
    with pytest.raises(ValueError, match="NVFP4 option"):
        Scaled("float4_e2m1fn", block=32, four_over_six="mse")  # e8m0 scales
    with pytest.raises(ValueError, match="NVFP4 option"):
        Scaled("float8_e4m3fn", block=16, scale="float8_e4m3fn", tensor_scale=True, four_over_six="mse")
    # float64 and float32 inputs, in place and not, counts
    x = nvfp4_data(8, 64, seed=4)
    st = lowfp.scaled.ScaledStats()
    y = lowfp.quantize(x, fmt, stats=st)
    assert torch.equal(lowfp.quantize(x.double(), fmt).float(), y)
    assert torch.equal(lowfp.quantize_(x.clone(), fmt), y)
    assert st.blocks == 32 and st.numel == x.numel()


def test_compiled_keeps_the_operator_and_equals_eager():
    x = nvfp4_data(8, 64, seed=5)
    f = torch.compile(lambda v: lowfp.quantize(v, "nvfp4_4over6"), fullgraph=True)
    assert torch.equal(f(x), lowfp.quantize(x, "nvfp4_4over6"))
