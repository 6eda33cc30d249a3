"""The quantize API: layouts, dtypes, out=/in-place, numpy, autograd, errors (docs/design.md §3, §7)."""

import contextlib
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import lowfp
from cpu_kernels import outputs_of_each_kernel
from devices import on_cuda, same_bits
from host_programs import run_host_program

F = "fp(4,3,4)"


def ref(x):
    """Element-wise reference via the contiguous float64 path (checked elsewhere)."""
    return lowfp.quantize(x.contiguous().double(), F).to(x.dtype)


# -- shapes and layouts -----------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: torch.randn(()),                               # 0-d
    lambda: torch.randn(0),                                # empty
    lambda: torch.randn(3, 0, 5),
    lambda: torch.randn(7, 9).t(),                         # transposed
    lambda: torch.randn(100)[::3],                         # strided
    lambda: torch.randn(2, 3, 5, 7).to(memory_format=torch.channels_last),
    lambda: torch.randn(4, 1).expand(4, 6),                # broadcast view (stride 0)
])
def test_layouts(make):
    x = make() * 20
    before = x.clone()
    y = lowfp.quantize(x, F)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y, ref(x))
    assert torch.equal(x, before)  # input untouched


_DENSE_AND_NOT = [
    lambda: torch.randn(4, 6, 5, 7).to(memory_format=torch.channels_last),
    lambda: torch.randn(3, 4, 5, 6, 7).to(memory_format=torch.channels_last_3d),
    lambda: torch.randn(7, 9).t(),
    lambda: torch.randn(5, 6, 7).permute(2, 0, 1),
    lambda: torch.randn(5, 1, 7).transpose(0, 2),          # a size-1 dim with any stride
    lambda: torch.randn(8, 9)[:, 1:7],                     # not dense
    lambda: torch.randn(4, 1).expand(4, 6),                # overlapping
]


@pytest.mark.parametrize("make", _DENSE_AND_NOT)
@pytest.mark.parametrize("rounding", ["nearest", "toward_zero", "stochastic"])
def test_results_keep_the_inputs_layout(make, rounding):
    """Like torch's element-wise operators, a result is laid out as torch.empty_like(x) (x's
    strides when x is dense), and its values, counts and stochastic draws (by logical index)
    are those of the contiguous input."""
    x = make() * 40
    before = x.clone()
    stats, want_stats = lowfp.Stats(), lowfp.Stats()
    y = lowfp.quantize(x, F, rounding, seed=7, stats=stats, out_dtype=torch.float64)
    want = lowfp.quantize(x.contiguous(), F, rounding, seed=7, stats=want_stats,
                          out_dtype=torch.float64)
    assert y.stride() == torch.empty_like(x).stride()
    assert torch.equal(y, want) and torch.equal(stats.counts, want_stats.counts)
    z, st = lowfp.s2fp8_quantize(x, rounding=rounding, seed=7)
    z_want, st_want = lowfp.s2fp8_quantize(x.contiguous(), rounding=rounding, seed=7)
    assert z.stride() == torch.empty_like(x).stride()
    assert torch.equal(z, z_want) and torch.equal(st.params, st_want.params)
    assert torch.equal(x, before)
    inplace = x.clone()
    lowfp.quantize_(inplace, F, rounding, seed=7)
    assert torch.equal(inplace, want.float())


def test_out_and_inplace():
    x = torch.randn(64, 33) * 30
    want = ref(x)
    out = torch.empty_like(x)
    assert lowfp.quantize(x, F, out=out) is out and torch.equal(out, want)
    out_t = torch.empty(33, 64).t()  # non-contiguous out
    lowfp.quantize(x, F, out=out_t)
    assert torch.equal(out_t, want)
    view = x.clone()[:, ::2]
    base = view._base
    y = lowfp.quantize_(view, F)
    assert y is view and torch.equal(view, ref(x[:, ::2]))
    assert torch.equal(base[:, 1::2], x[:, 1::2])  # the other columns untouched
    z = x.clone()
    lowfp.quantize(z, F, out=z)  # out aliasing the input
    assert torch.equal(z, want)


@pytest.mark.parametrize("write", [
    lambda y: lowfp.quantize_(y, F),
    lambda y: lowfp.quantize(y.detach().clone(), F, out=y),
    lambda y: lowfp.quantize(y.detach().clone(), F, out=y.t()),  # non-contiguous: a copy_ back
    lambda y: lowfp.s2fp8_quantize(y.detach().clone(), out=y),
    lambda y: lowfp.quantize_(y, "mxfp8_e4m3"),
    lambda y: lowfp.quantize(y.detach().clone(), "nvfp4", out=y),
])
def test_writing_a_tensor_saved_for_backward_is_seen_by_autograd(write):
    """quantize_ / out= write through the tensor's pointer; like torch's in-place ops they must
    bump its version, so a backward that saved the old values raises instead of using the new."""
    x = torch.randn(6, 6, requires_grad=True)
    y = x.exp()  # exp's backward reads y
    version = y._version
    with torch.no_grad():
        write(y)
    assert y._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_inference_tensors_are_written_only_in_inference_mode():
    """As torch's in-place ops: inside torch.inference_mode() fine, outside a clear error and
    the tensor unchanged."""
    with torch.inference_mode():
        x = torch.randn(40) * 30
        y = torch.empty(40)
        lowfp.quantize(x, F, out=y)
        z = x.clone()
        lowfp.quantize_(z, F)
    assert torch.equal(y, ref(x)) and torch.equal(z, ref(x))
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        z.mul_(2)  # torch's rule
    before = z.clone()
    with pytest.raises(ValueError, match="x is an inference tensor"):
        lowfp.quantize_(z, F)
    with pytest.raises(ValueError, match="out is an inference tensor"):
        lowfp.quantize(torch.randn(40), F, out=z)
    with pytest.raises(ValueError, match="out is an inference tensor"):
        lowfp.s2fp8_quantize(torch.randn(40), out=z)
    assert torch.equal(z, before)
    assert torch.equal(lowfp.quantize(z, F), ref(z))  # reading one is fine


@pytest.mark.parametrize("fmt", [F, "mxfp8_e4m3", "nvfp4", "s2fp8"])
def test_expanded_tensors_are_refused_as_out_or_in_place(fmt):
    """An expanded tensor (stride 0) cannot hold one result per element: a named ValueError
    before any native code, as torch's own out= and in-place ops refuse it."""
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="out has elements that share memory"):
        lowfp.quantize(x, fmt, out=torch.zeros(1, 64).expand(4, 64))
    with pytest.raises(ValueError, match="x has elements that share memory"):
        lowfp.quantize_(torch.zeros(1, 64).expand(4, 64), fmt)
    if fmt == "nvfp4":
        with pytest.raises(ValueError, match="out has elements that share memory"):
            lowfp.scaled.quantize_scaled(x, fmt, hadamard_seed=0, out=torch.zeros(1, 64).expand(4, 64))
    out = torch.zeros(4, 64)
    lowfp.quantize(x, fmt, out=out.expand(4, 64))  # an expand that repeats nothing is fine
    assert torch.equal(out, lowfp.quantize(x, fmt))


def test_a_hadamard_transform_of_a_0d_tensor_is_refused_by_name():
    with pytest.raises(ValueError, match="x is a 0-d tensor"):
        lowfp.scaled.quantize_scaled(torch.tensor(1.0), "nvfp4", hadamard_seed=0)
    with pytest.raises(ValueError, match="x has 1 dim"):
        lowfp.scaled.quantize_scaled(torch.ones(32), lowfp.Scaled("float4_e2m1fn", block=16, axis=-2),
                                     hadamard_seed=0)


@pytest.mark.parametrize("shift", [1, -1, 700])
def test_out_overlapping_the_input_reads_it_first(shift):
    """out= that overlaps x without being x (NumPy's rule): as if x were copied first. The
    threads of the kernel would otherwise read elements another thread already rounded."""
    flat = torch.randn(5000) * 30
    n = flat.numel() - abs(shift)
    src = slice(0, n) if shift > 0 else slice(-shift, None)
    dst = slice(shift, None) if shift > 0 else slice(0, n)
    for apply in (lambda x, out: lowfp.quantize(x, F, "stochastic", seed=3, out=out),
                  lambda x, out: lowfp.s2fp8_quantize(x, out=out)):
        want = apply(flat[src].clone(), None)
        buf = flat.clone()
        apply(buf[src], buf[dst])
        got, want = buf[dst], (want[0] if isinstance(want, tuple) else want)
        assert torch.equal(got, want)
        untouched = slice(0, shift) if shift > 0 else slice(n, None)
        assert torch.equal(buf[untouched], flat[untouched])


def test_dtypes_and_out_dtype():
    x = torch.randn(1000) * 8
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        xd = x.to(dt)
        y = lowfp.quantize(xd, "float8_e4m3fn")
        assert y.dtype == dt
        assert torch.equal(y.double(), lowfp.quantize(xd.double(), "float8_e4m3fn"))
    y = lowfp.quantize(x.half(), "bfloat16", out_dtype=torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y, x.half().float().bfloat16().float())
    # fp(8,7,0) does not fit float32 but fits float64: the float32 input is rounded in float64
    big = torch.tensor([3e38, 1e39 / 1e1, 1.0])
    y = lowfp.quantize(big, "fp(8,7,0)", out_dtype=torch.float64)
    assert y.dtype == torch.float64 and y[2] == 1.0
    # float64 input to a float32 result is rounded once, in float64
    v = torch.tensor([464 + 2.0**-20], dtype=torch.float64)
    assert lowfp.quantize(v, "float8_e4m3fn", overflow="nan", out_dtype=torch.float32).isnan().all()


