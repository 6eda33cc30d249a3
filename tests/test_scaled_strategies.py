"""The CPU's element strategies for scaled formats (cpp/src/cpu/scaled/plan.hpp, docs/kernels.md):
the plan picks each where its conditions hold, and each, forced on every call that allows it,
gives the float64 strategy's values, counts and elements, new, into out= and in place."""

import contextlib
from fractions import Fraction
import math
import os
import subprocess
import sys

import pytest
import torch

import lowfp
from lowfp import _C
from lowfp.scaled import Scaled, ScaledStats
from lowfp.scaled.quantize import prepared
from reference import Spec, philox_word, positive_values

STRATEGIES = ("float64", "checked", "narrow", "lanes", "few")


@contextlib.contextmanager
def forced(name):
    before = _C.forced_scaled_strategy()
    _C.force_scaled_strategy(name)
    try:
        yield
    finally:
        _C.force_scaled_strategy(before)


def as_scaled(fmt):
    return Scaled.parse(fmt) if isinstance(fmt, str) else fmt


def cpu_plan(fmt, rounding, dtype, *, parts=False, overflow="saturate", block_cols=64):
    fmt = as_scaled(fmt)
    request = prepared(_C, fmt, rounding, overflow, 32, dtype)
    return request.cpu_plan(block_cols=fmt.block if isinstance(fmt.block, int) else block_cols,
                            parts=parts)


E4M3_SCALES = Scaled("float8_e4m3fn", block=16, scale="float8_e4m3fn")
FP4_BLOCK32 = Scaled("float4_e2m1fn", block=32, scale="float8_e4m3fn")

PLANS = [  # format, rounding, dtype, elements written, the strategy the plan takes
    ("nvfp4", "nearest", torch.float32, False, "few"),
    (FP4_BLOCK32, "nearest", torch.float32, False, "few"),
    ("nvfp4", "nearest", torch.float32, True, "checked"),      # (q wanted: no comparisons)
    (E4M3_SCALES, "nearest", torch.float32, False, "checked"),  # (too many magnitudes)
    ("fp8_e4m3_rowwise", "nearest", torch.float32, False, "checked"),
    ("mxfp8_e4m3", "nearest", torch.float32, False, "lanes"),
    ("mxfp4_e2m1", "stochastic", torch.float32, False, "lanes"),
    ("mxfp8_e4m3", "toward_zero", torch.float32, False, "narrow"),  # (directed: no vector loop)
    ("mxfp8_e4m3", "nearest", torch.float32, True, "narrow"),
    ("mxfp8_e4m3", "stochastic", torch.bfloat16, False, "narrow"),
    ("mxfp8_e4m3", "nearest", torch.float16, False, "narrow"),
    ("mxfp8_e4m3", "nearest", torch.float64, False, "float64"),
    ("nvfp4", "toward_zero", torch.float32, False, "float64"),
    ("nvfp4", "nearest", torch.bfloat16, False, "float64"),
    ("nvfp4", "stochastic", torch.float32, False, "checked"),
    ("fp8_e4m3_rowwise", "stochastic", torch.float32, True, "checked"),
    (Scaled("float6_e3m2fn", block=16, scale="float8_e4m3fn"), "stochastic", torch.float32, False, "checked"),
    # (m = 7: the margin of 2^(m + 13) would rerun most tiles)
    (Scaled("fp(5,7,0)", block=16, scale="float8_e4m3fn"), "stochastic", torch.float32, False, "float64"),
    ("nvfp4", "stochastic", torch.bfloat16, False, "float64"),
]


@pytest.mark.parametrize("fmt,rounding,dtype,parts,want", PLANS)
def test_the_plan_takes_the_first_strategy_a_call_allows(fmt, rounding, dtype, parts, want):
    plan = cpu_plan(fmt, rounding, dtype, parts=parts)
    assert plan["strategy"] == want
    assert "float64" in plan["allowed"] and want in plan["allowed"]
    # (the order of preference: no division, vectors, the float32 carrier, checked, float64)
    assert plan["allowed"][-1] == want or STRATEGIES.index(want) == max(
        STRATEGIES.index(s) for s in plan["allowed"])
    # Counts by comparison where the strategy does not count in its own loop
    by_comparison = dtype == torch.float32 and rounding == "nearest" and want in ("checked", "narrow", "float64")
    assert plan["count_by_comparison"] == by_comparison


