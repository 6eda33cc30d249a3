"""Runs lowfp's CUDA kernels on torch's current stream of the tensor's device."""

from __future__ import annotations

import torch

from . import _C_cuda  # type: ignore[attr-defined]


def _where(x: torch.Tensor):
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return device, torch.cuda.current_stream(device).cuda_stream


class _CudaBackend:
    name = "cuda"

    @staticmethod
    def quantize(x, x_code, y, y_code, n, args, counts_ptr):
        _C_cuda.quantize(x.data_ptr(), x_code, y.data_ptr(), y_code, n, *args, counts_ptr,
                         *_where(x))

    @staticmethod
    def s2fp8(x, code, y, n, args, log_max, sums, params, counts_ptr):
        _C_cuda.s2fp8(x.data_ptr(), code, y.data_ptr(), n, *args, log_max, sums.data_ptr(),
                      params.data_ptr(), counts_ptr, *_where(x))


_BACKEND = _CudaBackend()


def backend() -> _CudaBackend:
    return _BACKEND
