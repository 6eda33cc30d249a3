"""The ExtraBits optimizers over FSDP2 (fully_shard) on two gloo ranks (CPU): each rank steps its
shards, and training equals a single-process run bit for bit (deterministic and stochastic
rounding); state_dict and torch.distributed.checkpoint round-trip exactly; lowfp.emulate and
DynamicLossScaler work on the sharded model."""

import contextlib
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import lowfp
from lowfp.optim import ExtraBitsAdamW, ExtraBitsSGD, step_in_backward
from training import optimizer_step

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="this torch build has no gloo backend")

if os.path.exists("/sys/class/net/lo"):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _model():
    # Odd sizes: rank 1's shards of the (13, 7) weight and of the biases start inside a Philox
    # block (element 49, 7 and 3), and the last rank's shard of the 5-row weight is shorter.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5),
                               torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(torch.bfloat16)


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)  # every rank takes the same batch
    return torch.randn(8, 7, generator=g).to(torch.bfloat16), torch.randint(0, 3, (8,), generator=g)


def _train(model, opt, steps, first=0, scaler=None):
    for step in range(first, first + steps):
        x, y = _batch(step)
        optimizer_step(F.cross_entropy(model(x).float(), y), opt, scaler)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _assert_same(sharded_model, plain_model, sharded_opt, plain_opt, what):
    for (name, p), q in zip(sharded_model.named_parameters(), plain_model.parameters()):
        assert torch.equal(_full(p).view(torch.int16), q.view(torch.int16)), (what, name)
    for w, v in zip(sharded_opt.master_weights(), plain_opt.master_weights()):
        assert torch.equal(_full(w), v), what


def _optimizers(rounding):
    return [lambda ps: ExtraBitsAdamW(ps, lr=0.05, extra_bits=8, rounding=rounding,
                                      generator=torch.Generator().manual_seed(7)),
            lambda ps: ExtraBitsSGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3, extra_bits=5,
                                    rounding=rounding, generator=torch.Generator().manual_seed(7))]


@contextlib.contextmanager
def _reporting(rank, errors):
    """A rank's body: its traceback, or None once it finished, goes to the parent through
    ``errors``; the process group ends either way."""
    try:
        yield
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()
    errors.put((rank, None))


def _check_rank(rank, world, init_file, ckpt_dir, errors):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with _reporting(rank, errors):
        mesh = init_device_mesh("cpu", (world,))
        for rounding in ("nearest", "stochastic"):
            for make in _optimizers(rounding):
                plain = _model()
                sharded = _shard(_model(), mesh)
                plain_opt, opt = make(plain.parameters()), make(sharded.parameters())
                _train(plain, plain_opt, 3)
                _train(sharded, opt, 3)
                what = (rounding, type(opt).__name__)
                _assert_same(sharded, plain, opt, plain_opt, what)
                # The packed state holds this rank's shards only.
                p = next(sharded.parameters())
                assert isinstance(opt.state[p]["exp_avg" if "Adam" in what[1] else
                                              "momentum_buffer"], DTensor)
                assert opt.state[p]["extra"].numel() == lowfp.extra_bits.packed_words(
                    p.to_local().numel(), opt.param_groups[0]["extra_bits"], rounding)

                # state_dict: extra bits saved per element, placed like the parameter.
                sd = opt.state_dict()
                assert isinstance(sd["state"][0]["extra_values"], DTensor)
                assert sd["state"][0]["extra_values"].placements == (Shard(0),)
                fresh = make(sharded.parameters())
                fresh.load_state_dict(sd)
                for q in sharded.parameters():
                    assert torch.equal(fresh.state[q]["extra"], opt.state[q]["extra"]), what
                # A state_dict of the single-process optimizer loads into the sharded one too.
                fresh.load_state_dict(plain_opt.state_dict())
                for q in sharded.parameters():
                    assert torch.equal(fresh.state[q]["extra"], opt.state[q]["extra"]), what

                # torch.distributed.checkpoint: save, load into a new model and optimizer, go on.
                model_sd, optim_sd = get_state_dict(sharded, opt)
                path = os.path.join(ckpt_dir, f"{rounding}-{what[1]}")
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
                restored = _shard(_model(), mesh)
                restored_opt = make(restored.parameters())
                r_model_sd, r_optim_sd = get_state_dict(restored, restored_opt)
                state = {"model": r_model_sd, "optim": r_optim_sd}
                dcp.load(state, checkpoint_id=path)
                set_state_dict(restored, restored_opt, model_state_dict=state["model"],
                               optim_state_dict=state["optim"])
                _assert_same(restored, plain, restored_opt, plain_opt, what + ("dcp",))
                if rank == 0:  # for the reload on one rank (test_checkpoint_reshards_to_one_rank)
                    torch.save([[q.detach() for q in plain.parameters()],
                                plain_opt.master_weights()], path + ".want")
                # two more steps as the uninterrupted run: the generator's state came back with
                # the optimizer's (the fresh one's had drawn nothing, or once for DCP's state init)
                _train(plain, plain_opt, 2, first=3)
                _train(restored, restored_opt, 2, first=3)
                _assert_same(restored, plain, restored_opt, plain_opt, what + ("after dcp",))
                if rank == 0:
                    torch.save([[q.detach() for q in plain.parameters()],
                                plain_opt.master_weights()], path + ".want-after")

        # Other placements (tensor parallel's Shard(1)) step with deterministic rounding; their
        # shards are not runs of the global order, so stochastic rounding is refused.
        from torch.distributed.tensor import distribute_tensor
        full = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).bfloat16()
        grad = torch.randn(4, 6, generator=torch.Generator().manual_seed(2)).bfloat16()
        column = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(1)]))
        single = torch.nn.Parameter(full.clone())
        opts = [ExtraBitsSGD([q], lr=0.1, momentum=0.9, extra_bits=4) for q in (column, single)]
        column.grad, single.grad = distribute_tensor(grad, mesh, [Shard(1)]), grad.clone()
        for opt in opts:
            opt.step()
        assert torch.equal(column.full_tensor().view(torch.int16), single.view(torch.int16))
        try:
            ExtraBitsSGD([column], lr=0.1, rounding="stochastic")
            raise AssertionError("stochastic rounding of Shard(1) parameters was not refused")
        except ValueError as err:
            assert "one run of the row-major order" in str(err)

        # Stepping inside backward is refused with its reason.
        sharded = _shard(_model(), mesh)
        try:
            step_in_backward(ExtraBitsAdamW(sharded.parameters()))
            raise AssertionError("step_in_backward over FSDP2 was not refused")
        except ValueError as err:
            assert "reduce-scatter" in str(err)
        # float32 FSDP2 parameters cannot be converted in place: refused, saying what to do.
        try:
            ExtraBitsAdamW(_shard(_model().float(), mesh).parameters())
            raise AssertionError("float32 DTensor parameters were not refused")
        except TypeError as err:
            assert "before sharding" in str(err)

        # lowfp.emulate and DynamicLossScaler on the sharded model, against the same unsharded.
        x, y = _batch(0)
        plain = _model()
        tr = lowfp.assign.trace(plain, x, lambda out, t: F.cross_entropy(out.float(), t), y)
        a = lowfp.assign.ours(tr, r=0.5, candidates=lowfp.assign.Candidates(hi="fp(5,6,0)"))
        sharded = _shard(_model(), mesh)
        results = []
        for model in (plain, sharded):
            opt = _optimizers("stochastic")[0](model.parameters())
            with lowfp.emulate(model, a, rounding="stochastic") as em:
                # the first step's scaled gradients overflow fp(5,2,0); then 2^12 fits
                scaler = lowfp.DynamicLossScaler(init_scale=2.0 ** 20, backoff_factor=2.0 ** -8,
                                                 emulator=em)
                torch.manual_seed(3)  # emulate's stochastic keys come from torch's generator
                _train(model, opt, 3, scaler=scaler)
                results.append((scaler.get_scale(), em.counts.clone(), opt))
        assert results[0][0] == results[1][0] == 2.0 ** 12, [(r[0], r[1]) for r in results]  # backed off alike
        assert torch.equal(results[0][1], results[1][1])
        _assert_same(sharded, plain, results[1][2], results[0][2], "emulate")
    os._exit(0)  # see tests/test_dtensor.py: torch 2.13's gloo teardown may abort


