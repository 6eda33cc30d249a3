"""All 2^32 float32 bit patterns, modes nearest and toward_zero, against a reference that shares
no code with the engine: the format's values are decoded code by code (reference.positive_values),
and the float32 patterns that round to each value form one run between two boundaries (midpoints
for nearest, with a tie going to the neighbour whose encoding is even; the values themselves
for toward_zero). Each chunk of results is checked against that table by its runs: the result
changes exactly at the table's starts, and takes the table's result on each run."""


import numpy as np
import pytest
import torch

import lowfp
from reference import Spec, positive_values

pytestmark = pytest.mark.slow  # every float32 pattern of each case

CHUNK = 1 << 24
INF_BITS = 0x7F800000
SIGN = np.uint32(0x80000000)

CASES = {
    "fp(4,3,4)": Spec(4, 3, 4, "none"),
    "float8_e4m3fn": Spec(4, 3, 0, "fn"),
    "float8_e5m2": Spec(5, 2, 0, "ieee"),
    "bfloat16": Spec(8, 7, 0, "ieee"),
    "fp(5,0,3)": Spec(5, 0, 3, "none"),  # m = 0: ties go by the exponent code's parity
}


def f32_bits(v: float) -> int:
    with np.errstate(over="ignore"):
        return int(np.array([v], dtype=np.float32).view(np.uint32)[0])


def reference_runs(spec: Spec, mode: str, policy: str):
    """(starts, result_bits): pattern p in [0, inf] rounds to result_bits[i] for the last
    starts[i] <= p; the inf pattern itself is handled by the caller."""
    vals = positive_values(spec)
    step_top = vals[-1] - vals[-2] if spec.m == 0 else 2 ** (spec.emax - spec.m)
    extended = vals + [vals[-1] + step_top]  # V continues above max
    starts, results = [0], [0]
    for code, (lo, hi) in enumerate(zip(extended[:-1], extended[1:])):
        if mode == "toward_zero":
            start = f32_bits(float(hi))
        else:
            q = hi - lo
            lower_is_even = code % 2 == 0  # positive codes count up with the values
            start = f32_bits(float(lo + q / 2)) + (1 if lower_is_even else 0)
        starts.append(min(start, INF_BITS))
        results.append(f32_bits(float(hi)))
    # the last run is overflow: the policy's value for a positive finite overflow
    mx = float(vals[-1])
    if policy == "saturate" or mode == "toward_zero":
        results[-1] = f32_bits(mx)
    else:
        results[-1] = INF_BITS
    return np.array(starts, dtype=np.int64), np.array(results, dtype=np.uint32)


def distinct_runs(starts, results):
    """The runs without empty ones, and neighbours of one result joined: the result then changes
    exactly at each start (the last run, from inf's pattern on, may be empty: no finite pattern
    lies in it)."""
    nonempty = np.append(starts[1:] != starts[:-1], True)
    starts, results = starts[nonempty], results[nonempty]
    first = np.insert(results[1:] != results[:-1], 0, True)
    return starts[first], results[first]


def runs_differ(got, lo, starts, results, sign):
    """Whether got, the results of patterns lo .. lo + len(got) - 1 (all below inf's, with the
    sign bit ``sign``), differs from the table: its first result, where it changes and what it
    changes to, against the runs those patterns lie in."""
    i0 = np.searchsorted(starts, lo, side="right") - 1
    i1 = np.searchsorted(starts, lo + len(got) - 1, side="right") - 1
    changes = np.flatnonzero(got[1:] != got[:-1]) + 1
    return not (got[0] == results[i0] | sign
                and np.array_equal(changes, starts[i0 + 1:i1 + 1] - lo)
                and np.array_equal(got[changes], results[i0 + 1:i1 + 1] | sign))


def expected_chunk(starts, results, lo, hi):
    """The table's results for patterns lo .. hi - 1, element by element (for a failure's message)."""
    i0 = np.searchsorted(starts, lo, side="right") - 1
    i1 = np.searchsorted(starts, hi - 1, side="right") - 1
    seg_start = np.maximum(starts[i0:i1 + 1], lo)
    seg_end = np.append(starts[i0 + 1:i1 + 1], hi)
    return np.repeat(results[i0:i1 + 1], seg_end - seg_start)


