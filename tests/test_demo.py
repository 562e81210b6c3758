"""The README's main job, as a user runs it: `clusterctl demo` on a fresh state dir."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
    env = {**os.environ, "CLUSTERCTL_STATE_DIR": str(tmp_path / "state")}
    p = subprocess.run([sys.executable, "-m", "clusterctl", "demo", "--json", "--max-tokens", "16"],
                       capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["ok"] and doc["teardown_ok"] and doc["completion_tokens"] == 16 and doc["answer"]
    assert [r["layers"] for r in doc["ranks"]] == [2, 6]  # the 2 : 6 GiB split gives an uneven plan
    assert all(r["peak_rss_bytes"] for r in doc["ranks"])
    assert not list((tmp_path / "state" / "launches").glob("*.json"))
