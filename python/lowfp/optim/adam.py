"""ExtraBitsAdam and ExtraBitsAdamW: torch.optim.Adam/AdamW on 16-bit weights plus extra bits."""

from __future__ import annotations

from typing import Optional

import torch

from .._native import add_one_to_float32s
from .base import ExtraBitsOptimizer
from .hyper import check_bool, check_common, check_real, check_torch_switches, hyperparameter


class ExtraBitsAdam(ExtraBitsOptimizer):
    """torch.optim.Adam on W' = 16-bit weight + ``extra_bits`` packed bits (docs/design.md §5).

    Args: as torch.optim.Adam (``lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
    amsgrad=False, maximize=False, decoupled_weight_decay=False``: True is AdamW's decay, also
    per param group), plus ``extra_bits``, ``rounding``, ``state_dtype`` (of exp_avg /
    exp_avg_sq), ``param_dtype`` and ``generator`` as in :class:`ExtraBitsSGD`. ``foreach`` and
    ``fused`` are accepted and change nothing; ``capturable=True`` and ``differentiable=True``
    are refused.
    ``lr`` and ``betas`` may be 1-element tensors (both betas, or neither), read as floats at
    each step.
    """

    _optimizer = "adam"
    _decoupled = False  # the class's decoupled_weight_decay (AdamW: True)

    @classmethod
    def _added_group_keys(cls) -> dict:
        return {**super()._added_group_keys(), "decoupled_weight_decay": cls._decoupled}

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: Optional[bool] = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, decoupled_weight_decay: bool = False,
                 extra_bits: int = 16, rounding: str = "toward_zero",
                 state_dtype: torch.dtype = torch.float32, param_dtype: torch.dtype = torch.bfloat16,
                 generator: Optional[torch.Generator] = None, weight_format=None):
        check_torch_switches(foreach, fused, differentiable, capturable)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize,
                        decoupled_weight_decay=decoupled_weight_decay, extra_bits=extra_bits,
                        rounding=rounding, state_dtype=state_dtype, param_dtype=param_dtype,
                        weight_format=weight_format)
        super().__init__(params, defaults, generator)

    @staticmethod
    def _check_hyperparameters(group: dict) -> None:
        check_common(group)
        check_real(group, "eps", "Invalid epsilon value")
        betas = group["betas"]
        if isinstance(betas, torch.Tensor) or not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair of floats (beta1, beta2), got {betas!r}")
        betas = tuple(hyperparameter(b, f"betas[{i}]") for i, b in enumerate(betas))
        if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
            raise ValueError("betas must be either both floats or both Tensors")  # as torch.optim
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameters: {betas} (betas must be in [0, 1))")
        group["betas"] = betas
        for name in ("amsgrad", "maximize", "decoupled_weight_decay"):
            check_bool(group, name)

    def _batch_key(self, group, state):
        step = state.get("step")
        return (1.0 if step is None else float(step) + 1,)

    def _hyper(self, group, key, device_type):
        (step,) = key
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        beta1, beta2 = map(float, group["betas"])
        decoupled = group["decoupled_weight_decay"]
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        decay = 1 - lr * wd if (decoupled and wd != 0) else 1.0
        return dict(decay=decay, weight_decay=0.0 if decoupled else wd, lerp_weight=1 - beta1,
                    beta2=beta2, one_minus_beta2=1 - beta2,
                    bias_correction2_sqrt=bias_correction2 ** 0.5, eps=eps,
                    neg_step_size=-step_size, decoupled=decoupled, amsgrad=group["amsgrad"],
                    maximize=group["maximize"], cuda_association=self._steps_like_cuda(device_type))

    def _moments(self, p, group, state_dtype, state):
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:  # amsgrad switched on later
            state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype)
        out = [state["exp_avg"], state["exp_avg_sq"]]
        if group["amsgrad"]:
            out.append(state["max_exp_avg_sq"])
        return out

    def _after_step(self, states) -> None:
        add_one_to_float32s([state["step"] for state in states])

    def _host_state_changed(self, key) -> bool:
        return True  # the step count, after the step (so a skip has nothing to take back)


class ExtraBitsAdamW(ExtraBitsAdam):
    """torch.optim.AdamW (decoupled weight decay, default ``weight_decay=1e-2``) on W' =
    16-bit weight + ``extra_bits`` packed bits; arguments as :class:`ExtraBitsAdam`."""

    _decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, **kwargs):
        if "decoupled_weight_decay" in kwargs:  # as torch.optim.AdamW, which always decouples
            raise TypeError("ExtraBitsAdamW() got an unexpected keyword argument 'decoupled_weight_decay'")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, decoupled_weight_decay=True,
                         **kwargs)
