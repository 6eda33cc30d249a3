"""lowfp's rounding operators inside torch.compile and torch.export: no graph break
(fullgraph=True), results bit-identical to eager code (stochastic rounding with seed=None
included), fake and meta tensors give the results' shapes and dtypes, and torch.library's own
operator checks pass."""

import pathlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import lowfp
from devices import on_cuda
from lowfp.scaled import Scaled

F434 = lowfp.fp(4, 3, 4)
S2 = lowfp.S2FP8("float8_e4m3fn", log_max=8.0)


def _rounds(x, stats):
    """Every public rounding, each precision kind and both seed kinds."""
    a = lowfp.quantize(x, "fp(4,3,4)", "stochastic")                      # string, drawn seed
    b = lowfp.quantize(x * 3, F434, "stochastic", stats=stats, sr_bits=7)  # Format, counted
    c = lowfp.quantize(x, "fp(5,2,0)", "stochastic", seed=2**64 - 3, offset=2**63 + 5)
    d = lowfp.quantize(x, "float8_e4m3fn", "toward_zero", out_dtype=torch.bfloat16)
    e, st = lowfp.s2fp8_quantize(x, rounding="stochastic")
    f = lowfp.quantize(x, S2)
    g = x.clone()
    lowfp.quantize_(g, F434, "up", stats=stats)
    h = torch.empty_like(x)
    lowfp.quantize(x, "s2fp8", out=h)
    return a, b, c, d.float(), e, f, g, h, st.params, st.sums


def test_compiled_roundings_equal_eager_bit_for_bit():
    x = torch.randn(4, 257, dtype=torch.float32) * 40
    eager_stats, compiled_stats = lowfp.Stats(), lowfp.Stats()
    torch.manual_seed(7)
    eager = _rounds(x, eager_stats)
    compiled = torch.compile(_rounds, fullgraph=True, backend="inductor")
    torch.manual_seed(7)
    got = compiled(x, compiled_stats)
    for i, (want, have) in enumerate(zip(eager, got)):
        assert torch.equal(want, have), i
    assert torch.equal(eager_stats.counts, compiled_stats.counts)
    assert eager_stats.overflow > 0
    # The drawn seeds follow the default generator: another seed, other results.
    torch.manual_seed(8)
    assert not torch.equal(compiled(x, compiled_stats)[0], eager[0])


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        h = lowfp.quantize(self.fc1(x), F434, "stochastic", grad_fmt="fp(5,2,0)",
                           grad_rounding="stochastic")
        h = lowfp.quantize(h.relu(), "s2fp8", grad_fmt=F434)
        h, _ = lowfp.s2fp8_quantize(h, truncate_grad=True)
        return self.fc2(h)


def _step(model, x):
    torch.manual_seed(3)
    model.zero_grad()
    out = model(x)
    out.backward(torch.ones_like(out))
    return [out.detach()] + [p.grad.clone() for p in model.parameters()]


def test_compiled_training_step_equals_eager_with_rounded_gradients():
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(8, 16)
    eager = _step(net, x)
    compiled = _step(torch.compile(net, fullgraph=True), x)
    for want, have in zip(eager, compiled):
        assert torch.equal(want, have)


