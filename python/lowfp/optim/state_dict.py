"""An ExtraBits optimizer's ``state_dict`` and ``load_state_dict`` (docs/design.md §5): torch.optim's,
plus the extra bits of DTensor parameters saved per element (so that distributed checkpoints
reshard them), the generator='s state, saved dtypes kept, and state dicts of torch.optim's
SGD/Adam/AdamW taken over."""

from __future__ import annotations

import copy
import warnings

import torch

from .._dtensor import is_dtensor
from ..extra_bits import pack, reorder_packed, unpack
from . import sharded
from .state import (EXTRA_KEYS, LOWFP_GROUP_KEYS, MOMENT_KEYS, check_buffers, device_index,
                    from_torch_state, match_layout)

TORCH_SWITCHES = ("foreach", "fused", "capturable", "differentiable")  # torch.optim's, not here
GENERATOR_STATE = "generator_state"  # the generator='s state, in the first group


def saved(optimizer, state_dict: dict) -> dict:
    """torch.optim's ``state_dict`` of the optimizer made lowfp's: a DTensor parameter's extra
    bits under ``extra_values`` (an int32 DTensor placed like the parameter, bit k the rounding's
    flag, lowfp.extra_bits.unpack), the others' packed under ``extra``; the generator's state in
    the first group (torch.distributed.checkpoint keeps only "state" and "param_groups")."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        state = state_dict["state"].get(i)
        if state is not None and "extra" in state and is_dtensor(p):
            state = dict(state)  # torch.optim's state_dict shares the state dicts themselves
            state["extra_values"] = sharded.extra_values(p, state.pop("extra"),
                                                         state["extra_bits"], state["rounding"])
            state_dict["state"][i] = state
    if optimizer._generator is not None:
        first = state_dict["param_groups"][0]
        state_dict["param_groups"][0] = {**first, GENERATOR_STATE: optimizer._generator.get_state()}
    return state_dict


def load(optimizer, state_dict: dict) -> None:
    """Loads ``state_dict`` into the optimizer as ``torch.optim.Optimizer.load_state_dict`` does,
    keeping each saved state tensor's dtype (torch would cast floating state to the parameters'
    16-bit dtype, rounding float32 moments and the packed bits). A state dict of torch.optim's
    SGD/Adam/AdamW: its hyperparameters, moments and step counts are taken; the lowfp settings
    (LOWFP_GROUP_KEYS) stay the optimizer's, moments are converted to state_dtype (rounded to
    nearest for bfloat16), each parameter keeps its extra bits, and torch's implementation
    switches are dropped."""
    added = optimizer._added_group_keys()
    generator_state = next((g[GENERATOR_STATE] for g in state_dict["param_groups"]
                            if GENERATOR_STATE in g), None)
    state_dict = {**state_dict, "param_groups": [
        {key: v for key, v in g.items() if key != GENERATOR_STATE} for g in state_dict["param_groups"]]}
    groups, from_torch = [], []
    for g, own in zip(state_dict["param_groups"], optimizer.param_groups):
        foreign = not any(key in g for key in LOWFP_GROUP_KEYS)  # saved by torch.optim
        g = {**added, **g}
        if foreign:
            g = {key: v for key, v in g.items() if key not in TORCH_SWITCHES}
            g.update((key, own[key]) for key in LOWFP_GROUP_KEYS)
        groups.append(g)
        from_torch.append(foreign)
    groups += state_dict["param_groups"][len(groups):]  # a count mismatch: torch's error
    for g in groups:
        # (torch.optim.Optimizer.__setstate__ adds "differentiable" to the defaults)
        missing = sorted(set(optimizer.defaults) - set(g) - set(TORCH_SWITCHES))
        if missing:
            raise ValueError(f"state_dict: a param group lacks {missing}, which "
                             f"{type(optimizer).__name__} needs; was it saved by another optimizer?")
    # The extra bits that parameters of groups saved by torch.optim keep.
    kept = {id(p): {key: v for key, v in optimizer.state[p].items() if key in EXTRA_KEYS}
            for own, foreign in zip(optimizer.param_groups, from_torch) if foreign
            for p in own["params"] if p in optimizer.state}
    saved_state = state_dict["state"]
    ids = [i for g in groups for i in g["params"]]
    # a copy: the caller's dict is not changed
    torch.optim.Optimizer.load_state_dict(optimizer, {**state_dict, "param_groups": groups})
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, p in zip(ids, params):
        state = optimizer.state[p]
        for key, value in saved_state.get(pid, {}).items():
            # Adam's step count stays on the CPU, as in torch.optim: each step reads it
            where = "cpu" if key == "step" else p.device
            if torch.is_tensor(value) and key in MOMENT_KEYS and is_dtensor(p):
                value = sharded.placed_like(p, value)
            state[key] = (value.to(device=where, copy=True) if torch.is_tensor(value)
                          else copy.deepcopy(value))
        load_extra_bits(p, state)
    index = device_index(optimizer.weight_stats.counts)
    for group, foreign in zip(optimizer.param_groups, from_torch):
        for p in group["params"]:
            if foreign and (p in optimizer.state or id(p) in kept):
                # kept extra bits go back whether torch saved state for p or not (never stepped)
                from_torch_state(optimizer.state[p], group["state_dtype"])
                optimizer.state[p].update(kept.get(id(p), {}))
            if p not in optimizer.state:
                continue
            state = optimizer.state[p]
            for key in MOMENT_KEYS:
                if key in state and state[key] is None:  # torch.optim may save None buffers
                    del state[key]
            if is_dtensor(p):
                check_buffers(p._local_tensor, state, group, index,
                              [sharded.local(state[key]) for key in MOMENT_KEYS
                               if torch.is_tensor(state.get(key))])
                continue
            match_layout(p, state)  # saved from a model laid out otherwise
            check_buffers(p, state, group, index)
            if "extra" in state:  # saved before the dtype was recorded: p's from now on
                state.setdefault("param_dtype", p.dtype)
    if generator_state is not None:
        if optimizer._generator is None:
            warnings.warn("state_dict holds the state of the generator= that drew the saved "
                          "optimizer's stochastic-rounding seeds; this optimizer has none and "
                          "draws from torch's default generator: pass generator= to continue "
                          "the saved run", stacklevel=3)
        else:
            optimizer._generator.set_state(generator_state.cpu())


def load_extra_bits(p: torch.Tensor, state: dict) -> None:
    """Loaded extra bits made the packed words of p (of its shard, for a DTensor): saved per
    element (``extra_values``, by a sharded optimizer) or packed (``extra``, by an unsharded
    one, in its recorded memory order)."""
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
        state["extra"] = sharded.packed_shard(p, values, k, rounding)
    else:  # row-major; match_layout moves it into p's memory order
        if is_dtensor(values):
            values = values.full_tensor()
        if tuple(values.shape) != tuple(p.shape):
            raise ValueError(f"saved extra bits of shape {tuple(values.shape)} for a parameter "
                             f"of shape {tuple(p.shape)}; was state loaded from another model?")
        state["extra"] = pack(values.to(p.device), k, rounding)
        state.pop("extra_dim_order", None)
