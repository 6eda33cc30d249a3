"""Emulated training (docs/design.md §6): every tensor on its format's grid, fp32 bit for bit, promotion,
and the loss scaler seeing emulated overflows."""

import copy
import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lowfp
from lowfp import assign as A
from lowfp.experiments import models
from sync_mock import DeviceSync, device_reads_forbidden
from training import optimizer_step
from devices import DEVICES, bit_patterns, on_cuda, same_bits


def batch(n=16, c=1, hw=8, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, hw, hw, generator=g), torch.randint(0, classes, (n,), generator=g)


def on_grid(t, fmt, overflow):
    """t equals its own rounding (NaN-free; inf stays inf under overflow='inf')."""
    if isinstance(fmt, lowfp.S2FP8):
        return True  # S2FP8's grid depends on the tensor's statistics; checked in test_s2fp8
    return torch.equal(lowfp.quantize(t.detach(), fmt, overflow=overflow), t.detach())


MODELS = {
    "resnet": lambda: models.ResidualCNN(1, 10, 0.5),
    "mobilenet": lambda: models.MobileNetCNN(1, 10, 0.5),
    "shufflenet": lambda: models.ShuffleNetCNN(1, 10, 0.5),
    "transformer": lambda: models.TransformerClassifier(1, 10, 0.5, image_size=8, patch=2),
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("strategy", ["uniform", "ours", "op_io"])
def test_every_tensor_is_on_its_grid(name, strategy):
    torch.manual_seed(0)
    model = MODELS[name]()
    x, y = batch()
    tr = A.trace(model, x, F.cross_entropy, y)
    a = A.make(tr, strategy, **({"r": 0.5} if strategy == "ours" else {}))
    seen = {}
    leaf_outputs = []
    hooks = [m.register_forward_hook(lambda m, i, o: leaf_outputs.append(o))
             for m in model.modules() if not list(m.children()) and isinstance(m, (nn.Conv2d, nn.Linear))]
    with lowfp.emulate(model, a) as em:
        em.observer = lambda n, t: seen.setdefault(n, []).append(t.detach().clone())
        out = model(x)
        out_grads = []
        out.register_hook(lambda g: out_grads.append(g))
        F.cross_entropy(out, y).backward()
    for h in hooks:
        h.remove()
    # every tensor of the recorded step was rounded, and each result lies on its format's grid
    assert set(seen) == set(tr.tensors)
    for n, ts in seen.items():
        fmt = a.formats[n]
        overflow = "saturate" if A.role_of(n) in ("v", "theta") else "inf"
        for t in ts:
            assert on_grid(t, fmt, overflow), n
    # independent of the observer: the model's output, its gradient, leaf GEMM outputs, .grad
    key = tr.ops[-1].outputs[0]
    assert on_grid(out, a.formats[key], "saturate")
    # the gradient reaching the output is rounded to dv's format before it flows into the model
    dfmt = a.formats[A.grad_name(key)]
    assert torch.equal(seen[A.grad_name(key)][0], lowfp.quantize(out_grads[0], dfmt, overflow="inf"))
    for o in leaf_outputs:
        assert any(on_grid(o, f, "saturate") for f in {a.formats[n] for n in a.formats})
    for pname, p in model.named_parameters():
        assert on_grid(p.grad, a.formats["dtheta:" + pname], "inf"), pname
    assert len(em.history.steps) == 1


def train(model, steps, x, y, emulation=None, lr=0.05, scaler=None):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        optimizer_step(loss, opt, scaler)
        if emulation is not None:
            emulation.record(loss=loss.item())
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["resnet", "transformer"])
def test_fp32_assignment_reproduces_an_unemulated_run_bit_for_bit(name):
    torch.manual_seed(1)
    plain = MODELS[name]()
    emulated = copy.deepcopy(plain)
    x, y = batch()
    tr = A.trace(emulated, x, F.cross_entropy, y)
    torch.manual_seed(5)
    ref_losses = train(plain, 4, x, y)
    torch.manual_seed(5)
    with lowfp.emulate(emulated, A.fp32(tr)) as em:
        losses = train(emulated, 4, x, y, em)
    assert losses == ref_losses
    for (n, p), q in zip(plain.state_dict().items(), emulated.state_dict().values()):
        assert torch.equal(p, q), n
    assert [s["ratio_lo"] for s in em.history.steps] == [0.0] * 4


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_trace_and_train_under_ours(name):
    torch.manual_seed(2)
    model = MODELS[name]()
    x, y = batch(32)
    tr = A.trace(model, x, F.cross_entropy, y)
    assert len(tr.gemms) >= 3
    with lowfp.emulate(model, A.ours(tr, 0.5)) as em:
        losses = train(model, 15, x, y, em, lr=0.05)
    assert losses[-1] < 0.85 * losses[0], losses
    assert len(em.history.steps) == 15 and em.history.steps[3]["loss"] == losses[3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_models_train_under_the_default_candidates(dtype):
    """hi=None: fp(6,9,0) does not fit a 16-bit tensor, which keeps its own format (shown in the
    table); an explicit hi that does not fit is refused when emulate() is entered, naming the
    tensor and the fix; a 16-bit model's promotions go to its own format too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
    x, y = torch.randn(6, 8, dtype=dtype), torch.randint(0, 4, (6,))
    loss_fn = lambda out, t: F.cross_entropy(out.float(), t)  # noqa: E731
    tr = A.trace(model, x, loss_fn, y)
    assert {t.dtype for t in tr.tensors.values()} == {str(dtype).split(".")[1]}
    cand = A.Candidates()
    if dtype == torch.float16:  # fp(5,2,0) reaches 114688, past float16's range: lo must change
        with pytest.raises(ValueError, match=r"dv:.* fp\(5,2,0\).*Candidates\(lo_forward=\.\.\., lo_backward"):
            lowfp.emulate(model, A.ours(tr, 0.5))
        cand = A.Candidates(lo_backward="float8_e5m2")
    a = A.ours(tr, 0.5, candidates=cand)
    own = lowfp.formats.named()[str(dtype).split(".")[1]]
    assert {a[n] for n in tr.tensors if n not in a.lo} == {own}
    assert str(own) in a.table()
    with lowfp.emulate(model, a, threshold=0.0) as em:
        loss_fn(model(x * 1e3), y).backward()  # overflows fp(4,3,4): promotions to own
    assert em.history.promotions and all(p["to"] == str(own) for p in em.history.promotions)
    for t in model.parameters():
        assert t.grad is not None and t.grad.isfinite().all()
    bad = A.ours(tr, 0.5, candidates=A.Candidates("fp(6,9,0)", lo_backward="float8_e5m2"))
    with pytest.raises(ValueError, match=r"tensor v:input\[0\] .* fp\(6,9,0\).*Candidates\(hi=\.\.\.\)"):
        lowfp.emulate(model, bad)
    # the float32 model keeps the paper's hi, and a saved assignment keeps each tensor's dtype
    tr32 = A.trace(model.float(), x.float(), loss_fn, y)
    assert {A.ours(tr32, 0.5)[n] for n in tr32.tensors if n not in A.ours(tr32, 0.5).lo} == {lowfp.fp(6, 9, 0)}
    assert A.Trace.from_dict(tr.to_dict()).tensors == tr.tensors


def test_transformer_attention_is_one_gemm_operator():
    model = MODELS["transformer"]()
    x, y = batch(4)
    tr = A.trace(model, x, F.cross_entropy, y)
    attn = [o for o in tr.ops if o.func == "multi_head_attention_forward"]
    assert len(attn) == 2 and all(o.is_gemm for o in attn)
    assert "theta:blocks.0.attn.in_proj_weight" in attn[0].inputs
    assert "theta:blocks.0.attn.out_proj.weight" in attn[0].inputs


def test_promotion_fires_on_a_model_driven_to_overflow():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[0].weight.mul_(200.0)  # pre-activations far beyond fp(4,3,4)'s max of 30
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    tr = A.trace(model, x, F.cross_entropy, y)
    a = A.uniform(tr)
    with lowfp.emulate(model, a, threshold=0.01) as em:
        train(model, 3, x, y, em, lr=1e-4)
        promoted = em.assignment
    events = em.history.promotions
    names = [e["tensor"] for e in events]
    s1, s2, s3 = em.history.steps
    assert "v:0:linear" in s1["promotions"] and len(set(names)) == len(names)
    assert [e["step"] for e in events] == sorted(e["step"] for e in events)
    assert all(e["overflow_ratio"] > 0.01 and e["to"] == "fp(6,9,0)" for e in events)
    assert s1["ratio_lo"] < a.ratio_lo and s3["ratio_lo"] <= s1["ratio_lo"]
    assert promoted["v:0:linear"] == lowfp.fp(6, 9, 0) and "v:0:linear" not in promoted.lo
    # step 1's counts are read when step 3 begins: step 2 still ran at fp(4,3,4), step 3 not
    assert "v:0:linear" in [n for n, _ in s2["top_overflow"]]
    assert "v:0:linear" not in [n for n, _ in s3["top_overflow"]]
    assert a["v:0:linear"] == lowfp.fp(4, 3, 4)  # the caller's assignment is untouched
    # without promotion the overflow goes on
    torch.manual_seed(3)
    with lowfp.emulate(model, a, promote=False) as em2:
        train(model, 2, x, y, em2, lr=1e-4)
    assert em2.history.promotions == []
    assert "v:0:linear" in [n for n, _ in em2.history.steps[1]["top_overflow"]]


def test_scaler_backs_off_on_an_overflow_a_saturating_format_hides():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    tr = A.trace(model, x, F.cross_entropy, y)
    before = [p.detach().clone() for p in model.parameters()]
    with lowfp.emulate(model, A.uniform(tr), backward_overflow="saturate") as em:
        # dL/dlogits ~ 1/32 per element; times 2^24 it is far beyond fp(5,2,0)'s max (114688)
        scaler = lowfp.DynamicLossScaler(init_scale=2.0 ** 24, emulator=em)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())  # hidden by saturation
        assert int(em.backward_overflows()) > 0
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0 ** 23
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # step skipped
    assert em.history.steps[0]["loss_scale"] == 2.0 ** 24
    # torch's GradScaler, seeing finite gradients, would have stepped
    gs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    with lowfp.emulate(model, A.uniform(tr), backward_overflow="saturate"):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        gs.scale(loss).backward()
        gs.step(opt)
        gs.update()
    assert gs.get_scale() == 2.0 ** 24


def test_eval_and_no_grad_forwards_round_but_are_not_steps():
    torch.manual_seed(5)
    model = models.ResidualCNN(1, 10, 0.5)
    x, y = batch()
    tr = A.trace(model, x, F.cross_entropy, y)
    a = A.uniform(tr)
    with lowfp.emulate(model, a) as em:
        train(model, 2, x, y, em)
        model.eval()
        with torch.no_grad():
            out = model(x)
        model.train()
    assert on_grid(out, a.formats[tr.ops[-1].outputs[0]], "saturate")
    assert len(em.history.steps) == 2
    assert "forward" not in model.__dict__


def test_history_json_and_plot(tmp_path):
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    tr = A.trace(model, x, F.cross_entropy, y)
    with lowfp.emulate(model, A.ours(tr, 0.5)) as em:
        scaler = lowfp.DynamicLossScaler(init_scale=256.0, emulator=em)
        train(model, 5, x, y, em, scaler=scaler)
    h = em.history
    assert [s["step"] for s in h.steps] == [1, 2, 3, 4, 5]
    assert all(s["loss_scale"] == 256.0 for s in h.steps)
    path = tmp_path / "h.json"
    h.save(path)
    import json
    back = json.loads(path.read_text())
    assert back["steps"][2]["loss"] == h.steps[2]["loss"] and back["promotions"] == []
    png = tmp_path / "h.png"
    from lowfp.experiments.plots import plot_history
    plot_history(h, png, title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_emulate_errors():
    model = nn.Linear(4, 2)
    tr = A.trace(model, torch.randn(3, 4))
    with pytest.raises(TypeError, match="assignment must be"):
        lowfp.emulate(model, "uniform")
    with pytest.raises(ValueError, match="threshold"):
        lowfp.emulate(model, A.uniform(tr), threshold=2)
    with pytest.raises(ValueError, match="backward_overflow"):
        lowfp.emulate(model, A.uniform(tr), backward_overflow="wrap")
    with pytest.raises(ValueError, match="rounding"):
        lowfp.emulate(model, A.uniform(tr), rounding="up")
    with lowfp.emulate(model, A.uniform(tr)):
        with pytest.raises(ValueError, match="already"):
            lowfp.emulate(model, A.uniform(tr)).install()
    # a format that cannot hold a tensor's dtype is named when emulate() is entered: here the
    # parameters, made bfloat16 after a float32 trace
    half = nn.Linear(4, 2)
    tr32 = A.trace(half, torch.randn(3, 4))
    half.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"theta:weight \(torch.bfloat16\) is assigned fp\(6,9,0\).*"
                                         r"does not fit torch.bfloat16.*Candidates\(hi=\.\.\.\)"):
        lowfp.emulate(half, A.all_hi(tr32))
    assert "forward" not in half.__dict__
    # a model lowfp cannot round is refused before anything is installed or allocated
    meta = nn.Linear(4, 2).to("meta")
    with pytest.raises(ValueError, match="model has parameters or buffers on device meta"):
        lowfp.emulate(meta, A.uniform(tr))
    assert "forward" not in meta.__dict__
    # meta inputs to a CPU model: the rounding names them, and leaving the block still works
    em = lowfp.emulate(model, A.uniform(tr))
    with pytest.raises(ValueError, match="x is on meta|on device meta"):
        with em:
            model(torch.randn(3, 4, device="meta"))
    assert "forward" not in model.__dict__ and int(em.counts.sum()) == 0


def test_bfloat16_model_with_extra_bits_optimizer_and_scaler():
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4)).to(torch.bfloat16)
    x, y = torch.randn(64, 8, dtype=torch.bfloat16), torch.randint(0, 4, (64,))
    loss_fn = lambda out, t: F.cross_entropy(out.float(), t)  # noqa: E731
    tr = A.trace(model, x, loss_fn, y)
    cand = A.Candidates(hi="bfloat16")  # the hi format must fit the bfloat16 activations
    opt = lowfp.optim.ExtraBitsSGD(model.parameters(), lr=0.3, momentum=0.9, extra_bits=8)
    losses = []
    with lowfp.emulate(model, A.ours(tr, 0.5, candidates=cand)) as em:
        scaler = lowfp.DynamicLossScaler(init_scale=2.0 ** 10, emulator=em)
        for _ in range(25):
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def _read_step_by_rows(em, rows):
    """What a closed step's count rows give, row by row in Python's ints (the reference for
    Emulator._read_step): (promotions, top_overflow, top_underflow, backward_underflow)."""
    over, under, promoted = [], [], []
    grad_underflow = grad_numel = 0
    for i, (name, forward) in enumerate(em._row_roles):
        o, u, _, n = (int(v) for v in rows[i])
        if not forward:
            grad_underflow, grad_numel = grad_underflow + u, grad_numel + n
        if n == 0:
            continue
        if o:
            over.append((name, o / n))
            if em.promote and forward and o / n > em.threshold and name in em.assignment.lo:
                promoted.append(name)
        if u:
            under.append((name, u / n))
    over.sort(key=lambda x: -x[1])  # (stable: ties in row order)
    under.sort(key=lambda x: -x[1])
    return promoted, over[:em.top], under[:em.top], grad_underflow / grad_numel if grad_numel else 0.0


@pytest.mark.parametrize("promote", [True, False])
def test_a_closed_steps_counts_give_the_row_by_row_history(promote):
    """Emulator._read_step gives the history entry and promotions of a plain row-by-row reading
    of the count table, ties and all: random tables, with rows that counted nothing, ratios that
    tie, overflows on both sides of the threshold, promotion on and off."""
    from lowfp.emulate import _ClosedStep
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    g = torch.Generator().manual_seed(7)
    promotions = ties = 0
    for trial in range(20):
        a = A.ours(A.trace(model, x, F.cross_entropy, y), 0.5)
        with lowfp.emulate(copy.deepcopy(model), a, promote=promote) as em:
            em.top = 3  # (fewer than the rows with events)
            rows_n = len(em._row_roles)
            n = torch.randint(0, 4, (rows_n,), generator=g) * 25  # (0: a row that counted nothing)
            over = torch.minimum(torch.randint(0, 4, (rows_n,), generator=g), n)
            under = torch.minimum(torch.randint(0, 3, (rows_n,), generator=g) * 5, n - over)
            rows = torch.stack((over, under, torch.zeros_like(n), n), 1).numpy()
            promoted, top_over, top_under, lost = _read_step_by_rows(em, rows)
            entry = em._read_step(_ClosedStep(trial + 1, None, None, None, {}), rows)
            assert entry["promotions"] == promoted
            assert entry["top_overflow"] == top_over and entry["top_underflow"] == top_under
            assert entry["backward_underflow"] == lost
            assert all(type(r) is float for _, r in top_over + entry["top_overflow"])
            assert [p["tensor"] for p in em.history.promotions] == promoted
            assert all(name not in em.assignment.lo for name in promoted)
            promotions += len(promoted)
            ratios = [r for _, r in top_over]
            ties += len(ratios) - len(set(ratios))
    assert (promotions > 0) == promote and ties > 0  # (the cases the table is made to hold)


def test_history_records_the_share_of_gradients_lost_to_underflow():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    tr = A.trace(model, x, F.cross_entropy, y)

    def share(lo_backward):
        a = A.uniform(tr, candidates=A.Candidates("bfloat16", "bfloat16", lo_backward))
        seen = []
        with lowfp.emulate(model, a) as em:
            em.observer = lambda n, t: seen.append((n, t.detach().clone()))
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            em.end_step()
        grads = [t for n, t in seen if n.startswith(("dv:", "dtheta:"))]
        return em.history.steps[-1]["backward_underflow"], grads
    # fp(5,2,0) (float8_e5m2's range) keeps these gradients, fp(3,2,0) (smallest 2^-3) loses most
    kept, _ = share("fp(5,2,0)")
    lost, grads = share("fp(3,2,0)")
    assert kept < 0.05 < lost <= 1
    zeros = sum(int((g == 0).sum()) for g in grads) / sum(g.numel() for g in grads)
    assert lost <= zeros  # every underflow became a zero (some were zero before rounding)


class _Selecting(nn.Module):
    """ReLU (in place and not) and max pooling, each reading a rounded tensor; ``write`` writes
    into the tensor ReLU reads first (without using the returned value), in one of three ways."""

    def __init__(self, write=None):
        super().__init__()
        self.write = write
        self.conv1, self.bn = nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3)
        self.fc = nn.Linear(4, 10)

    def forward(self, x):
        h = self.bn(self.conv1(x))
        if self.write == "method":
            h.mul_(3.0)
        elif self.write == "view":
            h[:, 0].mul_(3.0)
        elif self.write == "setitem":
            h[:, 1] = 0.1
        r = F.relu(h, inplace=True)
        self.relu_returned_its_input = r is h  # (as torch's in-place ReLU does)
        h = F.max_pool2d(r, 2)
        h = F.adaptive_max_pool2d(torch.relu(self.conv2(h)), 1)
        return self.fc(h.flatten(1))


def _emulated_step(model, a, x, y, skip=True, observe=True, **kw):
    """Output, parameter gradients and the step's count table (with the backward counts) of one
    emulated training step, and the rounded tensors by name (observe=False: none, the observer
    unset); skip=False rounds every selecting operator's output too."""
    with lowfp.emulate(model, a, **kw) as em:
        if not skip:
            em._source_of = lambda t: None
        seen = {}
        if observe:
            em.observer = lambda n, t: seen.setdefault(n, t.detach().clone())
        out = model(x)
        F.cross_entropy(out, y).backward()
        em._fold_grad_counts()
        counts = em.counts.clone()
    return out.detach(), [p.grad.clone() for p in model.parameters()], counts, seen


def _rounder_calls(monkeypatch):
    """A list that gets an entry for each rounding the emulation makes (each goes through a
    BoundRounder: a call, or a rounding in place that rounds)."""
    from lowfp.quantize import BoundRounder
    calls = []
    call, in_place = BoundRounder.__call__, BoundRounder.round_in_place
    monkeypatch.setattr(BoundRounder, "__call__", lambda self, t: calls.append(1) or call(self, t))

    def round_in_place(self, t):
        done = in_place(self, t)
        if done:
            calls.append(1)
        return done
    monkeypatch.setattr(BoundRounder, "round_in_place", round_in_place)
    return calls


def _skipped_roundings(base, strategy, r, seed, monkeypatch):
    """(trace, assignment, roundings skipped) of one emulated step of ``base`` (its input with a
    NaN) with selecting operators skipping and without: the same output, gradients, counts
    (NaNs among them) and observed tensors either way."""
    calls = _rounder_calls(monkeypatch)
    torch.manual_seed(seed)
    x, y = batch(hw=12)
    x[0, 0, 0, 0] = float("nan")
    tr = A.trace(base, x, F.cross_entropy, y)
    a = A.make(tr, strategy, **({"r": r} if strategy == "ours" else {}))
    results = []
    for skip, observe in ((True, True), (False, True), (True, False)):
        calls.clear()
        results.append(_emulated_step(copy.deepcopy(base), a, x, y, skip, observe) + (len(calls),))
    (out, grads, counts, seen, n_skip), (out_ref, grads_ref, counts_ref, seen_ref, n_ref) = results[:2]
    # without an observer, a skipped tensor is the operator's result itself, its gradient rounded
    # by a hook: the same again
    out_hook, grads_hook, counts_hook, _, n_hook = results[2]
    for o in (out, out_hook):
        assert torch.equal(o.nan_to_num(), out_ref.nan_to_num())
    for g, g_hook, g_ref in zip(grads, grads_hook, grads_ref):
        assert torch.equal(g.nan_to_num(), g_ref.nan_to_num())
        assert torch.equal(g_hook.nan_to_num(), g_ref.nan_to_num())
    assert torch.equal(counts, counts_ref) and torch.equal(counts_hook, counts_ref)
    assert n_hook == n_skip
    assert counts[:, 2].sum() > 0  # NaNs were counted where the rounding was skipped too
    assert seen.keys() == seen_ref.keys()
    for n in seen:
        assert torch.equal(seen[n].nan_to_num(), seen_ref[n].nan_to_num()), n
    return tr, a, n_ref - n_skip


@pytest.mark.parametrize("strategy", ["uniform", "ours"])
def test_selecting_operators_skip_a_rounding_that_changes_nothing(strategy, monkeypatch):
    """ReLU and max pooling of a tensor rounded to their output's format: the forward rounding
    of their outputs is skipped, with the same values, gradients and counts (NaN included)."""
    torch.manual_seed(0)
    tr, a, skipped = _skipped_roundings(_Selecting(), strategy, 0.5, 0, monkeypatch)
    selecting = [op for op in tr.ops if op.func in ("relu", "max_pool2d", "adaptive_max_pool2d")]
    # each selecting operator whose input has its output's format skips its forward rounding
    skippable = sum(a.formats[op.inputs[0]] == a.formats[op.outputs[0]] for op in selecting)
    assert len(selecting) == 4 and skippable >= (4 if strategy == "uniform" else 1)
    assert skipped == skippable
    if strategy == "uniform":  # a skipped in-place ReLU returns its input, as torch's does
        model = _Selecting()
        x, y = batch(hw=12)
        _emulated_step(model, a, x, y, observe=False)
        assert model.relu_returned_its_input
        _emulated_step(model, a, x, y, skip=False, observe=False)
        assert not model.relu_returned_its_input  # (a rounded copy)


class _Partitions(nn.Module):
    """Every kind of partitioning call on one rounded tensor, and one on an unrounded input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(13, 10)

    def forward(self, x):
        h = self.conv(x)
        parts = [*h.chunk(2, dim=1), *torch.split(h, [1, 3], dim=1), h.narrow(1, 1, 2), h[:, :3],
                 *h.unbind(1), *torch.tensor_split(h, 2, dim=3)]
        parts.append(x[:, :, :5])  # (the model's input: no format of this forward's)
        return self.fc(torch.stack([p.flatten(1).mean(1) for p in parts], 1))


PARTITIONS = ("chunk", "split", "narrow", "__getitem__", "unbind", "tensor_split")


@pytest.mark.parametrize("strategy", ["uniform", "ours"])
def test_partitions_skip_a_rounding_that_changes_nothing(strategy, monkeypatch):
    """Each part of a partition of a tensor rounded to the part's format: its forward rounding
    is skipped, with the same values, gradients and counts (NaN included) as rounding it."""
    torch.manual_seed(3)
    tr, a, skipped = _skipped_roundings(_Partitions(), strategy, 0.3, 3, monkeypatch)
    partitions = [op for op in tr.ops if op.func in PARTITIONS]
    assert sorted({op.func for op in partitions}) == sorted(PARTITIONS)
    skippable = sum(op.inputs[0] in a.formats and a.formats[op.inputs[0]] == a.formats[o]
                    for op in partitions for o in op.outputs)
    assert skipped == skippable and skippable >= (12 if strategy == "uniform" else 1)


@pytest.mark.parametrize("write", ["method", "view", "setitem"])
def test_a_write_in_place_makes_selecting_operators_round_again(write):
    """A write into a tensor (whose returned value the model drops, or of a constant) leaves
    values off the grid: ReLU of it must round again (the skip ends at any in-place write)."""
    torch.manual_seed(1)
    model = _Selecting(write)
    x, y = batch(hw=12)
    a = A.uniform(A.trace(model, x, F.cross_entropy, y))
    out, grads, counts, seen = _emulated_step(model, a, x, y)
    relu = next(n for n in seen if n.endswith(":relu"))
    fmt = a.formats[relu]
    assert on_grid(seen[relu], fmt, "saturate")
    # (the values ReLU was given were off the grid: otherwise this test shows nothing)
    _, _, _, seen_bn = _emulated_step(model, a, x, y)
    bn = next(n for n in seen_bn if n.endswith(":batch_norm"))
    written = seen_bn[bn].clone()
    if write == "method":
        written.mul_(3.0)
    elif write == "view":
        written[:, 0].mul_(3.0)
    else:
        written[:, 1] = 0.1
    assert not on_grid(F.relu(written), fmt, "saturate")


def test_selecting_operators_round_when_formats_differ_or_follow_the_tensor(monkeypatch):
    """No skip where the input's format differs from the output's (hi in, lo out) or where the
    format's grid follows each tensor (S2FP8)."""
    calls = _rounder_calls(monkeypatch)
    torch.manual_seed(2)
    base = _Selecting()
    x, y = batch(hw=12)
    tr = A.trace(base, x, F.cross_entropy, y)
    a = A.uniform(tr)
    relu = next(op for op in tr.ops if op.func == "relu")
    a.formats[relu.inputs[0]] = a.candidates.hi_for(torch.float32)
    _, _, _, seen = _emulated_step(copy.deepcopy(base), a, x, y)
    assert not on_grid(seen[relu.inputs[0]], a.formats[relu.outputs[0]], "saturate")
    assert on_grid(seen[relu.outputs[0]], a.formats[relu.outputs[0]], "saturate")
    s2 = A.uniform(tr, candidates=A.Candidates(lo_forward=lowfp.S2FP8("float8_e5m2")))
    results = []
    for skip in (True, False):
        calls.clear()
        results.append(_emulated_step(copy.deepcopy(base), s2, x, y, skip) + (len(calls),))
    assert results[0][4] == results[1][4]
    assert torch.equal(results[0][0], results[1][0])


@pytest.mark.parametrize("case", ["nearest", "stochastic", "promotion", "scaler"])
def test_a_training_step_never_waits_for_the_device(case):
    """The forwards and backwards of emulated steps read nothing of the device on the host: the
    CPU stand-in for torch.cuda.set_sync_debug_mode("error") (tests/sync_mock.py) around each;
    test_emulated_forward_and_backward_never_wait_for_the_gpu runs the real mode on a GPU. The
    counts are read a step later (when the forward after next begins, from a host copy) or by
    end_step(), which does wait."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    if case == "promotion":
        with torch.no_grad():
            model[0].weight.mul_(200.0)  # beyond fp(4,3,4)'s max: promotions
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    a = A.uniform(A.trace(model, x, F.cross_entropy, y))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rounding = "stochastic" if case == "stochastic" else "nearest"
    with lowfp.emulate(model, a, rounding=rounding) as em:
        scaler = lowfp.DynamicLossScaler(init_scale=2.0 ** 10, emulator=em) if case == "scaler" else None
        for _ in range(4):
            with device_reads_forbidden(model.parameters(), (x, y, em.counts, em._grad_counts)):
                loss = F.cross_entropy(model(x), y)
                (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is None:
                opt.step()
            else:  # reads the step's overflows once, where the caller asks
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
        with device_reads_forbidden(model.parameters(), (x, y, em.counts, em._grad_counts)):
            with pytest.raises(DeviceSync):  # the mock sees a read: loss.item() would wait
                F.cross_entropy(model(x), y).item()
    assert [s["step"] for s in em.history.steps] == [1, 2, 3, 4, 5]
    assert bool(em.history.promotions) == (case == "promotion")


def test_end_step_reads_the_counts_at_once():
    """end_step() closes the step and reads its counts now: a promotion applies from the next
    step; without it, from the step after (see the test above)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[0].weight.mul_(200.0)
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    a = A.uniform(A.trace(model, x, F.cross_entropy, y))
    with lowfp.emulate(model, a) as em:
        F.cross_entropy(model(x), y).backward()
        with device_reads_forbidden(em.counts):
            with pytest.raises(DeviceSync):  # it waits for the device, as documented
                em.end_step()
    with lowfp.emulate(model, a) as em:
        entries = []
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
            em.record(loss=1.0)
            entries.append(em.end_step())
        assert em.end_step() is None  # nothing left to read
    assert entries == em.history.steps and entries[0]["step"] == 1 and entries[0]["loss"] == 1.0
    assert "v:0:linear" in entries[0]["promotions"]
    assert "v:0:linear" not in [n for n, _ in entries[1]["top_overflow"]]


# On a GPU (tests/devices.py): the CPU's bits, counts and steps.

@on_cuda
def test_emulated_training_on_cuda():
    import torch.nn.functional as F
    from lowfp import assign as A
    torch.manual_seed(0)
    model = lowfp.experiments.models.ResidualCNN(1, 10, 0.5).cuda()
    x, y = torch.randn(16, 1, 8, 8, device="cuda"), torch.randint(0, 10, (16,), device="cuda")
    tr = A.trace(model, x, F.cross_entropy, y)
    a = A.ours(tr, 0.5)
    seen = {}
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    with lowfp.emulate(model, a) as em:
        assert em.counts.is_cuda
        scaler = lowfp.DynamicLossScaler("cuda", init_scale=256.0, emulator=em)
        for step in range(10):
            em.observer = (lambda n, t: seen.setdefault(n, t.detach().clone())) if step == 0 else None
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    assert set(seen) == set(tr.tensors)
    for n, t in seen.items():
        overflow = "saturate" if A.role_of(n) in ("v", "theta") else "inf"
        assert torch.equal(lowfp.quantize(t, a.formats[n], overflow=overflow), t), n
    assert losses[-1] < losses[0] and len(em.history.steps) == 10


@on_cuda
@pytest.mark.parametrize("case", ["nearest", "stochastic", "promotion", "scaler", "compiled"])
def test_emulated_forward_and_backward_never_wait_for_the_gpu(case):
    """torch.cuda.set_sync_debug_mode("error") around each emulated forward and backward (the
    counts are read a step later, from a host copy; docs/design.md §6); tests/test_emulate.py
    runs the CPU stand-in."""
    import torch.nn.functional as F
    from lowfp import assign as A
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
    if case == "promotion":
        with torch.no_grad():
            model[0].weight.mul_(200.0)
    x, y = torch.randn(64, 8, device="cuda"), torch.randint(0, 4, (64,), device="cuda")
    a = A.uniform(A.trace(model, x, F.cross_entropy, y))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with lowfp.emulate(model, a, rounding="stochastic" if case == "stochastic" else "nearest") as em:
        scaler = lowfp.DynamicLossScaler("cuda", init_scale=2.0 ** 10, emulator=em) if case == "scaler" else None
        run = torch.compile(model) if case == "compiled" else model
        for step in range(5):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if step >= 2 else "default")  # compiled by then
            try:
                loss = F.cross_entropy(run(x), y)
                (loss if scaler is None else scaler.scale(loss)).backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
    assert [s["step"] for s in em.history.steps] == [1, 2, 3, 4, 5]
    assert bool(em.history.promotions) == (case == "promotion")


