"""Precision assignment (docs/design.md §6): record a training step, then choose a format per tensor.

>>> import torch, lowfp
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
>>> tr = lowfp.assign.trace(model, torch.randn(32, 8))
>>> a = lowfp.assign.ours(tr, 0.5)
>>> a.ratio_lo >= 0.5
True

A training step's tensors TS are the activations ``v`` (model inputs and operator outputs), their
gradients ``dv``, the parameters ``theta`` and their gradients ``dtheta``; see
:mod:`lowfp._intercept` for what counts as one operator. Tensor names are ``role:base``: ``v:0:linear``
is the output of the first module's linear, ``theta:0.weight`` a parameter, ``v:input[0]`` the
model's first input.

Groups (for ``ours``): the operators are cut at every GEMM. Group 0 holds the model inputs and
what the operators before the first GEMM produce; group k ≥ 1 starts with the k-th GEMM and holds
the outputs of that GEMM and of every operator after it up to the next GEMM. A parameter joins
the group of the activation its operator reads (first activation argument), so the weight of the
k-th GEMM is in the group of that GEMM's input, group k - 1: demoting a group lowers both operands
of the next GEMM. This is how the assignment paper's released code groups tensors (a parameter
with the module before its own); a parameter whose operator reads no activation joins that
operator's group. ``dv`` is in the group of its ``v``. Weight gradients stay hi (outside every
group) unless ``Candidates(weight_grads_lo=True)``, which puts ``dtheta`` in the group of its
``theta``.
"""

from __future__ import annotations

import contextlib
import json
import random
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ._checks import check_choice, check_int, is_real
from ._intercept import ForwardSession
from .formats import Precision, fp, to_precision
from .scaled import to_scaled

__all__ = ["Candidates", "TensorInfo", "OpInfo", "Trace", "Assignment", "trace", "fp32", "all_hi",
           "uniform", "op", "op_io", "ours", "make", "STRATEGIES", "ROLES"]

ROLES = ("v", "dv", "theta", "dtheta")
FORWARD_ROLES = ("v", "theta")
_GRAD_OF = {"v": "dv", "theta": "dtheta"}


def role_of(name: str) -> str:
    return name.split(":", 1)[0]


def grad_name(name: str) -> str:
    role, base = name.split(":", 1)
    return f"{_GRAD_OF[role]}:{base}"


