"""Instructions per loop of a CUDA kernel, read off its machine code (SASS), for kernels that no
GPU at hand can time.

    python bench/sass_loops.py FILE.cu KERNEL [--arch sm_90] [--cuobjdump PATH]
        [--path START:END [--taken ADDRESS[:TIMES] ...] [--jump FROM:TO ...]]

Compiles FILE.cu as the CUDA build does (nvcc -O3 --fmad=false, the project's include folders),
disassembles it with cuobjdump (``pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm``
bring it and the disassembler it calls, which must be on PATH), and for each
kernel whose mangled name holds every comma-separated part of KERNEL prints its loops (a
backward branch and its target) with two counts: every instruction in the loop, and those on its
fall-through path, which skips each forward branch's target range (where a kernel branches
around a rare case, the common path). An H100 SM issues at most four warp instructions a cycle,
128 thread instructions, so a loop of n instructions per element runs at most
128 / n elements a cycle per SM: an upper bound, not a measurement. With --path it counts instead
the instructions a warp issues on one path through the code (`path`), the branches it takes
named by their addresses in the listing (cuobjdump -sass shows them).
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


def path(instructions, start: int, end: int, taken=None, jumps=None) -> int:
    """Instructions issued on one path from `start` to `end` (both counted): unconditional branches
    followed, each predicated branch at an address in `taken` followed as many times as it maps
    to, others falling through, and each indexed jump (BRX) to the target `jumps` gives it. A
    warp issues a predicated-off instruction too, so a path through code that some of its lanes
    skip counts it."""
    taken, jumps = dict(taken or {}), dict(jumps or {})
    at = {a: i for i, (a, _) in enumerate(instructions)}
    i, count = at[start], 0
    while True:
        address, text = instructions[i]
        count += 1
        if address == end:
            return count
        if count > len(instructions) * 64:
            raise ValueError(f"no end at {end:#x}: a loop taken forever from {address:#x}")
        if text.startswith("BRX"):
            i = at[jumps[address]]
            continue
        target = branch_target(text)
        if target is not None and (not text.startswith("@") or taken.get(address, 0) > 0):
            if text.startswith("@"):
                taken[address] -= 1
            i = at[target]
            continue
        i += 1


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
    parser.add_argument("--path", metavar="START:END",
                        help="count one path from START to END (hex addresses) instead of listing loops")
    parser.add_argument("--taken", nargs="*", default=[], metavar="ADDRESS[:TIMES]",
                        help="predicated branches the path takes (TIMES times; default always)")
    parser.add_argument("--jump", nargs="*", default=[], metavar="FROM:TO", help="indexed jumps' targets")
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
        if args.path:
            start, end = (int(a, 16) for a in args.path.split(":"))
            taken = {int(a, 16): int(n) if n else 10 ** 9
                     for a, _, n in (t.partition(":") for t in args.taken)}
            jumps = dict((int(a, 16), int(b, 16)) for a, b in (j.split(":") for j in args.jump))
            print(f"  path {start:#x}-{end:#x}: {path(instructions, start, end, taken, jumps)} instructions")
            continue
        for start, end, total, hot in loops(instructions):
            print(f"  loop {start:#x}-{end:#x}: {total} instructions, {hot} on the fall-through path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
