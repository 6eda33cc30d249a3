"""lowfp's roundings fused by Inductor as Triton code, the code a GPU runs, executed here by
Triton's interpreter (tests/triton_interpreter.py): the native kernels' bits and counts for every
plain format family, mode and carrier dtype (16-bit NaNs with a GPU's conversions included), every
named and custom scaled format, and an emulated training step compiled with Inductor.

Run by .ci/triton-interpreter before a GPU session, not by CI: it needs triton, and the
interpreter runs each kernel in NumPy (about 20 minutes on 2 cores, and 15 more for the script's
flushing stage). It is not named test_*.py, so that pytest collects it only when named; run it
alone (the import below changes Inductor's CPU backend for the process)."""

import copy

import triton_interpreter  # (first: Inductor's CPU code becomes Triton, run by the interpreter)

import pytest
import torch
import torch.nn as nn

import lowfp
from lowfp import assign as A
from lowfp.scaled import ScaledStats
from test_emulate_compile import _graphs_after, _loss, _train
from test_scaled_torch_round import CUSTOM, DTYPES, NAMED, bits, decision_points, named_format_values
from test_torch_round import FORMATS, MODES, boundary_values, fits


@pytest.fixture(autouse=True)
def fused_everywhere(monkeypatch):
    monkeypatch.setenv("LOWFP_INDUCTOR_FUSION", "1")
    triton_interpreter.LAUNCHES.clear()


def _compiled(fn, *args):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True)(*args)


@pytest.mark.parametrize("fmt_text", FORMATS)
def test_plain_formats_equal_the_native_kernel(fmt_text):
    fmt = lowfp.Format.parse(fmt_text)
    checked = 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        if not fits(fmt, dtype):
            continue
        x = boundary_values(fmt, dtype)
        for mode in MODES:
            def f(t, stats):
                return lowfp.quantize(t, fmt_text, mode, seed=11 if mode == "stochastic" else None,
                                      offset=3, stats=stats)
            fused_stats, native_stats = lowfp.Stats(), lowfp.Stats()
            got, want = _compiled(f, x, fused_stats), f(x, native_stats)
            assert torch.equal(bits(got), bits(want)), (dtype, mode)
            assert torch.equal(fused_stats.counts, native_stats.counts), (dtype, mode)
            checked += 1
    assert checked and triton_interpreter.LAUNCHES  # (Triton kernels ran)


def _scaled_cases():
    x = named_format_values()
    cases = [pytest.param(lowfp.scaled.to_scaled(name), x, id=name) for name in NAMED]
    for fmt in CUSTOM:
        shape = (32, 64) if fmt.axis == 0 else (64, 32)
        cases.append(pytest.param(fmt, decision_points(fmt, shape, seed=len(str(fmt))).double(), id=str(fmt)))
    return cases


@pytest.mark.parametrize("fmt,x", _scaled_cases())
def test_scaled_formats_equal_the_native_kernel(fmt, x):
    for dtype in DTYPES:
        xd = x.to(dtype)
        for mode in MODES:
            def f(t, stats):
                return lowfp.quantize(t, fmt, mode, seed=0x0123456789ABCDEF if mode == "stochastic" else None,
                                      offset=9, stats=stats)
            fused_stats, native_stats = ScaledStats(), ScaledStats()
            got, want = _compiled(f, xd, fused_stats), f(xd, native_stats)
            assert torch.equal(bits(got), bits(want)), (dtype, mode)
            assert torch.equal(fused_stats.counts, native_stats.counts), (dtype, mode)
    assert triton_interpreter.LAUNCHES


def test_an_emulated_step_compiled_by_inductor_equals_eager():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    a = A.ours(A.trace(base, x, _loss, y), 0.5)
    for rounding in ("nearest", "stochastic"):
        eager = _train(copy.deepcopy(base), a, x, y, 3, rounding=rounding)
        triton_interpreter.LAUNCHES.clear()
        (history, weights, _), graphs = _graphs_after(
            lambda: _train(copy.deepcopy(base), a, x, y, 3, "inductor", rounding=rounding))
        assert graphs == 1 and triton_interpreter.LAUNCHES
        assert history.steps == eager[0].steps
        assert all(torch.equal(w, v) for w, v in zip(weights, eager[1]))
