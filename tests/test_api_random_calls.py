"""Random, mostly invalid calls of the public functions (quantize, quantize_, s2fp8_quantize,
extra_bits.split / merge): odd dtypes, empty and strided and expanded tensors, numpy arrays,
special values, aliasing outputs, bad formats, modes, seeds, offsets and stats. Every call
either returns or raises a TypeError / ValueError (or torch's own RuntimeError for writing into
an expanded tensor in place, as torch's in-place operations raise it), and never changes an
input it was not asked to write. A crash would take the whole test run down with it."""

import random

import numpy as np
import pytest
import torch

import lowfp
import lowfp.extra_bits as eb

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.uint8,
          torch.complex64, torch.bool]
FORMATS = ["fp(4,3,4)", "fp(5,2,0)", "fp(6,9,0)", "bfloat16", "float16", "float8_e4m3fn",
           "float8_e5m2", "fp(8,23,0)", "fp(1,0,0)", "fp(2,1,1)", "fp(11,52,0)", "fp(4,3,4",
           "x", 3, None]
EXPANDED_WRITE = "more than one element of the written-to tensor refers to a single memory location"


def random_input(rng):
    shape = [rng.choice([0, 1, 2, 3, 5, 33]) for _ in range(rng.randint(0, 3))]
    dtype = rng.choice(DTYPES)
    if dtype.is_floating_point:
        t = torch.randn(shape, dtype=torch.float64) * 10.0 ** rng.randint(-40, 40)
        if t.numel() and rng.random() < 0.3:
            t.view(-1)[0] = rng.choice([float("nan"), float("inf"), -float("inf"), -0.0, 1e-310])
        t = t.to(dtype)
    elif dtype.is_complex:
        t = torch.randn(shape, dtype=dtype)
    elif dtype == torch.bool:
        t = torch.rand(shape) > 0.5
    else:
        t = torch.randint(0, 100, shape).to(dtype)
    r = rng.random()
    if r < 0.15 and t.dim() >= 1 and t.shape[-1] > 1:
        t = t[..., ::2]
    elif r < 0.25 and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif r < 0.35 and t.dim() >= 1 and t.shape[0]:
        t = t[:1].expand(4, *t.shape[1:])
    elif r < 0.4 and dtype != torch.bfloat16:
        t = t.numpy()
    return t


def snapshot(x):
    """x's bytes, NaN payloads included."""
    if isinstance(x, np.ndarray):
        return x.copy()
    return x.clone()


def same(a, b):
    if isinstance(a, np.ndarray):
        return a.tobytes() == b.tobytes()
    if a.dtype.is_complex or a.dtype == torch.bool or a.numel() == 0:
        return torch.equal(a, b)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(bits), b.view(bits))


def one_call(rng):
    kind = rng.choice(["quantize", "quantize", "quantize_", "s2fp8", "split", "merge"])
    x = random_input(rng)
    kw = {}
    if rng.random() < 0.5:
        kw["rounding"] = rng.choice(["nearest", "stochastic", "toward_zero", "up", "down", "no", None])
    if rng.random() < 0.2:
        kw["overflow"] = rng.choice(["saturate", "inf", "nan", "bad"])
    if rng.random() < 0.2:
        kw["subnormals"] = rng.choice([True, False, 1])
    if rng.random() < 0.2:
        kw["seed"] = rng.choice([0, 1, 2**64 - 1, 2**64, -1, 1.5])
    if rng.random() < 0.1:
        kw["offset"] = rng.choice([0, 5, -1, 2**63])
    if rng.random() < 0.1:
        kw["sr_bits"] = rng.choice([0, 1, 8, 23, 32, 33])
    if rng.random() < 0.2:
        kw["out"] = x if rng.random() < 0.3 else random_input(rng)
    if rng.random() < 0.1:
        kw["out_dtype"] = rng.choice(DTYPES)
    if rng.random() < 0.2:
        kw["stats"] = lowfp.Stats("cpu") if rng.random() < 0.8 else "bad"
    fmt = rng.choice(FORMATS)
    packed = None
    if kind == "merge":
        k, rounding = rng.choice([1, 8, 13, 16]), rng.choice(["toward_zero", "nearest", "stochastic"])
        n = x.numel() if torch.is_tensor(x) else 0
        packed = (torch.zeros(max(0, eb.packed_words(n, k, rounding) + rng.choice([0, 0, -1, 1])),
                              dtype=rng.choice([torch.int32, torch.int64]))
                  if rng.random() < 0.5 else random_input(rng))
    written = {id(kw["out"])} if "out" in kw else set()
    if kind == "quantize_":
        written = {id(x)}
    inputs = [t for t in (x, packed) if t is not None and id(t) not in written]
    before = [snapshot(t) for t in inputs]
    try:
        if kind == "quantize":
            lowfp.quantize(x, fmt, **kw)
        elif kind == "quantize_":
            kw.pop("out", None)
            kw.pop("out_dtype", None)
            lowfp.quantize_(x, fmt, **kw)
        elif kind == "s2fp8":
            kw.pop("out_dtype", None)
            lowfp.s2fp8_quantize(x, rng.choice(["float8_e5m2", "float8_e4m3fn", "fp(4,3,4)", "bad"]), **kw)
        elif kind == "split":
            eb.split(x, rng.choice([torch.bfloat16, torch.float16, torch.float32]),
                     rng.choice([0, 1, 7, 8, 13, 16, 17, True]),
                     rng.choice(["toward_zero", "nearest", "stochastic", "x"]), seed=kw.get("seed"))
        else:
            eb.merge(x, packed, k, rounding)
    except (TypeError, ValueError):
        pass
    except RuntimeError as e:
        assert EXPANDED_WRITE in str(e), (kind, fmt, kw, e)
    for t, b in zip(inputs, before):
        assert same(t, b), (kind, fmt, kw)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_calls_raise_named_errors_and_leave_inputs_alone(seed):
    rng = random.Random(seed)
    for _ in range(300):
        one_call(rng)