def test_numpy_arrays():
    rng = np.random.default_rng(0)
    for dt in (np.float16, np.float32, np.float64):
        a = (rng.standard_normal((5, 6)) * 10).astype(dt)
        before = a.copy()
        y = lowfp.quantize(a, F)
        assert isinstance(y, np.ndarray) and y.dtype == dt and y.shape == a.shape
        np.testing.assert_array_equal(y, lowfp.quantize(torch.from_numpy(a), F).numpy())
        np.testing.assert_array_equal(a, before)
    a = rng.standard_normal(50).astype(np.float32) * 10
    np.testing.assert_array_equal(lowfp.quantize(a[::-2], F), lowfp.quantize(a[::-2].copy(), F))
    ro = a.copy()
    ro.flags.writeable = False
    np.testing.assert_array_equal(lowfp.quantize(ro, F), lowfp.quantize(a, F))
    out = np.empty(50, dtype=np.float32)
    assert lowfp.quantize(a, F, out=out) is out
    back = np.empty(100, dtype=np.float32)[::-2]  # negative-stride out
    lowfp.quantize(a, F, out=back)
    np.testing.assert_array_equal(back, lowfp.quantize(a, F))
    b = a.copy()
    lowfp.quantize_(b, F)
    np.testing.assert_array_equal(b, lowfp.quantize(a, F))
    assert lowfp.quantize(np.array(3.3, dtype=np.float32), F).shape == ()
    scalar = lowfp.quantize(np.float32(3.3), F)
    assert isinstance(scalar, np.float32) and scalar == np.float32(3.25)
    wide = np.empty(50)  # a float64 out sets the result dtype: rounded in float64
    lowfp.quantize(a, F, out=wide)
    np.testing.assert_array_equal(wide, lowfp.quantize(a.astype(np.float64), F))
    np.testing.assert_array_equal(lowfp.quantize(a, F, out_dtype=np.float64),
                                  lowfp.quantize(a.astype(np.float64), F))
    big_endian = a.astype(">f4")  # read through a native copy, as numpy's ufuncs accept it
    np.testing.assert_array_equal(lowfp.quantize(big_endian, F), lowfp.quantize(a, F))
    lowfp.quantize_(big_endian, F)
    assert big_endian.dtype == np.dtype(">f4")
    np.testing.assert_array_equal(big_endian, lowfp.quantize(a, F))
    # an out that only a copy can stand for gets the checks of a viewed one
    with pytest.raises(ValueError, match="out has dtype torch.float16, which cannot hold"):
        lowfp.quantize(a, "bfloat16", out=np.empty(100, dtype=np.float16)[::-2])


def test_stats_accumulate():
    s = lowfp.Stats()
    x = torch.tensor([1.0, 1e5, -1e5, 1e-9, 0.0, float("nan"), float("inf")])
    lowfp.quantize(x, F, stats=s)
    lowfp.quantize(x, F, stats=s)
    assert s.as_dict() == {"overflow": 6, "underflow": 2, "nan": 2, "numel": 14}
    assert s.ratio("overflow") == 6 / 14
    assert "overflow=6" in repr(s)
    s.reset()
    assert s.numel == 0 and s.ratio("nan") == 0.0


# The CPU kernel counts a tile's overflows and NaNs only where its largest magnitude passes the
# format's largest (cpp/src/cpu/quantize_kernels.cpp, kTile elements a tile); these tiles hold an
# event or none in every arrangement it must get right.
_TILE = 2048


def _tiles_with_and_without_events(fmt, dtype):
    g = torch.Generator().manual_seed(3)
    tiles = [torch.randn(_TILE, generator=g, dtype=torch.float64) * fmt.max / 8 for _ in range(10)]
    tiles[0][::97] = fmt.smallest / 3  # underflows only
    tiles[1][-1] = fmt.max * 4  # one overflow, the tile's last element
    tiles[2][5] = fmt.max  # the largest value itself: no event
    tiles[3][1000] = float("nan")
    tiles[4][7] = fmt.max * (1 + fmt.eps / 8)  # above max, rounds to it in nearest
    tiles[5][::3] = -fmt.max * 2  # two tiles of many overflows, then a quiet one
    tiles[6][1::2] = fmt.max * 2
    tiles[8][0] = float("inf")
    tiles[9] = tiles[9][:1001]  # a partial tile, its last element an overflow
    tiles[9][-1] = -fmt.max * 3
    return torch.cat(tiles).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mode", ["nearest", "toward_zero", "stochastic"])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_counts_of_tiles_with_and_without_events(dtype, mode, in_place, threads):
    fmt = lowfp.formats.float8_e5m2  # overflows to inf: the counts can be read off the result
    x = _tiles_with_and_without_events(fmt, dtype)
    before = x.clone()
    saved = lowfp.get_num_threads()
    try:
        lowfp.set_num_threads(threads)
        want = lowfp.quantize(x, fmt, mode, seed=9)  # no counts: the loop that counts nothing
        stats = lowfp.Stats()
        got = lowfp.quantize_(x, fmt, mode, seed=9, stats=stats) if in_place else \
            lowfp.quantize(x, fmt, mode, seed=9, stats=stats)
    finally:
        lowfp.set_num_threads(saved)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert in_place or torch.equal(x.view(torch.uint8), before.view(torch.uint8))
    nan = before.isnan()
    # overflow to inf, except toward zero, which stops at max (from max + ulp up)
    overflowed = (before.double().abs() >= fmt.max + 2.0**(fmt.emax - fmt.m) if mode == "toward_zero"
                  else want.isinf())
    assert stats.as_dict() == {"overflow": int((overflowed & ~nan).sum()),
                               "underflow": int(((want == 0) & (before != 0)).sum()),
                               "nan": int(nan.sum()), "numel": before.numel()}
    assert stats.overflow > 0 and stats.underflow > 0  # (the tiles hold what they should)


# -- autograd -----------------------------------------------------------------------------------

def test_straight_through_gradient():
    x = (torch.randn(50) * 10).requires_grad_()
    y = lowfp.quantize(x, F)
    assert torch.equal(y.detach(), ref(x.detach()))
    g = torch.randn(50)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_gradient_rounded_to_grad_fmt():
    x = (torch.randn(50) * 10).requires_grad_()
    g = torch.randn(50) * 1000
    lowfp.quantize(x, F, grad_fmt="fp(5,2,0)").backward(g)
    assert torch.equal(x.grad, lowfp.quantize(g, "fp(5,2,0)"))
    x.grad = None
    lowfp.quantize(x, F, grad_fmt="fp(5,2,0)", grad_rounding="toward_zero").backward(g)
    assert torch.equal(x.grad, lowfp.quantize(g, "fp(5,2,0)", "toward_zero"))


def test_gradient_with_dtype_change():
    x = torch.randn(10, dtype=torch.float16, requires_grad=True)
    y = lowfp.quantize(x, "bfloat16", out_dtype=torch.float32)
    y.sum().backward()
    assert x.grad.dtype == torch.float16 and torch.equal(x.grad, torch.ones(10, dtype=torch.float16))


# -- large tensors --------------------------------------------------------------------------------

def test_more_than_2_to_the_31_elements():
    n = 2**31 + 9
    x = torch.full((n,), 0.3, dtype=torch.float16)
    x[-3:] = torch.tensor([100.0, -7.7, 1e-4])
    s = lowfp.Stats()
    lowfp.quantize_(x, "float8_e4m3fn", stats=s)
    assert s.numel == n and s.overflow == 0 and s.underflow == 1
    want = torch.tensor([0.3, 100.0, -7.7, 1e-4], dtype=torch.float16)
    want = lowfp.quantize(want.float(), "float8_e4m3fn").half()
    assert torch.equal(x[[0, n - 3, n - 2, n - 1]], want)
    assert torch.equal(x[2**31 - 2: 2**31 + 2], want[:1].expand(4))
    del x


@pytest.mark.long
def test_extra_bits_and_s2fp8_over_2_to_the_31_elements():
    # About 14 GB at the peak (float32 input and its bfloat16 split, then the float32 merge).
    n = 2**31 + 9
    w = torch.full((n,), 0.3)
    w[-3:] = torch.tensor([100.0 + 2**-10, -7.7, 1e-30])
    at = torch.tensor([0, 2**31 - 1, 2**31, n - 3, n - 2, n - 1])
    s = lowfp.Stats()
    w16, packed = lowfp.extra_bits.split(w, torch.bfloat16, 4, "nearest", stats=s)
    assert s.numel == n
    want16, want_packed = lowfp.extra_bits.split(w[at], torch.bfloat16, 4, "nearest")
    want = lowfp.extra_bits.merge(want16, want_packed, 4, "nearest")
    assert torch.equal(w16[at], want16)
    del w
    merged = lowfp.extra_bits.merge(w16, packed, 4, "nearest")  # packed words past 2^31 / 32 blocks
    assert torch.equal(merged[at], want) and want[0] != float(torch.tensor(0.3).bfloat16())
    del merged, packed
    x = w16.view(torch.float16)  # reuse the memory: S2FP8 of float16 input, in place
    x.fill_(0.3)
    x[-3:] = torch.tensor([100.0, -7.7, 1e-4])
    y, stats = lowfp.s2fp8_quantize(x, out=x)
    assert stats.count == n and y is x
    # float64 reference of docs/design.md §4 for n - 3 copies of 0.3 and three other magnitudes
    values = torch.tensor([0.3, 100.0, -7.7, 1e-4]).half().double()
    logs = values.abs().log2()
    mu = (float(logs[0]) * (n - 3) + math.fsum(logs[1:].tolist())) / n
    m = float(logs.max())
    alpha = 15.0 / (m - mu)
    beta = -alpha * mu
    assert (stats.mu, stats.m, stats.alpha, stats.beta) == pytest.approx((mu, m, alpha, beta), rel=1e-12)
    y8 = (values.sign() * torch.exp2(alpha * logs + beta)).to(torch.float8_e5m2).double()
    want = torch.where(y8 == 0, y8, y8.sign() * torch.exp2((y8.abs().log2() - beta) / alpha)).half()
    got = y[torch.cat([at[:3], at[-3:]])]
    assert torch.equal(got[:3], want[:1].expand(3))  # the bulk, on both sides of 2^31
    assert bool(((got[2:].float() - want.float()).abs() <= want.float().abs() * 2.0 ** -10).all())
    del x, y, w16


# -- every CPU kernel variant gives the same bits -------------------------------------------------

