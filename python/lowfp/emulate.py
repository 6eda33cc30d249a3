"""Emulated low-precision training (docs/design.md §6): every tensor of the training step is rounded to
the format its assignment gives it, in forward and backward, with promotion of overflowing
tensors and a per-step history.

>>> import torch, lowfp
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
>>> x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
>>> tr = lowfp.assign.trace(model, x, torch.nn.functional.cross_entropy, y)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> with lowfp.emulate(model, lowfp.assign.uniform(tr)) as em:
...     for _ in range(3):
...         loss = torch.nn.functional.cross_entropy(model(x), y)
...         opt.zero_grad(); loss.backward(); opt.step()
>>> len(em.history.steps)
3

What is rounded where:
- an operator's floating outputs v as they are produced (forward formats saturate);
- a parameter theta once per forward, at its first use (the optimizer keeps the unrounded one);
- the model's floating inputs on entry;
- in backward, the gradient dv of each v once it is complete (summed over its uses) and each
  weight gradient dtheta before it is accumulated into ``.grad``; backward formats let overflow
  become inf (``backward_overflow="saturate"`` hides it from the values, not from the counts).

ReLU, max pooling and the partitions (``split``, ``chunk``, ``narrow``, a cutting slice...:
``_intercept.SELECTING_NAMES``) only select among their input's values and zeros: when the input
holds results of an output's forward format, rounded in this forward with no in-place write by any
operator since, and that format's grid is fixed (an fp(e,m,b) format that saturates: not S2FP8 or
a scaled format), rounding that output returns it unchanged. That rounding is skipped and counted
as it would count (its NaNs and its elements); the output's gradient is rounded as usual. Eager and
compiled forwards skip alike, so they draw the same stochastic-rounding seeds. (Under torch.compile
this also lets the backward of ReLU read the output that the next operator saves, instead of a mask
of its own.)

One step is one training forward (grad enabled, ``model.training``) and the backward of its
result. Each step's per-tensor overflow/underflow counts accumulate on the device in one int64
table. The next training forward closes the step without waiting for the device: it starts a
copy of the table to the host, and the step's counts are read (its promotions made, its history
entry written) when the training forward after that begins, a lag of one step, by when the copy
has long finished. ``end_step()`` and the end of the emulation close and read at once (one
synchronisation, where the caller asks for it). So on a GPU neither the forward nor the backward
waits for the device (docs/design.md §6). Forwards under ``torch.no_grad()`` or in eval mode are
rounded but not counted.

``torch.compile(model)`` inside the emulation (or a compiled training step) traces the
roundings into the model's graph, made once and reused from step to step; a step that promotes
a tensor recompiles it once (docs/design.md §6).

An in-place operator on an activation (``relu_``, ``x += y``) returns a rounded copy (the tensor
itself where its rounding is skipped, changing nothing): code that uses the returned value (as
nn.Modules do) sees rounded values; a tensor mutated in place and then used without the returned
value keeps the unrounded result.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import warnings
from typing import Dict, List, Mapping, NamedTuple, Optional

import numpy as np
import torch

from . import _C, backends
from ._autograd import function_apply
from ._native import DTYPE_CODES
from .backends import is_dense, is_plain
from ._checks import check_choice, is_real
from ._intercept import ForwardSession
from .assign import FORWARD_ROLES, Assignment, grad_name, role_of
from .formats import Precision
from .quantize import BoundRounder, Rounder
from .stats import Stats

__all__ = ["emulate", "Emulator", "History"]

log = logging.getLogger("lowfp")
_OVERFLOW = ("saturate", "inf", "nan")
_MARK = "_lowfp_rounded"  # (forward serial, writes, rounder) on a tensor that holds its results


# The autograd nodes whose operator saves none of its results for backward (it may save its
# inputs), each checked against torch.autograd.graph.saved_tensors_hooks in tests/test_emulate.py
# on every device there. An operator's new result with one of these nodes is rounded in its own
# memory: nothing else holds it, so no copy is needed and no saved value changes.
_SAVES_NO_RESULT = frozenset("""
ConvolutionBackward0 AddmmBackward0 MmBackward0 BmmBackward0 BaddbmmBackward0 AddBackward0
SubBackward0 MulBackward0 DivBackward0 NegBackward0 NativeBatchNormBackward0
NativeLayerNormBackward0 NativeGroupNormBackward0 MeanBackward0 MeanBackward1 SumBackward0
SumBackward1 AvgPool2DBackward0 GeluBackward0 SiluBackward0 LeakyReluBackward0 HardswishBackward0
CatBackward0 StackBackward0 EmbeddingBackward0 ConstantPadNdBackward0 UpsampleNearest2DBackward0
""".split())
_node_saves_no_result: Dict[type, object] = {}


def _rounds_in_place(t: torch.Tensor) -> bool:
    """Whether t, a new result of an operator call (not one of its arguments), may be rounded in
    its own memory: a plain tensor, not a view, whose autograd node saves none of its results.
    matmul, linear and attention on 3-d operands return the GEMM's result reshaped by
    _unsafe_view (its own node, sharing the GEMM result's memory, which no node saves): their
    node is taken when the node before it is one of these."""
    if type(t) is not torch.Tensor or t._base is not None:
        return False
    node = t.grad_fn
    ok = _node_saves_no_result.get(type(node))
    if ok is None:
        ok = _node_saves_no_result[type(node)] = (
            _UNSAFE_VIEW if type(node).__name__ == "UnsafeViewBackward0"
            else type(node).__name__ in _SAVES_NO_RESULT)
    if ok is _UNSAFE_VIEW:
        node = node.next_functions[0][0]
        ok = type(node).__name__ in _SAVES_NO_RESULT
    return ok


_UNSAFE_VIEW = "unsafe view"  # (_node_saves_no_result's entry for _unsafe_view's node)


_HOOKS_KEY = "lowfp"  # (never one of torch's RemovableHandle ids, which are ints)


def _add_gradient_hook(t: torch.Tensor, hook) -> None:
    """t.register_hook(hook) for an operator's result of this forward, which has no hooks yet:
    the same dict of hooks on t and the same registration with t's node, without the handle
    that register_hook builds (the emulation never removes its hooks: they go with the step's
    graph). A later t.register_hook adds to that dict, after this one."""
    global _lean_hooks
    if _lean_hooks and t._backward_hooks is None:
        try:
            t._backward_hooks = hooks = collections.OrderedDict()
            hooks[_HOOKS_KEY] = hook
            t.grad_fn._register_hook_dict(t)
            return
        except AttributeError:  # (a torch without these: register_hook from now on)
            t._backward_hooks = None
            _lean_hooks = False
    t.register_hook(hook)


_lean_hooks = True


def _entry(fwd: Optional[Rounder], fs: Optional[Stats], bwd: Optional[Rounder], bs: Optional[Stats]):
    """What a rounding of a v or theta tensor takes (Emulator._round): its forward rounder and
    count slot, its backward rounder and count slot, the two bound to their slots (BoundRounder;
    None without a rounder: the backward one is the gradient's tensor hook), whether the gradient
    may be rounded by that hook (not stochastic: see _round), and whether the forward rounding's
    results are marked (an idempotent rounder)."""
    return (fwd, fs, bwd, bs, None if fwd is None else BoundRounder(fwd, fs),
            None if bwd is None else BoundRounder(bwd, bs), bwd is None or bwd.rounding != "stochastic",
            fwd is not None and fwd.idempotent)


def _unchanged(source, fwd: Optional[Rounder], t: torch.Tensor) -> bool:
    """Whether t holds results of its own forward rounder (source: ForwardSession._source_of),
    so that rounding it again would return it unchanged."""
    return source is not None and source is fwd and type(t) is torch.Tensor


class _Round(torch.autograd.Function):
    """Forward: round x with fwd (or copy it); backward: round the gradient with bwd (each a
    BoundRounder or None)."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, observe):
        ctx.bwd = (bwd, observe)
        return x.clone() if fwd is None else fwd(x)

    @staticmethod
    def backward(ctx, grad):
        bwd, observe = ctx.bwd
        if bwd is not None:
            grad = bwd(grad)
            if observe is not None:
                observe[0](grad_name(observe[1]), grad)
        return grad, None, None, None


_round_apply = function_apply(_Round)


def _count_unchanged(counts: torch.Tensor, t: torch.Tensor) -> None:
    """Add to ``counts`` those of a rounding that returns t unchanged: its NaNs, and its
    elements."""
    if torch.compiler.is_compiling():  # (one add of the four counts, for Inductor to fuse)
        nan = torch.isnan(t).sum()
        zero = torch.zeros_like(nan)
        counts.add_(torch.stack((zero, zero, nan, zero + t.numel())))
        return
    if t.dtype in DTYPE_CODES and is_plain(t) and is_dense(t):
        # one native call: on the CPU a vectorised pass finds the usual case, no NaN, and the
        # counts are added in place, where torch would take a mask, a sum and two adds; on a GPU
        # one launch on the current stream, where torch's are four
        if t.is_cpu and counts.is_cpu:
            _C.count_unchanged(t.data_ptr(), DTYPE_CODES[t.dtype], t.numel(), counts.data_ptr())
            return
        if t.is_cuda and counts.is_cuda and backends.same_device(counts, t) and backends.cuda_built():
            module, device, stream = backends.native(t, "t")
            module.count_unchanged(t.data_ptr(), DTYPE_CODES[t.dtype], t.numel(), counts.data_ptr(), device, stream)
            return
    # elsewhere torch counts them, not waited for
    counts[2].add_(torch.isnan(t).sum())
    counts[3].add_(t.numel())


# What Emulator._round's eager path in C calls (cpp/bindings/def_emulate.hpp), handed over once
_NATIVE_ROUND_OBJECTS = dict(
    tensor=torch.Tensor, is_grad_enabled=torch.is_grad_enabled, round_apply=_round_apply,
    count_unchanged=_count_unchanged, add_gradient_hook=_add_gradient_hook, rounds_in_place=_rounds_in_place,
    saves_no_result=_node_saves_no_result, ordered_dict=collections.OrderedDict, hooks_key=_HOOKS_KEY,
    mark=_MARK, round_bound=_C.round_bound)
_C.emulator_round_setup(**_NATIVE_ROUND_OBJECTS)


class _RoundInGraph(torch.autograd.Function):
    """_Round as torch.compile records it: no writes to state outside the function. Forward
    returns (rounded x, its counts); backward rounds the gradient with ``bwd`` and hands its
    counts back as the gradient of ``sink``, a row of the emulator's float64 leaf
    ``_grad_counts``, which autograd accumulates."""

    @staticmethod
    def forward(ctx, x, sink, rounders):
        """rounders: (fwd, count, bwd), one argument (fewer for Dynamo to trace per call)."""
        fwd, count, bwd = rounders
        ctx.bwd, ctx.count = bwd, sink is not None
        if fwd is None:
            y, counts = x.clone(), x.new_zeros(4 if count else 0, dtype=torch.int64)
        else:
            y, counts = fwd.in_graph(x, count)
        ctx.mark_non_differentiable(counts)
        return y, counts

    @staticmethod
    def backward(ctx, grad, unused):
        bwd = ctx.bwd
        if bwd is None:
            return grad, None, None
        grad, counts = bwd.in_graph(grad, ctx.count)
        return grad, (counts.to(torch.float64) if ctx.count else None), None


class _ClosedStep(NamedTuple):
    """A closed training step whose counts are being copied to the host."""
    step: int
    table: torch.Tensor                  # the host copy of the count table
    copied: Optional[torch.cuda.Event]   # recorded after the copy (CUDA), else None
    loss_scale: Optional[float]
    scalars: Dict[str, float]


class History:
    """Per-step records of an emulated run: ``steps`` (dicts with step, loss_scale, ratio_lo,
    aggregate_bits, promotions, top_overflow, top_underflow, backward_underflow (the share of
    all backward values, dv and dθ, that underflowed to zero) and anything given to
    ``Emulator.record``) and ``promotions`` (step, tensor, overflow ratio, from, to);
    ``lowfp.experiments.plots.plot_history`` draws them."""

    def __init__(self):
        self.steps: List[dict] = []
        self.promotions: List[dict] = []

    def to_dict(self) -> dict:
        return {"steps": self.steps, "promotions": self.promotions}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())


class Emulator(ForwardSession):
    """The runtime behind :func:`lowfp.emulate` (see the module docs)."""

    # lowfp._C.intercept_call rounds outputs and parameters by lowfp._C.emulator_round (_round's
    # eager path in C, the same algorithm) without calling _output and _param
    _native_round = True

    def __init__(self, model: torch.nn.Module, assignment: Assignment, *, promote: bool = True,
                 threshold: float = 0.01, rounding: str = "nearest",
                 backward_overflow: str = "inf", top: int = 5, gemm_recipe=None):
        super().__init__(model)
        devices = {t.device.type for t in itertools.chain(model.parameters(), model.buffers())}
        if not devices <= {"cpu", "cuda"}:
            raise ValueError(f"model has parameters or buffers on device {sorted(devices - {'cpu', 'cuda'})[0]}: "
                             f"lowfp.emulate runs models on the CPU or a CUDA device")
        if not isinstance(assignment, Assignment):
            raise TypeError(f"assignment must be a lowfp.assign.Assignment, got {type(assignment).__name__}")
        if not isinstance(promote, bool):
            raise TypeError(f"promote must be a bool, got {promote!r}")
        if not is_real(threshold) or not 0 <= threshold <= 1:
            raise ValueError(f"threshold must be a number in [0, 1], got {threshold!r}")
        check_choice(backward_overflow, _OVERFLOW, "backward_overflow")
        check_choice(rounding, ("nearest", "stochastic"), "rounding")
        params = dict(model.named_parameters())
        unknown = [n for n, t in assignment.trace.tensors.items() if t.role == "theta" and (
            n[len("theta:"):] not in params or params[n[len("theta:"):]].numel() != t.numel)]
        if unknown:
            raise ValueError(f"assignment was recorded on another model: model has no parameters "
                             f"{unknown[:3]} of the recorded sizes")
        self.assignment = assignment.copy()   # promotions change this copy only
        self._totals = None  # (ratio_lo, aggregate_bits) of self.assignment, until a promotion
        self.promote, self.threshold, self.top = promote, float(threshold), int(top)
        self.rounding, self.backward_overflow = rounding, backward_overflow
        self._per_module = None
        if gemm_recipe is not None:  # GEMM operands inside the interception, then the tensors
            from .scaled.gemm import GemmHandler, PerModule, to_recipe
            if isinstance(gemm_recipe, Mapping):
                self._per_module = PerModule(model, gemm_recipe)
                self.gemms = GemmHandler(None, self._per_module)
            else:
                self.gemms = GemmHandler(to_recipe(gemm_recipe))
        self.history = History()
        self.scaler = None                     # set by DynamicLossScaler(emulator=...)
        self.observer = None                   # observer(name, tensor): every rounded result;
        #                                        a compiled forward with one runs eagerly
        self.step = 0                          # closed training steps
        names = list(self.assignment.trace.tensors)
        self._row = {n: i for i, n in enumerate(names)}
        # per row, (name, a forward tensor), and the rows of gradients, for reading a step's counts
        self._row_roles = [(n, role_of(n) in FORWARD_ROLES) for n in names]
        self._gradient_rows = np.array([not forward for _, forward in self._row_roles], dtype=bool)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.counts = torch.zeros(len(names), 4, dtype=torch.int64, device=device)
        self._stats = {n: Stats.view(self.counts[i]) for n, i in self._row.items()}
        # backward counts of compiled steps arrive as this leaf's gradient (see _RoundGradient)
        self._grad_counts = torch.zeros(len(names), 4, dtype=torch.float64, device=device,
                                        requires_grad=True)
        self._backward_rows = torch.tensor([i for n, i in self._row.items()
                                            if role_of(n) in ("dv", "dtheta")],
                                           dtype=torch.int64, device=device)
        self._rounders: Dict[tuple, Rounder] = {}
        # Each rounder once, and its index there: a compiled forward reaches a rounder through
        # this list alone, so that Dynamo guards its state once, not once per tensor that uses it.
        self._rounder_list: List[Rounder] = []
        self._rounder_slots: Dict[int, int] = {}
        self._plan: Dict[str, Optional[Rounder]] = {n: self._rounder_for(n) for n in names}
        # Per v or theta name, what a rounding of it takes, looked up once per call:
        # (forward rounder, its count slot, backward rounder, its count slot, the backward
        # rounding as a tensor hook) while counting, and the same without slots; rebuilt for a
        # tensor when it is promoted.
        self._entries: Dict[str, tuple] = {}
        self._uncounted: Dict[str, tuple] = {}
        # The same for a compiled forward, in plain numbers whose guards are cheap (the rounders'
        # indices in _rounder_list and the rows of the count tables, -1 for none; whether the
        # results are marked): (forward rounder, its row, backward rounder, its row, marked).
        # Dynamo guards each by value, so a promotion, which changes an index, recompiles (the
        # changed index becomes a symbol there, which indexing the list specializes again).
        self._graph_plans: Dict[str, tuple] = {}
        for n in names:
            if role_of(n) in FORWARD_ROLES:
                self._prepare_entry(n)
        self._check_fits(params)
        self._params: Dict[int, torch.Tensor] = {}
        self._pending = False      # a training step is open (its forward ran, it is not closed)
        self._closed: List[_ClosedStep] = []  # closed steps whose counts are not yet read
        self._host_tables: List[torch.Tensor] = []  # free host copies of the count table
        self._counting = False     # the current forward is a training step
        self._scalars: Dict[str, float] = {}
        self._step_scale = None
        self._unknown_warned: set = set()
        self._marks: dict = {}     # _mark's record while Dynamo traces a forward

    # -- formats ---------------------------------------------------------------------------
    def _rounder(self, fmt, forward: bool) -> Optional[Rounder]:
        """One Rounder per (format, direction), shared by every tensor that uses it."""
        if fmt is None:
            return None
        key = (fmt, forward)
        if key not in self._rounders:
            overflow = "saturate" if forward else self.backward_overflow
            rounder = self._rounders[key] = Rounder(fmt, self.rounding, overflow)
            self._rounder_slots[id(rounder)] = len(self._rounder_list)
            self._rounder_list.append(rounder)
        return self._rounders[key]

    def _slot(self, rounder: Optional[Rounder]) -> int:
        """rounder's index in _rounder_list (-1: None)."""
        return -1 if rounder is None else self._rounder_slots[id(rounder)]

    def _check_fits(self, params: Dict[str, torch.Tensor]) -> None:
        """Every tensor's format fits its dtype (a parameter's as it is now, the others' as
        recorded), so that a 16-bit model fails here, naming the tensor and the fix, not at its
        first forward."""
        for name, rounder in self._plan.items():
            if rounder is None:
                continue
            t = self.assignment.trace.tensors[name]
            base = name.split(":", 1)[1]
            dtype = params[base].dtype if t.role in ("theta", "dtheta") else getattr(torch, t.dtype)
            reason = rounder.fit_error(dtype)
            if reason:
                fix = ("pass a hi format that fits it: Candidates(hi=...) (lowfp train --hi), or "
                       "hi=None for each 16-bit tensor's own format"
                       if name not in self.assignment.lo else
                       "pass lo candidates that fit it (Candidates(lo_forward=..., lo_backward=...))")
                raise ValueError(f"lowfp.emulate: tensor {name} ({dtype}) is assigned "
                                 f"{self.assignment.formats[name]}, which it cannot hold: {reason}; {fix}")

    def _rounder_for(self, name: str) -> Optional[Rounder]:
        return self._rounder(self.assignment.formats[name], role_of(name) in FORWARD_ROLES)

    def _hi(self, dtype) -> Optional[Precision]:
        c = self.assignment.candidates
        return None if c is None else c.hi_for(dtype)

    def _prepare_entry(self, name: str) -> None:
        """The rounding entries of a v or theta name (see __init__)."""
        gname = grad_name(name)
        fwd, bwd = self._plan[name], self._plan.get(gname)
        bs = self._stats.get(gname)
        self._entries[name] = _entry(fwd, self._stats[name], bwd, bs)
        self._uncounted[name] = _entry(fwd, None, bwd, None)
        *_, marked = self._entries[name]
        self._graph_plans[name] = (self._slot(fwd), self._row[name], self._slot(bwd),
                                   -1 if bs is None else self._row[gname], marked)

    def _unrecorded(self, name: str, dtype: torch.dtype):
        """The rounding entry of a v or theta name that the recorded step does not have: hi,
        said once."""
        if name not in self._unknown_warned:
            self._unknown_warned.add(name)
            warnings.warn(f"lowfp.emulate: {name} was not in the recorded step; it is rounded "
                          "to the hi candidate. Trace the model again if its structure changed.",
                          stacklevel=2)
        hi = self._hi(dtype)
        return _entry(self._rounder(hi, True), None, self._rounder(hi, False), None)

    def _round(self, t: torch.Tensor, name: str, source=None, new: bool = False,
               compiling: Optional[bool] = None) -> torch.Tensor:
        """t rounded for tensor `name`. source: the rounder whose results a selecting operator's
        argument holds (ForwardSession._source_of); when it is this tensor's forward rounder, the
        forward rounding would return t unchanged, so it is skipped and only counted. new: t is a
        result of an operator call that returned none of its arguments (see _rounds_in_place).
        compiling: torch.compiler.is_compiling(), where the caller knows it."""
        if torch.compiler.is_compiling() if compiling is None else compiling:
            return self._round_compiled(t, name, source)
        # (every training tensor passes here: one lookup)
        entry = (self._entries if self._counting else self._uncounted).get(name)
        fwd, fs, bwd, bs, fwd_bound, bwd_bound, hookable, marked = (
            entry if entry is not None else self._unrecorded(name, t.dtype))
        if fwd is None and bwd is None:
            return t
        unchanged = _unchanged(source, fwd, t)
        observe = None if self.observer is None else (self.observer, name)
        if t.requires_grad and torch.is_grad_enabled():
            # t itself, its gradient rounded by a hook (on an operator's output of this forward,
            # never on a user's leaf, whose hooks would outlive the step), where there is nothing
            # to round forward (skipped, or no forward format) or t can be rounded in its own
            # memory. Stochastic gradients keep their own node: a hook would run when t's
            # producer does, which moves their seed draws in backward's order away from the
            # compiled step's.
            kernel = None if unchanged else fwd_bound
            if (hookable and observe is None and not t.is_leaf
                    and (kernel is None or (new and _rounds_in_place(t) and kernel.round_in_place(t)))):
                out = t
                if bwd_bound is not None:
                    _add_gradient_hook(t, bwd_bound)
            else:
                out = _round_apply(t, kernel, bwd_bound, observe)
        elif unchanged or fwd_bound is None:
            out = t
        else:
            out = fwd_bound(t)
        if observe is not None and fwd is not None:
            self.observer(name, out)
        if unchanged and fs is not None:
            _count_unchanged(fs.counts, t)
        if marked:
            setattr(out, _MARK, (self.serial, self.writes, fwd))  # (_mark, eager)
        return out

    def _mark(self, t: torch.Tensor, rounder: Rounder) -> None:
        """t holds results of rounder, until an operator writes into a tensor in place (any
        tensor: it may share t's memory). The same rule in eager and compiled forwards, so that
        both skip the same roundings (and draw the same stochastic-rounding seeds)."""
        if torch.compiler.is_compiling():  # Dynamo cannot set attributes on tensors
            self._marks[t] = (self.writes, rounder)
        else:
            setattr(t, _MARK, (self.serial, self.writes, rounder))

    def _source_of(self, t: torch.Tensor):
        """The rounder whose results t holds (see _mark), or None."""
        if torch.compiler.is_compiling():
            mark = self._marks.get(t)
            return mark[1] if mark is not None and mark[0] == self.writes else None
        mark = getattr(t, _MARK, None)
        return mark[2] if mark is not None and mark[:2] == (self.serial, self.writes) else None

    def _round_compiled(self, t: torch.Tensor, name: str, source) -> torch.Tensor:
        """_round in a graph torch.compile records, from the name's _graph_plans entry (a name
        the recorded step lacks: _unrecorded's rounders, uncounted)."""
        plan = self._graph_plans.get(name)
        if plan is not None:
            f, fs_row, b, bs_row, marked = plan
            fwd = None if f < 0 else self._rounder_list[f]
            bwd = None if b < 0 else self._rounder_list[b]
            if not self._counting:
                fs_row = bs_row = -1
        else:
            fwd, _, bwd, _, _, _, _, marked = self._unrecorded(name, t.dtype)
            fs_row = bs_row = -1
        if fwd is None and bwd is None:
            return t
        unchanged = _unchanged(source, fwd, t)
        out = self._round_in_graph(t, None if unchanged else fwd, -1 if unchanged else fs_row, bwd, bs_row)
        if unchanged and fs_row >= 0:
            _count_unchanged(self.counts[fs_row], t)
        if marked:
            self._mark(out, fwd)
        return out

    def _round_in_graph(self, t, fwd, fs_row, bwd, bs_row):
        """A compiled rounding by lowfp's operators: the forward counts are added to row fs_row
        of the table by the graph, the backward counts arrive as row bs_row of
        ``_grad_counts.grad`` (-1: not counted)."""
        if not (t.requires_grad and torch.is_grad_enabled()):
            if fwd is None:
                return t
            out, counts = fwd.in_graph(t, fs_row >= 0)
            if fs_row >= 0:
                self.counts[fs_row].add_(counts)
            return out
        sink = None if bs_row < 0 else self._grad_counts[bs_row]
        out, counts = _RoundInGraph.apply(t, sink, (fwd, fs_row >= 0, bwd))
        if fs_row >= 0:
            self.counts[fs_row].add_(counts)
        return out

    # -- ForwardSession decisions -----------------------------------------------------------
    def _begin(self) -> None:
        super()._begin()
        training = self.model.training and torch.is_grad_enabled()
        if training:
            self._read_closed_steps()  # closed when this forward's previous step began
            self._close_step()
            self._pending = True
            self._step_scale = None if self.scaler is None else self.scaler.get_scale()
        self._counting = training
        self._params.clear()

    def _start(self) -> None:
        if torch.compiler.is_compiling():
            self._params = {}

    _end = _start

    def _compilable(self) -> bool:
        return self.observer is None  # an observer is Python called with each rounded tensor

    def _param(self, p, name, compiling=None):
        q = self._params.get(id(p))
        if q is None:
            q = self._params[id(p)] = self._round(p, name, compiling=compiling)
        return q

    def _input(self, t, name):
        return self._round(t, name)

    def _output(self, t, name, source=None, new=False, compiling=None):
        return self._round(t, name, source, new, compiling)

    def _forward(self, inner, args, kwargs):
        try:
            return super()._forward(inner, args, kwargs)
        finally:
            self._marks.clear()

    # -- steps -----------------------------------------------------------------------------
    def record(self, **scalars: float) -> None:
        """Attach values (e.g. ``loss=loss.item()``) to the current step's history entry."""
        for k, v in scalars.items():
            self._scalars[k] = float(v)

    def backward_overflows(self) -> torch.Tensor:
        """Overflows of the backward roundings (dv, dtheta) in the current step, as a 0-d int64
        tensor on the device (no synchronisation)."""
        self._fold_grad_counts()
        return self.counts.index_select(0, self._backward_rows)[:, 0].sum()

    def _fold_grad_counts(self) -> None:
        """Move the backward counts of compiled steps into ``counts``."""
        g = self._grad_counts.grad
        if g is not None:
            self.counts.add_(g.to(torch.int64))
            self._grad_counts.grad = None

    def end_step(self) -> Optional[dict]:
        """Close the current training step and read its counts now (one synchronisation with the
        device; the next training forward would close it without one and read it a step later):
        promote forward tensors whose overflow ratio exceeds the threshold and append to
        ``history``. Returns the history entry of the last step read (None if there was none)."""
        self._close_step()
        return self._read_closed_steps()

    def _close_step(self) -> None:
        """Close the open training step, if any: start copying its counts to the host (not
        waited for) and zero the table for the next step."""
        if not self._pending:
            return
        self._pending = False
        self.step += 1
        self._fold_grad_counts()
        table = self._host_tables.pop() if self._host_tables else torch.empty(
            self.counts.shape, dtype=torch.int64, pin_memory=self.counts.is_cuda)
        table.copy_(self.counts, non_blocking=True)
        copied = None
        if self.counts.is_cuda:
            copied = torch.cuda.Event()
            copied.record()
        self.counts.zero_()  # after the copy, on the same stream
        self._closed.append(_ClosedStep(self.step, table, copied, self._step_scale, self._scalars))
        self._scalars = {}

    def _read_closed_steps(self) -> Optional[dict]:
        """Read every closed step's counts, oldest first (waiting for their copies only)."""
        entry = None
        while self._closed:
            closed = self._closed.pop(0)
            if closed.copied is not None:
                closed.copied.synchronize()
            entry = self._read_step(closed, closed.table.numpy())
            self._host_tables.append(closed.table)
        return entry

    def _read_step(self, closed: "_ClosedStep", rows: np.ndarray) -> dict:
        """Promotions and the history entry of one closed step from its count rows (int64,
        (tensors, 4)); only the rows that overflowed or underflowed are visited."""
        o, u, n = rows[:, 0], rows[:, 1], rows[:, 3]
        grad_underflow, grad_numel = int(u[self._gradient_rows].sum()), int(n[self._gradient_rows].sum())
        over, under = [], []
        promoted = []
        for i in np.flatnonzero(((o != 0) | (u != 0)) & (n != 0)).tolist():
            name, forward = self._row_roles[i]
            oi, ui, ni = int(o[i]), int(u[i]), int(n[i])
            if oi:
                over.append((name, oi / ni))
                if (self.promote and forward and oi / ni > self.threshold
                        and name in self.assignment.lo):
                    promoted.append((name, oi / ni))
            if ui:
                under.append((name, ui / ni))
        for name, ratio in promoted:
            self._promote(name, ratio, closed.step)
        over.sort(key=lambda x: -x[1])
        under.sort(key=lambda x: -x[1])
        if self._totals is None:  # (sums over every tensor: once, and after a promotion)
            self._totals = (self.assignment.ratio_lo, self.assignment.aggregate_bits)
        entry = {"step": closed.step, "loss_scale": closed.loss_scale, "ratio_lo": self._totals[0],
                 "aggregate_bits": self._totals[1], "promotions": [n for n, _ in promoted],
                 "top_overflow": over[:self.top], "top_underflow": under[:self.top],
                 "backward_underflow": grad_underflow / grad_numel if grad_numel else 0.0}
        entry.update(closed.scalars)
        self.history.steps.append(entry)
        return entry

    def _promote(self, name: str, ratio: float, step: int) -> None:
        a = self.assignment
        self._totals = None
        old = a.formats[name]
        hi = a.formats[name] = self._hi(a.trace.tensors[name].dtype)
        a.lo.discard(name)
        self._plan[name] = self._rounder_for(name)
        self._prepare_entry(name)
        self.history.promotions.append({"step": step, "tensor": name, "overflow_ratio": ratio,
                                        "from": str(old), "to": str(hi)})
        log.info("lowfp: step %d: promoted %s from %s to %s (overflow ratio %.4g)",
                 step, name, old, hi, ratio)

    def install(self) -> None:
        super().install()
        if self._per_module is not None:  # (recipes per module: their hooks too)
            self._per_module.install()

    def remove(self) -> None:
        if self._per_module is not None:
            self._per_module.close()
        super().remove()

    # -- context manager -------------------------------------------------------------------
    def __enter__(self):
        self.install()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self) -> None:
        """Close the last step and take the emulation off the model."""
        if self._installed:
            self.end_step()
            self.remove()


