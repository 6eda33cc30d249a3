"""Optimizer moments kept in a low-precision format (docs/design.md §5.1), as torchao's low-bit
optimizers, FlashOptim and MS-AMP keep them in 8 or 4 bits: after each ``step()`` every named
moment is rounded to its format, so that the next step starts from the value such storage holds.

    >>> opt = torch.optim.AdamW(model.parameters())        # or an ExtraBits optimizer
    >>> states = lowfp.optim.low_precision_states(opt, exp_avg="fp8_e4m3_block128",
    ...                                          exp_avg_sq="float8_e4m3fn", sqrt_second_moment=True)
    >>> states.memory_bytes()                              # as such storage would hold them

The moments stay float32 tensors holding the rounded values (lowfp emulates the storage), so the
optimizer's own update runs unchanged on them.
"""

from __future__ import annotations

from typing import Dict, Optional, Union

import torch

from .._checks import check_choice
from ..formats import Format, to_format
from ..quantize import quantize
from ..scaled.config import Scaled, to_scaled
from .sharded import local
from .state import MOMENT_KEYS

__all__ = ["LowPrecisionStates", "low_precision_states", "STATE_ROUNDINGS"]

STATE_ROUNDINGS = ("nearest", "stochastic")
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")
ROUNDS_KEY = "lowfp_state_rounds"  # per parameter: how many times its moments were rounded
_U64 = (1 << 64) - 1


def _state_format(value, name: str) -> Optional[Union[Format, Scaled]]:
    if value is None:
        return None
    scaled = to_scaled(value)
    if scaled is not None:
        if isinstance(scaled.block, tuple):
            raise ValueError(f"{name}: moments are rounded as flat tensors (row-major over the "
                             f"parameter), so 2-D blocks do not apply; got {scaled}")
        return scaled
    fmt = to_format(value, name)
    reason = fmt.fit_error(torch.float32)
    if reason:
        raise ValueError(f"{name}: {fmt} does not fit the float32 moments that hold it ({reason})")
    return fmt


