"""The supervisor end to end with real local ranks of the tiny model: ``launch --heal``, a rank SIGKILLed, the
deployment healed onto the node left (a history entry of kind heal, the same port), then back to the original
plan once the node has been healthy for --rejoin-after (kind rejoin); the state file and `status` say so."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from launchutil import (ask, cli, heal_file, local_cluster, manifests, processes_with_nonce, start_cli, wait_for,
                        wait_line)

pytestmark = pytest.mark.slow


def test_a_sigkilled_rank_heals_onto_the_node_left_then_rejoins(tmp_path, tiny, env):
    state = Path(env["CLUSTERCTL_STATE_DIR"])
    c = local_cluster(tmp_path, (6, 6))
    dep = tmp_path / "dep.json"
    cli("plan", "-c", str(c), "-m", str(tiny), "--context", "256", "-o", str(dep), "-q", env=env, check=True)
    proc = start_cli("launch", str(dep), "--heal", "--heal-grace", "1", "--rejoin-after", "2", "--rejoin-drain",
                     "5", "--timeout", "120", "--grace", "3", env=env)
    try:
        endpoint = wait_line(proc)
        [m0] = manifests(state)
        original = heal_file(state)
        assert original["state"] == "serving" and original["job"] == m0["job_id"] and original["heals"] == 0
        victim = next(r for r in m0["ranks"] if r["node"] == "a")
        os.kill(victim["pid"], signal.SIGKILL)

        healed = wait_for("the heal", lambda: (lambda d: d if d.get("heals") == 1 and d.get("state") == "serving"
                                            and d.get("job") not in (None, m0["job_id"]) else None)(
            heal_file(state)))
        assert healed["lost_nodes"] == ["a"] and healed["deployment"] != original["deployment"]
        [m1] = manifests(state)
        assert [r["node"] for r in m1["ranks"]] == ["b"] and m1["endpoint"] == endpoint  # the same URL
        assert processes_with_nonce(m0["nonce"]) == []  # every rank of the lost job is gone
        assert ask(endpoint)
        hist = json.loads(cli("history", str(original["deployment"]), "--json", env=env, check=True).stdout)
        [entry] = hist["clusters"][0]["entries"]
        assert entry["kind"] == "heal" and entry["from"] == original["deployment"] and "a leaves" in entry["changes"]
        st = json.loads(cli("status", "--json", env=env, check=True).stdout)
        # the rejoin may be under way already (2 s of health): either way the heal is counted and named
        assert st["heal"][0]["heals"] == 1 and st["heal"][0]["original"] == original["deployment"]
        assert st["heal"][0]["state"] in ("serving", "healing") and st["heal"][0]["supervisor_alive"] is True

        back = wait_for("the rejoin", lambda: (lambda d: d if d.get("deployment") == original["deployment"]
                                            and d.get("state") == "serving" and d.get("job") else None)(
            heal_file(state)))
        assert back["lost_nodes"] == [] and back["heals"] == 1
        [m2] = manifests(state)
        assert sorted(r["node"] for r in m2["ranks"]) == ["a", "b"] and m2["endpoint"] == endpoint
        hist = json.loads(cli("history", "--json", env=env, check=True).stdout)["clusters"][0]
        assert [e.get("kind") for e in hist["entries"]] == ["heal", "rejoin"] and hist["current"] == original[
            "deployment"]
        assert ask(endpoint)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, proc.stderr.read()
    assert manifests(state) == [] and heal_file(state)["state"] == "degraded"
