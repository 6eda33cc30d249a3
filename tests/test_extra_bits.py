"""Extra bits (docs/design.md §5): split/merge/packing and the ExtraBits optimizers, against references
written here: float64/integer arithmetic for truncation, a Python bit string for packing, and a
numpy float32 optimizer that performs torch.optim's operations in the same order (numpy's
float32 element-wise operations round each operation: no fused multiply-adds)."""

import copy
import math

import numpy as np
import pytest
import torch

import lowfp
import lowfp.extra_bits as eb
from lowfp.optim import ExtraBitsAdam, ExtraBitsAdamW, ExtraBitsSGD
from reference import fma32

F32 = np.float32


def random_float32(n, seed=0, lo=-30, hi=30):
    g = np.random.default_rng(seed)
    x = (g.standard_normal(n) * np.exp2(g.uniform(lo, hi, n))).astype(F32)
    return torch.from_numpy(x)


def truncate_bits(w: torch.Tensor, dtype, k) -> torch.Tensor:
    """W truncated toward zero to (16-bit precision + k) bits, in float64 arithmetic."""
    m16, emin = (7, -126) if dtype == torch.bfloat16 else (10, -14)
    x = w.double().numpy()
    a = np.abs(x)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    step = np.exp2(np.maximum(e, emin) - m16 - k)
    return torch.from_numpy(np.sign(x) * np.floor(a / step) * step).float()


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


def pack_reference(values, q):
    """docs/design.md §5's packing as a bit string: element j of each 32-element block at bits [j q, (j + 1) q)
    of the block's q words, least significant bit first; the last block padded with zeros. int32s."""
    n = -(-len(values) // 32) * 32
    bits = "".join(format(v, f"0{q}b")[::-1] for v in values) + "0" * q * (n - len(values))
    words = [int(bits[32 * j:32 * j + 32][::-1], 2) for j in range(n * q // 32)]
    return [wd - 2**32 if wd >= 2**31 else wd for wd in words]


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


# ---- optimizers ------------------------------------------------------------------------------

def torch_sqrt(x):
    """torch's CPU float32 square root (MKL's on MKL builds: not always correctly rounded)."""
    return torch.from_numpy(np.ascontiguousarray(x)).sqrt().numpy()


class RefSGD:
    """torch.optim.SGD's single-tensor formulas in numpy float32, operation by operation, with a
    fused multiply-add (fma32) where torch's CPU kernels compute one (add with alpha)."""

    def __init__(self, w, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
                 state_round=None):
        self.w, self.buf = [x.copy() for x in w], [None] * len(w)
        # the buffer's storage: each in-place update of a bfloat16 buffer rounds it
        self.state_round = state_round or (lambda a: a)
        self.h = (F32(-lr), F32(momentum), F32(1 - dampening), F32(weight_decay), nesterov, maximize, momentum != 0)

    def step(self, grads):
        neg_lr, mom, omd, wd, nesterov, maximize, has_m = self.h
        R = self.state_round
        for i, g in enumerate(grads):
            d = -g if maximize else g
            if wd != 0:
                d = fma32(wd, self.w[i], d)
            if has_m:
                if self.buf[i] is None:
                    buf = d.copy()  # torch's clone of the gradient: stored rounded, used as it is
                else:
                    buf = R(fma32(omd, d, R(self.buf[i] * mom)))
                d = fma32(mom, buf, d) if nesterov else buf
                self.buf[i] = R(buf)
            self.w[i] = fma32(neg_lr, d, self.w[i])


class RefAdam:
    """torch.optim.Adam/AdamW's single-tensor formulas in numpy float32, with torch's fused
    multiply-adds (add with alpha, lerp, addcmul) and torch's own square root."""

    def __init__(self, w, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                 maximize=False, decoupled=False, state_round=None):
        self.w = [x.copy() for x in w]
        self.state_round = state_round  # applied to the stored moments after each step
        self.m = [np.zeros_like(x) for x in w]
        self.v = [np.zeros_like(x) for x in w]
        self.vmax = [np.zeros_like(x) for x in w]
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.amsgrad, self.maximize, self.decoupled, self.t = amsgrad, maximize, decoupled, 0

    def step(self, grads):
        self.t += 1
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        neg_ss, bc2s = F32(-(self.lr / bc1)), F32(bc2 ** 0.5)
        lw = F32(1 - b1)
        for i, g in enumerate(grads):
            g = -g if self.maximize else g
            w = self.w[i]
            if self.decoupled and self.wd != 0:
                w = w * F32(1 - self.lr * self.wd)
            elif self.wd != 0:
                g = fma32(F32(self.wd), w, g)  # grad.add(param, alpha=wd)
            m = self.m[i]  # lerp: one rounding after the difference
            self.m[i] = fma32(lw, g - m, m) if abs(lw) < 0.5 else fma32(lw - F32(1), g - m, g)
            self.v[i] = fma32(F32(1 - b2) * g, g, self.v[i] * F32(b2))  # mul_ then addcmul_
            v = self.v[i]
            if self.amsgrad:
                self.vmax[i] = np.maximum(self.vmax[i], self.v[i])
                v = self.vmax[i]
            denom = torch_sqrt(v) / bc2s + F32(self.eps)
            self.w[i] = w + (neg_ss * self.m[i]) / denom
            if self.state_round is not None:
                self.m[i], self.v[i], self.vmax[i] = map(self.state_round, (self.m[i], self.v[i], self.vmax[i]))


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.GELU(), torch.nn.Linear(32, 4))


def run_exactness(opt_cls, ref_cls, kwargs, dtype=torch.bfloat16, k=16, rounding="toward_zero",
                  steps=300, truncate=None, state_dtype=torch.float32):
    model = small_model()
    ref = ref_cls([p.detach().numpy().copy() for p in model.parameters()], **{
        key: v for key, v in kwargs.items()})
    opt = opt_cls(model.parameters(), extra_bits=k, rounding=rounding, param_dtype=dtype,
                  state_dtype=state_dtype, **kwargs)
    if truncate is not None:  # float32 parameters were converted with their extra bits
        ref.w = [truncate(torch.from_numpy(w)).numpy() for w in ref.w]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    y = torch.randint(0, 4, (256,), generator=g)
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
        loss.backward()
        ref.step([p.grad.float().numpy() for p in model.parameters()])
        opt.step()
        if truncate is not None:  # a master truncated to 16 + k bits after every step
            ref.w = [truncate(torch.from_numpy(w)).numpy() for w in ref.w]
        for got, want in zip(opt.master_weights(), ref.w):
            assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), step
    return model, opt


SGD_CASES = [dict(lr=0.05), dict(lr=0.05, momentum=0.9), dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
             dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
             dict(lr=0.05, momentum=0.8, dampening=0.1, maximize=True)]
ADAM_CASES = [dict(lr=1e-3), dict(lr=3e-3, weight_decay=1e-2, amsgrad=True),
              dict(lr=1e-3, betas=(0.8, 0.99), maximize=True)]


@pytest.mark.parametrize("kwargs", SGD_CASES)
def test_sgd_bfloat16_16_is_an_fp32_master(kwargs):
    run_exactness(ExtraBitsSGD, RefSGD, kwargs)


@pytest.mark.parametrize("kwargs", ADAM_CASES)
def test_adam_bfloat16_16_is_an_fp32_master(kwargs):
    run_exactness(ExtraBitsAdam, RefAdam, kwargs)


@pytest.mark.parametrize("kwargs", [dict(lr=1e-3), dict(lr=1e-3, weight_decay=0.1, amsgrad=True)])
def test_adamw_bfloat16_16_is_an_fp32_master(kwargs):
    run_exactness(ExtraBitsAdamW, lambda w, **kw: RefAdam(w, decoupled=True, **{"weight_decay": 1e-2, **kw}), kwargs)


def to_bfloat16_nearest(x):
    """float32 -> bfloat16 -> float32 by torch's cast (round to nearest even)."""
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


@pytest.mark.parametrize("opt_cls,ref_cls,kwargs", [
    (ExtraBitsSGD, RefSGD, dict(lr=0.05, momentum=0.9)),
    (ExtraBitsSGD, RefSGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    (ExtraBitsAdam, RefAdam, dict(lr=1e-3, amsgrad=True)),
    (ExtraBitsAdamW, lambda w, **kw: RefAdam(w, decoupled=True, weight_decay=1e-2, **kw), dict(lr=1e-3)),
])
def test_bfloat16_state_is_float32_state_rounded_to_nearest(opt_cls, ref_cls, kwargs):
    # the update uses the new state in float32, which is then stored rounded to bfloat16
    run_exactness(opt_cls, lambda w, **kw: ref_cls(w, state_round=to_bfloat16_nearest, **kw), kwargs,
                  steps=100, state_dtype=torch.bfloat16)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_float16_13_is_an_fp32_master(rounding):
    run_exactness(ExtraBitsAdamW, lambda w, **kw: RefAdam(w, decoupled=True, weight_decay=1e-2, **kw),
                  dict(lr=1e-3), dtype=torch.float16, k=13, rounding=rounding, steps=150)


@pytest.mark.parametrize("k", [4, 8])
def test_smaller_k_is_a_truncated_master(k):
    run_exactness(ExtraBitsSGD, RefSGD, dict(lr=0.05, momentum=0.9), k=k, rounding="nearest", steps=150,
                  truncate=lambda w: truncate_bits(w, torch.bfloat16, k))


def test_against_torch_optim():
    """Largest difference from torch.optim on an fp32 master fed the same gradients, one step at
    a time from the same weights, in units of ulp of the larger operand |W| + |update|: none."""
    for opt_cls, torch_cls, kw in [(ExtraBitsSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
                                   (ExtraBitsAdam, torch.optim.Adam, dict(lr=1e-3)),
                                   (ExtraBitsAdamW, torch.optim.AdamW, dict(lr=1e-3))]:
        model = small_model()
        master = [p.detach().clone().requires_grad_() for p in model.parameters()]
        opt = opt_cls(model.parameters(), **kw)
        topt = torch_cls(master, **kw)
        g = torch.Generator().manual_seed(2)
        worst = 0.0
        for _ in range(100):
            grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in model.parameters()]
            before = [m.detach().clone() for m in master]
            for p, m, gr in zip(model.parameters(), master, grads):
                p.grad, m.grad = gr, gr.float()
            opt.step()
            topt.step()
            for got, want, b in zip(opt.master_weights(), master, before):
                scale = b.abs() + (want.detach() - b).abs()
                ulp = torch.from_numpy(np.spacing(scale.numpy().astype(F32)))
                worst = max(worst, ((got - want.detach()).abs() / ulp).max().item())
                want.data.copy_(got)  # compare one step at a time from the same weights
        print(f"{opt_cls.__name__}: largest difference from {torch_cls.__name__} {worst} ulp")
        assert worst == 0.0, (opt_cls.__name__, worst)  # before torch's arithmetic: SGD 1, Adam 4


def test_state_dict_round_trip_into_a_fresh_optimizer():
    model = small_model()
    opt = ExtraBitsAdamW(model.parameters(), lr=1e-2, extra_bits=8, rounding="stochastic")
    x = torch.randn(32, 16)
    for _ in range(3):
        opt.zero_grad()
        model(x.bfloat16()).float().pow(2).mean().backward()
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    clone = copy.deepcopy(model)
    opt2 = ExtraBitsAdamW(clone.parameters(), lr=1e-2, extra_bits=8, rounding="stochastic")
    opt2.load_state_dict(sd)
    for p, q in zip(model.parameters(), clone.parameters()):
        s1, s2 = opt.state[p], opt2.state[q]
        assert torch.equal(s1["extra"], s2["extra"]) and s2["extra"].dtype == torch.int32
        assert s2["exp_avg"].dtype == torch.float32 and torch.equal(s1["exp_avg"], s2["exp_avg"])
    for m in (model, clone):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
    torch.manual_seed(7)
    opt.step()
    torch.manual_seed(7)
    opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt2.master_weights()))