@pytest.mark.parametrize("fmt,op", [("fp(4,3,4)", "quantize"), ("mxfp8_e4m3", "scaled_quantize")])
def test_compiled_graphs_call_lowfps_kernel_without_the_autograd_formula(monkeypatch, fmt, op):
    """Where Inductor keeps lowfp's kernel, its graphs call the kernel on buffers of the graph
    (the lowerings of lowfp::quantize_in_graph and lowfp::scaled_quantize_in_graph: no Python
    autograd kernel to pass through on every call), forward and backward, with the results and
    gradients of eager code."""
    from torch._inductor.utils import run_and_get_code
    monkeypatch.setenv("LOWFP_INDUCTOR_FUSION", "0")
    x = torch.randn(64, 32)
    grad_fmt = {"grad_fmt": "fp(5,2,15)"} if op == "quantize" else {}

    def forward(t):
        return lowfp.quantize(t * 3, fmt, **grad_fmt)

    def step(f):
        t = x.clone().requires_grad_()
        y = f(t)
        (y * torch.arange(32.0)).sum().backward()
        return y.detach(), t.grad

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, backend="inductor")
    with torch._inductor.config.patch(force_disable_caches=True):
        (y, grad), code = run_and_get_code(step, compiled)
    code = "\n".join(code)
    want_y, want_grad = step(forward)
    assert torch.equal(y, want_y) and torch.equal(grad, want_grad)
    # the value, and for a plain format its rounded gradient
    if op == "quantize":
        assert len(_rounding_operands(code)) == 2
    else:
        assert code.count("lowfp_scaled_round_in_graph(") == 1
    assert f"torch.ops.lowfp.{op}.default" not in code
    assert f"{op}_in_graph.default(" not in code


_ROUNDING_CALLS = ("torch.ops.lowfp.quantize_into.default(", "lowfp_round_in_graph(")


def _rounding_operands(code: str):
    """The first two arguments (x, out) of each rounding call in Inductor's generated code
    (lowfp::quantize_into, or lowfp._ops.round_in_graph where the lowering calls it directly)."""
    calls = []
    for line in code.splitlines():
        rest = next((line.partition(c)[2] for c in _ROUNDING_CALLS if c in line), None)
        if rest is None or "import" in line:
            continue
        depth, args, current = 0, [], ""
        for ch in rest:
            if ch == "," and depth == 0:
                args.append(current.strip())
                current = ""
                if len(args) == 2:
                    break
                continue
            depth += (ch == "(") - (ch == ")")
            current += ch
        calls.append(tuple(args))
    return calls


_W = torch.randn(32, 32)
_ROUNDED_WHERE = {  # the rounding of f(t, stats), and whether it may overwrite its input
    "a GEMM's result, read by nothing else": (
        lambda t, st: lowfp.quantize(t @ _W, F434, stats=st) * 2, True),
    "through a view": (
        lambda t, st: lowfp.quantize((t @ _W).view(4, 16, 32), F434, stats=st) * 2, True),
    "Inductor's kernel's result": (
        lambda t, st: lowfp.quantize(t * 300, "float8_e4m3fn", stats=st).relu(), True),
    "read again after": (
        lambda t, st: (lambda a: lowfp.quantize(a, F434, stats=st) + a)(t @ _W), False),
    "its view read again after": (
        lambda t, st: (lambda a: lowfp.quantize(a.view(2, 32, 32), F434, stats=st).sum() + a)(t @ _W),
        False),
    "a graph input": (lambda t, st: lowfp.quantize(t, F434, stats=st) * 2, False),
    "into another dtype": (
        lambda t, st: lowfp.quantize(t @ _W, F434, out_dtype=torch.bfloat16, stats=st).float(), False),
    "a part of it": (lambda t, st: lowfp.quantize((t @ _W)[:, :16], F434, stats=st) * 2, False),
}


@pytest.mark.parametrize("case", list(_ROUNDED_WHERE))
def test_compiled_rounding_overwrites_its_input_only_where_nothing_else_reads_it(monkeypatch, case):
    """lowfp::quantize_in_graph's lowering rounds into the input's own buffer where the graph's
    operator that made it is read by nothing else (directly or through views) and the result
    takes its dtype and layout; elsewhere into a new buffer. Either way eager's bits and counts."""
    from torch._inductor.utils import run_and_get_code
    monkeypatch.setenv("LOWFP_INDUCTOR_FUSION", "0")
    f, in_place = _ROUNDED_WHERE[case]
    x = torch.randn(64, 32) * 3
    want_stats, stats = lowfp.Stats(), lowfp.Stats()
    want = f(x, want_stats)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        got, code = run_and_get_code(torch.compile(f, fullgraph=True), x, stats)
    assert torch.equal(got, want) and torch.equal(stats.counts, want_stats.counts)
    assert stats.numel > 0
    (operands,) = _rounding_operands("\n".join(code))
    assert (operands[0] == operands[1]) == in_place, operands


