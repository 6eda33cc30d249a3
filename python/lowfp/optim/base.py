"""The base of the ExtraBits optimizers: parameter groups and their conversion, the fused step
over a group, settling host-side state, state_dict, master weights and memory.

Subclasses give _optimizer (lowfp::extra_bits_step's name for their update), _check_hyperparameters,
_batch_key, _hyper, _moments and optionally
_after_step, _host_state_changed, _undo_host_state, _added_group_keys. step_in_backward reaches
the optimizer through _step_parameter, _draw_group_seeds, _settle_host_state and the
_step_in_backward attribute only."""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from .. import _C, backends
from .._checks import is_dtype_in
from .._dtensor import is_dtensor
from .._native import as_int64, draw_seed
from .._ops import HYPER_FIELDS, _extra_bits_step_impl
from ..backends import inverse_order, memory_order
from ..extra_bits import (check_weight_format, merge, pack, packed_words,
                          reorder_packed, split, unpack)
from ..stats import Stats
from . import _sharded
from ._ddp import _refuse_if_in_ddp
from ._state import (_EXTRA_KEYS, _LOWFP_GROUP_KEYS, _MOMENT_KEYS, _PARAM_DTYPES,
                     _STATE_DTYPES, _LayoutChanged, _check_buffers, _check_param_dtype, device_index,
                     _from_torch_state, _match_layout, _record_order, _same_memory_order)

if TYPE_CHECKING:
    from .step_in_backward import StepInBackward

_TORCH_SWITCHES = ("foreach", "fused", "capturable", "differentiable")  # torch.optim's, not here
GENERATOR_STATE = "generator_state"  # state_dict: the generator='s state, in the first group