@pytest.mark.parametrize("opt_cls, torch_cls, ref_cls, kw", [
    (ExtraBitsSGD, torch.optim.SGD, RefSGD, dict(lr=0.05, momentum=0.9, dampening=0.1)),
    (ExtraBitsAdam, torch.optim.Adam, RefAdam, dict(lr=1e-3, weight_decay=1e-2)),
    (ExtraBitsAdamW, torch.optim.AdamW, RefAdam, dict(lr=1e-3, amsgrad=True, weight_decay=0.1))])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_a_torch_optim_state_dict_continues_float32_training(opt_cls, torch_cls, ref_cls, kw, state_dtype):
    """A checkpoint of float32 training with torch.optim continued with extra bits: the model's
    float32 weights are loaded, the optimizer converts them (bfloat16 + 16 bits: every bit kept)
    and loads torch's state_dict, whose moments and step counts it takes. The next steps equal
    the float32 reference formulas continued from torch's weights and state (moments rounded to
    bfloat16 after every step for bfloat16 state, as test_bfloat16_state_... checks)."""
    torch.manual_seed(0)
    model = small_model()
    topt = torch_cls(model.parameters(), **kw)
    g = torch.Generator().manual_seed(5)
    grads = [[torch.randn(p.shape, generator=g) for p in model.parameters()] for _ in range(7)]
    for step in range(3):
        for p, gr in zip(model.parameters(), grads[step]):
            p.grad = gr
        topt.step()
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(topt.state_dict())
    tstate = [topt.state[p] for p in model.parameters()]

    state_round = None if state_dtype == torch.float32 else (
        lambda a: torch.from_numpy(a).bfloat16().float().numpy())
    ref = ref_cls([p.detach().numpy().copy() for p in model.parameters()], **kw, state_round=state_round)
    first = (lambda t: t.bfloat16().float().numpy()) if state_round else (lambda t: t.numpy().copy())
    if ref_cls is RefSGD:
        ref.buf = [first(s["momentum_buffer"]) for s in tstate]
    else:
        ref.t = 3
        ref.m, ref.v = [first(s["exp_avg"]) for s in tstate], [first(s["exp_avg_sq"]) for s in tstate]
        if kw.get("amsgrad"):
            ref.vmax = [first(s["max_exp_avg_sq"]) for s in tstate]
        ref.decoupled = torch_cls is torch.optim.AdamW

    fresh = small_model(seed=1)
    fresh.load_state_dict(saved_model)  # float32 weights first, then the optimizer
    opt = opt_cls(fresh.parameters(), extra_bits=16, state_dtype=state_dtype,
                  **{key: v for key, v in kw.items() if key != "lr"}, lr=0.5)  # lr: torch's, loaded
    extras = [opt.state[p]["extra"].clone() for p in fresh.parameters()]
    opt.load_state_dict(saved_opt)
    group = opt.param_groups[0]
    assert group["lr"] == kw["lr"] and group["extra_bits"] == 16 and group["state_dtype"] is state_dtype
    assert not {"foreach", "fused", "differentiable", "capturable"} & set(group)
    for p, e, s in zip(fresh.parameters(), extras, tstate):
        assert torch.equal(opt.state[p]["extra"], e)  # the converted float32 weights' cut-off bits
        for key, value in s.items():
            got = opt.state[p][key]
            want = value if key == "step" else value.to(state_dtype)
            assert got.dtype == want.dtype and torch.equal(got, want), key
    assert all(torch.equal(a, torch.from_numpy(b)) for a, b in zip(opt.master_weights(), ref.w))
    for step in range(3, 7):
        for p, gr in zip(fresh.parameters(), grads[step]):
            p.grad = gr.bfloat16()
        ref.step([gr.bfloat16().float().numpy() for gr in grads[step]])
        opt.step()
        for got, want in zip(opt.master_weights(), ref.w):
            assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), step
    # Another family's state is still refused, naming what it lacks.
    other = torch.optim.Adam if torch_cls is torch.optim.SGD else torch.optim.SGD
    with pytest.raises(ValueError, match="lacks"):
        opt.load_state_dict(other(small_model().parameters(), lr=0.1).state_dict())



def test_a_torch_optim_state_dict_keeps_the_extra_bits_of_parameters_it_has_no_state_for():
    """A parameter that never had a gradient under torch.optim has no saved state: it keeps the
    extra bits its float32 weights were converted with, and its moments start at its first step."""
    model = small_model()
    topt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    frozen = model[4].bias
    for p in model.parameters():
        p.grad = None if p is frozen else torch.randn(p.shape)
    topt.step()
    saved = topt.state_dict()
    w32 = frozen.detach().clone()
    opt = ExtraBitsAdamW(model.parameters(), lr=1e-3, extra_bits=16)
    extra = opt.state[frozen]["extra"].clone()
    opt.load_state_dict(saved)
    assert torch.equal(opt.state[frozen]["extra"], extra) and "exp_avg" not in opt.state[frozen]
    assert torch.equal(opt.master_weights()[5], w32)  # bfloat16 + 16: every bit of it
    assert float(opt.state[model[0].weight]["step"]) == 1.0
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert float(opt.state[frozen]["step"]) == 1.0 and float(opt.state[model[0].weight]["step"]) == 2.0


def steps_of(make_opt, steps=5, seed=0):
    """Master weights of small_model after `steps` steps on fixed gradients."""
    model = small_model(seed)
    opt = make_opt(model)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        opt.step()
    return opt, opt.master_weights()


def test_adam_decoupled_weight_decay_is_adamw_and_per_group():
    # torch.optim.Adam(decoupled_weight_decay=True) is AdamW; so here, also for one group only.
    kw = dict(lr=1e-2, weight_decay=0.1, extra_bits=8)
    adam, decoupled = steps_of(lambda m: ExtraBitsAdam(m.parameters(), decoupled_weight_decay=True, **kw))
    adamw, reference = steps_of(lambda m: ExtraBitsAdamW(m.parameters(), **kw))
    _, coupled = steps_of(lambda m: ExtraBitsAdam(m.parameters(), **kw))
    assert all(torch.equal(a, b) for a, b in zip(decoupled, reference))
    assert not any(torch.equal(a, b) for a, b in zip(coupled, reference))
    assert adam.param_groups[0]["decoupled_weight_decay"] and adamw.param_groups[0]["decoupled_weight_decay"]
    _, mixed = steps_of(lambda m: ExtraBitsAdam(
        [{"params": m[0].parameters(), "decoupled_weight_decay": True},
         {"params": list(m[2].parameters()) + list(m[4].parameters())}], **kw))
    assert all(torch.equal(a, b) for a, b in zip(mixed[:2], reference[:2]))
    assert all(torch.equal(a, b) for a, b in zip(mixed[2:], coupled[2:]))
    with pytest.raises(TypeError, match="decoupled_weight_decay must be a bool"):
        ExtraBitsAdam(small_model().parameters(), decoupled_weight_decay=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'decoupled_weight_decay'"):
        ExtraBitsAdamW(small_model().parameters(), decoupled_weight_decay=False)


@pytest.mark.parametrize("opt_cls, expected", [(ExtraBitsAdam, False), (ExtraBitsAdamW, True)])
def test_state_dict_saved_before_decoupled_weight_decay_loads(opt_cls, expected):
    # A state_dict from before the setting existed keeps its class's old behaviour, and the
    # caller's dict is not changed; so does a pickle.
    opt, _ = steps_of(lambda m: opt_cls(m.parameters(), lr=1e-2, weight_decay=0.1, extra_bits=8))
    old = copy.deepcopy(opt.state_dict())
    for g in old["param_groups"]:
        del g["decoupled_weight_decay"]
    kept = copy.deepcopy(old)
    other = {"decoupled_weight_decay": not expected} if opt_cls is ExtraBitsAdam else {}
    fresh = opt_cls(small_model().parameters(), lr=1e-2, weight_decay=0.1, extra_bits=8, **other)
    fresh.load_state_dict(old)
    assert fresh.param_groups[0]["decoupled_weight_decay"] is expected
    assert old["param_groups"][0].keys() == kept["param_groups"][0].keys()
    state = opt.__getstate__()
    for g in state["param_groups"]:
        del g["decoupled_weight_decay"]
    revived = opt_cls.__new__(opt_cls)
    revived.__setstate__(state)
    assert revived.param_groups[0]["decoupled_weight_decay"] is expected


@pytest.mark.parametrize("opt_cls", [ExtraBitsSGD, ExtraBitsAdam, ExtraBitsAdamW])
def test_torch_implementation_switches(opt_cls):
    # foreach / fused are accepted so torch.optim code runs unchanged, and change nothing.
    kw = dict(lr=1e-2, extra_bits=8)
    _, plain = steps_of(lambda m: opt_cls(m.parameters(), **kw))
    for switches in (dict(foreach=True), dict(foreach=False, fused=True), dict(fused=False),
                     dict(differentiable=False)):
        _, got = steps_of(lambda m: opt_cls(m.parameters(), **switches, **kw))
        assert all(torch.equal(a, b) for a, b in zip(got, plain)), switches
    params = small_model().parameters()
    with pytest.raises(TypeError, match="foreach must be a bool or None, got 'yes'"):
        opt_cls(params, foreach="yes")
    with pytest.raises(ValueError, match="differentiable=True is not supported"):
        opt_cls(params, differentiable=True)
    if opt_cls is ExtraBitsSGD:
        with pytest.raises(TypeError, match="capturable"):  # torch's SGD has no such argument
            opt_cls(params, capturable=False)
    else:
        _, got = steps_of(lambda m: opt_cls(m.parameters(), capturable=False, **kw))
        assert all(torch.equal(a, b) for a, b in zip(got, plain))
        with pytest.raises(ValueError, match="capturable=True is not supported"):
            opt_cls(params, capturable=True)


def test_float32_model_conversion_and_memory():
    model = small_model()
    w32 = [p.detach().clone() for p in model.parameters()]
    opt = ExtraBitsSGD(model.parameters(), lr=0.1, momentum=0.9, extra_bits=16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), w32))  # nothing lost
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    mem = opt.memory_bytes()
    n = sum(p.numel() for p in model.parameters())
    assert mem["weights"] == 2 * n
    assert mem["extra_bits"] == sum(opt.state[p]["extra"].numel() * 4 for p in model.parameters())
    assert mem["moments"] == sum(opt.state[p]["momentum_buffer"].numel() * 4 for p in model.parameters())
    assert mem["total"] == mem["weights"] + mem["extra_bits"] + mem["moments"]
    opt16 = ExtraBitsAdam(small_model().bfloat16().parameters(), extra_bits=8, state_dtype=torch.bfloat16)
    for group in opt16.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    opt16.step()
    assert opt16.memory_bytes()["moments"] == sum(2 * 2 * p.numel() for g in opt16.param_groups for p in g["params"])



