"""Refusing what would silently cut DistributedDataParallel off a parameter."""

from __future__ import annotations

import torch

def refuse_if_in_ddp(p: torch.Tensor, consequence: str) -> None:
    """Refuses a parameter that a DistributedDataParallel model may have hooked: DDP hooks its
    gradient all-reduce on the parameter's AccumulateGrad node, which a dtype change replaces
    and which runs after per-parameter hooks. DDP needs a process group, so without one nothing
    is looked at; with one, the node being held by anything else counts (a graph still
    referenced, such as a loss kept from an earlier step, holds it too: the message says so)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if grad_accumulator_is_held(p):
        raise ValueError(f"a {p.dtype} parameter of shape {tuple(p.shape)} looks wrapped in "
                         "DistributedDataParallel: something holds its gradient accumulator (a "
                         "DDP model's reducer, or a graph still referenced, such as a loss kept "
                         f"from an earlier step: del it first); {consequence}")


def grad_accumulator_is_held(p: torch.Tensor) -> bool:
    """Whether something other than this call holds p's AccumulateGrad node (DDP's reducer, a
    graph). The node is cached weakly on p: a mark left in its metadata survives a second
    lookup only if another owner kept the node alive in between."""
    if not p.requires_grad:
        return False
    with torch.enable_grad():  # optimizers are often built under no_grad
        node = p.view_as(p).grad_fn.next_functions[0][0]
        node.metadata["lowfp_probe"] = True
        del node
        return p.view_as(p).grad_fn.next_functions[0][0].metadata.pop("lowfp_probe", False)


