"""Optimizers that keep 16-bit weights plus k packed extra bits instead of an fp32 master copy
(docs/design.md §5): ``ExtraBitsSGD``, ``ExtraBitsAdam``, ``ExtraBitsAdamW``.

>>> import torch, lowfp
>>> model = torch.nn.Linear(4, 2)                       # float32 parameters ...
>>> opt = lowfp.optim.ExtraBitsAdamW(model.parameters(), lr=1e-3, extra_bits=16)
>>> model.weight.dtype                                  # ... now bfloat16 + 16 extra bits
torch.bfloat16

Each step merges w and its extra bits into W' (float32), applies torch.optim's update formula in
float32 with torch's own arithmetic (the same operations and fused multiply-adds as torch's CPU
kernels, and for Adam torch's own square root: see _torch_sqrt), and splits the result back, in
one fused pass over every element of a parameter group.
Arguments, defaults, param groups, LR schedulers, ``zero_grad`` and ``state_dict`` work as in
torch.optim. float32 parameters are converted to ``param_dtype`` in place when the optimizer is
built, their cut-off bits becoming the initial extra bits (so nothing is lost with bfloat16 and
k=16); the model then computes in that dtype. Buffers are not parameters: a model with float32
buffers (BatchNorm's running statistics) needs ``model.to(param_dtype)`` after the optimizer is
built, which leaves the already 16-bit parameters and their extra bits as they are.
float16/bfloat16 parameters start with zero extra bits.
Parameters may have any dense layout (channels_last, transposed): a step goes over their elements
in memory order, the order their extra bits and moments are kept in.
"""

from __future__ import annotations

import copy
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import _C, backends
from ._torch_sqrt import use_torch_sqrt
from ._checks import is_dtype_in, is_real
from .backends import inverse_order, memory_order
from .extra_bits import check_extra_bits, merge, packed_words, reorder_packed, split
from ._native import DTYPE_CODES, ROUNDING_MODES, draw_seed
from .scaler import _any_non_finite_into
from .stats import Stats

__all__ = ["ExtraBitsSGD", "ExtraBitsAdam", "ExtraBitsAdamW", "step_in_backward", "StepInBackward"]

_STATE_DTYPES = (torch.float32, torch.bfloat16)
_PARAM_DTYPES = (torch.float16, torch.bfloat16)
_MOMENT_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_NO_STATE = (0, 0, 0)  # the pointers of a step's unused state slots (three in all)
_LOWFP_GROUP_KEYS = ("extra_bits", "rounding", "state_dtype", "param_dtype")  # not torch.optim's
_TORCH_SWITCHES = ("foreach", "fused", "capturable", "differentiable")  # torch.optim's, not here
_EXTRA_KEYS = ("extra", "extra_bits", "rounding", "param_dtype", "extra_dim_order")


