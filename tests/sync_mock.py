"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``.

On a CPU every tensor is on the host, so nothing synchronizes; this mock says which reads would
synchronize if the tensors the caller names (a model's parameters and inputs, an emulator's count
tables) and everything computed from them lived on a GPU. Inside ``device_reads_forbidden(...)``:

- a tensor is *on the device* if it was named, or if an operator produced it from a tensor on the
  device (views and in-place results included); tensors made by factory functions (``zeros``,
  ``randint``, ...) from no device tensor are on the host;
- reading a device tensor's values into Python (``item``, ``bool``, ``int``, ``float``,
  ``tolist``, ``numpy``, ``nonzero``, ``.cpu()``, ``.to("cpu")``) raises ``DeviceSync``, as would
  a blocking ``copy_`` from a device tensor into a host one; a ``copy_(..., non_blocking=True)``
  into a host tensor is not a synchronisation, but reading that host tensor inside the same
  window is (the copy must be waited for); read in a later window, it has long finished.

Its limit: a tensor a factory function makes with ``device=`` a device tensor's device counts as
on the host here, which it would not be on a GPU; the real mode on a GPU (tests/test_emulate.py, on CUDA)
covers that case.
"""

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary


class DeviceSync(RuntimeError):
    pass


_READ_METHODS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu,
                 torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
                 torch.Tensor.__index__}
_READ_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
             torch.ops.aten.nonzero.default, torch.ops.aten.equal.default}


class _Window:
    """What one window knows: the tensors on the device, and the host copies still in flight."""

    def __init__(self):
        self.on_device = WeakTensorKeyDictionary()
        self.in_flight = WeakTensorKeyDictionary()


class _Tracker(TorchDispatchMode):
    def __init__(self, window: _Window):
        super().__init__()
        self.on_device, self.in_flight = window.on_device, window.in_flight

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        device_inputs = [t for t in inputs if t in self.on_device]
        if func in _READ_OPS and device_inputs:
            raise DeviceSync(f"{func} reads a device tensor on the host")
        if func is torch.ops.aten.copy_.default and args[0] not in self.on_device:
            if args[1] in self.on_device and not kwargs.get("non_blocking", len(args) > 2 and args[2]):
                raise DeviceSync("a blocking copy from a device tensor to the host")
            if args[1] in self.on_device:
                self.in_flight[args[0]] = True
            return func(*args, **kwargs)  # the destination stays on the host
        out = func(*args, **kwargs)
        if device_inputs:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.on_device[t] = True
        return out


class _Reads(TorchFunctionMode):
    def __init__(self, window: _Window):
        super().__init__()
        self.on_device, self.in_flight = window.on_device, window.in_flight

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and args[0] in self.in_flight:
            if func in _READ_METHODS:
                raise DeviceSync(f"{func.__name__} reads a host copy that is still in flight")
        if args and isinstance(args[0], torch.Tensor) and args[0] in self.on_device:
            to_host = func is torch.Tensor.to and any(
                a == "cpu" or a == torch.device("cpu") for a in list(args[1:]) + list(kwargs.values())
                if isinstance(a, (str, torch.device)))
            if func in _READ_METHODS or to_host:
                raise DeviceSync(f"{getattr(func, '__name__', func)} reads a device tensor on the host")
        return func(*args, **kwargs)


@contextlib.contextmanager
def device_reads_forbidden(*device_tensors):
    """Inside: reading any of ``device_tensors`` (tensors or iterables of them), or anything
    computed from them, on the host raises DeviceSync."""
    window = _Window()
    for item in device_tensors:
        for t in ([item] if isinstance(item, torch.Tensor) else item):
            window.on_device[t] = True
    with _Tracker(window), _Reads(window):
        yield window.on_device
