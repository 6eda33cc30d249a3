"""Recording a training step and the precision assignments of DESIGN §6, checked against sizes,
groups and ratios worked out by hand."""

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lowfp
from lowfp import assign as A


def mlp(*widths, seed=0):
    torch.manual_seed(seed)
    layers = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def mlp_trace(batch=32):
    model = mlp(8, 16, 4)
    x, y = torch.randn(batch, 8), torch.randint(0, 4, (batch,))
    return model, A.trace(model, x, F.cross_entropy, y)


def test_mlp_tensors_sizes_and_groups_by_hand():
    _, tr = mlp_trace()
    # batch 32: input 32x8 (no gradient: it does not require grad); Linear(8,16) weight 128, bias
    # 16, output 32x16; ReLU 32x16; Linear(16,4) weight 64, bias 4, output 32x4.
    expect = {"v:input[0]": 256,
              "theta:0.weight": 128, "dtheta:0.weight": 128, "theta:0.bias": 16, "dtheta:0.bias": 16,
              "v:0:linear": 512, "dv:0:linear": 512, "v:1:relu": 512, "dv:1:relu": 512,
              "theta:2.weight": 64, "dtheta:2.weight": 64, "theta:2.bias": 4, "dtheta:2.bias": 4,
              "v:2:linear": 128, "dv:2:linear": 128}
    assert {n: t.numel for n, t in tr.tensors.items()} == expect
    assert tr.total_numel == 2984
    assert [(o.key, o.is_gemm) for o in tr.ops] == [("0:linear", True), ("1:relu", False),
                                                     ("2:linear", True)]
    assert tr.gemms == [0, 2]
    groups = tr.groups()
    assert sorted(groups[0]) == ["v:input[0]"]
    assert sorted(groups[1]) == sorted(["theta:0.weight", "theta:0.bias", "v:0:linear", "dv:0:linear",
                                        "v:1:relu", "dv:1:relu"])
    assert sorted(groups[2]) == sorted(["theta:2.weight", "theta:2.bias", "v:2:linear", "dv:2:linear"])
    # weight gradients join their parameters' groups only when asked
    assert "dtheta:0.weight" in tr.groups(weight_grads=True)[1]


def test_mlp_ratios_and_aggregate_by_hand():
    _, tr = mlp_trace()
    hi_bits, lo_bits = 16, 8  # fp(6,9,0) = 1+6+9; fp(4,3,4), fp(5,2,0) = 8 bits
    a = A.all_hi(tr)
    assert a.ratio_lo == 0 and a.aggregate_bits == 2984 * hi_bits
    u = A.uniform(tr)
    dtheta = 128 + 16 + 64 + 4
    assert u.ratio_lo == pytest.approx((2984 - dtheta) / 2984, rel=1e-15)
    assert u.aggregate_bits == (2984 - dtheta) * lo_bits + dtheta * hi_bits
    assert A.fp32(tr).aggregate_bits == 2984 * 32 and A.fp32(tr).ratio_lo == 0
    assert u["v:0:linear"] == lowfp.fp(4, 3, 4) and u["theta:0.weight"] == lowfp.fp(4, 3, 4)
    assert u["dv:0:linear"] == lowfp.fp(5, 2, 0) and u["dtheta:0.weight"] == lowfp.fp(6, 9, 0)
    # groups: 0 -> 256, 1 -> 128+16+4*512 = 2192, 2 -> 64+4+2*128 = 324
    o = A.ours(tr, 0.5)
    assert o.demoted_groups == [1] and o.ratio_lo == pytest.approx(2192 / 2984)
    o = A.ours(tr, 0.8)
    assert o.demoted_groups == [1, 2] and o.ratio_lo == pytest.approx((2192 + 324) / 2984)
    o = A.ours(tr, 0.1, order="increasing")
    assert o.demoted_groups == [0, 2] and o.ratio_lo == pytest.approx((256 + 324) / 2984)