@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_a_float32_model_with_buffers_is_converted_by_to_after_the_optimizer(param_dtype):
    """The optimizer converts only parameters: BatchNorm's float32 running statistics then meet
    16-bit weights, which torch's batch_norm refuses. model.to(param_dtype) after the optimizer
    converts the buffers and leaves the already 16-bit parameters, their identity and their
    extra bits as they are, so nothing of the float32 weights is lost."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4))
    w32 = [p.detach().clone() for p in model.parameters()]
    opt = ExtraBitsAdamW(model.parameters(), lr=1e-3, extra_bits=16 if param_dtype == torch.bfloat16
                         else 13, param_dtype=param_dtype)
    x = torch.randn(5, 3, 8, 8)
    with pytest.raises(RuntimeError):  # torch's own error: float32 running statistics
        model(x.to(param_dtype))
    params = list(model.parameters())
    extras = [opt.state[p]["extra"].clone() for p in params]
    assert model.to(param_dtype) is model
    assert list(model.parameters()) == params and all(p.dtype == param_dtype for p in params)
    assert model[1].running_var.dtype == param_dtype
    assert all(torch.equal(opt.state[p]["extra"], e) for p, e in zip(params, extras))
    # bfloat16 + 16 is float32; float16 + 13 too in float16's normal range
    normal = [w.abs() >= 2.0 ** -14 if param_dtype == torch.float16 else torch.ones_like(w, dtype=torch.bool)
              for w in w32]
    assert all(torch.equal(a[m], b[m]) for a, b, m in zip(opt.master_weights(), w32, normal))
    assert sum(m.sum().item() for m in normal) > 0.99 * sum(w.numel() for w in w32)
    for _ in range(2):
        opt.zero_grad()
        model(x.to(param_dtype)).float().square().mean().backward()
        opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(opt.master_weights(), w32))


def test_param_groups_schedulers_and_zero_grad():
    model = small_model().bfloat16()
    opt = ExtraBitsSGD([{"params": model[0].parameters(), "lr": 0.5},
                        {"params": model[2].parameters()}, {"params": model[4].parameters(), "extra_bits": 4}],
                       lr=0.1, extra_bits=12)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = [w.clone() for w in opt.master_weights()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    after = opt.master_weights()
    assert opt.param_groups[0]["lr"] == 0.25 and opt.param_groups[1]["lr"] == 0.05
    assert opt.state[model[4].weight]["extra"].numel() == (model[4].weight.numel() + 31) // 32 * 4
    d0 = (after[0] - before[0]).abs().max().item()
    assert d0 == pytest.approx(0.5, rel=1e-2)  # group 0 stepped with its own lr
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())



@pytest.mark.parametrize("opt_cls, kw", [(ExtraBitsSGD, dict(momentum=0.9)), (ExtraBitsAdamW, {}),
                                         (ExtraBitsAdam, dict(betas=(0.8, 0.99)))])
def test_tensor_lr_and_betas_step_as_floats(opt_cls, kw):
    """torch.optim takes lr (and Adam's betas) as 1-element tensors, which LR schedulers fill in
    place; the step reads them as floats, so it equals the float run under the same schedule."""
    def run(as_tensor):
        model = small_model()
        # 1-element: torch accepts any shape; float64, so the scheduler's values stay the floats'
        lr = torch.tensor([0.02], dtype=torch.float64) if as_tensor else 0.02
        kws = dict(kw)
        if as_tensor and "betas" in kws:
            kws["betas"] = tuple(torch.tensor(b, dtype=torch.float64) for b in kws["betas"])
        opt = opt_cls(model.parameters(), lr=lr, extra_bits=8, rounding="nearest", **kws)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=6)
        g = torch.Generator().manual_seed(3)
        for _ in range(5):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            opt.step()
            sched.step()
        return opt
    tensor_run, float_run = run(True), run(False)
    lr = tensor_run.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.shape == () and float(lr) == float_run.param_groups[0]["lr"]
    assert all(torch.equal(a, b) for a, b in zip(tensor_run.master_weights(), float_run.master_weights()))
    loaded = opt_cls(small_model().parameters(), lr=torch.tensor(1.0), extra_bits=8, rounding="nearest",
                     **kw)
    loaded.load_state_dict(tensor_run.state_dict())
    assert float(loaded.param_groups[0]["lr"]) == float(lr)
    for bad in (torch.tensor([0.1, 0.2]), torch.tensor(1)):
        with pytest.raises(ValueError, match="Tensor lr must be 1-element and floating-point"):
            opt_cls(small_model().parameters(), lr=bad, **kw)
    with pytest.raises(TypeError, match="lr must be a float or a 1-element tensor"):
        opt_cls(small_model().parameters(), lr="0.1", **kw)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt_cls([{"params": small_model().parameters(), "lr": torch.tensor(-1.0)}], **kw)
    if opt_cls is not ExtraBitsSGD:
        with pytest.raises(ValueError, match="both floats or both Tensors"):
            opt_cls(small_model().parameters(), betas=(0.9, torch.tensor(0.99)))
        with pytest.raises(ValueError, match=r"Tensor betas\[1\] must be 1-element"):
            opt_cls(small_model().parameters(), betas=(torch.tensor(0.9), torch.tensor([0.9, 0.99])))


def test_optimizer_errors():
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        ExtraBitsSGD([torch.nn.Parameter(torch.ones(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="between 1 and 13"):
        ExtraBitsSGD([torch.nn.Parameter(torch.ones(3, dtype=torch.float16))], extra_bits=14)
    with pytest.raises(ValueError, match="rounding"):
        ExtraBitsAdam([torch.nn.Parameter(torch.ones(3))], rounding="up")
    with pytest.raises(TypeError, match="state_dtype"):
        ExtraBitsAdam([torch.nn.Parameter(torch.ones(3))], state_dtype=torch.float16)
    with pytest.raises(ValueError, match="Nesterov"):
        ExtraBitsSGD([torch.nn.Parameter(torch.ones(3))], nesterov=True)
    with pytest.raises(ValueError, match="betas must be a pair"):
        ExtraBitsAdam([torch.nn.Parameter(torch.ones(3))], betas=(0.9,))
    nan = float("nan")
    for cls, kw, what in [(ExtraBitsSGD, dict(lr=nan), "learning rate"),
                          (ExtraBitsAdamW, dict(lr=-1e-3), "learning rate"),
                          (ExtraBitsSGD, dict(momentum=nan), "momentum"),
                          (ExtraBitsSGD, dict(weight_decay=nan), "weight_decay"),
                          (ExtraBitsAdam, dict(eps=nan), "epsilon"),
                          (ExtraBitsAdam, dict(betas=(0.9, nan)), "beta")]:
        with pytest.raises(ValueError, match=f"Invalid {what}"):  # as torch.optim
            cls([torch.nn.Parameter(torch.ones(3))], **kw)
    sgd = ExtraBitsSGD([torch.nn.Parameter(torch.ones(3))], momentum=0.9)
    with pytest.raises(ValueError, match=r"lacks \['amsgrad', 'betas', 'eps'\].*another optimizer"):
        ExtraBitsAdamW([torch.nn.Parameter(torch.ones(3))]).load_state_dict(sgd.state_dict())


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate parameters")
def test_a_refused_param_group_leaves_the_optimizer_as_it_was():
    """A group that fails its checks is not added, and none of its float32 parameters is
    converted; a parameter listed twice in a group (which torch.optim only warns about) is
    refused: one fused call would update its memory from two slots at once."""
    first = torch.nn.Parameter(torch.randn(3).bfloat16())
    opt = ExtraBitsSGD([first], lr=0.1)
    p32 = torch.nn.Parameter(torch.randn(4))
    bad = [[p32, torch.nn.Parameter(torch.ones(3, dtype=torch.float64))],
           [p32, torch.nn.Parameter(torch.ones(4, 2).bfloat16()[::2])],  # every other row
           [p32, p32]]
    for params, error, match in zip(bad, (TypeError, ValueError, ValueError),
                                    ("float16 or bfloat16", "dense in memory", "more than once")):
        with pytest.raises(error, match=match):
            opt.add_param_group({"params": params})
        assert len(opt.param_groups) == 1 and p32.dtype == torch.float32 and p32 not in opt.state
    with pytest.raises(ValueError, match="more than once"):
        ExtraBitsAdamW([first, torch.nn.Parameter(torch.ones(2).bfloat16()), first])
    opt.add_param_group({"params": [p32], "lr": 0.5})  # a good group still goes in
    assert len(opt.param_groups) == 2 and p32.dtype == torch.bfloat16


def test_a_parameter_appended_to_a_group_by_hand_steps():
    """torch.optim steps whatever group["params"] holds, also a parameter appended to it after
    the optimizer was built; so does this one, with the stochastic draws of an optimizer built
    with both. An appended float32 parameter was never converted: a clear error."""
    def params():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in (5, 40)]
    (a, b), (c, d) = params(), params()
    kw = dict(lr=0.1, momentum=0.9, extra_bits=8, rounding="stochastic")
    opt, ref = ExtraBitsSGD([a], **kw), ExtraBitsSGD([c, d], **kw)
    opt.param_groups[0]["params"].append(b)
    for step in range(3):
        for p, q in ((a, c), (b, d)):
            p.grad = q.grad = torch.randn(p.shape).bfloat16()
        torch.manual_seed(step)
        opt.step()
        torch.manual_seed(step)
        ref.step()
        assert all(torch.equal(x, y) for x, y in zip(opt.master_weights(), ref.master_weights()))
    opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.randn(3)))
    opt.param_groups[0]["params"][-1].grad = torch.randn(3)
    with pytest.raises(TypeError, match="now has dtype torch.float32"):
        opt.step()


def bf16_param(n):
    p = torch.nn.Parameter(torch.randn(n).bfloat16())
    p.grad = torch.randn(n).bfloat16()
    return p


def test_gradients_of_another_dtype_or_layout():
    """A float32 or non-contiguous gradient steps as its contiguous bfloat16 rounding does (as
    p.grad.to(p.dtype)); a sparse one (Embedding(sparse=True)) is a clear error, before any
    parameter has stepped."""
    torch.manual_seed(0)
    g32 = torch.randn(6, 4)
    a, b = torch.nn.Parameter(torch.randn(4, 6).bfloat16()), None
    b = torch.nn.Parameter(a.detach().clone())
    opt_a, opt_b = ExtraBitsAdamW([a], lr=0.1), ExtraBitsAdamW([b], lr=0.1)
    a.grad_dtype = None  # torch refuses a gradient of another dtype unless told to accept it
    a.grad = g32.t()  # float32, transposed
    b.grad = g32.t().bfloat16().contiguous()
    opt_a.step()
    opt_b.step()
    assert torch.equal(a, b) and torch.equal(opt_a.state[a]["extra"], opt_b.state[b]["extra"])
    emb = torch.nn.Embedding(10, 3, sparse=True)
    dense = torch.nn.Parameter(torch.randn(3).bfloat16())
    opt = ExtraBitsSGD([dense, emb.weight], lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    dense.grad = torch.ones(3).bfloat16()
    before = dense.detach().clone()
    with pytest.raises(ValueError, match="dense gradients, got a torch.sparse_coo one"):
        opt.step()
    assert torch.equal(dense, before)


# ---- parameters laid out in memory other than row-major -----------------------------------------

def laid_out_params(seed=0):
    """bfloat16 parameters in three layouts: a channels_last convolution weight, a transposed
    weight (strides (1, 4)) and a contiguous bias."""
    torch.manual_seed(seed)
    conv = torch.randn(8, 3, 3, 3).bfloat16().to(memory_format=torch.channels_last)
    return [torch.nn.Parameter(conv), torch.nn.Parameter(torch.randn(6, 4).bfloat16().t()),
            torch.nn.Parameter(torch.randn(5).bfloat16())]


def in_memory_order(t, order):
    """A contiguous copy of t's elements in memory order (order: lowfp's memory order)."""
    return (t if order is None else t.permute(order)).clone(memory_format=torch.contiguous_format)


def test_memory_order_of_dense_layouts():
    cl = torch.empty(8, 3, 3, 3).to(memory_format=torch.channels_last)
    assert lowfp.backends.memory_order(cl) == (0, 2, 3, 1) and cl.permute(0, 2, 3, 1).is_contiguous()
    assert lowfp.backends.memory_order(torch.empty(6, 4).t()) == (1, 0)
    assert lowfp.backends.memory_order(torch.empty(5)) is None
    # a size-1 dim goes last, whatever its stride
    assert lowfp.backends.memory_order(torch.empty(4, 1, 6).permute(2, 1, 0)) == (2, 0, 1)
    for bad in (torch.empty(6, 4)[:, ::2], torch.empty(10)[::3], torch.empty(1, 3).expand(4, 3)):
        with pytest.raises(ValueError, match="dense in memory"):
            lowfp.backends.memory_order(bad)
    for order in [(0, 1, 2), (2, 0, 1), (1, 2, 0)]:
        assert lowfp.backends.inverse_order(order) == tuple(int(i) for i in np.argsort(order))


@pytest.mark.parametrize("rounding", eb.EXTRA_BITS_ROUNDING)
def test_reorder_packed_moves_each_elements_bits(rounding):
    """Against pack_reference: arbitrary q-bit values packed in one memory order of a (3, 5, 7, 2)
    tensor (210 elements, a partial last block), repacked in another, equal those values packed
    in the new order; and back."""
    shape = (3, 5, 7, 2)
    orders = [None, (0, 2, 3, 1), (3, 1, 0, 2)]
    for k in range(1, 17):
        q = eb.bits_per_element(k, rounding)
        logical = torch.randint(0, 2 ** q, shape, generator=torch.Generator().manual_seed(k))
        for old in orders:
            packed = torch.tensor(pack_reference(in_memory_order(logical, old).reshape(-1).tolist(), q),
                                  dtype=torch.int32)
            for new in orders:
                want = pack_reference(in_memory_order(logical, new).reshape(-1).tolist(), q)
                moved = eb.reorder_packed(packed, shape, k, rounding, old, new)
                assert moved.tolist() == want, (k, old, new)
                assert torch.equal(eb.reorder_packed(moved, shape, k, rounding, new, old), packed)


def test_reorder_packed_errors():
    packed = torch.zeros(eb.packed_words(30, 8, "nearest"), dtype=torch.int32)
    for args, error, match in [
            ((packed[:-1], (5, 6), 8, "nearest", None, (1, 0)), ValueError, "packed has 8 words but 30"),
            ((packed.long(), (5, 6), 8, "nearest", None, (1, 0)), TypeError, "int32"),
            ((packed, (5, 6), 17, "nearest", None, (1, 0)), ValueError, "k must be an int between 1 and 16"),
            ((packed, (5, 6), 8, "up", None, (1, 0)), ValueError, "rounding must be one of"),
            ((packed, (5, 6), 8, "nearest", (0, 0), None), ValueError, "old must be an order of the 2 dims"),
            ((packed, (5, 6), 8, "nearest", None, (1, 0, 2)), ValueError, "new must be an order")]:
        with pytest.raises(error, match=match):
            eb.reorder_packed(*args)


@pytest.mark.parametrize("opt_cls,kw", [
    (ExtraBitsSGD, dict(lr=0.1, momentum=0.9, extra_bits=8, rounding="stochastic")),
    (ExtraBitsAdamW, dict(lr=1e-2, extra_bits=16, rounding="nearest", amsgrad=True)),
    (ExtraBitsAdam, dict(lr=1e-2, extra_bits=5, rounding="toward_zero", state_dtype=torch.bfloat16))])
def test_parameters_in_any_dense_layout_step_in_memory_order(opt_cls, kw):
    """A channels_last or transposed parameter steps element by element in memory order: exactly
    as contiguous twins holding its elements in that order, with the same gradients (stochastic
    rounding included: Philox words follow the position in memory). Its moments take its layout,
    and master_weights() returns its elements where they belong."""
    params = laid_out_params()
    orders = [lowfp.backends.memory_order(p) for p in params]
    assert orders == [(0, 2, 3, 1), (1, 0), None]
    twins = [torch.nn.Parameter(in_memory_order(p.detach(), o)) for p, o in zip(params, orders)]
    opt, opt_twin = opt_cls(params, **kw), opt_cls(twins, **kw)
    for step in range(4):
        for p, t, o in zip(params, twins, orders):
            g = torch.randn(p.shape).bfloat16()  # contiguous: copied into p's layout by the step
            p.grad = torch.empty_like(p).copy_(g) if step % 2 else g
            t.grad = in_memory_order(g, o)
        torch.manual_seed(step)
        opt.step()
        torch.manual_seed(step)
        opt_twin.step()
        for p, t, o, w, wt in zip(params, twins, orders, opt.master_weights(), opt_twin.master_weights()):
            assert p.stride() == torch.empty_like(p).stride() and lowfp.backends.memory_order(p) == o  # kept
            assert torch.equal(in_memory_order(p.detach(), o).view(torch.int16), t.detach().view(torch.int16))
            assert torch.equal(in_memory_order(w, o), wt)
            state, state_twin = opt.state[p], opt_twin.state[t]
            assert torch.equal(state["extra"], state_twin["extra"])
            assert state.get("extra_dim_order") == o and "extra_dim_order" not in state_twin
            for key in ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in state:
                    assert lowfp.backends.memory_order(state[key]) == o, key
                    assert torch.equal(in_memory_order(state[key], o), state_twin[key]), key


def test_float32_channels_last_model_keeps_its_layout_and_every_bit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    model = model.to(memory_format=torch.channels_last)
    w32 = [p.detach().clone() for p in model.parameters()]
    opt = ExtraBitsSGD(model.parameters(), lr=0.1, extra_bits=16)
    for p, w in zip(model.parameters(), w32):
        assert p.dtype == torch.bfloat16 and p.stride() == w.stride()
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), w32))  # nothing lost
    assert opt.state[model[0].weight]["extra_dim_order"] == (0, 2, 3, 1)
    x = torch.randn(2, 3, 10, 10).bfloat16().to(memory_format=torch.channels_last)
    model(x).sum().backward()
    opt.step()  # the gradients autograd gives are channels_last too
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    with torch.no_grad():
        for p, w in zip(ref.parameters(), w32):
            p.copy_(w)
    ref_opt = ExtraBitsSGD(ref.parameters(), lr=0.1, extra_bits=16)  # contiguous
    for p, q in zip(ref.parameters(), model.parameters()):
        p.grad = q.grad.contiguous()  # (a contiguous convolution may sum in another order)
    ref_opt.step()
    for a, b in zip(opt.master_weights(), ref_opt.master_weights()):
        assert torch.equal(a, b)  # toward_zero: the same numbers in any layout


@pytest.mark.parametrize("rounding", eb.EXTRA_BITS_ROUNDING)
def test_a_layout_change_moves_the_extra_bits_and_moments(rounding):
    """model.to(memory_format=torch.channels_last) after the optimizer was made, as Module.to
    does it (param.data replaced): nothing is lost, and the next steps go on as those of a model
    that stayed contiguous (deterministic rounding; stochastic words follow memory positions).
    Then back, by loading the state into a contiguous model's optimizer."""
    torch.manual_seed(0)
    kw = dict(lr=1e-2, extra_bits=7, rounding=rounding)
    conv = torch.nn.Conv2d(4, 6, 3).bfloat16()
    twin = copy.deepcopy(conv)
    opt, opt_twin = ExtraBitsAdam(conv.parameters(), **kw), ExtraBitsAdam(twin.parameters(), **kw)
    x = torch.randn(2, 4, 7, 7).bfloat16()

    def step(model, optimizer, memory_format, seed):
        optimizer.zero_grad()
        model(x.to(memory_format=memory_format)).square().sum().backward()
        torch.manual_seed(seed)
        optimizer.step()

    for i in range(2):
        step(conv, opt, torch.contiguous_format, i)
        step(twin, opt_twin, torch.contiguous_format, i)
    conv.to(memory_format=torch.channels_last)
    assert lowfp.backends.memory_order(conv.weight) == (0, 2, 3, 1)
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt_twin.master_weights()))
    opt.load_state_dict(opt.state_dict())  # moves the state to the new layout
    state = opt.state[conv.weight]
    assert state["extra_dim_order"] == (0, 2, 3, 1) and lowfp.backends.memory_order(state["exp_avg"]) == (0, 2, 3, 1)
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt_twin.master_weights()))
    assert torch.equal(conv.weight, twin.weight)
    if rounding != "stochastic":
        for i in range(2, 4):
            step(conv, opt, torch.channels_last, i)
            step(twin, opt_twin, torch.contiguous_format, i)
            assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt_twin.master_weights()))
    else:
        step(conv, opt, torch.channels_last, 2)  # moved at the step, without load_state_dict
    # and back: a contiguous model's optimizer loads the channels_last state
    back = copy.deepcopy(twin)
    with torch.no_grad():
        for p, q in zip(back.parameters(), conv.parameters()):
            p.copy_(q)
    opt_back = ExtraBitsAdam(back.parameters(), **kw)
    saved = opt.state_dict()
    assert saved["state"][0]["extra_dim_order"] == (0, 2, 3, 1)
    opt_back.load_state_dict(saved)
    assert "extra_dim_order" not in opt_back.state[back.weight]
    assert opt_back.state[back.weight]["exp_avg"].is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt_back.master_weights()))
    assert saved["state"][0]["extra_dim_order"] == (0, 2, 3, 1)  # the caller's dict unchanged


