"""Where Inductor decomposes lowfp's rounding operators into their torch forms
(docs/design.md §3.1): ``lowfp::quantize`` into ``lowfp._torch_round.quantize`` and
``lowfp::scaled_quantize`` into ``lowfp.scaled.torch_round.scaled_quantize``, and elsewhere into
the operators' ``_in_graph`` forms, which keep lowfp's kernel without the autograd formula.

Inductor's C++ backend (torch 2.13) has no vector form of a bitcast (``Tensor.view(dtype)``): it
stores the vector, converts its lanes one by one and loads them again, which costs more than the
rest of a fused rounding together. :func:`vectorize_cpu_bitcasts` gives it one, ATen's
``at::vec::cast`` (the same bits in a register of the other type), for the bitcasts the torch
forms make; what it generates is otherwise unchanged.

Where a graph keeps lowfp's kernel, ``lowfp::quantize_in_graph`` is lowered to
``lowfp::quantize_into`` on buffers of the graph (:func:`quantize_into_planned_buffers`): the
rounding overwrites its input where nothing else reads it (most GEMM results), which saves a
pass's worth of memory traffic and a new tensor per call, and elsewhere writes a buffer that
Inductor's memory planner allocates, as for its own kernels. Where the layouts, fixed when
compiling, allow it, the generated code calls the prepared request itself
(``lowfp._ops.round_in_graph``) instead of the operator, whose dispatch into Python costs more
than the kernel on small tensors. ``lowfp::scaled_quantize_in_graph`` of a contiguous CPU tensor
whose blocks the kernel reads where they lie is lowered likewise to a direct call
(:func:`scaled_into_planned_buffers`)."""

from __future__ import annotations

from typing import Optional

import torch

from ._torch_round import fuses, quantize

__all__ = ["generating_source_key", "quantize_into_planned_buffers",
           "register_inductor_decompositions", "scaled_into_planned_buffers", "tag_compile_caches",
           "vectorize_cpu_bitcasts"]

_registered = False

# The bitcasts between types of one width that ATen's at::vec::cast reinterprets in a register.
_VECTOR_BITCASTS = {(torch.float32, torch.int32), (torch.int32, torch.float32),
                    (torch.float64, torch.int64), (torch.int64, torch.float64)}


def vectorize_cpu_bitcasts() -> bool:
    """Give Inductor's C++ vector code generator a vector form of ``to_dtype_bitcast`` between
    float32 and int32 and between float64 and int64 (the vectors that hold a kernel's lanes cast
    one by one); every other bitcast keeps Inductor's own code. Done only where Inductor's is
    the element-by-element fallback (``CppVecOverrides._scalarize``), so a torch that vectorizes
    bitcasts itself keeps its own; returns whether it was done (once per process).

    The generated kernels compute the same bits either way (a bitcast moves no bit), so a kernel
    in Inductor's cache from before is still right, only slower."""
    try:
        from torch._inductor.codegen import cpp
        from torch._inductor.codegen.cpp_utils import DTYPE_TO_CPP
        from torch._inductor.virtualized import V
    except ImportError:  # a torch laid out otherwise: Inductor's own code
        return False

    vec = getattr(cpp, "CppVecOverrides", None)
    fallback = None if vec is None else vec.__dict__.get("to_dtype_bitcast")
    if (not isinstance(fallback, staticmethod) or "_scalarize" not in fallback.__func__.__qualname__
            or not hasattr(getattr(cpp, "CppVecKernel", None), "_get_num_vectors")):
        return False  # (not the code generator this form is written for)
    element_by_element = fallback.__func__

    def to_dtype_bitcast(x, dtype, src_dtype):
        if (src_dtype, dtype) not in _VECTOR_BITCASTS:
            return element_by_element(x, dtype, src_dtype)
        n = V.kernel._get_num_vectors(src_dtype)  # (the same for dtype: one width)
        cast = f"at::vec::cast<{DTYPE_TO_CPP[dtype]}, {DTYPE_TO_CPP[src_dtype]}>"
        if n == 1:
            return f"{cast}({x})"
        # lanes in n vectors (float64 lanes of a float32 kernel): each vector cast in turn
        parts = "; ".join(f"r[{i}] = {cast}({x}[{i}])" for i in range(n))
        return (f"[&]() {{ at::vec::VectorizedN<{DTYPE_TO_CPP[dtype]}, {n}> r; {parts}; "
                "return r; }()")

    vec.to_dtype_bitcast = staticmethod(to_dtype_bitcast)
    return True