def _compiled_code_as_eager(f, stats_type) -> str:
    """Inductor's generated code for f(x, stats) on a 64 × 32 tensor, checked to give eager's
    results, counts and draws from torch's generator (each run from the same manual seed)."""
    from torch._inductor.utils import run_and_get_code
    x = torch.randn(64, 32) * 3
    want_stats, stats = stats_type(), stats_type()
    torch.manual_seed(1)
    want = f(x, want_stats)
    torch._dynamo.reset()
    torch.manual_seed(1)
    with torch._inductor.config.patch(force_disable_caches=True):
        got, code = run_and_get_code(torch.compile(f, fullgraph=True), x, stats)
    assert torch.equal(got, want) and torch.equal(stats.counts, want_stats.counts)
    after_compiled = torch.rand(3)
    torch.manual_seed(1)
    f(x, stats_type())
    assert torch.equal(torch.rand(3), after_compiled)  # the same draws from the generator
    return "\n".join(code)


_CALLED_AS = {  # a rounding of f(t, stats), and whether the graph calls round_in_graph directly
    "nearest": (lambda t, st: lowfp.quantize(t @ _W, F434, stats=st) * 2, True),
    "stochastic, its seed given": (
        lambda t, st: lowfp.quantize(t @ _W, F434, "stochastic", seed=7, offset=3, stats=st) * 2, True),
    "stochastic, its seed drawn": (
        lambda t, st: lowfp.quantize(t @ _W, F434, "stochastic", stats=st) * 2, True),
    "a dense transposed input": (lambda t, st: lowfp.quantize(t.t(), F434, "up", stats=st) * 2, True),
    "stochastic, a transposed input": (
        lambda t, st: lowfp.quantize(t.t(), F434, "stochastic", seed=5, stats=st) * 2, False),
    "an input with gaps": (lambda t, st: lowfp.quantize(t[:, ::2], F434, stats=st) * 2, False),
}


@pytest.mark.parametrize("case", list(_CALLED_AS))
def test_compiled_rounding_calls_the_prepared_request_where_its_layouts_allow(monkeypatch, case):
    """The lowering calls lowfp._ops.round_in_graph (the prepared request, no dispatcher) where a
    CPU rounding's buffers share one dense layout (contiguous for stochastic rounding); elsewhere
    lowfp::quantize_into. Eager's bits, counts and generator draws either way."""
    monkeypatch.setenv("LOWFP_INDUCTOR_FUSION", "0")
    f, direct = _CALLED_AS[case]
    code = _compiled_code_as_eager(f, lowfp.Stats)
    assert code.count("lowfp_round_in_graph(") == (1 if direct else 0)
    assert ("torch.ops.lowfp.quantize_into.default(" in code) != direct


_BLOCKS_ALONG_0 = Scaled("float8_e4m3fn", block=4, axis=0)
_SCALED_CALLED_AS = {  # a scaled rounding of f(t, stats): called directly, and into its input
    "mxfp8 of a GEMM's result": (lambda t, st: lowfp.quantize(t @ _W, "mxfp8_e4m3", stats=st) * 2,
                                 True, True),
    "nvfp4 stochastic, its seed drawn": (
        lambda t, st: lowfp.quantize(t @ _W, "nvfp4", "stochastic", stats=st) * 2, True, True),
    "nvfp4 stochastic, its seed given": (
        lambda t, st: lowfp.quantize(t @ _W, "nvfp4", "stochastic", seed=9, offset=5, stats=st) * 2,
        True, True),
    "a scale per row": (
        lambda t, st: lowfp.quantize(t * 3, "fp8_e4m3_rowwise", "up", stats=st).relu(), True, True),
    "a scale per tensor": (
        lambda t, st: lowfp.quantize(t @ _W, Scaled("float8_e5m2", axis=None), stats=st) * 2, True, True),
    "2-D blocks": (
        lambda t, st: lowfp.quantize(t @ _W, "fp8_e4m3_block128x128", stats=st) * 2, True, True),
    "blocks along axis 0, read where they lie": (
        lambda t, st: lowfp.quantize(t @ _W, _BLOCKS_ALONG_0, "stochastic", seed=3, stats=st) * 2,
        True, True),
    "a graph input": (lambda t, st: lowfp.quantize(t, "mxfp8_e4m3", stats=st) * 2, True, False),
    "read again after": (
        lambda t, st: (lambda a: lowfp.quantize(a, "mxfp4_e2m1", stats=st) + a)(t @ _W), True, False),
    "a transposed input": (lambda t, st: lowfp.quantize(t.t(), "mxfp8_e4m3", stats=st) * 2, False, False),
    "its parts": (lambda t, st: lowfp.scaled.encode(t @ _W, "mxfp8_e4m3").scales * 2, False, False),
}