def test_op_and_op_io_by_definition():
    torch.manual_seed(0)
    model = mlp(8, 16, 16, 4)  # GEMMs: 0:linear, 2:linear, 4:linear; only the middle one counts
    tr = A.trace(model, torch.randn(8, 8), F.cross_entropy, torch.randint(0, 4, (8,)))
    assert [tr.ops[i].key for i in tr.gemms] == ["0:linear", "2:linear", "4:linear"]
    op_lo = {"v:1:relu", "theta:2.weight", "theta:2.bias", "dv:2:linear"}
    assert A.op(tr).lo == op_lo
    assert A.op_io(tr).lo == op_lo | {"v:2:linear", "dv:1:relu", "dtheta:2.weight", "dtheta:2.bias"}
    # lo tensors get the lo candidate of their direction, everything else hi
    a = A.op_io(tr)
    for n, f in a.formats.items():
        want = (lowfp.fp(4, 3, 4) if A.role_of(n) in ("v", "theta") else lowfp.fp(5, 2, 0)) \
            if n in a.lo else lowfp.fp(6, 9, 0)
        assert f == want, n


def test_functional_graph_residual_cat_matmul():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 6)
            self.w = nn.Parameter(torch.randn(6, 6))

        def forward(self, x):
            h = self.a(x)
            h = h + x                       # residual through an operator on the model input
            z = torch.cat([h, x], dim=1)    # (n, 12)
            y = torch.matmul(z[:, :6], self.w.t())  # the parameter through a view
            return F.linear(y, self.w).sum(1)

    torch.manual_seed(0)
    tr = A.trace(Net(), torch.randn(5, 6))
    keys = [(o.key, o.is_gemm, o.inputs) for o in tr.ops]
    assert keys == [("a:linear", True, ("v:input[0]", "theta:a.weight", "theta:a.bias")),
                    ("add", False, ("v:a:linear", "v:input[0]")),
                    ("cat", False, ("v:add", "v:input[0]")),
                    ("matmul", True, ("v:cat", "theta:w")),
                    ("linear", True, ("v:matmul", "theta:w")),
                    ("sum", False, ("v:linear",))]
    assert tr.tensors["v:cat"].numel == 60 and tr.tensors["theta:w"].numel == 36
    assert "dv:input[0]" not in tr.tensors and "dtheta:w" in tr.tensors
    # w is first used by the second GEMM: its group is 2
    assert tr.tensors["theta:w"].group == 2 and tr.tensors["v:sum"].group == 3


def test_ours_endpoints_monotone_and_orders():
    model = lowfp.models.ResidualCNN(1, 10, 0.5)
    tr = A.trace(model, torch.randn(4, 1, 8, 8), F.cross_entropy, torch.randint(0, 10, (4,)))
    assert A.ours(tr, 0).formats == A.all_hi(tr).formats
    assert A.ours(tr, 1).formats == A.uniform(tr).formats
    groups = tr.groups()
    sizes = [sum(tr.tensors[n].numel for n in g) for g in groups]
    nonempty = [i for i, g in enumerate(groups) if g]
    for order, seed in (("decreasing", None), ("increasing", None), ("random", 3)):
        prev = -1.0
        for r in [i / 20 for i in range(21)]:
            a = A.ours(tr, r, order=order, seed=seed)
            assert a.ratio_lo >= prev and a.ratio_lo >= r - 1e-12 or len(a.demoted_groups) == len(nonempty)
            prev = a.ratio_lo
        full = A.ours(tr, 1, order=order, seed=seed).demoted_groups
        assert sorted(full) == nonempty
        if order == "decreasing":
            assert [sizes[i] for i in full] == sorted((sizes[i] for i in full), reverse=True)
        elif order == "increasing":
            assert [sizes[i] for i in full] == sorted(sizes[i] for i in full)
        else:
            assert full == A.ours(tr, 1, order="random", seed=3).demoted_groups
            assert full != A.ours(tr, 1, order="decreasing").demoted_groups
        # every prefix of the sequence: the tensors demoted are exactly those groups
        a = A.ours(tr, 0.3, order=order, seed=seed)
        assert a.lo == {n for g in a.demoted_groups for n in groups[g]}
        k = len(a.demoted_groups)
        assert a.demoted_groups == full[:k]
        before = sum(sizes[i] for i in full[:k - 1]) / tr.total_numel
        assert before < 0.3 <= a.ratio_lo