def test_a_layout_change_moves_the_state_at_the_step():
    """Without load_state_dict: the step finds the new layout and moves the state first."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 6, 3).bfloat16()
    twin = copy.deepcopy(conv)
    kw = dict(lr=0.1, momentum=0.9, extra_bits=9, rounding="nearest")
    opt, opt_twin = ExtraBitsSGD(conv.parameters(), **kw), ExtraBitsSGD(twin.parameters(), **kw)
    for i in range(3):
        if i == 1:
            conv.to(memory_format=torch.channels_last)
        for p, q in zip(conv.parameters(), twin.parameters()):
            g = torch.randn(p.shape).bfloat16()
            p.grad, q.grad = torch.empty_like(p).copy_(g), g
        opt.step()
        opt_twin.step()
        assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt_twin.master_weights()))
    assert lowfp.backends.memory_order(opt.state[conv.weight]["momentum_buffer"]) == (0, 2, 3, 1)


def test_a_recorded_layout_that_does_not_fit_is_refused():
    p = laid_out_params()[0]
    opt = ExtraBitsSGD([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    saved["state"][0]["extra_dim_order"] = (0, 2, 3)
    with pytest.raises(ValueError, match="dim order \\(0, 2, 3\\), which is not an order of its dims"):
        ExtraBitsSGD([torch.nn.Parameter(p.detach().clone())], lr=0.1).load_state_dict(saved)


def test_step_in_backward_of_a_channels_last_model_equals_a_normal_step():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.GELU(), torch.nn.Conv2d(8, 4, 3))
    a = a.to(memory_format=torch.channels_last)
    b = copy.deepcopy(a)
    kw = dict(lr=1e-2, extra_bits=8, rounding="stochastic")
    torch.manual_seed(1)  # the same stochastic split of the float32 parameters
    opt_a = ExtraBitsAdamW(a.parameters(), **kw)
    torch.manual_seed(1)
    opt_b = ExtraBitsAdamW(b.parameters(), **kw)
    handle = lowfp.optim.step_in_backward(opt_b, clip_value=0.5)
    x = torch.randn(2, 3, 9, 9).bfloat16().to(memory_format=torch.channels_last)
    for step in range(3):
        opt_a.zero_grad()
        a(x).square().mean().backward()
        for p in a.parameters():
            p.grad.clamp_(-0.5, 0.5)
        torch.manual_seed(step)
        opt_a.step()
        torch.manual_seed(step)
        b(x).square().mean().backward()
        assert all(torch.equal(u, v) for u, v in zip(opt_a.master_weights(), opt_b.master_weights()))
    assert lowfp.backends.memory_order(b[0].weight) == (0, 2, 3, 1)
    handle.remove()


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, ExtraBitsSGD, ExtraBitsAdamW])
def test_step_is_seen_by_autograd_as_torch_optim_steps_are(opt_cls):
    """The fused step writes parameters through their pointers. A backward through a graph
    built before the step must raise, as it does after torch.optim's step, not differentiate
    with the new weights; every tensor the step wrote has a new version."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).bfloat16()
    opt = opt_cls(model.parameters(), lr=0.1, **({"momentum": 0.9} if opt_cls is not ExtraBitsAdamW else {}))
    loss = model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).sum()
    loss.backward(retain_graph=True)
    opt.step()  # creates the state
    versions = {id(t): t._version for p in model.parameters()
                for t in [p, *[v for v in opt.state[p].values() if torch.is_tensor(v) and v.dim()]]}
    opt.step()
    assert all(t._version > versions[id(t)] for p in model.parameters()
               for t in [p, *[v for v in opt.state[p].values() if torch.is_tensor(v) and v.dim()]])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_adam_step_counts_are_float32_cpu_tensors_and_hand_edited_ones_count_on():
    """Step counts are kept as torch.optim.Adam keeps them (one-element float32 CPU tensors,
    added to in place, versions bumped); a count edited by hand into another kind of tensor goes
    on counting in its own dtype, and the step reads it as its step number."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3).bfloat16()) for _ in range(4)]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = ExtraBitsAdam(params, lr=0.1), ExtraBitsAdam(ref_params, lr=0.1)
    for step in range(3):
        for p, q in zip(params, ref_params):
            p.grad = q.grad = torch.randn(5, 3).bfloat16()
        versions = [opt.state[p]["step"]._version for p in params if p in opt.state]
        opt.step()
        ref.step()
        counts = [opt.state[p]["step"] for p in params]
        assert all(c.dtype == torch.float32 and c.device.type == "cpu" and c.shape == () for c in counts)
        assert [float(c) for c in counts] == [step + 1.0] * 4
        assert all(c._version > v for c, v in zip(counts, versions))
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    # Edited by hand: one to float64, one to int64, and one skipped ahead to 10.
    opt.state[params[0]]["step"] = torch.tensor(3.0, dtype=torch.float64)
    opt.state[params[1]]["step"] = torch.tensor(3, dtype=torch.int64)
    opt.state[params[2]]["step"] = torch.tensor(10.0)
    ref.state[ref_params[2]]["step"] = torch.tensor(10.0)
    for p, q in zip(params, ref_params):
        p.grad = q.grad = torch.randn(5, 3).bfloat16()
    opt.step()
    ref.step()
    assert [(c.dtype, float(c)) for c in (opt.state[p]["step"] for p in params)] == [
        (torch.float64, 4.0), (torch.int64, 4.0), (torch.float32, 11.0), (torch.float32, 4.0)]
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))


def test_optimizer_refuses_buffers_that_no_longer_fit():
    """The fused step trusts every buffer's size, dtype and device; without these checks each
    case below read or wrote past a buffer (heap corruption) or misread float32 state as bfloat16."""
    small = bf16_param(5)
    opt = ExtraBitsAdam([small])
    opt.step()
    big = bf16_param(20)  # the same 16 packed words as 5 elements
    with pytest.raises(ValueError, match="'exp_avg'.* needs .* tensor of 20 elements"):
        ExtraBitsAdam([big]).load_state_dict(opt.state_dict())

    p = bf16_param(32)
    opt = ExtraBitsSGD([p], lr=0.1, momentum=0.9, extra_bits=8)
    opt.step()
    p.data = torch.zeros(1000, dtype=torch.bfloat16)  # 32 elements' extra bits no longer fit
    p.grad = torch.ones(1000, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="extra bits of a parameter of shape \\(1000,\\).* needs 256"):
        opt.step()
    p.data = torch.zeros(32)
    p.grad = torch.ones(32)
    with pytest.raises(TypeError, match="now has dtype torch.float32"):
        opt.step()
    p.data = torch.zeros(64, dtype=torch.bfloat16)[::2]
    p.grad = torch.ones(32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dense in memory .* has strides \\(2,\\)"):
        opt.step()
    # Changes that keep every object, and some the data pointers too: each is refused at the
    # next step (so no shortcut may take "same objects, same pointers" for "nothing changed").
    p = bf16_param(32)
    opt = ExtraBitsAdam([p], lr=0.1)
    opt.step()
    opt.step()
    p.data = p.data.view(torch.float16)  # the same memory read as float16
    with pytest.raises(TypeError, match="is now torch.float16, but its extra bits extend torch.bfloat16"):
        opt.step()
    p.data = p.data.view(torch.bfloat16)
    opt.step()
    opt.state[p]["exp_avg"].data = torch.zeros(3)  # the same tensor object, other memory
    with pytest.raises(ValueError, match="'exp_avg' .* is a \\(3,\\)"):
        opt.step()
    opt.state[p]["exp_avg"].data = torch.zeros(32)
    opt.step()
    opt.param_groups[0]["rounding"] = "nearest"
    with pytest.raises(ValueError, match="changed from 16/'toward_zero' to 16/'nearest'"):
        opt.step()
    # model.to(device) after the optimizer: checked as for an optimizer on cuda:0 (index 0)
    from lowfp.optim._state import _check_buffers
    q = bf16_param(32)
    with pytest.raises(ValueError, match="must be on cuda:0.* is on cpu .*move the model before"):
        _check_buffers(q, {}, opt.param_groups[0], 0)

    p = bf16_param(8)
    opt = ExtraBitsSGD([p], lr=0.1, momentum=0.9)
    opt.step()
    opt.param_groups[0]["state_dtype"] = torch.bfloat16  # the buffer is float32
    with pytest.raises(ValueError, match="'momentum_buffer'.*needs a torch.bfloat16 tensor"):
        opt.step()
    opt.param_groups[0]["state_dtype"] = torch.float32
    opt.param_groups[0]["extra_bits"] = 8
    with pytest.raises(ValueError, match="changed from 16/'toward_zero' to 8"):
        opt.step()
    opt.param_groups[0]["extra_bits"] = 16
    opt.state[p]["momentum_buffer"] = torch.zeros(7)
    with pytest.raises(ValueError, match="'momentum_buffer' .* is a \\(7,\\)"):
        opt.step()


def test_a_model_converted_to_another_16_bit_type_is_refused():
    """Extra bits extend the 16-bit type they were split from. After model.half() on a bfloat16
    model they would read as float16's and give a wrong master weight: the step,
    master_weights() and load_state_dict() refuse, and the step changes nothing first."""
    model = small_model().bfloat16()
    opt = ExtraBitsSGD(model.parameters(), lr=0.1, extra_bits=8)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    assert saved["state"][0]["param_dtype"] == torch.bfloat16
    model.half()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    weights = [p.detach().clone() for p in model.parameters()]
    match = "is now torch.float16, but its extra bits extend torch.bfloat16 weights"
    with pytest.raises(TypeError, match=match):
        opt.step()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    with pytest.raises(TypeError, match=match):
        opt.master_weights()
    fresh = ExtraBitsSGD(small_model().half().parameters(), lr=0.1, extra_bits=8)
    with pytest.raises(TypeError, match=match):
        fresh.load_state_dict(saved)
    # a state_dict saved before the dtype was recorded loads, and records it from then on
    for state in saved["state"].values():
        del state["param_dtype"]
    model16 = small_model().bfloat16()
    opt16 = ExtraBitsSGD(model16.parameters(), lr=0.1, extra_bits=8)
    opt16.load_state_dict(saved)
    assert all(opt16.state[p]["param_dtype"] == torch.bfloat16 for p in model16.parameters())


def test_amsgrad_switched_on_later_starts_its_maximum_at_zero():
    """torch.optim.Adam raises KeyError here; the maximum starts from zero, as it would have if
    amsgrad had been on from a zero state."""
    a, b = bf16_param(100), bf16_param(100)
    b.data.copy_(a.data)
    late = ExtraBitsAdam([a], lr=1e-2)
    always = ExtraBitsAdam([b], lr=1e-2, amsgrad=True)
    for step in range(6):
        g = torch.randn(100).bfloat16() * (10.0 if step == 3 else 1.0)
        a.grad, b.grad = g.clone(), g.clone()
        if step == 3:
            late.param_groups[0]["amsgrad"] = True
            always.state[b]["max_exp_avg_sq"].zero_()
        late.step()
        always.step()
        assert torch.equal(a, b)
    assert torch.equal(late.state[a]["max_exp_avg_sq"], always.state[b]["max_exp_avg_sq"])


# ---- step inside backward ----------------------------------------------------------------------

def twin_models(opt_cls, **kw):
    a = small_model()
    b = copy.deepcopy(a)
    torch.manual_seed(0)  # the same stochastic split of the float32 parameters
    opt_a = opt_cls(a.parameters(), **kw)
    torch.manual_seed(0)
    return a, b, opt_a, opt_cls(b.parameters(), **kw)


def loss_of(model, x, y, scale=1.0):
    return torch.nn.functional.cross_entropy(model(x.bfloat16()).float(), y) * scale


def steps_match_inside_backward(a, b, opt_a, opt_b, x, y, steps):
    """Steps model a normally and b (whose optimizer steps inside backward) on the same batches;
    asserts their master weights stay equal and b's gradients are freed as they are used."""
    for step in range(steps):
        torch.manual_seed(step)
        opt_a.zero_grad()
        loss_of(a, x, y).backward()
        opt_a.step()
        torch.manual_seed(step)
        loss_of(b, x, y).backward()
        assert all(p.grad is None for p in b.parameters())  # freed as they were used
        for wa, wb in zip(opt_a.master_weights(), opt_b.master_weights()):
            assert torch.equal(wa, wb), step