# -- the recorded step ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    """One tensor of TS: its name, role (v, dv, theta, dtheta), element count on the recorded
    step, the operator that produced it (v, dv) or first used it (theta, dtheta), its group, and
    its dtype on the recorded step (a gradient's: its tensor's)."""

    name: str
    role: str
    numel: int
    op: str
    group: int
    dtype: str = "float32"


@dataclass(frozen=True)
class OpInfo:
    """One operator call: its position, name, torch function, innermost module, whether it is a
    GEMM, and the TS names it read (activations and parameters) and produced."""

    index: int
    key: str
    func: str
    module: str
    is_gemm: bool
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]


@contextlib.contextmanager
def _reading(what: str):
    """Turns the KeyError / TypeError of a malformed saved dict into a ValueError naming it."""
    try:
        yield
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"d is not what {what} returns: {type(e).__name__}: {e}") from e


class Trace:
    """The operators and tensors of one recorded training step (see :func:`trace`)."""

    def __init__(self, ops: Sequence[OpInfo], tensors: Sequence[TensorInfo]):
        self.ops: List[OpInfo] = list(ops)
        self.tensors: Dict[str, TensorInfo] = {t.name: t for t in tensors}
        self.gemms: List[int] = [o.index for o in self.ops if o.is_gemm]
        self.total_numel = sum(t.numel for t in self.tensors.values())

    def groups(self, weight_grads: bool = False) -> List[List[str]]:
        """Tensor names per group (group index = list index); dtheta only if weight_grads."""
        out: List[List[str]] = [[] for _ in range(len(self.gemms) + 1)]
        for t in self.tensors.values():
            if t.role != "dtheta" or weight_grads:
                out[t.group].append(t.name)
        return out

    def names(self, role: Optional[str] = None) -> List[str]:
        return [n for n, t in self.tensors.items() if role is None or t.role == role]

    def to_dict(self) -> dict:
        return {"ops": [dict(index=o.index, key=o.key, func=o.func, module=o.module,
                             is_gemm=o.is_gemm, inputs=list(o.inputs), outputs=list(o.outputs))
                        for o in self.ops],
                "tensors": [dict(name=t.name, role=t.role, numel=t.numel, op=t.op, group=t.group,
                                 dtype=t.dtype) for t in self.tensors.values()]}

    @classmethod
    def from_dict(cls, d: dict) -> "Trace":
        with _reading("Trace.to_dict()"):
            ops = [OpInfo(o["index"], o["key"], o["func"], o["module"], bool(o["is_gemm"]),
                          tuple(o["inputs"]), tuple(o["outputs"])) for o in d["ops"]]
            tensors = [TensorInfo(t["name"], t["role"], int(t["numel"]), t["op"], int(t["group"]),
                                  str(t.get("dtype", "float32"))) for t in d["tensors"]]
        return cls(ops, tensors)

    def __repr__(self) -> str:
        return (f"Trace({len(self.ops)} operators, {len(self.gemms)} GEMMs, "
                f"{len(self.tensors)} tensors, {self.total_numel} elements)")


class _Recorder(ForwardSession):
    def __init__(self, model):
        super().__init__(model)
        self.ops: List[OpInfo] = []
        self.numel: Dict[str, int] = {}
        self.dtype: Dict[str, str] = {}
        self.first_op: Dict[str, str] = {}
        self.group: Dict[str, int] = {}
        self.has_grad: set = set()
        self._gemms_seen = 0

    def _begin(self):
        super()._begin()
        self.ops.clear()
        self.numel.clear()
        self.dtype.clear()
        self.first_op.clear()
        self.group.clear()
        self.has_grad.clear()
        self._gemms_seen = 0

    def _watch_grad(self, t, name):
        if t.requires_grad:
            t.register_hook(lambda g, name=name: self.has_grad.add(name))

    def _count(self, t, name):
        self.numel[name] = t.numel()
        self.dtype[name] = str(t.dtype).replace("torch.", "")

    def _param(self, p, name, compiling=False):
        self._count(p, name)
        return p

    def _input(self, t, name):
        self._count(t, name)
        self.first_op[name] = "input"
        self.group[name] = 0
        self._watch_grad(t, name)
        return t

    def _output(self, t, name, source=None, new=False, compiling=False):
        self._count(t, name)
        self._watch_grad(t, name)
        return t

    def _operator(self, key, fname, module, is_gemm, inputs, outputs, tensors):
        if is_gemm:
            self._gemms_seen += 1
        g = self._gemms_seen
        # A parameter joins the group of its operator's activation input (a GEMM's weight goes
        # with the GEMM's input, so that a demoted group lowers both operands), as the
        # assignment paper's code groups them; without an activation input, the operator's group.
        activation = next((n for n in inputs if n.startswith("v:")), None)
        param_group = self.group[activation] if activation is not None else g
        for name in inputs:
            if name.startswith("theta:") and name not in self.first_op:
                self.first_op[name] = key
                self.group[name] = param_group
        for name in outputs:
            self.first_op[name] = key
            self.group[name] = g
        self.ops.append(OpInfo(len(self.ops), key, fname, module, is_gemm,
                               tuple(dict.fromkeys(inputs)), tuple(outputs)))


def _default_loss(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().sum()
    if isinstance(out, (tuple, list)):
        parts = [_default_loss(o) for o in out if isinstance(o, (torch.Tensor, tuple, list))]
        return sum(parts) if parts else torch.zeros(())
    if isinstance(out, dict):
        return _default_loss(list(out.values()))
    raise TypeError(f"the model returned {type(out).__name__}; pass loss_fn to trace()")


def trace(model: torch.nn.Module, example_inputs, loss_fn: Optional[Callable] = None,
          targets=None) -> Trace:
    """Run one training step of ``model`` (forward, loss, backward) and record its operators and
    the tensors of TS with their sizes.

    Args:
        model: any nn.Module.
        example_inputs: a tensor or a tuple of positional arguments for ``model``, at the
            training batch size (ratios are measured on these sizes).
        loss_fn: ``loss_fn(output, targets)`` (or ``loss_fn(output)`` without targets) returning
            a scalar; default: the sum of the outputs.
        targets: passed to ``loss_fn``.

    The model is left as it was: parameters, gradients, buffers (e.g. BatchNorm running
    statistics), training mode and torch's random number generator state are restored.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    params = [p for p in model.parameters()]
    saved_grads = [p.grad for p in params]
    saved_buffers = [b.detach().clone() for b in model.buffers()]
    rec = _Recorder(model)
    rec.install()
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            for p in params:
                p.grad = None
            out = model(*args)
            if loss_fn is None:
                loss = _default_loss(out)
            else:
                loss = loss_fn(out, targets) if targets is not None else loss_fn(out)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("loss_fn must return a scalar tensor")
            if loss.requires_grad:
                loss.backward()
            param_grads = {rec.param_names[id(p)] for p in params
                           if p.grad is not None and id(p) in rec.param_names}
    finally:
        rec.remove()
        with torch.no_grad():
            for p, g in zip(params, saved_grads):
                p.grad = g
            for b, saved in zip(model.buffers(), saved_buffers):
                b.copy_(saved)
    tensors: List[TensorInfo] = []
    order = list(rec.first_op)  # inputs, then per operator its new parameters and outputs
    for name in order:
        role = role_of(name)
        tensors.append(TensorInfo(name, role, rec.numel[name], rec.first_op[name], rec.group[name],
                                  rec.dtype[name]))
        gname = grad_name(name)
        has = (name in rec.has_grad) if role == "v" else (name[len("theta:"):] in param_grads)
        if has:
            tensors.append(TensorInfo(gname, _GRAD_OF[role], tensors[-1].numel,
                                      rec.first_op[name], rec.group[name], rec.dtype[name]))
    return Trace(rec.ops, tensors)


