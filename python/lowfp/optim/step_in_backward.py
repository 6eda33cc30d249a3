"""Stepping each parameter inside the backward pass, as soon as its gradient is accumulated."""

from __future__ import annotations

import weakref
from typing import Dict, Optional, Protocol, Tuple, runtime_checkable

import torch

from .._checks import is_real
from .._dtensor import is_dtensor
from ..scaler import any_non_finite_into
from .ddp import refuse_if_in_ddp


@runtime_checkable
class StepsInBackward(Protocol):
    """What stepping inside backward needs of an optimizer (lowfp's ExtraBits optimizers): its
    param groups, the handle stepping it (one at a time), a stochastic seed per group for a
    pass, one parameter's step with a gradient and the device's skip flag, and the host-side
    state of such steps settled once the device has decided them."""

    param_groups: list
    _step_in_backward: Optional["StepInBackward"]

    def _draw_group_seeds(self) -> Dict[int, int]: ...

    def _step_parameter(self, gi: int, p: torch.Tensor, grad: torch.Tensor, seed: int,
                        found_inf: Optional[torch.Tensor]) -> None: ...

    def _settle_host_state(self) -> None: ...


def grad_scaler_inverse(scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    """torch.amp.GradScaler's unscale factor for a scale tensor (on any device): the float32
    rounding of the float64 reciprocal, as its unscale_ computes it; a 0-d tensor on device,
    made without waiting for the scale's device."""
    return scale.to(device).reshape(()).double().reciprocal().float()


class _EndOfPass:
    """The callback queued on the autograd engine at the first hook of a backward pass. The
    engine holds it until the pass's graph task is freed, so a dead weak reference to it means
    the pass is over, also when it raised (an error runs no final callbacks). A reentrant
    backward inside the pass (checkpoint with use_reentrant=True) is part of the pass: the
    outer task, and so this callback, are still alive."""

    __slots__ = ("handle", "__weakref__")

    def __init__(self, handle: "StepInBackward"):
        self.handle = handle

    def __call__(self) -> None:
        self.handle._end_of_backward()


class StepInBackward:
    """The handle :func:`step_in_backward` returns: ``remove()`` takes the hooks off;
    ``skipped`` counts parameter steps skipped for a non-finite gradient and ``found_inf`` says
    whether the last backward pass skipped one. Both are kept on the parameters' device (the
    hooks never wait for it); reading them waits."""

    def __init__(self, optimizer: StepsInBackward, clip_value: Optional[float], scaler):
        self.optimizer, self.clip_value, self.scaler = optimizer, clip_value, scaler
        # Parameters skipped [in all, in the current pass], on the parameters' device.
        self._skip_counts: Optional[torch.Tensor] = None
        # Of the current pass, on the device: whether hooked parameter i's gradient was not finite.
        self._found_inf: Tuple[torch.Tensor, ...] = ()
        self._hooked = 0  # parameters hooked so far; hook i writes _found_inf[i]
        self._inverse_scale = 1.0  # of the current pass: a float, or a float32 tensor on the device
        self._seeds: Dict[int, int] = {}  # per group, drawn at the first hook of a pass
        self._pass_end: Optional[weakref.ref] = None  # to the current pass's _EndOfPass
        self._handles = []
        optimizer._step_in_backward = self
        for gi in range(len(optimizer.param_groups)):
            self._hook_group(gi)

    @property
    def skipped(self) -> int:
        return 0 if self._skip_counts is None else int(self._skip_counts[0])

    @property
    def found_inf(self) -> bool:
        return self._skip_counts is not None and bool(self._skip_counts[1])

    def _hook_group(self, gi: int) -> None:
        for p in self.optimizer.param_groups[gi]["params"]:
            self._handles.append(p.register_post_accumulate_grad_hook(
                lambda param, gi=gi, i=self._hooked: self._hook(param, gi, i)))
            self._hooked += 1

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.optimizer._settle_host_state()
        if self.optimizer._step_in_backward is self:
            self.optimizer._step_in_backward = None

    def _in_pass(self) -> bool:
        return self._pass_end is not None and self._pass_end() is not None

    def _start_pass(self, device: torch.device) -> None:
        opt = self.optimizer
        opt._settle_host_state()  # left over when the last backward pass raised
        self._seeds = opt._draw_group_seeds()
        if self._skip_counts is None:
            self._skip_counts = torch.zeros(2, dtype=torch.int64, device=device)
        else:
            self._skip_counts[1].zero_()
        # One view per parameter, made in one call here rather than by indexing in each hook.
        self._found_inf = torch.empty(self._hooked, dtype=torch.bool, device=device).unbind()
        if self.scaler is not None:
            self._inverse_scale = self._read_inverse_scale(device)
            note = getattr(self.scaler, "_watch_skips_in_backward", None)  # lowfp.DynamicLossScaler
            if note is not None:
                note(self, self._skip_counts[1])
        end = _EndOfPass(self)
        torch.autograd.Variable._execution_engine.queue_callback(end)
        self._pass_end = weakref.ref(end)

    def _read_inverse_scale(self, device: torch.device):
        # torch.amp.GradScaler keeps its scale on the device, where get_scale() would wait for
        # it; unscale as its unscale_ does.
        enabled = getattr(self.scaler, "is_enabled", None)
        if callable(enabled) and not enabled():
            return 1.0
        read_async = getattr(self.scaler, "_get_scale_async", None)
        scale = read_async() if callable(read_async) else None
        if isinstance(scale, torch.Tensor):
            return grad_scaler_inverse(scale, device)
        return 1.0 / float(self.scaler.get_scale())

    def _end_of_backward(self) -> None:
        self._pass_end = None
        self.optimizer._settle_host_state()

    def _hook(self, p: torch.Tensor, gi: int, i: int) -> None:
        # A plain backward pass runs hooks with grad mode off already; the context (a few us a
        # parameter, which the narrow models of bench_optim show) only for create_graph=True.
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._hook(p, gi, i)
        opt = self.optimizer
        if not self._in_pass():  # the first parameter of this backward pass
            self._start_pass(p.device)
        g = p.grad
        if self.scaler is not None:
            # In the gradient's dtype, as GradScaler.unscale_ and DynamicLossScaler.unscale_ do:
            # a value that overflows it is found here, not stepped with as inf.
            g = g * self._inverse_scale
        # Decided on the device: the fused step reads it and does nothing when it is true.
        found_inf = any_non_finite_into(g, self._found_inf[i], self._skip_counts)
        if self.clip_value is not None:
            g = g.clamp(-self.clip_value, self.clip_value)
        opt._step_parameter(gi, p, g, self._seeds[gi], found_inf)
        p.grad = None  # freed as soon as it is used (the device keeps it until the step has run)


def step_in_backward(optimizer, *, clip_value: Optional[float] = None, scaler=None,
                     clip_norm: Optional[float] = None, accumulation_steps: int = 1,
                     model: Optional[torch.nn.Module] = None) -> StepInBackward:
    """Step each parameter as soon as its gradient is accumulated, then free that gradient, so
    the gradients of the whole model never exist at once (docs/design.md §5). Call ``loss.backward()``
    and nothing else: ``optimizer.step()`` and ``zero_grad()`` are not needed.

    Args:
        optimizer: an ExtraBitsSGD/Adam/AdamW.
        clip_value: clamp every gradient element to [-clip_value, clip_value] (after unscaling).
        scaler: a loss scaler with ``get_scale()``: gradients are multiplied by its reciprocal
            in their own dtype (as ``GradScaler.unscale_``); a parameter whose unscaled gradient
            is not finite is not stepped (counted in ``handle.skipped``; the
            pass sets ``handle.found_inf``, and lowfp.DynamicLossScaler's ``update()`` backs off).
            torch.amp.GradScaler's scale is read on the device; its ``update()`` needs
            ``new_scale`` here, as no ``step`` records its checks.
        clip_norm, accumulation_steps, model: refused where they cannot work: norm clipping needs
            every gradient before any step, accumulation needs gradients kept across backward
            passes, and DistributedDataParallel reduces gradients after these hooks would run
            (a live DDP model's parameters are refused without model= too: its reducer holds
            their gradient accumulators).
    Returns a handle whose ``remove()`` restores ordinary stepping.

    On a GPU the hooks never wait for it: the finiteness check is a flag on the device that the
    fused step reads. Host-side state waits once, at the end of the pass: Adam's step counts are
    applied then (to the parameters not skipped), and SGD's first momentum step is taken back
    for a skipped one. A pass that raises is settled by the next pass, ``state_dict()`` or
    ``load_state_dict()``. A reentrant backward inside the pass (``checkpoint`` with
    ``use_reentrant=True``) is part of it. A part of the pass that still reads a parameter after
    its gradient is complete (say through ``w.detach()``) would see the stepped weight; autograd
    sees the step (as any in-place update) and raises, as with torch's own recipe.
    """
    if not isinstance(optimizer, StepsInBackward):
        raise TypeError(f"optimizer must be a lowfp ExtraBits optimizer, got {type(optimizer).__name__}")
    if optimizer._step_in_backward is not None:
        raise ValueError("optimizer already steps inside backward (each parameter would step "
                         "twice); call remove() on the handle step_in_backward returned first")
    if getattr(optimizer, "_lowfp_low_precision_states", None) is not None:
        raise ValueError("the optimizer keeps its moments in low precision (low_precision_states), "
                         "which rounds them after step(); steps inside backward would skip that")
    if clip_norm is not None:
        raise ValueError("clip_norm: gradient norm clipping needs every gradient before any "
                         "parameter steps, which stepping inside backward does not allow; use "
                         "clip_value (element-wise) or step normally")
    if accumulation_steps != 1:
        raise ValueError("accumulation_steps: gradient accumulation needs gradients kept across "
                         "backward passes, but stepping inside backward frees each one at once")
    if model is not None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError("model: DistributedDataParallel all-reduces gradients after the per-"
                         "parameter hooks would have stepped; step normally with DDP")
    for group in optimizer.param_groups:  # a DDP model not passed as model=: its reducer shows
        for p in group["params"]:
            if is_dtensor(p):
                raise ValueError(
                    "a parameter is a DTensor (FSDP2's fully_shard, tensor parallel): FSDP2 gives "
                    "each sharded parameter its gradient after its reduce-scatter, outside "
                    "autograd, so a per-parameter hook never sees it; step normally (FSDP2 frees "
                    "the unsharded gradients itself)")
            refuse_if_in_ddp(p, "the per-parameter hooks would step before DDP's "
                                  "all-reduce of the gradients; step normally with DDP")
    if clip_value is not None and (not is_real(clip_value) or not clip_value > 0):
        raise ValueError(f"clip_value must be a positive number, got {clip_value!r}")
    if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
        raise TypeError("scaler must have a get_scale() method (torch.amp.GradScaler, "
                        "lowfp.DynamicLossScaler)")
    return StepInBackward(optimizer, clip_value, scaler)
