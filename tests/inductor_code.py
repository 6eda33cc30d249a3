"""Compiling a function with Inductor and reading the code it generated (the fusion tests; their
``fused`` fixture is in conftest.py)."""

import torch
from torch._inductor.utils import run_and_get_code


def compiled_code(fn, *args):
    """fn compiled (fullgraph, Inductor, no cache: code made under the current settings) and
    called on args: (its result, the generated code as one string)."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="inductor")
    with torch._inductor.config.patch(force_disable_caches=True):
        result, code = run_and_get_code(compiled, *args)
    return result, "\n".join(code)
