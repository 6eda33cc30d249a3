"""Recording a training step and the precision assignments of docs/design.md §6, checked against sizes,
groups and ratios worked out by hand."""

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lowfp
import lowfp.experiments.models
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
    # a GEMM's parameters join the group of its input activation (the paper's code)
    groups = tr.groups()
    assert sorted(groups[0]) == sorted(["v:input[0]", "theta:0.weight", "theta:0.bias"])
    assert sorted(groups[1]) == sorted(["v:0:linear", "dv:0:linear", "v:1:relu", "dv:1:relu",
                                        "theta:2.weight", "theta:2.bias"])
    assert sorted(groups[2]) == sorted(["v:2:linear", "dv:2:linear"])
    # weight gradients join their parameters' groups only when asked
    assert "dtheta:0.weight" in tr.groups(weight_grads=True)[0]


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
    # groups: 0 -> 256+128+16 = 400, 1 -> 4*512+64+4 = 2116, 2 -> 2*128 = 256
    o = A.ours(tr, 0.5)
    assert o.demoted_groups == [1] and o.ratio_lo == pytest.approx(2116 / 2984)
    o = A.ours(tr, 0.8)
    assert o.demoted_groups == [1, 0] and o.ratio_lo == pytest.approx((2116 + 400) / 2984)
    o = A.ours(tr, 0.1, order="increasing")
    assert o.demoted_groups == [2, 0] and o.ratio_lo == pytest.approx((256 + 400) / 2984)


def test_op_and_op_io_by_definition():
    torch.manual_seed(0)
    model = mlp(8, 16, 16, 4)  # GEMMs: 0:linear, 2:linear, 4:linear; only the middle one counts
    tr = A.trace(model, torch.randn(8, 8), F.cross_entropy, torch.randint(0, 4, (8,)))
    assert [tr.ops[i].key for i in tr.gemms] == ["0:linear", "2:linear", "4:linear"]
    op_lo = {"v:1:relu", "theta:2.weight", "theta:2.bias", "dv:2:linear"}
    assert A.op(tr).lo == op_lo
    io_lo = op_lo | {"v:2:linear", "dv:1:relu"}  # dtheta_2 stays hi, as in every strategy
    assert A.op_io(tr).lo == io_lo
    assert A.op_io(tr, A.Candidates(weight_grads_lo=True)).lo == \
        io_lo | {"dtheta:2.weight", "dtheta:2.bias"}
    # lo tensors get the lo candidate of their direction, everything else hi
    a = A.op_io(tr)
    for n, f in a.formats.items():
        want = (lowfp.fp(4, 3, 4) if A.role_of(n) in ("v", "theta") else lowfp.fp(5, 2, 0)) \
            if n in a.lo else lowfp.fp(6, 9, 0)
        assert f == want, n


def test_weight_gradients_stay_hi_in_every_strategy_unless_asked():
    """A model whose weight gradients dominate TS (wide layers, batch 2): no strategy demotes a
    dtheta by default, so op_io's ratio cannot pass uniform's; weight_grads_lo=True demotes them
    in every strategy that demotes their theta."""
    torch.manual_seed(0)
    model = mlp(256, 256, 256, 256, 8)
    tr = A.trace(model, torch.randn(2, 256), F.cross_entropy, torch.randint(0, 8, (2,)))
    dtheta = sum(t.numel for t in tr.tensors.values() if t.role == "dtheta")
    assert dtheta > 0.4 * tr.total_numel
    strategies = [A.uniform, A.op, A.op_io] + [lambda t, c=None, r=r: A.ours(t, r, candidates=c)
                                               for r in (0.2, 0.4, 0.5, 0.7)]
    wide = A.Candidates(weight_grads_lo=True)
    for i, strategy in enumerate(strategies):
        a = strategy(tr)
        assert not any(A.role_of(n) == "dtheta" for n in a.lo), a.name
        assert all(a[n] == lowfp.fp(6, 9, 0) for n in tr.names("dtheta")), a.name
        assert a.ratio_lo <= A.uniform(tr).ratio_lo + 1e-12, a.name
        w = strategy(tr, wide)
        if i < 3:  # (ours demotes other groups once dtheta counts in their sizes)
            assert a.lo <= w.lo and w.lo - a.lo <= set(tr.names("dtheta")), a.name
        for n in w.lo:  # with weight_grads_lo a dtheta is lo only with its theta
            if A.role_of(n) == "dtheta":
                assert "theta:" + n.split(":", 1)[1] in w.lo, (w.name, n)
        assert any(A.role_of(n) == "dtheta" for n in w.lo) == (strategy is not A.op), w.name
    assert A.op_io(tr, wide).ratio_lo > A.op_io(tr).ratio_lo
    assert A.uniform(tr, wide).ratio_lo == 1.0


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
            y = torch.matmul(z[:, :6], self.w.t())  # a part of z (a partition); w through a view
            return F.linear(y, self.w).sum(1)

    torch.manual_seed(0)
    tr = A.trace(Net(), torch.randn(5, 6))
    keys = [(o.key, o.is_gemm, o.inputs) for o in tr.ops]
    assert keys == [("a:linear", True, ("v:input[0]", "theta:a.weight", "theta:a.bias")),
                    ("add", False, ("v:a:linear", "v:input[0]")),
                    ("cat", False, ("v:add", "v:input[0]")),
                    ("__getitem__", False, ("v:cat",)),
                    ("matmul", True, ("v:__getitem__", "theta:w")),
                    ("linear", True, ("v:matmul", "theta:w")),
                    ("sum", False, ("v:linear",))]
    assert tr.tensors["v:cat"].numel == 60 and tr.tensors["theta:w"].numel == 36
    assert "dv:input[0]" not in tr.tensors and "dtheta:w" in tr.tensors
    # w is first used by the second GEMM, which reads a part of cat's output (group 1): group 1
    assert tr.tensors["theta:w"].group == 1 and tr.tensors["v:sum"].group == 3


