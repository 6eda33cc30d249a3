"""A model compiled with torch.compile inside lowfp.emulate: one graph per forward kind, no
recompiles from step to step, and the same steps as eager emulation (docs/design.md §6).

The comparisons use the ``aot_eager`` backend, which runs the captured graph with torch's eager
kernels: with it, compiled and eager emulation must agree bit for bit (weights, per-tensor
counts, promotions, loss scales). Inductor's own kernels may reorder reductions (batch norm,
layer norm), so with Inductor only a model without reductions is compared bit for bit."""

import contextlib
import copy

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

import lowfp
from lowfp import assign as A
from lowfp.experiments import models
from devices import DEVICES
from training import optimizer_step


def _image_batch(n=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def _token_batch(n=4, t=16, vocab=32):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab, (n, t), generator=g),
            torch.randint(0, vocab, (n, t), generator=g))


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


CASES = {  # model factory, batch
    "resnet": (lambda: models.ResidualCNN(1, 10, 0.5), _image_batch),
    "transformer": (lambda: models.TransformerClassifier(1, 10, 0.5, image_size=8, patch=2), _image_batch),
    "gpt": (lambda: models.GPT(32, 16, 32, 2, 2), _token_batch),
}


def _train(model, assignment, x, y, steps, compile_backend=None, scaler_scale=None, mode=None, **kw):
    """Emulated SGD steps; returns (history, weights, loss scales)."""
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scales = []
    with lowfp.emulate(model, assignment, **kw) as em:
        run = model if compile_backend is None else torch.compile(model, backend=compile_backend,
                                                                  mode=mode)
        scaler = None if scaler_scale is None else lowfp.DynamicLossScaler(init_scale=scaler_scale,
                                                                           emulator=em)
        for _ in range(steps):
            loss = _loss(run(x), y)
            optimizer_step(loss, opt, scaler)
            if scaler is not None:
                scales.append(scaler.get_scale())
            em.record(loss=loss.item())
    return em.history, [p.detach().clone() for p in model.parameters()], scales


def _assert_equal(tensors, others):
    assert len(tensors) == len(others)
    for t, o in zip(tensors, others):
        assert torch.equal(t, o)


def _graphs_after(fn):
    """fn's result and the number of graphs Dynamo compiled while it ran."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    out = fn()
    return out, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("name,rounding", [("resnet", "nearest"), ("transformer", "nearest"),
                                           ("gpt", "nearest"), ("gpt", "stochastic")])
def test_compiled_emulation_equals_eager_in_one_graph(name, rounding):
    make, batch = CASES[name]
    torch.manual_seed(0)
    base = make()
    x, y = batch()
    a = A.ours(A.trace(base, x, _loss, y), 0.5)
    eager_history, eager_weights, _ = _train(copy.deepcopy(base), a, x, y, 3, rounding=rounding)
    (history, weights, _), graphs = _graphs_after(
        lambda: _train(copy.deepcopy(base), a, x, y, 3, "aot_eager", rounding=rounding))
    # One graph for the training forward (its backward comes with it); the steps after the
    # first reuse it: nothing of the step (serials, counts, the history) is a constant of it.
    assert graphs == 1
    assert history.steps == eager_history.steps
    assert any(s["top_underflow"] for s in history.steps)  # the counts compared are not all empty
    _assert_equal(weights, eager_weights)


@pytest.mark.parametrize("fusion", ["auto", "1"])  # on the CPU: lowfp's kernel, then fused
def test_inductor_compiled_emulation_equals_eager(monkeypatch, fusion):
    monkeypatch.setenv("LOWFP_INDUCTOR_FUSION", fusion)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    a = A.ours(A.trace(base, x, _loss, y), 0.5)
    eager = _train(copy.deepcopy(base), a, x, y, 3)
    (history, weights, _), graphs = _graphs_after(
        lambda: _train(copy.deepcopy(base), a, x, y, 3, "inductor"))
    assert graphs == 1
    assert history.steps == eager[0].steps
    _assert_equal(weights, eager[1])


@pytest.mark.parametrize("device", DEVICES)
def test_reduce_overhead_compiled_emulation_equals_eager(device):
    """torch.compile(mode="reduce-overhead") inside the emulation (CUDA graphs on a GPU): the
    steps, counts and weights of eager emulation."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    x, y = torch.randn(32, 8, device=device), torch.randint(0, 4, (32,), device=device)
    a = A.ours(A.trace(base, x, _loss, y), 0.5)
    eager = _train(copy.deepcopy(base), a, x, y, 4)
    torch._dynamo.reset()
    compiled = _train(copy.deepcopy(base), a, x, y, 4, "inductor", mode="reduce-overhead")
    assert compiled[0].steps == eager[0].steps
    assert any(s["top_underflow"] for s in eager[0].steps)  # (the counts compared are not empty)
    _assert_equal(compiled[1], eager[1])


def _overflowing_mlp():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[0].weight.mul_(200.0)  # pre-activations far beyond fp(4,3,4)'s max of 30
    return model, torch.randn(64, 8), torch.randint(0, 4, (64,))