@pytest.mark.parametrize("mode", ["nearest", "toward_zero"])
@pytest.mark.parametrize("name", list(CASES))
def test_all_float32_patterns(name, mode):
    spec = CASES[name]
    fmt = lowfp.Format.parse(name)
    policy = fmt.overflow
    starts, results = distinct_runs(*reference_runs(spec, mode, policy))
    inf_result = INF_BITS if policy == "inf" else f32_bits(fmt.max)
    base = np.arange(CHUNK, dtype=np.uint32)
    pattern = np.empty(CHUNK, dtype=np.uint32)
    out = np.empty(CHUNK, dtype=np.float32)
    checked = 0
    for lo in range(0, 1 << 31, CHUNK):
        finite_end = min(max(INF_BITS - lo, 0), CHUNK)  # patterns below inf in this chunk
        np.add(base, np.uint32(lo), out=pattern)
        for sign in (np.uint32(0), SIGN):
            if sign:
                pattern |= sign
            lowfp.quantize(pattern.view(np.float32), fmt, mode, out=out)
            got = out.view(np.uint32)
            if finite_end and runs_differ(got[:finite_end], lo, starts, results, sign):
                want = expected_chunk(starts, results, lo, lo + finite_end) | sign
                i = np.flatnonzero(got[:finite_end] != want)[:4]
                pytest.fail(f"{name} {mode}: patterns {[hex(int(p)) for p in pattern[i]]} "
                            f"got {[hex(int(g)) for g in got[i]]} want {[hex(int(w)) for w in want[i]]}")
            if 0 <= INF_BITS - lo < CHUNK:  # inf's pattern, then NaNs'
                assert got[finite_end] == inf_result | sign, (name, mode, hex(sign))
                assert np.isnan(out[finite_end + 1:]).all(), (name, mode, hex(sign))
            checked += CHUNK
    assert checked == 2**32


# Stochastic rounding: the native kernels (which round these formats by steps, round.hpp's
# round_stochastic_by_steps, in the float32 carrier and, for float64 inputs, the float64 one)
# against the torch form of round_bits (lowfp._torch_round, eager: torch operations on the
# carrier's bits, sharing no code with the kernels), element by element with the same Philox
# words, and the counts.
STOCHASTIC_CASES = [("fp(4,3,4)", 32), ("float8_e5m2", 9), ("fp(5,0,3)", 32), ("float16", 1)]


@pytest.mark.parametrize("stride", [pytest.param(61, marks=pytest.mark.long), 4093])
@pytest.mark.parametrize("name,sr_bits", STOCHASTIC_CASES)
def test_stochastic_float32_patterns_match_the_torch_form(name, sr_bits, stride):
    """Every 4093rd float32 pattern (every 61st with -m long), as float32 and as float64 inputs:
    the same results, NaNs aside (a NaN stays NaN), and the same counts."""
    from lowfp._torch_round import quantize as torch_form

    fmt = lowfp.Format.parse(name)
    per_chunk = 1 << 20
    base = np.arange(per_chunk, dtype=np.uint64) * np.uint64(stride)
    checked = 0
    for chunk, lo in enumerate(range(0, 1 << 32, per_chunk * stride)):
        pattern = base + np.uint64(lo)
        pattern = pattern[pattern < 2**32].astype(np.uint32)
        x32 = torch.from_numpy(pattern.view(np.float32))
        seed, offset = 0x5DEECE66D + chunk, chunk * per_chunk
        for x in (x32, x32.double()):
            stats = lowfp.Stats()
            got = lowfp.quantize(x, fmt, "stochastic", seed=seed, offset=offset, sr_bits=sr_bits, stats=stats)
            want, counts = torch_form(x, str(fmt), "stochastic", sr_bits, seed, None, offset, x.dtype, True)
            got, want = got.float().numpy(), want.float().numpy()
            nan = np.isnan(want)
            same = np.array_equal(np.isnan(got), nan) and np.array_equal(
                got[~nan].view(np.uint32), want[~nan].view(np.uint32))
            if not same:
                i = np.flatnonzero((got.view(np.uint32) != want.view(np.uint32)) & ~nan)[:4]
                pytest.fail(f"{name} sr_bits={sr_bits} {x.dtype}: patterns {[hex(int(p)) for p in pattern[i]]} "
                            f"got {got[i]} want {want[i]}")
            assert stats.counts.tolist() == counts.tolist()
        checked += len(pattern)
    assert checked == -(-2**32 // stride)