def test_cpu_kernel_variants_agree(tmp_path):
    script = """
import sys, torch, lowfp
torch.manual_seed(0)
bits = torch.randint(-2**31, 2**31 - 1, (300_000,), dtype=torch.int32)
x32 = bits.view(torch.float32)
x64 = (torch.randn(300_000, dtype=torch.float64) * 2.0 ** torch.randint(-30, 30, (300_000,)))
xh = torch.randint(-2**15, 2**15 - 1, (300_000,), dtype=torch.int16).view(torch.float16)
outs = []
for mode in lowfp.ROUNDING_MODES:
    for fmt in ["float8_e4m3fn", "fp(4,3,4)", "fp(8,0,1)", "float8_e5m2fnuz"]:
        s = lowfp.Stats()
        outs += [lowfp.quantize(x32, fmt, mode, seed=3, stats=s).view(torch.int32),
                 lowfp.quantize(x64, fmt, mode, seed=3, stats=s).view(torch.int64),
                 lowfp.quantize(xh, fmt, mode, seed=3, stats=s, out_dtype=torch.float32).view(torch.int32),
                 s.counts]
# float16 in and out (F16C conversions in the avx2/avx512 kernels): every bit pattern, NaNs with
# payloads and subnormals included, through float16 itself and formats that fit it
every_half = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
for mode in lowfp.ROUNDING_MODES:
    for fmt in ["float16", "float8_e4m3fn", "fp(4,3,4)", "float8_e5m2fnuz"]:
        s = lowfp.Stats()
        outs += [lowfp.quantize(every_half, fmt, mode, seed=3, stats=s).view(torch.int16), s.counts]
# S2FP8: the threshold and stochastic forms (tables in registers with AVX-512) and the float64
# path (x32's NaN, infinities and subnormals)
xs = torch.randn(300_000) * 2.0 ** -20
for mode in lowfp.ROUNDING_MODES:
    for fmt in ["float8_e5m2", "float8_e4m3fn"]:
        for x in (xs, x32, (xs * 2.0 ** 12).half(), x32.half()):
            s = lowfp.Stats()
            y, st = lowfp.s2fp8_quantize(x, fmt, rounding=mode, seed=3, stats=s)
            outs += [y.view(torch.int32 if y.dtype == torch.float32 else torch.int16), st.sums,
                     st.params, s.counts]
# extra bits: split (vector and scalar packing), merge, and a fused step
import lowfp.extra_bits as eb
w = x32[torch.isfinite(x32)][:100_000].contiguous()
# every q: k = 1..16 toward_zero (q = k) and nearest (q = k + 1); float16 and stochastic for some
cases = [(k, r, torch.bfloat16) for k in range(1, 17) for r in ("toward_zero", "nearest")]
cases += [(k, r, torch.float16) for k, r in [(1, "toward_zero"), (1, "nearest"), (8, "toward_zero"),
                                             (8, "nearest"), (13, "stochastic")]]
cases += [(16, "stochastic", torch.bfloat16)]
for k, r, dt in cases:
    w16, packed = eb.split(w, dt, k, r, seed=5)
    outs += [w16.view(torch.int16), packed, eb.merge(w16, packed, k, r).view(torch.int32)]
# float16 at its own scale (F16C stores), and merge of every float16 pattern with random bits
for k, r in ((13, "toward_zero"), (8, "nearest"), (13, "stochastic")):
    w16, packed = eb.split(w * 2.0**-100, torch.float16, k, r, seed=5)
    words = torch.randint(-2**31, 2**31 - 1, (eb.packed_words(every_half.numel(), k, r),), dtype=torch.int32)
    outs += [w16.view(torch.int16), packed, eb.merge(every_half, words, k, r).view(torch.int32)]
p = torch.nn.Parameter((torch.randn(70_001) * 0.02).bfloat16())
p.grad = (torch.randn(70_001) * 1e-3).bfloat16()
opt = lowfp.optim.ExtraBitsSGD([p], lr=0.01, momentum=0.9, extra_bits=8, rounding="nearest")
for _ in range(3):
    opt.step()
outs += [p.detach().view(torch.int16).clone(), opt.master_weights()[0].view(torch.int32)]
# float16 steps (F16C conversions in the avx2/avx512 kernels): subnormal weights, and weights that
# overflow to inf and then step on from their truncation (the flag bit of a rounded-up overflow)
w_half = torch.cat([torch.randn(50_000) * 0.02, torch.randn(20_001) * 2.0**-20, torch.full((7,), 65000.0)])
g_half = torch.cat([torch.randn(70_001) * 1e-3, torch.full((7,), -600.0)])
for rounding, k in (("stochastic", 13), ("nearest", 8)):
    q = torch.nn.Parameter(w_half.half())
    opt16 = lowfp.optim.ExtraBitsSGD([q], lr=1.0, momentum=0.5, extra_bits=k, rounding=rounding)
    for step in range(3):
        q.grad = g_half.half()
        torch.manual_seed(step)
        opt16.step()
    outs += [q.detach().view(torch.int16).clone(), opt16.master_weights()[0].view(torch.int32),
             opt16.weight_stats.counts.clone()]
torch.save([lowfp._C.cpu_kernel()] + outs, sys.argv[1])
"""
    results = outputs_of_each_kernel(script, tmp_path)
    ref_outs = results["baseline"][1:]
    for kernel, r in results.items():
        for a, b in zip(r[1:], ref_outs):
            assert torch.equal(a, b), kernel


# -- errors (docs/design.md §7) ---------------------------------------------------------------------------

