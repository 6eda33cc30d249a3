"""ExtraBits optimizers beside DistributedDataParallel (gloo on the CPU) and the seeds of their
stochastic rounding: replicas that must stay identical need the same seeds and the same extra
bits, and DDP's gradient hooks must not be cut off by the float32 conversion."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from lowfp.optim import ExtraBitsAdamW, ExtraBitsSGD, step_in_backward

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="this torch build has no gloo backend")

if os.path.exists("/sys/class/net/lo"):  # gloo on loopback, whatever the host name resolves to
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def loss_of(model, x):
    return model(x.to(next(model.parameters()).dtype)).float().square().mean()


def test_generator_draws_the_stochastic_seeds():
    """Seeds come from generator= (conversion and step), not from torch's global generator,
    which then decides nothing; a pickled optimizer carries its generator's state."""
    import pickle
    x = torch.randn(8, 16)

    def run(global_seed, gen_seed, steps=3):
        model = small_model()
        opt = ExtraBitsAdamW(model.parameters(), lr=1e-2, extra_bits=8, rounding="stochastic",
                             generator=None if gen_seed is None else torch.Generator().manual_seed(gen_seed))
        torch.manual_seed(global_seed)
        for _ in range(steps):
            opt.zero_grad()
            loss_of(model, x).backward()
            opt.step()
        return model, opt

    _, a = run(1, 7)
    _, b = run(2, 7)  # another global state: the same weights
    _, c = run(1, 8)  # another generator: other weights
    _, d = run(1, None)
    same = [torch.equal(u, v) for u, v in zip(a.master_weights(), b.master_weights())]
    assert all(same)
    assert not any(torch.equal(u, v) for u, v in zip(a.master_weights(), c.master_weights()))
    assert not any(torch.equal(u, v) for u, v in zip(a.master_weights(), d.master_weights()))
    model, opt = run(1, 7, steps=1)
    model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        loss_of(m, x).backward()
        o.step()
    assert all(torch.equal(u, v) for u, v in zip(opt.master_weights(), opt2.master_weights()))
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        ExtraBitsSGD(small_model().parameters(), generator=3)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_ddp_model_is_refused_before_its_hooks_are_cut_off(one_rank_group):
    """Converting a float32 parameter's dtype makes autograd replace its gradient accumulator,
    where DDP hooked its all-reduce: that parameter's gradients would never be averaged again.
    The optimizer refuses, converting nothing; built first, it works with DDP."""
    model = small_model()
    ddp = DDP(model)
    with pytest.raises(ValueError, match="DistributedDataParallel.*build the optimizer before"):
        ExtraBitsAdamW(ddp.parameters(), extra_bits=8)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model = small_model()
    opt = ExtraBitsAdamW(model.parameters(), extra_bits=8)
    ddp = DDP(model.to(torch.bfloat16))
    loss_of(ddp, torch.randn(8, 16)).backward()
    opt.step()
    # 16-bit parameters are not converted: a DDP model of them is fine in either order
    ddp16 = DDP(small_model().bfloat16())
    opt = ExtraBitsSGD(ddp16.parameters(), extra_bits=8)
    # Stepping inside backward would step before DDP's all-reduce: refused, model= or not.
    with pytest.raises(ValueError, match="DistributedDataParallel.*step normally with DDP"):
        step_in_backward(opt)
    plain = ExtraBitsSGD(small_model().bfloat16().parameters(), extra_bits=8)
    step_in_backward(plain).remove()


def test_a_graph_kept_alive_is_no_reason_to_refuse_outside_a_process_group():
    """Without a process group there is no DDP, and a graph that holds the accumulators is
    harmless: a loss kept from an earlier step (the usual loop variable), or even one not yet
    backwarded, whose backward then leaves a float32 gradient that the step converts."""
    assert not dist.is_initialized()
    model = small_model()
    x = torch.randn(8, 16)
    loss_of(model, x).backward()
    kept = loss_of(model, x)  # not backwarded yet
    old = loss_of(model, x)
    old.backward()  # backwarded, still referenced
    opt = ExtraBitsSGD(model.parameters(), lr=0.1, extra_bits=8)
    handle = step_in_backward(opt)
    handle.remove()
    model.zero_grad()
    kept.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    masters = [w.clone() for w in opt.master_weights()]
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(opt.master_weights(), masters))


def test_a_graph_kept_alive_inside_a_process_group_is_named_in_the_refusal(one_rank_group):
    model = small_model()
    loss = loss_of(model, torch.randn(8, 16))
    loss.backward()
    with pytest.raises(ValueError, match="a loss kept from an earlier step: del it first"):
        ExtraBitsSGD(model.parameters(), extra_bits=8)
    del loss
    with torch.no_grad():  # the check sees autograd's state even when built under no_grad
        ExtraBitsSGD(model.parameters(), extra_bits=8)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def _two_ranks(rank, path, results):
    """One replica: its own global seed (as data augmentation would have it), the float32
    weights every rank starts from, and a generator seeded alike on every rank."""
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        model = small_model(seed=0)
        reference = copy.deepcopy(model)
        opt = ExtraBitsAdamW(model.parameters(), lr=1e-2, extra_bits=8, rounding="stochastic",
                             generator=torch.Generator().manual_seed(5))
        ddp = DDP(model.to(torch.bfloat16))
        torch.manual_seed(100 + rank)
        xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(r)) for r in range(2)]
        loss_of(ddp, xs[rank]).backward()
        # the average of the two ranks' gradients, computed here in float32
        ref = reference.to(torch.bfloat16)
        per_rank = []
        for x in xs:
            ref.zero_grad()
            loss_of(ref, x).backward()
            per_rank.append([p.grad.float() for p in ref.parameters()])
        averaged = max(((a + b) / 2 - p.grad.float()).abs().max().item()
                       for a, b, p in zip(*per_rank, model.parameters()))
        opt.step()
        for _ in range(2):
            opt.zero_grad()
            loss_of(ddp, xs[rank]).backward()
            opt.step()
        # numpy arrays: torch tensors would be passed by a file descriptor of this process
        # the bfloat16 weights each replica computes with (stochastically rounded: these differ
        # when the seeds do) and the float32 masters (which the flag bits make the same anyway)
        weights = [p.detach().view(torch.int16) for p in model.parameters()] + opt.master_weights()
        results.put((rank, averaged, [w.numpy().copy() for w in weights]))
        results.close()
        results.join_thread()  # delivered before the exit below
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown, where gloo can hang or abort in torch 2.13
    # (tests/test_dtensor.py).
    os._exit(0)


def test_two_replicas_stay_identical_with_stochastic_rounding(tmp_path):
    """Two gloo ranks with different global seeds: DDP averages the bfloat16 gradients, and
    the optimizer (built before DDP, with a shared generator) keeps both replicas' bfloat16
    weights and float32 masters equal, bit for bit, through stochastic rounding."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = mp.start_processes(_two_ranks, args=(str(tmp_path / "pg"), results), nprocs=2,
                               start_method="spawn", join=False)
    got = dict((rank, (averaged, weights)) for rank, averaged, weights in
               (results.get(timeout=120) for _ in range(2)))
    for proc in ranks.processes:  # a rank that cannot end fails the test instead of hanging it
        proc.join(60)
        assert proc.exitcode == 0, proc.exitcode
    for rank in (0, 1):
        # the bfloat16 rounding of the mean (half a bfloat16 ulp of |g| < 4), not one rank's own
        assert got[rank][0] <= 2.0 ** -8, got[rank][0]
    assert all((a.view('int16') == b.view('int16')).all() for a, b in zip(got[0][1], got[1][1]))
