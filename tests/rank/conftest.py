"""The rank's tests share the launch tests' helpers (rankharness, launchutil) in tests/launch (on the path:
tests/conftest.py)."""

import pytest

from rankharness import RankCluster, tiny_model_path

# The 2-rank clusters of the API tests (test_api, test_rank_admission, test_conformance), one per decode schedule,
# started once for the session: what they configure is what every one of those tests may rely on.
SHARED_CONTEXT = 128  # the plan's per-request context (context_tokens)
SHARED_OVERRIDES = {"context_tokens": SHARED_CONTEXT, "control_timeout_s": 8.0, "max_batch": 4,
                    "model_aliases": ["my-alias"], "cors_origins": ["https://app.example"]}
_shared: dict[str, RankCluster] = {}


@pytest.fixture(scope="session")
def shared_clusters(tmp_path_factory):
    """shared_clusters(schedule) -> a running 2-rank cluster of the tiny model (made on first use)."""
    def get(schedule: str) -> RankCluster:
        if schedule not in _shared:
            c = RankCluster(tmp_path_factory.mktemp(f"shared-{schedule}"), tiny_model_path(), [4, 4],
                            overrides={**SHARED_OVERRIDES, "schedule": schedule}, tag=f"sh{schedule[:4]}")
            _shared[schedule] = c
            c.up()
        return _shared[schedule]

    yield get
    for c in _shared.values():
        c.stop()
    _shared.clear()


@pytest.fixture(scope="module", params=["overlap", "lockstep"])
def cluster(request, shared_clusters):
    return shared_clusters(request.param)
