"""DTensor parameters (FSDP2's fully_shard, tensor parallelism): the optimizers step each rank's
shard in place, keep its extra bits packed beside it, and save them per element as a DTensor
placed like the parameter, so that a checkpoint reshards as the parameters do (docs/design.md
§5.4)."""

from __future__ import annotations

from typing import Optional

import torch

from .._dtensor import contiguous_strides, is_dtensor
from ..extra_bits import pack, unpack


def local(t):
    """A DTensor's shard on this rank (the tensor the kernels write); any other tensor itself."""
    return t._local_tensor if is_dtensor(t) else t


def check_dtensor_parameter(p, param_dtype: torch.dtype) -> None:
    """What a DTensor parameter must be before the optimizer takes it."""
    from torch.distributed.tensor.placement_types import Partial

    if any(isinstance(pl, Partial) for pl in p.placements):
        raise ValueError(f"a DTensor parameter of shape {tuple(p.shape)} has placements "
                         f"{p.placements}; a Partial parameter is not a value yet")
    if p.dtype == torch.float32:
        raise TypeError(
            f"a float32 DTensor parameter of shape {tuple(p.shape)} (FSDP2 or tensor parallel): a "
            f"sharded parameter cannot be converted to {param_dtype} in place, because fully_shard "
            "keeps its own reference to the shard's memory; convert the model before sharding it "
            f"(model.to({param_dtype}), then fully_shard), and the optimizer starts its extra bits "
            "at zero")


def shard_start(p) -> Optional[int]:
    """The global row-major index of the first element of p's shard on this rank, when the
    shard is one run of the global index (FSDP2's Shard(0), Replicate); else None."""
    if not is_dtensor(p):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(p.shape)
    local_shape, offset = compute_local_shape_and_global_offset(shape, p.device_mesh, p.placements)
    if 0 in local_shape:
        return 0  # an empty shard draws nothing
    cut = [d for d in range(len(shape)) if local_shape[d] != shape[d]]
    if not cut:
        return 0
    first = cut[0]
    if any(shape[d] != 1 for d in range(first)) or len(cut) > 1:
        return None
    inner = 1
    for size in shape[first + 1:]:
        inner *= size
    return offset[first] * inner


def local_grad(p, g: torch.Tensor) -> torch.Tensor:
    """The shard of a DTensor parameter's gradient on this rank, laid out as the parameter."""
    if not is_dtensor(g):
        raise TypeError(f"a DTensor parameter of shape {tuple(p.shape)} has a {type(g).__name__} "
                        "gradient; its gradient must be a DTensor placed like it (as FSDP2 gives)")
    if g.device_mesh != p.device_mesh or g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)
    return g._local_tensor


def extra_values(p, packed: torch.Tensor, k: int, rounding: str):
    """The extra bits of DTensor parameter p as state_dict saves them (key ``extra_values``):
    one int32 per element (lowfp.extra_bits.unpack), a DTensor with p's shape and placements."""
    from torch.distributed.tensor import DTensor

    shard = local(p)
    values = unpack(packed, shard.numel(), k, rounding).reshape(shard.shape)
    return DTensor.from_local(values, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=contiguous_strides(p.shape))


def packed_shard(p, values: torch.Tensor, k: int, rounding: str) -> torch.Tensor:
    """The packed words of DTensor p's shard from saved per-element extra bits: a DTensor (placed
    in any way) or a plain tensor of p's global shape."""
    if tuple(values.shape) != tuple(p.shape):
        raise ValueError(f"saved extra bits of shape {tuple(values.shape)} for a parameter of "
                         f"shape {tuple(p.shape)}; was state loaded from another model?")
    if is_dtensor(values):
        if values.device_mesh != p.device_mesh or values.placements != p.placements:
            values = values.redistribute(p.device_mesh, p.placements)
        values = values._local_tensor
    else:
        values = shard_of(p, values)
    return pack(values.to(device=local(p).device, dtype=torch.int32), k, rounding)


def shard_of(p, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full``, a plain tensor with DTensor p's global shape."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(tuple(p.shape), p.device_mesh,
                                                                p.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
    return full[index].contiguous()


def placed_like(p, value: torch.Tensor):
    """A saved state tensor of DTensor p (a moment) made a DTensor placed like p."""
    from torch.distributed.tensor import DTensor

    if is_dtensor(value):
        if value.device_mesh != p.device_mesh or value.placements != p.placements:
            value = value.redistribute(p.device_mesh, p.placements)
        return value
    if value.shape != p.shape:
        return value  # left for the step's checks to refuse, naming the state
    shard = shard_of(p, value.to(local(p).device))
    return DTensor.from_local(shard, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=contiguous_strides(p.shape))