def test_ours_endpoints_monotone_and_orders():
    model = lowfp.experiments.models.ResidualCNN(1, 10, 0.5)
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
    model = lowfp.experiments.models.ResidualCNN(1, 10, 0.5)
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
    assert all("forward" not in m.__dict__ for m in model.modules())  # (submodules' too)
    assert not hasattr(x, "_lowfp_ts")


class _CallsForwardDirectly(torch.nn.Module):
    """A block whose submodules run through nn.Module.__call__, through .forward, and one with an
    instance forward of the user's own."""

    def __init__(self):
        super().__init__()
        self.inner, self.direct, self.own = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.own.forward = lambda x: torch.tanh(torch.nn.Linear.forward(self.own, x))

    def forward(self, x):
        return self.own(self.direct.forward(self.inner(x)))


def test_operators_are_named_by_the_submodule_whose_forward_runs():
    """An operator's name holds the innermost submodule whose forward runs, called as module(x)
    or module.forward(x); a user's own instance forward is kept and put back."""
    model = _CallsForwardDirectly()
    own = model.own.forward
    tr = A.trace(model, torch.randn(3, 4), lambda out: out.sum())
    assert [o.key for o in tr.ops] == ["inner:linear", "direct:linear", "own:linear", "own:tanh"]
    assert model.own.forward is own and "forward" not in model.inner.__dict__


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


# -- partitioning calls (docs/design.md §6) -------------------------------------------------------
class _ShuffleV2Unit(nn.Module):
    """ShuffleNet-v2's basic unit: half the channels bypass the three convolutions to the
    concatenation. ``split`` picks chunk, split, tensor_split, narrow, or slices of a strict part
    of the channels, cloned as the assignment paper's ``SplitHalf`` does (an operator of one
    output each)."""

    def __init__(self, c, split):
        super().__init__()
        h = c // 2
        self.split = split
        self.conv1, self.bn1 = nn.Conv2d(h, h, 1, bias=False), nn.BatchNorm2d(h)
        self.conv2, self.bn2 = nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False), nn.BatchNorm2d(h)
        self.conv3, self.bn3 = nn.Conv2d(h, h, 1, bias=False), nn.BatchNorm2d(h)

    def forward(self, x):
        c = x.shape[1] // 2
        if self.split == "chunk":
            x1, x2 = x.chunk(2, dim=1)
        elif self.split == "split":
            x1, x2 = torch.split(x, [c, c], dim=1)
        elif self.split == "tensor_split":
            x1, x2 = x.tensor_split(2, dim=1)
        elif self.split == "narrow":
            x1, x2 = x.narrow(1, 0, c), torch.narrow(x, 1, c, c)
        else:
            x1, x2 = x[:, :c].clone(), x[:, c:].clone()
        out = F.relu(self.bn1(self.conv1(x2)))
        out = self.bn2(self.conv2(out))
        out = F.relu(self.bn3(self.conv3(out)))
        out = torch.cat([x1, out], 1)
        n, c, h, w = out.shape
        return out.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)  # channel shuffle


class _ShuffleNet(nn.Module):
    def __init__(self, split):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.unit = _ShuffleV2Unit(8, split)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.unit(self.stem(x)).mean((2, 3)))


def _shufflenet_trace(split):
    torch.manual_seed(0)
    return A.trace(_ShuffleNet(split), torch.randn(2, 1, 4, 4), F.cross_entropy, torch.tensor([0, 2]))


@pytest.mark.parametrize("split, halves", [("chunk", ("v:unit:chunk[0]", "v:unit:chunk[1]")),
                                           ("slices", ("v:unit:__getitem__", "v:unit:__getitem__#1"))])