# One operator per autograd node that emulate rounds in place (emulate._SAVES_NO_RESULT), and
# some whose node saves its result (which must not be): name -> f(tensors) on the device.
def _node_cases(device):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device).requires_grad_()
    x, w, a, b, s, s2 = r(4, 8, 6, 6), r(8, 8, 3, 3), r(5, 7), r(7, 3), r(2, 5, 7), r(2, 7, 3)
    c8, c7, c3 = r(8), r(7), r(3)
    return {
        "conv2d": lambda: F.conv2d(x, w, padding=1), "conv_transpose2d": lambda: F.conv_transpose2d(x, w),
        "linear": lambda: F.linear(a, b.t(), c3), "linear 3-d": lambda: F.linear(s, b.t()),
        "mm": lambda: a @ b, "bmm": lambda: torch.bmm(s, s2), "matmul 3-d": lambda: s @ b,
        "baddbmm": lambda: torch.baddbmm(s @ s2, s, s2),
        "attention": lambda: F.scaled_dot_product_attention(s, s, s),
        "add": lambda: a + a, "sub": lambda: a - 2 * a, "mul": lambda: a * a, "div": lambda: a / (a.abs() + 1),
        "neg": lambda: -a, "batch_norm": lambda: F.batch_norm(x, torch.zeros(8, device=device),
                                                             torch.ones(8, device=device), c8, c8, training=True),
        "layer_norm": lambda: F.layer_norm(s, (7,), c7), "group_norm": lambda: F.group_norm(x, 2, c8, c8),
        "mean": lambda: x.mean(), "mean dims": lambda: x.mean(dim=(2, 3)), "sum": lambda: x.sum(),
        "sum dim": lambda: x.sum(dim=1), "avg_pool2d": lambda: F.avg_pool2d(x, 2), "gelu": lambda: F.gelu(a),
        "silu": lambda: F.silu(a), "leaky_relu": lambda: F.leaky_relu(a), "hardswish": lambda: F.hardswish(a),
        "cat": lambda: torch.cat([a, a]), "stack": lambda: torch.stack([a, a]),
        "embedding": lambda: F.embedding(torch.tensor([1, 2], device=device), a),
        "pad": lambda: F.pad(x, (1, 1)), "interpolate": lambda: F.interpolate(x, scale_factor=2),
        # nodes that save their result
        "relu": lambda: F.relu(a), "softmax": lambda: F.softmax(a, -1), "log_softmax": lambda: F.log_softmax(a, -1),
        "tanh": lambda: torch.tanh(a), "sigmoid": lambda: torch.sigmoid(a), "exp": lambda: a.exp(),
        "sqrt": lambda: (a.abs() + 1).sqrt(),
    }


