"""Dynamic loss scaling that also sees emulated overflows (docs/design.md §6)."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ._dtensor import is_dtensor
from . import backends
from ._checks import is_int
from ._non_finite import check_non_finite

__all__ = ["DynamicLossScaler"]

_READY, _UNSCALED, _STEPPED = 0, 1, 2


def any_non_finite(t: torch.Tensor, count_into: Optional[torch.Tensor] = None, *,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Whether t holds a NaN or an infinity, as a bool tensor on t's device (never waited for);
    ``count_into``, a contiguous int64 tensor on that device, gets it (0 or 1) added to each
    element; ``out``, one bool on that device, receives it and is returned. ``isfinite(t).all()``
    first writes a bool per element. A dense float16/bfloat16/float32/float64 tensor on the CPU
    or a CUDA device is read once by lowfp's kernel (exponent bits all ones), check and count in
    one call (one launch on a GPU) where torch takes several; any other tensor by
    :func:`non_finite_by_torch`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested or t.is_quantized or t.layout != torch.strided:
        raise TypeError(f"t must be a dense (torch.strided) tensor, not nested or quantized; got "
                        f"layout {t.layout}")
    if count_into is not None and (not isinstance(count_into, torch.Tensor)
                                   or count_into.dtype is not torch.int64
                                   or not backends.same_device(count_into, t)
                                   or not count_into.is_contiguous()):
        raise ValueError(f"count_into must be a contiguous int64 tensor on {t.device}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype is not torch.bool
                            or out.numel() != 1 or not backends.same_device(out, t)):
        raise ValueError(f"out must be a one-element bool tensor on {t.device}")
    found = any_non_finite_into(t, out, count_into)
    written = [x for x in (out, count_into) if x is not None]
    if written:  # lowfp's kernel writes them through their pointers: tell autograd, as torch does
        torch.autograd.graph.increment_version(written)
    return found


def any_non_finite_into(t: torch.Tensor, out: Optional[torch.Tensor],
                        count_into: Optional[torch.Tensor]) -> torch.Tensor:
    """any_non_finite without checking ``out`` and ``count_into``, for callers that made them
    (the hooks of step inside backward, one call per parameter). Traced (torch.compile, fake and
    meta tensors) it is the operator lowfp::any_non_finite; in eager code the kernel is called
    directly, which saves the dispatcher's few microseconds a parameter."""
    if (torch.compiler.is_compiling() or type(t) in backends.TRACING_TYPES
            or t.device.type == "meta"):
        found = torch.ops.lowfp.any_non_finite(t)
        if out is not None:
            out.view(()).copy_(found)
            found = out
        if count_into is not None:
            count_into.add_(found.reshape(()).to(count_into.dtype))
        return found
    return check_non_finite(t, out, count_into)


def _unscale_and_find_non_finite(grads: List[torch.Tensor], inv: float) -> torch.Tensor:
    """Multiply each gradient by inv in place, in its own dtype, then say (a bool tensor, not
    waited for) whether any is not finite: on the CPU one lowfp kernel call per gradient;
    elsewhere, where each call is a launch, torch's multi-tensor calls for all of them."""
    if not grads:
        return torch.zeros((), dtype=torch.bool)
    cpu = [g for g in grads if g.is_cpu]
    others = [g for g in grads if not g.is_cpu]
    return _any_of(([_unscale_one_by_one(cpu, inv)] if cpu else []) +
                   ([_unscale_multi_tensor(others, inv)] if others else []))


def _on_any_rank(found: torch.Tensor, meshes) -> torch.Tensor:
    """Whether ``found`` holds on any rank of the device meshes of sharded gradients: every rank
    must skip the same steps, though each checked only its own shards (and its own emulated
    backward overflows)."""
    flag = found.to(torch.int32).reshape(1)
    for mesh in meshes:
        for dim in range(mesh.ndim):
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX,
                                         group=mesh.get_group(dim))
    return flag.reshape(()) != 0