# -- candidates and assignments ------------------------------------------------------------------
@dataclass(frozen=True)
class Candidates:
    """The precision candidates C of docs/design.md §6: ``hi`` for every tensor; ``lo_forward`` for
    activations and parameters, ``lo_backward`` for gradients. ``weight_grads_lo`` lets
    ``uniform`` and ``ours`` demote weight gradients too (by default they stay hi). Any lowfp
    format, :class:`lowfp.S2FP8` or :class:`lowfp.Scaled` (``"mxfp8_e4m3"``: tensor-level, its
    blocks along each tensor's last axis) may be a candidate.

    ``hi=None`` (the default) is the paper's fp(6,9,0) for float32 and float64 tensors, and a
    16-bit tensor's own format (``bfloat16``, ``float16``: not rounded further) for those, which
    fp(6,9,0) does not fit: see :meth:`hi_for`."""

    hi: Optional[Precision] = None
    lo_forward: Precision = field(default_factory=lambda: fp(4, 3, 4))
    lo_backward: Precision = field(default_factory=lambda: fp(5, 2, 0))
    weight_grads_lo: bool = False

    def __post_init__(self):
        for name in ("hi", "lo_forward", "lo_backward"):
            value = getattr(self, name)
            if value is not None or name != "hi":
                object.__setattr__(self, name, to_candidate(value, name))
        if not isinstance(self.weight_grads_lo, bool):
            raise TypeError(f"weight_grads_lo must be a bool, got {self.weight_grads_lo!r}")

    def hi_for(self, dtype) -> Precision:
        """The hi format of a tensor of ``dtype`` (a torch.dtype or its name)."""
        if self.hi is not None:
            return self.hi
        name = str(dtype).replace("torch.", "")
        return to_precision(name, "dtype") if name in _OWN_HI else DEFAULT_HI

    def lo(self, role: str) -> Precision:
        return self.lo_forward if role in FORWARD_ROLES else self.lo_backward

    def to_dict(self) -> dict:
        return {"hi": None if self.hi is None else str(self.hi), "lo_forward": str(self.lo_forward),
                "lo_backward": str(self.lo_backward), "weight_grads_lo": self.weight_grads_lo}


DEFAULT_HI = fp(6, 9, 0)  # the assignment paper's hi (16 bits)
_OWN_HI = ("bfloat16", "float16")  # dtypes whose tensors keep their own format under hi=None


def to_candidate(value, name: str):
    """A candidate precision: a scaled format (or its name), else as lowfp.formats.to_precision."""
    scaled = to_scaled(value)
    return scaled if scaled is not None else to_precision(value, name)


def _bits(p) -> float:
    return 32 if p is None else p.bits  # (a scaled format's bits share its scales out)