@pytest.mark.parametrize("opt_cls,kw", [(ExtraBitsAdamW, dict(lr=1e-2, extra_bits=8, rounding="stochastic")),
                                        (ExtraBitsSGD, dict(lr=0.1, momentum=0.9, extra_bits=16, rounding="nearest"))])
def test_step_in_backward_equals_a_normal_step(opt_cls, kw):
    a, b, opt_a, opt_b = twin_models(opt_cls, **kw)
    handle = lowfp.optim.step_in_backward(opt_b)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    steps_match_inside_backward(a, b, opt_a, opt_b, x, y, steps=5)
    handle.remove()
    loss_of(b, x, y).backward()
    assert all(p.grad is not None for p in b.parameters())  # hooks gone: ordinary gradients


@pytest.mark.filterwarnings("ignore:Using backward.. with create_graph=True:UserWarning")
def test_step_in_backward_under_create_graph_steps_as_a_normal_step():
    # backward(create_graph=True) runs the hooks with grad mode on; their unscale and clip must
    # not record autograd history, and the step must equal a normal one.
    a, b, opt_a, opt_b = twin_models(ExtraBitsSGD, lr=0.1, momentum=0.9, extra_bits=16)
    handle = lowfp.optim.step_in_backward(opt_b, scaler=DuckScaler(8.0), clip_value=0.5)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    for step in range(2):
        opt_a.zero_grad()
        loss_of(a, x, y, scale=8.0).backward()
        for p in a.parameters():
            p.grad = (p.grad * (1 / 8.0)).clamp(-0.5, 0.5)
        opt_a.step()
        seen = []
        hook = b[0].weight.register_post_accumulate_grad_hook(
            lambda p: seen.append(torch.is_grad_enabled()))
        loss_of(b, x, y, scale=8.0).backward(create_graph=True)
        hook.remove()
        assert seen == [True]  # so the hooks did run with grad mode on
        assert all(p.grad is None for p in b.parameters())
        for wa, wb in zip(opt_a.master_weights(), opt_b.master_weights()):
            assert torch.equal(wa, wb), step
    assert handle.skipped == 0
    handle.remove()