def _any_of(flags: List[torch.Tensor]) -> torch.Tensor:
    """One bool that is true when any of the 0-d bools `flags` (at least one) is: on their
    device when they share one (not waited for), else on the CPU (which waits)."""
    if len(flags) == 1:
        return flags[0]
    if len({f.device for f in flags}) == 1:
        return torch.stack(flags).any()
    return torch.stack([f.cpu() for f in flags]).any()


def _unscale_one_by_one(grads: List[torch.Tensor], inv: float) -> torch.Tensor:
    """_unscale_and_find_non_finite by a multiply and lowfp's check per gradient (one pass each
    over a dense CPU gradient)."""
    return _any_of([any_non_finite(g.mul_(inv)) for g in grads])  # checked while in cache


def _unscale_multi_tensor(grads: List[torch.Tensor], inv: float) -> torch.Tensor:
    """_unscale_and_find_non_finite (for the gradients not on the CPU) by torch's multi-tensor
    calls for each (device, dtype): a multiply, then the infinity norm (the largest magnitude,
    NaN or infinite exactly when some element is; unlike a sum of squares it cannot overflow).
    GradScaler's own check, _amp_foreach_non_finite_check_and_unscale_, has no bfloat16 CUDA
    kernel and looks at the values before they are unscaled."""
    by_device_and_dtype: Dict[tuple, List[torch.Tensor]] = {}
    for g in grads:
        by_device_and_dtype.setdefault((g.device, g.dtype), []).append(g)
    non_finite = []
    for same in by_device_and_dtype.values():
        torch._foreach_mul_(same, inv)
        nonempty = [g for g in same if g.numel()]  # torch: no infinity norm of nothing
        if not nonempty:
            continue
        largest = torch.stack(torch._foreach_norm(nonempty, float("inf")))
        non_finite.append(~torch.isfinite(largest).all())
    if not non_finite:  # every gradient empty
        return torch.zeros((), dtype=torch.bool, device=grads[0].device)
    return _any_of(non_finite)