@pytest.mark.parametrize("case", list(_SCALED_CALLED_AS))
def test_compiled_scaled_rounding_calls_the_prepared_request_on_the_graphs_buffers(monkeypatch, case):
    """lowfp::scaled_quantize_in_graph's lowering on the CPU: the graph calls
    lowfp.scaled.quantize.round_in_graph (the prepared request, no dispatcher) on buffers it
    allocates, writing into the input itself where nothing else reads it, wherever the kernel
    reads a contiguous input where it lies and no q is asked for; elsewhere the functional
    operator. Eager's values, scales, counts and generator draws either way."""
    monkeypatch.setenv("LOWFP_INDUCTOR_FUSION", "0")
    f, direct, in_place = _SCALED_CALLED_AS[case]
    code = _compiled_code_as_eager(f, lowfp.scaled.ScaledStats)
    calls = [line for line in code.splitlines()
             if "lowfp_scaled_round_in_graph(" in line and "import" not in line]
    assert len(calls) == (1 if direct else 0), calls
    assert ("torch.ops.lowfp.scaled_quantize_in_graph.default(" in code) != direct
    if direct:
        x_arg, out_arg = calls[0].partition("(")[2].split(", ")[:2]
        assert (x_arg == out_arg) == in_place, calls[0]


def test_quantize_into_operator_refuses_an_out_of_another_shape():
    x = torch.randn(4, 6)[:, ::2]
    with pytest.raises(ValueError, match="out must have x's shape"):
        torch.ops.lowfp.quantize_into(x, torch.empty(3), "fp(4,3,4)", "nearest", 32, 0, None, 0, None)


