"""Shared fixtures for the whole suite. The real-sshd and network-namespace fixtures live in fixtures_ssh.py."""

import os
import sys
from pathlib import Path

import pytest

# the rank harness and the launch tests' helpers (tests/launch/rankharness.py, launchutil.py) serve tests of every
# folder (tests/ mirrors src/: connect/, front/, supervise/, rank/ start ranks too)
sys.path.insert(0, str(Path(__file__).resolve().parent / "launch"))

# Never the network: a fuzzed `plan --model` that reads as a hub name (`0/0`) must not reach huggingface.co. Set
# before anything imports huggingface_hub (it reads the variable once); the hub tests give their processes a
# stand-in hub of their own (tests/hubserver.py).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"

import slowguard
import xdistsched
from fixtures_ssh import netns_cluster, sshd, sshd_factory  # noqa: F401  (fixtures, registered by import)
from slowguard import (pytest_collection_modifyitems, pytest_configure, pytest_runtest_logreport,  # noqa: F401
                       pytest_runtest_protocol)  # (the `slow` mark, enforced: docs/testing.md; registered by import)
from xdistsched import pytest_testnodedown, pytest_xdist_make_scheduler  # noqa: F401
# (hooks of parallel runs, scripts/test; registered by import)


@pytest.fixture(scope="session")
def tiny():
    """The tiny random-weight model the launch, connect, front and supervise tests serve."""
    from rankharness import tiny_model_path

    return tiny_model_path()


@pytest.fixture
def env(tmp_path):
    """The CLI's environment for one test: its own state dir (keys, deployments, launch manifests)."""
    return {"CLUSTERCTL_STATE_DIR": str(tmp_path / "state")}


def pytest_terminal_summary(terminalreporter):
    xdistsched.terminal_summary(terminalreporter)  # the fuzzers' case counts from the workers
    slowguard.terminal_summary(terminalreporter)  # unmarked tests that took long


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


@pytest.fixture(autouse=True)
def _mlx_random_state_usable():
    """A test that leaves MLX's global random state unusable does not fail the next test of its process.

    A sampler that raises inside a compiled MLX function (tests/rank/engine/test_admission_parts.py makes one on
    purpose) can leave ``mx.random.state`` holding an array without a primitive; every later random op in that
    process then fails with "[eval] Attempting to eval an array without a primitive" (e.g. the toy model that
    plan's batching probe builds). In one process the suite's order hid it (a later test reseeded); with xdist
    workers the order differs. Only a state that cannot be evaluated is replaced (reseeded): a usable one is left
    as it is. Nothing is imported if the test process never imported mlx."""
    yield
    import sys

    mx = sys.modules.get("mlx.core")
    if mx is None:
        return
    try:
        mx.eval(mx.random.state)
    except RuntimeError:
        mx.random.seed(0)