@pytest.mark.parametrize("call,exc,match", [
    (lambda: lowfp.quantize([1.0], F), TypeError, "x must be a torch.Tensor"),
    (lambda: lowfp.quantize(torch.arange(3), F), TypeError, "x must have dtype"),
    (lambda: lowfp.quantize(torch.ones(2, dtype=torch.complex64), F), TypeError, "x must have dtype"),
    (lambda: lowfp.quantize(torch.ones(2, dtype=torch.bool), F), TypeError, "x must have dtype"),
    (lambda: lowfp.quantize(np.arange(3), F), TypeError, "x must have dtype"),
    (lambda: lowfp.quantize(torch.ones(2), 3), TypeError, "fmt must be"),
    (lambda: lowfp.quantize(torch.ones(2), "fp(4,3"), ValueError, "cannot parse"),
    (lambda: lowfp.quantize(torch.ones(2), "float7"), ValueError, "cannot parse"),
    (lambda: lowfp.quantize(torch.ones(2), F, "round"), ValueError, "rounding must be one of"),
    (lambda: lowfp.quantize(torch.ones(2), F, overflow="wrap"), ValueError, "overflow must be"),
    (lambda: lowfp.quantize(torch.ones(2), F, subnormals=1), TypeError, "subnormals"),
    (lambda: lowfp.quantize(torch.ones(2), F, "stochastic", sr_bits=0), ValueError, "sr_bits"),
    (lambda: lowfp.quantize(torch.ones(2), F, "stochastic", sr_bits=33), ValueError, "sr_bits"),
    (lambda: lowfp.quantize(torch.ones(2), F, "stochastic", seed=-1), ValueError, "seed"),
    (lambda: lowfp.quantize(torch.ones(2), F, "stochastic", seed=2**64), ValueError, "seed"),
    (lambda: lowfp.quantize(torch.ones(2), F, "stochastic", seed=1.5), TypeError, "seed"),
    (lambda: lowfp.quantize(torch.ones(2), F, "stochastic", generator=3), TypeError, "generator"),
    (lambda: lowfp.quantize(torch.ones(2), F, "stochastic", seed=1, generator=torch.Generator()),
     ValueError, "not both"),
    (lambda: lowfp.quantize(torch.ones(2), F, offset=-1), ValueError, "offset"),
    (lambda: lowfp.quantize(torch.ones(2), F, out=torch.empty(3)), ValueError, "out has shape"),
    (lambda: lowfp.quantize(torch.ones(2), F, out=np.empty(2)), TypeError, "out must be a torch.Tensor"),
    (lambda: lowfp.quantize(torch.ones(2), F, out=torch.empty(2, dtype=torch.int32)), TypeError,
     "out must have dtype"),
    (lambda: lowfp.quantize(torch.ones(2), F, out=torch.empty(2), out_dtype=torch.float64),
     ValueError, "out_dtype"),
    (lambda: lowfp.quantize(torch.ones(2), F, out_dtype=torch.int8), TypeError, "out_dtype"),
    (lambda: lowfp.quantize(torch.ones(2), F, out=torch.empty(2, device="meta")), ValueError,
     "out is on meta"),
    (lambda: lowfp.quantize(torch.ones(2), F, stats=lowfp.Stats("meta")), ValueError, "stats lives on"),
    (lambda: lowfp.quantize(torch.ones(2), F, stats={}), TypeError, "stats must be"),
    (lambda: lowfp.quantize(torch.ones(2, dtype=torch.float16), "bfloat16"), ValueError,
     "out_dtype=torch.float32"),
    (lambda: lowfp.quantize(torch.ones(2), "fp(8,7,0)"), ValueError, "emax=128; float32 allows at most 127"),
    (lambda: lowfp.quantize(torch.ones(2, requires_grad=True), F, out=torch.empty(2)), ValueError,
     r"automatic differentiation \(x requires grad\)"),
    # As torch's out= functions: a write into a tensor that requires grad is not recorded.
    (lambda: lowfp.quantize(torch.ones(2), F, out=torch.empty(2, requires_grad=True)), ValueError,
     r"automatic differentiation \(out requires grad\)"),
    (lambda: lowfp.s2fp8_quantize(torch.ones(2), out=torch.empty(2, requires_grad=True)), ValueError,
     r"automatic differentiation \(out requires grad\)"),
    (lambda: lowfp.s2fp8_quantize(torch.ones(2, requires_grad=True), out=torch.empty(2)), ValueError,
     r"automatic differentiation \(x requires grad\)"),
    (lambda: lowfp.quantize_(torch.ones(2, requires_grad=True), F), ValueError, "requires grad"),
    (lambda: lowfp.quantize_(torch.ones(2), F, out=torch.empty(2)), TypeError, "does not take out"),
    (lambda: lowfp.quantize(np.ones(2, dtype=np.float32), F, out=np.ones(2, dtype=np.int64)), TypeError,
     "out must have dtype"),
    (lambda: lowfp.quantize(torch.ones(2), F, grad_fmt="fp(4,3,4)", grad_rounding="x"), ValueError,
     "grad_rounding"),
    (lambda: lowfp.quantize(torch.ones(2, 2).to_sparse(), F), TypeError, "x must be a dense"),
    (lambda: lowfp.quantize(torch.ones(2, 2), F, out=torch.ones(2, 2).to_sparse()), TypeError,
     "out must be a dense"),
    (lambda: lowfp.quantize_(torch.ones(2, 2).to_sparse(), F), TypeError, "x must be a dense"),
    (lambda: lowfp.s2fp8_quantize(torch.ones(2, 2).to_sparse()), TypeError, "x must be a dense"),
    (lambda: lowfp.set_num_threads(-1), ValueError, "n must be between 0 and 2\\*\\*31 - 1"),
    (lambda: lowfp.set_num_threads(2**40), ValueError, "n must be between 0 and 2\\*\\*31 - 1"),
    (lambda: lowfp.set_num_threads(2.0), TypeError, "n must be an int"),
])
def test_bad_input_raises_named_error(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_more_threads_than_work_give_the_same_results():
    # Thread counts far above the cores: per-thread outputs are sized by the threads actually
    # started, and results (events included) never depend on the count.
    x = torch.randn(200_003) * 1e3
    x[::7] = float("inf")
    torch_threads = torch.get_num_threads()
    try:
        lowfp.set_num_threads(0)  # 0: follow torch's intra-op thread count
        assert lowfp.get_num_threads() == torch_threads
        torch.set_num_threads(1)
        assert lowfp.get_num_threads() == 1
        torch.set_num_threads(torch_threads)
        assert lowfp.get_num_threads() == torch_threads
        results = []
        for n in (1, 10**6):
            lowfp.set_num_threads(n)
            assert lowfp.get_num_threads() == n
            stats = lowfp.Stats()
            q = lowfp.quantize(x, "fp(4,3,4)", "stochastic", seed=5, stats=stats)
            y, s2 = lowfp.s2fp8_quantize(x)
            w16, packed = lowfp.extra_bits.split(x, torch.bfloat16, 8, "nearest")
            results.append((q, stats.overflow, y, s2.alpha, w16, packed))
    finally:
        lowfp.set_num_threads(0)
        torch.set_num_threads(torch_threads)
    one, many = results
    for a, b in zip(one, many):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_cuda_tensor_without_cuda_build_is_a_clear_error(monkeypatch):
    from lowfp import backends
    monkeypatch.setattr(backends, "_C_cuda", None)  # a CPU-only build, whatever this one is
    with pytest.raises(ValueError, match="no CUDA backend"):
        backends._check_device(torch.device("cuda", 0), "x")
    with pytest.raises(ValueError, match="lowfp supports cpu and cuda"):
        backends._check_device(torch.device("meta"), "x")


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["nearest", "stochastic"])
def test_every_storage_dtype_pair(x_dtype, out_dtype, mode):
    """Each input/output storage pair equals rounding the same values in float64."""
    fmt = "fp(4,2,1)"  # fits every dtype
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(20_000, generator=g) * 2.0 ** torch.randint(-16, 8, (20_000,), generator=g)).to(x_dtype)
    x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=x_dtype)
    got = lowfp.quantize(x, fmt, mode, seed=4, out_dtype=out_dtype, overflow="inf")
    want = lowfp.quantize(x.double(), fmt, mode, seed=4, overflow="inf")
    assert got.dtype == out_dtype
    assert torch.equal(got[4:].double(), want[4:])
    assert got[0].isnan() and got[1] == float("inf") and got[2] == -float("inf")
    assert got[3] == 0 and torch.signbit(got[3])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_lowfp_starts_no_openmp_runtime_of_its_own():
    # lowfp's CPU kernels run on the OpenMP runtime torch loaded (the same libgomp.so.1), so they
    # add no worker threads beside torch's and wait as torch's do (OMP_WAIT_POLICY); imported in
    # either order. In a fresh interpreter, as an earlier import would decide it.
    code = ("import {first}, {second}, lowfp.backends\n"
            "maps = [l.split()[-1] for l in open('/proc/self/maps') if 'gomp' in l or 'omp.so' in l]\n"
            "print(len(set(maps)))\n")
    for first, second in (("torch", "lowfp"), ("lowfp", "torch")):
        out = subprocess.run([sys.executable, "-c", code.format(first=first, second=second)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == "1", (first, out.stdout)


class _SeesOperators:
    """A dispatch mode that records the operators it sees (and runs them)."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.seen = set()

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.seen.add(str(func))
                return func(*args, **(kwargs or {}))
        return Mode()


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "nvfp4", "fp8_e4m3_rowwise"])
def test_eager_scaled_calls_skip_the_dispatcher_with_the_operators_bits(fmt):
    x = torch.randn(6, 64) * torch.logspace(-3, 3, 64)
    for kwargs in (dict(), dict(rounding="up"), dict(rounding="stochastic", seed=9),
                   dict(rounding="stochastic")):
        results = []
        for mode in (None, _SeesOperators()):
            torch.manual_seed(5)
            stats = lowfp.scaled.ScaledStats()
            with mode if mode is not None else contextlib.nullcontext():
                y = lowfp.quantize(x, fmt, stats=stats, **kwargs)
                out = torch.zeros_like(x)
                version = out._version
                lowfp.quantize(x, fmt, stats=stats, out=out, **kwargs)
                assert out._version > version  # autograd sees the write either way
                parts = lowfp.scaled.encode(x, fmt, **kwargs)
            results.append((y, out, stats.counts.clone(), parts.q, parts.scales, torch.rand(1)))
            if mode is not None:
                assert "lowfp.scaled_quantize.default" in mode.seen
        for a, b in zip(*results):
            assert torch.equal(a, b), (fmt, kwargs)


def test_recorded_eager_calls_skip_the_dispatcher_with_the_operators_results_and_gradients(monkeypatch):
    """An eager call whose result autograd records (x requires grad; no mode, no torch.func
    transform) runs lowfp::quantize's implementation and formula through lowfp's own autograd
    Function, without the operator's Python autograd kernel: the operator's values, counts,
    gradients (straight through or rounded, every mode) and generator draws, in any layout; the
    first call and the next, remembered one (no grad_fmt: set up in C for a contiguous x, the
    prepared rounding in torch's clone of this small x, or in the Function for out_dtype)."""
    taken = _spy_remembered(monkeypatch)
    x0 = torch.randn(3, 50) * 30
    x0[0, :2] = torch.tensor([1e9, 1e-9])
    cases = [dict(), dict(grad_fmt="fp(5,2,15)"), dict(out_dtype=torch.float64, grad_fmt="fp(5,2,15)"),
             dict(rounding="stochastic", grad_fmt="fp(5,2,0)", grad_rounding="stochastic"),
             dict(rounding="stochastic", seed=7, generator=None, grad_fmt=lowfp.S2FP8()),
             dict(rounding="stochastic", generator=torch.Generator().manual_seed(4), offset=5),
             dict(rounding="stochastic", seed=2**64 - 1), dict(rounding="toward_zero", out_dtype=torch.float64)]
    for kwargs in cases:
        for contiguous, layout in ((True, lambda t: t), (False, lambda t: t.t())):
            results = []
            sys.modules["lowfp.quantize"]._EAGER.clear()  # (the first call cold)
            for call, mode in enumerate((None, None, _SeesOperators())):
                kw = {k: (v.clone_state() if isinstance(v, torch.Generator) else v) for k, v in kwargs.items()}
                torch.manual_seed(11)
                x = layout(x0).clone().requires_grad_()
                stats = lowfp.Stats()
                taken.clear()
                with mode if mode is not None else contextlib.nullcontext():
                    y = lowfp.quantize(x, "fp(4,3,4)", stats=stats, **kw)
                    remembered_in_c = call == 1 and contiguous and "grad_fmt" not in kwargs
                    in_clone = remembered_in_c and "out_dtype" not in kwargs  # (a small x of its dtype)
                    node = type(y.grad_fn).__name__
                    assert (node == "CloneBackward0" if in_clone
                            else ("RecordedRounding" in node) == (mode is None)), (kwargs, call, node)
                    assert taken == (["_quantize_remembered"] if in_clone
                                     else ["_round_remembered_in_c", "_quantize_remembered"] if remembered_in_c
                                     else []), (kwargs, contiguous, call, taken)
                    y.backward(torch.linspace(-3e4, 3e4, y.numel(), dtype=y.dtype).reshape(y.shape))
                results.append((y.detach(), x.grad, stats.counts.clone(), torch.rand(1)))
                if mode is not None:
                    assert "lowfp.quantize.default" in mode.seen
            for got in results[:2]:  # (first and remembered calls against the operator's)
                for a, b in zip(got, results[2]):
                    assert a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num()), kwargs


def test_eager_calls_skip_the_dispatcher_with_the_operators_bits():
    """An eager call on plain tensors with nothing to record runs lowfp::quantize's own
    implementation directly; under a dispatch mode (which must see the operator) it goes through
    the operator. Both give the same bits, counts and draws from the default generator."""
    x = torch.randn(3, 50, dtype=torch.float64) * 30
    x[0, :3] = torch.tensor([float("nan"), 1e9, 1e-9])
    cases = [dict(), dict(rounding="toward_zero", overflow="inf"), dict(rounding="stochastic", seed=2**64 - 3),
             dict(rounding="stochastic", generator=torch.Generator().manual_seed(4), offset=2**63 + 5),
             dict(rounding="stochastic"), dict(out_dtype=torch.float32), dict(subnormals=False)]
    for kwargs in cases:
        results = []
        for mode in (None, _SeesOperators()):
            kw = {k: (v.clone_state() if isinstance(v, torch.Generator) else v) for k, v in kwargs.items()}
            torch.manual_seed(11)
            stats = lowfp.Stats()
            with mode if mode is not None else contextlib.nullcontext():
                y = lowfp.quantize(x, "fp(4,3,4)", stats=stats, **kw)
                out = torch.empty_like(y)
                lowfp.quantize(x, "fp(4,3,4)", stats=stats, out=out, **kw)
            results.append((y, out, stats.counts.clone(), torch.rand(1)))
            if mode is not None:
                assert "lowfp.quantize.default" in mode.seen and "lowfp.quantize_into.default" in mode.seen
        (y1, o1, c1, r1), (y2, o2, c2, r2) = results
        def bits(t):  # (NaN equals NaN here)
            return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)
        assert y1.dtype == y2.dtype and torch.equal(bits(y1), bits(y2)) and torch.equal(bits(o1), bits(o2)), kwargs
        assert torch.equal(c1, c2) and torch.equal(r1, r2), kwargs  # (r: the generator after)


def _spy_remembered(monkeypatch) -> list:
    """Empties lowfp.quantize's table of remembered calls and returns a list that gets the name
    of the function that rounds a remembered call (rather than handing it back): the Python
    path, _round_remembered; quantize's look-up in C, _quantize_remembered, where it rounds the
    call itself or sets up lowfp's autograd Function around it (a tensor back, not the table's
    entry); or the C call of a prepared rounding inside that Function, _round_remembered_in_c."""
    import sys
    module = sys.modules["lowfp.quantize"]
    taken = []
    def spy_on(name: str, rounded=lambda y: y is not None):  # (None: this call needs the full path)
        original = getattr(module, name)
        def spy(*args):
            y = original(*args)
            if rounded(y):
                taken.append(name)
            return y
        monkeypatch.setattr(module, name, spy)
    spy_on("_round_remembered")
    spy_on("_quantize_remembered", lambda y: type(y) is torch.Tensor)
    spy_on("_round_remembered_in_c")
    monkeypatch.setattr(module, "_EAGER", {})  # cold: nothing remembered from other tests
    return taken


def _cold_remembered_and_operator(call, taken: list) -> list:
    """call() three times, each after torch.manual_seed(5): cold, remembered, and under a mode
    (through the operator); per time (its result, the next draw of torch's generator, the
    functions that rounded its remembered calls)."""
    got = []
    for mode in (None, None, _SeesOperators()):
        taken.clear()
        torch.manual_seed(5)
        with mode if mode is not None else contextlib.nullcontext():
            result = call()
        got.append((result, torch.rand(1), tuple(taken)))
    return got


def test_repeated_scaled_calls_take_the_remembered_request_with_the_same_bits(monkeypatch):
    """A scaled-format call whose arguments passed every check once is one prepared kernel call
    the next time (in C for blocks along the last axis, lowfp._C.round_scaled; in
    PreparedScaled.round for others): the bits, block counts and generator draws of the operator,
    for every kind of block; layouts and stats it does not cover take the full path."""
    from lowfp.scaled import Scaled, ScaledStats
    taken = _spy_remembered(monkeypatch)
    x = torch.randn(6, 64) * torch.logspace(-3, 3, 64)
    x[0, :3] = torch.tensor([float("nan"), float("inf"), 0.0])
    cases = [("mxfp8_e4m3", dict()), ("nvfp4", dict()), ("mxfp4_e2m1", dict(rounding="stochastic")),
             (Scaled("fp(4,3,4)", axis=-1), dict(rounding="toward_zero")),  # one scale per row
             (Scaled("fp(4,3,4)", axis=None), dict()),                      # one per tensor
             (Scaled("float8_e4m3fn", block=(2, 16)), dict()),              # 2-D blocks
             ("mxfp8_e5m2", dict(overflow="inf"))]
    for dtype in (torch.float32, torch.bfloat16):
        for fmt, kwargs in cases:
            def call():
                stats = ScaledStats()
                y = lowfp.quantize(x.to(dtype), fmt, stats=stats, **kwargs)
                out = torch.empty_like(y)
                lowfp.quantize(x.to(dtype), fmt, stats=stats, out=out, **kwargs)
                return y, out, stats.counts
            got = _cold_remembered_and_operator(call, taken)
            ((y0, o0, c0), r0, n0), ((y1, o1, c1), r1, n1), ((y2, o2, c2), r2, n2) = got
            assert (len(n0), len(n1), len(n2)) == (0, 2, 0), (fmt, kwargs)
            scaled = lowfp.scaled.to_scaled(fmt)
            last_axis = scaled.axis == -1 and not isinstance(scaled.block, tuple)
            assert n1 == ("_quantize_remembered" if last_axis else "_round_remembered",) * 2, (fmt, n1)
            if kwargs.get("rounding") != "stochastic":  # (two draws otherwise)
                assert torch.equal(o0.view(torch.int16), y0.view(torch.int16)), (fmt, kwargs)
            for y, o, c, r in ((y1, o1, c1, r1), (y2, o2, c2, r2)):
                assert torch.equal(y.view(torch.int16), y0.view(torch.int16)), (fmt, kwargs)
                assert torch.equal(o.view(torch.int16), o0.view(torch.int16)), (fmt, kwargs)
                assert torch.equal(c, c0) and torch.equal(r, r0), (fmt, kwargs)
    # blocks along another axis: remembered where the kernel reads the tensor in place (a
    # deterministic rounding: scaled.config.kernel_layout), the full path where a stochastic
    # one copies the axis last
    along0 = Scaled("fp(4,3,4)", block=4, axis=0)
    v = x[0, 3:].contiguous()
    for call in (lambda: lowfp.quantize(v, along0), lambda: lowfp.quantize(v[:, None], along0),
                 lambda: lowfp.quantize(x, along0), lambda: lowfp.quantize(x, along0, "stochastic", seed=1)):
        call()
    taken.clear()
    assert torch.equal(lowfp.quantize(v, along0), lowfp.quantize(v[:, None], along0)[:, 0])
    want = lowfp.quantize(x.t().contiguous(), Scaled("fp(4,3,4)", block=4)).t()
    assert torch.equal(lowfp.quantize(x, along0).view(torch.int32), want.view(torch.int32))
    assert len(taken) == 3
    want = lowfp.quantize(x.t().contiguous(), Scaled("fp(4,3,4)", block=4), "stochastic", seed=1).t()
    assert torch.equal(lowfp.quantize(x, along0, "stochastic", seed=1).view(torch.int32), want.view(torch.int32))
    assert len(taken) == 3  # (not remembered)
    # a plain Stats takes the element counts alone
    taken.clear()
    stats, scaled_stats = lowfp.Stats(), ScaledStats()
    lowfp.quantize(x, "mxfp8_e4m3", stats=stats)
    assert len(taken) == 1
    lowfp.scaled.quantize_scaled(x, "mxfp8_e4m3", stats=scaled_stats)  # (the full path)
    assert stats.numel == x.numel() and stats.nan == 1
    assert torch.equal(stats.counts, scaled_stats.counts[:4]) and scaled_stats.blocks == 12
    # a non-contiguous x, a 0-d x: the full path
    taken.clear()
    t = x.t()
    lowfp.quantize(t, "mxfp8_e4m3")
    with pytest.raises(ValueError, match="0-d"):
        lowfp.quantize(torch.tensor(1.0), "mxfp8_e4m3")
    assert taken == []
    assert lowfp.quantize(torch.empty(0, 32), "mxfp8_e4m3").shape == (0, 32) and len(taken) == 1
    def draw_after(mode):  # an empty stochastic rounding draws its seed as the operator does
        torch.manual_seed(1)
        with mode:
            lowfp.quantize(torch.empty(0, 32), "mxfp4_e2m1", "stochastic")
        return torch.rand(1)
    assert torch.equal(draw_after(contextlib.nullcontext()), draw_after(_SeesOperators()))
    assert taken == ["_quantize_remembered"] * 2


def test_repeated_eager_calls_take_the_remembered_plan_with_the_same_bits_and_checks(monkeypatch):
    """A call whose arguments passed every check once is one prepared kernel call the next time
    (lowfp.quantize's _EAGER): the bits, counts and generator draws of the operator, and every
    argument error and special tensor still handled as on the first call."""
    taken = _spy_remembered(monkeypatch)
    x = torch.randn(4, 300) * 30
    x[0, :3] = torch.tensor([float("nan"), 1e9, 1e-9])
    cases = [("fp(4,3,4)", dict()), (lowfp.formats.float8_e4m3fn, dict(rounding="toward_zero")),
             ("fp(4,3,4)", dict(rounding="stochastic")), ("fp(5,2,0)", dict(overflow="inf")),
             ("fp(4,3,4)", dict(subnormals=False)), ("fp(4,3,4)", dict(out_dtype=torch.float64)),
             ("bfloat16", dict(rounding="nearest_away")), ("s2fp8", dict()),
             (lowfp.S2FP8("float8_e4m3fn", 8.0), dict(rounding="stochastic"))]
    for dtype in (torch.float32, torch.bfloat16):
        for fmt, kwargs in cases:
            def call():
                stats = lowfp.Stats()
                y = lowfp.quantize(x.to(dtype), fmt, stats=stats, **kwargs)
                out = x.to(dtype, copy=True)  # (rounded into itself, but where out_dtype differs)
                if "out_dtype" not in kwargs:
                    lowfp.quantize(out, fmt, stats=stats, out=out, **kwargs)
                return y, out, stats.counts
            got = _cold_remembered_and_operator(call, taken)
            ((y0, o0, c0), r0, n0), ((y1, o1, c1), r1, n1), ((y2, o2, c2), r2, n2) = got
            assert (len(n0), len(n1), len(n2)) == (0, 1 if "out_dtype" in kwargs else 2, 0), (fmt, kwargs)
            if fmt != "s2fp8" and not isinstance(fmt, lowfp.S2FP8):  # (C takes a plain format's call)
                assert set(n1) == {"_quantize_remembered"}, n1
            for y, o, c, r in ((y1, o1, c1, r1), (y2, o2, c2, r2)):
                assert y.dtype == y0.dtype and torch.equal(y.view(torch.int8), y0.view(torch.int8))
                assert torch.equal(o.view(torch.int8), o0.view(torch.int8)), (fmt, kwargs)
                assert torch.equal(c, c0) and torch.equal(r, r0), (fmt, kwargs)
    # a CPU generator: its draws, remembered (in C) or not (the operator's: the test above)
    draws = []
    taken.clear()
    for _ in range(2):
        g = torch.Generator().manual_seed(9)
        draws.append((lowfp.quantize(x, "fp(4,3,4)", "stochastic", generator=g), g.get_state()))
    assert taken == ["_quantize_remembered"] * 2  # (remembered by the cases above)
    bits = [d[0].view(torch.int32) for d in draws]
    assert torch.equal(bits[0], bits[1]) and torch.equal(draws[0][1], draws[1][1])
    g = torch.Generator().manual_seed(9)
    want_g = lowfp.quantize(x, "fp(4,3,4)", "stochastic", seed=lowfp.draw_seed(g))
    assert torch.equal(bits[0], want_g.view(torch.int32)) and torch.equal(g.get_state(), draws[0][1])
    # Warm now: what the first call would refuse is refused, what it would route elsewhere goes there
    lowfp.quantize(x, "fp(4,3,4)", sr_bits=1)
    with pytest.raises(TypeError, match="sr_bits must be an int"):
        lowfp.quantize(x, "fp(4,3,4)", sr_bits=True)
    lowfp.quantize(x, "fp(4,3,4)", subnormals=True)
    with pytest.raises(TypeError, match="subnormals must be a bool"):
        lowfp.quantize(x, "fp(4,3,4)", subnormals=1)
    with pytest.raises(TypeError, match="offset must be an int"):
        lowfp.quantize(x, "fp(4,3,4)", offset=0.0)
    with pytest.raises(TypeError, match="stats must be a lowfp.Stats"):
        lowfp.quantize(x, "fp(4,3,4)", stats=torch.zeros(4, dtype=torch.int64))
    taken.clear()
    t = x.t()  # not contiguous: the layout path, same values
    assert torch.equal(lowfp.quantize(t, "fp(4,3,4)").view(torch.int32),
                       lowfp.quantize(x, "fp(4,3,4)").t().view(torch.int32))
    assert taken == ["_quantize_remembered"]  # only the contiguous call
    w = x.clone().requires_grad_(True)  # autograd: the prepared rounding in torch's clone of w
    y = lowfp.quantize(w, "fp(4,3,4)")
    assert type(y.grad_fn).__name__ == "CloneBackward0"
    assert taken[-1:] == ["_quantize_remembered"]
    assert torch.equal(y.detach().view(torch.int32), lowfp.quantize(x, "fp(4,3,4)").view(torch.int32))
    y.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(x))
    taken.clear()
    sparse = x.to_sparse()
    with pytest.raises(TypeError, match="dense"):
        lowfp.quantize(sparse, "fp(4,3,4)")
    meta = lowfp.quantize(x.to("meta"), "fp(4,3,4)")  # the operator's fake implementation
    assert meta.device.type == "meta" and meta.shape == x.shape
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as fake_mode:
        fake = lowfp.quantize(fake_mode.from_tensor(x), "fp(4,3,4)")
    assert fake.shape == x.shape
    with pytest.raises(ValueError, match="stats lives on"):
        lowfp.quantize(x, "fp(4,3,4)", stats=lowfp.Stats("meta"))
    assert taken == []
    empty = torch.empty(0, 3)
    assert lowfp.quantize(empty, "fp(4,3,4)").shape == (0, 3) and len(taken) == 1
    # out=: remembered by out's dtype; taken for a contiguous out apart from x or x itself
    want = lowfp.quantize(x, "fp(4,3,4)").view(torch.int32)
    for _ in range(2):
        out = torch.empty_like(x)
        assert lowfp.quantize(x, "fp(4,3,4)", out=out) is out
        assert torch.equal(out.view(torch.int32), want)
    taken.clear()
    u = x.clone()
    lowfp.quantize_(u, "fp(4,3,4)")
    assert torch.equal(u.view(torch.int32), want) and len(taken) == 1
    flat = x.flatten().clone()  # overlapping, not x itself: the full path reads a copy of x
    lowfp.quantize(flat[:-1], "fp(4,3,4)", out=flat[1:])
    assert torch.equal(flat[1:].view(torch.int32), want.flatten()[:-1])
    strided = torch.empty(300, 4).t()  # not contiguous: the layout path
    lowfp.quantize(x, "fp(4,3,4)", out=strided)
    assert torch.equal(strided.view(torch.int32), want) and len(taken) == 1
    with pytest.raises(ValueError, match="out has shape"):
        lowfp.quantize(x, "fp(4,3,4)", out=torch.empty(4, 299))
    with pytest.raises(ValueError, match="out= does not support automatic differentiation"):
        lowfp.quantize(x, "fp(4,3,4)", out=torch.empty_like(x).requires_grad_(True))
    with torch.inference_mode():
        frozen = torch.empty_like(x)
    with pytest.raises(ValueError, match="out is an inference tensor"):
        lowfp.quantize(x, "fp(4,3,4)", out=frozen)
    assert len(taken) == 1


