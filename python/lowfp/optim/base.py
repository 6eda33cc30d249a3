"""The base of the ExtraBits optimizers (docs/design.md §5): parameter groups (their checks, the
conversion of float32 parameters, each parameter's Philox offset), hyperparameters and the step
loop. The fused step itself is fused.py's, GradScaler's part amp.py's, state_dict
state_dict.py's, master weights and memory weights.py's, what the fused step relies on about a
parameter's state state.py's.

A subclass (sgd.py, adam.py) gives _optimizer (lowfp::extra_bits_step's name for its update),
_check_hyperparameters, _batch_key, _hyper and _moments, and optionally _after_step,
_host_state_changed, _undo_host_state and _added_group_keys. step_in_backward.py reaches an
optimizer through the small protocol it names (StepsInBackward)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .. import backends
from .._checks import is_dtype_in
from .._dtensor import is_dtensor
from .._native import draw_seed
from ..backends import inverse_order, memory_order
from ..extra_bits import check_weight_format, split
from ..stats import Stats
from . import amp, fused, sharded, weights
from .ddp import refuse_if_in_ddp
from .state import PARAM_DTYPES, STATE_DTYPES, record_order
from .state_dict import load as load_state, saved as saved_state


class ExtraBitsOptimizer(torch.optim.Optimizer):
    _optimizer = ""  # "sgd" or "adam": the update lowfp::extra_bits_step applies
    # torch's arithmetic differs between its CPU kernels and its CUDA foreach kernels (Adam's
    # addcmul and addcdiv, docs/design.md §5): None follows the parameters' device; True makes a
    # CPU optimizer step as torch does on CUDA (the CPU twin of a GPU run, in tests).
    _cuda_association: Optional[bool] = None

    def __init__(self, params, defaults: dict, generator: Optional[torch.Generator] = None):
        self._check_hyperparameters(defaults)  # before any group: torch.optim's order of errors
        k, rounding = defaults["extra_bits"], defaults["rounding"]
        param_dtype, state_dtype = defaults["param_dtype"], defaults["state_dtype"]
        if not is_dtype_in(param_dtype, PARAM_DTYPES):
            raise TypeError(f"param_dtype must be torch.float16 or torch.bfloat16, got {param_dtype}")
        defaults["weight_format"] = check_weight_format(
            defaults.get("weight_format"), param_dtype, k, rounding, k_name="extra_bits",
            dtype_name="param_dtype")
        if not is_dtype_in(state_dtype, STATE_DTYPES):
            raise TypeError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {generator!r}")
        # Where stochastic rounding's seeds come from (None: torch's default CPU generator).
        self._generator = generator
        self.weight_stats: Optional[Stats] = None  # 16-bit weight roundings (on the params' device)
        self._step_in_backward = None  # the active StepInBackward handle, if any
        self._philox_offset: Dict[int, int] = {}  # per parameter, set once in add_param_group
        self._unsettled: List[tuple] = []  # (state, batch key, found_inf): see _settle_host_state
        super().__init__(params, defaults)

    # -- parameter groups -------------------------------------------------------------------------

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
                record_order(self.state[p], order)
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
                  for p in group["params"] if p.dtype == torch.float32 or p.dtype in PARAM_DTYPES}
        wf = group["weight_format"]
        for dtype, name in sorted(dtypes or {(group["param_dtype"], "param_dtype")}, key=str):
            wf = check_weight_format(group["weight_format"], dtype, k, rounding,
                                     k_name="extra_bits", dtype_name=name)
        group["weight_format"] = wf
        if not is_dtype_in(group["state_dtype"], STATE_DTYPES):
            raise TypeError(f"state_dtype must be torch.float32 or torch.bfloat16, got {group['state_dtype']}")
        params = group["params"]
        if len({id(p) for p in params}) != len(params):
            # torch.optim only warns (and says it will become an error): one fused call would
            # update the same memory from two slots at once.
            raise ValueError("a parameter appears more than once in a param group")
        device = None if self.weight_stats is None else self.weight_stats.device
        for p in params:
            if is_dtensor(p):  # FSDP2, tensor parallel: each rank steps its shard
                sharded.check_dtensor_parameter(p, group["param_dtype"])
                if rounding == "stochastic" and sharded.shard_start(p) is None:
                    raise ValueError(
                        f"a DTensor parameter of shape {tuple(p.shape)} placed as {p.placements}: "
                        "stochastic rounding draws by global element index, which needs each "
                        "rank's shard to be one run of the row-major order (Shard(0), FSDP2's "
                        "default, or Replicate)")
            local = sharded.local(p)
            if type(local) in backends.TRACING_TYPES or local.is_meta:
                backends.check_operand(local, "parameter")  # shapes only: lowfp's operators
            else:
                backends.native(local, "parameter")  # a CUDA parameter needs the CUDA build
            if device is None:
                device = p.device
            elif p.device != device:
                raise ValueError(f"all parameters must be on one device: {device} and {p.device}")
            if p.dtype == torch.float32:
                refuse_if_in_ddp(
                    p, f"converting it to {group['param_dtype']} would disconnect that silently (DDP "
                    "would stop averaging its gradients), so build the optimizer before wrapping "
                    "the model in DDP (then model.to(param_dtype) for its buffers, then DDP)")
            elif p.dtype in PARAM_DTYPES:
                pass  # k, rounding and the weight format checked for its dtype above
            else:
                raise TypeError(f"parameters must be float16 or bfloat16 (or float32, converted to "
                                f"param_dtype), got {p.dtype}")
            memory_order(sharded.local(p))  # dense (any order of its dims), else ValueError

    def _set_philox_offsets(self, group: dict) -> None:
        # Each parameter's Philox element offset within its group, fixed by its place there, so
        # stepping parameters one by one (step in backward) draws the same words as together. A
        # DTensor's shard starts at its first element's global index (-1: not one run of it), so
        # a sharded step draws as the unsharded one.
        offset = 0
        for p in group["params"]:
            start = sharded.shard_start(p)
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

    # -- the step -----------------------------------------------------------------------------

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Read by torch.amp.GradScaler.step (amp.supports_amp_scaling)."""
        return amp.supports_amp_scaling(self)

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
        found_inf, grad_scale, scaled_grads = amp.amp_scaling(self)
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

    def _fused_call(self, group: dict, entries: List[Tuple[torch.Tensor, dict]], key: tuple,
                    seed: int, grads: Optional[List[torch.Tensor]] = None,
                    found_inf: Optional[torch.Tensor] = None,
                    grad_scale: Optional[torch.Tensor] = None) -> None:
        """Steps the (parameter, state) entries of one group sharing the batch key, in one native
        call per dtype (fused.py; grads: theirs, or None for p.grad; found_inf and grad_scale as
        fused.launch takes them), then the host-side state that follows the step: at once, or,
        where the device decides a skip (found_inf), when _settle_host_state runs."""
        batches, dtensors = fused.gather(self, group, entries, grads)
        values = self._hyper(group, key, sharded.local(entries[0][0]).device.type)
        fused.launch(self._optimizer, group, batches, values, seed, found_inf, grad_scale,
                     self.weight_stats.counts)
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

    # -- what step_in_backward uses (its StepsInBackward protocol) ------------------------

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

    # -- state and inspection -------------------------------------------------------------

    def state_dict(self) -> dict:
        """As torch.optim's. The extra bits of a DTensor parameter (FSDP2) are saved per element
        under ``extra_values``: an int32 DTensor placed like the parameter (bit k the rounding's
        flag, lowfp.extra_bits.unpack), so that torch.distributed.checkpoint reshards them with
        the parameter; those of other parameters stay packed under ``extra``."""
        self._settle_host_state()
        return saved_state(self, super().state_dict())

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
        load_state(self, state_dict)

    def master_weights(self) -> List[torch.Tensor]:
        """W' of every parameter as a float32 tensor, in param_groups order (a DTensor placed
        like the parameter for a DTensor parameter)."""
        return weights.master_weights(self)

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes held for the parameters: 16-bit weights, packed extra bits, optimizer moments
        (this rank's shards of DTensor parameters)."""
        return weights.memory_bytes(self)

    # -- what a subclass gives ---------------------------------------------------------------

    @staticmethod
    def _check_hyperparameters(group: dict) -> None:
        """Raises TypeError/ValueError for a group's (or the defaults') bad hyperparameters."""
        raise NotImplementedError

    def _after_step(self, states: List[dict]) -> None:
        """Host-side state that follows a taken step of the parameters whose states these are
        (Adam: the step count)."""

    def _host_state_changed(self, key: tuple) -> bool:
        """Whether a step of this batch key changes state the host keeps: before the call (made
        by _moments; _undo_host_state takes it back after a skip) or after it (_after_step)."""
        return False

    def _undo_host_state(self, state: dict, key: tuple) -> None:
        """Take back the host-side state _moments made for a step that was skipped."""
