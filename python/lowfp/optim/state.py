"""What the fused step relies on about a parameter's state, checked before each step, and how
state is converted or moved: torch.optim state dicts, memory layouts."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..backends import memory_order
from ..extra_bits import packed_words, reorder_packed

STATE_DTYPES = (torch.float32, torch.bfloat16)
PARAM_DTYPES = (torch.float16, torch.bfloat16)
MOMENT_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
LOWFP_GROUP_KEYS = ("extra_bits", "rounding", "state_dtype", "param_dtype",  # not torch.optim's
                     "weight_format")
EXTRA_KEYS = ("extra", "extra_bits", "rounding", "param_dtype", "extra_dim_order", "weight_format")



def from_torch_state(state: dict, state_dtype: torch.dtype) -> None:
    """A parameter's state as torch.optim saved it, made this optimizer's: moments in
    state_dtype, the step count a float32 CPU tensor (a plain number in old torch.optim)."""
    for key in MOMENT_KEYS:
        if torch.is_tensor(state.get(key)) and state[key].is_floating_point():
            state[key] = state[key].to(state_dtype)
    if "step" in state and not torch.is_tensor(state["step"]):
        state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)


META_INDEX = -2  # check_buffers' index of the meta device (whose get_device() is -1, the CPU's)


def device_index(t: torch.Tensor) -> int:
    """check_buffers' index of t's device."""
    return META_INDEX if t.is_meta else t.get_device()


def _on(t: torch.Tensor, index: int) -> bool:
    return t.is_meta if index == META_INDEX else t.get_device() == index


def check_buffers(p: torch.Tensor, state: dict, group: dict, index: int,
                   moments: Optional[Sequence[torch.Tensor]] = None) -> int:
    """The fused kernels trust every buffer's size, dtype and device. A parameter whose ``.data``
    was replaced, a changed group setting or state loaded from another model must fail here, not
    read or write past a buffer. ``index``: the optimizer's CUDA device index, -1 for the CPU or
    META_INDEX for the meta device (device_index gives it);
    ``moments``: the state tensors the step passes (default: all). Returns p.numel().

    It runs for every parameter at every step (once per parameter inside backward), so each
    property is read once and the device by one attribute: ``is_cpu`` for a CPU optimizer,
    ``get_device()`` for a CUDA one, ``is_meta`` for a meta one; torch.device objects
    and shapes are built only once something is wrong."""
    n, cpu, param_dtype = p.numel(), index == -1, p.dtype
    if param_dtype not in PARAM_DTYPES:
        raise TypeError(f"a parameter of shape {tuple(p.shape)} now has dtype {p.dtype}; extra bits "
                        "need float16 or bfloat16 parameters")
    if not (p.is_cpu if cpu else _on(p, index)):
        device = (torch.device("cpu") if cpu else torch.device("meta") if index == META_INDEX
                  else torch.device("cuda", index))
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
        if state.get("weight_format") != group.get("weight_format"):
            raise ValueError(f"weight_format of a parameter group changed from "
                             f"{state.get('weight_format')!r} to {group.get('weight_format')!r} "
                             "after its extra bits were created; build a new optimizer instead")
        if state.get("param_dtype", param_dtype) is not param_dtype:
            check_param_dtype(p, state)
        want = packed_words(n, k, rounding)
        if (extra.dtype is not torch.int32 or extra.numel() != want
                or not (extra.is_cpu if cpu else _on(extra, index))
                or not extra.is_contiguous()):
            raise ValueError(f"the extra bits of a parameter of shape {tuple(p.shape)} are "
                             f"{extra.numel()} {extra.dtype} words on {extra.device}, but it needs "
                             f"{want} contiguous int32 words on {p.device} (k={k}, rounding="
                             f"{rounding!r}); was its .data replaced, or state loaded from another "
                             "model?")
        if state.get("extra_dim_order") != order:
            raise LayoutChanged
    if moments is None:
        moments = [state[key] for key in MOMENT_KEYS if torch.is_tensor(state.get(key))]
    dtype = group["state_dtype"]
    for t in moments:
        # a moment of another shape (state edited by hand) is read in its row-major order
        laid_out = t.is_contiguous() if row_major else t.shape == p.shape and same_memory_order(t, p)
        if not laid_out and t.shape == p.shape:
            raise LayoutChanged
        if (t.dtype is not dtype or t.numel() != n or not laid_out
                or not (t.is_cpu if cpu else _on(t, index))):
            key = next((key for key in MOMENT_KEYS if state.get(key) is t
                        or getattr(state.get(key), "_local_tensor", None) is t), "a moment")
            raise ValueError(f"state {key!r} of a parameter of shape {tuple(p.shape)} is a "
                             f"{tuple(t.shape)} {t.dtype} tensor on {t.device}, but the step needs a "
                             f"{dtype} tensor of {n} elements on {p.device} in the parameter's "
                             "memory order (state_dtype cannot change once moments exist; was the "
                             "parameter's .data replaced, or state loaded from another model?)")
    return n


def check_param_dtype(p: torch.Tensor, state: dict) -> None:
    """Extra bits extend the 16-bit type they were split from: read with another (model.half()
    on a bfloat16 model after the optimizer was made) they would give a wrong master weight, and
    the right one cannot be recovered from the converted weights."""
    made_for = state.get("param_dtype", p.dtype)
    if made_for != p.dtype:  # (dtypes are singletons: ``is`` is the fast test, == the sure one)
        raise TypeError(f"a parameter of shape {tuple(p.shape)} is now {p.dtype}, but its extra bits "
                        f"extend {made_for} weights (was the model converted after the optimizer "
                        "was made?); its float32 master weight cannot be recovered from the "
                        "converted weights: convert the model before building the optimizer")


class LayoutChanged(ValueError):
    """A parameter's memory order is not its extra bits' or moments' (model.to(memory_format=...)
    since they were made): match_layout moves them."""

    def __init__(self):
        super().__init__("a parameter's memory layout changed since its optimizer state was made")


def record_order(state: dict, order: Optional[Tuple[int, ...]]) -> None:
    """Notes the memory order its extra bits are packed in; none for row-major (contiguous)."""
    if order is None:
        state.pop("extra_dim_order", None)
    else:
        state["extra_dim_order"] = order


def same_memory_order(t: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether t (of p's shape) has p's strides, except on dims of size 1, which do not move."""
    ts, ps = t.stride(), p.stride()
    return ts == ps or all(a == b for a, b, size in zip(ts, ps, p.shape) if size > 1)


def match_layout(p: torch.Tensor, state: dict) -> None:
    """Moves a parameter's extra bits and moments into its current memory order: after
    ``model.to(memory_format=...)``, or state loaded from a model laid out otherwise. Exact: the
    packed bits of each element move with it (so a stochastic flag stays with its weight).
    Buffers of the wrong size are left for check_buffers to refuse."""
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
            pass  # words that do not fit: check_buffers refuses them, saying what they are
        else:
            record_order(state, order)
    for key in MOMENT_KEYS:
        t = state.get(key)
        if torch.is_tensor(t) and t.shape == p.shape and not same_memory_order(t, p):
            state[key] = torch.empty_like(p, dtype=t.dtype).copy_(t)