def test_the_c_shortcut_hands_back_every_call_it_does_not_take(monkeypatch):
    """lowfp._C.round_remembered answers None, drawing and writing nothing, for what the Python
    path must decide: another object than a CPU request, a tensor subclass, autograd, a mode,
    a layout, stats of another type or device, a seed or offset out of range, a seed with a
    generator, another generator type; quantize's look-up in C (quantize_remembered) answers
    None for a call it cannot remember and the table's entry for one it does not round."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lowfp import _C
    from lowfp._prepared import PreparedFormat
    from lowfp.scaled import ScaledStats
    module = sys.modules["lowfp.quantize"]
    monkeypatch.setattr(module, "_EAGER", {})  # (nothing remembered from other tests)
    x = torch.randn(4, 32)
    lowfp.quantize(x, "fp(4,3,4)", "stochastic")  # (remembered)
    key = module._eager_key("fp(4,3,4)", "stochastic", None, None, 32, x, None, None)
    entry = module._EAGER[key]
    assert type(entry) is PreparedFormat

    class Sub(torch.Tensor):
        pass

    class SubGenerator(torch.Generator):
        pass

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def call(request=entry.request, x=x, stats=None, seed=None, generator=None, offset=0):
        return _C.round_remembered(request, entry.dtype, x, stats, seed, generator, offset, None)

    state = torch.get_rng_state()
    for args in (dict(request=object()), dict(request=lowfp.Format(4, 3, 4)), dict(x=x.as_subclass(Sub)),
                 dict(x=x.clone().requires_grad_()), dict(x=x.t()), dict(x=x.to("meta")),
                 dict(stats=ScaledStats()), dict(stats=lowfp.Stats("meta")), dict(seed=-1),
                 dict(seed=2**64), dict(seed=1.0), dict(seed=True), dict(offset=-1), dict(offset=2**64),
                 dict(seed=1, generator=torch.Generator()), dict(generator=SubGenerator()),
                 dict(generator=object())):
        assert call(**args) is None, args
    with Seen():
        assert call() is None
    counts = lowfp.Stats().counts  # BoundRounder's call with counts said to lie on CUDA device 0
    assert _C.round_bound({torch.float32: entry.request}, x, counts.data_ptr(), 0, None) is None
    assert _C.round_bound({torch.float32: entry.request}, x, 0, 0, None) is not None  # (no counts)
    state = torch.get_rng_state()
    if lowfp.cuda_built():  # a CUDA request (lowfp._C_cuda's, told apart there) with a CPU x
        from lowfp import backends
        from lowfp._native import DTYPE_CODES, ROUNDING_MODES, format_args
        code = DTYPE_CODES[torch.float32]
        cuda_request = backends._C_cuda.PreparedQuantize(
            code, code, *format_args(lowfp.Format(4, 3, 4), ROUNDING_MODES.index("stochastic"), 32))
        assert call(request=cuda_request) is None
        assert _C.round_bound({torch.float32: cuda_request}, x, 0, -1, None) is None
    assert torch.equal(torch.get_rng_state(), state)  # (nothing drawn)
    with torch.no_grad():  # a tensor requiring grad, with nothing to record: taken
        assert call(x=x.clone().requires_grad_(), seed=5) is not None
    assert torch.equal(call(seed=5), lowfp.quantize(x, "fp(4,3,4)", "stochastic", seed=5))
    g = torch.Generator().manual_seed(3)  # a CPU generator: drawn from, as draw_seed draws
    want = lowfp.quantize(x, "fp(4,3,4)", "stochastic", seed=lowfp.draw_seed(torch.Generator().manual_seed(3)))
    assert torch.equal(call(generator=g), want) and torch.equal(torch.get_rng_state(), state)
    # the last CPU generator is remembered weakly: freed generators and new ones at their
    # addresses are each drawn from, as the Python path draws
    for k in range(4):
        g, g_python = torch.Generator().manual_seed(k), torch.Generator().manual_seed(k)
        for _ in range(2):
            got = call(generator=g)
            assert torch.equal(got, lowfp.quantize(x, "fp(4,3,4)", "stochastic", seed=lowfp.draw_seed(g_python)))
        assert torch.equal(g.get_state(), g_python.get_state())
    if torch.cuda.is_available():  # a CUDA generator after a remembered CPU one: handed back
        assert call(generator=torch.Generator("cuda")) is None
    with pytest.raises(TypeError, match=r"round_remembered\(request"):  # (internal, but never a crash)
        _C.round_remembered(entry.request, entry.dtype, x)
    with pytest.raises(TypeError, match="requests must be a dict"):
        _C.round_bound([], x, 0, -1, None)

    # quantize's look-up, in quantize's argument order
    def look_up(x=x, fmt="fp(4,3,4)", seed=None, generator=None, offset=0, sr_bits=32, out=None,
                grad_fmt=None, table=module._EAGER):
        return _C.quantize_remembered(table, x, fmt, "stochastic", None, None, seed, generator, offset,
                                      sr_bits, None, out, None, grad_fmt)
    for args in (dict(x=x.as_subclass(Sub)), dict(x=x.numpy()), dict(x=x.tolist()),
                 dict(out=torch.empty_like(x).as_subclass(Sub)), dict(generator=SubGenerator()),
                 dict(offset=-1), dict(offset=2**64), dict(offset=True), dict(grad_fmt="bfloat16"),
                 dict(sr_bits=[32]), dict(fmt="fp(4,3,5)"), dict(table={})):
        assert look_up(**args) is None, args
    assert look_up(seed=-1) is entry and look_up(x=x.t()) is entry  # (the Python path decides)
    assert look_up(out=torch.empty(4, 31)) is None  # (no entry for this out= dtype yet)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(look_up(seed=5), want_5 := lowfp.quantize(x, "fp(4,3,4)", "stochastic", seed=5))
    out = torch.empty_like(x)
    lowfp.quantize(x, "fp(4,3,4)", "stochastic", seed=5, out=out)  # (remembers out='s dtype)
    out_entry = module._EAGER[module._eager_key("fp(4,3,4)", "stochastic", None, None, 32, x, out, None)]
    assert look_up(out=torch.empty(4, 31)) is out_entry  # (a shape that _writable_in_one_call refuses)
    assert look_up(seed=5, out=out) is out and torch.equal(out, want_5)
    # x requiring grad: the prepared rounding recorded straight through, same checks
    w = x.clone().requires_grad_()
    recorded = look_up(x=w, seed=5)
    assert recorded.grad_fn is not None and torch.equal(recorded.detach(), want_5)
    with Seen():
        assert look_up(x=w, seed=5) is entry
    assert look_up(x=w.t(), seed=5) is entry and look_up(x=w, seed=-1) is entry
    assert look_up(x=w, out=out) is out_entry  # (out= does not record: the Python path raises)
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(TypeError, match=r"quantize_remembered\(table"):
        _C.quantize_remembered(module._EAGER, x)
    with pytest.raises(TypeError, match="table must be a dict"):
        look_up(table=[])
    assert module._eager_key("fp(4,3,4)", "stochastic", None, None, 32, x, None, None) == key
    assert module._eager_key("fp(4,3,4)", "stochastic", None, None, True, x, None, None) != \
        module._eager_key("fp(4,3,4)", "stochastic", None, None, 1, x, None, None)


def test_the_scaled_c_call_hands_back_every_call_it_does_not_take():
    """lowfp._C.round_scaled (PreparedScaled.round's blocks along the last axis, in C) answers
    None, drawing and writing nothing, for another entry or blocks along another axis, a tensor
    subclass, a layout, a 0-d x, counts on another device, a seed or offset out of range, a seed
    with a generator, another generator type, an out= of another shape, dtype or layout; else
    the operator's bits, counts and draws."""
    from lowfp import _C
    from lowfp.scaled import Scaled, ScaledStats
    from lowfp.scaled.quantize import PreparedScaled
    x = torch.randn(4, 64) * 100
    entry = PreparedScaled(lowfp.scaled.to_scaled("mxfp4_e2m1"), "stochastic", None, 32, x)
    rows = PreparedScaled(Scaled("fp(4,3,4)", block=4, axis=0), "nearest", None, 32, x)

    class Sub(torch.Tensor):
        pass

    def call(entry=entry, x=x, counts=None, seed=None, generator=None, offset=0, out=None):
        return _C.round_scaled(entry, x, counts, seed, generator, offset, out)

    state = torch.get_rng_state()
    for args in (dict(entry=rows), dict(entry=object()), dict(x=x.as_subclass(Sub)), dict(x=x.t()),
                 dict(x=torch.tensor(1.0)), dict(x=x.to("meta")), dict(counts=lowfp.Stats("meta").counts),
                 dict(seed=-1), dict(seed=2**64), dict(offset=-1), dict(offset=2**64),
                 dict(seed=1, generator=torch.Generator()), dict(generator=object()),
                 dict(out=torch.empty(4, 63)), dict(out=torch.empty(4, 64, dtype=torch.float64)),
                 dict(out=torch.empty(64, 4).t()), dict(out=[0.0] * 256)):
        assert call(**args) is None, args
    assert torch.equal(torch.get_rng_state(), state)  # (nothing drawn)
    stats = ScaledStats()
    torch.manual_seed(3)
    got = call(counts=stats.counts)
    after = torch.rand(1)
    want_stats = ScaledStats()
    torch.manual_seed(3)
    want = lowfp.scaled.quantize_scaled(x, "mxfp4_e2m1", "stochastic", stats=want_stats)
    assert torch.equal(got, want) and torch.equal(stats.counts, want_stats.counts) and torch.equal(torch.rand(1), after)
    out = torch.empty_like(x)
    assert call(seed=7, offset=3, out=out) is out
    assert torch.equal(out, lowfp.scaled.quantize_scaled(x, "mxfp4_e2m1", "stochastic", seed=7, offset=3))
    empty = torch.empty(0, 64)
    torch.manual_seed(3)
    assert call(x=empty).shape == (0, 64) and torch.equal(torch.rand(1), after)  # (drawn, as the operator draws)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_remembered_call_that_autograd_records_gives_the_operators_bits_counts_and_gradient(
        monkeypatch, dtype):
    """A remembered call whose result autograd records: on a small CPU tensor rounded in torch's
    clone of x (a node that saves nothing), on a larger one or into another dtype in lowfp's
    autograd Function. Either way the bits, counts and generator draws of the call without
    autograd, the gradient straight through, x unchanged."""
    import sys
    module = sys.modules["lowfp.quantize"]
    monkeypatch.setattr(module, "_EAGER", {})
    threshold = 1 << 16  # (def_bound_round.hpp: kCloneRoundBytes)
    size = torch.empty(0, dtype=dtype).element_size()
    cases = [(threshold // size, {}, "CloneBackward0"),
             (threshold // size + 1, {}, "_RememberedRecordedRoundingBackward"),
             (64, dict(out_dtype=torch.float64), "_RememberedRecordedRoundingBackward")]
    if dtype == torch.float64:
        cases.pop()  # (out_dtype float64 is x's own dtype here)
    for n, kwargs, node in cases:
        x = (torch.randn(n, dtype=torch.float64) * 30).to(dtype)
        x[:4] = torch.tensor([float("nan"), 1e9, 1e-9, -0.0])
        for rounding in ("nearest", "stochastic"):
            w = torch.nn.Parameter(x.clone())  # (a Parameter, as a model's weight)
            lowfp.quantize(w, "fp(4,3,4)", rounding, **kwargs)  # (remembers the call)
            got = []
            for source in (w, x):
                stats = lowfp.Stats()
                torch.manual_seed(3)
                y = lowfp.quantize(source, "fp(4,3,4)", rounding, stats=stats, **kwargs)
                got.append((y, stats.counts.clone(), torch.rand(1)))
            (y, counts, after), (want, want_counts, want_after) = got
            assert type(y.grad_fn).__name__ == node, (n, kwargs)
            assert y.dtype == want.dtype and torch.equal(y.detach().view(torch.uint8), want.view(torch.uint8))
            assert torch.equal(counts, want_counts) and int(counts[1]) > 0  # (1e-9 underflows)
            assert torch.equal(after, want_after)  # (the same draws of torch's generator)
            assert torch.equal(w.detach().view(torch.uint8), x.view(torch.uint8))  # x unchanged
            grad = torch.randn(n, dtype=y.dtype)
            y.backward(grad)
            assert w.grad.dtype == dtype and torch.equal(w.grad, grad.to(dtype))


def test_seeds_and_offsets_of_repeated_calls_take_the_remembered_request(monkeypatch):
    """seed= and offset= are each call's own: a call that passes them is one prepared kernel call
    once its other arguments passed every check, with the operator's bits, counts and (none
    drawn for a seed) generator draws; a bad seed or offset is still refused."""
    from lowfp.scaled import ScaledStats
    taken = _spy_remembered(monkeypatch)
    x = torch.randn(4, 64) * 30
    x[0, :2] = torch.tensor([float("nan"), 1e9])
    for fmt, stats_type in (("fp(4,3,4)", lowfp.Stats), ("nvfp4", ScaledStats),
                            ("mxfp4_e2m1", ScaledStats), (lowfp.S2FP8(), lowfp.Stats)):
        for rounding, kwargs in (("stochastic", dict(seed=3)), ("stochastic", dict(seed=2**64 - 1, offset=5)),
                                 ("stochastic", dict(offset=2**64 - 1)), ("nearest", dict(seed=4, offset=9))):
            def call():
                stats = stats_type()
                return lowfp.quantize(x, fmt, rounding, stats=stats, **kwargs), stats.counts
            sys.modules["lowfp.quantize"]._EAGER.clear()  # (cold again)
            got = _cold_remembered_and_operator(call, taken)
            ((y0, c0), r0, n0), ((y1, c1), r1, n1), ((y2, c2), r2, n2) = got
            assert (len(n0), len(n1), len(n2)) == (0, 1, 0), (fmt, kwargs)
            for y, c, r in ((y1, c1, r1), (y2, c2, r2)):
                assert torch.equal(y.view(torch.int32), y0.view(torch.int32)), (fmt, kwargs)
                assert torch.equal(c, c0) and torch.equal(r, r0), (fmt, kwargs)
        other = lowfp.quantize(x, fmt, "stochastic", seed=3, offset=1)  # (warm)
        assert not torch.equal(other, lowfp.quantize(x, fmt, "stochastic", seed=3))
        taken.clear()
        with pytest.raises(ValueError, match="not both"):
            lowfp.quantize(x, fmt, "stochastic", seed=1, generator=torch.Generator())
        for bad, error in ((-1, ValueError), (2**64, ValueError), (1.5, TypeError), (True, TypeError)):
            with pytest.raises(error, match="seed"):
                lowfp.quantize(x, fmt, "stochastic", seed=bad)
            with pytest.raises(error, match="offset"):
                lowfp.quantize(x, fmt, "stochastic", offset=bad)
        assert taken == []


@pytest.mark.parametrize("fmt", ["fp(4,3,4)", "float8_e5m2", lowfp.S2FP8()])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_rounder_of_a_format_rounds_as_quantize(fmt, rounding):
    """The emulation's Rounder, prepared after its first tensor of a dtype: quantize's bits,
    counts and seed draws for every layout (channels-last activations included: stochastic
    rounding draws by logical index there too) and stats type, and the input's layout."""
    from lowfp.quantize import Rounder
    rounder = Rounder(fmt, rounding)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 5, generator=g) * 40
    x[0, 1, 2, 3] = float("nan")
    layouts = (x, x, x.to(memory_format=torch.channels_last), x.transpose(1, 3), x[:, :2],
               x.to(torch.bfloat16))
    for t in layouts:
        for stats_type in (lowfp.Stats, lowfp.scaled.ScaledStats):
            s_got, s_want = stats_type(), stats_type()
            torch.manual_seed(3)
            got = rounder(t, s_got)
            torch.manual_seed(3)
            want = lowfp.quantize(t, fmt, rounding, stats=s_want)
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)) and got.dtype == t.dtype
            assert got.stride() == want.stride()
            assert torch.equal(s_got.counts, s_want.counts), (s_got, s_want)
    assert rounder._requests  # (remembered)
    if not isinstance(fmt, lowfp.S2FP8) and rounding == "nearest":  # dense layouts: one pass where x lies
        prepared = rounder._requests[(torch.float32, False)]
        for t in (x.to(memory_format=torch.channels_last), x.transpose(1, 3), x.permute(2, 0, 3, 1)):
            got = prepared.round(t, None)
            assert got is not None and got.stride() == t.stride()
            assert torch.equal(got.nan_to_num(7.0), lowfp.quantize(t, fmt).nan_to_num(7.0))
        assert prepared.round(x[:, :2], None) is None  # (not dense: the full path)
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode():  # (a subclass: the full path's shapes and strides, no kernel)
            for t in (torch.empty(2, 3, 4, 5), torch.empty(2, 3, 4, 5).transpose(1, 3)):
                got = rounder(t)
                assert got.shape == t.shape and got.stride() == t.stride()


