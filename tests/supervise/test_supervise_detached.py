"""``supervise`` over a detached job, with real local ranks of the tiny model and real signals: rank 0 SIGKILLed
heals onto rank 1's node (whenever rank 1 follows it out); ``teardown`` during a heal stops the supervisor first
and leaves nothing (nothing relaunched afterwards); a supervisor SIGKILLed mid-heal: ``status`` says nothing
serves, and a restarted supervisor finishes the heal on the cluster's same port (docs/heal.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from launchutil import (ask, cli, heal_file, local_cluster, manifests, processes_with_nonce, start_cli, wait_for,
                        wait_gone, wait_line)

pytestmark = pytest.mark.slow
POLICY = ("--heal-grace", "1", "--rejoin-after", "600", "--grace", "3", "--timeout", "120")


def _supervised(tmp_path: Path, tiny: Path, env: dict):
    """A detached 2-node job (rank 0 on a, rank 1 on b) and its supervisor, serving."""
    c = local_cluster(tmp_path, (6, 6))
    dep = tmp_path / "dep.json"
    cli("plan", "-c", str(c), "-m", str(tiny), "--context", "256", "-o", str(dep), "-q", env=env, check=True)
    cli("launch", str(dep), "--detach", "--timeout", "120", "-q", env=env, check=True)
    sup = start_cli("supervise", str(dep), *POLICY, env=env)
    endpoint = wait_line(sup)
    return dep, sup, endpoint


def _stop(sup: subprocess.Popen, dep: Path, env: dict) -> None:
    if sup.poll() is None:
        sup.kill()
        sup.wait(timeout=30)
    cli("teardown", str(dep), "--force", "--grace", "1", env=env)


def test_rank0_sigkilled_heals_onto_rank1s_node_and_teardown_then_leaves_nothing(tmp_path, tiny, env):
    state = Path(env["CLUSTERCTL_STATE_DIR"])
    dep, sup, endpoint = _supervised(tmp_path, tiny, env)
    try:
        [m0] = manifests(state)
        os.kill(next(r["pid"] for r in m0["ranks"] if r["rank"] == 0), signal.SIGKILL)
        healed = wait_for("the heal", lambda: (lambda d: d if d.get("heals") == 1 and d.get("state") == "serving"
                                            and d.get("job") not in (None, m0["job_id"]) else None)(heal_file(state)))
        assert healed["lost_nodes"] == ["a"], healed  # never every node blamed
        [m1] = manifests(state)
        assert [r["node"] for r in m1["ranks"]] == ["b"] and m1["endpoint"] == endpoint
        assert processes_with_nonce(m0["nonce"]) == [] and ask(endpoint)

        p = cli("teardown", str(dep), env=env)
        assert p.returncode == 0, p.stderr
        assert f"supervisor of cluster t (pid {sup.pid})" in p.stderr
        assert sup.wait(timeout=10) == 0 and manifests(state) == [] and processes_with_nonce(m1["nonce"]) == []
        assert heal_file(state)["state"] == "degraded" and heal_file(state)["job"] is None
    finally:
        _stop(sup, dep, env)


def test_teardown_during_a_heal_stops_the_supervisor_and_nothing_comes_back(tmp_path, tiny, env):
    state = Path(env["CLUSTERCTL_STATE_DIR"])
    dep, sup, endpoint = _supervised(tmp_path, tiny, env)
    try:
        [m0] = manifests(state)
        os.kill(next(r["pid"] for r in m0["ranks"] if r["rank"] == 1), signal.SIGKILL)
        wait_for("healing", lambda: heal_file(state).get("state") == "healing", timeout=60)
        p = cli("teardown", str(dep), env=env)
        assert p.returncode == 0, p.stderr
        assert "no launch" not in p.stderr and f"(pid {sup.pid})" in p.stderr
        assert sup.wait(timeout=10) == 0
        nonces = {m0["nonce"]} | {m["nonce"] for m in manifests(state)}
        assert manifests(state) == []
        time.sleep(15)  # the supervisor's backoff and a relaunch would have happened by now
        assert manifests(state) == [] and not any(processes_with_nonce(n) for n in nonces)
        assert not any("clusterctl.rank" in " ".join(q.info["cmdline"] or []) and str(tmp_path) in
                       " ".join(q.info["cmdline"] or []) for q in psutil.process_iter(["cmdline"]))
        st = json.loads(cli("status", "--json", env=env, check=True).stdout)
        assert st["jobs"] == [] and st["heal"][0]["condition"] == "supervisor dead, nothing serving"
    finally:
        _stop(sup, dep, env)


def test_a_supervisor_killed_mid_heal_is_succeeded_on_the_same_port(tmp_path, tiny, env):
    state = Path(env["CLUSTERCTL_STATE_DIR"])
    dep, sup, endpoint = _supervised(tmp_path, tiny, env)
    second = None
    try:
        [m0] = manifests(state)
        frozen = next(r["pid"] for r in m0["ranks"] if r["rank"] == 1)
        os.kill(frozen, signal.SIGSTOP)
        wait_for("healing", lambda: heal_file(state).get("state") == "healing", timeout=60)
        time.sleep(2)
        sup.kill()  # SIGKILL 2 s into the heal
        sup.wait(timeout=10)
        doc = heal_file(state)
        assert doc["state"] == "healing" and doc["http_port"] == int(endpoint.rsplit(":", 1)[1])
        st = json.loads(cli("status", "--json", env=env, check=True).stdout)
        assert st["heal"][0]["supervisor_alive"] is False
        assert st["heal"][0]["condition"] == "supervisor dead, nothing serving", st["heal"]
        assert "supervisor dead, nothing serving" in cli("status", env=env).stderr

        second = start_cli("supervise", str(dep), *POLICY, env=env)
        back = wait_for("the finished heal", lambda: (lambda d: d if d.get("state") == "serving" and d.get("job")
                                                   and d.get("supervisor", {}).get("pid") == second.pid
                                                   else None)(heal_file(state)), timeout=180)
        assert back["lost_nodes"] == ["b"], back
        [m1] = manifests(state)
        assert [r["node"] for r in m1["ranks"]] == ["a"] and m1["endpoint"] == endpoint  # the same port
        assert processes_with_nonce(m0["nonce"]) == [] and ask(endpoint)
    finally:
        if second is not None and second.poll() is None:
            second.kill()
            second.wait(timeout=30)
        _stop(sup, dep, env)
        if frozen in processes_with_nonce(m0["nonce"]):  # still the stopped rank: never leave it behind
            os.kill(frozen, signal.SIGKILL)
            wait_gone([frozen])