@pytest.mark.parametrize("device", DEVICES)
def test_results_rounded_in_place_are_saved_by_no_node(device):
    """A result whose autograd node emulate rounds in its own memory is held by nothing autograd
    saved: every tensor its operator packs for backward (torch.autograd.graph.saved_tensors_hooks)
    lies in other memory. Nodes that save their result are not rounded in place. On the CPU, every
    node of the list is met."""
    emulation = importlib.import_module("lowfp.emulate")
    met = set()
    for name, f in _node_cases(device).items():
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            out = f()
        node = out.grad_fn
        if type(node).__name__ == "UnsafeViewBackward0":
            node = node.next_functions[0][0]
        met.add(type(node).__name__)
        saved = any(p.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for p in packed)
        assert emulation._rounds_in_place(out) == (type(node).__name__ in emulation._SAVES_NO_RESULT), name
        if emulation._rounds_in_place(out):
            assert not saved, name
        if name in ("relu", "softmax", "log_softmax", "tanh", "sigmoid", "exp", "sqrt"):
            assert saved and not emulation._rounds_in_place(out), name
    if device == "cpu":
        assert emulation._SAVES_NO_RESULT <= met, sorted(emulation._SAVES_NO_RESULT - met)


def _steps_with_and_without_rounding_in_place(model, a, x, y, monkeypatch, steps=3, rounding="nearest"):
    """(parameters, counts, history, roundings in place) after training copies of ``model`` for
    ``steps`` under ``a``: with results rounded in their own memory, and with each rounded into a
    copy."""
    emulation = importlib.import_module("lowfp.emulate")
    check = emulation._rounds_in_place
    # (the Python method, whose _rounds_in_place this replaces; lowfp._C.emulator_round, the
    # same algorithm, is compared with it in test_the_native_interception_gives_the_python_methods_results)
    monkeypatch.setattr(emulation.Emulator, "_native_round", False)
    results = []
    for in_place in (True, False):
        calls = []
        monkeypatch.setattr(emulation, "_rounds_in_place",
                            lambda t: calls.append(check(t)) or (in_place and calls[-1]))
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        torch.manual_seed(7)
        with lowfp.emulate(m, a, rounding=rounding) as em:
            for _ in range(steps):
                loss = F.cross_entropy(m(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            counts = em.counts.clone()
        results.append(([p.detach().clone() for p in m.parameters()], counts, em.history.steps, sum(calls)))
    monkeypatch.setattr(emulation, "_rounds_in_place", check)
    return results


@pytest.mark.parametrize("name", sorted(MODELS))
def test_results_rounded_in_place_give_the_bits_of_a_copy(name, monkeypatch):
    """Rounding an operator's new result in its own memory (its gradient by a tensor hook) gives
    the parameters, counts and history of rounding it into a copy (an autograd Function), and the
    caller's input and the model's parameters outside the optimizer's step are not written."""
    torch.manual_seed(0)
    model = MODELS[name]()
    x, y = batch()
    x_before = x.clone()
    tr = A.trace(model, x, F.cross_entropy, y)
    before = [p.detach().clone() for p in model.parameters()]
    with lowfp.emulate(model, A.make(tr, "uniform")):
        for _ in range(2):  # (the second forward's roundings are prepared)
            F.cross_entropy(model(x), y).backward()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    model.zero_grad()
    (params, counts, history, n), (params_ref, counts_ref, history_ref, _) = \
        _steps_with_and_without_rounding_in_place(model, A.make(tr, "uniform"), x, y, monkeypatch)
    assert n > 0  # some results were rounded in place
    assert all(torch.equal(p, q) for p, q in zip(params, params_ref))
    assert torch.equal(counts, counts_ref) and history == history_ref
    assert torch.equal(x, x_before)


class _ReturnsItsArgument(nn.Module):
    """A convolution's result, which its node does not save, saved by the next convolution and
    then passed through an operator that returns its argument (dropout in eval mode)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(8 * 64, 10)

    def forward(self, x):
        h = self.conv1(x)
        z = self.conv2(h)
        w = F.dropout(h, 0.5, training=False)  # h itself
        return self.head(torch.cat([z, w], 1).flatten(1))


def test_an_operator_that_returns_its_argument_is_not_rounded_in_place(monkeypatch):
    """The result of an operator call that returns one of its arguments is rounded into a copy:
    rounded in place, the convolution's input that conv2 saved would change under it."""
    torch.manual_seed(0)
    model = _ReturnsItsArgument()
    x, y = batch()
    tr = A.trace(model, x, F.cross_entropy, y)
    a = A.make(tr, "uniform")
    dropout = next(n for n in tr.tensors if n.endswith(":dropout"))
    formats = dict(a.formats)
    formats[dropout] = lowfp.fp(3, 1, 2)  # coarser than conv1's result: rounding it again changes it
    a = A.Assignment(tr, formats, a.lo, "test")
    (params, counts, _, n), (params_ref, counts_ref, _, _) = \
        _steps_with_and_without_rounding_in_place(model, a, x, y, monkeypatch)
    assert n > 0
    assert all(torch.equal(p, q) for p, q in zip(params, params_ref))
    assert torch.equal(counts, counts_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt, rounding, dtype", [("fp(4,3,4)", "nearest", torch.float32),
                                                  ("float8_e5m2", "nearest", torch.bfloat16),
                                                  ("fp(5,2,0)", "stochastic", torch.float32),
                                                  ("s2fp8", "nearest", torch.float32)])
def test_a_bound_rounder_gives_its_rounders_bits_and_counts(device, fmt, rounding, dtype):
    """BoundRounder(rounder, stats)(x) and .round_in_place(x), the emulation's calls, give the
    bits and counts of rounder(x, stats), on every call (the first learns the prepared request),
    for contiguous and transposed tensors and Parameters; stochastic rounding draws its seeds
    from torch's generator as the rounder does."""
    from lowfp.quantize import BoundRounder, Rounder
    rounder = Rounder(fmt, rounding, "saturate")
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(64, 48, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 48), generator=g))).to(dtype)
    base[0, :3] = torch.tensor([float("nan"), float("inf"), 1e30])
    for x in (base.to(device), base.to(device).t(), torch.nn.Parameter(base.to(device))):
        bound_stats, stats = lowfp.Stats(device), lowfp.Stats(device)
        bound = BoundRounder(rounder, bound_stats)
        for call in range(3):
            torch.manual_seed(call)
            y = bound(x)
            torch.manual_seed(call)
            assert same_bits(y, rounder(x, stats)) and y.shape == x.shape
            assert torch.equal(bound_stats.counts, stats.counts)
            if type(x) is torch.Tensor and x.is_contiguous():
                z = x.clone()
                torch.manual_seed(call)
                done = bound.round_in_place(z)
                torch.manual_seed(call)
                if done:
                    assert same_bits(z, rounder(x, stats))
                    assert torch.equal(bound_stats.counts, stats.counts)
                else:
                    assert torch.equal(z, x)
        # a plain format's request learned, stochastic ones too: later calls are one C call
        assert (x.dtype in bound._requests) == (fmt != "s2fp8")


