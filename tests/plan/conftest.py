"""Fixtures of the planner tests (helpers live in clusters.py and ../modelfiles.py)."""

import pytest
from modelfiles import make_model


@pytest.fixture
def model32(tmp_path):
    return make_model(tmp_path / "m32", layers=32, hidden=64)


@pytest.fixture
def state(tmp_path, monkeypatch):
    d = tmp_path / "state"
    monkeypatch.setenv("CLUSTERCTL_STATE_DIR", str(d))
    return d
