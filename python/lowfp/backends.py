"""Which compiled module runs a tensor (``native``: lowfp._C on the CPU, lowfp._C_cuda with the
device index and torch's current stream on CUDA devices; both take the same arguments), and how
the kernels may see a tensor's memory (dense, in which order of its dims)."""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from . import _C

try:  # present only when lowfp was built with nvcc (LOWFP_CUDA=AUTO/ON)
    from . import _C_cuda  # type: ignore[attr-defined]
except ImportError:
    _C_cuda = None

__all__ = ["check_dense", "check_operand", "cuda_built", "native", "same_device", "memory_order",
           "inverse_order", "is_dense"]


def cuda_built() -> bool:
    """Whether this lowfp build includes the CUDA backend."""
    return _C_cuda is not None


def _check_device(device: torch.device, argname: str) -> None:
    """ValueError naming argname for a device lowfp has no backend for."""
    if device.type == "cpu":
        return
    if device.type == "cuda":
        if _C_cuda is None:
            raise ValueError(f"{argname} is a CUDA tensor ({device}) but this lowfp build has no CUDA "
                             "backend (lowfp.cuda_built() is False); move it to the CPU or reinstall "
                             "lowfp on a machine with nvcc")
        return
    raise ValueError(f"{argname} is on device {device}; lowfp supports cpu and cuda tensors")


# The tensor types whose data_ptr() is their own memory. Subclasses (DTensor, FakeTensor, the
# wrappers of torch.compile and torch.func) are views of something else, or of nothing.
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_plain(t: torch.Tensor) -> bool:
    """Whether t's data_ptr() is its own memory (not a subclass's view of something else)."""
    return type(t) in PLAIN_TYPES


def check_dense(t: torch.Tensor, argname: str) -> None:
    """The kernels read and write plain strided buffers through data_ptr(): tensor subclasses,
    nested, quantized, sparse and other layouts are refused by name."""
    if type(t) not in PLAIN_TYPES:
        kind = f"{type(t).__module__}.{type(t).__qualname__}"
        raise TypeError(f"{argname} is a {kind}, a tensor subclass whose memory lowfp's kernels cannot "
                        "read (under FakeTensorMode, torch.export or a DTensor); pass a plain "
                        "torch.Tensor (a DTensor's shard: .to_local())")
    if t.is_nested:
        raise TypeError(f"{argname} is a nested tensor; lowfp takes plain dense tensors (round each "
                        "component, or .to_padded_tensor())")
    if t.is_quantized:
        raise TypeError(f"{argname} is a quantized tensor ({t.dtype}); dequantize it first")
    # (Dynamo traces dense tensors only, and refuses to read .layout inside a backward)
    if not torch.compiler.is_compiling() and t.layout != torch.strided:
        raise TypeError(f"{argname} must be a dense (torch.strided) tensor, got layout {t.layout}; "
                        f"convert it with .to_dense() first")


# Tensors that stand for real ones while torch traces (torch.compile, torch.export, fake and
# meta runs): lowfp's operators give them their results' shapes and dtypes without reading memory.
TRACING_TYPES = (FakeTensor, FunctionalTensor)


def check_operand(t: torch.Tensor, argname: str) -> None:
    """What a tensor argument of a lowfp operator must be: dense and plain, or a tensor torch
    traces with; on a CPU, CUDA or meta device."""
    if type(t) in TRACING_TYPES:
        if t.is_nested or t.is_quantized or t.layout != torch.strided:
            raise TypeError(f"{argname} must be a dense (torch.strided) tensor, got layout {t.layout}")
        return
    check_dense(t, argname)
    if not torch.compiler.is_compiling() and _functorch_wrapped(t):
        raise TypeError(f"{argname} is a tensor of a torch.func transform (vmap, grad, vjp, jvp, ...), "
                        "which lowfp's operators do not support; call lowfp outside the transform "
                        "(torch.autograd records lowfp's roundings)")
    if t.device.type != "meta" and not t.is_cpu:
        _check_device(t.device, argname)


_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda t: False)


def fake_mode_of(*tensors):
    """The FakeTensorMode to enter for a call on ``tensors`` made outside any: that of a
    FakeTensor among them (None when a mode is active or no tensor is fake). FakeTensors mixed
    with real tensors outside any mode are a TypeError."""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return None
    fakes = [t for t in tensors if type(t) is FakeTensor]
    if not fakes:
        return None
    if len(fakes) != sum(t is not None for t in tensors):
        raise TypeError("x and out are FakeTensors and real tensors mixed; pass all of them fake "
                        "(or run under their FakeTensorMode)")
    return fakes[0].fake_mode