class DuckScaler:
    """Only get_scale(): what step_in_backward needs of a scaler."""

    def __init__(self, scale):
        self.scale_value = scale

    def get_scale(self):
        return self.scale_value

    def scale(self, loss):
        return loss * self.scale_value


@pytest.mark.parametrize("scaler_kind", ["duck", "torch"])
def test_step_in_backward_unscales_clips_and_skips(scaler_kind):
    a, b, opt_a, opt_b = twin_models(ExtraBitsSGD, lr=0.1, extra_bits=16)
    # torch's GradScaler keeps its scale in a tensor, read without waiting for the device.
    scaler = DuckScaler(1024.0) if scaler_kind == "duck" else torch.amp.GradScaler("cpu", init_scale=1024.0)
    handle = lowfp.optim.step_in_backward(opt_b, scaler=scaler, clip_value=0.01)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    loss_of(a, x, y).backward()
    for p in a.parameters():
        p.grad = p.grad.float().clamp(-0.01, 0.01).to(p.dtype)
    opt_a.step()
    scaler.scale(loss_of(b, x, y)).backward()
    assert all(torch.equal(wa, wb) for wa, wb in zip(opt_a.master_weights(), opt_b.master_weights()))
    assert handle.skipped == 0 and not handle.found_inf
    before = opt_b.master_weights()
    inf_hook = b[4].bias.register_hook(lambda g: torch.full_like(g, float("inf")))
    scaler.scale(loss_of(b, x, y)).backward()
    after = opt_b.master_weights()
    assert handle.skipped == 1 and handle.found_inf
    assert torch.equal(before[-1], after[-1]) and not torch.equal(before[0], after[0])
    inf_hook.remove()
    scaler.scale(loss_of(b, x, y)).backward()
    assert handle.skipped == 1 and not handle.found_inf  # found_inf is the last pass's
    assert not torch.equal(after[-1], opt_b.master_weights()[-1])


def test_step_in_backward_unscales_in_the_gradient_dtype():
    # A scale below 1 can make an unscaled float16 gradient overflow float16. Unscaled in the
    # gradient's dtype (as GradScaler.unscale_ does), it is found and that parameter skipped,
    # not stepped with an infinite gradient; the other parameter steps as without a scaler.
    p, q = (torch.nn.Parameter(torch.ones(3, dtype=torch.float16)) for _ in range(2))
    opt = ExtraBitsSGD([p, q], lr=0.1, extra_bits=13)
    handle = lowfp.optim.step_in_backward(opt, scaler=DuckScaler(1 / 16))
    big, small = torch.tensor([80000.0, 1.0, 1.0]), torch.tensor([1.0, 2.0, 3.0])
    # Scaled gradients 5000 and small / 16, exact in float16; 5000 * 16 overflows it.
    ((p.float() * big).sum() + (q.float() * small).sum()).mul(1 / 16).backward()
    assert handle.skipped == 1 and handle.found_inf
    r = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    reference = ExtraBitsSGD([r], lr=0.1, extra_bits=13)
    r.grad = small.half()
    reference.step()
    masters = opt.master_weights()
    assert torch.equal(masters[0], torch.ones(3)) and torch.equal(masters[1], reference.master_weights()[0])


@pytest.mark.parametrize("make_scaler", [lambda: torch.amp.GradScaler("cpu", enabled=False),
                                         lambda: lowfp.DynamicLossScaler(enabled=False)])
