"""Argument validators shared by the public modules: each names the argument and what is
allowed, and never lets an unhashable or oddly typed value reach a dictionary lookup."""

from __future__ import annotations

from typing import Collection

import torch


def check_choice(value, choices: Collection[str], name: str, *, none_ok: bool = False) -> None:
    """``value`` must be one of the strings ``choices`` (or None when ``none_ok``): else a
    ValueError naming ``name``."""
    if (none_ok and value is None) or (isinstance(value, str) and value in choices):
        return
    allowed = f"one of {tuple(choices)}" + (" or None" if none_ok else "")
    raise ValueError(f"{name} must be {allowed}, got {value!r}")


def is_dtype_in(value, dtypes: Collection[torch.dtype]) -> bool:
    """Whether ``value`` is a torch.dtype among ``dtypes`` (False for anything else, hashable
    or not)."""
    return isinstance(value, torch.dtype) and value in dtypes
