"""Fixtures of the PLE reader tests (helpers live in stfiles.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from stfiles import evict_verified

from clusterctl.ple.residency import PAGE


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def can_evict(tmp_path):
    """Skip when this filesystem keeps pages after POSIX_FADV_DONTNEED (e.g. tmpfs)."""
    p = tmp_path / "probe.bin"
    p.write_bytes(os.urandom(4 * PAGE))
    with open(p, "rb") as f:
        os.fsync(f.fileno())
        f.read()
    if not evict_verified(None, p):
        pytest.skip(f"cannot evict pages of files under {tmp_path} (tmpfs?)")
    return True
