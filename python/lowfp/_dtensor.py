"""Rounding a DTensor (docs/design.md §3): each rank rounds its own shard and the result is a
DTensor with the input's mesh and placements.

Stochastic rounding draws by *global* element index: element i of the whole tensor (row-major)
uses Philox word i % 4 of block offset + i // 4, so a sharded result equals the unsharded one bit
for bit whatever the placements. A shard that is not one run of the global index (Shard(d) for
d > 0, or a start that is not a multiple of 4) is rounded inside a zero buffer that spans its
global index range, at its global positions; that costs the span, not the shard.
"""

from __future__ import annotations

import torch

__all__ = ["is_dtensor", "round_dtensor", "contiguous_strides"]


def _dtensor_type():
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


def is_dtensor(t) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def round_dtensor(round_local, x, fmt, *, rounding: str, seed, generator, offset: int, stats, out,
                  **kwargs):
    """lowfp.quantize (``round_local``: lowfp.quantize.round_tensor) of a DTensor ``x``."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Partial, Replicate

    from .formats import S2FP8, to_precision

    if any(isinstance(p, Partial) for p in x.placements):
        raise ValueError(f"x is a DTensor with placements {x.placements}: a Partial value is not "
                         "the tensor's value yet; redistribute it (to Replicate or Shard) first")
    sharded = any(not isinstance(p, Replicate) for p in x.placements)
    if sharded and isinstance(to_precision(fmt, "fmt"), S2FP8):
        raise ValueError(f"x is a DTensor sharded as {x.placements}: S2FP8's statistics are those "
                         "of the whole tensor; round x.full_tensor() or a replicated DTensor")
    kwargs["fmt"] = fmt
    if out is not None:
        if not is_dtensor(out) or out.device_mesh != x.device_mesh or out.placements != x.placements:
            raise TypeError("out must be a DTensor with x's device mesh and placements")
        out_local = out.to_local()
    else:
        out_local = None
    local = x.to_local()
    if rounding != "stochastic" or not sharded or local.numel() == 0:
        y, s2 = round_local(local, rounding=rounding, seed=seed, generator=generator,
                            offset=offset, stats=stats, out=out_local, **kwargs)
    else:
        from ._native import stochastic_seed
        seed = stochastic_seed(seed, generator)  # ranks draw alike when their generators agree
        local_shape, global_start = compute_local_shape_and_global_offset(
            x.shape, x.device_mesh, x.placements)
        y, s2 = _round_at_global_positions(round_local, local, x.shape, global_start, rounding,
                                           seed, offset, stats, out_local, kwargs)
    if out is not None:
        return out, s2
    result = DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                stride=contiguous_strides(x.shape))
    return result, s2


def contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _round_at_global_positions(round_local, local: torch.Tensor, global_shape, global_start,
                               rounding, seed, offset, stats, out_local, kwargs):
    """Round ``local`` (the block of the global tensor that starts at ``global_start``) as the
    same elements of the whole tensor would be rounded."""
    from ._native import check_uint64
    from .stats import Stats

    strides = contiguous_strides(global_shape)
    first = sum(s * o for s, o in zip(strides, global_start))
    last = first + sum(s * (n - 1) for s, n in zip(strides, local.shape))
    phase = first % 4
    span = torch.zeros(phase + last - first + 1, dtype=local.dtype, device=local.device)
    at = span.as_strided(local.shape, strides, phase)
    at.copy_(local)
    counts = torch.zeros(4, dtype=torch.int64, device=local.device) if stats is not None else None
    block = (check_uint64(offset, "offset") + first // 4) % 2**64
    rounded, s2 = round_local(span, rounding=rounding, seed=seed, generator=None, offset=block,
                              stats=Stats.view(counts) if counts is not None else None, out=None,
                              **kwargs)
    if counts is not None:  # the zeros around the shard are exact: only numel must be corrected
        counts[3] = local.numel()
        stats.accumulate(counts)
    y = rounded.as_strided(local.shape, strides, phase)
    if out_local is not None:
        out_local.copy_(y)
        return out_local, None
    return y.contiguous(), None
