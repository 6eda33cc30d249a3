"""Runs a script under each CPU kernel level (LOWFP_CPU_KERNEL: baseline, AVX2, AVX-512), each in a
child process, for tests that compare the levels bit for bit."""

import os
import subprocess
import sys

import torch

KERNELS = ("baseline", "avx2", "avx512")


def outputs_of_each_kernel(script: str, tmp_path) -> dict:
    """{kernel: the list the script saved with torch.save to sys.argv[1]}; the script saves
    lowfp._C.cpu_kernel() first, so that a test can check which level ran (one this CPU lacks
    runs the best it has)."""
    results = {}
    for kernel in KERNELS:
        path = tmp_path / f"{kernel}.pt"
        env = dict(os.environ, LOWFP_CPU_KERNEL=kernel)
        subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True)
        results[kernel] = torch.load(path)
    assert "baseline" in {r[0] for r in results.values()}
    return results
