"""Applying lowfp's autograd Functions on the eager hot paths (the emulation's roundings, and
lowfp.quantize's calls that autograd records)."""

from __future__ import annotations

import torch

__all__ = ["function_apply"]


def function_apply(function):
    """``function.apply`` less the work that only functorch's transforms need: torch's C++
    apply itself while none is active (Function.apply then checks for them and unwraps the
    dead wrappers they leave, a few microseconds a call), else Function.apply. The Function
    defines no setup_context (Function.apply would bind its arguments)."""
    native_apply = super(torch.autograd.Function, function).apply
    unwrap_if_dead = getattr(torch._C._functorch, "unwrap_if_dead", None)
    transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if unwrap_if_dead is None or transforms_active is None:  # (a torch without them)
        return function.apply

    def apply(x, *args):
        if transforms_active():
            return function.apply(x, *args)
        return native_apply(unwrap_if_dead(x), *args)
    return apply