def emulate(model: torch.nn.Module, assignment: Assignment, *, promote: bool = True,
            threshold: float = 0.01, rounding: str = "nearest",
            backward_overflow: str = "inf", gemm_recipe=None) -> Emulator:
    """Round every forward and backward tensor of ``model``'s training steps to the format
    ``assignment`` gives it (see the module docs). Use as a context manager (``with
    lowfp.emulate(model, a) as em:``), or call ``em.install()`` and ``em.close()``.

    Args:
        model: the nn.Module the assignment was traced on (any torch optimizer can train it).
        assignment: from :mod:`lowfp.assign` (``uniform(tr)``, ``ours(tr, 0.5)``, ...).
        promote, threshold: after each step, forward tensors at a lo format whose overflow ratio
            exceeds ``threshold`` (default 0.01) are promoted to the hi candidate for the rest of
            the run (``history.promotions`` logs them).
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"``.
        backward_overflow: what an overflowing gradient becomes: ``"inf"`` (default; a loss
            scaler's finiteness check sees it), ``"saturate"`` or ``"nan"``. The counts reach
            :class:`lowfp.DynamicLossScaler` either way.
        gemm_recipe: also round the operands of the model's GEMMs to scaled formats, each along
            its reduction axis (a :class:`lowfp.scaled.GemmRecipe`, a name such as ``"mxfp8"``,
            or a mapping of module-name patterns to recipes; see
            :func:`lowfp.scaled.emulate_gemms`). The assignment's formats then apply to the
            GEMMs' outputs and every other tensor.
    """
    return Emulator(model, assignment, promote=promote, threshold=threshold, rounding=rounding,
                    backward_overflow=backward_overflow, gemm_recipe=gemm_recipe)
