"""C++ programs under tests/cpp/ that follow a CUDA kernel's schedule on the CPU (built with the
host compiler from the same headers as the CUDA build), so that CI checks its indexing without a
GPU."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INCLUDES = ["cpp/include", "cpp/src/host", "cpp/src/cuda"]


def run_host_program(tmp_path, source, *sources, timeout=300):
    """Builds tests/cpp/<source> (with cpp/<sources>, paths from the repository's root) and runs
    it; returns its stdout after asserting it exited 0. Skips where no C++ compiler is found.
    Unoptimised (-O0): the programs' many kernel instances build in half -O1's time or less, and
    each runs in seconds all the same."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip(f"no C++ compiler to build tests/cpp/{source}")
    exe = tmp_path / Path(source).stem
    subprocess.run([compiler, "-std=c++20", "-O0", "-pthread", "-ffp-contract=off",
                    *(f"-I{ROOT / d}" for d in INCLUDES), str(ROOT / "tests/cpp" / source),
                    *(str(ROOT / s) for s in sources), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout
