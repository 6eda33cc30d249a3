"""The devices the tests run on: the CPU always, CUDA where a GPU and lowfp's CUDA build are
present (`bash bench/run_gpu.sh` runs the suite there). A module's tests of lowfp's numbers take
`@pytest.mark.parametrize("device", DEVICES)`; its checks that a GPU gives the CPU's bits, counts
and steps take `@on_cuda`. Helpers of those checks follow."""

import pytest
import torch

import lowfp

CUDA_PRESENT = torch.cuda.is_available() and lowfp.cuda_built()
_needs_cuda = pytest.mark.skipif(not CUDA_PRESENT,
                                 reason="needs a CUDA GPU and lowfp built with nvcc (LOWFP_CUDA=AUTO/ON)")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, _needs_cuda])]


def on_cuda(test):
    """A test that needs a GPU (marked `cuda`: `pytest -m cuda` selects them)."""
    return pytest.mark.cuda(_needs_cuda(test))


def bit_patterns(n, dtype, seed=0):
    """n random bit patterns of dtype (every binade, NaN payloads); float64 as random normals
    spread over 2^±60."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.float64:
        x = torch.randn(n, generator=g, dtype=torch.float64)
        return x * torch.exp2(torch.randint(-60, 60, (n,), generator=g).double())
    int_dtype = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    info = torch.iinfo(int_dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=int_dtype).view(dtype)


def same_bits(a, b):
    """a and b hold the same bits (NaN payloads included), on any devices."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().cpu().view(ints))


def step_on_both(cpu_opt, gpu_opt, cpu_params, gpu_params, g, steps, seed):
    """Steps both optimizers with the same random gradients and stochastic-rounding seeds; after
    each step the weights and master weights must be equal bit for bit, and so must the counts.
    The CPU optimizer steps with torch's CUDA arithmetic (Adam's association, correctly rounded
    roots), as the GPU does."""
    cpu_opt._cuda_association = True
    for step in range(steps):
        for p, q in zip(cpu_params, gpu_params):
            grad = torch.randn(p.shape, generator=g).to(p.dtype)
            p.grad, q.grad = grad, grad.cuda()
        torch.manual_seed(seed + step)
        cpu_opt.step()
        torch.manual_seed(seed + step)
        gpu_opt.step()
        for p, q in zip(cpu_params, gpu_params):
            assert same_bits(p.detach(), q.detach()), step
        for a, b in zip(cpu_opt.master_weights(), gpu_opt.master_weights()):
            assert torch.equal(a, b.cpu()), step
    assert cpu_opt.weight_stats.as_dict() == gpu_opt.weight_stats.as_dict()


def cpu_and_gpu(x, fmt, mode, **kw):
    """lowfp.quantize of CPU x on the CPU and on the GPU: both results on the CPU, both counts."""
    s_cpu, s_gpu = lowfp.Stats(), lowfp.Stats("cuda")
    y_cpu = lowfp.quantize(x, fmt, mode, seed=77, stats=s_cpu, **kw)
    y_gpu = lowfp.quantize(x.cuda(), fmt, mode, seed=77, stats=s_gpu, **kw)
    return y_cpu, y_gpu.cpu(), s_cpu.as_dict(), s_gpu.as_dict()
