"""The supervisor's command line and what `status` makes of its state file (fast: no ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launchutil import cli


def _state_file(state: Path, name: str, doc) -> Path:
    p = state / "heal" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


@pytest.mark.slow
def test_heal_and_detach_contradict_and_supervise_names_a_missing_deployment(tmp_path, env):
    p = cli("launch", "nope", "--heal", "--detach", env=env)
    assert p.returncode == 2 and "clusterctl supervise" in p.stderr
    p = cli("supervise", "nope", "--heal-grace", "1", "--rejoin-after", "2", env=env)
    assert p.returncode == 66, p.stderr
    p = cli("supervise", "nope", "--heal-max", "0", env=env)
    assert p.returncode == 2


@pytest.mark.slow
def test_status_shows_each_supervisors_state_and_ignores_a_garbled_file(tmp_path, env):
    state = Path(env["CLUSTERCTL_STATE_DIR"])
    _state_file(state, "t.json", {
        "schema_version": 1, "state": "degraded", "reason": "the model does not fit on a (b lost): needs 9 GiB",
        "since": "2026-12-05T12:00:00Z", "heals": 2, "degraded_seconds": 61.5, "deployment": "t-1", "job": None,
        "cluster": "t", "original": "t-0", "lost_nodes": ["b"],
        "supervisor": {"host": "elsewhere-host", "pid": 1, "start_time": 1.0, "boot_id": None, "detached": False}})
    _state_file(state, "u.json", '{"state": "serving", "deployment": ')  # truncated
    _state_file(state, "v.json", {"state": "asleep", "deployment": "v-1"})  # not a state
    p = cli("status", "--json", env=env)
    assert p.returncode == 0, p.stderr
    [h] = json.loads(p.stdout)["heal"]
    assert h["state"] == "degraded" and h["heals"] == 2 and h["lost_nodes"] == ["b"]
    p = cli("status", env=env)
    assert p.returncode == 0 and "heal t: degraded since 2026-12-05T12:00:00Z: the model does not fit" in p.stderr
    assert "2 heal(s), 62 s degraded" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_status_says_a_dead_supervisors_healing_is_nothing_serving(tmp_path, env):
    """A supervisor killed mid-heal leaves ``healing`` in its file: `status` says what is, not its last word."""
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os, psutil; p = psutil.Process(); "
                           "print(p.pid, p.create_time())"], capture_output=True, text=True, check=True)
    pid, start = gone.stdout.split()
    import socket

    state = Path(env["CLUSTERCTL_STATE_DIR"])
    _state_file(state, "t.json", {
        "schema_version": 1, "state": "healing", "reason": "rank 1 on b lost; leaving out b",
        "since": "2026-12-05T12:00:00Z", "heals": 0, "degraded_seconds": 0.0, "deployment": "t-1",
        "job": "t-1-20261205120000-abcdef", "cluster": "t", "original": "t-1", "lost_nodes": [],
        "leaving_out": ["b"], "http_host": "127.0.0.1", "http_port": 27570,
        "supervisor": {"host": socket.gethostname(), "pid": int(pid), "start_time": float(start), "boot_id": None,
                       "detached": False}})
    p = cli("status", "--json", env=env)
    assert p.returncode == 0, p.stderr
    [h] = json.loads(p.stdout)["heal"]
    assert h["supervisor_alive"] is False and h["condition"] == "supervisor dead, nothing serving"
    p = cli("status", env=env)
    assert "heal t: supervisor dead, nothing serving (its last word: healing since" in p.stderr, p.stderr


def test_teardown_refuses_with_75_a_supervisor_it_cannot_stop_naming_it(tmp_path, env):
    """A supervisor that holds its cluster's lock but runs elsewhere (or is not the pid its file names) is not
    signalled: teardown exits 75 naming its pid and how to stop it, and touches nothing."""
    from clusterctl.locks import Lock

    state = Path(env["CLUSTERCTL_STATE_DIR"])
    _state_file(state, "t.json", {
        "schema_version": 1, "state": "healing", "reason": "rank 1 on b dead; leaving out b",
        "since": "2026-12-05T12:00:00Z", "heals": 0, "degraded_seconds": 0.0, "deployment": "t-1", "job": None,
        "cluster": "t", "original": "t-1", "lost_nodes": [],
        "supervisor": {"host": "elsewhere-host", "pid": 4242, "start_time": 1.0, "boot_id": None, "detached": False}})
    before = (state / "heal" / "t.json").read_bytes()
    lock = Lock(state / "locks" / "heal-t.lock").acquire()  # the supervisor, alive, holds it
    try:
        p = cli("teardown", env=env)
    finally:
        lock.release()
    assert p.returncode == 75, p.stderr
    assert "supervised by pid 4242 on elsewhere-host" in p.stderr and "kill 4242" in p.stderr
    assert "no launch" not in p.stderr and (state / "heal" / "t.json").read_bytes() == before
