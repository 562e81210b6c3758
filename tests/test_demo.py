"""The README's main job, as a user runs it: `clusterctl demo` on a fresh state dir — the real SmolLM2 instruct
model on 2 local ranks, its answer checked against one plain mlx-lm process."""

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
    assert doc["ok"] and doc["teardown_ok"] and doc["model"] == "smollm2"
    assert "Paris" in doc["answer"] and doc["matches_one_process"] is True
    assert doc["answer"] == doc["one_process_answer"]
    assert [r["layers"] for r in doc["ranks"]] == [7, 23]  # the 2 : 6 GiB split gives an uneven plan
    assert all(r["peak_rss_bytes"] for r in doc["ranks"])
    assert not list((tmp_path / "state" / "launches").glob("*.json"))
