"""torch.amp.GradScaler and an ExtraBits optimizer: when ``_step_supports_amp_scaling`` holds,
as for torch's fused optimizers, GradScaler only checks the gradients and sets ``grad_scale`` and
``found_inf`` on the optimizer, and the fused step divides the gradients by the scale in float32
and skips on the device."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .fused import grad_like


def supports_amp_scaling(optimizer) -> bool:
    """Whether GradScaler leaves unscaling and skipping to the fused step: so a float16
    gradient below float16's normal range once unscaled keeps its value (GradScaler refuses to
    unscale float16 gradients itself), and on a GPU GradScaler does not wait for its check. On
    the CPU with bfloat16 parameters only, GradScaler's own path is kept: it checks and
    unscales in one pass, where the fused path adds a pass and a division, and bfloat16, with
    float32's exponent range, divides by its power-of-two scales exactly (to 2^-126); only a
    scale that is not a power of two (an init_scale chosen so) gives a quotient rounded to
    bfloat16 there."""
    device = None if optimizer.weight_stats is None else optimizer.weight_stats.device
    return device is not None and (device.type != "cpu" or any(
        p.dtype is torch.float16 for group in optimizer.param_groups for p in group["params"]))


def amp_scaling(optimizer) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], list]:
    """What GradScaler.step set on the optimizer: (``found_inf`` as a bool on the parameters'
    device, which skips the fused calls there, or None; ``grad_scale`` as a float32 0-d tensor
    there, by which the fused step divides each gradient in float32, or None; the gradients it
    reads scaled, which the step unscales in their dtype after it, or []). ``grad_scale`` is
    None when the user called ``scaler.unscale_`` first. On a GPU the host state of a skipped
    step is settled at the next step or state_dict(), as inside backward. A gradient whose
    dtype is not its parameter's (assigned by hand) would be converted to it still scaled,
    which can overflow: then every gradient is unscaled by torch first, in its own dtype."""
    grad_scale = getattr(optimizer, "grad_scale", None)
    found_inf = getattr(optimizer, "found_inf", None)
    if (grad_scale is None and found_inf is None) or optimizer.weight_stats is None:
        return None, None, []
    device = optimizer.weight_stats.device
    skip = None if found_inf is None else torch.as_tensor(found_inf, device=device).reshape(()) != 0
    if grad_scale is None:
        return skip, None, []
    stepped = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]
               if p.grad is not None]
    for p, g in stepped:
        if g.layout is not torch.strided:
            grad_like(p, g)  # raises, before any gradient is changed
    scale = grad_scale.to(device=device, dtype=torch.float32).reshape(())
    grads = [g for _, g in stepped]
    if any(g.dtype is not p.dtype for p, g in stepped):
        if grads:
            torch._foreach_div_(grads, scale)
        return skip, None, []
    return skip, scale, grads