_torch_threads = 0  # the torch.get_num_threads() last handed to the CPU kernels


def follow_torch_threads() -> None:
    """The CPU kernels use torch's intra-op thread count unless lowfp.set_num_threads set one:
    handed over whenever torch's has changed (torch.set_num_threads)."""
    global _torch_threads
    n = torch.get_num_threads()
    if n != _torch_threads:
        _C.set_default_threads(n)
        _torch_threads = n


def same_device(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a.device == b.device, from is_cpu / is_cuda and the device index where it can: comparing
    torch.device objects costs several times more than the rest of a small call."""
    if b.is_cpu:
        return a.is_cpu
    if b.is_cuda:
        return a.is_cuda and a.get_device() == b.get_device()
    return a.device == b.device


def ready_on_cpu(t: torch.Tensor) -> bool:
    """Whether t (a plain tensor, checked by the caller) is a strided CPU tensor the CPU
    kernels read as native() would hand it to them (torch's thread count followed): the prepared
    calls' common case, without native()'s checks."""
    if t.is_cpu and not t.is_nested and t.layout is torch.strided:
        if torch.get_num_threads() != _torch_threads:
            follow_torch_threads()
        return True
    return False


def native(t: torch.Tensor, argname: str):
    """(module, device index, stream handle) that run raw-buffer functions on t's device."""
    if not (type(t) in PLAIN_TYPES and t.is_cpu and not t.is_nested and not t.is_quantized
            and t.layout is torch.strided):  # (the common case passes check_dense's checks)
        check_dense(t, argname)
    if t.is_cpu:  # not t.device.type: it builds a torch.device, and some callers run per parameter
        follow_torch_threads()
        return _C, -1, 0
    if not (t.is_cuda and _C_cuda is not None):
        _check_device(t.device, argname)  # (raises: no backend for t's device)
    device = t.get_device()  # (an int, where t.device builds a torch.device)
    if _cuda_raw_stream is not None:  # torch's raw accessor, as Inductor's generated code calls it
        return _C_cuda, device, _cuda_raw_stream(device)
    return _C_cuda, device, torch.cuda.current_stream(device).cuda_stream


_cuda_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (absent from CPU builds)


# -- memory layouts -------------------------------------------------------------------------------

def memory_order(t: torch.Tensor, name: str = "parameter") -> Optional[Tuple[int, ...]]:
    """None when ``t`` is contiguous (row-major); else its dims from outermost to innermost in
    memory (those of size 1 last), so that ``t.permute(order)`` is contiguous. ValueError when
    ``t`` is not dense: its elements do not fill one block of memory without gaps or overlaps."""
    if t.is_contiguous():
        return None
    order = _dense_order(t.shape, t.stride())
    if order is None:
        raise ValueError(f"{name}s must be dense in memory (contiguous, channels_last or another "
                         f"order of their dims, without gaps); one of shape {tuple(t.shape)} has "
                         f"strides {tuple(t.stride())}")
    return order


def is_dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill one block of memory from t.data_ptr(), in some order (a kernel
    that treats each element alike may read it as a flat buffer)."""
    return t.is_contiguous() or _dense_order(t.shape, t.stride()) is not None


@functools.lru_cache(maxsize=1024)  # each step asks again for every parameter's layout
def _dense_order(sizes: Tuple[int, ...], strides: Tuple[int, ...]) -> Optional[Tuple[int, ...]]:
    """memory_order from a shape and strides; None when they leave gaps or overlap."""
    spread = sorted((d for d in range(len(sizes)) if sizes[d] > 1), key=lambda d: -strides[d])
    expected = 1
    for d in reversed(spread):
        if strides[d] != expected:
            return None
        expected *= sizes[d]
    return tuple(spread) + tuple(d for d in range(len(sizes)) if sizes[d] <= 1)


def inverse_order(order: Sequence[int]) -> Tuple[int, ...]:
    """The permutation that undoes ``t.permute(order)``."""
    inverse = [0] * len(order)
    for position, d in enumerate(order):
        inverse[d] = position
    return tuple(inverse)
