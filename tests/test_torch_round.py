"""The torch form of the rounding (lowfp._torch_round), which Inductor compiles in place of
lowfp::quantize: the same bits and counts as the native kernels for every format family, mode,
carrier and boundary, the same Philox words, and compiled code that holds no lowfp operator."""

import itertools

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from inductor_code import compiled_code

import lowfp
from lowfp import _C, _torch_round
from lowfp._torch_round import philox_block_words, philox_words, quantize as torch_quantize

FORMATS = ["fp(4,3,4)", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "fp(5,0,3)",
           "fp(2,1,0)", "fp(8,3,1)", "fp(6,5,-20)", "bfloat16", "float16", "p3109_k8p3se",
           "p3109_k8p1sf", "fp(3,2,0,subnormals=False)", "fp(5,2,0,overflow='nan')",
           "fp(4,3,4,overflow='inf')", "fp(11,40,0,specials='ieee')", "fp(10,30,-100)"]
MODES = ["nearest", "nearest_away", "toward_zero", "up", "down", "stochastic"]
U64 = (1 << 64) - 1


def boundary_values(fmt: lowfp.Format, dtype: torch.dtype) -> torch.Tensor:
    """Values around every interesting point of the format: grid points, midpoints and their
    carrier neighbours, max and beyond, the subnormal range, zeros, infinities and NaN."""
    g = torch.Generator().manual_seed(0)
    wide = torch.float64
    pts = [0.0, fmt.max, fmt.max * 1.0625, fmt.max * 2, 2.0 ** fmt.emin,
           2.0 ** (fmt.emin - fmt.m), 2.0 ** (fmt.emin - fmt.m - 1), 1.0, 1.5, 3.0,
           float("inf"), float("nan")]
    for e in range(max(fmt.emin - fmt.m - 3, -1070), min(fmt.emax + 2, 1020)):
        step = 2.0 ** (e - fmt.m)
        for k in range(0, 2 ** min(fmt.m, 3) + 1):
            pts += [2.0 ** e + k * step, 2.0 ** e + (k + 0.5) * step]
    base = torch.tensor(pts, dtype=wide)
    base = base[torch.isnan(base) | (base.abs() <= torch.finfo(dtype).max) | torch.isinf(base)]
    base = base.to(dtype)
    finite = base.isfinite()
    bits_dtype = {torch.float16: torch.int16, torch.bfloat16: torch.int16,
                  torch.float32: torch.int32, torch.float64: torch.int64}[dtype]
    b = base.view(bits_dtype)
    neighbours = [b, (b + 1).view(dtype)[finite], (b - 1).view(dtype)[finite & (base != 0)]]
    vals = torch.cat([neighbours[0].view(dtype)] + neighbours[1:])
    rand = torch.randn(2000, generator=g, dtype=wide) * torch.exp2(
        torch.randint(fmt.emin - fmt.m - 4, fmt.emax + 3, (2000,), generator=g).to(wide))
    rand = rand[rand.abs() <= torch.finfo(dtype).max].to(dtype)
    vals = torch.cat([vals, rand])
    return torch.cat([vals, -vals])


def native(x, fmt, rounding, seed, offset, dtype, sr_bits=32):
    stats = lowfp.Stats()
    y = lowfp.quantize(x, fmt, rounding, seed=seed if rounding == "stochastic" else None,
                       offset=offset, sr_bits=sr_bits, stats=stats, out_dtype=dtype)
    return y, stats.counts


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


def fits(fmt: lowfp.Format, dtype) -> bool:
    return not fmt.fit_error(dtype)


@pytest.mark.parametrize("fmt_text", FORMATS)
def test_every_mode_and_carrier_equals_the_native_kernel(fmt_text):
    fmt = lowfp.Format.parse(fmt_text)
    checked = 0
    for dtype, mode in itertools.product(
            (torch.float16, torch.bfloat16, torch.float32, torch.float64), MODES):
        out_dtype = dtype if fits(fmt, dtype) else torch.float64
        if not fits(fmt, out_dtype):
            continue
        x = boundary_values(fmt, dtype)
        seed, offset = 0x0123456789ABCDEF, 2**64 - 7  # block indices wrap past 2^64
        for sr_bits in ((32, 5) if mode == "stochastic" else (32,)):
            want, want_counts = native(x, fmt, mode, seed, offset, out_dtype, sr_bits)
            have, have_counts = torch_quantize(x, str(fmt), mode, sr_bits, seed, None, offset,
                                               out_dtype, True)
            assert same_bits(have, want), (dtype, mode, sr_bits)
            assert torch.equal(have_counts, want_counts), (dtype, mode, sr_bits)
            checked += 1
    assert checked >= 6


