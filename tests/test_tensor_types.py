"""Tensors whose memory lowfp's kernels cannot read (DTensor, nested, quantized; FakeTensors
outside the rounding operators, which give them results: tests/test_compile.py) are refused with
a TypeError or ValueError naming the argument, never a crash. Each case runs in a child process,
so that a crash fails the test instead of ending the run."""

import subprocess
import sys
import textwrap

import pytest

DTENSOR = textwrap.dedent("""
    import os, torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor, Shard
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=0, world_size=1)
    d = distribute_tensor(torch.randn(64), init_device_mesh("cpu", (1,)), [Shard(0)])
""")

CASES = {
    "ExtraBitsAdamW over float32 DTensor parameters": (
        DTENSOR, "lowfp.optim.ExtraBitsAdamW([torch.nn.Parameter(d)])", TypeError,
        "float32 DTensor parameter .* convert the model before sharding"),
    "quantize of a nested tensor": (
        "", "lowfp.quantize(torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), 'fp(4,3,4)')",
        TypeError, "x is a nested tensor"),
    "quantize of a quantized tensor": (
        "", "lowfp.quantize(torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), 'fp(4,3,4)')",
        TypeError, "x is a quantized tensor"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_refused_by_name_never_a_crash(name):
    setup, call, exc, match = CASES[name]
    code = ("import re, torch, lowfp, lowfp.optim\n" + setup + "try:\n"
            + textwrap.indent(call, "    ") + "\n    print('RETURNED')\n"
            f"except {exc.__name__} as e:\n"
            f"    print('RAISED', bool(re.search({match!r}, str(e))), e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (name, out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith("RAISED True"), (name, out.stdout, out.stderr[-1000:])


# -- every public function fed every tensor kind, each call in its own child process ------------

def _make(kind):
    """A tensor of the given kind (built in the child that uses it)."""
    import torch
    base = torch.randn(4, 6)
    if kind == "sparse_coo":
        return base.to_sparse()
    if kind == "sparse_csr":
        return base.to_sparse_csr()
    if kind == "nested":
        return torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    if kind == "quantized":
        return torch.quantize_per_tensor(base, 0.1, 0, torch.qint8)
    if kind == "meta":
        return torch.empty(4, 6, device="meta")
    if kind == "int64":
        return torch.arange(24).reshape(4, 6)
    if kind == "complex":
        return torch.randn(4, 6, dtype=torch.complex64)
    if kind == "python subclass":
        class Plain(torch.Tensor):
            pass
        return base.as_subclass(Plain)
    if kind == "dispatch subclass":
        from torch.testing._internal.two_tensor import TwoTensor
        return TwoTensor(base, base.clone())
    if kind == "fake outside its mode":
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode():
            return torch.randn(4, 6)
    raise AssertionError(kind)


CALLS = {  # name: (call, the argument the tensor is)
    "quantize": ("lowfp.quantize(t, 'fp(4,3,4)')", "x"),
    "quantize stochastic": ("lowfp.quantize(t, 'fp(4,3,4)', 'stochastic')", "x"),
    "quantize out=": ("lowfp.quantize(torch.randn(4, 6), 'fp(4,3,4)', out=t)", "out"),
    "quantize_": ("lowfp.quantize_(t, 'fp(4,3,4)')", "x"),
    "s2fp8_quantize": ("lowfp.s2fp8_quantize(t)", "x"),
    "extra_bits.split": ("lowfp.extra_bits.split(t, torch.bfloat16, 8)", "w32"),
    "ExtraBitsAdamW": ("lowfp.optim.ExtraBitsAdamW([t])", "parameter"),
    "ExtraBitsSGD": ("lowfp.optim.ExtraBitsSGD([t], lr=0.1)", "parameter"),
    "any_non_finite": ("lowfp.scaler.any_non_finite(t)", "t"),
    "quantize to a scaled format": ("lowfp.quantize(t, 'mxfp8_e4m3')", "x"),
    "scaled.encode": ("lowfp.scaled.encode(t, 'nvfp4', 'stochastic')", "x"),
}
KINDS = ["sparse_coo", "sparse_csr", "nested", "quantized", "meta", "int64", "complex",
         "python subclass", "dispatch subclass", "fake outside its mode"]


def _child(kind, call, conn):
    import torch  # noqa: F401  (the call's namespace)
    import lowfp
    import lowfp.optim
    import lowfp.scaler
    try:
        t = _make(kind)
        eval(call, {"torch": torch, "lowfp": lowfp, "t": t})
        conn.send(("returned", ""))
    except (TypeError, ValueError) as err:
        conn.send(("refused", f"{type(err).__name__}: {err}"))
    except BaseException as err:  # anything else is a finding too (but not a crash)
        conn.send(("other", f"{type(err).__name__}: {err}"))


@pytest.mark.parametrize("kind", KINDS)
def test_every_public_function_refuses_or_handles_every_tensor_kind(kind):
    """Each call runs in a process forked from a server that has imported torch and lowfp (cheap,
    and a crash ends only that process): it returns, or raises TypeError/ValueError naming the
    argument. Never a signal, never another exception."""
    import multiprocessing
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "lowfp"])
    problems = []
    for name, (call, argname) in CALLS.items():
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(kind, call, child))
        proc.start()
        child.close()
        proc.join(120)
        if proc.exitcode != 0 or not parent.poll():
            problems.append(f"{name}: the child ended with exit code {proc.exitcode}")
            continue
        outcome, message = parent.recv()
        if outcome == "other":
            problems.append(f"{name}: {message}")
        elif outcome == "refused" and argname not in message and "t " not in message:
            problems.append(f"{name}: the refusal does not name {argname}: {message}")
    assert not problems, "\n".join(problems)