class _ExtraBitsOptimizer(torch.optim.Optimizer):
    _opt_code = -1
    _takes_square_roots = False  # Adam: its denominators' square roots (see _torch_sqrt)

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
        check_extra_bits(param_dtype, k, rounding, "extra_bits", "param_dtype")
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
                                    group["param_dtype"], k, rounding, generator=self._generator)
                p.data = w16 if order is None else w16.permute(inverse_order(order))
                p.grad = None
                self.state[p].update(extra=packed, extra_bits=k, rounding=rounding,
                                     param_dtype=group["param_dtype"])
                _record_order(self.state[p], order)
        self._set_philox_offsets(group)
        if self._step_in_backward is not None:  # a group added while stepping inside backward
            self._step_in_backward._hook_group(len(self.param_groups) - 1)

    def _check_new_group(self, group: dict) -> None:
        """Everything about a new group's parameters that the fused step relies on, checked
        before any float32 parameter is converted."""
        k, rounding = group["extra_bits"], group["rounding"]
        self._check_hyperparameters(group)
        if not is_dtype_in(group["state_dtype"], _STATE_DTYPES):
            raise TypeError(f"state_dtype must be torch.float32 or torch.bfloat16, got {group['state_dtype']}")
        params = group["params"]
        if len({id(p) for p in params}) != len(params):
            # torch.optim only warns (and says it will become an error): one fused call would
            # update the same memory from two slots at once.
            raise ValueError("a parameter appears more than once in a param group")
        device = None if self.weight_stats is None else self.weight_stats.device
        for p in params:
            backends.native(p, "parameter")  # a CUDA parameter needs the CUDA build
            if device is None:
                device = p.device
            elif p.device != device:
                raise ValueError(f"all parameters must be on one device: {device} and {p.device}")
            if p.dtype == torch.float32:
                check_extra_bits(group["param_dtype"], k, rounding, "extra_bits", "param_dtype")
                _refuse_if_in_ddp(
                    p, f"converting it to {group['param_dtype']} would disconnect that silently (DDP "
                    "would stop averaging its gradients), so build the optimizer before wrapping "
                    "the model in DDP (then model.to(param_dtype) for its buffers, then DDP)")
            elif p.dtype in _PARAM_DTYPES:
                check_extra_bits(p.dtype, k, rounding, "extra_bits", "a parameter's dtype")
            else:
                raise TypeError(f"parameters must be float16 or bfloat16 (or float32, converted to "
                                f"param_dtype), got {p.dtype}")
            memory_order(p)  # dense (any order of its dims), else ValueError

    def _set_philox_offsets(self, group: dict) -> None:
        # Each parameter's Philox block offset within its group, fixed by its place there, so
        # stepping parameters one by one (step in backward) draws the same words as together.
        offset = 0
        for p in group["params"]:
            self._philox_offset[id(p)] = offset
            offset += (p.numel() + 3) // 4  # every parameter starts on a fresh Philox block

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
        return {}

    @staticmethod
    def _new_extra(p: torch.Tensor, group: dict, state: dict) -> torch.Tensor:
        """Zero extra bits for a parameter that started in 16 bits, made at its first step."""
        k, rounding = group["extra_bits"], group["rounding"]
        extra = torch.zeros(packed_words(p.numel(), k, rounding), dtype=torch.int32, device=p.device)
        state.update(extra=extra, extra_bits=k, rounding=rounding, param_dtype=p.dtype)
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
        keep, by_dtype = [], {}  # keep: tensors the call reads, alive until it has run
        written = []  # what the call writes: parameters, extra bits, moments
        index = self.weight_stats.counts.get_device()
        offsets = self._philox_offset
        for j, (p, state) in enumerate(entries):
            g = p.grad if grads is None else grads[j]
            if (g.layout is not torch.strided or g.dtype is not p.dtype
                    or not (g.is_contiguous() and p.is_contiguous())):
                g = self._grad_of(p, g)  # converted, or laid out as p (a no-op when it is)
            extra = state.get("extra")
            if extra is None:
                extra = self._new_extra(p, group, state)
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
            offset = offsets.get(id(p))
            if offset is None:  # appended to group["params"] by hand, as torch.optim allows
                self._set_philox_offsets(group)
                offset = offsets[id(p)]
            keep.append(g)
            written += (p, extra, *moments)
            by_dtype.setdefault(p.dtype, []).append(
                (p.data_ptr(), g.data_ptr(), extra.data_ptr(), *[m.data_ptr() for m in moments],
                 *_NO_STATE[len(moments):], n, offset))
        mod, device, stream = backends.native(entries[0][0], "parameter")
        hyper = self._hyper(mod, group, key)
        if device < 0 and self._takes_square_roots:
            use_torch_sqrt()  # once: the CPU step's square roots as torch.sqrt's
        skip_flag = 0 if found_inf is None else found_inf.data_ptr()
        scale_at = 0 if grad_scale is None else grad_scale.data_ptr()
        for dtype, slots in by_dtype.items():
            mod.extra_bits_step(self._opt_code, DTYPE_CODES[dtype], group["extra_bits"],
                                ROUNDING_MODES.index(group["rounding"]), DTYPE_CODES[state_dtype],
                                hyper, seed, slots, skip_flag, scale_at,
                                self.weight_stats.counts.data_ptr(), device, stream)
        # Written through their pointers: tell autograd, as torch.optim's in-place updates do, so
        # a backward through a graph that saved a parameter before this step raises.
        torch.autograd.graph.increment_version(written)
        if found_inf is not None and self._host_state_changed(key):
            # Inside backward the device decides the skip: settled at the end of the pass.
            self._unsettled.extend((state, key, found_inf) for _, state in entries)
        else:
            self._after_step([state for _, state in entries])

    def _settle_host_state(self) -> None:
        """The host-side state of steps taken inside backward, whose skip for a non-finite
        gradient the device decided: a skipped step's state made before the call is taken back
        (SGD's first momentum buffer), a taken step's state that follows it is applied (Adam's
        step count: one call for the pass, where one per parameter took ~13 us inside backward).
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
        self._settle_host_state()
        return super().state_dict()

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
        """W' of every parameter as a float32 tensor, in param_groups order."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                if "extra" in state:  # packed in the recorded memory order of p
                    _check_param_dtype(p, state)
                    order = state.get("extra_dim_order")
                    w = p.detach() if order is None else p.detach().permute(order)
                    w32 = merge(w, state["extra"], state["extra_bits"], state["rounding"])
                    out.append(w32 if order is None else w32.permute(inverse_order(order)))
                else:
                    out.append(p.detach().float())
        return out

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes held for the parameters: 16-bit weights, packed extra bits, optimizer moments."""
        weights = extra = moments = 0
        for group in self.param_groups:
            for p in group["params"]:
                weights += p.numel() * p.element_size()
                state = self.state.get(p, {})
                k, rounding = group["extra_bits"], group["rounding"]
                extra += 4 * (state["extra"].numel() if "extra" in state
                              else packed_words(p.numel(), k, rounding))
                for key in _MOMENT_KEYS:
                    if key in state and torch.is_tensor(state[key]):
                        moments += state[key].numel() * state[key].element_size()
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
        groups, from_torch = [], []
        for g, own in zip(state_dict["param_groups"], self.param_groups):
            g = {**added, **g}
            foreign = not any(key in g for key in _LOWFP_GROUP_KEYS)  # saved by torch.optim
            if foreign:
                g = {key: v for key, v in g.items() if key not in _TORCH_SWITCHES}
                g.update((key, own[key]) for key in _LOWFP_GROUP_KEYS)
            groups.append(g)
            from_torch.append(foreign)
        groups += state_dict["param_groups"][len(groups):]  # a count mismatch: torch's error
        for g in groups:
            missing = sorted(set(self.defaults) - set(g))
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
            for key, value in saved.get(pid, {}).items():
                # Adam's step count stays on the CPU, as in torch.optim: each step reads it
                where = "cpu" if key == "step" else p.device
                self.state[p][key] = (value.to(device=where, copy=True) if torch.is_tensor(value)
                                      else copy.deepcopy(value))
        index = self.weight_stats.counts.get_device()
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
                _match_layout(p, state)  # saved from a model laid out otherwise
                _check_buffers(p, state, group, index)
                if "extra" in state:  # saved before the dtype was recorded: p's from now on
                    state.setdefault("param_dtype", p.dtype)


def _from_torch_state(state: dict, state_dtype: torch.dtype) -> None:
    """A parameter's state as torch.optim saved it, made this optimizer's: moments in
    state_dtype, the step count a float32 CPU tensor (a plain number in old torch.optim)."""
    for key in _MOMENT_KEYS:
        if torch.is_tensor(state.get(key)) and state[key].is_floating_point():
            state[key] = state[key].to(state_dtype)
    if "step" in state and not torch.is_tensor(state["step"]):
        state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)


def _refuse_if_in_ddp(p: torch.Tensor, consequence: str) -> None:
    """Refuses a parameter that a DistributedDataParallel model may have hooked: DDP hooks its
    gradient all-reduce on the parameter's AccumulateGrad node, which a dtype change replaces
    and which runs after per-parameter hooks. DDP needs a process group, so without one nothing
    is looked at; with one, the node being held by anything else counts (a graph still
    referenced, such as a loss kept from an earlier step, holds it too: the message says so)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if _grad_accumulator_is_held(p):
        raise ValueError(f"a {p.dtype} parameter of shape {tuple(p.shape)} looks wrapped in "
                         "DistributedDataParallel: something holds its gradient accumulator (a "
                         "DDP model's reducer, or a graph still referenced, such as a loss kept "
                         f"from an earlier step: del it first); {consequence}")


