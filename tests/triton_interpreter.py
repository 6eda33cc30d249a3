"""Inductor's Triton code for CPU tensors, run by Triton's interpreter (TRITON_INTERPRET=1): the
kernels a GPU would run for lowfp's fused roundings, checked on a machine without one
(tests/triton_interpreter_checks.py, run by .ci/triton-interpreter; not part of CI).

Importing this module sets Inductor's CPU backend to Triton and replaces, for the process:
- Triton's backend look-up, which needs a GPU driver (only its hash is asked for);
- AsyncCompile.triton, so that each generated kernel is loaded from a file (Triton reads its
  source) and launched by the interpreter with block sizes chosen here (the interpreter runs one
  program at a time in NumPy; XBLOCK covers a pointwise kernel's elements, reductions take
  XBLOCK 1 and R0_BLOCK 64);
- libdevice's floor, ceil, isnan and isinf, which the interpreter lacks, by tl's;
- the interpreter's float32/bfloat16 conversions (it mishandles subnormals) by exact ones, and
  its narrowing of float32 to a 16-bit float so that a NaN becomes the canonical 0x7FFF, as a
  GPU's cvt.rn.bf16.f32 and cvt.rn.f16.f32 make it: code that relies on a NaN's bits surviving
  such a conversion fails here as it would on a GPU.

With LOWFP_INTERPRETER_FTZ=1, float32 additions, subtractions, products and quotients also flush
subnormal operands and results to zero, as code compiled with flush-to-zero does.

What it cannot show: the rest of a GPU's float arithmetic where it differs from NumPy's
(approximate division, fused multiply-adds), its scheduling and its speed. Torch's and Triton's
private interfaces change between versions; this is a tool for the versions
.ci/triton-interpreter installs."""

import hashlib
import importlib.util
import math
import os
import tempfile

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.utils._triton as torch_triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch._inductor import async_compile, config  # noqa: E402
from torch._inductor.runtime import triton_heuristics, triton_helpers  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

torch_triton.triton_backend = lambda: None
torch_triton.triton_hash_with_backend = lambda: "0" * 64
triton_helpers.set_driver_to_cpu = lambda: None
config.cpu_backend = "triton"
config.compile_threads = 1

LAUNCHES = []  # the names of the kernels launched, in order (clear it before a call)
_KERNEL_DIR = os.path.join(tempfile.gettempdir(), "lowfp_triton_interpreter")


class _Kernel:
    """A generated kernel as the generated wrapper calls it: run(*args, stream=)."""

    def __init__(self, name: str, fn, kind: str, meta: dict):
        self.name, self.fn, self.kind = name, fn, kind
        self.signature = meta["triton_meta"]["signature"]
        self.constants = meta["triton_meta"].get("constants", {})

    def run(self, *args, stream=None):
        names = [p for p in self.signature if not p.endswith("BLOCK")]  # (what the wrapper passes)
        values = dict(zip(names, args))
        xnumel = values.get("xnumel", self.constants.get("xnumel", 1))
        blocks = {}
        if "XBLOCK" in self.signature:
            blocks["XBLOCK"] = (1 << max(0, (int(xnumel) - 1).bit_length()) if self.kind == "pointwise"
                                else 1)
            blocks["XBLOCK"] = min(blocks["XBLOCK"], 1024)
        if "YBLOCK" in self.signature:
            blocks["XBLOCK"] = blocks["YBLOCK"] = 16
        if "R0_BLOCK" in self.signature:
            blocks["R0_BLOCK"] = 64
        grid = (math.ceil(xnumel / blocks.get("XBLOCK", 1)),)
        if "ynumel" in values:
            grid += (math.ceil(values["ynumel"] / blocks["YBLOCK"]),)
        LAUNCHES.append(self.name)
        self.fn[grid](*(values[n] for n in names), **blocks)


def _recording(kind: str):
    def decorator(*_, **meta):
        def record(fn):
            fn._interpreted_as = (kind, meta)
            return fn
        return record
    return decorator