def _reload_on_one_rank(rank, init_file, ckpt_dir, errors):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    with _reporting(rank, errors):
        mesh = init_device_mesh("cpu", (1,))
        for rounding in ("nearest", "stochastic"):
            for make in _optimizers(rounding):
                model = _shard(_model(), mesh)
                opt = make(model.parameters())
                path = os.path.join(ckpt_dir, f"{rounding}-{type(opt).__name__}")
                model_sd, optim_sd = get_state_dict(model, opt)
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, checkpoint_id=path)
                set_state_dict(model, opt, model_state_dict=state["model"],
                               optim_state_dict=state["optim"])
                for steps, want in ((0, ".want"), (2, ".want-after")):
                    # two more steps continue the two ranks' run (its generator state included)
                    _train(model, opt, steps, first=3)
                    params, masters = torch.load(path + want)
                    for p, q in zip(model.parameters(), params):
                        assert torch.equal(p.full_tensor().view(torch.int16), q.view(torch.int16))
                    for w, v in zip(opt.master_weights(), masters):
                        assert torch.equal(w.full_tensor(), v), (rounding, type(opt).__name__, steps)
    os._exit(0)


def test_fsdp2_training_equals_single_process_and_its_checkpoint_reshards(tmp_path):
    # Two ranks check training, state_dict, checkpoints, emulate and the scaler (_check_rank);
    # then one rank loads their checkpoints: the extra bits are saved per element, placed like
    # the parameters, so every master weight comes back exact on another number of ranks.
    ctx = mp.get_context("spawn")
    for nprocs, fn, args in ((2, _check_rank, (2, str(tmp_path / "pg"), str(tmp_path))),
                             (1, _reload_on_one_rank, (str(tmp_path / "pg1"), str(tmp_path)))):
        errors = ctx.SimpleQueue()
        ranks = mp.spawn(fn, args=(*args, errors), nprocs=nprocs, join=False)
        deadline = time.monotonic() + 300
        while not ranks.join(timeout=5):
            assert time.monotonic() < deadline, "a rank did not finish in 300 s"
        failures = [f"rank {r}:\n{tb}" for r, tb in (errors.get() for _ in range(nprocs))
                    if tb is not None]
        assert not failures, "\n".join(failures)
