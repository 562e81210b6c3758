"""Shared fixtures for the whole suite. The real-sshd and network-namespace fixtures live in fixtures_ssh.py."""

import os

import pytest

from fixtures_ssh import netns_cluster, sshd, sshd_factory  # noqa: F401  (fixtures, registered by import)
from xdistsched import (pytest_collection_modifyitems, pytest_terminal_summary, pytest_testnodedown,  # noqa: F401
                        pytest_xdist_make_scheduler)  # hooks of parallel runs (scripts/test), registered by import


@pytest.fixture(autouse=True, scope="session")
def _private_hash_cache(tmp_path_factory):
    """The model-hash cache of this test session, not the user's (~/.cache/clusterctl). Nodes reached over SSH
    keep theirs (the environment does not travel); their entries are keyed by absolute paths under tmp dirs."""
    old = os.environ.get("CLUSTERCTL_CACHE_DIR")
    os.environ["CLUSTERCTL_CACHE_DIR"] = str(tmp_path_factory.mktemp("hash-cache"))
    yield
    if old is None:
        os.environ.pop("CLUSTERCTL_CACHE_DIR", None)
    else:
        os.environ["CLUSTERCTL_CACHE_DIR"] = old
