"""Where Inductor decomposes lowfp's rounding operators into their torch forms
(docs/design.md §3.1): ``lowfp::quantize`` into ``lowfp._torch_round.quantize`` and
``lowfp::scaled_quantize`` into ``lowfp.scaled.torch_round.scaled_quantize``, and elsewhere into
the operators' ``_in_graph`` forms, which keep lowfp's kernel without the autograd formula."""

from __future__ import annotations

import torch

from ._torch_round import fuses, quantize

__all__ = ["register_inductor_decompositions"]

_registered = False


@torch.compiler.assume_constant_result  # runs at trace time, outside the traced code
def register_inductor_decompositions() -> bool:
    """Let Inductor decompose ``lowfp::quantize`` into :func:`quantize` and
    ``lowfp::scaled_quantize`` into ``lowfp.scaled.torch_round.scaled_quantize`` (once per
    process) where :func:`fuses` says so; elsewhere, and for the tensors and scaled formats the
    torch form does not cover, into their ``_in_graph`` forms: the same implementations without
    the autograd formulas, which the traced backward has applied already.

    Called while tracing, by the functions that put the operators in a graph: importing Inductor
    costs seconds, which eager users should not pay."""
    global _registered
    if not _registered:
        from torch._inductor import decomposition, lowering
        from torch._library.utils import get_layout_constraint_tag

        from .scaled import Scaled, torch_round as scaled_form

        def quantize_decomposition(x, fmt, rounding, sr_bits, seed, drawn_seed, offset, dtype,
                                   count, grad_fmt, grad_rounding):
            if not fuses(x.device):  # lowfp's kernel, by the operator without autograd
                return torch.ops.lowfp.quantize_in_graph.default(
                    x, fmt, rounding, sr_bits, seed, drawn_seed, offset, dtype, count, grad_fmt,
                    grad_rounding)
            return quantize(x, fmt, rounding, sr_bits, seed, drawn_seed, offset, dtype, count)

        def scaled_decomposition(x, fmt, rounding, overflow, sr_bits, seed, drawn_seed, offset,
                                 count, parts):
            if not (fuses(x.device) and scaled_form.fuses_format(Scaled.parse(fmt), x.dtype)):
                return torch.ops.lowfp.scaled_quantize_in_graph.default(
                    x, fmt, rounding, overflow, sr_bits, seed, drawn_seed, offset, count, parts)
            return scaled_form.scaled_quantize(x, fmt, rounding, overflow, sr_bits, seed,
                                               drawn_seed, offset, count, parts)

        for op in (torch.ops.lowfp.quantize.default, torch.ops.lowfp.quantize_in_graph.default,
                   torch.ops.lowfp.scaled_quantize.default,
                   torch.ops.lowfp.scaled_quantize_in_graph.default):
            if op not in lowering.lowerings:
                # Where the decomposition declines, the operator reaches Inductor's lowering: give
                # it the fallback Inductor would make for a custom operator, allowed beside the
                # decomposition (Inductor refuses to make one for an operator that has both).
                lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(
                    get_layout_constraint_tag(op, with_default=True)), override_decomp=True)
        for op, decompose in ((torch.ops.lowfp.quantize.default, quantize_decomposition),
                              (torch.ops.lowfp.scaled_quantize.default, scaled_decomposition)):
            decomposition.register_decomposition(op)(decompose)
        # Inductor caches its table merged with its random-op decompositions: rebuild it.
        decomposition.fast_random_decomps.cache_clear()
        _registered = True
    return True