class _ExtraBitsOptimizer(torch.optim.Optimizer):
    _optimizer = ""  # "sgd" or "adam": the update lowfp::extra_bits_step applies
    # torch's arithmetic differs between its CPU kernels and its CUDA foreach kernels (Adam's
    # addcmul and addcdiv, docs/design.md §5): None follows the parameters' device; True makes a
    # CPU optimizer step as torch does on CUDA (the CPU twin of a GPU run, in tests).
    _cuda_association: Optional[bool] = None

    @staticmethod
    def _check_hyperparameters(group: dict) -> None:
        """Raises TypeError/ValueError for a group's (or the defaults') bad hyperparameters."""
        raise NotImplementedError

    def __init__(self, params, defaults: dict, generator: Optional[torch.Generator] = None):
        self._check_hyperparameters(defaults)  # before any group: torch.optim's order of errors
        k, rounding = defaults["extra_bits"], defaults["rounding"]
        param_dtype, state_dtype = defaults["param_dtype"], defaults["state_dtype"]
        if not is_dtype_in(param_dtype, _PARAM_DTYPES):
            raise TypeError(f"param_dtype must be torch.float16 or torch.bfloat16, got {param_dtype}")
        defaults["weight_format"] = check_weight_format(
            defaults.get("weight_format"), param_dtype, k, rounding, k_name="extra_bits",
            dtype_name="param_dtype")
        if not is_dtype_in(state_dtype, _STATE_DTYPES):
            raise TypeError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {generator!r}")
        # Where stochastic rounding's seeds come from (None: torch's default CPU generator).
        self._generator = generator
        self.weight_stats: Optional[Stats] = None  # 16-bit weight roundings (on the params' device)
        self._step_in_backward: Optional[StepInBackward] = None  # the active handle, if any
        self._philox_offset: Dict[int, int] = {}  # per parameter, set once in add_param_group
        self._unsettled: List[tuple] = []  # (state, batch key, found_inf): see _settle_host_state
        super().__init__(params, defaults)

    # -- parameters -------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_new_group(group)
        except Exception:
            self.param_groups.pop()  # as torch.optim: a group that fails its checks is not added
            raise
        k, rounding = group["extra_bits"], group["rounding"]
        for p in group["params"]:
            if self.weight_stats is None:
                self.weight_stats = Stats(p.device)
            if p.dtype == torch.float32:  # its cut-off bits become its initial extra bits
                order = memory_order(p)  # packed in memory order; p keeps its layout
                w16, packed = split(p.detach() if order is None else p.detach().permute(order),
                                    group["param_dtype"], k, rounding, generator=self._generator,
                                    weight_format=group["weight_format"])
                p.data = w16 if order is None else w16.permute(inverse_order(order))
                p.grad = None
                self.state[p].update(extra=packed, extra_bits=k, rounding=rounding,
                                     param_dtype=group["param_dtype"],
                                     weight_format=group["weight_format"])
                _record_order(self.state[p], order)
        self._set_philox_offsets(group)
        if self._step_in_backward is not None:  # a group added while stepping inside backward
            self._step_in_backward._hook_group(len(self.param_groups) - 1)

    def _check_new_group(self, group: dict) -> None:
        """Everything about a new group's parameters that the fused step relies on, checked
        before any float32 parameter is converted."""
        k, rounding = group["extra_bits"], group["rounding"]
        self._check_hyperparameters(group)
        group.setdefault("weight_format", None)
        # k, rounding and the weight format for each dtype the group's weights will have
        dtypes = {(group["param_dtype"], "param_dtype") if p.dtype == torch.float32
                  else (p.dtype, "a parameter's dtype")
                  for p in group["params"] if p.dtype == torch.float32 or p.dtype in _PARAM_DTYPES}
        wf = group["weight_format"]
        for dtype, name in sorted(dtypes or {(group["param_dtype"], "param_dtype")}, key=str):
            wf = check_weight_format(group["weight_format"], dtype, k, rounding,
                                     k_name="extra_bits", dtype_name=name)
        group["weight_format"] = wf
        if not is_dtype_in(group["state_dtype"], _STATE_DTYPES):
            raise TypeError(f"state_dtype must be torch.float32 or torch.bfloat16, got {group['state_dtype']}")
        params = group["params"]
        if len({id(p) for p in params}) != len(params):
            # torch.optim only warns (and says it will become an error): one fused call would
            # update the same memory from two slots at once.
            raise ValueError("a parameter appears more than once in a param group")
        device = None if self.weight_stats is None else self.weight_stats.device
        for p in params:
            if is_dtensor(p):  # FSDP2, tensor parallel: each rank steps its shard
                _sharded.check_dtensor_parameter(p, group["param_dtype"])
                if rounding == "stochastic" and _sharded.shard_start(p) is None:
                    raise ValueError(
                        f"a DTensor parameter of shape {tuple(p.shape)} placed as {p.placements}: "
                        "stochastic rounding draws by global element index, which needs each "
                        "rank's shard to be one run of the row-major order (Shard(0), FSDP2's "
                        "default, or Replicate)")
            local = _sharded.local(p)
            if type(local) in backends.TRACING_TYPES or local.is_meta:
                backends.check_operand(local, "parameter")  # shapes only: lowfp's operators
            else:
                backends.native(local, "parameter")  # a CUDA parameter needs the CUDA build
            if device is None:
                device = p.device
            elif p.device != device:
                raise ValueError(f"all parameters must be on one device: {device} and {p.device}")
            if p.dtype == torch.float32:
                _refuse_if_in_ddp(
                    p, f"converting it to {group['param_dtype']} would disconnect that silently (DDP "
                    "would stop averaging its gradients), so build the optimizer before wrapping "
                    "the model in DDP (then model.to(param_dtype) for its buffers, then DDP)")
            elif p.dtype in _PARAM_DTYPES:
                pass  # k, rounding and the weight format checked for its dtype above
            else:
                raise TypeError(f"parameters must be float16 or bfloat16 (or float32, converted to "
                                f"param_dtype), got {p.dtype}")
            memory_order(_sharded.local(p))  # dense (any order of its dims), else ValueError

    def _set_philox_offsets(self, group: dict) -> None:
        # Each parameter's Philox element offset within its group, fixed by its place there, so
        # stepping parameters one by one (step in backward) draws the same words as together. A
        # DTensor's shard starts at its first element's global index (-1: not one run of it), so
        # a sharded step draws as the unsharded one.
        offset = 0
        for p in group["params"]:
            start = _sharded.shard_start(p)
            self._philox_offset[id(p)] = -1 if start is None else offset + start
            offset += 4 * ((p.numel() + 3) // 4)  # every parameter starts on a fresh Philox block

    # torch.optim.Optimizer pickles (and deep-copies) only defaults, state and param_groups.
    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["weight_stats"] = self.weight_stats
        state["_generator"] = self._generator  # pickled with its state (a copy draws alike)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_generator", None)  # pickled before there was one
        self._step_in_backward = None  # hooks stay with the original parameters
        self._unsettled = []
        self._philox_offset = {}  # keyed by id(): rebuilt for the new parameter objects
        for group in self.param_groups:
            for key, value in self._added_group_keys().items():
                group.setdefault(key, value)
            self._set_philox_offsets(group)

    @classmethod
    def _added_group_keys(cls) -> dict:
        """Param-group settings added after optimizers were first saved, with the value that
        reproduces the old behaviour: filled in when an older state_dict or pickle is loaded
        (as torch.optim's __setstate__ does)."""
        return {"weight_format": None}

    @staticmethod
    def _new_extra(p: torch.Tensor, group: dict, state: dict) -> torch.Tensor:
        """Zero extra bits for a parameter that started in 16 bits, made at its first step."""
        k, rounding = group["extra_bits"], group["rounding"]
        extra = torch.zeros(packed_words(p.numel(), k, rounding), dtype=torch.int32, device=p.device)
        state.update(extra=extra, extra_bits=k, rounding=rounding, param_dtype=p.dtype,
                     weight_format=group["weight_format"])
        _record_order(state, memory_order(p))
        return extra

    # -- the step -----------------------------------------------------------------------------

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Read by torch.amp.GradScaler.step. When true, as for torch's fused optimizers,
        GradScaler only checks the gradients and sets ``grad_scale`` and ``found_inf`` on the
        optimizer, and the fused step divides the gradients by the scale in float32 and skips
        (_amp_scaling): so a float16 gradient below float16's normal range once unscaled keeps
        its value (GradScaler refuses to unscale float16 gradients itself), and on a GPU
        GradScaler does not wait for its check. On the CPU with bfloat16 parameters only,
        GradScaler's own path is kept: it checks and unscales in one pass, where the fused path
        adds a pass and a division, and bfloat16, with float32's exponent range, divides by its
        power-of-two scales exactly (to 2^-126); only a scale that is not a power of two (an
        init_scale chosen so) gives a quotient rounded to bfloat16 there."""
        device = None if self.weight_stats is None else self.weight_stats.device
        return device is not None and (device.type != "cpu" or any(
            p.dtype is torch.float16 for group in self.param_groups for p in group["params"]))

    # A step is one fused native call per group, nothing a compiler could fuse further: a
    # compiled training step runs it between its graphs, with one graph break and no tracing.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        self._settle_host_state()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf, grad_scale, scaled_grads = self._amp_scaling()
        for group in self.param_groups:
            # (parameter, its state): looked up once a step, as a tensor's hash is a Python call.
            stepped = [(p, self.state[p]) for p in group["params"] if p.grad is not None]
            if stepped:
                # One fused call per set of parameters that share their per-parameter
                # hyperparameters (SGD's first momentum step, Adam's step count).
                seed = draw_seed(self._generator) if group["rounding"] == "stochastic" else 0
                batches: Dict[tuple, list] = {}
                for entry in stepped:
                    batches.setdefault(self._batch_key(group, entry[1]), []).append(entry)
                for key, entries in batches.items():
                    self._fused_call(group, entries, key, seed, found_inf=found_inf,
                                     grad_scale=grad_scale)
        if scaled_grads:  # unscaled after the step read them, as torch's fused kernels leave them
            # (a skipped step leaves them scaled)
            torch._foreach_div_(scaled_grads, grad_scale if found_inf is None else
                                torch.where(found_inf, 1.0, grad_scale))
        if found_inf is not None and found_inf.is_cpu:
            self._settle_host_state()  # nothing to wait for: the step's state is final at once
        return loss

    def _amp_scaling(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], list]:
        """What torch.amp.GradScaler.step set on this optimizer (see _step_supports_amp_scaling):
        (``found_inf`` as a bool on the parameters' device, which skips the fused calls there,
        or None; ``grad_scale`` as a float32 0-d tensor there, by which the fused step divides
        each gradient in float32, or None; the gradients it reads scaled, which step() unscales
        in their dtype after it, or []). ``grad_scale`` is None when the user called
        ``scaler.unscale_`` first. On a GPU the host state of a skipped step is settled at the
        next step or state_dict(), as inside backward. A gradient whose dtype is not its
        parameter's (assigned by hand) would be converted to it still scaled, which can
        overflow: then every gradient is unscaled by torch first, in its own dtype."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if (grad_scale is None and found_inf is None) or self.weight_stats is None:
            return None, None, []
        device = self.weight_stats.device
        skip = None if found_inf is None else torch.as_tensor(found_inf, device=device).reshape(()) != 0
        if grad_scale is None:
            return skip, None, []
        stepped = [(p, p.grad) for group in self.param_groups for p in group["params"]
                   if p.grad is not None]
        for p, g in stepped:
            if g.layout is not torch.strided:
                self._grad_of(p, g)  # raises, before any gradient is changed
        scale = grad_scale.to(device=device, dtype=torch.float32).reshape(())
        grads = [g for _, g in stepped]
        if any(g.dtype is not p.dtype for p, g in stepped):
            if grads:
                torch._foreach_div_(grads, scale)
            return skip, None, []
        return skip, scale, grads

    @staticmethod
    def _grad_of(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """g as the kernel reads it: dense, in p's dtype and p's memory order (contiguous for a
        contiguous p; autograd gives a channels_last parameter a channels_last gradient)."""
        if g.layout is not torch.strided:
            raise ValueError(f"lowfp's extra-bits optimizers need dense gradients, got a {g.layout} "
                             "one (sparse gradients are not supported)")
        if g.dtype is not p.dtype:
            g = g.to(p.dtype)
        if p.is_contiguous():
            return g.contiguous()
        if g.shape == p.shape and _same_memory_order(g, p):
            return g
        return torch.empty_like(p).copy_(g)

    def _fused_call(self, group: dict, entries: List[Tuple[torch.Tensor, dict]], key: tuple,
                    seed: int, grads: Optional[List[torch.Tensor]] = None,
                    found_inf: Optional[torch.Tensor] = None,
                    grad_scale: Optional[torch.Tensor] = None) -> None:
        """Steps the (parameter, state) entries (of one group, sharing the batch key) in one
        native call per dtype. grads: theirs, or None for p.grad. Stochastic rounding uses one
        seed per group and step; each parameter's Philox offset is fixed by its place in the
        group, so stepping parameters one by one (step in backward) gives the same result as
        stepping them together. found_inf: a bool on the parameters' device (step_in_backward's
        or GradScaler.step's) that skips the step on the device when true; grad_scale: a
        float32 0-d tensor there (GradScaler's scale) that the step divides the gradients by, in
        float32, before the update. Step inside backward
        makes this call once per parameter, and step() once per batch key, so a parameter costs
        what its loop turn costs: a few us of Python, most of it reading tensors' properties."""
        state_dtype = group["state_dtype"]
        by_dtype = {}  # dtype: (parameters, gradients, extra bits, moments, Philox offsets)
        dtensors = []  # DTensor parameters, whose shards the step writes
        index = device_index(self.weight_stats.counts)
        offsets = self._philox_offset
        for j, (p, state) in enumerate(entries):
            g = p.grad if grads is None else grads[j]
            pid = id(p)
            if type(p) is not torch.nn.Parameter and is_dtensor(p):  # steps this rank's shard
                g = _sharded.local_grad(p, g)
                moments = [m._local_tensor for m in self._moments(p, group, state_dtype, state)]
                dtensors.append(p)
                p = p._local_tensor
            else:
                moments = None
            if (g.layout is not torch.strided or g.dtype is not p.dtype
                    or not (g.is_contiguous() and p.is_contiguous())):
                g = self._grad_of(p, g)  # converted, or laid out as p (a no-op when it is)
            extra = state.get("extra")
            if extra is None:
                extra = self._new_extra(p, group, state)
            if moments is None:
                moments = self._moments(p, group, state_dtype, state)
            try:
                n = _check_buffers(p, state, group, index, moments)
            except _LayoutChanged:  # model.to(memory_format=...) since the last step
                _match_layout(p, state)
                extra, moments = state["extra"], self._moments(p, group, state_dtype, state)
                n = _check_buffers(p, state, group, index, moments)
            if g.numel() != n:
                raise ValueError(f"a gradient has shape {tuple(g.shape)} but its parameter has "
                                 f"shape {tuple(p.shape)}")
            offset = offsets.get(pid)
            if offset is None:  # appended to group["params"] by hand, as torch.optim allows
                self._set_philox_offsets(group)
                offset = offsets[pid]
            if offset < 0:  # a shard that is not one run of its parameter's global order
                if group["rounding"] == "stochastic":
                    raise ValueError("stochastic rounding of a DTensor parameter whose shard is "
                                     "not one run of its row-major order (Shard(0) or Replicate)")
                offset = 0  # no random words drawn
            batch = by_dtype.get(p.dtype)
            if batch is None:
                batch = by_dtype[p.dtype] = ([], [], [], [], [])
            batch[0].append(p)
            batch[1].append(g)
            batch[2].append(extra)
            batch[3].extend(moments)
            batch[4].append(offset)
        first = entries[0][0]
        _, float_names, bool_names = HYPER_FIELDS[self._optimizer]
        values = self._hyper(group, key, _sharded.local(first).device.type)
        hyper, flags = [float(values[k]) for k in float_names], [bool(values[k]) for k in bool_names]
        # The operator where torch traces (fake, functional or meta parameters); else its
        # implementation, called directly: a dispatch costs more than a small parameter's step.
        local = _sharded.local(first)
        step = (torch.ops.lowfp.extra_bits_step
                if type(local) in backends.TRACING_TYPES or local.is_meta else _extra_bits_step_impl)
        for params, grads_, extras, moments, offs in by_dtype.values():
            step(params, grads_, extras, moments, len(moments) // len(params), self._optimizer,
                 group["extra_bits"], group["rounding"], state_dtype, hyper, flags,
                 as_int64(seed), offs, found_inf, grad_scale, self.weight_stats.counts,
                 group["weight_format"])
        if dtensors:
            torch.autograd.graph.increment_version(dtensors)
        if found_inf is not None and self._host_state_changed(key):
            # Inside backward the device decides the skip: settled at the end of the pass.
            self._unsettled.extend((state, key, found_inf) for _, state in entries)
        else:
            self._after_step([state for _, state in entries])

    def _steps_like_cuda(self, device_type: str) -> bool:
        """Whether a step on parameters of ``device_type`` follows torch's CUDA arithmetic."""
        if self._cuda_association is not None:
            return self._cuda_association
        return device_type == "cuda"

    # -- what step_in_backward uses ---------------------------------------------------------

    def _draw_group_seeds(self) -> Dict[int, int]:
        """Per group index, the Philox key of a step (0 where the rounding is not stochastic)."""
        return {i: (draw_seed(self._generator) if g["rounding"] == "stochastic" else 0)
                for i, g in enumerate(self.param_groups)}

    def _step_parameter(self, gi: int, p: torch.Tensor, grad: torch.Tensor, seed: int,
                        found_inf: Optional[torch.Tensor]) -> None:
        """One parameter of group gi stepped with ``grad`` (skipped on the device when
        ``found_inf`` holds True); host-side state is settled by _settle_host_state."""
        group, state = self.param_groups[gi], self.state[p]
        self._fused_call(group, [(p, state)], self._batch_key(group, state), seed, [grad], found_inf)

    def _settle_host_state(self) -> None:
        """The host-side state of steps taken inside backward, whose skip for a non-finite
        gradient the device decided: a skipped step's state made before the call is taken back
        (SGD's first momentum buffer), a taken step's state that follows it is applied (Adam's
        step count: one call for the pass rather than one per parameter inside backward).
        This waits for the device: once per backward pass, at its end, and only when some step
        in it changed host state."""
        if not self._unsettled:
            return
        pending, self._unsettled = self._unsettled, []
        skipped = torch.stack([f for _, _, f in pending]).tolist()  # each one 0-d bool
        taken = []
        for (state, key, _), was_skipped in zip(pending, skipped):
            if was_skipped:
                self._undo_host_state(state, key)
            else:
                taken.append(state)
        if taken:
            self._after_step(taken)

    def state_dict(self) -> dict:
        """As torch.optim's. The extra bits of a DTensor parameter (FSDP2) are saved per element
        under ``extra_values``: an int32 DTensor placed like the parameter (bit k the rounding's
        flag, lowfp.extra_bits.unpack), so that torch.distributed.checkpoint reshards them with
        the parameter; those of other parameters stay packed under ``extra``."""
        self._settle_host_state()
        saved = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in enumerate(params):
            state = saved["state"].get(i)
            if state is not None and "extra" in state and is_dtensor(p):
                state = dict(state)  # torch.optim's state_dict shares the state dicts themselves
                state["extra_values"] = _sharded.extra_values(p, state.pop("extra"),
                                                              state["extra_bits"], state["rounding"])
                saved["state"][i] = state
        if self._generator is not None:
            # So that a loaded optimizer draws the seeds this one would. It rides in the first
            # group, as torch.distributed.checkpoint keeps only "state" and "param_groups".
            first = saved["param_groups"][0]
            saved["param_groups"][0] = {**first, GENERATOR_STATE: self._generator.get_state()}
        return saved

    # Subclasses: _batch_key, _hyper, _moments, _after_step, _host_state_changed, _undo_host_state.
    def _after_step(self, states: List[dict]) -> None:
        """Host-side state that follows a taken step of the parameters whose states these are
        (Adam: the step count)."""

    def _host_state_changed(self, key: tuple) -> bool:
        """Whether a step of this batch key changes state the host keeps: before the call (made
        by _moments; _undo_host_state takes it back after a skip) or after it (_after_step)."""
        return False

    def _undo_host_state(self, state: dict, key: tuple) -> None:
        """Take back the host-side state _moments made for a step that was skipped."""

    # -- inspection and state -------------------------------------------------------------------

    @torch.no_grad()
    def master_weights(self) -> List[torch.Tensor]:
        """W' of every parameter as a float32 tensor, in param_groups order (a DTensor placed
        like the parameter for a DTensor parameter)."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                if "extra" in state and is_dtensor(p):
                    w32 = merge(p._local_tensor.detach(), state["extra"], state["extra_bits"],
                                state["rounding"], weight_format=state.get("weight_format"))
                    out.append(type(p).from_local(w32, p.device_mesh, p.placements, run_check=False,
                                                  shape=p.shape, stride=p.stride()))
                elif "extra" in state:  # packed in the recorded memory order of p
                    _check_param_dtype(p, state)
                    order = state.get("extra_dim_order")
                    w = p.detach() if order is None else p.detach().permute(order)
                    w32 = merge(w, state["extra"], state["extra_bits"], state["rounding"],
                                weight_format=state.get("weight_format"))
                    out.append(w32 if order is None else w32.permute(inverse_order(order)))
                else:
                    out.append(p.detach().float())
        return out

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes held for the parameters: 16-bit weights, packed extra bits, optimizer moments
        (this rank's shards of DTensor parameters)."""
        weights = extra = moments = 0
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                p = _sharded.local(p)
                weights += p.numel() * p.element_size()
                k, rounding = group["extra_bits"], group["rounding"]
                extra += 4 * (state["extra"].numel() if "extra" in state
                              else packed_words(p.numel(), k, rounding))
                for key in _MOMENT_KEYS:
                    if key in state and torch.is_tensor(state[key]):
                        t = _sharded.local(state[key])
                        moments += t.numel() * t.element_size()
        return {"weights": weights, "extra_bits": extra, "moments": moments,
                "total": weights + extra + moments}

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch.optim's, keeping each saved state tensor's dtype (torch would cast floating
        state to the parameters' 16-bit dtype, rounding float32 moments and the packed bits).

        A state_dict saved by torch.optim's SGD/Adam/AdamW loads too (a checkpoint of float32
        training continued with extra bits): its hyperparameters, moments and step counts are
        taken; the lowfp settings (extra_bits, rounding, state_dtype, param_dtype) stay this
        optimizer's; moments are converted to state_dtype (rounded to nearest for bfloat16); and
        each parameter keeps the extra bits it has, which, for float32 weights converted by this
        optimizer, are their cut-off bits. torch's implementation switches (foreach, fused,
        capturable, differentiable) are dropped."""
        self._settle_host_state()  # before the state it would change is replaced
        added = self._added_group_keys()
        generator_state = next((g[GENERATOR_STATE] for g in state_dict["param_groups"]
                                if GENERATOR_STATE in g), None)
        state_dict = {**state_dict, "param_groups": [
            {key: v for key, v in g.items() if key != GENERATOR_STATE} for g in state_dict["param_groups"]]}
        groups, from_torch = [], []
        for g, own in zip(state_dict["param_groups"], self.param_groups):
            foreign = not any(key in g for key in _LOWFP_GROUP_KEYS)  # saved by torch.optim
            g = {**added, **g}
            if foreign:
                g = {key: v for key, v in g.items() if key not in _TORCH_SWITCHES}
                g.update((key, own[key]) for key in _LOWFP_GROUP_KEYS)
            groups.append(g)
            from_torch.append(foreign)
        groups += state_dict["param_groups"][len(groups):]  # a count mismatch: torch's error
        for g in groups:
            # (torch.optim.Optimizer.__setstate__ adds "differentiable" to the defaults)
            missing = sorted(set(self.defaults) - set(g) - set(_TORCH_SWITCHES))
            if missing:
                raise ValueError(f"state_dict: a param group lacks {missing}, which "
                                 f"{type(self).__name__} needs; was it saved by another optimizer?")
        # The extra bits that parameters of groups saved by torch.optim keep.
        kept = {id(p): {key: v for key, v in self.state[p].items() if key in _EXTRA_KEYS}
                for own, foreign in zip(self.param_groups, from_torch) if foreign
                for p in own["params"] if p in self.state}
        saved = state_dict["state"]
        ids = [i for g in groups for i in g["params"]]
        # a copy: the caller's dict is not changed
        super().load_state_dict({**state_dict, "param_groups": groups})
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            state = self.state[p]
            for key, value in saved.get(pid, {}).items():
                # Adam's step count stays on the CPU, as in torch.optim: each step reads it
                where = "cpu" if key == "step" else p.device
                if torch.is_tensor(value) and key in _MOMENT_KEYS and is_dtensor(p):
                    value = _sharded.placed_like(p, value)
                state[key] = (value.to(device=where, copy=True) if torch.is_tensor(value)
                              else copy.deepcopy(value))
            self._load_extra_bits(p, state)
        index = device_index(self.weight_stats.counts)
        for group, foreign in zip(self.param_groups, from_torch):
            for p in group["params"]:
                if foreign and (p in self.state or id(p) in kept):
                    # kept extra bits go back whether torch saved state for p or not (never stepped)
                    _from_torch_state(self.state[p], group["state_dtype"])
                    self.state[p].update(kept.get(id(p), {}))
                if p not in self.state:
                    continue
                state = self.state[p]
                for key in _MOMENT_KEYS:
                    if key in state and state[key] is None:  # torch.optim may save None buffers
                        del state[key]
                if is_dtensor(p):
                    _check_buffers(p._local_tensor, state, group, index,
                                   [_sharded.local(state[key]) for key in _MOMENT_KEYS
                                    if torch.is_tensor(state.get(key))])
                    continue
                _match_layout(p, state)  # saved from a model laid out otherwise
                _check_buffers(p, state, group, index)
                if "extra" in state:  # saved before the dtype was recorded: p's from now on
                    state.setdefault("param_dtype", p.dtype)
        if generator_state is not None:
            if self._generator is None:
                warnings.warn("state_dict holds the state of the generator= that drew the saved "
                              "optimizer's stochastic-rounding seeds; this optimizer has none and "
                              "draws from torch's default generator: pass generator= to continue "
                              "the saved run", stacklevel=2)
            else:
                self._generator.set_state(generator_state.cpu())


    @staticmethod
    def _load_extra_bits(p: torch.Tensor, state: dict) -> None:
        """Loaded extra bits made the packed words of p (of its shard, for a DTensor): saved
        per element (``extra_values``, by a sharded optimizer) or packed (``extra``, by an
        unsharded one, in its recorded memory order)."""
        values = state.pop("extra_values", None)
        if values is None and not (is_dtensor(p) and "extra" in state):
            return
        k, rounding = state.get("extra_bits"), state.get("rounding")
        if not isinstance(k, int) or rounding is None:
            raise ValueError("state_dict: saved extra bits without their extra_bits and rounding")
        if values is None:  # packed words of the whole parameter, for a DTensor parameter's shard
            packed = state.pop("extra")
            old = state.pop("extra_dim_order", None)
            if old is not None:
                packed = reorder_packed(packed, p.shape, k, rounding, old, None)
            values = unpack(packed, p.numel(), k, rounding).reshape(p.shape)
        if is_dtensor(p):
            state["extra"] = _sharded.packed_shard(p, values, k, rounding)
        else:  # row-major; _match_layout moves it into p's memory order
            if is_dtensor(values):
                values = values.full_tensor()
            if tuple(values.shape) != tuple(p.shape):
                raise ValueError(f"saved extra bits of shape {tuple(values.shape)} for a parameter "
                                 f"of shape {tuple(p.shape)}; was state loaded from another model?")
            state["extra"] = pack(values.to(p.device), k, rounding)
            state.pop("extra_dim_order", None)


def _grad_scaler_inverse(scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    """torch.amp.GradScaler's unscale factor for a scale tensor (on any device): the float32
    rounding of the float64 reciprocal, as its unscale_ computes it; a 0-d tensor on device,
    made without waiting for the scale's device."""
    return scale.to(device).reshape(()).double().reciprocal().float()


def _add_one(counts: List[torch.Tensor]) -> None:
    """count += 1 for each of Adam's step counts. torch.optim keeps them as one-element float32
    CPU tensors, as this optimizer does: those are added to by one native call, where
    torch._foreach_add_ dispatches an add per tensor; any other kind of count (state edited by
    hand) by torch."""
    addresses = []
    for t in counts:
        if (t.dtype is not torch.float32 or not t.is_cpu or t.numel() != 1
                or type(t) is not torch.Tensor):  # (fake tensors while torch traces)
            torch._foreach_add_(counts, 1)
            return
        addresses.append(t.data_ptr())
    _C.add_to_float32s(addresses, 1.0)
    torch.autograd.graph.increment_version(counts)  # written through their pointers


