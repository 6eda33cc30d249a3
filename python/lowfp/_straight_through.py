"""The straight-through estimator of every rounding lowfp offers (quantize, S2FP8): the forward
pass rounds, the backward pass hands the gradient on unchanged or rounded by ``round_grad``."""

from __future__ import annotations

from typing import Callable, Optional

import torch


class StraightThrough(torch.autograd.Function):
    """``StraightThrough.apply(x, forward, round_grad)``: ``forward(x)`` is the result;
    ``round_grad(grad)`` (when not None) rounds the gradient on its way back to x."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor],
                round_grad: Optional[Callable[[torch.Tensor], torch.Tensor]]):
        ctx.round_grad = round_grad
        return forward(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.round_grad is not None:
            grad = ctx.round_grad(grad)
        return grad, None, None