def test_step_in_backward_with_a_disabled_scaler_steps_as_without(make_scaler):
    # A disabled torch GradScaler has no scale tensor at all: its get_scale() (1.0) is used.
    a, b, opt_a, opt_b = twin_models(ExtraBitsAdamW, lr=1e-2, extra_bits=8)
    handle = lowfp.optim.step_in_backward(opt_b, scaler=make_scaler())
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    steps_match_inside_backward(a, b, opt_a, opt_b, x, y, steps=3)
    assert handle.skipped == 0


@pytest.mark.parametrize("opt_cls, kw", [
    (ExtraBitsSGD, dict(lr=0.1, momentum=0.9, dampening=0.5)),
    (ExtraBitsAdam, dict(lr=1e-2, amsgrad=True)),
    (ExtraBitsAdamW, dict(lr=1e-2)),
])
def test_step_in_backward_skip_leaves_no_state_behind(opt_cls, kw):
    """The device skips a step whose gradient is not finite; the state the host keeps (SGD's
    first momentum step, Adam's step count) is taken back at the end of the pass, so the
    parameter then steps as one that had no gradient in that pass (torch.optim's behaviour)."""
    a, b, opt_a, opt_b = twin_models(opt_cls, extra_bits=16, **kw)
    handle = lowfp.optim.step_in_backward(opt_b)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    for step in range(4):
        opt_a.zero_grad()
        loss_of(a, x, y).backward()
        inf_hook = None
        if step in (0, 2):  # the first step, then a later one
            a[4].bias.grad = None
            inf_hook = b[4].bias.register_hook(lambda g: torch.full_like(g, float("nan")))
        opt_a.step()
        loss_of(b, x, y).backward()
        if inf_hook is not None:
            inf_hook.remove()
        assert handle.found_inf == (step in (0, 2)) and handle.skipped == (1 if step < 2 else 2)
        for wa, wb in zip(opt_a.master_weights(), opt_b.master_weights()):
            assert torch.equal(wa, wb), step
        for pa, pb in zip(a.parameters(), b.parameters()):
            sa, sb = opt_a.state[pa], opt_b.state[pb]
            if "step" in sb:  # a parameter that has not stepped yet has no state in torch
                assert float(sb["step"]) == float(sa.get("step", 0.0)), step
            assert ("momentum_buffer" in sa) == ("momentum_buffer" in sb), step
    handle.remove()


def test_step_in_backward_settles_a_pass_that_raised():
    """Adam's step counts of a pass inside backward are applied when the pass ends. A pass that
    raises never ends: its counts are applied by the next state_dict(), load_state_dict() or
    pass; a load must not receive the counts of steps taken before it; and the next pass starts
    afresh (its own found_inf, its own end)."""
    model = small_model()
    opt = ExtraBitsAdamW(model.parameters(), lr=1e-2, extra_bits=8)
    handle = lowfp.optim.step_in_backward(opt)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    loss_of(model, x, y).backward()
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == [1.0] * 6
    saved = copy.deepcopy(opt.state_dict())

    def boom(g):
        raise RuntimeError("boom")

    def raising_pass(nan_in_last_bias):
        hooks = [model[0].weight.register_hook(boom)]  # after the later layers have stepped
        if nan_in_last_bias:
            hooks.append(model[4].bias.register_hook(lambda g: torch.full_like(g, float("nan"))))
        with pytest.raises(RuntimeError, match="boom"):
            loss_of(model, x, y).backward()
        for h in hooks:
            h.remove()

    raising_pass(nan_in_last_bias=True)
    assert handle.skipped == 1 and handle.found_inf
    steps = [float(v["step"]) for v in opt.state_dict()["state"].values()]
    # model[0].weight did not step, model[4].bias was skipped, the other layers stepped.
    assert steps[0] == 1.0 and steps[2:] == [2.0, 2.0, 2.0, 1.0]

    raising_pass(nan_in_last_bias=False)
    opt.load_state_dict(saved)  # the raised pass's steps are settled first, not onto the load
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == [1.0] * 6
    loss_of(model, x, y).backward()
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == [2.0] * 6
    assert handle.skipped == 1 and not handle.found_inf  # this pass's, not the raised one's
    handle.remove()


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_step_in_backward_through_checkpointed_layers_is_one_pass(use_reentrant):
    """With checkpoint(use_reentrant=True) the checkpointed layer's parameters get their
    gradients in a backward nested inside the pass. It is part of the pass: a skip before it
    (the last layer's, whose gradient comes first) still shows in found_inf and the scaler."""
    from torch.utils.checkpoint import checkpoint

    def model():
        torch.manual_seed(0)
        return torch.nn.ModuleList([torch.nn.Linear(16, 32), torch.nn.Linear(32, 32),
                                    torch.nn.Linear(32, 4)])

    def forward(m, x):
        h = torch.nn.functional.gelu(m[0](x.bfloat16()))
        h = checkpoint(lambda t: torch.nn.functional.gelu(m[1](t)), h, use_reentrant=use_reentrant)
        return m[2](h).float()
    a, b = model(), model()
    opt_a, opt_b = (ExtraBitsSGD(m.parameters(), lr=0.1, momentum=0.9, extra_bits=8) for m in (a, b))
    scaler = lowfp.DynamicLossScaler(init_scale=1024.0)
    handle = lowfp.optim.step_in_backward(opt_b, scaler=scaler)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    for step in range(3):
        opt_a.zero_grad()
        torch.nn.functional.cross_entropy(forward(a, x), y).backward()
        nan_hook = None
        if step == 1:
            a[2].bias.grad = None
            nan_hook = b[2].bias.register_hook(lambda g: torch.full_like(g, float("nan")))
        opt_a.step()
        scaler.scale(torch.nn.functional.cross_entropy(forward(b, x), y)).backward()
        if nan_hook is not None:
            nan_hook.remove()
        assert handle.found_inf == (step == 1) and handle.skipped == (0 if step == 0 else 1)
        scaler.update()
        assert scaler.get_scale() == (1024.0 if step == 0 else 512.0)  # backed off once
        for wa, wb in zip(opt_a.master_weights(), opt_b.master_weights()):
            assert torch.equal(wa, wb), step
    handle.remove()


@pytest.mark.parametrize("opt_cls,kw", [(ExtraBitsSGD, dict(momentum=0.9, rounding="stochastic")),
                                        (ExtraBitsAdamW, dict(rounding="nearest"))])
def test_step_in_backward_under_emulation_equals_a_normal_step(opt_cls, kw):
    """lowfp.emulate rounds each weight gradient before it is accumulated into .grad, so the
    hooks step with the rounded gradient, as a step after backward does."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(32, 8).bfloat16(), torch.randint(0, 4, (32,))
    a, b = model(), model()
    torch.manual_seed(9)  # the same draws for the stochastic conversion to bfloat16
    opt_a = opt_cls(a.parameters(), lr=0.05, **kw)
    torch.manual_seed(9)
    opt_b = opt_cls(b.parameters(), lr=0.05, **kw)

    def loss_fn(out, y):
        return torch.nn.functional.cross_entropy(out.float(), y)
    assignment = lowfp.assign.uniform(lowfp.assign.trace(a, x, loss_fn, y),
                                      lowfp.assign.Candidates(hi=lowfp.fp(6, 6, 0)))
    handle = lowfp.optim.step_in_backward(opt_b)
    with lowfp.emulate(a, assignment), lowfp.emulate(b, assignment) as em_b:
        for step in range(4):
            torch.manual_seed(step)
            loss_a = loss_fn(a(x), y)
            opt_a.zero_grad()
            loss_a.backward()
            opt_a.step()
            torch.manual_seed(step)
            loss_b = loss_fn(b(x), y)
            loss_b.backward()
            assert torch.equal(loss_a, loss_b), step
            for wa, wb in zip(opt_a.master_weights(), opt_b.master_weights()):
                assert torch.equal(wa, wb), step
    assert len(em_b.history.steps) == 4 and all(p.grad is None for p in b.parameters())
    handle.remove()


def test_step_in_backward_of_a_weight_backward_still_reads_raises_as_torchs_recipe():
    """A node that reads w without producing its gradient (here through w.detach()) and runs
    after w's gradient is complete would differentiate with the stepped w: not what a normal
    step gives. Autograd must see the step and raise, as it does for torch's own recipe
    (torch.optim stepped in the post-accumulate-grad hook), not return a silently wrong x.grad."""
    def run(make_hook):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4, 4).bfloat16())
        x = torch.randn(3, 4).bfloat16().requires_grad_()
        handle = make_hook(w)
        late = (x @ w.detach()).square().sum()  # made first: its backward runs after w's
        early = (x.detach() @ w).sum()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (early + late).backward()
        return handle

    def torch_recipe(w):
        opt = torch.optim.SGD([w], lr=0.1)
        return w.register_post_accumulate_grad_hook(lambda p: (opt.step(), opt.zero_grad()) and None)
    run(torch_recipe).remove()  # the control: torch's recipe raises here
    run(lambda w: lowfp.optim.step_in_backward(ExtraBitsSGD([w], lr=0.1))).remove()


def test_step_in_backward_refusals():
    opt = ExtraBitsSGD(small_model().parameters())
    with pytest.raises(ValueError, match="clip_norm"):
        lowfp.optim.step_in_backward(opt, clip_norm=1.0)
    with pytest.raises(ValueError, match="accumulation"):
        lowfp.optim.step_in_backward(opt, accumulation_steps=4)
    with pytest.raises(TypeError, match="ExtraBits"):
        lowfp.optim.step_in_backward(torch.optim.SGD(small_model().parameters(), lr=0.1))
    with pytest.raises(TypeError, match="get_scale"):
        lowfp.optim.step_in_backward(opt, scaler=object())
    handle = lowfp.optim.step_in_backward(opt)
    with pytest.raises(ValueError, match="already steps inside backward"):
        lowfp.optim.step_in_backward(opt, clip_value=1.0)  # each parameter would step twice
    handle.remove()
    with pytest.raises(ValueError, match="clip_value must be a positive number"):
        lowfp.optim.step_in_backward(opt, clip_value=True)
    lowfp.optim.step_in_backward(opt, clip_value=1.0).remove()


def test_group_added_while_stepping_inside_backward_steps_too():
    # A group added after step_in_backward() gets its hooks; without them its parameters would
    # silently never step (step() is not called in that mode).
    kw = dict(lr=0.1, momentum=0.9, extra_bits=8, rounding="stochastic")
    a, b = small_model(), small_model()
    opts = []
    for model, inside in ((a, False), (b, True)):
        torch.manual_seed(0)
        opt = ExtraBitsSGD(list(model[0].parameters()) + list(model[2].parameters()), **kw)
        handle = lowfp.optim.step_in_backward(opt) if inside else None
        torch.manual_seed(1)
        opt.add_param_group({"params": list(model[4].parameters()), "lr": 0.05})
        opts.append((opt, handle))
    (opt_a, _), (opt_b, handle) = opts
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    before = opt_b.master_weights()
    steps_match_inside_backward(a, b, opt_a, opt_b, x, y, steps=3)
    assert not torch.equal(before[-1], opt_b.master_weights()[-1])  # the added group stepped
    handle.remove()
    loss_of(b, x, y).backward()
    assert all(p.grad is not None for p in b.parameters())  # the added group's hooks went too


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_optimizer_pickles_and_deep_copies(how):
    """torch.optim.Optimizer pickles only defaults, state and param_groups; the copy must keep the
    weight counts and each parameter's Philox offset (keyed by the new parameters)."""
    import pickle
    model = small_model()
    opt = ExtraBitsAdamW(model.parameters(), lr=1e-2, extra_bits=8, rounding="stochastic")
    x = torch.randn(32, 16)
    model(x.bfloat16()).float().pow(2).mean().backward()
    opt.step()
    model2, opt2 = (pickle.loads(pickle.dumps((model, opt))) if how == "pickle"
                    else copy.deepcopy((model, opt)))
    assert opt2.weight_stats.as_dict() == opt.weight_stats.as_dict()
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x.bfloat16()).float().pow(2).mean().backward()
        torch.manual_seed(11)
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), opt2.master_weights()))
    assert opt2.weight_stats.as_dict() == opt.weight_stats.as_dict()


