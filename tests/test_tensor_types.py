"""Tensors whose memory lowfp's kernels cannot read (DTensor, nested, quantized; FakeTensors
outside the rounding operators, which give them results: tests/test_compile.py) are refused with
a TypeError or ValueError naming the argument, never a crash. Each case runs in a child process,
so that a crash fails the test instead of ending the run."""

import subprocess
import sys
import textwrap

import pytest

FAKE = "from torch._subclasses.fake_tensor import FakeTensorMode\n"
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
    "split of a FakeTensor": (FAKE, "with FakeTensorMode():\n"
                                    "    lowfp.extra_bits.split(torch.randn(8), torch.bfloat16, 8)",
                              TypeError, "w32 is a .*FakeTensor"),
    "quantize of a DTensor": (DTENSOR, "lowfp.quantize(d, 'fp(4,3,4)')", TypeError, "x is a .*DTensor"),
    "ExtraBitsAdamW over DTensor parameters": (
        DTENSOR, "lowfp.optim.ExtraBitsAdamW([torch.nn.Parameter(d)])", TypeError,
        "parameter is a .*DTensor"),
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