class Assignment:
    """A format for every tensor of a recorded step (None: not rounded, counted as 32 bits).

    ``lo`` is the set of tensors at a low-precision candidate; ``ratio_lo`` = Σ size of lo
    tensors / Σ size of all tensors; ``aggregate_bits`` = Σ size(t) · bits(format(t)).
    ``print(assignment)`` shows a table; ``save``/``load`` use JSON.
    """

    def __init__(self, trace: Trace, formats: Dict[str, Optional[Precision]], lo: Iterable[str],
                 name: str, candidates: Optional[Candidates] = None,
                 demoted_groups: Sequence[int] = ()):
        missing = set(trace.tensors) - set(formats)
        if missing:
            raise ValueError(f"formats has no entry for {sorted(missing)[:3]}")
        unknown = sorted((set(formats) | set(lo)) - set(trace.tensors))
        if unknown:
            raise ValueError(f"formats and lo may name only the trace's tensors; unknown: {unknown[:3]}")
        self.trace = trace
        self.formats: Dict[str, Optional[Precision]] = {
            n: (None if f is None else to_candidate(f, f"formats[{n!r}]")) for n, f in formats.items()}
        self.lo = set(lo)
        self.name = name
        self.candidates = candidates
        self.demoted_groups = list(demoted_groups)

    @property
    def ratio_lo(self) -> float:
        total = self.trace.total_numel
        return sum(self.trace.tensors[n].numel for n in self.lo) / total if total else 0.0

    @property
    def aggregate_bits(self) -> int:
        return round(sum(t.numel * _bits(self.formats[n]) for n, t in self.trace.tensors.items()))

    def copy(self) -> "Assignment":
        return Assignment(self.trace, dict(self.formats), set(self.lo), self.name, self.candidates,
                          self.demoted_groups)

    def __getitem__(self, name: str) -> Optional[Precision]:
        return self.formats[name]

    def table(self) -> str:
        rows = [("tensor", "role", "group", "elements", "format", "lo")]
        for n, t in self.trace.tensors.items():
            f = self.formats[n]
            rows.append((n.split(":", 1)[1], t.role, str(t.group), str(t.numel),
                         "fp32 (not rounded)" if f is None else str(f), "lo" if n in self.lo else ""))
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        lines = [f"{self.name}: ratio_lo {self.ratio_lo:.4f}, aggregate {self.aggregate_bits} bits "
                 f"({self.aggregate_bits / 8 / 1024:.1f} KiB) over {self.trace.total_numel} elements"]
        for i, r in enumerate(rows):
            lines.append("  ".join(c.rjust(w) if j in (2, 3) else c.ljust(w)
                                   for j, (c, w) in enumerate(zip(r, widths))).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    __str__ = table

    def __repr__(self) -> str:
        return (f"Assignment({self.name!r}, ratio_lo={self.ratio_lo:.4f}, "
                f"aggregate_bits={self.aggregate_bits})")

    def to_dict(self) -> dict:
        return {"name": self.name,
                "candidates": None if self.candidates is None else self.candidates.to_dict(),
                "ratio_lo": self.ratio_lo, "aggregate_bits": self.aggregate_bits,
                "demoted_groups": self.demoted_groups,
                "formats": {n: (None if f is None else str(f)) for n, f in self.formats.items()},
                "lo": sorted(self.lo), "trace": self.trace.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "Assignment":
        with _reading("Assignment.to_dict()"):
            cand = d.get("candidates")
            trace, formats, lo, name = Trace.from_dict(d["trace"]), d["formats"], d["lo"], d["name"]
            candidates = None if cand is None else Candidates(**cand)
            demoted = d.get("demoted_groups", ())
        return cls(trace, formats, lo, name, candidates, demoted)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path) -> "Assignment":
        with open(path) as f:
            return cls.from_dict(json.load(f))


def _check(trace: Trace, candidates: Optional[Candidates]) -> Candidates:
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a lowfp.assign.Trace (from lowfp.assign.trace), "
                        f"got {type(trace).__name__}")
    if candidates is None:
        return Candidates()
    if not isinstance(candidates, Candidates):
        raise TypeError(f"candidates must be a lowfp.assign.Candidates, got {type(candidates).__name__}")
    return candidates


def _with_lo(trace: Trace, c: Candidates, lo: Iterable[str], name: str, groups=()) -> Assignment:
    # Weight gradients stay hi in every strategy unless the candidates say otherwise (§6).
    lo = {n for n in lo if c.weight_grads_lo or trace.tensors[n].role != "dtheta"}
    formats = {n: (c.lo(t.role) if n in lo else c.hi_for(t.dtype)) for n, t in trace.tensors.items()}
    return Assignment(trace, formats, lo, name, c, groups)


