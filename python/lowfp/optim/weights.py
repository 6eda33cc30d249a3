"""What an ExtraBits optimizer holds, seen from outside: each parameter's float32 master weight
W' (its 16-bit weight and extra bits merged) and the bytes of its weights, extra bits and
moments."""

from __future__ import annotations

from typing import Dict, List

import torch

from .._dtensor import is_dtensor
from ..backends import inverse_order
from ..extra_bits import merge, packed_words
from . import sharded
from .state import MOMENT_KEYS, check_param_dtype


@torch.no_grad()
def master_weights(optimizer) -> List[torch.Tensor]:
    """W' of every parameter as a float32 tensor, in param_groups order (a DTensor placed like
    the parameter for a DTensor parameter)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if "extra" in state and is_dtensor(p):
                w32 = merge(p._local_tensor.detach(), state["extra"], state["extra_bits"],
                            state["rounding"], weight_format=state.get("weight_format"))
                out.append(type(p).from_local(w32, p.device_mesh, p.placements, run_check=False,
                                              shape=p.shape, stride=p.stride()))
            elif "extra" in state:  # packed in the recorded memory order of p
                check_param_dtype(p, state)
                order = state.get("extra_dim_order")
                w = p.detach() if order is None else p.detach().permute(order)
                w32 = merge(w, state["extra"], state["extra_bits"], state["rounding"],
                            weight_format=state.get("weight_format"))
                out.append(w32 if order is None else w32.permute(inverse_order(order)))
            else:
                out.append(p.detach().float())
    return out


def memory_bytes(optimizer) -> Dict[str, int]:
    """Bytes held for the parameters: 16-bit weights, packed extra bits, optimizer moments
    (this rank's shards of DTensor parameters)."""
    weights = extra = moments = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            p = sharded.local(p)
            weights += p.numel() * p.element_size()
            k, rounding = group["extra_bits"], group["rounding"]
            extra += 4 * (state["extra"].numel() if "extra" in state
                          else packed_words(p.numel(), k, rounding))
            for key in MOMENT_KEYS:
                if key in state and torch.is_tensor(state[key]):
                    t = sharded.local(state[key])
                    moments += t.numel() * t.element_size()
    return {"weights": weights, "extra_bits": extra, "moments": moments,
            "total": weights + extra + moments}
