import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def fused(monkeypatch):
    """Roundings fused by Inductor on the CPU too (where LOWFP_INDUCTOR_FUSION=auto keeps
    lowfp's kernels)."""
    monkeypatch.setenv("LOWFP_INDUCTOR_FUSION", "1")