@pytest.mark.parametrize("fmt", ["fp(4,3,4)", lowfp.S2FP8()])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_rounders_graph_form_gives_its_bits_and_counts(fmt, rounding):
    """Rounder.in_graph, what a compiled emulation records: the rounder's bits, counts and seed
    draws as (result, counts), for the tensors a stack passes (non-contiguous, empty, float64,
    meta, fake), and named errors for the rest."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from lowfp.quantize import Rounder
    rounder = Rounder(fmt, rounding)
    x = torch.randn(6, 5) * 40
    x[0, 0] = float("nan")
    for t in (x, x.t(), torch.empty(0, 3), x.double(), x.to(torch.bfloat16)):
        for count in (True, False):
            stats = lowfp.Stats()
            torch.manual_seed(3)
            want = rounder(t, stats)
            torch.manual_seed(3)
            got, counts = rounder.in_graph(t, count)
            assert got.dtype == t.dtype and torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
            assert torch.equal(counts, stats.counts) if count else counts.numel() == 0
    got, counts = rounder.in_graph(torch.empty(4, 3, device="meta"), True)
    assert got.shape == (4, 3) and got.device.type == "meta" and counts.shape == (4,)
    with FakeTensorMode() as mode:
        got, counts = rounder.in_graph(mode.from_tensor(x), True)
        assert got.shape == x.shape and counts.shape == (4,)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        rounder.in_graph([1.0], True)
    with pytest.raises(ValueError, match="cannot be rounded"):
        rounder.in_graph(torch.zeros(3, dtype=torch.int32), True)


def test_any_stats_takes_the_counts_it_shares_with_a_rounding():
    """A ScaledStats takes a plain or S2FP8 rounding's four counts (its block counts stay 0),
    a Stats a scaled rounding's element counts, on every path (native, operator, S2FP8)."""
    x = torch.randn(4, 64) * 1e3
    for fmt, kwargs in (("fp(4,3,4)", {}), (lowfp.S2FP8(), {}), ("mxfp4_e2m1", {})):
        for grad in (False, True):  # (requires grad: the operator's path)
            t = x.clone().requires_grad_(grad)
            plain, scaled = lowfp.Stats(), lowfp.scaled.ScaledStats()
            lowfp.quantize(t, fmt, stats=plain, **kwargs)
            lowfp.quantize(t, fmt, stats=scaled, **kwargs)
            assert torch.equal(scaled.counts[:4], plain.counts) and plain.numel == x.numel()
            assert scaled.blocks == (8 if fmt == "mxfp4_e2m1" else 0)
    for bad in ([1, 2], torch.ones(4), torch.ones(2, 2, dtype=torch.int64)):
        with pytest.raises(TypeError, match="counts must be a 1-D int64 tensor"):
            lowfp.Stats().accumulate(bad)


