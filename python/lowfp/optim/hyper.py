"""Checks of the optimizers' arguments and hyperparameters, one validator per kind."""

from __future__ import annotations

import torch

from .._checks import is_real

def check_torch_switches(foreach, fused, differentiable, capturable=False):
    """torch.optim's implementation switches, accepted so that torch.optim code runs unchanged.
    foreach and fused change nothing here: each group is always stepped by lowfp's fused kernel.
    Autograd through the step and CUDA-graph capture are not supported."""
    for name, value in (("foreach", foreach), ("fused", fused)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool or None, got {value!r}")
    if differentiable:
        raise ValueError("differentiable=True is not supported: the fused step updates the packed "
                         "extra bits in place, outside autograd")
    if capturable:
        raise ValueError("capturable=True is not supported: the step count and hyperparameters "
                         "are computed on the host, so the step cannot be captured in a CUDA graph")


def hyperparameter(value, name: str):
    """A float, or a 1-element tensor as torch.optim allows for lr and betas (kept as a 0-d
    tensor, which LR schedulers fill in place). The step reads it as a Python float, as torch's
    default CPU step does (a CUDA tensor is read once per group and step, which waits for it)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(f"Tensor {name} must be 1-element and floating-point, got a "
                             f"{value.dtype} tensor of shape {tuple(value.shape)}")
        return value.reshape(())
    if not is_real(value):
        raise TypeError(f"{name} must be a float or a 1-element tensor, got {value!r}")
    return value


def check_bool(group: dict, name: str) -> None:
    value = group[name]
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_real(group: dict, name: str, message: str) -> None:
    """A real number >= 0; NaN is refused too, as torch.optim's ``not 0.0 <= x`` does."""
    value = group[name]
    if not is_real(value):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    if not 0.0 <= value:
        raise ValueError(f"{message}: {value} ({name} must be >= 0)")


def check_common(group: dict) -> None:
    """lr (a float or a 1-element tensor, kept as a 0-d tensor) and weight_decay, in place."""
    group["lr"] = hyperparameter(group["lr"], "lr")
    if not 0.0 <= group["lr"]:
        raise ValueError(f"Invalid learning rate: {group['lr']} (lr must be >= 0)")
    check_real(group, "weight_decay", "Invalid weight_decay value")


