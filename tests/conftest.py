import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


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
