"""Fixtures the launch tests share: the tiny model and a private state dir per test."""

import pytest

from rankharness import tiny_model_path


@pytest.fixture(scope="session")
def tiny():
    return tiny_model_path()


@pytest.fixture
def env(tmp_path):
    """The CLI's environment for one test: its own state dir (keys, deployments, launch manifests)."""
    return {"CLUSTERCTL_STATE_DIR": str(tmp_path / "state")}