# On a GPU (tests/devices.py): the CPU's bits, counts and steps.

@on_cuda
def test_layouts_out_inplace_and_errors():
    x = torch.randn(64, 48, device="cuda") * 40
    want = lowfp.quantize(x.cpu(), "fp(4,3,4)")
    assert torch.equal(lowfp.quantize(x.t(), "fp(4,3,4)").cpu(), want.t())
    out = torch.empty(48, 64, device="cuda").t()
    lowfp.quantize(x, "fp(4,3,4)", out=out)
    assert torch.equal(out.cpu(), want)
    y = x.clone()
    lowfp.quantize_(y, "fp(4,3,4)")
    assert torch.equal(y.cpu(), want)
    assert lowfp.quantize(torch.empty(0, device="cuda"), "fp(4,3,4)").numel() == 0
    with pytest.raises(ValueError, match="out is on cpu"):
        lowfp.quantize(x, "fp(4,3,4)", out=torch.empty(64, 48))
    with pytest.raises(ValueError, match="stats lives on cpu"):
        lowfp.quantize(x, "fp(4,3,4)", stats=lowfp.Stats())


@on_cuda
def test_gradients_on_gpu():
    x = (torch.randn(100, device="cuda") * 10).requires_grad_()
    lowfp.quantize(x, "fp(4,3,4)", grad_fmt="fp(5,2,0)").backward(torch.full((100,), 1e5, device="cuda"))
    assert torch.equal(x.grad.cpu(), lowfp.quantize(torch.full((100,), 1e5), "fp(5,2,0)"))