@pytest.mark.parametrize("fmt_text,by_addition", [
    ("float8_e4m3fn", True), ("float8_e5m2", True), ("fp(4,3,4)", True), ("float16", True),
    ("fp(7,3,63)", False),  # the kernel adds, but half its smallest step, 2^-129, is subnormal
    ("bfloat16", False),    # the kernel's constant would pass float32's range: round_bits there
    ("fp(3,2,0,subnormals=False)", False)])
def test_the_torch_form_rounds_by_addition_where_the_kernel_does_and_flushing_cannot_tell(
        fmt_text, by_addition):
    p = _torch_round.round_params(fmt_text, "nearest", 32, torch.float32, torch.float32)
    assert _torch_round.rounds_by_addition(p, _torch_round.FLOAT32_CARRIER, "nearest") is by_addition
    assert not _torch_round.rounds_by_addition(p, _torch_round.FLOAT32_CARRIER, "stochastic")
    # A backend that flushes subnormals (DAZ and FTZ here, as a GPU compiler may) gives the
    # native kernel's bits and counts: float32 subnormals and the format's own smallest steps.
    fmt = lowfp.Format.parse(fmt_text)
    tiny = torch.tensor([1e-45, 3e-39, 1.1754942e-38, 2.0 ** -126, 2.0 ** (fmt.emin - fmt.m),
                         1.5 * 2.0 ** (fmt.emin - fmt.m), 2.0 ** (fmt.emin - fmt.m - 1)])
    x = torch.cat([tiny, -tiny, boundary_values(fmt, torch.float32)])
    want, want_counts = native(x, fmt, "nearest", None, 0, torch.float32)
    if by_addition:
        torch.set_flush_denormal(True)
    try:
        have, have_counts = torch_quantize(x, fmt_text, "nearest", 32, 0, None, 0, torch.float32, True)
    finally:
        torch.set_flush_denormal(False)
    assert same_bits(have, want) and torch.equal(have_counts, want_counts)


def test_stochastic_words_follow_the_drawn_seed_tensor():
    x = torch.randn(1000, dtype=torch.float32)
    key = 0xFEDCBA9876543210
    drawn = torch.tensor([key & 0xFFFFFFFF, key >> 32], dtype=torch.int64)
    have, _ = torch_quantize(x, "fp(3,2,0)", "stochastic", 32, 0, drawn, 12, x.dtype, False)
    want = lowfp.quantize(x, "fp(3,2,0)", "stochastic", seed=key, offset=12)
    assert same_bits(have, want)