def fp32(trace: Trace, candidates: Optional[Candidates] = None) -> Assignment:
    """No rounding at all (the reference run)."""
    c = _check(trace, candidates)
    return Assignment(trace, {n: None for n in trace.tensors}, (), "fp32", c)


def all_hi(trace: Trace, candidates: Optional[Candidates] = None) -> Assignment:
    """Every tensor at the hi candidate."""
    c = _check(trace, candidates)
    return _with_lo(trace, c, (), "all_hi")


def uniform(trace: Trace, candidates: Optional[Candidates] = None) -> Assignment:
    """Every tensor lo (weight gradients hi unless ``candidates.weight_grads_lo``)."""
    c = _check(trace, candidates)
    return _with_lo(trace, c, trace.tensors, "uniform")


def _op_lo(trace: Trace, io: bool) -> List[str]:
    lo: List[str] = []
    inner = trace.gemms[1:-1]  # every GEMM but the first and the last
    for i in inner:
        o = trace.ops[i]
        lo += [n for n in o.inputs if role_of(n) in FORWARD_ROLES]          # v_i, theta_i
        lo += [grad_name(n) for n in o.outputs]                              # dv_{i+1}
        if io:
            lo += list(o.outputs)                                            # v_{i+1}
            lo += [grad_name(n) for n in o.inputs if role_of(n) in FORWARD_ROLES]  # dv_i, dtheta_i
    return [n for n in lo if n in trace.tensors]


def op(trace: Trace, candidates: Optional[Candidates] = None) -> Assignment:
    """The inputs of every GEMM but the first and last lo: its activation and parameter inputs
    (v_i, theta_i) and the gradient of its output (dv_{i+1})."""
    c = _check(trace, candidates)
    return _with_lo(trace, c, _op_lo(trace, False), "op")


def op_io(trace: Trace, candidates: Optional[Candidates] = None) -> Assignment:
    """``op`` plus the GEMMs' outputs and the other gradients: v_{i+1}, dv_i and dtheta_i
    (dtheta_i only with ``Candidates(weight_grads_lo=True)``, as in every strategy)."""
    c = _check(trace, candidates)
    return _with_lo(trace, c, _op_lo(trace, True), "op_io")


ORDERS = ("decreasing", "increasing", "random")


def ours(trace: Trace, r: float, order: str = "decreasing", seed: Optional[int] = None,
         candidates: Optional[Candidates] = None) -> Assignment:
    """Demote whole groups to lo, largest first (``order="decreasing"``; ``"increasing"`` and
    ``"random"`` for ablations), until ratio_lo ≥ r. ``demoted_groups`` lists the demotion
    sequence. ``ours(trace, 0)`` is ``all_hi``; ``ours(trace, 1)`` is ``uniform``."""
    c = _check(trace, candidates)
    if not is_real(r) or not 0.0 <= r <= 1.0:
        raise ValueError(f"r must be a number in [0, 1], got {r!r}")
    check_choice(order, ORDERS, "order")
    if seed is not None:
        check_int(seed, "seed")
    groups = trace.groups(c.weight_grads_lo)
    sizes = [sum(trace.tensors[n].numel for n in g) for g in groups]
    candidates_idx = [i for i, g in enumerate(groups) if g]
    if order == "decreasing":
        seq = sorted(candidates_idx, key=lambda i: (-sizes[i], i))
    elif order == "increasing":
        seq = sorted(candidates_idx, key=lambda i: (sizes[i], i))
    else:
        seq = list(candidates_idx)
        random.Random(seed).shuffle(seq)
    total = trace.total_numel
    lo: List[str] = []
    lo_numel = 0
    demoted: List[int] = []
    for gi in seq:
        if total == 0 or lo_numel / total >= r:
            break
        lo += groups[gi]
        lo_numel += sizes[gi]
        demoted.append(gi)
    label = f"ours(r={r:g}" + (f", order={order}" if order != "decreasing" else "") + \
        (f", seed={seed}" if order == "random" and seed is not None else "") + ")"
    return _with_lo(trace, c, lo, label, demoted)


STRATEGIES = {"fp32": fp32, "all_hi": all_hi, "uniform": uniform, "op": op, "op_io": op_io,
              "ours": ours}


def make(trace: Trace, strategy: str, **kwargs) -> Assignment:
    """An assignment by name: ``make(tr, "op_io")``, ``make(tr, "ours", r=0.5)``."""
    check_choice(strategy, STRATEGIES, "strategy")
    return STRATEGIES[strategy](trace, **kwargs)
