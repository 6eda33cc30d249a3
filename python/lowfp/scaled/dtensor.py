"""Rounding a DTensor to a scaled format (docs/design.md §3.2): each rank rounds its own shard,
which gives the unsharded result bit for bit where no block (and no group of the Hadamard
transform) straddles two shards: Replicate, Shard on a dim the blocks do not run along, or along
it when every shard starts at a multiple of the block. A per-tensor scale (or NVFP4's tensor
scale) needs the whole tensor's amax, so it takes Replicate placements only.

Stochastic rounding draws by the element's index in the format's layout (the tensor with its
block axis moved last, row-major): a shard whose elements are one run of that layout, starting
at a multiple of 4, takes the offset of its first element; other sharded layouts are refused.
"""

from __future__ import annotations

import math
from typing import Callable, List


from .config import Scaled

__all__ = ["check_placements", "round_dtensor"]


def _chunk_starts(n: int, ways: List[int]) -> List[int]:
    """The first index of every shard of a dim of size n split by torch's Shard over mesh dims
    of sizes ``ways`` in turn (each split as torch.chunk: ceil-sized chunks, the last ones shorter
    or empty)."""
    ranges = [(0, n)]
    for w in ways:
        split = []
        for start, stop in ranges:
            size = -(-(stop - start) // w) if stop > start else 0
            split += [(min(start + k * size, stop), min(start + (k + 1) * size, stop)) for k in range(w)]
        ranges = split
    return [start for start, stop in ranges if stop > start]


def _layout_axes(fmt: Scaled, ndim: int):
    """(the dim each 1-D block runs along or None, the dims of 2-D blocks or ())."""
    if fmt.axis is None:
        return None, ()
    if isinstance(fmt.block, tuple):
        return None, (ndim - 2, ndim - 1)
    return fmt.axis % ndim, ()


def check_placements(x, fmt: Scaled, rounding: str, hadamard: bool) -> int:
    """Raises ValueError for placements whose shards the format cannot round on their own;
    returns the Philox block offset of this rank's shard (0 unless sharded stochastic rounding)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = x.placements
    for p in placements:
        if type(p) not in (Replicate, Shard):
            raise ValueError(f"x is a DTensor with placements {placements}: a scaled format rounds "
                             "Replicate and Shard placements (a Partial value is not the tensor's "
                             "value yet; redistribute it first)")
    sharded = {}  # tensor dim: mesh sizes that split it, in mesh order
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            sharded.setdefault(p.dim % x.ndim, []).append(x.device_mesh.size(mesh_dim))
    if not sharded:
        return 0
    what = f"x is a DTensor sharded as {placements}"
    if fmt.axis is None or fmt.tensor_scale:
        raise ValueError(f"{what}: {fmt} has a per-tensor scale, which needs the whole tensor's "
                         "amax; round a Replicate DTensor (x.redistribute(placements=[Replicate()]))")
    axis, block_dims = _layout_axes(fmt, x.ndim)
    multiples = {}  # tensor dim: what every shard's start along it must be a multiple of
    if axis is not None:
        if fmt.block is None and axis in sharded:
            raise ValueError(f"{what}: {fmt} scales whole slices along dim {axis}, which the "
                             "shards split; shard another dim, or Replicate this one")
        # (with the Hadamard transform, its groups of 16 whole too)
        multiples[axis] = _lcm(fmt.block, 16) if hadamard else fmt.block
    for d, b in zip(block_dims, fmt.block if block_dims else ()):
        multiples[d] = b
    for d, b in multiples.items():
        if d in sharded and any(s % b for s in _chunk_starts(x.shape[d], sharded[d])):
            raise ValueError(f"{what}: along dim {d} its shards start at "
                             f"{_chunk_starts(x.shape[d], sharded[d])}, not all multiples of {b}, "
                             f"so a block of {fmt} would straddle two shards; make the shards "
                             f"multiples of {b} long, shard another dim, or Replicate")
    if rounding != "stochastic":
        return 0
    # The layout's order: the other dims in order, then the block axis (2-D blocks: as is).
    order = [d for d in range(x.ndim) if d != axis] + ([axis] if axis is not None else [])
    first = next(i for i, d in enumerate(order) if d in sharded)
    if len(sharded) > 1 or any(x.shape[d] != 1 for d in order[:first]):
        raise ValueError(f"{what}: stochastic rounding draws by the index in {fmt}'s layout (dims "
                         f"in the order {order}, row-major), of which this shard is not one run; "
                         f"shard dim {order[0]} only, or round a Replicate DTensor")
    d = order[first]
    inner = 1
    for e in order[first + 1:]:
        inner *= x.shape[e]
    starts = [s * inner for s in _chunk_starts(x.shape[d], sharded[d])]
    if any(s % 4 for s in starts):
        raise ValueError(f"{what}: stochastic rounding draws Philox words in fours by the index in "
                         f"{fmt}'s layout, and the shards start at elements {starts}, not all "
                         "multiples of 4; choose shard sizes that are, or round a Replicate DTensor")
    _, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, placements)
    return offset[d] * inner // 4


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


def round_dtensor(x, fmt: Scaled, rounding: str, hadamard: bool, out, offset: int,
                  round_local: Callable):
    """``round_local(local, out_local, offset)`` on this rank's shard of x, as a DTensor placed
    like x (``out``: a DTensor with x's mesh and placements, written and returned)."""
    from torch.distributed.tensor import DTensor

    from .._dtensor import contiguous_strides, is_dtensor

    block_offset = check_placements(x, fmt, rounding, hadamard)
    out_local = None
    if out is not None:
        if not is_dtensor(out) or out.device_mesh != x.device_mesh or out.placements != x.placements:
            raise TypeError("out must be a DTensor with x's device mesh and placements")
        out_local = out.to_local()
    y = round_local(x.to_local(), out_local, (offset + block_offset) % 2**64)
    if out is not None:
        return out
    return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                              stride=contiguous_strides(x.shape))