def test_a_bound_rounder_takes_what_a_stack_passes_or_names_the_problem():
    """Empty and non-contiguous tensors, meta and FakeTensors round (through the rounder where
    its one native call does not take them); other types and integer tensors are named errors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lowfp.quantize import BoundRounder, Rounder
    bound = BoundRounder(Rounder("fp(4,3,4)"), lowfp.Stats())
    bound(torch.randn(4))  # (learns the prepared request)
    assert bound(torch.empty(0)).shape == (0,) and bound.round_in_place(torch.empty(0))
    x = torch.randn(3, 4).t()
    assert torch.equal(bound(x), lowfp.quantize(x, "fp(4,3,4)", overflow="saturate"))
    assert BoundRounder(Rounder("fp(4,3,4)"))(torch.randn(4, device="meta")).device.type == "meta"
    for precision in ("fp(4,3,4)", "s2fp8", "mxfp8_e4m3"):  # meta after the rounder has a CPU request
        rounder = Rounder(precision)
        for _ in range(2):
            rounder(torch.randn(2, 32))
        assert rounder(torch.randn(2, 32, device="meta")).device.type == "meta"
        assert not rounder.round_in_place(torch.randn(2, 32, device="meta"))
    with FakeTensorMode():
        assert BoundRounder(Rounder("fp(4,3,4)"))(torch.randn(4)).shape == (4,)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        bound([1.0])
    with pytest.raises(ValueError, match="cannot be rounded"):
        bound(torch.arange(3))


class _EveryCallKind(nn.Module):
    """Calls of every shape the interception meets: tensors given by keyword and in lists, a
    parameter read directly, views, a partition and a cut, results that are tuples or not floating,
    writes into a tensor (a method, __setitem__, out=), metadata queries, and a GEMM."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.scale = nn.Parameter(torch.full((4, 1, 1), 1.5))
        self.fc = nn.Linear(4 * 36 + 3, 10)

    def forward(self, x):
        h = self.conv(x)
        assert h.dim() == 4 and h.size(1) == 4
        h = torch.add(h, other=self.scale)           # a parameter by keyword
        a, b = h.chunk(2, dim=1)                     # a tuple result (a partition)
        h = torch.cat([b, a], dim=1) * self.scale    # a list argument; a parameter read directly
        h[:, 0] = 0.25                               # __setitem__
        h.mul_(1.5)                                  # a write by a method
        top = h[:, :3].amax(dim=(1, 2, 3))           # a cut
        best = h.flatten(1).argmax(dim=1)            # a result that is not floating
        s = torch.empty_like(top)
        torch.mul(top.detach(), 2.0, out=s)          # out=
        values, _ = h.flatten(2).max(dim=2)          # a tuple of a floating and an integer result
        feat = torch.cat([h.flatten(1), s[:, None], values[:, :2] + best[:, None]], dim=1)
        return self.fc(input=feat)                   # the GEMM's input by keyword


