import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _worker_threads() -> None:
    """Under pytest-xdist, each worker (and the processes its tests start) gets an equal share of
    the CPUs as its thread count, unless OMP_NUM_THREADS says otherwise: every worker's torch
    and lowfp at the machine's full thread count oversubscribe it (OpenMP threads waiting on each
    other). Tests of threading set their own counts."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 1 or "OMP_NUM_THREADS" in os.environ:
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cpus // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


_worker_threads()


@pytest.fixture
def fused(monkeypatch):
    """Roundings fused by Inductor on the CPU too (where LOWFP_INDUCTOR_FUSION=auto keeps
    lowfp's kernels)."""
    monkeypatch.setenv("LOWFP_INDUCTOR_FUSION", "1")


def pytest_collection_modifyitems(config, items):
    """The exhaustive sweeps (marked slow) first: pytest-xdist hands tests out in this order, so
    a sweep of a minute or more left to the end would keep one worker busy while the others sit
    idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # (a stable sort)
