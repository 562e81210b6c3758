"""A detached launch whose rank dies at start fails at once with that rank's own words, as a foreground one does
(docs/launch.md, step 8): nobody waits on a detached rank's exit, so the marker wait watches its process."""

from __future__ import annotations

import json
import sys
import time

import psutil
import pytest

from launchutil import cli, local_cluster, manifests

pytestmark = pytest.mark.slow

ERROR_LINE = "error: rank 1: this node's python cannot start ranks (test)"


def test_a_detached_rank_that_dies_at_start_fails_the_launch_at_once_with_its_log(tmp_path, tiny, env):
    # node b's python runs every node operation but dies at once as a rank, after a few lines of output
    py = tmp_path / "python-b"
    py.write_text("#!/bin/sh\n"
                  'if [ "$2" = clusterctl.rank ]; then\n'
                  "  for i in $(seq 1 30); do echo \"rank output line $i\"; done\n"
                  f"  echo \"{ERROR_LINE}\" >&2\n"
                  "  exit 3\n"
                  "fi\n"
                  f'exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    c = local_cluster(tmp_path, (2, 6), extra={"b": {"python": str(py)}})
    dep = str(tmp_path / "dep.json")
    cli("plan", "-c", str(c), "-m", str(tiny), "--context", "512", "-o", dep, "-q", env=env, check=True)

    t0 = time.monotonic()
    p = cli("launch", dep, "--detach", "--json", "--timeout", "120", env=env)
    took = time.monotonic() - t0
    assert p.returncode == 1, p.stderr
    [err] = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert err.startswith(f"error: rank 1 on b exited before it was ready: {ERROR_LINE}"), p.stderr
    assert took < 60, f"the launch took {took:.1f} s to notice (timeout 120 s)"  # not its timeout
    doc = json.loads(p.stdout)
    [rank] = doc["ranks"]
    tail = rank["stderr_tail"].splitlines()
    assert (rank["rank"], rank["node"]) == (1, "b") and rank["log_path"].endswith("-rank1.log")
    assert len(tail) == 20 and tail[-1] == ERROR_LINE and tail[0] == "rank output line 12"
    # what did start (rank 0, loading) was torn down, verified
    assert doc["teardown"]["ok"] is True and manifests(tmp_path / "state") == []
    assert not [x for x in psutil.process_iter(["cmdline"]) if "clusterctl.rank" in " ".join(x.info["cmdline"] or [])
                and str(tmp_path) in " ".join(x.info["cmdline"] or [])]