def test_compiled_rounding_of_dynamic_shapes_keeps_the_functional_operator(monkeypatch):
    """Shapes that are not concrete: the functional lowfp::quantize_in_graph, eager's bits."""
    from torch._inductor.utils import run_and_get_code
    monkeypatch.setenv("LOWFP_INDUCTOR_FUSION", "0")
    f = torch.compile(lambda t: lowfp.quantize(t @ _W, F434) * 2, fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    codes = []
    for rows in (5, 9):
        x = torch.randn(rows, 32)
        with torch._inductor.config.patch(force_disable_caches=True):
            got, code = run_and_get_code(f, x)
        assert torch.equal(got, lowfp.quantize(x @ _W, F434) * 2)
        codes += code
    assert codes and all("torch.ops.lowfp.quantize_in_graph.default(" in c for c in codes)


def test_exported_program_runs_and_equals_eager():
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(8, 16)
    program = torch.export.export(net, (x,))
    code = program.graph_module.code
    assert "lowfp.quantize" in code and "lowfp.s2fp8" in code and "lowfp.draw_seed" in code
    torch.manual_seed(5)
    want = net(x)
    torch.manual_seed(5)
    assert torch.equal(program.module()(x), want)


def test_seed_arguments_are_constants_of_the_graph():
    """A format string and an explicit seed are folded in at trace time: recompiling for each new
    seed value is how Dynamo treats Python ints."""
    x = torch.randn(100)
    f = torch.compile(lambda t, s: lowfp.quantize(t, "fp(3,2,0)", "stochastic", seed=s),
                      fullgraph=True)
    for seed in (0, 1, 2**64 - 1):
        assert torch.equal(f(x, seed), lowfp.quantize(x, "fp(3,2,0)", "stochastic", seed=seed))


@pytest.mark.parametrize("mode", ["meta", "fake"])
def test_meta_and_fake_tensors_get_shapes_and_dtypes(mode):
    def run():
        x = torch.empty(3, 5, dtype=torch.bfloat16, device="meta" if mode == "meta" else "cpu")
        xt = x.t()  # a transposed input: so is the result, as on real tensors
        y = lowfp.quantize(xt, "fp(4,3,4)", "stochastic", out_dtype=torch.float32)
        z, st = lowfp.s2fp8_quantize(x.double())
        lowfp.quantize_(x, "float8_e5m2")
        return y, z, st
    if mode == "fake":
        with FakeTensorMode():
            y, z, st = run()
    else:
        y, z, st = run()
    assert (y.shape, y.dtype, y.stride()) == ((5, 3), torch.float32, (1, 5))
    assert (z.shape, z.dtype) == ((3, 5), torch.float64)
    assert st.params.shape == (4,) and st.params.dtype == torch.float64


@pytest.mark.parametrize("make", [lambda: torch.randn(6, 7).t(), lambda: torch.randn(6, 7)[:, ::2],
                                  lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fake_results_match_real_ones(make, rounding):
    x = make()
    real = lowfp.quantize(x, F434, rounding, out_dtype=torch.float64)
    real_s2fp8 = lowfp.s2fp8_quantize(x, rounding=rounding)[0]
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = lowfp.quantize(x, F434, rounding, out_dtype=torch.float64)
        fake_s2fp8 = lowfp.s2fp8_quantize(x, rounding=rounding)[0]
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())
    assert (fake_s2fp8.shape, fake_s2fp8.stride()) == (real_s2fp8.shape, real_s2fp8.stride())


def test_compiled_rounding_keeps_channels_last_and_matches_eager():
    """The rounding operators are flexible_layout: Inductor hands them the channels-last tensors
    it keeps around convolutions, and the results keep that layout."""
    conv = torch.nn.Conv2d(3, 8, 3, padding=1)

    def f(x):
        y = lowfp.quantize(torch.relu(conv(x)), F434, out_dtype=torch.float32)
        return lowfp.quantize(y * 3, "fp(5,2,0)", "stochastic", seed=5)

    x = torch.randn(2, 3, 9, 9).to(memory_format=torch.channels_last)
    with torch.no_grad():
        got, want = torch.compile(f, fullgraph=True)(x), f(x)
    assert torch.equal(got, want)
    assert got.is_contiguous(memory_format=torch.channels_last)


def test_extra_bits_split_and_merge_compile_and_take_fake_tensors():
    w = torch.randn(5, 37)
    f = torch.compile(lambda t: lowfp.extra_bits.merge(
        *lowfp.extra_bits.split(t, torch.bfloat16, 8, "stochastic"), k=8, rounding="stochastic"),
        fullgraph=True)
    torch.manual_seed(2)
    got = f(w)
    torch.manual_seed(2)
    want = lowfp.extra_bits.merge(*lowfp.extra_bits.split(w, torch.bfloat16, 8, "stochastic"), k=8,
                                  rounding="stochastic")
    assert torch.equal(got, want)
    with FakeTensorMode():
        w16, packed = lowfp.extra_bits.split(torch.empty(5, 37), torch.float16, 13, "nearest")
        assert (w16.shape, w16.dtype, packed.shape) == ((5, 37), torch.float16,
                                                        (lowfp.extra_bits.packed_words(185, 13, "nearest"),))
        assert lowfp.extra_bits.merge(w16, packed, 13, "nearest").dtype == torch.float32


def test_formats_built_inside_the_compiled_code():
    """lowfp.fp(...), Format(...), .replace, S2FP8(...) and Scaled(...) called in the traced code:
    no graph break, and the results of eager code bit for bit."""
    def f(x):
        return (lowfp.quantize(x, lowfp.fp(4, 3, 4)),
                lowfp.quantize(x, lowfp.Format(5, 2, 0, specials="ieee"), "stochastic", seed=3,
                               grad_fmt=lowfp.fp(5, 2, 0)),
                lowfp.quantize(x, lowfp.fp(4, 3, 4).replace(overflow="nan")),
                lowfp.s2fp8_quantize(x, lowfp.S2FP8(lowfp.fp(5, 2, 0, specials="ieee"), 12.0))[0],
                lowfp.s2fp8_quantize(x, lowfp.fp(4, 3, 0, specials="fn"), log_max=7.0)[0],
                lowfp.quantize(x, lowfp.Scaled(lowfp.fp(2, 1, 0), block=16, scale=lowfp.fp(4, 3, 0, specials="fn"),
                                               tensor_scale=True)))

    x = torch.randn(4, 64) * 100
    got, want = torch.compile(f, fullgraph=True)(x), f(x)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32))  # (NaNs included)
    with pytest.raises(Exception, match="invalid format"):
        torch.compile(lambda t: lowfp.quantize(t, lowfp.fp(0, 3, 0)), fullgraph=True)(x)


