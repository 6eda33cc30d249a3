"""Instructions per loop of a CUDA kernel, read off its machine code (SASS), for kernels that no
GPU at hand can time.

    python bench/sass_loops.py FILE.cu KERNEL [--arch sm_90] [--cuobjdump PATH]

Compiles FILE.cu as the CUDA build does (nvcc -O3 --fmad=false, the project's include folders),
disassembles it with cuobjdump (``pip install nvidia-cuda-cuobjdump`` brings one), and for each
kernel whose mangled name holds every comma-separated part of KERNEL prints its loops (a
backward branch and its target) with two counts: every instruction in the loop, and those on its
fall-through path, which skips each forward branch's target range (where a kernel branches
around a rare case, the common path). An H100 SM issues at most four warp instructions a cycle,
128 thread instructions, so a loop of n instructions per element runs at most
128 / n elements a cycle per SM: an upper bound, not a measurement.
"""

import argparse
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+0x([0-9a-f]+)")


def functions(sass: str):
    """{mangled name: [(address, instruction text)]} of a cuobjdump -sass listing."""
    out = {}
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        name, _, body = part.partition("\n")
        out[name.strip()] = [(int(a, 16), t) for a, t in _INSTRUCTION.findall(body)]
    return out


def branch_target(text: str):
    m = _BRANCH.match(text)
    return int(m.group(2), 16) if m else None


def loops(instructions):
    """[(start, end, all instructions, fall-through instructions)] for each backward branch."""
    found = []
    for address, text in instructions:
        target = branch_target(text)
        if target is None or target > address:
            continue
        body = [(a, t) for a, t in instructions if target <= a <= address]
        hot, skip_to = 0, None
        for a, t in body:
            if skip_to is not None and a < skip_to:
                continue
            skip_to = None
            hot += 1
            forward = branch_target(t)
            if forward is not None and forward > a and t.startswith("@"):
                skip_to = forward
        found.append((target, address, len(body), hot))
    return found


def compile_sass(source: Path, arch: str, cuobjdump: str) -> str:
    import pybind11
    includes = [ROOT / "cpp/include", ROOT / "cpp/src/host", ROOT / "cpp/bindings", ROOT / "cpp/src/cuda",
                Path(sysconfig.get_paths()["include"]), Path(pybind11.get_include())]
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernels.cubin"
        subprocess.run(["nvcc", "-std=c++17", "-O3", "--fmad=false", f"-arch={arch}", "-cubin", str(source),
                        *[f"-I{i}" for i in includes], "-o", str(cubin)], check=True)
        return subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("kernel", help="comma-separated parts of the kernel's mangled name")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump"))
    args = parser.parse_args(argv)
    if args.cuobjdump is None:
        print("no cuobjdump: pip install nvidia-cuda-cuobjdump, then pass --cuobjdump "
              "<site-packages>/nvidia/cu13/bin/cuobjdump", file=sys.stderr)
        return 2
    parts = args.kernel.split(",")
    for name, instructions in functions(compile_sass(args.source, args.arch, args.cuobjdump)).items():
        if not all(p in name for p in parts):
            continue
        print(name)
        for start, end, total, hot in loops(instructions):
            print(f"  loop {start:#x}-{end:#x}: {total} instructions, {hot} on the fall-through path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
