"""Runs lowfp's CUDA kernels on torch's current stream of the tensor's device."""

from __future__ import annotations

import torch

from . import _C_cuda  # type: ignore[attr-defined]


class _CudaBackend:
    name = "cuda"

    @staticmethod
    def quantize(x, x_code, y, y_code, n, args, counts_ptr):
        device = x.device.index if x.device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(device).cuda_stream
        _C_cuda.quantize(x.data_ptr(), x_code, y.data_ptr(), y_code, n, *args, counts_ptr, device,
                         stream)


_BACKEND = _CudaBackend()


def backend() -> _CudaBackend:
    return _BACKEND