class DynamicLossScaler:
    """torch.amp.GradScaler's interface and defaults (``scale``, ``unscale_``, ``step``,
    ``update``, ``get_scale``, ``state_dict``), for float32, bfloat16 and float16 parameters and
    lowfp's optimizers.

    The loss is multiplied by the scale; ``step`` unscales the gradients, and skips the optimizer
    step when any gradient is not finite **or** when an emulated backward rounding of
    ``emulator`` overflowed in this step (a saturating backward format hides an overflow from a
    finiteness check, its counts do not). ``update`` then multiplies the scale by
    ``backoff_factor`` after a skipped step, and by ``growth_factor`` after ``growth_interval``
    steps in a row without one.

    Gradients are unscaled in their own dtype (float16 gradients of tiny values can underflow
    there, as they would on hardware). For float16 parameters of lowfp's ExtraBits optimizers,
    torch.amp.GradScaler keeps them: it hands its scale to their step, which divides in
    float32. With :func:`lowfp.optim.step_in_backward` pass the scaler to it: each parameter is
    unscaled and checked by itself, the pass reports a non-finite gradient here, and
    ``update()`` is called after ``backward()`` with no ``step``.
    """

    def __init__(self, device="cpu", init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 emulator=None):
        if not (isinstance(init_scale, (int, float)) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive number, got {init_scale!r}")
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {enabled!r}")
        self.device = torch.device(device)
        self._scale = float(init_scale)
        self.set_growth_factor(growth_factor)
        self.set_backoff_factor(backoff_factor)
        self.set_growth_interval(growth_interval)
        self._growth_tracker = 0
        self._enabled = enabled
        self._states: Dict[int, dict] = {}
        # step_in_backward handles' counts of parameters skipped in their current pass (device
        # tensors, read at update()), by handle.
        self._skips_in_backward: Dict[int, torch.Tensor] = {}
        self.emulator = None
        if emulator is not None:
            self.watch(emulator)

    def watch(self, emulator) -> "DynamicLossScaler":
        """Also back off when ``emulator``'s backward roundings overflow; its history records
        the scale of every step."""
        from .emulate import Emulator
        if not isinstance(emulator, Emulator):
            raise TypeError(f"emulator must be a lowfp Emulator (from lowfp.emulate), got "
                            f"{type(emulator).__name__}")
        self.emulator = emulator
        emulator.scaler = self
        return self

    # -- GradScaler's interface ---------------------------------------------------------------
    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        if not (isinstance(new_factor, (int, float)) and new_factor > 1.0):
            raise ValueError(f"growth_factor must be a number > 1, got {new_factor!r}")
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        if not (isinstance(new_factor, (int, float)) and 0.0 < new_factor < 1.0):
            raise ValueError(f"backoff_factor must be a number in (0, 1), got {new_factor!r}")
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        if not is_int(new_interval) or new_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {new_interval!r}")
        self._growth_interval = new_interval

    def scale(self, outputs):
        """outputs (a tensor or nested lists/tuples of tensors) times the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs * self._scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"outputs must be a tensor or a list/tuple of tensors, got {type(outputs).__name__}")

    def _state(self, optimizer) -> dict:
        return self._states.setdefault(id(optimizer), {"stage": _READY, "found_inf": None})

    def unscale_(self, optimizer) -> None:
        """Divide optimizer's gradients by the scale in place and note whether any is not finite
        (once per step; ``step`` calls it when it was not called)."""
        if not self._enabled:
            return
        state = self._state(optimizer)
        if state["stage"] == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] == _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv = 1.0 / self._scale
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        if any(g.is_sparse for g in grads):
            raise ValueError("DynamicLossScaler does not support sparse gradients")
        meshes = {id(g.device_mesh): g.device_mesh for g in grads if is_dtensor(g)}
        with torch.no_grad():  # a DTensor gradient (FSDP2): this rank's shard
            found = _unscale_and_find_non_finite([g._local_tensor if is_dtensor(g) else g
                                                  for g in grads], inv)
        if self.emulator is not None:
            found = found.to(self.emulator.counts.device) | (self.emulator.backward_overflows() > 0)
        if meshes:
            found = _on_any_rank(found, meshes.values())
        state["found_inf"] = found
        state["stage"] = _UNSCALED

    def step(self, optimizer, *args, **kwargs):
        """``optimizer.step(*args, **kwargs)`` unless this step found a non-finite gradient or an
        emulated backward overflow; returns its result (None when skipped)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if DynamicLossScaler is enabled.")
        state = self._state(optimizer)
        if state["stage"] == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] == _READY:
            self.unscale_(optimizer)
        result = None
        state["found_inf"] = bool(state["found_inf"])  # the step's one wait for the device
        if not state["found_inf"]:
            result = optimizer.step(*args, **kwargs)
        state["stage"] = _STEPPED
        return result

    def _watch_skips_in_backward(self, handle, count: torch.Tensor) -> None:
        """Called by step_in_backward at the start of a backward pass: ``count`` will hold the
        number of parameters whose unscaled gradient was not finite in that pass."""
        self._skips_in_backward[id(handle)] = count

    def update(self, new_scale: Optional[float] = None) -> None:
        """Back off after a skipped step, grow after growth_interval clean steps (or set
        ``new_scale``); starts the next iteration."""
        if not self._enabled:
            return
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                new_scale = float(new_scale)
            if not (isinstance(new_scale, (int, float)) and new_scale > 0):
                raise ValueError(f"new_scale must be a positive number, got {new_scale!r}")
            self._scale = float(new_scale)
        else:
            infs = [s["found_inf"] for s in self._states.values() if s["found_inf"] is not None]
            found = any(bool(f) for f in infs + list(self._skips_in_backward.values()))
            if not infs and not found and self.emulator is not None:
                found = bool(self.emulator.backward_overflows() > 0)  # step_in_backward runs
            if found:
                self._scale *= self._backoff_factor
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    self._scale *= self._growth_factor
                    self._growth_tracker = 0
        self._states.clear()
        self._skips_in_backward.clear()

    def state_dict(self) -> dict:
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of DynamicLossScaler.")
        self._scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.get_scale()}, growth_tracker={self._growth_tracker}, "
                f"watching={'an emulator' if self.emulator is not None else 'nothing'})")
