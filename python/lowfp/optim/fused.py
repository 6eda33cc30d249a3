"""The fused step of a batch of parameters (docs/design.md §5): each parameter's gradient, extra
bits, moments and Philox offset checked and gathered (``gather``), then one native call,
``lowfp::extra_bits_step``, per parameter dtype (``launch``)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .. import backends
from .._dtensor import is_dtensor
from .._native import as_int64
from .._ops import HYPER_FIELDS, extra_bits_step_impl
from ..backends import memory_order
from ..extra_bits import packed_words
from . import sharded
from .state import LayoutChanged, check_buffers, device_index, match_layout, record_order, same_memory_order

# Per parameter dtype: (parameters, gradients, extra bits, moments, Philox offsets)
Batches = Dict[torch.dtype, Tuple[list, list, list, list, list]]


def grad_like(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """g as the kernel reads it: dense, in p's dtype and p's memory order (contiguous for a
    contiguous p; autograd gives a channels_last parameter a channels_last gradient)."""
    if g.layout is not torch.strided:
        raise ValueError(f"lowfp's extra-bits optimizers need dense gradients, got a {g.layout} "
                         "one (sparse gradients are not supported)")
    if g.dtype is not p.dtype:
        g = g.to(p.dtype)
    if p.is_contiguous():
        return g.contiguous()
    if g.shape == p.shape and same_memory_order(g, p):
        return g
    return torch.empty_like(p).copy_(g)


def new_extra(p: torch.Tensor, group: dict, state: dict) -> torch.Tensor:
    """Zero extra bits for a parameter that started in 16 bits, made at its first step."""
    k, rounding = group["extra_bits"], group["rounding"]
    extra = torch.zeros(packed_words(p.numel(), k, rounding), dtype=torch.int32, device=p.device)
    state.update(extra=extra, extra_bits=k, rounding=rounding, param_dtype=p.dtype,
                 weight_format=group["weight_format"])
    record_order(state, memory_order(p))
    return extra


def gather(optimizer, group: dict, entries: List[Tuple[torch.Tensor, dict]],
           grads: Optional[List[torch.Tensor]]) -> Tuple[Batches, list]:
    """The (parameter, state) entries of one group, each checked (check_buffers) and its
    buffers gathered by dtype; grads: theirs, or None for p.grad. Returns the batches and the
    DTensor parameters among them, whose local shards the batches hold. Each parameter's
    Philox offset is fixed by its place in the group (the optimizer's _philox_offset), so that
    stepping parameters one by one (step in backward) draws the words that stepping them
    together does. A parameter costs what its loop turn costs: a few µs of Python, most of it
    reading tensors' properties."""
    state_dtype = group["state_dtype"]
    by_dtype: Batches = {}
    dtensors = []
    index = device_index(optimizer.weight_stats.counts)
    offsets = optimizer._philox_offset
    for j, (p, state) in enumerate(entries):
        g = p.grad if grads is None else grads[j]
        pid = id(p)
        if type(p) is not torch.nn.Parameter and is_dtensor(p):  # steps this rank's shard
            g = sharded.local_grad(p, g)
            moments = [m._local_tensor for m in optimizer._moments(p, group, state_dtype, state)]
            dtensors.append(p)
            p = p._local_tensor
        else:
            moments = None
        if (g.layout is not torch.strided or g.dtype is not p.dtype
                or not (g.is_contiguous() and p.is_contiguous())):
            g = grad_like(p, g)  # converted, or laid out as p (a no-op when it is)
        extra = state.get("extra")
        if extra is None:
            extra = new_extra(p, group, state)
        if moments is None:
            moments = optimizer._moments(p, group, state_dtype, state)
        try:
            n = check_buffers(p, state, group, index, moments)
        except LayoutChanged:  # model.to(memory_format=...) since the last step
            match_layout(p, state)
            extra, moments = state["extra"], optimizer._moments(p, group, state_dtype, state)
            n = check_buffers(p, state, group, index, moments)
        if g.numel() != n:
            raise ValueError(f"a gradient has shape {tuple(g.shape)} but its parameter has "
                             f"shape {tuple(p.shape)}")
        offset = offsets.get(pid)
        if offset is None:  # appended to group["params"] by hand, as torch.optim allows
            optimizer._set_philox_offsets(group)
            offset = offsets[pid]
        if offset < 0:  # a shard that is not one run of its parameter's global order
            if group["rounding"] == "stochastic":
                raise ValueError("stochastic rounding of a DTensor parameter whose shard is "
                                 "not one run of its row-major order (Shard(0) or Replicate)")
            offset = 0  # no random words drawn
        batch = by_dtype.get(p.dtype)
        if batch is None:
            batch = by_dtype[p.dtype] = ([], [], [], [], [])
        batch[0].append(p)
        batch[1].append(g)
        batch[2].append(extra)
        batch[3].extend(moments)
        batch[4].append(offset)
    return by_dtype, dtensors


def launch(name: str, group: dict, batches: Batches, values: dict, seed: int,
           found_inf: Optional[torch.Tensor], grad_scale: Optional[torch.Tensor],
           counts: torch.Tensor) -> None:
    """One ``lowfp::extra_bits_step`` call per batch: ``name`` the update ("sgd", "adam"),
    ``values`` its hyperparameters by name (HYPER_FIELDS), ``seed`` stochastic rounding's (one
    per group and step), ``found_inf`` a bool on the parameters' device that skips the step
    there when true, ``grad_scale`` a float32 0-d tensor there (GradScaler's) that the step
    divides the gradients by, in float32, before the update; the 16-bit weights' rounding
    events added to ``counts``."""
    _, float_names, bool_names = HYPER_FIELDS[name]
    hyper, flags = [float(values[k]) for k in float_names], [bool(values[k]) for k in bool_names]
    for params, grads, extras, moments, offsets in batches.values():
        # The operator where torch traces (fake, functional or meta parameters); else its
        # implementation, called directly: a dispatch costs more than a small parameter's step.
        local = params[0]
        step = (torch.ops.lowfp.extra_bits_step
                if type(local) in backends.TRACING_TYPES or local.is_meta else extra_bits_step_impl)
        step(params, grads, extras, moments, len(moments) // len(params), name,
             group["extra_bits"], group["rounding"], group["state_dtype"], hyper, flags,
             as_int64(seed), offsets, found_inf, grad_scale, counts, group["weight_format"])