def test_philox_words_equal_the_known_answer_function():
    blocks = torch.tensor([0, 1, 2, 2**32 - 1, 2**32, 2**40 + 5, 2**62 - 1], dtype=torch.int64)
    for key, offset in ((0, 0), (U64, U64), (0x243F6A8885A308D3, 2**63 + 11)):
        words = torch.stack(philox_block_words(blocks, key, offset), dim=-1).tolist()
        for b, got in zip(blocks.tolist(), words):
            block = (offset + b) & U64
            want = _C.philox4x32_10(block & 0xFFFFFFFF, block >> 32, 0, 0, key & 0xFFFFFFFF,
                                    key >> 32)
            assert tuple(got) == want, (key, offset, b)
    # Element i takes word i mod 4 of block offset + i div 4, whatever the shape.
    flat = philox_words(torch.Size([23]), "cpu", 5, 9).tolist()
    shaped = philox_words(torch.Size([23, 1]), "cpu", 5, 9)
    assert shaped.flatten().tolist() == flat
    for i, w in enumerate(flat):
        assert w == _C.philox4x32_10(9 + i // 4, 0, 0, 0, 5, 0)[i % 4]


@pytest.mark.parametrize("mode", ["nearest", "stochastic"])
@pytest.mark.parametrize("shape", [(0,), (), (3, 0, 2), (5,)])
def test_empty_and_zero_dim_tensors(shape, mode):
    x = torch.randn(shape) * 30
    want, want_counts = native(x, lowfp.Format.parse("fp(4,3,4)"), mode, 11, 3, x.dtype)
    have, have_counts = torch_quantize(x, "fp(4,3,4)", mode, 32, 11, None, 3, x.dtype, True)
    assert have.shape == x.shape and same_bits(have, want)
    assert torch.equal(have_counts, want_counts)


def test_non_contiguous_inputs_draw_by_the_logical_index():
    x = torch.randn(64, 48).t()[::2]
    y, _ = torch_quantize(x, "fp(4,3,4)", "stochastic", 32, 99, None, 5, x.dtype, False)
    assert same_bits(y, lowfp.quantize(x, "fp(4,3,4)", "stochastic", seed=99, offset=5))


@pytest.mark.parametrize("view", ["columns", "offset", "transposed", "expanded", "bfloat16", "empty"])
def test_compiled_views_round_where_they_lie(fused, view):
    """The torch form reads its input where it lies (it stores x itself, not a copy of its bits):
    views with strides, a storage offset, a zero stride, a 16-bit dtype or no elements give the
    native bits, counts and layout, nearest and stochastic."""
    base = torch.randn(64, 130) * 100
    x = {"columns": base[:, 1::2], "offset": base[3:, 5:], "transposed": base.t(),
         "expanded": base[0].expand(8, 130), "bfloat16": base.to(torch.bfloat16)[:, 2:],
         "empty": base[:0]}[view]

    def f(t):
        stats = [lowfp.Stats(), lowfp.Stats()]
        ys = [lowfp.quantize(t, "fp(4,3,4)", "nearest", stats=stats[0]),
              lowfp.quantize(t, "fp(4,3,4)", "stochastic", seed=3, stats=stats[1])]
        return ys, [s.counts for s in stats]

    (got, got_counts), code = compiled_code(f, x)
    want, want_counts = f(x)
    assert "lowfp" not in code
    for g, w, gc, wc in zip(got, want, got_counts, want_counts):
        assert same_bits(g, w) and g.stride() == w.stride() and torch.equal(gc, wc)


def test_compiled_rounding_is_fused_into_inductors_kernel(fused):
    """For every mode: no lowfp operator in the generated code, the rounding inside the kernel
    that also computes its producer, its counts and its consumer, and the native result (one
    graph holds the six, one compile)."""
    x = torch.randn(3, 1000) * 50

    def f(t, stats):
        return [lowfp.quantize(torch.sin(t) * (300 + 50 * i), "float8_e4m3fn", mode, seed=7,
                               stats=s).relu()
                for i, (mode, s) in enumerate(zip(MODES, stats))]

    stats = [lowfp.Stats() for _ in MODES]
    got, code = compiled_code(f, x, stats)
    assert "lowfp" not in code
    # One generated kernel: the sines, the roundings, their counts and the relus.
    assert code.count("async_compile.cpp_pybinding") == 1 and "cpp_fused" in code
    assert ".sin()" in code
    want_stats = [lowfp.Stats() for _ in MODES]
    want = f(x, want_stats)
    for mode, w, h, ws, hs in zip(MODES, want, got, want_stats, stats):
        assert same_bits(h, w), mode
        assert torch.equal(hs.counts, ws.counts) and ws.numel == x.numel(), mode
    assert sum(s.overflow for s in want_stats) > 0


def test_inductor_casts_the_bitcasts_of_the_torch_forms_in_vector_registers():
    """lowfp._inductor.vectorize_cpu_bitcasts: float32/int32 and float64/int64 views in Inductor's
    CPU code are vector casts (one vector per lane group, two for float64 lanes of a float32
    kernel), not a loop over the lanes, and give eager's bits (a length with a vector tail)."""
    from lowfp._inductor import vectorize_cpu_bitcasts

    vectorize_cpu_bitcasts()

    def f(t):
        wide = (t * 3).to(torch.float64)
        trimmed = (wide.view(torch.int64) & ~0xFFFF).view(torch.float64).to(torch.float32)
        return trimmed + ((t.view(torch.int32) ^ 0x1).view(torch.float32))

    x = torch.randn(1003) * 1e5
    got, code = compiled_code(f, x)
    assert same_bits(got, f(x))
    assert "at::vec::cast<int64_t, double>" in code and "at::vec::cast<float, int32_t>" in code
    assert "bit_cast" not in code  # Inductor's lane-by-lane fallback


def test_compiled_out_and_in_place_forms_equal_eager(fused):
    x = torch.randn(513) * 100

    def f(t, out, stats):
        lowfp.quantize(t, "fp(5,2,0)", "up", out=out, stats=stats)
        u = t.clone()
        lowfp.quantize_(u, "fp(4,3,4)", "stochastic", seed=3, stats=stats)
        return u

    outs, stats = [torch.empty(513), torch.empty(513)], [lowfp.Stats(), lowfp.Stats()]
    want = f(x, outs[0], stats[0])
    got, code = compiled_code(f, x, outs[1], stats[1])
    assert "lowfp" not in code
    assert same_bits(got, want) and same_bits(outs[1], outs[0])
    assert torch.equal(stats[0].counts, stats[1].counts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_results_are_stored_as_their_patterns_where_inductor_computes_in_float32(
        fused, monkeypatch, dtype):
    """Inductor's Triton code keeps 16-bit floats in float32 registers and stores them by a
    conversion, which on a GPU makes every NaN the canonical one. Where it generates Triton, the
    torch form stores the 16-bit patterns as int16 and returns a view of that memory
    (_torch_round.stored_as). Checked here with the CPU taking that path (its C++ code keeps the
    bits either way): the generated code stores int16 and views it, and the result has the
    native bits, NaNs of either sign and with payloads included."""
    assert not _torch_round._stores_through_float32(torch.device("cpu"))
    assert _torch_round._stores_through_float32(torch.device("cuda"))
    with torch._inductor.config.patch(cpu_backend="triton"):
        assert _torch_round._stores_through_float32(torch.device("cpu"))
    monkeypatch.setattr(_torch_round, "_stores_through_float32", lambda device: True)
    patterns = {torch.bfloat16: [0x7FFF, -1, 0x7FC1, -0x3F, 0x7F80, 0x3F80, -0x4000, 0x0001],
                torch.float16: [0x7FFF, -1, 0x7E01, -0x1FF, 0x7C00, 0x3C00, -0x4000, 0x0001]}[dtype]
    x = torch.cat([torch.tensor(patterns, dtype=torch.int16).view(dtype),
                   (torch.randn(500) * 30).to(dtype)])

    def f(t):
        return [lowfp.quantize(t, "fp(4,3,4)", "nearest"), lowfp.quantize(t, "float8_e5m2", "stochastic", seed=5)]

    got, code = compiled_code(f, x)
    assert "lowfp" not in code
    assert "torch.int16" in code and code.count("view.dtype(") >= 2  # (stored int16, viewed)
    for g, w in zip(got, f(x)):
        assert same_bits(g, w) and torch.isnan(w).sum() == 4


def test_compiled_gradient_rounding_is_fused_too(fused):
    x = torch.randn(300, requires_grad=True)

    def f(t):
        y = lowfp.quantize(t * 2, "fp(4,3,4)", grad_fmt="float8_e5m2", grad_rounding="down")
        return (y * torch.linspace(-1e4, 1e4, 300)).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    (loss, code) = run_and_get_code(lambda t: compiled(t).backward(), x)
    got = x.grad.clone()
    x.grad = None
    f(x).backward()
    assert "lowfp" not in "\n".join(code)
    assert same_bits(got, x.grad)


@pytest.mark.parametrize("fmt_text,masks", [
    ("float8_e4m3fn", True), ("fp(4,3,4)", True),  # saturation
    ("float8_e5m2", True), ("fp(4,3,4,overflow='inf')", True),  # infinity
    ("fp(5,2,0,overflow='nan')", False),  # +NaN for either sign
    ("float8_e4m3fnuz", False),  # no negative zero
    ("bfloat16", False)])  # not by addition
def test_nearest_by_addition_takes_its_choices_by_masks_where_the_overflow_keeps_the_sign(
        fmt_text, masks):
    """round_by_addition (lane masks, Events in mask form) where the overflow is the sign over one
    magnitude; both forms give the native kernel's bits and counts, signalling NaNs, NaN
    payloads, infinities and zeros of both signs among the inputs."""
    c = _torch_round.FLOAT32_CARRIER
    p = _torch_round.round_params(fmt_text, "nearest", 32, torch.float32, torch.float32)
    takes_masks = _torch_round.rounds_by_addition(p, c, "nearest") and \
        _torch_round.keeps_sign_on_overflow(p, c)
    assert takes_masks is masks
    fmt = lowfp.Format.parse(fmt_text)
    specials = torch.tensor([0x7F800001, 0x7FA00000, 0x7FC00000, 0x7FFFFFFF, 0x7F800000, 0, 1],
                            dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([specials, -specials, boundary_values(fmt, torch.float32)])
    want, want_counts = native(x, fmt, "nearest", None, 0, torch.float32)
    have, have_counts = torch_quantize(x, fmt_text, "nearest", 32, 0, None, 0, torch.float32, True)
    assert same_bits(have, want) and torch.equal(have_counts, want_counts)
    assert have_counts[0] > 0 and have_counts[2] == torch.isnan(x).sum() >= 8  # both signs
    if masks:  # the flag form of the same rounding agrees with the mask form
        bits = x.view(torch.int32)
        by_masks, events = _torch_round.round_by_addition(bits, p, c)
        by_flags, flags = _torch_round.round_bits(bits, p, c, "nearest", None,
                                                 _torch_round.lanes_of(c, "nearest"))
        assert torch.equal(by_masks, by_flags)
        assert events.masks and all(set(e.unique().tolist()) <= {-1, 0} for e in events[:3])
        assert not flags.masks and all(e.dtype == torch.bool for e in flags[:3])
        assert torch.equal(torch.stack(_torch_round.event_counts(events, x.numel())),
                           torch.stack(_torch_round.event_counts(flags, x.numel())))


@pytest.mark.slow
def test_all_float32_patterns_compiled_equal_native(fused):
    """Every float32 bit pattern through the Inductor-compiled rounding (CPU backend), nearest,
    with counts, for fp(4,3,4), float8_e4m3fn and float8_e5m2, against the native kernel."""
    names = ("fp(4,3,4)", "float8_e4m3fn", "float8_e5m2")
    chunk = 1 << 20  # (4 MiB buffers, which the allocator reuses: larger ones are new pages each time)

    def round_all(t, stats):
        return [lowfp.quantize(t, name, stats=s) for name, s in zip(names, stats)]

    torch._dynamo.reset()
    compiled = torch.compile(round_all, fullgraph=True, dynamic=False)
    base = torch.arange(chunk, dtype=torch.int32)
    for lo in range(-(1 << 31), 1 << 31, chunk):
        x = (base + lo).view(torch.float32)
        native_stats = [lowfp.Stats() for _ in names]
        fused_stats = [lowfp.Stats() for _ in names]
        for name, want, have in zip(names, round_all(x, native_stats), compiled(x, fused_stats)):
            assert torch.equal(want.view(torch.int32), have.view(torch.int32)), (name, lo)
        for name, s_native, s_fused in zip(names, native_stats, fused_stats):
            assert torch.equal(s_native.counts, s_fused.counts), (name, lo)


@pytest.mark.parametrize("setting,fused_here", [(None, False), ("0", False), ("1", True)])
def test_the_setting_chooses_fusion_or_the_operator(monkeypatch, setting, fused_here):
    """LOWFP_INDUCTOR_FUSION, read when a graph is traced: the CPU keeps lowfp's kernel unless it
    is 1 (auto fuses on CUDA devices: test_compiled_and_exported_roundings_on_gpu_equal_eager in
    tests/test_compile.py); the bits are the same either way."""
    if setting is None:
        monkeypatch.delenv("LOWFP_INDUCTOR_FUSION", raising=False)
    else:
        monkeypatch.setenv("LOWFP_INDUCTOR_FUSION", setting)
    x = torch.randn(100) * 40
    y, code = compiled_code(lambda t: lowfp.quantize(t, "fp(4,3,4)").relu(), x)
    assert ("lowfp" not in code) == fused_here  # (no call of lowfp's kernel where fused)
    assert same_bits(y, lowfp.quantize(x, "fp(4,3,4)").relu())
    assert _torch_round.fuses(torch.device("cuda")) == (setting != "0")
    monkeypatch.setenv("LOWFP_INDUCTOR_FUSION", "auto")  # the default, said: as None above
    assert not _torch_round.fuses(x.device) and _torch_round.fuses(torch.device("cuda"))
    monkeypatch.setenv("LOWFP_INDUCTOR_FUSION", "yes")
    with pytest.raises(ValueError, match="LOWFP_INDUCTOR_FUSION must be one of auto, 1, 0"):
        _torch_round.fuses(x.device)