@on_cuda
def test_streams_and_device_counts():
    """Work is enqueued on torch's current stream; counts stay on the device until read."""
    side = torch.cuda.Stream()
    x = torch.randn(1 << 22, device="cuda") * 100
    stats = lowfp.Stats("cuda")
    with torch.cuda.stream(side):
        x_side = x * 1  # produced on the side stream, so the next op is ordered after it
        y = lowfp.quantize(x_side, "fp(4,3,4)", "stochastic", seed=5, stats=stats)
    assert stats.counts.is_cuda
    side.synchronize()
    cpu_stats = lowfp.Stats()
    a = lowfp.quantize(x.cpu(), "fp(4,3,4)", "stochastic", seed=5, stats=cpu_stats)
    assert torch.equal(y.cpu(), a)
    # Stochastic overflow is random (values between max and the next binade may round down),
    # so the reference is the CPU's count for the same seed; most of |x| > 32 must overflow.
    assert stats.numel == x.numel() and stats.as_dict() == cpu_stats.as_dict()
    assert stats.overflow >= int((x.abs() >= 32).sum()) > 0


@on_cuda
def test_native_calls_take_torchs_current_stream_and_device():
    """backends.native hands the kernels torch's current stream of the tensor's device (its raw
    accessor, as Inductor's code calls it): the default stream, a side stream inside
    torch.cuda.stream, each device's own."""
    from lowfp import backends
    x = torch.randn(8, device="cuda")
    assert backends.native(x, "x")[1:] == (x.get_device(), torch.cuda.current_stream().cuda_stream)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert backends.native(x, "x")[1:] == (x.get_device(), side.cuda_stream)
    last = torch.cuda.device_count() - 1
    t = torch.randn(8, device=f"cuda:{last}")
    assert backends.native(t, "t")[1:] == (last, torch.cuda.current_stream(last).cuda_stream)


@on_cuda
def test_remembered_calls_on_gpu_are_one_c_call_on_torchs_current_stream(monkeypatch):
    """A remembered call on a CUDA tensor (a plain format, or a scaled one with blocks along the
    last axis), and a BoundRounder's call, is one C call of lowfp._C_cuda's kernel, enqueued on
    torch's current stream (here a side stream whose producer of x is still sleeping when the call
    is made): the CPU's bits, counts and generator draws, nearest and stochastic, with out= and
    stats on the device. What C hands back (stats on the CPU, a transposed x) takes the Python
    path, with the same bits."""
    from lowfp.quantize import BoundRounder, Rounder
    from lowfp.scaled import ScaledStats
    taken = _spy_remembered(monkeypatch)
    x_cpu = torch.randn(64, 300) * 30
    x_cpu[0, :3] = torch.tensor([float("nan"), 1e9, 1e-9])
    x_gpu = x_cpu.cuda()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()

    def produced_late():  # (inside torch.cuda.stream(side)) x made by the side stream after a sleep
        torch.cuda._sleep(50_000_000)
        return x_gpu * 1

    cases = [("fp(4,3,4)", dict()), ("fp(4,3,4)", dict(rounding="stochastic")),
             ("fp(4,3,4)", dict(rounding="stochastic", seed=5, offset=3)),
             ("fp(4,3,4)", dict(rounding="stochastic", generator=torch.Generator().manual_seed(4))),
             ("fp(4,3,4)", dict(out_dtype=torch.float64)), ("mxfp8_e4m3", dict()),
             ("nvfp4", dict(rounding="stochastic"))]
    for fmt, kwargs in cases:
        with_out = "out_dtype" not in kwargs
        stats_type = lowfp.Stats if fmt == "fp(4,3,4)" else ScaledStats

        def call(device, stats):
            kw = {k: (v.clone_state() if isinstance(v, torch.Generator) else v) for k, v in kwargs.items()}
            torch.manual_seed(1)
            with torch.cuda.stream(side):
                x = produced_late() if device == "cuda" else x_cpu
                y = lowfp.quantize(x, fmt, stats=stats, **kw)
                out = torch.empty_like(y)
                if with_out:
                    lowfp.quantize(x, fmt, stats=stats, out=out, **kw)
            side.synchronize()
            return y, out if with_out else y, torch.rand(1)
        want_stats = stats_type()
        want = call("cpu", want_stats)
        for remembered in (False, True):
            stats = stats_type("cuda")
            taken.clear()
            got = call("cuda", stats)
            assert taken == ["_quantize_remembered"] * (1 + with_out) * remembered, (kwargs, taken)
            assert same_bits(got[0], want[0]) and same_bits(got[1], want[1]) and torch.equal(got[2], want[2])
            assert torch.equal(stats.counts.cpu(), want_stats.counts), (fmt, kwargs)
    taken.clear()
    with torch.cuda.stream(side):
        y = lowfp.quantize(produced_late(), "fp(4,3,4)", stats=lowfp.Stats())  # (stats on the CPU)
        t = lowfp.quantize(produced_late().t(), "fp(4,3,4)")  # (transposed: the layout path)
    side.synchronize()
    assert taken == []
    assert same_bits(y, lowfp.quantize(x_cpu, "fp(4,3,4)")) and same_bits(t, lowfp.quantize(x_cpu.t(), "fp(4,3,4)"))
    # the emulation's BoundRounder: its rounding and its rounding in place, from the second call
    # (the first learns the prepared request)
    for rounding in ("nearest", "stochastic"):
        rounder = Rounder("fp(4,3,4)", rounding, "saturate")
        want_stats, stats = lowfp.Stats(), lowfp.Stats("cuda")
        bound, bound_cpu = BoundRounder(rounder, stats), BoundRounder(rounder, want_stats)
        for call in range(3):
            torch.manual_seed(call)
            want_y, want_z = bound_cpu(x_cpu), x_cpu.clone()
            assert bound_cpu.round_in_place(want_z)
            torch.manual_seed(call)
            with torch.cuda.stream(side):
                y = bound(produced_late())
                z = produced_late()
                assert bound.round_in_place(z)
            side.synchronize()
            assert same_bits(y, want_y) and same_bits(z, want_z), (rounding, call)
            assert torch.float32 in bound._requests
        assert stats.as_dict() == want_stats.as_dict()


@on_cuda
def test_more_than_2_to_the_31_elements_on_gpu():
    n = 2**31 + 9
    tail = torch.tensor([0.3] * 6 + [100.0, -7.7, 1e-4], dtype=torch.float16)
    x = torch.full((n,), 0.3, dtype=torch.float16, device="cuda")
    x[-3:] = tail[-3:].cuda()
    s = lowfp.Stats("cuda")
    lowfp.quantize_(x, "float8_e4m3fn", "stochastic", seed=9, stats=s)
    assert s.numel == n and s.overflow == 0
    # the last 9 elements start at index 2^31, a multiple of 4: block offset 2^31 / 4
    want = lowfp.quantize(tail, "float8_e4m3fn", "stochastic", seed=9, offset=2**31 // 4)
    assert torch.equal(x[2**31:].cpu(), want)
    del x
    torch.cuda.empty_cache()


def test_torch_func_transforms_are_refused_by_name():
    """A tensor of a torch.func transform (vmap's batched, grad's tracked tensors) has no memory
    lowfp's kernels can read: a TypeError naming x, for formats, scaled formats and S2FP8 alike,
    remembered calls included; a plain tensor rounded inside a transform still rounds."""
    x = torch.randn(4, 32)
    for fmt in ("fp(4,3,4)", "mxfp8_e4m3", "s2fp8"):
        lowfp.quantize(x, fmt)  # (remembered: the next calls would take the prepared request)
        for transform in (lambda f: torch.func.vmap(f)(x), lambda f: torch.func.grad(lambda t: f(t).sum())(x),
                          lambda f: torch.func.vjp(f, x)):
            with pytest.raises(TypeError, match="x is a tensor of a torch.func transform"):
                transform(lambda t: lowfp.quantize(t, fmt))
    w = torch.randn(4, 32)
    grad = torch.func.grad(lambda t: (t * lowfp.quantize(w, "fp(4,3,4)")).sum())(x)
    assert torch.equal(grad, lowfp.quantize(w, "fp(4,3,4)"))


def test_the_gpu_element_loop_on_cpu_threads_takes_each_element_once_with_its_word(tmp_path):
    # cpp/src/cuda/element_groups.hpp, the loop of the element-wise CUDA kernels (quantize, S2FP8,
    # a scaled call's single block) over groups of four, followed thread by thread on the CPU:
    # each group once, each element's Philox word, nothing past the end, only real elements
    # counted; 32-, 16- (two groups in flight) and 64-bit elements, in place too (tests/cpp/).
    out = run_host_program(tmp_path, "element_groups_on_threads.cpp")
    assert out.strip() == "0 failures in 3360 cases", out