def test_candidates_s2fp8_weight_grads_and_json(tmp_path):
    _, tr = mlp_trace()
    c = A.Candidates(hi="bfloat16", lo_forward=lowfp.S2FP8(), lo_backward="float8_e5m2",
                     weight_grads_lo=True)
    u = A.uniform(tr, candidates=c)
    assert u.ratio_lo == 1.0 and u["v:1:relu"] == lowfp.S2FP8() and u["dtheta:0.bias"] == lowfp.formats.float8_e5m2
    assert u.aggregate_bits == 2984 * 8
    path = tmp_path / "a.json"
    o = A.ours(tr, 0.6, candidates=c)
    o.save(path)
    back = A.Assignment.load(path)
    assert back.formats == o.formats and back.lo == o.lo and back.name == o.name
    assert back.ratio_lo == o.ratio_lo and back.aggregate_bits == o.aggregate_bits
    assert back.candidates == c and back.trace.to_dict() == tr.to_dict()
    assert json.loads(o.to_json())["ratio_lo"] == o.ratio_lo
    text = str(o)
    assert "ratio_lo" in text and "S2FP8" in text and "0:linear" in text


def test_malformed_saved_assignments_are_value_errors():
    _, tr = mlp_trace()
    good = A.uniform(tr).to_dict()
    with pytest.raises(ValueError, match=r"not what Assignment.to_dict\(\) returns: KeyError: 'trace'"):
        A.Assignment.from_dict({k: v for k, v in good.items() if k != "trace"})
    with pytest.raises(ValueError, match=r"not what Trace.to_dict\(\) returns: KeyError: 'ops'"):
        A.Trace.from_dict({"tensors": []})
    with pytest.raises(ValueError, match="not what Assignment.to_dict"):
        A.Assignment.from_dict({**good, "candidates": {"hi": 3}})
    with pytest.raises(ValueError, match=r"unknown: \['v:99:nothing'\]"):
        A.Assignment.from_dict({**good, "lo": good["lo"] + ["v:99:nothing"]})
    with pytest.raises(ValueError, match="unknown"):
        A.Assignment(tr, {**{n: None for n in tr.tensors}, "theta:x": None}, (), "x")


def test_trace_leaves_the_model_as_it_was():
    model = lowfp.models.ResidualCNN(1, 10, 0.5)
    model.train()
    x = torch.randn(4, 1, 8, 8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    y = torch.randint(0, 10, (4,))
    rng = torch.get_rng_state()
    A.trace(model, x, F.cross_entropy, y)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(torch.all(p.grad == 7.0) for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert "forward" not in model.__dict__ and model.training
    assert not hasattr(x, "_lowfp_ts")


def test_errors():
    model, tr = mlp_trace()
    with pytest.raises(ValueError, match="r must be"):
        A.ours(tr, 1.5)
    with pytest.raises(ValueError, match="order must be"):
        A.ours(tr, 0.5, order="largest")
    with pytest.raises(ValueError, match="strategy must be"):
        A.make(tr, "mixed")
    with pytest.raises(TypeError, match="trace must be"):
        A.uniform(model)
    with pytest.raises(TypeError, match="model must be"):
        A.trace(lambda x: x, torch.randn(2))
    with pytest.raises(TypeError, match="candidates must be"):
        A.uniform(tr, candidates={"hi": "bfloat16"})
    with pytest.raises(ValueError, match="lo_forward"):
        A.Candidates(lo_forward="fp(4,3")
    with pytest.raises(ValueError, match="another model"):
        lowfp.emulate(mlp(8, 5, 4), A.uniform(tr))
    assert A.make(tr, "ours", r=0.5).formats == A.ours(tr, 0.5).formats
    assert math.isclose(A.make(tr, "uniform").ratio_lo, A.uniform(tr).ratio_lo)
