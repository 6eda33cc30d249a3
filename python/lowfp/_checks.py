"""Argument validators shared by the public modules: each names the argument and what is
allowed, and never lets an unhashable or oddly typed value reach a dictionary lookup."""

from __future__ import annotations

import numbers
from typing import Collection

import torch


def is_int(value) -> bool:
    """A Python int (or numpy integer) that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number (int, float, numpy scalar) that is not a bool; NaN included."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(value, name: str) -> int:
    """``value`` as an int, or TypeError naming ``name``."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


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