def test_argument_errors_are_raised_while_tracing():
    f = torch.compile(lambda t: lowfp.quantize(t, "fp(4,3,4)", "sideways"), fullgraph=True)
    with pytest.raises(Exception, match="rounding must be one of"):
        f(torch.randn(4))


def _step_args(x, optimizer, rounding):
    """lowfp::extra_bits_step's arguments for one parameter (values as an optimizer makes them)."""
    w, packed = lowfp.extra_bits.split(x.detach(), torch.bfloat16, 8, rounding)
    grads = [torch.randn_like(w)]
    if optimizer == "adam":  # decay .. neg_step_size; decoupled, amsgrad, maximize, CUDA's arithmetic
        moments = [torch.zeros_like(x), torch.zeros_like(x)]
        hyper, flags = [0.999, 0.0, 0.1, 0.999, 0.001, 0.0316, 1e-8, -0.01], [True, False, False, False]
    else:  # neg_lr, momentum, 1 - dampening, weight decay; nesterov, maximize, first step, momentum
        moments = [torch.zeros_like(x)]
        hyper, flags = [-0.1, 0.9, 1.0, 0.0], [False, False, True, True]
    return ([w], grads, [packed], moments, len(moments), optimizer, 8, rounding, torch.float32, hyper,
            flags, 12345, [5], None, None, torch.zeros(4, dtype=torch.int64))


@pytest.mark.parametrize("name,args", [
    ("quantize", lambda x: (x, "fp(4,3,4)", "stochastic", 32, 3, None, 0, torch.float64, True,
                            "fp(5,2,0)", "nearest")),
    ("quantize_in_graph", lambda x: (x, "fp(4,3,4)", "stochastic", 32, 3, None, 0, torch.float64, True,
                                     "fp(5,2,0)", "nearest")),
    ("quantize_into", lambda x: (x, torch.empty_like(x), "float8_e4m3fn", "nearest", 32, 0, None, 0,
                                 torch.zeros(4, dtype=torch.int64))),
    ("s2fp8", lambda x: (x, "float8_e5m2", 15.0, "stochastic", 32, 0,
                         torch.tensor([1, 2]), 0, True, "s2fp8", "nearest")),
    ("s2fp8_into", lambda x: (x, torch.empty_like(x), "float8_e5m2", 15.0, "nearest", 32, 0, None, 0,
                              torch.zeros(lowfp._C.S2FP8_SUM_SIZE, dtype=torch.int64),
                              torch.zeros(4, dtype=torch.float64), None)),
    ("draw_seed", lambda x: ()),
    ("extra_bits_split", lambda x: (x, torch.bfloat16, 8, "stochastic", 32, 3, None, 0, True)),
    ("extra_bits_merge", lambda x: lowfp.extra_bits.split(x, torch.float16, 5, "nearest") + (5, "nearest")),
    ("any_non_finite", lambda x: (x.detach().index_fill(0, torch.tensor([3]), float("nan")),)),
    ("extra_bits_step", lambda x: _step_args(x, "adam", "stochastic")),
    ("extra_bits_step", lambda x: _step_args(x, "sgd", "nearest")),
])
def test_torch_library_opcheck(name, args):
    x = torch.randn(9, 4, requires_grad=name in ("quantize", "s2fp8"))
    op = getattr(torch.ops.lowfp, name).default
    results = torch.library.opcheck(op, args(x))
    assert set(results.values()) == {"SUCCESS"}, results


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_torch_library_opcheck_channels_last(rounding):
    x = torch.randn(2, 5, 3, 4).to(memory_format=torch.channels_last).requires_grad_()
    for op, args in ((torch.ops.lowfp.quantize.default,
                      (x, "fp(4,3,4)", rounding, 32, 3, None, 0, torch.float32, True, "fp(5,2,0)",
                       "nearest")),
                     (torch.ops.lowfp.s2fp8.default,
                      (x, "float8_e5m2", 15.0, rounding, 32, 3, None, 0, True, None, "nearest"))):
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, results