def _concrete(values) -> bool:
    return all(isinstance(v, int) or getattr(v, "is_Integer", False) for v in values)


def quantize_into_planned_buffers(x, fmt, rounding, sr_bits, seed, drawn_seed, offset, dtype,
                                  count, grad_fmt, grad_rounding):
    """Inductor's lowering of ``lowfp::quantize_in_graph``: ``lowfp::quantize_into`` (or
    ``lowfp._ops.round_in_graph`` where :func:`_calls_directly` allows it) writes the result
    into x itself where :func:`_dies_here` allows it, else into a new buffer of the graph in x's
    layout (the operator's empty_like with preserve_format), and adds the counts to a buffer of
    zeros. Shapes or strides that are not concrete keep the functional operator's fallback."""
    from torch._inductor import ir, lowering

    stored = ir.ExternKernel.realize_input(x)
    if ir.is_storage_and_layout(stored):
        ir.as_storage_and_layout(stored, freeze=True)  # (the result's strides follow these)
    size, stride = stored.get_size(), stored.get_stride()
    if not (_concrete(size) and _concrete(stride)):
        return _functional_fallback(x, fmt, rounding, sr_bits, seed, drawn_seed, offset, dtype,
                                    count, grad_fmt, grad_rounding)
    size, stride = [int(v) for v in size], [int(v) for v in stride]
    device = stored.get_device()
    result_stride = list(torch.empty_like(torch.empty_strided(size, stride, device="meta"),
                                          dtype=dtype).stride())
    if _dies_here(stored, dtype, result_stride):  # rounded where it lies
        y = x
    else:
        y = lowering.empty_strided(size, result_stride, dtype=dtype, device=device)
    counts = (lowering.full([4], 0, dtype=torch.int64, device=device) if count
              else lowering.empty_strided([0], None, dtype=torch.int64, device=device))
    if _calls_directly(device, rounding, size, stride, result_stride):
        _round_in_graph_node()(_ROUND_IN_GRAPH, stored, [y, counts if count else None], drawn_seed,
                               (fmt, rounding, sr_bits, seed, offset))
    else:
        _quantize_into(stored, y, fmt, rounding, sr_bits, seed, drawn_seed, offset,
                       counts if count else None)
    return y, counts


def _calls_directly(device, rounding, size, stride, result_stride) -> bool:
    """Whether the graph may call lowfp._ops.round_in_graph in place of lowfp::quantize_into:
    Python wrapper code, CPU tensors, and buffers of one dense layout (contiguous for stochastic
    rounding, whose words follow the logical index), which Inductor's layouts fix for every
    call. Both buffers are x, or x and one the graph allocated while x was alive: they share no
    memory."""
    from ._native import dense_layout

    if not _python_wrapper_on_cpu(device) or stride != result_stride:
        return False
    t = torch.empty_strided(size, stride, device="meta")
    return t.is_contiguous() if rounding == "stochastic" else dense_layout(t)


def _python_wrapper_on_cpu(device) -> bool:
    """Whether the graph being lowered runs as Python wrapper code (not cpp_wrapper or AOT),
    which may call a Python function of lowfp's on CPU tensors."""
    from torch._inductor.virtualized import V

    return device.type == "cpu" and not V.graph.cpp_wrapper and not getattr(V.graph, "aot_mode", False)