def test_shufflenet_unit_op_ratio_counted_by_hand(split, halves):
    """N=2, 8 channels of 4x4 after the stem; the unit's halves are 2x4x4x4 = 128 elements.
    op demotes the inputs, weights and output gradients of the three inner convolutions: the
    split's second half (128, not the whole 256-element stem output), conv1/2/3's weights
    (16 + 36 + 16), relu's and bn2's outputs (128 each), three output gradients (128 each).
    Slicing a strict part of the channels (and cloning it) is a partition as chunk is."""
    tr = _shufflenet_trace(split)
    v = 32 + 256 + 2 * 128 + 8 * 128 + 256 + 16 + 6  # input, stem, halves, unit, cat, mean, fc
    dv = v - 32                                       # the model input has no gradient
    theta = 72 + 16 + 8 + 36 + 8 + 16 + 8 + 24 + 3    # stem, conv1, bn1, conv2, bn2, conv3, bn3, fc
    assert tr.total_numel == v + dv + 2 * theta == 4042
    a = A.op(tr)
    assert a.lo == {halves[1], "theta:unit.conv1.weight", "dv:unit.conv1:conv2d",
                    "v:unit:relu", "theta:unit.conv2.weight", "dv:unit.conv2:conv2d",
                    "v:unit.bn2:batch_norm", "theta:unit.conv3.weight", "dv:unit.conv3:conv2d"}
    assert a.ratio_lo == (6 * 128 + 16 + 36 + 16) / 4042
    # the bypassing half is an operator output of its own, in the stem's group, and stays hi
    assert tr.tensors[halves[0]].numel == 128 and a[halves[0]] == lowfp.fp(6, 9, 0)


@pytest.mark.parametrize("split", ["chunk", "split", "tensor_split", "narrow"])
def test_partitioning_calls_count_as_explicit_slices(split):
    """Splitting with a partitioning call or with slices gives the same tensors of TS, so every
    strategy gives the same ratio and aggregate."""
    tr, ref = _shufflenet_trace(split), _shufflenet_trace("slices")
    assert len(tr.tensors) == len(ref.tensors) and tr.total_numel == ref.total_numel
    strategies = {"fp32": A.fp32, "all_hi": A.all_hi, "uniform": A.uniform, "op": A.op,
                  "op_io": A.op_io}
    strategies.update({f"ours({r})": (lambda t, r=r: A.ours(t, r)) for r in (0.4, 0.5, 0.7)})
    for name, strategy in strategies.items():
        a, b = strategy(tr), strategy(ref)
        assert (a.ratio_lo, a.aggregate_bits) == (b.ratio_lo, b.aggregate_bits), (split, name)
        assert sorted(tr.tensors[n].numel for n in a.lo) == \
            sorted(ref.tensors[n].numel for n in b.lo), (split, name)


def test_partitioned_parts_are_rounded_on_their_own_in_emulation():
    """Under emulation each part takes its own format: op_io keeps the bypassing half hi while
    the half feeding conv1 is lo, and the chunked model trains bit for bit like the sliced one."""
    torch.manual_seed(0)
    chunked = _ShuffleNet("chunk")
    sliced = _ShuffleNet("slices")
    sliced.load_state_dict(chunked.state_dict())
    x, y = torch.randn(4, 1, 4, 4), torch.tensor([0, 2, 1, 1])
    results = []
    for model in (chunked, sliced):
        tr = A.trace(model, x, F.cross_entropy, y)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with lowfp.emulate(model, A.op_io(tr)):
            for _ in range(3):
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
        results.append([p.detach().clone() for p in model.parameters()] + [loss.detach()])
    for p, q in zip(*results):
        assert torch.equal(p, q)


def test_slices_of_a_strict_part_are_partitions_and_the_rest_views():
    """x[:, :c] and x[..., a:b] make tensors of their own; a full-range slice, an integer index,
    view, transpose, contiguous and clone of the whole tensor are the tensor they come from."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, x):
            h = self.fc(x)                                    # v:fc:linear, 4 x 6
            same = h[:, :].contiguous().t().t().view(4, 6).clone()
            part = h[..., 1:4]                                # 4 x 3: a tensor of its own
            first = h[:, 0]                                   # an integer index: a view
            return same.sum() + part.sum() + first.sum()
    tr = A.trace(M(), torch.randn(4, 6))
    getitems = [n for n in tr.tensors if "__getitem__" in n]
    assert getitems == ["v:__getitem__", "dv:__getitem__"]
    assert tr.tensors["v:__getitem__"].numel == 12


def test_a_list_of_slices_cuts_as_a_tuple_does():
    # the assignment paper's SplitHalf indexes with a list of slices (torch reads it as a tuple)
    from lowfp._intercept import cuts
    x = torch.zeros(2, 8, 3)
    assert cuts(x, [slice(None), slice(None, 4), slice(None)]) and cuts(x, (slice(None), slice(4, None)))
    assert not cuts(x, [slice(None), slice(None), slice(None)]) and not cuts(x, [0, 1])


def test_a_slices_length_is_pythons():
    # cuts measures a slice by plain arithmetic (Dynamo traces it on every torch): the length
    # range(*s.indices(size)) gives, for every bound and step near and past a dim's ends
    import itertools

    from lowfp._intercept import slice_length
    bounds = [None] + list(range(-9, 10))
    for size in range(7):
        for start, stop, step in itertools.product(bounds, bounds, [None, 1, 2, 3, 7, -1, -2, -3, -7]):
            s = slice(start, stop, step)
            assert slice_length(s, size) == len(range(*s.indices(size))), (s, size)