def test_non_finite_check_compiles_and_traces():
    # The loss scaler's check inside a compiled function (fullgraph: the operator
    # lowfp::any_non_finite, out= and count_into= as graph writes), on fake and meta tensors.
    from torch._subclasses.fake_tensor import FakeTensorMode

    def check(t, out, count):
        return lowfp.scaler.any_non_finite(t * 2, count, out=out)

    compiled = torch.compile(check, fullgraph=True)
    for t in (torch.randn(1000), torch.tensor([1.0, float("inf")]), torch.randn(3).bfloat16()):
        outs = [torch.zeros((), dtype=torch.bool) for _ in range(2)]
        counts = [torch.zeros(3, dtype=torch.int64) for _ in range(2)]
        eager = check(t, outs[0], counts[0])
        traced = compiled(t, outs[1], counts[1])
        assert bool(eager) == bool(traced) == bool(outs[1]) == (not torch.isfinite(t).all())
        assert torch.equal(counts[0], counts[1])
    with FakeTensorMode():
        found = lowfp.scaler.any_non_finite(torch.randn(5))
        assert (found.shape, found.dtype) == ((), torch.bool)
    meta = lowfp.scaler.any_non_finite(torch.empty(4, device="meta"))
    assert (meta.device.type, meta.dtype) == ("meta", torch.bool)


def _tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("name", ["ExtraBitsAdamW", "ExtraBitsSGD"])
@pytest.mark.parametrize("where", ["fake", "meta"])
def test_extra_bits_optimizers_step_fake_and_meta_parameters(name, where):
    # Shapes, dtypes and devices only (memory planning, tracing): the state is what a real
    # optimizer makes, and the step goes through lowfp::extra_bits_step's fake implementation.
    kwargs = {"lr": 0.1, "extra_bits": 8, "rounding": "stochastic"}
    if name == "ExtraBitsSGD":
        kwargs["momentum"] = 0.9

    def run(model, x):
        opt = getattr(lowfp.optim, name)(model.parameters(), **kwargs)
        for _ in range(2):
            model(x).float().sum().backward()
            opt.step()
        return {k: (tuple(v.shape), v.dtype) for k, v in opt.state[model[0].weight].items()
                if torch.is_tensor(v)}, model[0].weight

    want, _ = run(_tiny_model(), torch.randn(4, 8, dtype=torch.bfloat16))
    if where == "fake":
        with FakeTensorMode():
            got, w = run(_tiny_model(), torch.randn(4, 8, dtype=torch.bfloat16))
        assert type(w).__name__ == "FakeTensor"
    else:
        got, w = run(_tiny_model().to("meta"), torch.randn(4, 8, dtype=torch.bfloat16, device="meta"))
        assert w.is_meta
    assert got == want and w.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_step_with_an_extra_bits_optimizer_equals_eager(backend):
    # The optimizer's step runs between the compiled graphs (one graph break, nothing traced).
    x = torch.randn(32, 8, dtype=torch.bfloat16)
    results = []
    for compiled in (False, True):
        model = _tiny_model().to(torch.bfloat16)
        opt = lowfp.optim.ExtraBitsAdamW(model.parameters(), lr=1e-2, extra_bits=8, rounding="stochastic",
                                         generator=torch.Generator().manual_seed(0))

        def step():
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()

        run = torch.compile(step, backend=backend) if compiled else step
        for _ in range(3):
            run()
        results.append([p.detach().clone() for p in model.parameters()] + [opt.master_weights()[0]])
    for want, have in zip(*results):
        assert torch.equal(want, have)


