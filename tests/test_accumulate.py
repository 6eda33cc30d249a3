"""GEMMs with emulated accumulation (docs/design.md §10) against a slow exact reference: each
product exact (or rounded to the product format), each addition's exact sum (Fractions) rounded
once to the accumulator format, in the order the spec fixes, with the spec's Philox words."""

import itertools
import math
import struct
from fractions import Fraction

import pytest
import torch

import lowfp
from lowfp import Accumulate, AccumulateStats
from lowfp.accumulate import DEEPSEEK_V3, HOPPER_FP8, PRESETS
from reference import Spec, code_is_odd, exceeds_max, overflow_result, philox_word, round_exact
from devices import DEVICES, on_cuda, same_bits
from host_programs import run_host_program


def spec_of(fmt: lowfp.Format) -> Spec:
    return Spec(fmt.e, fmt.m, fmt.b, fmt.specials, fmt.subnormals)


def bits(v: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", v))[0]


def floor_log2(x: Fraction) -> int:
    e = x.numerator.bit_length() - x.denominator.bit_length()
    return e if Fraction(2) ** e <= x else e - 1


def aligned_exponent(x: float, emin: int) -> int:
    """The exponent a fused group aligns x by (docs/design.md §10)."""
    return -126 if x == 0 else max(math.frexp(abs(x))[1] - 1, emin)


def round_fraction(x: Fraction, spec: Spec, mode: str, policy: str, word: int, sr_bits: int):
    """(value, event): the nonzero exact x rounded to the format (docs/design.md §3)."""
    a = abs(x)
    qe = max(floor_log2(a), spec.emin) - spec.m
    scaled = a / Fraction(2) ** qe
    k = math.floor(scaled)
    f = scaled - k
    neg = x < 0
    if mode == "nearest":
        up = f > Fraction(1, 2) or (f == Fraction(1, 2) and code_is_odd(k, qe, spec))
    elif mode == "nearest_away":
        up = f >= Fraction(1, 2)
    elif mode == "toward_zero":
        up = False
    elif mode == "up":
        up = f > 0 and not neg
    elif mode == "down":
        up = f > 0 and neg
    else:
        up = (word >> (32 - sr_bits)) < math.floor(f * 2 ** sr_bits)
    if exceeds_max(k + up, qe, spec):
        return overflow_result(float(x), spec, mode, policy), "overflow"
    if k + up == 0:
        return (0.0 if spec.unsigned_zero else math.copysign(0.0, -1.0 if neg else 1.0)), "underflow"
    v = math.ldexp(k + up, qe)
    return (-v if neg else v), None


class Element:
    """The reference sum of one output element: its roundings counted, its words drawn in order."""

    def __init__(self, acc: Accumulate, seed: int, first_word: int, counts: list):
        self.acc, self.seed, self.word, self.counts = acc, seed, first_word, counts
        self.spec = spec_of(acc.fmt)
        self.policy = acc.overflow or acc.fmt.overflow

    def count(self, event):
        self.counts[3] += 1
        if event in ("overflow", "underflow", "nan"):
            self.counts[("overflow", "underflow", "nan").index(event)] += 1

    def rounded(self, x, spec, mode, policy, words=True):
        """x (a float, or an exact Fraction when finite) rounded; specials as round_exact."""
        word = 0
        if words and mode == "stochastic":
            word = philox_word(self.seed, 0, self.word)
            self.word += 1
        if isinstance(x, float):
            if math.isnan(x) or math.isinf(x):
                v, ev = round_exact(x, spec, "nearest" if mode == "stochastic" else mode, policy)
                self.count(ev)
                return v
            if x == 0:
                self.count(None)
                return 0.0 if spec.unsigned_zero else x
            x = Fraction(x)
        v, ev = round_fraction(x, spec, mode, policy, word, self.acc.sr_bits)
        self.count(ev)
        return v

    def add(self, a: float, b: float, spec=None, mode=None, policy=None, words=True):
        spec = spec or self.spec
        mode = mode or self.acc.rounding
        policy = policy or self.policy
        if not (math.isfinite(a) and math.isfinite(b)):
            return self.rounded(a + b, spec, mode, policy, words)
        exact = Fraction(a) + Fraction(b)
        if exact == 0:  # +0, or -0 when both addends are -0
            zero = -0.0 if math.copysign(1, a) < 0 and math.copysign(1, b) < 0 else 0.0
            return self.rounded(zero, spec, mode, policy, words)
        return self.rounded(exact, spec, mode, policy, words)

    def add_counted(self, s, y, **kw):
        t = self.add(s, y, **kw)
        self.counts[4] += int(y != 0 and bits(t) == bits(s))
        return t


def reference_gemm(a: torch.Tensor, b: torch.Tensor, acc: Accumulate, seed: int):
    """(C as float32, counts [overflow, underflow, nan, roundings, swamped])."""
    a64, b64 = a.double().tolist(), b.double().tolist()
    m, k = a.shape
    n = b.shape[1]
    if acc.order == "pairwise":
        per_element = 2 * k - 1 if k else 0
    elif acc.group:
        def groups(n):
            return -(-n // acc.group)
        per_element = groups(k) if acc.order == "sequential" else (
            (k // acc.block) * groups(acc.block) + groups(k % acc.block))
    else:
        per_element = 4 * k if acc.compensated else k
    counts = [0] * 5
    out = torch.empty(m, n, dtype=torch.float32)
    for i in range(m):
        for j in range(n):
            el = Element(acc, seed, (i * n + j) * per_element, counts)

            def product(kk):
                p = a64[i][kk] * b64[kk][j]  # exact
                if acc.product is not None:
                    return el.rounded(p, spec_of(acc.product), "nearest", acc.product.overflow, words=False)
                return p

            def fused(s, k0, k1):  # docs/design.md §10's fused group, from its words
                pairs = [(a64[i][kk], b64[kk][j]) for kk in range(k0, k1)]
                products = [x * y for x, y in pairs]
                if not all(math.isfinite(v) for v in [s] + products):
                    total = s  # (an infinity or a NaN: the IEEE sum)
                    for v in products:
                        total += v
                else:
                    e = max([aligned_exponent(s, -126)] + [aligned_exponent(x, acc.operand_emin) +
                                                           aligned_exponent(y, acc.operand_emin) for x, y in pairs])
                    quantum = Fraction(2) ** (e - acc.align_bits)
                    total = int(Fraction(s) / quantum) + sum(int(Fraction(v) / quantum) for v in products)
                    total = float(total * quantum) if total else 0.0
                t = el.rounded(total, el.spec, acc.rounding, el.policy)
                el.counts[4] += int(any(v != 0 for v in products) and bits(t) == bits(s))
                return t

            def sequential(k0, k1):
                s = c = 0.0
                if acc.group:
                    for g0 in range(k0, k1, acc.group):
                        s = fused(s, g0, min(k1, g0 + acc.group))
                    return s
                for kk in range(k0, k1):
                    q = product(kk)
                    if acc.compensated:
                        y = el.add(q, -c)
                        t = el.add_counted(s, y)
                        c = el.add(el.add(t, -s), -y)
                        s = t
                    else:
                        s = el.add_counted(s, q)
                return s

            def tree(k0, k1):  # post-order; the left subtree a power of two of leaves
                if k1 - k0 == 1:
                    return el.rounded(product(k0), el.spec, acc.rounding, el.policy)
                half = 1 << ((k1 - k0 - 1).bit_length() - 1)
                left = tree(k0, k0 + half)
                right = tree(k0 + half, k1)
                return el.add_counted(left, right)

            if acc.order == "sequential":
                v = sequential(0, k)
            elif acc.order == "pairwise":
                v = tree(0, k) if k else 0.0
            else:
                v = 0.0
                for k0 in range(0, k, acc.block):
                    inner = sequential(k0, min(k, k0 + acc.block))
                    v = el.add_counted(v, inner, spec=spec_of(acc.outer), mode="nearest",
                                       policy=acc.outer.overflow, words=False)
            out[i, j] = v
    return out, counts


def operands(m, k, n, dtype, seed, spread=12):
    """Values of many magnitudes (so that sums swamp), zeros and exact ties of small formats."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-spread, spread, (m, k), generator=g).float())
    b = torch.randn(k, n, generator=g) * torch.exp2(torch.randint(-spread, spread, (k, n), generator=g).float())
    a[0, :3] = torch.tensor([0.0, 1.0, -0.0])[:min(3, k)]
    b[:2, 0] = torch.tensor([0.5, 0.25])[:min(2, k)]
    return a.to(dtype), b.to(dtype)


E5M10 = lowfp.Format(5, 10, 0, specials="ieee")
E8M7 = lowfp.Format(8, 7, 0, specials="ieee")
FORMATS = [lowfp.Format(4, 3, 4), lowfp.Format(5, 2, 0), E5M10, E8M7, lowfp.Format(8, 13, 0, specials="ieee")]
ACCUMULATIONS = [
    dict(order="sequential"),
    dict(order="pairwise"),
    dict(order="blocked", block=4),
    dict(order="sequential", compensated=True),
    dict(order="blocked", block=5, compensated=True),
    dict(order="sequential", product="float8_e4m3fn"),
    dict(order="blocked", block=3, outer=E5M10),
    dict(order="sequential", group=5, align_bits=4),
    dict(order="blocked", block=7, group=3, align_bits=9, operand_emin=-6),
]


def check(a, b, acc, seed=11, device="cpu"):
    want, want_counts = reference_gemm(a, b, acc, seed)
    st = AccumulateStats(device)
    got = lowfp.gemm(a.to(device), b.to(device), acc, seed=seed, stats=st).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (acc, got, want)
    assert st.counts.tolist() == want_counts, (acc, st.counts.tolist(), want_counts)
    return want_counts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("options", ACCUMULATIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_every_order_equals_the_exact_reference(fmt, options, device):
    a, b = operands(3, 37, 2, torch.float32, seed=fmt.m + 7 * len(options))
    check(a, b, Accumulate(fmt, **options), device=device)


@pytest.mark.parametrize("rounding", lowfp.ROUNDING_MODES)
@pytest.mark.parametrize("order", ["sequential", "pairwise", "blocked"])
@pytest.mark.parametrize("device", DEVICES)
def test_every_rounding_mode_equals_the_exact_reference(rounding, order, device):
    a, b = operands(2, 29, 3, torch.float32, seed=3)
    block = 6 if order == "blocked" else None
    counts = check(a, b, Accumulate(lowfp.Format(5, 2, 0), order=order, block=block, rounding=rounding),
                   device=device)
    assert counts[4] > 0  # (swamped additions: the test sees them)


@pytest.mark.parametrize("sr_bits", [1, 7, 32])
@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_with_fewer_random_bits(sr_bits, device):
    a, b = operands(2, 21, 2, torch.float32, seed=4)
    check(a, b, Accumulate(E8M7, rounding="stochastic", sr_bits=sr_bits, compensated=True), device=device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", DEVICES)
def test_16_bit_operands(dtype, device):
    a, b = operands(3, 17, 4, dtype, seed=5, spread=4)
    check(a, b, Accumulate(lowfp.Format(4, 3, 4), order="pairwise", rounding="stochastic"), device=device)


@pytest.mark.parametrize("policy", ["saturate", "inf", "nan"])
@pytest.mark.parametrize("device", DEVICES)
def test_overflow_and_special_values(policy, device):
    a, b = operands(2, 9, 3, torch.float32, seed=6, spread=2)
    a = a * 64
    a[1, 2], b[4, 1] = float("inf"), float("nan")
    counts = check(a, b, Accumulate(lowfp.Format(4, 3, 4), overflow=policy), device=device)
    assert counts[0] > 0 and counts[2] > 0


@pytest.mark.parametrize("rounding", ["nearest", "up", "stochastic"])
@pytest.mark.parametrize("device", DEVICES)
def test_each_sum_is_rounded_once(rounding, device):
    # s = 1 + 2^-13 (odd in fp(8,13)), p = (1 - 2^-46) 2^-14: the exact sum lies 2^-60 below the
    # midpoint 1 + 2^-13 + 2^-14, where float64's own rounding would land (a tie, to even: up).
    a = torch.tensor([[1 + 2.0 ** -13, (1 + 2.0 ** -23) * 2.0 ** -7]])
    b = torch.tensor([[1.0], [(1 - 2.0 ** -23) * 2.0 ** -7]])
    acc = Accumulate(lowfp.Format(8, 13, 0, specials="ieee"), rounding=rounding)
    check(a, b, acc, device=device)
    if rounding == "nearest":
        assert lowfp.gemm(a, b, acc).item() == 1 + 2.0 ** -13


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("order, rounding", [("sequential", "nearest"), ("blocked", "nearest"),
                                             ("sequential", "toward_zero"), ("sequential", "up"),
                                             ("sequential", "down"), ("sequential", "stochastic")])
@pytest.mark.parametrize("device", DEVICES)
def test_sums_at_the_ends_of_the_accumulators_range(fmt, order, rounding, device):
    # Running sums that wander through the binades around 2^emin (subnormal steps, underflow)
    # and up to max (the top binade, overflow), where a rounding takes other steps than in the
    # binades between: one sum a column, columns one by one (a GPU thread's form) and side by side.
    g = torch.Generator().manual_seed(fmt.m)
    k = 40
    a = torch.randn(2, k, generator=g)
    scale = torch.tensor([fmt.min_normal * 2.0 ** e for e in (-3, -1, 0, 1)] + [fmt.max / 4, fmt.max / 2])
    b = torch.rand(k, 6, generator=g) * scale * (0.5 + torch.rand(k, 1, generator=g))
    acc = Accumulate(fmt, order=order, block=6 if order == "blocked" else None, rounding=rounding,
                     overflow="saturate")
    check(a, b, acc, device=device)
    check(a, b.repeat(1, 11), acc, device=device)


def test_the_gpu_tile_schedule_on_cpu_threads_gives_the_cpus_bits_and_counts(tmp_path):
    # cpp/src/cuda/accumulate_tiles.hpp, the CUDA driver's schedule of sums one product at a time
    # (tiles of 32, 8 or 1 columns staged in shared memory, a grid that strides), built for the
    # CPU and run by threads with a barrier for __syncthreads: every order, mode and lane form it
    # takes against the CPU's sums of one column at a time (tests/cpp/, its cases).
    out = run_host_program(tmp_path, "accumulate_tiles_on_threads.cpp", "cpp/src/host/accumulate_call.cpp")
    assert out.strip().endswith("0 of 95 cases differ"), out


@pytest.mark.parametrize("rounding", lowfp.ROUNDING_MODES)
@pytest.mark.parametrize("device", DEVICES)
def test_exact_cancellations_sum_to_the_specs_zero(rounding, device):
    # s + p == 0 exactly is +0 in every mode (-0 only from -0 + -0), rounding down too, where the
    # CPU's sums in the rounding mode (docs/kernels.md) would give -0.
    a = torch.tensor([[1.0, -1.0], [-0.0, -0.0], [0.5, -0.5], [-0.0, 0.0]])
    b = torch.tensor([[1.0, 3.0, -1.0], [1.0, 3.0, -1.0]])
    for order in ("sequential", "pairwise"):
        check(a, b, Accumulate(lowfp.Format(5, 2, 0), rounding=rounding, order=order), device=device)


@pytest.mark.parametrize("rounding", ["toward_zero", "up", "down", "stochastic"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_widest_accumulator_rounds_from_the_exact_sum(rounding, device):
    # 19 mantissa bits and 32 random bits: the most that the sums' 53 bits carry (design §10),
    # so that a sum truncated at 53 bits keeps every bit the rounding reads.
    acc = Accumulate(lowfp.Format(8, 19, 0, specials="ieee"), rounding=rounding, sr_bits=32)
    a, b = operands(3, 40, 70, torch.float32, seed=21, spread=30)
    check(a, b, acc, device=device)


@pytest.mark.parametrize("rounding", ["toward_zero", "up", "down", "stochastic"])
def test_the_callers_rounding_mode_is_restored(rounding):
    # (the CPU sets its threads' floating-point rounding mode for directed and stochastic sums)
    a, b = operands(64, 50, 130, torch.float32, seed=2)
    lowfp.gemm(a, b, Accumulate(lowfp.Format(5, 3, 0), rounding=rounding))
    tiny = 3 * 2.0 ** -54  # (1 ± tiny rounds to 1 ± 2^-52 to nearest, to 1 toward zero)
    assert 1.0 + tiny == 1 + 2.0 ** -52 and 1.0 - tiny == 1 - 2.0 ** -52
    ones = torch.ones(1 << 16, dtype=torch.float64)  # (torch's threads)
    assert torch.equal(ones + tiny, ones + 2.0 ** -52) and torch.equal(ones - tiny, ones - 2.0 ** -52)


@pytest.mark.parametrize("rounding", lowfp.ROUNDING_MODES)
@pytest.mark.parametrize("group,align_bits", [(1, 3), (4, 6), (32, 13)])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_groups_equal_the_exact_reference(rounding, group, align_bits, device):
    a, b = operands(2, 70, 3, torch.float32, seed=group)
    a[1, 5:9] = torch.tensor([1e-40, -3e-39, 0.0, float("inf")])  # (float32 subnormals, an inf)
    check(a, b, Accumulate(E8M7, rounding=rounding, group=group, align_bits=align_bits, operand_emin=-10),
          device=device)


def test_the_presets_model_hopper_and_deepseek_v3():
    # (checked bit for bit against MMA-Sim's reference, microsoft/MMA-Sim's nv_fused_dot_add
    # chained per 32 products, on 5000 sampled E4M3 dot products when they were written; here,
    # against this file's reference of the spec)
    assert PRESETS == {"hopper-fp8": HOPPER_FP8, "deepseek-v3": DEEPSEEK_V3}
    g = torch.Generator().manual_seed(2)
    bits8 = torch.randint(0, 256, (2, 256), generator=g, dtype=torch.int32).to(torch.uint8)
    bits8[(bits8 & 0x7F) == 0x7F] = 0x38  # (no NaN)
    a = bits8.view(torch.float8_e4m3fn).float()
    b = bits8.flip(1).view(torch.float8_e4m3fn).float().t().contiguous()
    for acc in (HOPPER_FP8, DEEPSEEK_V3):
        check(a, b, acc)
    # A K = 4096 sum of positive products: ~14-bit accumulation drifts; promotion every 128 holds
    x, y = torch.rand(2, 4096, generator=g), torch.rand(4096, 2, generator=g)
    exact = x.double() @ y.double()
    err = {name: ((lowfp.gemm(x, y, acc).double() - exact).abs() / exact).max().item()
           for name, acc in PRESETS.items()}
    assert err["hopper-fp8"] > 0.01 > 0.005 > err["deepseek-v3"]


@pytest.mark.parametrize("options", [
    dict(), dict(rounding="stochastic"), dict(rounding="toward_zero"), dict(rounding="down", subnormals=False),
    dict(order="pairwise", rounding="stochastic"), dict(order="blocked", block=6),
    dict(compensated=True, rounding="up"), dict(compensated=True, rounding="stochastic"),
    dict(group=8, align_bits=5, rounding="stochastic"), dict(product="float8_e4m3fn", rounding="up"),
    dict(rounding="up"), dict(rounding="down"), dict(order="pairwise", rounding="down"),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "sequential")
def test_wide_rows_take_the_vector_lanes(options):
    # (the CPU sums the columns of a row side by side, 64 and then 8 at a time, the rest one by
    # one: 146 columns take each width, 8 columns the narrow one only. Stochastic lanes draw four
    # words at a time, from one block when every lane's words start a block (sequential: K = 20
    # words per element; compensated: 80) and from two otherwise (pairwise: 39). Sums below the
    # format's smallest normal, which operands of many magnitudes give, take the general rounding;
    # lanes without any take the fixed drop.)
    options = dict(options)
    subnormals = options.pop("subnormals", True)
    acc = Accumulate(lowfp.Format(5, 3, 0, subnormals=subnormals), **options)
    for n in (146, 8):
        a, b = operands(2, 20, n, torch.float32, seed=14)
        check(a, b, acc)
        strided = b.t().contiguous().t()  # (columns 20 elements apart)
        assert torch.equal(lowfp.gemm(a, strided, acc, seed=3), lowfp.gemm(a, b, acc, seed=3))


def test_gemm_is_differentiable():
    # dA = dC·Bᵀ and dB = Aᵀ·dC, each summed as the forward (nearest: no keys), over broadcast batches
    acc = Accumulate(lowfp.Format(5, 4, 0, specials="ieee"), order="pairwise")
    a0, b0 = operands(5, 24, 7, torch.float32, seed=20, spread=3)
    a = torch.stack([a0, -a0, a0 * 2]).requires_grad_()
    b = b0.clone().requires_grad_()
    g = torch.randn(3, 5, 7)
    c = lowfp.gemm(a, b, acc)
    assert torch.equal(c.detach(), lowfp.gemm(a.detach(), b0, acc))
    c.backward(g)
    assert torch.equal(a.grad, lowfp.gemm(g, b0.t(), acc))
    assert torch.equal(b.grad, lowfp.gemm(a.detach().transpose(-1, -2), g, acc).sum(0))


def test_gemm_under_fake_tensors_and_meta_gives_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    acc = Accumulate(E8M7, rounding="stochastic")
    c = lowfp.gemm(torch.empty(2, 3, 4, device="meta"), torch.empty(4, 5, device="meta"), acc)
    assert c.shape == (2, 3, 5) and c.is_meta and c.dtype == torch.float32
    with FakeTensorMode():
        c = lowfp.gemm(torch.empty(3, 4, dtype=torch.bfloat16), torch.empty(4, 5, dtype=torch.bfloat16), acc)
    assert c.shape == (3, 5) and c.dtype == torch.float32


def test_gemm_is_one_operator_that_torch_checks():
    # schema, fake implementation, autograd registration and AOT dispatch (torch.library.opcheck;
    # stochastic gradients draw new keys each time, so AOT dispatch is compared without them)
    a, b = torch.randn(2, 3, 40), torch.randn(40, 5)
    for acc, utils in ((Accumulate(E8M7), torch.library._OPCHECK_DEFAULT_UTILS),
                       (Accumulate(E8M7, order="blocked", block=16, rounding="stochastic"),
                        ("test_schema", "test_autograd_registration", "test_faketensor"))):
        torch.library.opcheck(torch.ops.lowfp.gemm, (a, b, repr(acc), 7, None, True), test_utils=utils)
        torch.library.opcheck(torch.ops.lowfp.gemm, (a.requires_grad_(), b, repr(acc), 7, None, False),
                              test_utils=utils)
        a = a.detach()


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_gemm_compiles_into_one_graph_and_equals_eager(rounding):
    # torch.compile(fullgraph=True): no graph break; forward, both gradients and the counts are
    # eager's bit for bit, stochastic keys drawn from torch's generator in the same order
    acc = Accumulate(E8M7, order="blocked", block=8, rounding=rounding)

    def forward(a, b, stats):
        c = lowfp.gemm(a, b, acc, stats=stats)
        return c, (c * torch.linspace(-1, 1, c.shape[-1])).sum()

    def run(fn):
        torch.manual_seed(3)
        a = torch.randn(2, 6, 50, requires_grad=True)
        b = torch.randn(50, 7, requires_grad=True)
        stats = AccumulateStats()
        c, loss = fn(a, b, stats)
        loss.backward()
        return c.detach(), a.grad, b.grad, stats.counts

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    want, got = run(forward), run(compiled)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert want[3][3] > 0


def test_an_empty_reduction_sums_to_zero():
    a, b = torch.ones(2, 0), torch.ones(0, 3)
    st = AccumulateStats()
    c = lowfp.gemm(a, b, Accumulate(E8M7), stats=st)
    assert torch.equal(c, torch.zeros(2, 3)) and st.numel == 0


def test_batches_broadcast_and_layouts_do_not_change_bits():
    acc = Accumulate(E8M7, order="blocked", block=8, rounding="stochastic")
    a, b = operands(5, 40, 6, torch.float32, seed=8)
    batch_a = torch.stack([a, a * 2, -a])
    c = lowfp.gemm(batch_a, b, acc, seed=9)
    assert c.shape == (3, 5, 6)
    # element e's words follow its place in the whole (batch, m, n) output
    first = lowfp.gemm(batch_a[:1], b, acc, seed=9)
    assert torch.equal(c[0], first[0])
    # transposed (non-contiguous) operands: the same values, the same bits
    at = a.t().contiguous().t()
    bt = b.t().contiguous().t()
    assert torch.equal(lowfp.gemm(at, bt, acc, seed=9), lowfp.gemm(a, b, acc, seed=9))


def test_threads_do_not_change_bits():
    acc = Accumulate(lowfp.Format(5, 2, 0), rounding="stochastic", compensated=True)
    a, b = operands(64, 96, 48, torch.float32, seed=10)
    before = lowfp.get_num_threads()
    try:
        lowfp.set_num_threads(1)
        one = lowfp.gemm(a, b, acc, seed=1)
        lowfp.set_num_threads(2)
        two = lowfp.gemm(a, b, acc, seed=1)
    finally:
        lowfp.set_num_threads(before)
    assert torch.equal(one, two)


def test_float32_is_torchs_gemm():
    a, b = operands(4, 33, 5, torch.float32, seed=12)
    assert torch.equal(lowfp.gemm(a, b, Accumulate("float32")), a @ b)
    assert torch.equal(lowfp.gemm(a, b), a @ b)


def test_a_short_accumulator_loses_what_promotion_keeps():
    # DeepSeek-V3's observation, in miniature: sums of 4096 products kept in ~14 bits drift, and
    # promoting each block of 128 to float32 brings the error back near the format's own.
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(4, 4096, generator=g), torch.rand(4096, 4, generator=g)
    exact = a.double() @ b.double()
    fmt = lowfp.Format(8, 13, 0, specials="ieee")
    plain = lowfp.gemm(a, b, Accumulate(fmt))
    promoted = lowfp.gemm(a, b, Accumulate(fmt, order="blocked", block=128))
    err = lambda c: ((c.double() - exact).abs() / exact.abs()).max().item()  # noqa: E731
    assert err(plain) > 10 * err(promoted)
    assert err(promoted) < 2 ** -12


def test_arguments_are_checked():
    a, b = torch.ones(2, 3), torch.ones(3, 2)
    with pytest.raises(ValueError, match="block"):
        Accumulate(E8M7, order="blocked")
    with pytest.raises(ValueError, match="block"):
        Accumulate(E8M7, block=4)
    with pytest.raises(ValueError, match="pairwise"):
        Accumulate(E8M7, order="pairwise", compensated=True)
    with pytest.raises(ValueError, match="mantissa"):
        Accumulate(lowfp.Format(8, 23, 0, specials="ieee"))
    with pytest.raises(ValueError, match="float32's range"):
        Accumulate(lowfp.Format(9, 4, 0))
    with pytest.raises(ValueError, match="order"):
        Accumulate(E8M7, order="kahan")
    with pytest.raises(ValueError, match="together"):
        Accumulate(E8M7, group=4)
    with pytest.raises(ValueError, match="fused"):
        Accumulate(E8M7, group=4, align_bits=8, compensated=True)
    with pytest.raises(ValueError, match="group"):
        Accumulate(E8M7, group=65, align_bits=8)
    with pytest.raises(TypeError, match="dtype"):
        lowfp.gemm(a.double(), b.double(), Accumulate(E8M7))
    with pytest.raises(TypeError, match="dtype"):
        lowfp.gemm(a, b.half(), Accumulate(E8M7))
    with pytest.raises(ValueError, match="last dim"):
        lowfp.gemm(a, a, Accumulate(E8M7))
    with pytest.raises(TypeError, match="accumulate"):
        lowfp.gemm(a, b, "fp(5,2,0)")
    with pytest.raises(ValueError, match="dense"):
        lowfp.gemm(a.to_sparse(), b, Accumulate(E8M7))
    with pytest.raises(TypeError, match="AccumulateStats"):
        lowfp.gemm(a, b, Accumulate(E8M7), stats=lowfp.Stats())


def test_a_gemm_recipe_accumulates_the_forward_and_both_backward_gemms():
    # lowfp.scaled.emulate_gemms with GemmRecipe(accumulate=...): the linear layer's three GEMMs
    # are lowfp.gemm's (the bias added after, in float32), and a matmul's too.
    from lowfp.scaled import GemmRecipe, emulate_gemms
    acc = Accumulate(lowfp.Format(5, 4, 0, specials="ieee"), order="blocked", block=16)
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 8)
    x = torch.randn(5, 64, requires_grad=True)
    g = torch.randn(5, 8)
    with emulate_gemms(layer, GemmRecipe(None, accumulate=acc)):
        y = layer(x)
    y.backward(g)
    w, b = layer.weight.detach(), layer.bias.detach()
    assert torch.equal(y.detach(), lowfp.gemm(x.detach(), w.t(), acc) + b)
    assert torch.equal(x.grad, lowfp.gemm(g, w, acc))
    assert torch.equal(layer.weight.grad, lowfp.gemm(g.t(), x.detach(), acc))
    assert torch.equal(layer.bias.grad, g.sum(0))
    assert not torch.equal(y.detach(), x.detach() @ w.t() + b)  # (the short accumulator shows)

    class Product(torch.nn.Module):
        def forward(self, p, q):
            return torch.matmul(p, q)

    p, q = torch.randn(3, 4, 40), torch.randn(40, 6)
    with emulate_gemms(Product(), GemmRecipe(None, accumulate=acc)) as em:
        out = em.model(p, q)
    assert torch.equal(out, lowfp.gemm(p, q, acc))


def test_a_gemm_recipe_accumulates_each_gemm_as_its_entry_says():
    # {"fprop", "dgrad", "wgrad"} (TransformerEngine's names): each GEMM its own Accumulate, an
    # absent one torch's; a matmul's "wgrad" is its second operand's gradient
    from lowfp.scaled import GemmRecipe, emulate_gemms
    short = Accumulate(lowfp.Format(5, 2, 0, specials="ieee"))
    blocked = Accumulate(lowfp.Format(5, 4, 0, specials="ieee"), order="blocked", block=16)
    recipe = GemmRecipe(accumulate={"wgrad": short, "dgrad": blocked})
    assert recipe.accumulate == (("dgrad", blocked), ("wgrad", short))
    assert recipe.accumulation("fprop") is None and recipe.accumulation("wgrad") == short
    assert hash(recipe) == hash(GemmRecipe(accumulate=recipe.accumulate))  # (replace() round trip)
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 8, bias=False)
    x = torch.randn(40, 64, requires_grad=True)
    g = torch.randn(40, 8)
    with emulate_gemms(layer, recipe):
        y = layer(x)
    y.backward(g)
    w = layer.weight.detach()
    assert torch.equal(y.detach(), x.detach() @ w.t())
    assert torch.equal(x.grad, lowfp.gemm(g, w, blocked))
    assert torch.equal(layer.weight.grad, lowfp.gemm(g.t(), x.detach(), short))
    assert not torch.equal(layer.weight.grad, g.t() @ x.detach())

    class Product(torch.nn.Module):
        def forward(self, p, q):
            return torch.matmul(p, q)

    p = torch.randn(3, 4, 40, requires_grad=True)
    q = torch.randn(3, 40, 6, requires_grad=True)
    gout = torch.randn(3, 4, 6)
    with emulate_gemms(Product(), GemmRecipe(accumulate={"wgrad": short})) as em:
        out = em.model(p, q)
    out.backward(gout)
    assert torch.equal(out.detach(), p.detach() @ q.detach())
    assert torch.equal(p.grad, gout @ q.detach().transpose(-1, -2))
    assert torch.equal(q.grad, lowfp.gemm(p.detach().transpose(-1, -2), gout, short))


def test_a_gemm_recipe_with_accumulation_compiles_into_one_graph():
    # emulate_gemms with operand formats and per-GEMM accumulation under torch.compile: one graph,
    # no break, and eager's output and gradients bit for bit
    from lowfp.scaled import GemmRecipe, emulate_gemms
    acc = Accumulate(E8M7, order="blocked", block=8)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    emulate_gemms(model, GemmRecipe("mxfp8_e4m3", accumulate={"fprop": acc, "wgrad": acc})).install()
    x = torch.randn(8, 16)

    def run(forward):
        model.zero_grad()
        y = forward(x)
        y.sum().backward()
        return [y.detach()] + [p.grad for p in model.parameters()]

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    got = run(torch.compile(model, backend="aot_eager"))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    for g, w in zip(got, run(model)):
        assert torch.equal(g, w)


def test_a_gemm_recipe_takes_only_an_accumulate():
    from lowfp.scaled import GemmRecipe
    with pytest.raises(TypeError, match="accumulate"):
        GemmRecipe(None, accumulate="fp(5,2,0)")
    with pytest.raises(TypeError, match=r"accumulate\['wgrad'\] must be a lowfp.Accumulate"):
        GemmRecipe(None, accumulate={"wgrad": "fp(5,2,0)"})
    with pytest.raises(ValueError, match=r"keys must be among \('fprop', 'dgrad', 'wgrad'\), got \['forward'\]"):
        GemmRecipe(None, accumulate={"forward": Accumulate("bfloat16")})


def test_parse_reads_presets_and_what_repr_writes():
    options = [dict(), dict(order="blocked", block=64, outer="bfloat16", rounding="stochastic", sr_bits=8),
               dict(order="pairwise", product="bfloat16"), dict(compensated=True, overflow="inf")]
    for acc in [Accumulate("float16", **o) for o in options] + list(PRESETS.values()) + [Accumulate("float32")]:
        assert Accumulate.parse(repr(acc)) == acc
    assert Accumulate.parse(" hopper-fp8 ") is HOPPER_FP8
    with pytest.raises(ValueError, match="cannot parse accumulation 'hopper'"):
        Accumulate.parse("hopper")
    with pytest.raises(ValueError, match="arguments must be literals"):
        Accumulate.parse("Accumulate(fmt)")
    with pytest.raises(TypeError, match="accumulation string expected"):
        Accumulate.parse(3)


def _conv_reference(x, w, stride, pad, dilation, groups, acc, dy=None):
    """The convolution's forward, weight gradient (of dy, random unless given) and input gradient
    with each output element's products listed by loops in the order design §10 gives, each list
    summed by a 1 × K · K × 1 lowfp.gemm (checked against the exact reference above)."""
    n, c, *size = x.shape
    o, cg, *kernel = w.shape
    og = o // groups
    xp = torch.nn.functional.pad(x, [p for p in reversed(pad) for _ in range(2)])
    out = [(s + 2 * p - d * (k - 1) - 1) // st + 1 for s, p, d, k, st in zip(size, pad, dilation, kernel, stride)]
    positions = list(itertools.product(*[range(m) for m in out]))
    offsets = list(itertools.product(*[range(k) for k in kernel]))

    def tap(pos, off):  # the padded input index a kernel offset reads at an output position
        return tuple(p * st + f * d for p, f, st, d in zip(pos, off, stride, dilation))

    def dot(us, vs):
        return lowfp.gemm(torch.stack(us).view(1, -1), torch.stack(vs).view(-1, 1), acc)[0, 0]

    y = torch.zeros(n, o, *out)
    dw = torch.zeros_like(w)
    if dy is None:
        dy = torch.randn(n, o, *out, generator=torch.Generator().manual_seed(9))
    for b in range(n):
        for oc in range(o):
            g = oc // og
            for pos in positions:
                us = [w[(oc, ci) + tuple(off)] for ci in range(cg) for off in offsets]
                vs = [xp[(b, g * cg + ci) + tuple(tap(pos, off))] for ci in range(cg) for off in offsets]
                y[(b, oc) + tuple(pos)] = dot(us, vs)
    for oc in range(o):
        g = oc // og
        for ci in range(cg):
            for off in offsets:
                us = [dy[(b, oc) + tuple(pos)] for b in range(n) for pos in positions]
                vs = [xp[(b, g * cg + ci) + tuple(tap(pos, off))] for b in range(n) for pos in positions]
                dw[(oc, ci) + tuple(off)] = dot(us, vs)
    dxp = torch.zeros_like(xp)
    for b in range(n):
        for g in range(groups):
            for pos in positions:  # col2im: positions, then the kernel's offsets, in float32
                for ci in range(cg):
                    for off in offsets:
                        us = [dy[(b, g * og + j) + tuple(pos)] for j in range(og)]
                        vs = [w[(g * og + j, ci) + tuple(off)] for j in range(og)]
                        dxp[(b, g * cg + ci) + tuple(tap(pos, off))] += dot(us, vs)
    dx = dxp[(slice(None), slice(None)) + tuple(slice(p, p + s) for p, s in zip(pad, size))]
    return y, dy, dw, dx


@pytest.mark.parametrize("shape,kernel,stride,pad,dilation,groups", [
    ((2, 4, 6, 5), (3, 2), (2, 1), (1, 0), (1, 2), 2),
    ((1, 2, 9), (3,), (2,), (2,), (2,), 1),
    ((1, 2, 3, 4, 3), (2, 2, 2), (1, 1, 1), (0, 1, 0), (1, 1, 1), 1),
], ids=["conv2d", "conv1d", "conv3d"])
def test_a_gemm_recipe_accumulates_convolutions_over_their_windows(shape, kernel, stride, pad, dilation, groups):
    # forward, weight gradient and input gradient against loops over each output element's
    # products (stride, padding, dilation, groups, 1-3 spatial dims)
    from lowfp.scaled import GemmRecipe, emulate_gemms
    acc = Accumulate(lowfp.Format(5, 3, 0, specials="ieee"), order="blocked", block=5)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    conv = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)[len(kernel) - 1](
        shape[1], 4, kernel, stride=stride, padding=pad, dilation=dilation, groups=groups, bias=True)
    with emulate_gemms(conv, GemmRecipe(accumulate=acc)):
        y = conv(x)
    w, b = conv.weight.detach(), conv.bias.detach()
    want_y, dy, want_dw, want_dx = _conv_reference(x.detach(), w, stride, pad, dilation, groups, acc)
    y.backward(dy)
    assert torch.equal(y.detach(), want_y + b.view(-1, *[1] * len(kernel)))
    assert torch.equal(conv.weight.grad, want_dw)
    assert torch.equal(x.grad, want_dx)
    plain = torch.nn.functional.conv2d if len(kernel) == 2 else None
    if plain is not None:  # (the short accumulator shows)
        assert not torch.equal(y.detach(), plain(x.detach(), w, b, stride, pad, dilation, groups))


@pytest.mark.parametrize("shape,kernel,stride,pad,out_pad,dilation,groups", [
    ((2, 4, 3, 4), (3, 2), (2, 1), (1, 0), (1, 0), (1, 2), 2),
    ((1, 2, 5), (3,), (2,), (1,), (0,), (1,), 1),
], ids=["conv_transpose2d", "conv_transpose1d"])
def test_transposed_convolutions_accumulate_as_the_convolution_they_transpose(shape, kernel, stride, pad,
                                                                              out_pad, dilation, groups):
    # A transposed convolution's forward is the input gradient of the convolution with its
    # weight, its input gradient that convolution's forward, its weight gradient that
    # convolution's with X and dY in each other's place (design §10): the same loops
    from lowfp.scaled import GemmRecipe, emulate_gemms
    acc = Accumulate(lowfp.Format(5, 3, 0, specials="ieee"), order="blocked", block=5)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    layer = (torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d)[len(kernel) - 1](
        shape[1], 4, kernel, stride=stride, padding=pad, output_padding=out_pad, groups=groups,
        dilation=dilation, bias=True)
    with emulate_gemms(layer, GemmRecipe(accumulate=acc)):
        y = layer(x)
    w, b = layer.weight.detach(), layer.bias.detach()
    assert y.shape == layer(x).shape
    gy = torch.randn(y.shape, generator=g)
    # the convolution on y's shape: its input gradient of dy = x is the transposed forward
    want_dx, _, want_dw, want_y = _conv_reference(gy, w, stride, pad, dilation, groups, acc, dy=x.detach())
    y.backward(gy)
    assert torch.equal(y.detach(), want_y + b.view(-1, *[1] * len(kernel)))
    assert torch.equal(x.grad, want_dx)
    assert torch.equal(layer.weight.grad, want_dw)
    assert not torch.equal(y.detach(), layer(x).detach())  # (the short accumulator shows)
    odd = torch.nn.ConvTranspose1d(2, 2, 3, stride=1, output_padding=1, dilation=2)
    with pytest.raises(ValueError, match="output_padding smaller than stride"):
        with emulate_gemms(odd, GemmRecipe(accumulate=acc)):
            odd(torch.randn(1, 2, 5))


# The lane form of each kind of request (accumulate.hpp's LaneForm; both devices take the same),
# so that the GPU test below runs each form and each direction of the in-mode form.
_FORMS = [
    (dict(), "by_addition"), (dict(order="blocked", block=128), "by_addition"),
    (dict(rounding="stochastic"), "in_mode"), (dict(order="pairwise", rounding="stochastic"), "in_mode"),
    (dict(rounding="toward_zero"), "in_mode"), (dict(rounding="up"), "in_mode"),
    (dict(rounding="down", order="pairwise"), "in_mode"),
    (dict(rounding="toward_zero", product="float8_e4m3fn"), "bits"),
    (dict(compensated=True, rounding="stochastic"), "bits"), (dict(order="blocked", block=128, rounding="up"), "bits"),
    (dict(rounding="nearest_away"), "bits"),
    # fused groups: the presets' (tiles on a GPU), and a group that does not divide the GPU's
    # chunks (one element per thread there)
    (dict(rounding="toward_zero", group=32, align_bits=13, operand_emin=-6), "bits"),
    (dict(order="blocked", block=128, rounding="toward_zero", group=32, align_bits=13, operand_emin=-6), "bits"),
    (dict(group=5, align_bits=9), "by_addition"),
]


@pytest.mark.parametrize("options, form", _FORMS)
def test_each_kind_of_accumulation_takes_its_lane_form(options, form):
    from lowfp import _C
    from lowfp.accumulate import _prepared
    acc = lowfp.Accumulate(lowfp.Format(5, 6, 0, specials="ieee"), **options)
    assert _prepared(_C, acc).form == form


# On a GPU (tests/devices.py): the CPU's bits, counts and steps.

@on_cuda
@pytest.mark.parametrize("options, form", _FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [40, 9, 1])
def test_accumulation_gives_the_cpus_bits_and_counts(options, form, dtype, n):
    # (docs/design.md §10: one header's arithmetic on both; the GPU sums in tiles of 32, 8 or 1
    # columns (n), or one element per thread for the other orders)
    from lowfp.accumulate import _prepared
    acc = lowfp.Accumulate(lowfp.Format(5, 6, 0, specials="ieee"), **options)
    assert _prepared(lowfp.backends._C_cuda, acc).form == form  # (the CUDA module's request)
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(3, 17, 300, generator=g) * 8).to(dtype)
    b = (torch.randn(300, n, generator=g) * 8).to(dtype)
    a[0, 0, :3] = torch.tensor([float("inf"), 0.0, float("nan")])
    st_cpu, st_gpu = lowfp.AccumulateStats(), lowfp.AccumulateStats("cuda")
    cpu = lowfp.gemm(a, b, acc, seed=5, stats=st_cpu)
    gpu = lowfp.gemm(a.cuda(), b.t().contiguous().t().cuda(), acc, seed=5, stats=st_gpu)
    assert same_bits(cpu, gpu.cpu())
    assert torch.equal(st_cpu.counts, st_gpu.counts.cpu())
    # (a call that counts nothing takes kernels without the counts: the same bits)
    assert same_bits(cpu, lowfp.gemm(a.cuda(), b.cuda(), acc, seed=5).cpu())
