"""The operator-level view of a model's forward pass that ``assign.trace`` and ``emulate`` share
(docs/design.md §6).

While the model's ``forward`` runs, a ``TorchFunctionMode`` sees every call of a torch function,
a ``torch.nn.functional`` function or a Tensor method — from nn.Modules and from user code alike
(``x + y``, ``torch.cat``, ``F.linear``) — without rewriting the model. Each call is one of:

- **pass**: metadata (``size``, ``dtype``, ``requires_grad``), factories (``zeros_like``) and
  anything that returns no floating tensor: not part of the training step's tensors.
- **view**: calls that move or reinterpret values without changing any (``view``, ``transpose``,
  ``flatten``, ``__getitem__`` but for partitions, ``contiguous``, ``clone``, dtype casts,
  ``repeat``, channel shuffles): their result is the same tensor of TS as their input, so it is
  not recorded or rounded again.
- **partition**: ``chunk``, ``split``, ``tensor_split``, ``unbind``, ``narrow`` (and their
  variants), and basic slicing that keeps a strict part of a dim (``x[:, :c]``, see ``cuts``), are
  operators: each part is a tensor of its own, as in the precision-assignment paper's code, so a
  part that bypasses a GEMM (ShuffleNet-v2's identity half) keeps its own precision and is
  counted on its own.
- **operator**: everything else that takes a tracked tensor (an activation of this step, a model
  input or a parameter) and returns floating tensors. Its floating outputs are new activations v.

One call is one operator: a Python-level composite that torch dispatches as a single function is
one operator too (``F.multi_head_attention_forward`` for nn.MultiheadAttention, ``torch.lstm`` for
nn.LSTM, ``F.layer_norm``). Operators are named ``<module path>:<function>`` (the innermost
submodule whose forward is running, called as ``module(x)`` or ``module.forward(x)``; ``#n`` for
the n-th repeat inside the same module in one forward), which stays the same from step to step.

``ForwardSession.call`` is the definition of what a call becomes, and what torch.compile traces;
an eager call takes the same algorithm in C (``lowfp._C.intercept_call``, cpp/bindings/
def_intercept.hpp), which hands results that are not one tensor back to ``_outputs_of``.
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from . import _C

PASS, VIEW, OP = 0, 1, 2

_VIEW_NAMES = frozenset("""
view view_as reshape reshape_as flatten unflatten squeeze unsqueeze squeeze_ unsqueeze_ transpose
transpose_ t t_ permute movedim moveaxis swapaxes swapdims expand expand_as broadcast_to contiguous
__getitem__ select detach detach_ clone to float double half bfloat16 type type_as cpu cuda requires_grad_ repeat tile
flip fliplr flipud roll rot90 diagonal unfold as_strided channel_shuffle native_channel_shuffle
pixel_shuffle pixel_unshuffle index_select gather take masked_select repeat_interleave
""".split())
_PROPERTY_VIEWS = frozenset({"T", "mT", "H", "mH"})
_CONSTANT_NAMES = frozenset("""
zeros_like ones_like empty_like full_like rand_like randn_like randint_like new_zeros new_ones
new_empty new_full new_tensor
""".split())
# docs/design.md §6: linear, conv*, matmul/mm/bmm/addmm/baddbmm/einsum, scaled-dot-product attention; plus
# the composites that are one operator here and consist of GEMMs (attention, recurrent layers).
GEMM_NAMES = frozenset("""
linear bilinear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d conv_tbc
matmul __matmul__ __rmatmul__ mm bmm addmm addbmm baddbmm addmv mv einsum tensordot chain_matmul
multi_dot scaled_dot_product_attention multi_head_attention_forward lstm gru rnn_tanh rnn_relu
lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
""".split())

# The partitioning calls (docs/design.md §6); __getitem__ is one when it cuts (see cuts).
PARTITION_NAMES = frozenset("""
chunk unsafe_chunk split unsafe_split split_with_sizes unsafe_split_with_sizes tensor_split hsplit
vsplit dsplit unbind narrow narrow_copy __getitem__
""".split())

# Operators whose floating outputs hold only values of their first argument and zeros (ReLU, max
# pooling, the partitions): where that argument already holds values of the outputs' format,
# rounding an output changes nothing (see Emulator._round).
SELECTING_NAMES = frozenset("""
relu relu_ max_pool1d max_pool2d max_pool3d max_pool1d_with_indices max_pool2d_with_indices
max_pool3d_with_indices adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d
adaptive_max_pool1d_with_indices adaptive_max_pool2d_with_indices adaptive_max_pool3d_with_indices
""".split()) | PARTITION_NAMES

_classes: Dict[object, Tuple[int, str]] = {}


def classify(func) -> Tuple[int, str]:
    """(PASS | VIEW | OP, short name) of a function seen by the mode (cached)."""
    try:
        return _classes[func]
    except (KeyError, TypeError):
        pass
    full = None
    own = getattr(func, "__name__", None)
    if own and getattr(torch, own, None) is func:  # (resolve_name calls torch.mm "torch.spmm")
        full = "torch." + own
    else:
        try:
            full = resolve_name(func)
        except Exception:  # resolve_name walks torch's namespaces; never let it break a forward
            full = None
    if not full:
        full = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    parts = full.split(".")
    if parts[-1] in ("__get__", "__set__", "__delete__") and len(parts) > 1:
        name = parts[-2]
        kind = VIEW if parts[-1] == "__get__" and name in _PROPERTY_VIEWS else PASS
    else:
        name = parts[-1]
        kind = VIEW if name in _VIEW_NAMES else PASS if name in _CONSTANT_NAMES else OP
    try:
        _classes[func] = (kind, name)
    except TypeError:
        pass
    return kind, name


@torch.compiler.assume_constant_result
def classify_while_tracing(func) -> Tuple[int, str]:
    """classify(func) where Dynamo traces a forward: run when tracing, its result a constant of
    the graph, so that Dynamo guards on nothing of the table (where it guards on its keys in
    order, an entry added later by eager code fails the graph's guards)."""
    return classify(func)


_TAG = "_lowfp_ts"          # (forward serial, TS name) on every tensor the current forward tracks
_serials = itertools.count(1)


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def slice_length(s: slice, size: int) -> int:
    """len(range(*s.indices(size))) for int (or None) bounds, by Python's clamping rules in plain
    arithmetic, which Dynamo traces (it does not trace slice.indices on every torch); a step of 0,
    which torch refuses, counts as the whole dim."""
    step = 1 if s.step is None else s.step
    if step == 0:
        return size
    lo, hi = (0, size) if step > 0 else (-1, size - 1)  # (where a bound past either end clamps)

    def bound(v, default):
        if v is None:
            return default
        if v < 0:
            return max(v + size, lo)
        return min(v, hi)

    start, stop = bound(s.start, lo if step > 0 else hi), bound(s.stop, hi if step > 0 else lo)
    if step > 0:
        return max(0, (stop - start + step - 1) // step)
    return max(0, (start - stop - step - 1) // -step)


def cuts(t, index) -> bool:
    """Whether ``t[index]`` is basic slicing that keeps a strict part of some dim (``x[:, :c]``,
    ``x[..., a:b]``, ``x[::2]``), which makes it a partition; integer indices (``x[:, 0]``, a
    token picked to read), full-range slices and advanced indexing stay views."""
    if not isinstance(t, torch.Tensor):
        return False
    if isinstance(index, list) and any(i is None or i is Ellipsis or type(i) is slice for i in index):
        index = tuple(index)  # (torch's legacy reading of a list holding slices: a tuple)
    items = index if isinstance(index, tuple) else (index,)
    if not all(i is None or i is Ellipsis or type(i) in (slice, int) for i in items):
        return False
    dim = 0
    for k, i in enumerate(items):
        if i is Ellipsis:  # the dims the items after it do not index
            dim = t.dim() - sum(1 for j in items[k + 1:] if j is not None and j is not Ellipsis)
        elif type(i) is slice:
            if dim >= t.dim():
                return False  # (torch raises the IndexError)
            size = int(t.shape[dim])
            if slice_length(i, size) < size:
                return True
            dim += 1
        elif i is not None:
            dim += 1
    return False


def writes_in_place(fname: str, args, kwargs, out) -> bool:
    """Whether an operator call wrote into a tensor it was given: it returned one of its arguments
    (``add_``, ``x += y``, ``F.relu(x, inplace=True)``), or it is ``__setitem__`` or has ``out=``."""
    if fname == "__setitem__" or (kwargs and kwargs.get("out") is not None):
        return True
    if isinstance(out, torch.Tensor):  # (the common case: one result)
        for a in args:
            if a is out:
                return True
        return False
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for o in outs:  # (loops, not any() over generators: Dynamo traces those step by step)
        if isinstance(o, torch.Tensor):
            for a in args:
                if a is o:
                    return True
    return False


def _first(new):
    return new[0]


def floating_outputs(out) -> Tuple[List[torch.Tensor], object]:
    """The floating tensors of an operator's result and a function that rebuilds the result with
    replacements for them (tuples, lists and torch.return_types keep their type)."""
    if isinstance(out, torch.Tensor):
        return ([out] if out.is_floating_point() else []), _first
    if isinstance(out, (tuple, list)):
        slots = [i for i, o in enumerate(out) if _floating(o)]

        def rebuild(new, out=out, slots=slots):
            items = list(out)
            for i, t in zip(slots, new):
                items[i] = t
            if isinstance(out, list):
                return items
            return type(out)(items) if type(out) is not tuple else tuple(items)
        return [out[i] for i in slots], rebuild
    return [], None


_C.intercept_setup(_classes, classify, cuts, SELECTING_NAMES, GEMM_NAMES, torch.Tensor,
                   torch.nn.Parameter, _TAG, (PASS, VIEW, OP))


def _named_forward(forward, name: str, stack: List[str]):
    """A submodule's forward that has its path ``name`` on ``stack`` while it runs."""
    def named(*args, **kwargs):
        stack.append(name)
        try:
            return forward(*args, **kwargs)
        finally:
            if stack:  # (a forward's start empties it)
                stack.pop()
    return named


class _Mode(TorchFunctionMode):
    """The torch-function mode pushed while the model's forward runs; it hands every call to
    its session (kept apart so that sessions can be context managers of their own)."""

    def __init__(self, session: "ForwardSession"):
        super().__init__()
        self.session = session
        # ForwardSession.call's eager path in C (lowfp._C.intercept_call, the same algorithm);
        # None: every call takes the Python method, which torch.compile traces in any case.
        self.native = _C.intercept_call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.native is None or torch.compiler.is_compiling():
            return self.session.call(func, args, kwargs)
        return self.native(self.session, func, args, kwargs)


@torch.compiler.disable
def _begin_outside_graphs(session: "ForwardSession") -> None:
    """A forward's bookkeeping (closing the previous step reads its counts) runs eagerly, so
    that a compiled model's graph holds the forward alone and does not depend on the step."""
    session._begin()


@torch.compiler.disable
def _forward_outside_graphs(session: "ForwardSession", inner, args, kwargs):
    return session._forward(inner, args, kwargs)


class ForwardSession:
    """Runs a model's forward with every torch-function call classified and tracked tensors
    tagged. Subclasses decide what a parameter, a model input and an operator output become:
    ``_param(p, name, compiling)``, ``_input(t, name)``, ``_output(t, name, source, new,
    compiling)`` and ``_operator(...)``."""

    # Whether the native interception (lowfp._C.intercept_call) rounds an output and a
    # parameter by lowfp._C.emulator_round, the eager path of lowfp.emulate.Emulator._round, in
    # place of calling _output and _param.
    _native_round = False

    def __init__(self, model: torch.nn.Module):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.param_names: Dict[int, str] = {id(p): n for n, p in model.named_parameters()}
        self._other_params: set = set()  # ids of Parameters seen that are not the model's
        self._module_stack: List[str] = []
        self._traced: Dict[torch.Tensor, str] = {}  # the tags while Dynamo traces a forward
        self._repeats: Dict[str, int] = {}
        self.serial = 0
        self.writes = 0  # operator calls of this forward that wrote into a tensor they were given
        self._saved_forwards: List[tuple] = []  # (submodule, its own instance forward or None)
        self._installed = False
        self._saved_forward = None
        self._mode = _Mode(self)
        # (the emulation records nothing per operator: call skips its _operator)
        self._records_operators = type(self)._operator is not ForwardSession._operator
        # The GEMMs' emulation (lowfp.scaled.gemm.GemmHandler) or None: called, with the mapped
        # arguments, in place of the functions GEMM_NAMES names; NotImplemented passes a call on.
        self.gemms = None

    # -- installation ----------------------------------------------------------------------
    def install(self) -> None:
        if self._installed:
            return
        model = self.model
        if model.__dict__.get("_lowfp_session") is not None:
            raise ValueError("model is already traced or emulated by another lowfp session; "
                             "close that one first")
        # Each submodule's forward, wrapped to keep its path on the stack while it runs (an
        # instance attribute, which nn.Module.__call__ calls as it would the method; hooks would
        # take __call__'s slow path for every module).
        for name, module in model.named_modules():
            if module is not model:
                self._saved_forwards.append((module, module.__dict__.get("forward")))
                module.forward = _named_forward(module.forward, name, self._module_stack)
        self._saved_forward = model.__dict__.get("forward")
        inner = model.forward
        session = self

        def forward(*args, **kwargs):
            return session._run_forward(inner, args, kwargs)
        model.forward = forward
        model.__dict__["_lowfp_session"] = self
        self._installed = True

    def remove(self) -> None:
        if not self._installed:
            return
        for module, saved in reversed(self._saved_forwards):
            if saved is not None:
                module.forward = saved
            else:
                del module.forward
        self._saved_forwards.clear()
        model = self.model
        if self._saved_forward is not None:
            model.forward = self._saved_forward
        else:
            del model.forward
        model.__dict__.pop("_lowfp_session", None)
        self._installed = False

    # -- one forward -----------------------------------------------------------------------
    def _begin(self) -> None:
        """Called before each forward (subclasses reset their per-step state here)."""
        self.serial = next(_serials)
        self.writes = 0
        self._module_stack.clear()
        self._repeats.clear()

    def _run_forward(self, inner, args, kwargs):
        _begin_outside_graphs(self)
        if torch.compiler.is_compiling() and not self._compilable():
            return _forward_outside_graphs(self, inner, args, kwargs)
        return self._forward(inner, args, kwargs)

    def _forward(self, inner, args, kwargs):
        self._start()
        args = tuple(self._map_input(a, f"input[{i}]") for i, a in enumerate(args))
        kwargs = {k: self._map_input(v, f"input[{k}]") for k, v in kwargs.items()}
        try:
            with self._mode:
                return inner(*args, **kwargs)
        finally:
            self._traced.clear()
            self._end()

    def _start(self) -> None:
        """Called as each forward starts, inside a compiled graph too: where Dynamo traces it,
        subclasses give their per-forward caches new dicts here (a dict made by the trace, whose
        contents Dynamo guards on nowhere), and in _end once it ends."""

    def _end(self) -> None:
        """Called after each forward, inside a compiled graph too (see _start)."""

    def _map_input(self, a, name):
        if _floating(a):  # an alias, so that neither tags nor hooks land on the caller's tensor
            return self._tag(self._input(a.view_as(a), "v:" + name), "v:" + name)
        if isinstance(a, (tuple, list)) and any(_floating(x) for x in a):
            items = [self._map_input(x, f"{name[:-1]}.{i}]") for i, x in enumerate(a)]
            return items if isinstance(a, list) else tuple(items)
        return a

    def _tag(self, t: torch.Tensor, name: str, compiling: Optional[bool] = None) -> torch.Tensor:
        """t tagged as tensor ``name`` of this forward (compiling: torch.compiler.is_compiling(),
        where the caller knows it)."""
        if torch.compiler.is_compiling() if compiling is None else compiling:
            self._traced[t] = name  # (Dynamo cannot set attributes on tensors)
        else:
            setattr(t, _TAG, (self.serial, name))
        return t

    def tracked_name(self, t: torch.Tensor, compiling: Optional[bool] = None) -> Optional[str]:
        if torch.compiler.is_compiling() if compiling is None else compiling:
            return self._traced.get(t)
        tag = getattr(t, _TAG, None)
        return tag[1] if tag is not None and tag[0] == self.serial else None

    def _map_args(self, args, inputs: List[str], compiling: bool):
        """args with parameters replaced by self._param(...); TS names of tracked tensors are
        appended to inputs. Returns args itself when nothing was replaced."""
        new = None
        for i in range(len(args)):  # (not enumerate: Dynamo traces its generator step by step)
            a = args[i]
            if isinstance(a, torch.Tensor):
                if not compiling:  # (_see's first case inline: an activation of this forward)
                    tag = getattr(a, _TAG, None)
                    if tag is not None and tag[0] == self.serial:
                        inputs.append(tag[1])
                        continue
                r = self._see(a, inputs, compiling)
            elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                r = self._map_args(a, inputs, compiling)
            else:
                continue
            if r is not a:
                if new is None:
                    new = list(args)
                new[i] = r
        if new is None:
            return args
        return new if isinstance(args, list) else tuple(new)

    def _see(self, t: torch.Tensor, inputs: List[str], compiling: bool) -> torch.Tensor:
        if compiling:
            name = self._traced.get(t)
        else:
            tag = getattr(t, _TAG, None)
            name = tag[1] if tag is not None and tag[0] == self.serial else None
        if name is not None:
            inputs.append(name)
            return t
        if type(t) is torch.Tensor:  # (never a Parameter: isinstance would ask Parameter's metaclass)
            return t
        if isinstance(t, torch.nn.Parameter):
            pname = self.param_names.get(id(t))
            if pname is None and id(t) not in self._other_params:
                # A parameter registered since install: FSDP2 swaps each module's unsharded
                # parameters in for its sharded ones while it runs.
                self.param_names.update((id(p), n) for n, p in self.model.named_parameters())
                pname = self.param_names.get(id(t))
                if pname is None:
                    self._other_params.add(id(t))  # not the model's: looked up once
            if pname is not None:
                name = "theta:" + pname
                inputs.append(name)
                r = self._param(t, name, compiling)
                return self._tag(r, name, compiling) if r is not t else r  # never tag the user's Parameter
        return t

    def call(self, func, args, kwargs):
        """One torch-function call made by the model's forward (see the module docs)."""
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            kind, fname = classify_while_tracing(func)
        else:
            try:
                kind, fname = _classes[func]
            except (KeyError, TypeError):
                kind, fname = classify(func)
        if kind == PASS:
            return func(*args, **kwargs)
        if fname == "__getitem__" and len(args) == 2 and cuts(args[0], args[1]):
            kind = OP  # a strict part of a dim: a partition, as narrow (docs/design.md §6)
        compiling = torch.compiler.is_compiling()
        inputs: List[str] = []
        args = self._map_args(args, inputs, compiling)
        # (before the call, which may change it in place)
        source = (self._source_of(args[0]) if fname in SELECTING_NAMES and args
                  and isinstance(args[0], torch.Tensor) else None)
        if kwargs:
            values = list(kwargs.values())
            mapped = self._map_args(values, inputs, compiling)
            if mapped is not values:
                kwargs = dict(zip(kwargs.keys(), mapped))
        out = NotImplemented
        if self.gemms is not None and fname in GEMM_NAMES:
            out = self.gemms(func, args, kwargs)
        if out is NotImplemented:
            out = func(*args, **kwargs)
        wrote = kind == OP and writes_in_place(fname, args, kwargs, out)
        if wrote:
            self.writes += 1
        if not inputs:  # constants: computed from nothing this step tracks
            return out
        return self._outputs_of(out, kind, fname, inputs, source, wrote, compiling)

    def _outputs_of(self, out, kind: int, fname: str, inputs: List[str], source, wrote: bool,
                    compiling: bool):
        """The rest of ``call`` once the function ran on tracked tensors: its floating results
        named, decided (``_output``) and tagged (a view's take its input's name)."""
        tensors, rebuild = floating_outputs(out)
        if not tensors:
            return out
        if kind == VIEW:
            for t in tensors:
                self._tag(t, inputs[0], compiling)
            return out
        module = self._module_stack[-1] if self._module_stack else ""
        base = f"{module}:{fname}" if module else fname
        n = self._repeats.get(base, 0)
        self._repeats[base] = n + 1
        key = base if n == 0 else f"{base}#{n}"
        if len(tensors) == 1 and rebuild is _first:  # (the usual case: one tensor)
            name = "v:" + key
            result = self._tag(self._output(out, name, source, not wrote, compiling), name, compiling)
            if self._records_operators:
                self._operator(key, fname, module, fname in GEMM_NAMES, inputs, [name], tensors)
            return result
        names = ["v:" + key] if len(tensors) == 1 else [f"v:{key}[{j}]" for j in range(len(tensors))]
        new = [self._tag(self._output(t, name, source, not wrote, compiling), name, compiling)
               for t, name in zip(tensors, names)]
        if self._records_operators:
            self._operator(key, fname, module, fname in GEMM_NAMES, inputs, names, tensors)
        return rebuild(new)

    # -- what subclasses decide ------------------------------------------------------------
    def _compilable(self) -> bool:
        """Whether torch.compile may trace the session's forward; if not, a compiled model runs
        it eagerly (one graph break)."""
        return True

    def _param(self, p: torch.nn.Parameter, name: str, compiling: bool = False) -> torch.Tensor:
        return p

    def _input(self, t: torch.Tensor, name: str) -> torch.Tensor:
        return t

    def _output(self, t: torch.Tensor, name: str, source=None, new: bool = False,
                compiling: bool = False) -> torch.Tensor:
        """source: what ``_source_of`` said of the first argument of a SELECTING_NAMES operator
        (None otherwise). new: the call returned none of the tensors it was given (t is a result
        of its own, or a view of one). compiling: whether torch.compile traces the call (the
        caller knows)."""
        return t

    def _source_of(self, t: torch.Tensor):
        """What the session knows of the values of a selecting operator's argument t."""
        return None

    def _operator(self, key, fname, module, is_gemm, inputs, outputs, tensors) -> None:
        pass