def test_few_needs_blocks_of_whole_vectors():
    fmt = Scaled("float4_e2m1fn", block=20, scale="float8_e4m3fn")
    plan = cpu_plan(fmt, "nearest", torch.float32)
    assert "few" not in plan["allowed"] and plan["strategy"] == "checked"


def inputs(rows, cols, dtype, seed):
    """Values of many magnitudes (a scale per row), tiny ones whose quotients underflow, the
    special values, and ties of E4M3 and E2M1 under a block scale of 1 (a block whose largest
    magnitude is 448, or 6), where Checked's check fails and the element is rounded again in
    float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-24, 24, (rows, 1), generator=g).double())
    x = torch.where(torch.rand(rows, cols, generator=g, dtype=torch.float64) < 0.05, x * 2.0 ** -30, x)
    x[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    x[1, :8] = torch.tensor([448.0, 1.0625, -1.0625, 3.625, 0.0, 2.0 ** -10, 13.0, -208.0])
    x[2, :8] = torch.tensor([6.0, 0.25, -0.75, 1.25, 2.5, -5.0, 0.0, 3.5])
    x[1, 16] = 464.0  # (E4M3's overflow threshold, under a block scale of 1 in blocks of 16)
    return x.clamp(-6e4, 6e4).to(dtype)


FORCED = [  # format, rounding, dtype: together they allow every strategy
    ("nvfp4", "nearest", torch.float32),
    (FP4_BLOCK32, "nearest", torch.float32),
    (E4M3_SCALES, "nearest", torch.float32),
    ("fp8_e4m3_rowwise", "nearest", torch.float32),
    ("fp8_e4m3_block128x128", "nearest", torch.float32),
    ("mxfp8_e4m3", "nearest", torch.float32),
    ("mxfp4_e2m1", "nearest", torch.float32),
    (("mxfp8_e5m2", "inf"), "nearest", torch.float32),
    ("mxfp8_e4m3", "stochastic", torch.float32),
    ("mxfp4_e2m1", "stochastic", torch.float32),
    ("nvfp4", "stochastic", torch.float32),
    ("fp8_e4m3_rowwise", "stochastic", torch.float32),
    ("fp8_e4m3_block128x128", "stochastic", torch.float32),
    ("mxfp8_e4m3", "toward_zero", torch.float32),
    ("mxfp8_e4m3", "up", torch.bfloat16),
    ("mxfp4_e2m1", "stochastic", torch.float16),
    ("mxfp8_e4m3", "nearest", torch.bfloat16),
    # blocks along axis 0, read in place as blocks down the columns (scaled.config.kernel_layout)
    (lowfp.scaled.named()["mxfp8_e4m3"].with_axis(0), "nearest", torch.float32),
    (lowfp.scaled.named()["mxfp8_e4m3"].with_axis(0), "toward_zero", torch.bfloat16),
    (lowfp.scaled.named()["nvfp4"].with_axis(0), "nearest", torch.float32),
    (lowfp.scaled.named()["fp8_e4m3_rowwise"].with_axis(0), "nearest", torch.float32),
]


def run(x, fmt, rounding, overflow, how):
    """The values, the 6 counts and (how "parts") the elements q of one call."""
    st = ScaledStats()
    kw = dict(seed=7, overflow=overflow)
    if how == "parts":
        enc = lowfp.scaled.encode(x, fmt, rounding, **kw)
        return enc.q, None, None
    if how == "new":
        y = lowfp.quantize(x, fmt, rounding, stats=st, **kw)
    elif how == "out":
        y = lowfp.quantize(x, fmt, rounding, stats=st, out=torch.empty_like(x), **kw)
    elif how == "in place":
        y = lowfp.quantize_(x.clone(), fmt, rounding, stats=st, **kw)
    else:  # uncounted
        y = lowfp.quantize(x, fmt, rounding, **kw)
        return y, None, None
    return y, st.counts.clone(), None


@pytest.mark.parametrize("shape", [(37, 150), (3, 4200)], ids=["ragged", "tiles"])
@pytest.mark.parametrize("fmt,rounding,dtype", FORCED)
def test_every_strategy_gives_the_float64_strategys_bits(fmt, rounding, dtype, shape):
    fmt, overflow = fmt if isinstance(fmt, tuple) else (fmt, "saturate")
    x = inputs(*shape, dtype, seed=shape[1])
    hows = ("new", "out", "in place", "uncounted", "parts")
    with forced("float64"):
        want = {how: run(x, fmt, rounding, overflow, how) for how in hows}
    counts = want["new"][1]
    assert counts[2] == 1 and counts[3] == x.numel()  # (the NaN; every element)
    scaled = as_scaled(fmt)
    block = scaled.block if isinstance(scaled.block, int) else shape[1]
    if isinstance(scaled.block, tuple):
        block = scaled.block[1]
    tried = set()
    for how in hows:
        allowed = cpu_plan(fmt, rounding, dtype, parts=how == "parts", overflow=overflow,
                           block_cols=block)["allowed"]
        for name in [None, *allowed]:
            tried.add(name)
            with forced(name):
                y, c, _ = run(x, fmt, rounding, overflow, how)
            w, wc, _ = want[how]
            assert torch.equal(y.view(torch.uint8), w.view(torch.uint8)), (name, how)
            if wc is not None:
                assert torch.equal(c, wc), (name, how, c, wc)
    assert len(tried) > 2  # (the plan, float64 and at least one other)


# Checked's stochastic rounding against exact arithmetic: element formats, their grids
CHECKED_STOCHASTIC = {"nvfp4": Spec(2, 1, 0, "none"), "fp8_e4m3_rowwise": Spec(4, 3, 0, "fn")}


def near_decisions(fmt, sr_bits, seed, midpoints=False):
    """A float32 tensor whose elements' exact quotients x / s lie within float32's rounding of
    s · (g + (r' + 1) 2^-32 step) (g on E's grid, r' element i's Philox word with its low bits
    set), where the decision for its own word changes (midpoints: r' + 1 = 2^31, E's midpoints,
    where nearest rounding decides); each block's scale pinned by a larger first element. Returns
    x, s and the words r'."""
    g = torch.Generator().manual_seed(seed)
    scaled = Scaled.parse(fmt)
    rows, cols = 4, 4096
    block = scaled.block if isinstance(scaled.block, int) else cols
    base = torch.rand(rows, cols, generator=g, dtype=torch.float64) * 0.1
    base[:, ::block] = 1.0 + torch.rand(rows, cols // block, generator=g, dtype=torch.float64)
    base *= torch.exp2(torch.randint(-12, 12, (rows, cols // block), generator=g).double()).repeat_interleave(block, 1)
    x = base.float()
    s = lowfp.scaled.encode(x, fmt).scales.repeat_interleave(block, 1)  # (float64 s = S · t)
    values = positive_values(CHECKED_STOCHASTIC[fmt])
    grid = [v for v in values if v * 2 <= values[-1]]
    low = (1 << (32 - sr_bits)) - 1
    words = [2**31 - 1 if midpoints else philox_word(7, 0, i) | low for i in range(rows * cols)]
    picks = torch.randint(0, len(grid) - 1, (rows * cols,), generator=g).tolist()
    signs = torch.randint(0, 2, (rows * cols,), generator=g).tolist()
    flat, sf = x.view(-1), s.reshape(-1).tolist()
    for i in range(rows * cols):
        if i % cols % block == 0:
            continue  # (the block's largest, which sets its scale)
        lo, hi = grid[picks[i]], grid[picks[i] + 1]
        v = float(lo) + (words[i] + 1) * 2.0 ** -32 * float(hi - lo)  # (exact in float64)
        flat[i] = (-1.0) ** signs[i] * v * sf[i]  # (to float32 on assignment)
    assert torch.equal(lowfp.scaled.encode(x, fmt).scales.repeat_interleave(block, 1), s)
    return x, s, words


def stochastic_q(quotients, words, spec):
    """Each exact quotient's q: up from its grid point when r' is below its position
    floor(2^32 (|q| - g) / step)."""
    grid = positive_values(spec)
    out = []
    for q, r in zip(quotients, words):
        a = abs(q)
        k = max(j for j in range(len(grid)) if grid[j] <= a)
        if k + 1 == len(grid):
            out.append(math.copysign(float(grid[k]), q))  # (only the blocks' largest)
            continue
        lo, hi = grid[k], grid[k + 1]
        up = r < math.floor((a - lo) / (hi - lo) * 2**32)
        out.append(math.copysign(float(hi if up else lo), q))
    return torch.tensor(out, dtype=torch.float64)


def nearest_q(quotients, spec):
    """Each exact quotient's nearest value on E's grid, ties to the even code (saturating)."""
    grid = positive_values(spec)
    out = []
    for q in quotients:
        a = abs(q)
        k = max(j for j in range(len(grid)) if grid[j] <= a)
        if k + 1 == len(grid):
            out.append(math.copysign(float(grid[k]), q))
            continue
        below, above = a - grid[k], grid[k + 1] - a
        up = above < below or (above == below and k % 2 == 1)
        out.append(math.copysign(float(grid[k + 1] if up else grid[k]), q))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("fmt", sorted(CHECKED_STOCHASTIC))
def test_checked_nearest_rounds_again_the_quotients_at_e_midpoints(fmt):
    x, s, _ = near_decisions(fmt, 32, seed=11, midpoints=True)
    spec = CHECKED_STOCHASTIC[fmt]
    exact = [Fraction(v) / Fraction(d) for v, d in zip(x.view(-1).tolist(), s.reshape(-1).tolist())]
    want = nearest_q(exact, spec).view(x.shape)
    approx = (x * (1.0 / s).float()).view(-1).tolist()  # (the float32 quotient Checked rounds)
    assert (nearest_q([Fraction(a) for a in approx], spec).view(x.shape) != want).sum().item() > 20
    results = {}
    for name in (None, "checked", "float64"):  # (None: the plan's, counting by comparison)
        with forced(name):
            st = ScaledStats()
            y = lowfp.quantize(x, fmt, stats=st)
            inplace = lowfp.quantize_(x.clone(), fmt)
            results[name] = (y, st.counts.clone(), inplace, lowfp.scaled.encode(x, fmt).q)
    assert results["float64"][1][1] > 100  # (underflows: the midpoints of 0 and E's smallest)
    assert torch.equal(results["checked"][3].double(), want)
    for name in (None, "checked"):
        for got, wanted in zip(results[name], results["float64"]):
            assert torch.equal(got.view(torch.uint8), wanted.view(torch.uint8)), name


@pytest.mark.parametrize("sr_bits", [32, 9])
@pytest.mark.parametrize("fmt", sorted(CHECKED_STOCHASTIC))
def test_checked_stochastic_rounds_again_the_quotients_at_their_words_decisions(fmt, sr_bits):
    x, s, words = near_decisions(fmt, sr_bits, seed=sr_bits)
    spec = CHECKED_STOCHASTIC[fmt]
    exact = [Fraction(v) / Fraction(d) for v, d in zip(x.view(-1).tolist(), s.reshape(-1).tolist())]
    want = stochastic_q(exact, words, spec).view(x.shape)
    # The float32 quotient Checked rounds (x · fl(1 / s)) decides otherwise for many elements
    approx = (x * (1.0 / s).float()).view(-1).tolist()
    wrong = (stochastic_q([Fraction(a) for a in approx], words, spec).view(x.shape) != want).sum().item()
    assert wrong > 20
    assert cpu_plan(fmt, "stochastic", torch.float32)["strategy"] == "checked"
    kw = dict(seed=7, sr_bits=sr_bits)
    results = {}
    for name in (None, "checked", "float64"):
        with forced(name):
            st = ScaledStats()
            results[name] = (lowfp.quantize(x, fmt, "stochastic", stats=st, **kw), st.counts.clone(),
                             lowfp.scaled.encode(x, fmt, "stochastic", **kw).q)
    for name in (None, "checked"):
        y, counts, q = results[name]
        assert torch.equal(y.view(torch.int32), results["float64"][0].view(torch.int32)), name
        assert torch.equal(counts, results["float64"][1]), name
        assert torch.equal(q.double(), want), name


def test_the_forced_strategies_cover_every_strategy():
    seen = set()
    for fmt, rounding, dtype in FORCED:
        fmt, overflow = fmt if isinstance(fmt, tuple) else (fmt, "saturate")
        for parts in (False, True):
            seen.update(cpu_plan(fmt, rounding, dtype, parts=parts, overflow=overflow)["allowed"])
    assert seen == set(STRATEGIES)


def test_forcing_a_strategy_a_call_does_not_allow_leaves_its_plan():
    x = inputs(8, 64, torch.float64, seed=1)
    want = lowfp.quantize(x, "mxfp8_e4m3")
    with forced("few"):
        assert _C.forced_scaled_strategy() == "few"
        assert torch.equal(lowfp.quantize(x, "mxfp8_e4m3").view(torch.uint8), want.view(torch.uint8))
    assert _C.forced_scaled_strategy() is None


def test_an_unknown_strategy_is_a_value_error():
    with pytest.raises(ValueError, match="float64, checked, narrow, lanes or few"):
        _C.force_scaled_strategy("fastest")
    assert _C.forced_scaled_strategy() is None


def test_the_environment_variable_forces_a_strategy():
    code = "import lowfp; print(lowfp._C.forced_scaled_strategy())"
    env = dict(os.environ, LOWFP_SCALED_STRATEGY="checked")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "checked"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_blocks_wider_than_a_tile_round_as_each_block_alone(strategy):
    # Blocks of 3000 in rows of 7000: a row's tiles of 2048 share their first block's scales in
    # some tiles and not in others (each tile's block forms are reused only for the same blocks).
    fmt = Scaled("float8_e4m3fn", block=3000, scale="float32")
    x = inputs(3, 7000, torch.float32, seed=11)
    x = x * torch.exp2(torch.arange(7000) // 3000 * 6.0 - 6.0)  # each block of its own magnitude
    with forced(strategy):
        got = lowfp.quantize(x, fmt)
    for c0 in range(0, 7000, 3000):
        part = x[:, c0:c0 + 3000].contiguous()
        want = lowfp.quantize(part, fmt)
        assert torch.equal(got[:, c0:c0 + 3000].contiguous().view(torch.int32), want.view(torch.int32)), c0


@pytest.mark.parametrize("fmt,dtype", [("mxfp8_e4m3", torch.float32), ("mxfp4_e2m1", torch.float16),
                                       ("nvfp4", torch.float32), ("fp8_e4m3_rowwise", torch.bfloat16)])
def test_stochastic_blocks_along_axis_0_read_in_place_draw_the_moved_layouts_words(fmt, dtype):
    """Stochastic rounding along axis 0 of a contiguous tensor whose axis 0 is a multiple of 4
    long is read where it lies (scaled.config.kernel_layout), its words those of the tensor with
    axis 0 moved last (docs/design.md §9): in every strategy, the bits and counts of that moved
    copy rounded along its last axis, on two column tiles and rows of two threads."""
    from lowfp.scaled.config import kernel_layout
    base = lowfp.scaled.named()[fmt]
    along = base.with_axis(0)
    x = inputs(64, 2100, dtype, seed=11)
    assert kernel_layout(tuple(x.shape), along, True, True)[5] == 0  # (the column layout)
    want_stats = ScaledStats()
    want = lowfp.quantize(x.t().contiguous(), base, "stochastic", seed=5, offset=3, stats=want_stats).t()
    allowed = cpu_plan(along, "stochastic", dtype, block_cols=1)["allowed"]
    for name in [None, *allowed]:
        with forced(name):
            st = ScaledStats()
            got = lowfp.quantize(x, along, "stochastic", seed=5, offset=3, stats=st)
            assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               want.view(torch.int16 if dtype != torch.float32 else torch.int32)), name
            assert torch.equal(st.counts, want_stats.counts), name
