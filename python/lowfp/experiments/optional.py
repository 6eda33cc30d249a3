"""Dependencies that only plots and experiments need, imported when first used, with an error
that says how to install them."""

from __future__ import annotations

import importlib

_EXTRA = "pip install 'lowfp[experiments]'"


def import_optional(module: str, purpose: str):
    """The module, or ImportError naming what needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{purpose} needs {module.split('.')[0]}, which is not installed: "
                          f"{_EXTRA}") from err


def pyplot(purpose: str):
    """matplotlib.pyplot on the file-only Agg backend."""
    matplotlib = import_optional("matplotlib", purpose)
    matplotlib.use("Agg")
    return import_optional("matplotlib.pyplot", purpose)
