"""ExtraBitsSGD: torch.optim.SGD on 16-bit weights plus extra bits."""

from __future__ import annotations

from typing import Optional

import torch

from .hyper import check_bool, check_common, check_real, check_torch_switches
from .base import ExtraBitsOptimizer

class ExtraBitsSGD(ExtraBitsOptimizer):
    """torch.optim.SGD on W' = 16-bit weight + ``extra_bits`` packed bits (docs/design.md §5).

    Args: as torch.optim.SGD (``lr=1e-3, momentum=0, dampening=0, weight_decay=0,
    nesterov=False, maximize=False``), plus ``extra_bits`` (k: 1-16 for bfloat16, 1-13 for
    float16), ``rounding`` of the 16-bit weights (``"toward_zero"``, ``"nearest"``,
    ``"stochastic"``), ``state_dtype`` of the momentum buffer (float32 or bfloat16) and
    ``param_dtype`` (the 16-bit type float32 parameters are converted to) and ``weight_format``
    (None, or a lowfp format whose values param_dtype holds, e.g. ``"float8_e5m2"``: the weights
    are kept on its grid, the extra bits continue below its last bit). torch's ``foreach``
    and ``fused`` are accepted and change nothing (the step is always lowfp's fused kernel);
    ``differentiable=True`` is refused. ``lr`` may be a 1-element tensor, as in torch.optim
    (schedulers fill it in place); each step reads it as a float, as torch's default CPU step.
    ``generator``: a torch.Generator that stochastic rounding's seeds are drawn from (default:
    torch's default CPU generator). With DistributedDataParallel, pass one seeded alike on every
    rank so that the replicas round alike and stay identical. Its state is not part of
    ``state_dict()`` (nor is torch's own RNG state): save ``generator.get_state()`` beside it to
    resume bit for bit.
    """

    _optimizer = "sgd"

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, differentiable: bool = False,
                 fused: Optional[bool] = None, extra_bits: int = 16, rounding: str = "toward_zero",
                 state_dtype: torch.dtype = torch.float32, param_dtype: torch.dtype = torch.bfloat16,
                 generator: Optional[torch.Generator] = None, weight_format=None):
        check_torch_switches(foreach, fused, differentiable)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, extra_bits=extra_bits,
                        rounding=rounding, state_dtype=state_dtype, param_dtype=param_dtype,
                        weight_format=weight_format)
        super().__init__(params, defaults, generator)

    @staticmethod
    def _check_hyperparameters(group: dict) -> None:
        check_common(group)
        check_real(group, "momentum", "Invalid momentum value")
        check_real(group, "dampening", "Invalid dampening value")
        check_bool(group, "nesterov")
        check_bool(group, "maximize")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def _batch_key(self, group, state):
        return (group["momentum"] != 0 and "momentum_buffer" not in state,)

    def _hyper(self, group, key, device_type):
        (first,) = key
        return dict(neg_lr=-float(group["lr"]), momentum=group["momentum"],
                    one_minus_dampening=1 - group["dampening"], weight_decay=group["weight_decay"],
                    nesterov=group["nesterov"], maximize=group["maximize"], first_step=first,
                    has_momentum=group["momentum"] != 0)

    def _host_state_changed(self, key) -> bool:
        return key[0]  # the first momentum step: the buffer is taken as existing from now on

    def _undo_host_state(self, state, key) -> None:
        del state["momentum_buffer"]  # still zeros: the next step is the first again

    def _moments(self, p, group, state_dtype, state):
        if group["momentum"] == 0:
            return ()
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(p, dtype=state_dtype)
        return (buf,)