@pytest.mark.parametrize("name", sorted(MODELS) + ["every call kind"])
def test_the_native_interception_gives_the_python_methods_results(name, monkeypatch):
    """ForwardSession.call's eager path in C (lowfp._C.intercept_call, with Emulator._round's,
    lowfp._C.emulator_round) and the Python methods record the same trace and train the same
    bits: parameters, counts, history and a forward without grad, with nearest and stochastic
    rounding and with GEMMs emulated."""
    intercept = importlib.import_module("lowfp._intercept")
    native = intercept._C.intercept_call
    make = MODELS.get(name, _EveryCallKind)
    x, y = batch()
    runs = []
    for call in (native, None):
        monkeypatch.setattr(intercept._C, "intercept_call", call)
        torch.manual_seed(0)
        model = make()
        tr = A.trace(model, x, F.cross_entropy, y)
        got = [tr.ops, tr.tensors]
        for strategy, rounding, recipe in (("ours", "nearest", None), ("ours", "stochastic", None),
                                           ("ours", "nearest", "mxfp8"), ("uniform", "nearest", None)):
            m = copy.deepcopy(model)
            opt = torch.optim.SGD(m.parameters(), lr=0.05)
            torch.manual_seed(1)
            a = A.make(tr, strategy, **({"r": 0.5} if strategy == "ours" else {}))
            with lowfp.emulate(m, a, rounding=rounding, gemm_recipe=recipe) as em:
                assert (em._mode.native is None) == (call is None)
                counts = []  # (each step's, before the next forward reads them)
                for _ in range(3):
                    loss = F.cross_entropy(m(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    counts.append(em.counts.clone())
                with torch.no_grad():  # (rounded, not counted)
                    evaluated = m(x)
            got += [[p.detach().clone() for p in m.parameters()] + [evaluated], torch.stack(counts),
                    em.history.steps]
        runs.append(got)
    native_run, python_run = runs
    assert native_run[0] == python_run[0] and native_run[1] == python_run[1]
    assert len(native_run[0]) > 5
    for got, want in zip(native_run[2:], python_run[2:]):
        if isinstance(got, list) and got and isinstance(got[0], torch.Tensor):
            assert all(same_bits(p, q) for p, q in zip(got, want))
        elif isinstance(got, torch.Tensor):
            assert torch.equal(got, want)
        else:
            assert got == want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_a_skipped_rounding_counts_its_nans_and_elements(device, dtype, layout):
    """The counts a skipped rounding adds (emulate._count_unchanged): the tensor's NaNs (not its
    infinities) and its element count, added to what the row held, for every dtype and layout."""
    emulation = importlib.import_module("lowfp.emulate")
    g = torch.Generator().manual_seed(0)
    base = torch.randn(33, 40, generator=g, dtype=torch.float64)
    base[base > 1.5] = float("nan")
    base[base < -1.8] = float("inf")
    t = base.to(dtype).to(device)
    t = {"contiguous": t, "transposed": t.t(), "strided": t[::2, 1::3]}[layout]
    for counts_before in ([0, 0, 0, 0], [3, 1, 4, 1]):
        counts = torch.tensor(counts_before, dtype=torch.int64, device=device)
        emulation._count_unchanged(counts, t)
        want = list(counts_before)
        want[2] += int(torch.isnan(t).sum())
        want[3] += t.numel()
        assert counts.tolist() == want and want[2] > 0
    clean = torch.zeros(5, 7, dtype=dtype, device=device)
    counts = torch.zeros(4, dtype=torch.int64, device=device)
    emulation._count_unchanged(counts, clean)
    assert counts.tolist() == [0, 0, 0, 35]
    # every bit pattern's kind: NaNs of either sign and any payload, infinities, the largest
    # finite values (their bits beside the infinities')
    patterns = bit_patterns(4096, dtype).to(device)
    if dtype == torch.float64:  # (bit_patterns gives normals: add NaNs of both signs and payloads)
        words = patterns.view(torch.int64).clone()
        words[::7] = 0x7FF0000000000001
        words[1::7] = -0x0000000000000001  # (all ones: a negative NaN)
        patterns = words.view(torch.float64)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[patterns.element_size()]
    inf, big = torch.tensor([float("inf"), torch.finfo(dtype).max], dtype=dtype, device=device).view(ints)
    edges = torch.stack([inf, inf | torch.iinfo(ints).min, big, inf + 1])  # (inf, -inf, max, the first NaN)
    patterns = torch.cat([patterns, edges.view(dtype)])
    counts = torch.zeros(4, dtype=torch.int64, device=device)
    emulation._count_unchanged(counts, patterns)
    assert counts.tolist() == [0, 0, int(torch.isnan(patterns).sum()), patterns.numel()]
    assert int(torch.isnan(patterns).sum()) > 10 and int(torch.isinf(patterns).sum()) >= 2