def _grad_accumulator_is_held(p: torch.Tensor) -> bool:
    """Whether something other than this call holds p's AccumulateGrad node (DDP's reducer, a
    graph). The node is cached weakly on p: a mark left in its metadata survives a second
    lookup only if another owner kept the node alive in between."""
    if not p.requires_grad:
        return False
    with torch.enable_grad():  # optimizers are often built under no_grad
        node = p.view_as(p).grad_fn.next_functions[0][0]
        node.metadata["lowfp_probe"] = True
        del node
        return p.view_as(p).grad_fn.next_functions[0][0].metadata.pop("lowfp_probe", False)


def _check_buffers(p: torch.Tensor, state: dict, group: dict, index: int,
                   moments: Optional[Sequence[torch.Tensor]] = None) -> int:
    """The fused kernels trust every buffer's size, dtype and device. A parameter whose ``.data``
    was replaced, a changed group setting or state loaded from another model must fail here, not
    read or write past a buffer. ``index``: the optimizer's CUDA device index, or -1 for the CPU;
    ``moments``: the state tensors the step passes (default: all). Returns p.numel().

    It runs for every parameter at every step (once per parameter inside backward), so each
    property is read once and the device by one attribute: ``is_cpu`` for a CPU optimizer,
    ``get_device()`` for a CUDA one (-1 on the CPU and on the meta device); torch.device objects
    and shapes are built only once something is wrong."""
    n, cpu, param_dtype = p.numel(), index < 0, p.dtype
    if param_dtype not in _PARAM_DTYPES:
        raise TypeError(f"a parameter of shape {tuple(p.shape)} now has dtype {p.dtype}; extra bits "
                        "need float16 or bfloat16 parameters")
    if not (p.is_cpu if cpu else p.get_device() == index):
        device = torch.device("cpu") if cpu else torch.device("cuda", index)
        raise ValueError(f"parameters must be on {device}; one of shape {tuple(p.shape)} is on "
                         f"{p.device} (the optimizer's state lives where it was built: move the "
                         "model before building the optimizer, as torch.optim's docs ask)")
    # Every buffer follows p's memory order (row-major when p is contiguous, the common case).
    row_major = p.is_contiguous()
    order = None if row_major else memory_order(p)
    extra = state.get("extra")
    if extra is not None:
        k, rounding = group["extra_bits"], group["rounding"]
        if state["extra_bits"] != k or state["rounding"] != rounding:
            raise ValueError(f"extra_bits/rounding of a parameter group changed from "
                             f"{state['extra_bits']}/{state['rounding']!r} to {k}/{rounding!r} after "
                             "its extra bits were created; build a new optimizer instead")
        if state.get("param_dtype", param_dtype) is not param_dtype:
            _check_param_dtype(p, state)
        want = packed_words(n, k, rounding)
        if (extra.dtype is not torch.int32 or extra.numel() != want
                or not (extra.is_cpu if cpu else extra.get_device() == index)
                or not extra.is_contiguous()):
            raise ValueError(f"the extra bits of a parameter of shape {tuple(p.shape)} are "
                             f"{extra.numel()} {extra.dtype} words on {extra.device}, but it needs "
                             f"{want} contiguous int32 words on {p.device} (k={k}, rounding="
                             f"{rounding!r}); was its .data replaced, or state loaded from another "
                             "model?")
        if state.get("extra_dim_order") != order:
            raise _LayoutChanged
    if moments is None:
        moments = [state[key] for key in _MOMENT_KEYS if torch.is_tensor(state.get(key))]
    dtype = group["state_dtype"]
    for t in moments:
        # a moment of another shape (state edited by hand) is read in its row-major order
        laid_out = t.is_contiguous() if row_major else t.shape == p.shape and _same_memory_order(t, p)
        if not laid_out and t.shape == p.shape:
            raise _LayoutChanged
        if (t.dtype is not dtype or t.numel() != n or not laid_out
                or not (t.is_cpu if cpu else t.get_device() == index)):
            key = next(key for key in _MOMENT_KEYS if state.get(key) is t)
            raise ValueError(f"state {key!r} of a parameter of shape {tuple(p.shape)} is a "
                             f"{tuple(t.shape)} {t.dtype} tensor on {t.device}, but the step needs a "
                             f"{dtype} tensor of {n} elements on {p.device} in the parameter's "
                             "memory order (state_dtype cannot change once moments exist; was the "
                             "parameter's .data replaced, or state loaded from another model?)")
    return n