def test_promotion_recompiles_once_and_steps_as_eager():
    base, x, y = _overflowing_mlp()
    a = A.uniform(A.trace(base, x, _loss, y))
    eager_history, eager_weights, _ = _train(copy.deepcopy(base), a, x, y, 4)
    (history, weights, _), graphs = _graphs_after(
        lambda: _train(copy.deepcopy(base), a, x, y, 4, "aot_eager"))
    promoted_steps = {e["step"] for e in history.promotions}
    assert promoted_steps and "v:0:linear" in history.steps[0]["promotions"]
    # a promotion changes a format, a constant of the graph: one new graph per promoting step
    # read before the last forward (step s's counts are read when step s + 2 begins)
    assert graphs == 1 + len({s for s in promoted_steps if s + 2 <= 4})
    assert history.steps == eager_history.steps and history.promotions == eager_history.promotions
    _assert_equal(weights, eager_weights)


def test_compiled_plans_name_the_entries_rounders_and_count_rows():
    """A compiled forward reads each tensor's rounding from _graph_plans (rounder indices into
    one list, so that Dynamo guards a rounder's state once, and count-table rows); they name the
    eager entries' rounders and Stats rows, after a promotion too."""
    from lowfp.assign import grad_name
    base, x, y = _overflowing_mlp()
    a = A.uniform(A.trace(base, x, _loss, y))
    with lowfp.emulate(copy.deepcopy(base), a) as em:
        def check():
            assert set(em._graph_plans) == set(em._entries)
            for name, (f, f_row, b, b_row, marked) in em._graph_plans.items():
                fwd, fs, bwd, bs, *_, entry_marked = em._entries[name]
                assert (None if f < 0 else em._rounder_list[f]) is fwd
                assert (None if b < 0 else em._rounder_list[b]) is bwd
                assert fs.counts.data_ptr() == em.counts[f_row].data_ptr() and f_row == em._row[name]
                if bs is None:
                    assert b_row == -1
                else:
                    assert bs.counts.data_ptr() == em.counts[b_row].data_ptr()
                    assert b_row == em._row[grad_name(name)]
                assert marked == entry_marked
            assert len({id(r) for r in em._rounder_list}) == len(em._rounder_list)
        check()
        rounders = len(em._rounder_list)
        em._promote("v:0:linear", 1.0, 0)
        check()
        assert len(em._rounder_list) > rounders  # (the hi format's rounder, new)
        assert em._rounder_list[em._graph_plans["v:0:linear"][0]] is em._plan["v:0:linear"]


def test_loss_scaler_sees_the_compiled_backward_counts():
    torch.manual_seed(4)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    a = A.uniform(A.trace(base, x, _loss, y))
    # saturating gradients: only the counts, not the values, tell the scaler of the overflow
    eager = _train(copy.deepcopy(base), a, x, y, 4, scaler_scale=2.0 ** 24, backward_overflow="saturate")
    compiled = _train(copy.deepcopy(base), a, x, y, 4, "aot_eager", scaler_scale=2.0 ** 24,
                      backward_overflow="saturate")
    assert compiled[2] == eager[2] and compiled[2][0] == 2.0 ** 23  # backed off after step 1
    assert compiled[0].steps == eager[0].steps
    _assert_equal(compiled[1], eager[1])


def test_compiled_eval_forward_rounds_without_counting():
    torch.manual_seed(0)
    model = models.ResidualCNN(1, 10, 0.5)
    x, y = _image_batch()
    a = A.uniform(A.trace(model, x, _loss, y))
    model.eval()
    with lowfp.emulate(model, a) as em:
        with torch.no_grad():
            want = model(x)
            got = torch.compile(model, backend="aot_eager")(x)
        assert int(em.counts.sum()) == 0
    assert torch.equal(got, want)
    assert not torch.equal(got, model(x))  # the emulation rounded it


def test_an_observer_makes_the_compiled_forward_run_eagerly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    a = A.uniform(A.trace(model, x, _loss, y))
    seen = {}
    with lowfp.emulate(model, a) as em:
        em.observer = lambda name, t: seen.setdefault(name, t.detach().clone())
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        _loss(compiled(x), y).backward()
    assert set(seen) == set(a.trace.tensors)  # forward and backward tensors, all observed
    assert torch.equal(seen["theta:0.weight"], lowfp.quantize(model[0].weight.detach(), "fp(4,3,4)"))


def test_emulation_inside_a_compiled_training_step():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    a = A.ours(A.trace(base, x, _loss, y), 0.5)
    def train(compiled, emulated):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            loss = _loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

        run = torch.compile(step, backend="aot_eager") if compiled else step
        graphs = []
        with lowfp.emulate(model, a) if emulated else contextlib.nullcontext() as em:
            for _ in range(4):
                run()
                graphs.append(counters["stats"]["unique_graphs"])
        return (em.history.steps if emulated else None,
                [p.detach().clone() for p in model.parameters()]), graphs

    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    plain = [train(compiled, False)[0][1] for compiled in (False, True)]
    if not all(torch.equal(p, q) for p, q in zip(*plain)):
        pytest.skip(f"torch {torch.__version__}'s own compiled SGD step is not eager's bit for bit")
    torch._dynamo.reset()
    counters.clear()
    results = []
    for compiled in (False, True):
        result, graphs = train(compiled, True)
        results.append(result)
    # the graphs (split where torch splits a step: zero_grad, backward) are made in the first
    # step and reused
    assert graphs[0] > 0 and graphs[-1] == graphs[0]
    assert results[0][0] == results[1][0]
    _assert_equal(results[0][1], results[1][1])