# ---- torch.amp.GradScaler ----------------------------------------------------------------------

def amp_twin(opt_cls, fused):
    """opt_cls with GradScaler's path chosen. Unfused: torch.amp.GradScaler unscales the
    gradients itself (GradScaler.unscale_) and skips a step with a non-finite one on the host,
    as for torch.optim's unfused optimizers. Fused (the optimizers' own choice): GradScaler sets
    grad_scale / found_inf and the step unscales and skips."""
    return type(("F" if fused else "Unf") + "used" + opt_cls.__name__, (opt_cls,),
                {"_step_supports_amp_scaling": fused})


def grad_scaler_steps(models_and_opts, scalers, steps, bad_steps, dtype, unscale_first=False):
    """Trains each (model, optimizer) with its scaler on the same batches; at bad_steps the last
    layer's bias gradient is made infinite. Asserts the master weights, optimizer state and
    scales stay equal across the pairs, and that GradScaler's attributes are gone after a step."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
    for step in range(steps):
        for (model, opt), scaler in zip(models_and_opts, scalers):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
            scaler.scale(loss).backward()
            if step in bad_steps:
                model[4].bias.grad[1] = float("inf")
            if unscale_first:  # unscaled once, then clipped, as in torch's AMP recipe
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            torch.manual_seed(step)  # the same stochastic rounding seed for every optimizer
            scaler.step(opt)
            scaler.update()
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        (a, opt_a), sa = models_and_opts[0], scalers[0]
        for (b, opt_b), sb in zip(models_and_opts[1:], scalers[1:]):
            assert sa.get_scale() == sb.get_scale(), step
            for wa, wb in zip(opt_a.master_weights(), opt_b.master_weights()):
                assert torch.equal(wa, wb), step
            for pa, pb in zip(a.parameters(), b.parameters()):
                st_a, st_b = opt_a.state[pa], opt_b.state[pb]
                assert ("momentum_buffer" in st_a) == ("momentum_buffer" in st_b), step
                # A skipped first step leaves Adam's state at step 0 with zero moments (as
                # torch's fused Adam does); an unfused step is never called and leaves none.
                assert float(st_a.get("step", 0)) == float(st_b.get("step", 0)), step
    return scalers[0]


@pytest.mark.parametrize("opt_cls,kw", [
    (ExtraBitsSGD, dict(lr=0.1, momentum=0.9, extra_bits=8, rounding="stochastic")),
    (ExtraBitsAdamW, dict(lr=1e-2, extra_bits=16, amsgrad=True)),
])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_torch_grad_scaler_hands_the_scale_to_the_step(opt_cls, kw, unscale_first):
    # bfloat16, which GradScaler can also unscale itself: the fused path (GradScaler sets
    # grad_scale / found_inf and the step unscales and skips) skips, takes back and scales as
    # its unfused path, the one taken on the CPU, does; with power-of-two scales, bfloat16
    # gradients unscaled in bfloat16 (unfused) or in float32 (fused) are the same numbers. A
    # bad first step checks that SGD's first momentum buffer and Adam's count are taken back.
    assert not opt_cls([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))])._step_supports_amp_scaling
    pairs = []
    for cls in (amp_twin(opt_cls, fused=True), amp_twin(opt_cls, fused=False)):
        model = small_model()
        torch.manual_seed(0)  # the same stochastic split of the float32 parameters
        pairs.append((model, cls(model.parameters(), **kw)))
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2) for _ in pairs]
    scaler = grad_scaler_steps(pairs, scalers, steps=7, bad_steps={0, 3, 4}, dtype=torch.bfloat16,
                               unscale_first=unscale_first)
    assert scaler.get_scale() == 2.0 ** 10 / 8 * 4  # three back-offs, two growths


def test_torch_grad_scaler_with_float16_parameters_unscales_in_float32():
    """float16 + 13 through GradScaler (which refuses to unscale float16 gradients itself): the
    step divides each float16 gradient by the scale in float32, as torch's fused optimizers do,
    so its master is, bit for bit, an fp32 master stepped with those quotients (the weights
    stay in float16's normal range). That includes the quotients below float16's normal range,
    which unscaling in float16 would round or flush to zero (checked to happen here). After the
    step p.grad holds the quotient rounded to float16, as torch's fused kernels leave it."""
    model = small_model()
    ref = RefAdam([p.detach().numpy().copy() for p in model.parameters()], lr=1e-3,
                  decoupled=True, weight_decay=1e-2)
    opt = ExtraBitsAdamW(model.parameters(), lr=1e-3, weight_decay=1e-2, extra_bits=13,
                         param_dtype=torch.float16, rounding="nearest")
    assert opt._step_supports_amp_scaling  # a float16 parameter: the fused path
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=10 ** 6)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g)
    lost_in_float16 = 0
    for step in range(60):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x.half()).float(), y)).backward()
        scaled = [p.grad.float().numpy() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 2.0 ** 10  # no step skipped
        quotients = [q / F32(2.0 ** 10) for q in scaled]
        ref.step(quotients)
        for p, q, gs in zip(model.parameters(), quotients, scaled):
            assert torch.equal(p.grad, torch.from_numpy(q).half()), step
            in_float16 = (torch.from_numpy(gs).half() * torch.tensor(2.0 ** -10).half()).float()
            lost_in_float16 += int((in_float16 != torch.from_numpy(q)).sum())
        for got, want in zip(opt.master_weights(), ref.w):
            assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), step
    assert lost_in_float16 > 0
    with pytest.raises(ValueError, match="FP16"):  # torch's own unscale_ still refuses them
        scaler.unscale_(opt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_grad_scaler_unscales_every_gradient_pattern_in_float32(dtype):
    # Every finite 16-bit gradient pattern, subnormals included, unscaled by a scale that is not
    # a power of two (so the quotient rounds) through GradScaler's fused path (the CPU keeps
    # GradScaler's own path for bfloat16 parameters; a GPU takes this one): the update is that of
    # the float32 quotient g / 3 (SGD, lr 1, from 0: the new master is -(g / 3) split with 4
    # extra bits), and p.grad is left as that quotient rounded to the dtype. A float32 gradient
    # is divided in float32 before the step converts it (converting it scaled could overflow).
    patterns = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    g = patterns[torch.isfinite(patterns.float())]
    three = torch.tensor(3.0)
    for grad in (g, random_float32(g.numel(), seed=5, lo=-30, hi=14)):
        p = torch.nn.Parameter(torch.zeros(g.numel(), dtype=dtype))
        opt = amp_twin(ExtraBitsSGD, fused=True)([p], lr=1.0, extra_bits=4)
        scaler = torch.amp.GradScaler("cpu", init_scale=3.0)
        scaler.scale(torch.ones(()))
        p.grad_dtype = None  # torch 2.13: a gradient of another dtype needs this
        p.grad = grad.clone()
        scaler.step(opt)
        quotient = grad.float() / three
        if grad.dtype != dtype:
            quotient = quotient.to(dtype).float()  # the step converts the unscaled gradient
        want = eb.merge(*eb.split(-quotient, dtype, 4), 4)
        assert torch.equal(opt.master_weights()[0], want)
        assert torch.equal(p.grad, (grad.float() / three).to(grad.dtype))


def test_torch_grad_scaler_with_a_sparse_gradient_raises_before_changing_any():
    p, q = (torch.nn.Parameter(torch.ones(4, 2, dtype=torch.bfloat16)) for _ in range(2))
    opt = amp_twin(ExtraBitsSGD, fused=True)([p, q], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # makes its scale tensor, as scaling the loss does
    p.grad = torch.full((4, 2), 8.0, dtype=torch.bfloat16)
    q.grad = torch.ones(4, 2, dtype=torch.bfloat16).to_sparse()
    with pytest.raises(ValueError, match="dense gradients"):
        scaler.step(opt)
    assert torch.equal(p.grad, torch.full((4, 2), 8.0, dtype=torch.bfloat16))  # as it was
    assert torch.equal(p, torch.ones(4, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize("model", ["mlp", "resnet"])
def test_demo_runs(model):
    import subprocess
    import sys
    from pathlib import Path
    demo = Path(__file__).resolve().parents[1] / "examples" / "extra_bits_demo.py"
    out = subprocess.run([sys.executable, str(demo), "--data", "synthetic", "--epochs", "1",
                          "--model", model], capture_output=True, text=True, check=True).stdout
    assert "pure bfloat16" in out and "fp16 + 13" in out and out.count("\n") >= 8
    assert ("ResNet" in out) == (model == "resnet")