def _check_param_dtype(p: torch.Tensor, state: dict) -> None:
    """Extra bits extend the 16-bit type they were split from: read with another (model.half()
    on a bfloat16 model after the optimizer was made) they would give a wrong master weight, and
    the right one cannot be recovered from the converted weights."""
    made_for = state.get("param_dtype", p.dtype)
    if made_for != p.dtype:  # (dtypes are singletons: ``is`` is the fast test, == the sure one)
        raise TypeError(f"a parameter of shape {tuple(p.shape)} is now {p.dtype}, but its extra bits "
                        f"extend {made_for} weights (was the model converted after the optimizer "
                        "was made?); its float32 master weight cannot be recovered from the "
                        "converted weights: convert the model before building the optimizer")


class _LayoutChanged(ValueError):
    """A parameter's memory order is not its extra bits' or moments' (model.to(memory_format=...)
    since they were made): _match_layout moves them."""

    def __init__(self):
        super().__init__("a parameter's memory layout changed since its optimizer state was made")


def _record_order(state: dict, order: Optional[Tuple[int, ...]]) -> None:
    """Notes the memory order its extra bits are packed in; none for row-major (contiguous)."""
    if order is None:
        state.pop("extra_dim_order", None)
    else:
        state["extra_dim_order"] = order


def _same_memory_order(t: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether t (of p's shape) has p's strides, except on dims of size 1, which do not move."""
    ts, ps = t.stride(), p.stride()
    return ts == ps or all(a == b for a, b, size in zip(ts, ps, p.shape) if size > 1)


def _match_layout(p: torch.Tensor, state: dict) -> None:
    """Moves a parameter's extra bits and moments into its current memory order: after
    ``model.to(memory_format=...)``, or state loaded from a model laid out otherwise. Exact: the
    packed bits of each element move with it (so a stochastic flag stays with its weight).
    Buffers of the wrong size are left for _check_buffers to refuse."""
    order = memory_order(p)
    extra, old = state.get("extra"), state.get("extra_dim_order")
    if extra is not None and old != order:
        if (not isinstance(old, (tuple, list)) and old is not None
                or old is not None and sorted(old) != list(range(p.dim()))):
            raise ValueError(f"the extra bits of a parameter of shape {tuple(p.shape)} were packed "
                             f"in dim order {old!r}, which is not an order of its dims; was state "
                             "loaded from another model?")
        try:
            state["extra"] = reorder_packed(extra, p.shape, state.get("extra_bits"),
                                            state.get("rounding"), old, order)
        except (TypeError, ValueError):
            pass  # words that do not fit: _check_buffers refuses them, saying what they are
        else:
            _record_order(state, order)
    for key in _MOMENT_KEYS:
        t = state.get(key)
        if torch.is_tensor(t) and t.shape == p.shape and not _same_memory_order(t, p):
            state[key] = torch.empty_like(p, dtype=t.dtype).copy_(t)


def _grad_scaler_inverse(scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    """torch.amp.GradScaler's unscale factor for a scale tensor (on any device): the float32
    rounding of the float64 reciprocal, as its unscale_ computes it; a 0-d tensor on device,
    made without waiting for the scale's device."""
    return scale.to(device).reshape(()).double().reciprocal().float()


def _add_one(counts: List[torch.Tensor]) -> None:
    """count += 1 for each of Adam's step counts. torch.optim keeps them as one-element float32
    CPU tensors, as this optimizer does: those are added to by one native call, where
    torch._foreach_add_ dispatches an add per tensor (~2 us each); any other kind of count (state
    edited by hand) by torch."""
    addresses = []
    for t in counts:
        if t.dtype is not torch.float32 or not t.is_cpu or t.numel() != 1:
            torch._foreach_add_(counts, 1)
            return
        addresses.append(t.data_ptr())
    _C.add_to_float32s(addresses, 1.0)
    torch.autograd.graph.increment_version(counts)  # written through their pointers


def _check_torch_switches(foreach, fused, differentiable, capturable=False):
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


def _hyperparameter(value, name: str):
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


def _check_bool(group: dict, name: str) -> None:
    value = group[name]
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _check_real(group: dict, name: str, message: str) -> None:
    """A real number >= 0; NaN is refused too, as torch.optim's ``not 0.0 <= x`` does."""
    value = group[name]
    if not is_real(value):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    if not 0.0 <= value:
        raise ValueError(f"{message}: {value} ({name} must be >= 0)")


def _check_common(group: dict) -> None:
    """lr (a float or a 1-element tensor, kept as a 0-d tensor) and weight_decay, in place."""
    group["lr"] = _hyperparameter(group["lr"], "lr")
    if not 0.0 <= group["lr"]:
        raise ValueError(f"Invalid learning rate: {group['lr']} (lr must be >= 0)")
    _check_real(group, "weight_decay", "Invalid weight_decay value")


class ExtraBitsSGD(_ExtraBitsOptimizer):
    """torch.optim.SGD on W' = 16-bit weight + ``extra_bits`` packed bits (docs/design.md §5).

    Args: as torch.optim.SGD (``lr=1e-3, momentum=0, dampening=0, weight_decay=0,
    nesterov=False, maximize=False``), plus ``extra_bits`` (k: 1-16 for bfloat16, 1-13 for
    float16), ``rounding`` of the 16-bit weights (``"toward_zero"``, ``"nearest"``,
    ``"stochastic"``), ``state_dtype`` of the momentum buffer (float32 or bfloat16) and
    ``param_dtype`` (the 16-bit type float32 parameters are converted to). torch's ``foreach``
    and ``fused`` are accepted and change nothing (the step is always lowfp's fused kernel);
    ``differentiable=True`` is refused. ``lr`` may be a 1-element tensor, as in torch.optim
    (schedulers fill it in place); each step reads it as a float, as torch's default CPU step.
    ``generator``: a torch.Generator that stochastic rounding's seeds are drawn from (default:
    torch's default CPU generator). With DistributedDataParallel, pass one seeded alike on every
    rank so that the replicas round alike and stay identical. Its state is not part of
    ``state_dict()`` (nor is torch's own RNG state): save ``generator.get_state()`` beside it to
    resume bit for bit.
    """

    _opt_code = 0

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, differentiable: bool = False,
                 fused: Optional[bool] = None, extra_bits: int = 16, rounding: str = "toward_zero",
                 state_dtype: torch.dtype = torch.float32, param_dtype: torch.dtype = torch.bfloat16,
                 generator: Optional[torch.Generator] = None):
        _check_torch_switches(foreach, fused, differentiable)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, extra_bits=extra_bits,
                        rounding=rounding, state_dtype=state_dtype, param_dtype=param_dtype)
        super().__init__(params, defaults, generator)

    @staticmethod
    def _check_hyperparameters(group: dict) -> None:
        _check_common(group)
        _check_real(group, "momentum", "Invalid momentum value")
        _check_real(group, "dampening", "Invalid dampening value")
        _check_bool(group, "nesterov")
        _check_bool(group, "maximize")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def _batch_key(self, group, state):
        return (group["momentum"] != 0 and "momentum_buffer" not in state,)

    def _hyper(self, mod, group, key):
        (first,) = key
        return mod.SgdHyper(neg_lr=-float(group["lr"]), momentum=group["momentum"],
                            one_minus_dampening=1 - group["dampening"],
                            weight_decay=group["weight_decay"], nesterov=group["nesterov"],
                            maximize=group["maximize"], first_step=first,
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


class ExtraBitsAdam(_ExtraBitsOptimizer):
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

    _opt_code = 1
    _takes_square_roots = True
    _decoupled = False  # the class's decoupled_weight_decay (AdamW: True)

    @classmethod
    def _added_group_keys(cls) -> dict:
        return {"decoupled_weight_decay": cls._decoupled}

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: Optional[bool] = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, decoupled_weight_decay: bool = False,
                 extra_bits: int = 16, rounding: str = "toward_zero",
                 state_dtype: torch.dtype = torch.float32, param_dtype: torch.dtype = torch.bfloat16,
                 generator: Optional[torch.Generator] = None):
        _check_torch_switches(foreach, fused, differentiable, capturable)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize,
                        decoupled_weight_decay=decoupled_weight_decay, extra_bits=extra_bits,
                        rounding=rounding, state_dtype=state_dtype, param_dtype=param_dtype)
        super().__init__(params, defaults, generator)

    @staticmethod
    def _check_hyperparameters(group: dict) -> None:
        _check_common(group)
        _check_real(group, "eps", "Invalid epsilon value")
        betas = group["betas"]
        if isinstance(betas, torch.Tensor) or not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair of floats (beta1, beta2), got {betas!r}")
        betas = tuple(_hyperparameter(b, f"betas[{i}]") for i, b in enumerate(betas))
        if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
            raise ValueError("betas must be either both floats or both Tensors")  # as torch.optim
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameters: {betas} (betas must be in [0, 1))")
        group["betas"] = betas
        for name in ("amsgrad", "maximize", "decoupled_weight_decay"):
            _check_bool(group, name)

    def _batch_key(self, group, state):
        step = state.get("step")
        return (1.0 if step is None else float(step) + 1,)

    def _hyper(self, mod, group, key):
        (step,) = key
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        beta1, beta2 = map(float, group["betas"])
        decoupled = group["decoupled_weight_decay"]
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        decay = 1 - lr * wd if (decoupled and wd != 0) else 1.0
        return mod.AdamHyper(decay=decay, weight_decay=0.0 if decoupled else wd,
                             lerp_weight=1 - beta1, beta2=beta2, one_minus_beta2=1 - beta2,
                             bias_correction2_sqrt=bias_correction2 ** 0.5, eps=eps,
                             neg_step_size=-step_size, decoupled=decoupled,
                             amsgrad=group["amsgrad"], maximize=group["maximize"])

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
        _add_one([state["step"] for state in states])

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

    def __init__(self, optimizer: _ExtraBitsOptimizer, clip_value: Optional[float], scaler):
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
        self._seeds = {i: (draw_seed(opt._generator) if g["rounding"] == "stochastic" else 0)
                       for i, g in enumerate(opt.param_groups)}
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
            return _grad_scaler_inverse(scale, device)
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
        found_inf = _any_non_finite_into(g, self._found_inf[i], self._skip_counts)
        if self.clip_value is not None:
            g = g.clamp(-self.clip_value, self.clip_value)
        group, state = opt.param_groups[gi], opt.state[p]
        opt._fused_call(group, [(p, state)], opt._batch_key(group, state), self._seeds[gi], [g],
                        found_inf)
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
    if not isinstance(optimizer, _ExtraBitsOptimizer):
        raise TypeError(f"optimizer must be a lowfp ExtraBits optimizer, got {type(optimizer).__name__}")
    if optimizer._step_in_backward is not None:
        raise ValueError("optimizer already steps inside backward (each parameter would step "
                         "twice); call remove() on the handle step_in_backward returned first")
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
            _refuse_if_in_ddp(p, "the per-parameter hooks would step before DDP's "
                                  "all-reduce of the gradients; step normally with DDP")
    if clip_value is not None and (not is_real(clip_value) or not clip_value > 0):
        raise ValueError(f"clip_value must be a positive number, got {clip_value!r}")
    if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
        raise TypeError("scaler must have a get_scale() method (torch.amp.GradScaler, "
                        "lowfp.DynamicLossScaler)")
    return StepInBackward(optimizer, clip_value, scaler)