class LowPrecisionStates:
    """The moments of ``optimizer`` rounded after each of its steps (low_precision_states)."""

    def __init__(self, optimizer: torch.optim.Optimizer, formats: Dict[str, Union[Format, Scaled]],
                 rounding: str, sqrt_second_moment: bool, seed: int):
        self.optimizer = optimizer
        self.formats = formats
        self.rounding = rounding
        self.sqrt_second_moment = sqrt_second_moment
        self.seed = seed
        self._handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: self.round_states())
        optimizer._lowfp_low_precision_states = self

    def remove(self) -> None:
        """Stop rounding the moments (those already rounded stay as they are)."""
        self._handle.remove()
        if getattr(self.optimizer, "_lowfp_low_precision_states", None) is self:
            del self.optimizer._lowfp_low_precision_states

    def _seed(self, index: int, key: str) -> int:
        """Stochastic rounding's Philox key for parameter ``index`` (param_groups order) and one
        moment: distinct per pair, fixed by ``seed``."""
        return (self.seed * 0x9E3779B97F4A7C15 + index * len(MOMENT_KEYS) + MOMENT_KEYS.index(key)) & _U64

    @torch.no_grad()
    def round_states(self) -> None:
        """Round every named moment of every parameter with state (the step's post hook)."""
        index = -1
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                index += 1
                state = self.optimizer.state.get(p)
                if not state:
                    continue
                rounds = state.get(ROUNDS_KEY, 0)
                for key, fmt in self.formats.items():
                    t = state.get(key)
                    if not torch.is_tensor(t):
                        continue
                    self._round(local(t), fmt, key, index, rounds)
                state[ROUNDS_KEY] = rounds + 1

    def _round(self, t: torch.Tensor, fmt, key: str, index: int, rounds: int) -> None:
        flat = t.reshape(-1)
        compand = self.sqrt_second_moment and key in SECOND_MOMENTS
        v = torch.sqrt(flat) if compand else flat
        kwargs = {}
        if self.rounding == "stochastic":  # a fresh run of Philox words per rounding of the state
            kwargs = dict(seed=self._seed(index, key), offset=rounds * ((v.numel() + 3) // 4))
        q = quantize(v, fmt, self.rounding, **kwargs)
        t.copy_((q * q if compand else q).reshape(t.shape))

    def memory_bytes(self) -> Dict[str, float]:
        """Bytes the parameters and moments take in storage of their formats (moments without
        a format: their tensors' bytes), and per parameter; for an ExtraBits optimizer its
        extra bits too."""
        params = moments = extra = 0.0
        count = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                shard = local(p)
                count += shard.numel()
                params += shard.numel() * shard.element_size()
                state = self.optimizer.state.get(p, {})
                for key in MOMENT_KEYS:
                    t = state.get(key)
                    if not torch.is_tensor(t):
                        continue
                    t = local(t)
                    fmt = self.formats.get(key)
                    moments += t.numel() * (fmt.bits / 8 if fmt is not None else t.element_size())
        if hasattr(self.optimizer, "memory_bytes"):
            extra = float(self.optimizer.memory_bytes().get("extra_bits", 0))
        total = params + extra + moments
        return {"weights": params, "extra_bits": extra, "moments": moments, "total": total,
                "per_parameter": total / count if count else 0.0}

    def __repr__(self) -> str:
        formats = ", ".join(f"{k}={v}" for k, v in self.formats.items())
        return (f"LowPrecisionStates({formats}, rounding={self.rounding!r}, "
                f"sqrt_second_moment={self.sqrt_second_moment})")


def low_precision_states(optimizer: torch.optim.Optimizer, *, exp_avg=None, exp_avg_sq=None,
                         max_exp_avg_sq=None, momentum_buffer=None, rounding: str = "nearest",
                         sqrt_second_moment: bool = False, seed: int = 0) -> LowPrecisionStates:
    """Keep ``optimizer``'s moments in low precision: after each ``step()``, each moment named
    with a format (a lowfp Format, a scaled format such as ``"fp8_e4m3_block128"`` or
    ``Scaled("float4_e2m1fn", block=32)``, or their strings; blocks run over the moment flattened
    row-major) is rounded to it, by ``rounding`` (``"nearest"`` or ``"stochastic"``: Philox
    words keyed by ``seed``, the parameter and the moment, a fresh run each step, the count kept
    in the state so that ``state_dict`` resumes the same draws). ``sqrt_second_moment``: the
    second moments (exp_avg_sq, max_exp_avg_sq) are stored as their square roots, v = Q(√v)²
    (FlashOptim's companding, which spends the format's range on √v's narrower spread).

    Works with torch.optim's optimizers and lowfp's ExtraBits ones (float32 moments: an
    ExtraBits optimizer with ``state_dtype=torch.float32``), not with ``step_in_backward``,
    whose steps run inside backward. Returns the handle (``memory_bytes()``, ``remove()``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_choice(rounding, STATE_ROUNDINGS, "rounding")
    if not isinstance(sqrt_second_moment, bool):
        raise TypeError(f"sqrt_second_moment must be a bool, got {sqrt_second_moment!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= _U64:
        raise ValueError(f"seed must be an int in [0, 2^64), got {seed!r}")
    if getattr(optimizer, "_lowfp_low_precision_states", None) is not None:
        raise ValueError("this optimizer's moments are already kept in low precision (remove() "
                         "the first handle to change their formats)")
    if getattr(optimizer, "_step_in_backward", None) is not None:
        raise ValueError("the optimizer steps inside backward (step_in_backward), where its "
                         "moments would not be rounded: keep them in low precision with step()")
    named = dict(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, max_exp_avg_sq=max_exp_avg_sq,
                 momentum_buffer=momentum_buffer)
    formats = {k: f for k, f in ((k, _state_format(v, k)) for k, v in named.items()) if f is not None}
    if not formats:
        raise ValueError("name at least one moment's format (exp_avg=, exp_avg_sq=, "
                         "max_exp_avg_sq=, momentum_buffer=)")
    for group in optimizer.param_groups:
        state_dtype = group.get("state_dtype")
        for p in group["params"]:
            dtype = state_dtype if state_dtype is not None else p.dtype
            if dtype != torch.float32:
                raise ValueError(f"moments in low precision need float32 moment tensors, which "
                                 f"hold every format's values; a parameter of shape {tuple(p.shape)} "
                                 f"has {dtype} moments (an ExtraBits optimizer: state_dtype=torch.float32)")
    return LowPrecisionStates(optimizer, formats, rounding, sqrt_second_moment, seed)