def scaled_into_planned_buffers(x, fmt, rounding, overflow, sr_bits, seed, drawn_seed, offset,
                                count, parts):
    """Inductor's lowering of ``lowfp::scaled_quantize_in_graph`` on the CPU: the generated code
    calls the prepared request (``lowfp.scaled.quantize.round_in_graph``), which writes the
    result into x itself where :func:`_dies_here` allows it, else into a new buffer of the graph,
    and the scales, the tensor scale and the counts into buffers of the graph. Where that call
    does not cover the rounding (a tensor that is not contiguous, or whose blocks the kernel
    reads from a copy, ``parts``, an empty tensor, shapes that are not concrete, another device
    or wrapper) the functional operator's fallback."""
    from torch._inductor import ir, lowering

    from .scaled.config import Scaled, kernel_layout, kernel_scales

    def fallback():
        return _scaled_functional_fallback(x, fmt, rounding, overflow, sr_bits, seed, drawn_seed,
                                           offset, count, parts)

    stored = ir.ExternKernel.realize_input(x)
    if ir.is_storage_and_layout(stored):
        ir.as_storage_and_layout(stored, freeze=True)
    size, stride = stored.get_size(), stored.get_stride()
    device, dtype = stored.get_device(), stored.get_dtype()
    if parts or not (_concrete(size) and _concrete(stride)) or not _python_wrapper_on_cpu(device):
        return fallback()
    size, stride = [int(v) for v in size], [int(v) for v in stride]
    meta = torch.empty_strided(size, stride, dtype=dtype, device="meta")
    if not meta.numel() or not meta.is_contiguous():
        return fallback()
    scaled = Scaled.parse(fmt)
    rows, cols, brows, bcols, move, column = kernel_layout(tuple(size), scaled, True, rounding == "stochastic")
    if move is not None:
        return fallback()  # (the kernel reads a copy with the block axis moved last)
    grid = torch.empty(-(-rows // brows), -(-cols // bcols), dtype=torch.float64, device="meta")
    scales = kernel_scales(grid, tuple(size), scaled, None, column, brows)
    if not scales.is_contiguous():
        return fallback()  # (the kernel writes its grid of scales in row-major order)
    y = x if _dies_here(stored, dtype, stride) else lowering.empty_strided(size, stride, dtype=dtype,
                                                                           device=device)
    q = lowering.empty_strided([0], None, dtype=torch.float32, device=device)
    scales = lowering.empty_strided(list(scales.shape), list(scales.stride()), dtype=torch.float64,
                                    device=device)
    tensor_scale = lowering.empty_strided([], [], dtype=torch.float64, device=device)
    counts = (lowering.full([6], 0, dtype=torch.int64, device=device) if count
              else lowering.empty_strided([0], None, dtype=torch.int64, device=device))
    _round_in_graph_node()(_SCALED_ROUND_IN_GRAPH, stored,
                           [y, scales, tensor_scale, counts if count else None], drawn_seed,
                           (fmt, rounding, overflow, sr_bits, seed, offset))
    return y, q, scales, tensor_scale, counts


_NODE = None
# the functions the generated code calls, as it imports them (module, name, the name it uses)
_ROUND_IN_GRAPH = ("lowfp._ops", "round_in_graph", "lowfp_round_in_graph")
_SCALED_ROUND_IN_GRAPH = ("lowfp.scaled.quantize", "round_in_graph", "lowfp_scaled_round_in_graph")


def _round_in_graph_node():
    """Inductor's IR node for a call ``alias(x, *written, *constants, drawn_seed)`` of the
    function ``name`` of ``module`` (``kernel``: the three names), which writes the buffers
    ``written`` (None where the call passes none) from x: lowfp._ops.round_in_graph and
    lowfp.scaled.quantize.round_in_graph (a class made once: Inductor's modules load when first
    needed)."""
    global _NODE
    if _NODE is None:
        from torch._inductor import ir
        from torch._inductor.virtualized import V
        from torch.utils._ordered_set import OrderedSet

        class RoundInGraph(ir.ExternKernel):
            def __init__(self, kernel, x, written, drawn_seed, constants):
                self.kernel = kernel
                self.passed = [t is not None for t in written]
                given = [t for t in written if t is not None]
                optional = [] if drawn_seed is None else [drawn_seed]
                inputs = [self.realize_input(t) for t in [x, *given, *optional]]
                super().__init__(None, ir.NoneLayout(device=x.get_device()),
                                 self.unwrap_storage(inputs), constants)
                self.has_drawn_seed = drawn_seed is not None
                self.name = V.graph.register_buffer(self)
                V.graph.register_operation(self)
                # each written buffer as a mutation of its own, as Inductor's fallback kernels
                # of operators that write their arguments record them
                written_buffers = self.inputs[1:1 + len(given)]
                self.alias_names = [t.get_name() for t in written_buffers]
                self.mutation_outputs = [ir.MutationOutput(ir.NoneLayout(device=t.get_device()), t, self)
                                         for t in written_buffers]

            def codegen(self, wrapper) -> None:
                module, name, alias = self.kernel
                wrapper.add_import_once(f"from {module} import {name} as {alias}")
                refs = [t.codegen_reference() for t in self.inputs]
                given = iter(refs[1:1 + sum(self.passed)])
                written = [next(given) if passed else "None" for passed in self.passed]
                drawn_seed = refs[-1] if self.has_drawn_seed else "None"
                args = [refs[0], *written, *map(repr, self.constant_args), drawn_seed]
                wrapper.writeline(f"{alias}({', '.join(args)})")

            def should_allocate(self) -> bool:
                return False

            def get_inputs_that_alias_output(self):
                return self.alias_names

            def get_unbacked_symbol_defs(self):
                return OrderedSet()

            def has_side_effects(self) -> bool:
                return True

        _NODE = RoundInGraph
    return _NODE


def _returns_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _dies_here(stored, dtype, result_stride) -> bool:
    """Whether the rounding being lowered may overwrite its input ``stored`` (realized) in place
    of a new result: the input is in the result's dtype and layout, and it is the buffer that one
    of this graph's operators made (Inductor's kernel, or an extern kernel's out=, such as a
    GEMM's; not an input, a constant, or a buffer an operator passed through from its own
    inputs), read by nothing else, directly or through views, but this rounding."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    node = V.graph.current_node
    source = node.args[0] if node is not None and node.args else None
    while True:  # (through views, each the only use of the tensor it views)
        if not (isinstance(source, torch.fx.Node) and source.op == "call_function"
                and len(source.users) == 1):
            return False
        if not _returns_view(source):
            break
        source = source.args[0]
    buffer = stored.data if isinstance(stored, (ir.StorageBox, ir.ReinterpretView)) else None
    if isinstance(buffer, ir.StorageBox):
        buffer = buffer.data
    if not (isinstance(source.target, torch._ops.OpOverload)
            and isinstance(buffer, (ir.ComputedBuffer, ir.ExternKernelOut))):
        return False
    return (source in buffer.origins  # (made while lowering it)
            and stored.get_dtype() == dtype and list(stored.get_stride()) == result_stride)


# (Inductor's fallbacks, made when registering)
_functional_fallback = _scaled_functional_fallback = _quantize_into = None


def _writes_into_buffers_here() -> bool:
    """Whether this torch's Inductor has what quantize_into_planned_buffers and its IR node use;
    elsewhere lowfp::quantize_in_graph keeps the functional fallback (the same bits)."""
    from torch._inductor import ir, lowering

    return (all(hasattr(ir, n) for n in ("ExternKernel", "ExternKernelOut", "ComputedBuffer",
                                         "MutationOutput", "NoneLayout", "ReinterpretView",
                                         "StorageBox", "as_storage_and_layout",
                                         "is_storage_and_layout"))
            and all(hasattr(lowering, n) for n in ("empty_strided", "full", "fallback_handler"))
            and hasattr(ir.ExternKernel, "realize_input"))


# The modules whose code Inductor's generated code follows: the torch forms, the lowerings and
# the functions the generated code calls.
_GENERATING_MODULES = ("_inductor.py", "_torch_round.py", "_ops.py", "_native.py", "formats.py",
                       "scaled/torch_round.py", "scaled/quantize.py", "scaled/config.py")


def generating_source_key() -> str:
    """A hash of the sources of _GENERATING_MODULES: what compiled code made by this lowfp
    depends on beyond the graph Inductor is handed."""
    import hashlib
    import pathlib

    from . import __version__

    root = pathlib.Path(__file__).resolve().parent
    digest = hashlib.sha256(__version__.encode())
    for name in _GENERATING_MODULES:
        try:
            source = (root / name).read_bytes()
        except OSError:  # (an install without its sources: the version alone)
            source = b""
        digest.update(name.encode() + b"\0" + source)
    return digest.hexdigest()[:16]


_cache_tag: Optional[str] = None  # "lowfp-" + generating_source_key(), computed once


def tag_compile_caches() -> bool:
    """Add lowfp's key (generating_source_key) to ``torch.compiler.config.cache_key_tag``, which
    torch's compile caches (Inductor's FX graph cache, AOTAutograd's) put in their keys: they
    hash the graph as Dynamo traced it, holding lowfp's operators, not the torch forms and
    lowerings lowfp substitutes, so without it code compiled by another lowfp would be reused.
    The user's own tag is kept in front; returns whether this torch has the setting. Called on
    each trace that puts a lowfp operator in a graph, so that a tag the user sets later is
    extended too."""
    global _cache_tag
    from torch.compiler import config

    current = getattr(config, "cache_key_tag", None)
    if not isinstance(current, str):
        return False
    if _cache_tag is None:
        _cache_tag = "lowfp-" + generating_source_key()
    if _cache_tag not in current:
        config.cache_key_tag = f"{current}+{_cache_tag}" if current else _cache_tag
    return True


@torch.compiler.assume_constant_result  # runs at trace time, outside the traced code
def register_inductor_decompositions() -> bool:
    """Let Inductor decompose ``lowfp::quantize`` into :func:`quantize` and
    ``lowfp::scaled_quantize`` into ``lowfp.scaled.torch_round.scaled_quantize`` (once per
    process) where :func:`fuses` says so; elsewhere, and for the tensors and scaled formats the
    torch form does not cover, into their ``_in_graph`` forms: the same implementations without
    the autograd formulas, which the traced backward has applied already.

    Called while tracing, by the functions that put the operators in a graph: importing Inductor
    costs seconds, which eager users should not pay."""
    global _registered, _functional_fallback, _scaled_functional_fallback, _quantize_into
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
        if _writes_into_buffers_here():
            _functional_fallback = lowering.lowerings[torch.ops.lowfp.quantize_in_graph.default]
            _quantize_into = lowering.fallback_handler(torch.ops.lowfp.quantize_into.default,
                                                       add_to_fallback_set=False)
            lowering.register_lowering(torch.ops.lowfp.quantize_in_graph.default,
                                       type_promotion_kind=None)(quantize_into_planned_buffers)
            _scaled_functional_fallback = lowering.lowerings[torch.ops.lowfp.scaled_quantize_in_graph.default]
            lowering.register_lowering(torch.ops.lowfp.scaled_quantize_in_graph.default,
                                       type_promotion_kind=None)(scaled_into_planned_buffers)
        for op, decompose in ((torch.ops.lowfp.quantize.default, quantize_decomposition),
                              (torch.ops.lowfp.scaled_quantize.default, scaled_decomposition)):
            decomposition.register_decomposition(op)(decompose)
        # Inductor caches its table merged with its random-op decompositions: rebuild it.
        decomposition.fast_random_decomps.cache_clear()
        vectorize_cpu_bitcasts()
        _registered = True
    tag_compile_caches()
    return True