# On a GPU (tests/devices.py): the CPU's bits, counts and steps.

@on_cuda
def test_compiled_and_exported_roundings_on_gpu_equal_eager():
    """tests/test_compile.py's checks on a CUDA device: fullgraph compile and export."""
    x = (torch.randn(4, 257) * 40).cuda()
    eager_stats, compiled_stats = lowfp.Stats("cuda"), lowfp.Stats("cuda")
    torch.manual_seed(7)
    eager = _rounds(x, eager_stats)
    torch.manual_seed(7)
    got = torch.compile(_rounds, fullgraph=True)(x, compiled_stats)
    for i, (want, have) in enumerate(zip(eager, got)):
        assert torch.equal(want, have), i
    assert torch.equal(eager_stats.counts, compiled_stats.counts)
    torch.manual_seed(0)
    net, xs = _Net().cuda(), torch.randn(8, 16, device="cuda")
    want = _step(net, xs)
    for a, b in zip(want, _step(torch.compile(net, fullgraph=True), xs)):
        assert torch.equal(a, b)
    program = torch.export.export(net, (xs,))
    torch.manual_seed(5)
    ref = net(xs)
    torch.manual_seed(5)
    assert torch.equal(program.module()(xs), ref)


def test_compile_caches_key_on_lowfps_generating_code(monkeypatch, tmp_path):
    """torch's compile caches hash the traced graph, which holds lowfp's operators, not what lowfp
    lowers them to: lowfp adds a hash of that code to torch.compiler.config.cache_key_tag, after
    the user's own tag (set before or after lowfp's first compile), once."""
    import shutil

    import torch.compiler.config as cconfig

    import lowfp._inductor as inductor
    # (set and restored by hand: monkeypatch sees no attribute in a config module's __dict__ and
    # would delete the setting afterwards, which hides it from torch's own compile)
    before = cconfig.cache_key_tag
    try:
        cconfig.cache_key_tag = "mine"
        torch.compile(lambda t: lowfp.quantize(t, F434) * 2, fullgraph=True)(torch.randn(8))
        key = inductor.generating_source_key()
        assert cconfig.cache_key_tag == f"mine+lowfp-{key}"
        inductor.tag_compile_caches()  # (a second time: the tag stays as it was)
        assert cconfig.cache_key_tag == f"mine+lowfp-{key}"
        cconfig.cache_key_tag = "later"  # a tag set after the first compile is extended too
        torch.compile(lambda t: lowfp.quantize(t, F434) * 3, fullgraph=True)(torch.randn(8))
        assert cconfig.cache_key_tag == f"later+lowfp-{key}"
    finally:
        cconfig.cache_key_tag = before
    assert cconfig.cache_key_tag == before
    # the key follows the sources: a copy of the package with one torch form changed has another
    package = pathlib.Path(inductor.__file__).resolve().parent
    copy = tmp_path / "lowfp"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    monkeypatch.setattr(inductor, "__file__", str(copy / "_inductor.py"))
    assert inductor.generating_source_key() == key
    (copy / "scaled" / "torch_round.py").write_text((copy / "scaled" / "torch_round.py").read_text() + "\n#\n")
    assert inductor.generating_source_key() != key