class _Libdevice:
    """libdevice's functions that the interpreter lacks, by tl's (looked up when the kernel runs:
    the interpreter's tl), the others as they are."""

    def __init__(self, libdevice):
        self._libdevice = libdevice
        self.floor = lambda v: tl.floor(v)
        self.ceil = lambda v: tl.ceil(v)
        self.isnan = lambda v: v != v
        self.isinf = lambda v: tl.abs(v) == float("inf")

    def __getattr__(self, name):
        return getattr(self._libdevice, name)


def _load(self, kernel_name: str, source_code: str, device_str: str = "cuda") -> _Kernel:
    heuristics = ("pointwise", "reduction", "persistent_reduction")
    saved = {h: getattr(triton_heuristics, h) for h in heuristics}
    os.makedirs(_KERNEL_DIR, exist_ok=True)
    digest = hashlib.sha1(source_code.encode()).hexdigest()[:12]
    path = os.path.join(_KERNEL_DIR, f"{kernel_name}_{digest}.py")
    with open(path, "w") as f:
        f.write(source_code)
    try:
        for h in heuristics:
            setattr(triton_heuristics, h, _recording(h))
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for h, decorator in saved.items():
            setattr(triton_heuristics, h, decorator)
    if hasattr(module, "libdevice"):
        module.libdevice = _Libdevice(module.libdevice)
    fn = getattr(module, kernel_name)
    kind, meta = fn._interpreted_as
    return _Kernel(kernel_name, fn, kind, meta)


async_compile.AsyncCompile.triton = _load

_convert_float = interpreter._convert_float


def _exact_convert(data, src, dst, rounding_mode):
    """bfloat16 <-> float32 as a GPU converts: widening by the bits, narrowing by torch's
    round-to-nearest-even."""
    if src == tl.bfloat16 and dst == tl.float32:
        bits = np.frombuffer(data.tobytes(), dtype=np.uint16).astype(np.uint32) << 16
        return bits.reshape(data.shape).view(np.float32)
    if src == tl.float32 and dst == tl.bfloat16:
        narrowed = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy()).to(torch.bfloat16)
        return narrowed.view(torch.int16).numpy().view(np.uint16).reshape(data.shape)
    return _convert_float(data, src, dst, rounding_mode)


interpreter._convert_float = _exact_convert
_cast = interpreter.InterpreterBuilder.cast_impl


def _gpu_cast(self, src, dst_type):
    out = _cast(self, src, dst_type)
    if src.dtype.scalar == tl.float32 and dst_type.scalar in (tl.float16, tl.bfloat16):
        nan = np.isnan(src.data)
        if nan.any():  # a GPU's narrowing makes every NaN the canonical one
            bits = out.data.view(np.uint16).copy()
            bits[nan] = 0x7FFF
            out = interpreter.TensorHandle(bits.view(out.data.dtype), out.dtype)
    return out


interpreter.InterpreterBuilder.cast_impl = _gpu_cast


def _flushing(op):
    """op on float32 with subnormal operands and results flushed to zeros of their sign, as GPU
    code compiled with flush-to-zero computes."""
    def flushed(self, lhs, rhs):
        if lhs.dtype.scalar != tl.float32:
            return op(self, lhs, rhs)
        lhs, rhs = (interpreter.TensorHandle(_flush(h.data), h.dtype) for h in (lhs, rhs))
        out = op(self, lhs, rhs)
        return interpreter.TensorHandle(_flush(out.data), out.dtype)
    return flushed


def _flush(data):
    tiny = np.finfo(np.float32).tiny
    return np.where(np.abs(data) < tiny, np.copysign(np.float32(0), data), data).astype(data.dtype)


# LOWFP_INTERPRETER_FTZ=1: float32 additions, subtractions, products and quotients flush
# subnormals (docs/design.md §3.1 takes float32 arithmetic only where flushing cannot change a
# result)
if os.environ.get("LOWFP_INTERPRETER_FTZ") == "1":
    for _name in ("create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_precise_divf"):
        setattr(interpreter.InterpreterBuilder, _name, _flushing(getattr(interpreter.InterpreterBuilder, _name)))
