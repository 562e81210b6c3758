"""Launches over a REAL OpenSSH sshd: a local rank 0 and rank 1 on an SSH "node" (loopback or a namespace)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launchutil import cli, manifests, processes_with_nonce, start_cli, wait_gone, wait_line
from rankharness import tiny_model_path

pytestmark = pytest.mark.slow


def ssh_cluster(tmp: Path, sshd, *, runtime_b: str | None = None, python: str = sys.executable) -> Path:
    text = f"""
[cluster]
name = "mixed"
[[node]]
name = "a"
local = true
memory_gb = 2
ips = ["127.0.0.1"]
runtime_dir = "{tmp}/run-a"
[[node]]
name = "b"
host = "127.0.0.1"
port = {sshd.port}
user = "root"
identity_file = "{sshd.client_key}"
ips = ["127.0.0.1"]
memory_gb = 6
python = "{python}"
model_path = "{tiny_model_path()}"
runtime_dir = {json.dumps(runtime_b or f"{tmp}/run-b")}
"""
    p = tmp / "cluster.toml"
    p.write_text(text)
    return p


def plan(tmp_path, sshd, env, **kw) -> str:
    c = ssh_cluster(tmp_path, sshd, **kw)
    out = tmp_path / "dep.json"
    cli("plan", "-c", str(c), "-m", str(tiny_model_path()), "--allocation", "proportional", "--context", "512",
        "-o", str(out), "-q", env=env, check=True)
    return str(out)


def test_launch_over_ssh_with_a_hostile_runtime_path(tmp_path, sshd, env):
    canary = tmp_path / "PWNED"
    hostile = f"{tmp_path}/run b; $(touch {canary}) `touch {canary}` 'q' \"dq\""
    dep = plan(tmp_path, sshd, env, runtime_b=hostile)
    p = cli("launch", dep, "--detach", "--json", "--known-hosts", str(sshd.known_hosts), "--timeout", "180", env=env)
    assert p.returncode == 0, p.stderr
    [m] = manifests(tmp_path / "state")
    assert m["ranks"][1]["runtime_dir"] == hostile
    assert Path(m["ranks"][1]["marker_path"]).is_file()  # the literal path, on the "remote" node
    assert not canary.exists()
    nonce = m["nonce"]
    assert len(processes_with_nonce(nonce)) == 2

    st = json.loads(cli("status", "--json", "--known-hosts", str(sshd.known_hosts), env=env).stdout)
    assert [r["state"] for r in st["jobs"][0]["ranks"]] == ["serving", "serving"]

    td = cli("teardown", "--json", "--known-hosts", str(sshd.known_hosts), env=env)
    assert td.returncode == 0, td.stderr
    assert processes_with_nonce(nonce) == []
    assert manifests(tmp_path / "state") == []
    assert not canary.exists()


def test_unknown_host_key_is_refused_before_anything_starts(tmp_path, sshd, env):
    dep = plan(tmp_path, sshd, env)
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    p = cli("launch", dep, "--known-hosts", str(empty), env=env)
    assert p.returncode == 77, p.stderr
    assert "127.0.0.1" in p.stderr and "known" in p.stderr.lower()
    assert manifests(tmp_path / "state") == []


def test_sigkilled_coordinator_remote_rank_dies_and_reap_cleans_up(tmp_path, sshd, env):
    dep = plan(tmp_path, sshd, env)
    proc = start_cli("launch", dep, "--known-hosts", str(sshd.known_hosts), "--grace", "2", "--timeout", "180",
                     env=env)
    try:
        wait_line(proc)
        [m] = manifests(tmp_path / "state")
        pids = [r["pid"] for r in m["ranks"]]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        # the keeper on the "remote" node sees its SSH channel close and stops the rank by itself
        assert wait_gone(pids, timeout=30) == []
        r = cli("reap", "--json", "--known-hosts", str(sshd.known_hosts), env=env)
        assert r.returncode == 0, r.stderr
        assert manifests(tmp_path / "state") == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_preflight_reports_version_and_model_problems_over_ssh(tmp_path, sshd, env):
    fake = tmp_path / "fakepython"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    fake.chmod(0o755)
    c = ssh_cluster(tmp_path, sshd, python="/nonexistent/python3")
    out = tmp_path / "dep.json"
    cli("plan", "-c", str(c), "-m", str(tiny_model_path()), "-o", str(out), "--context", "512", "-q", env=env,
        check=True)
    p = cli("launch", str(out), "--known-hosts", str(sshd.known_hosts), env=env)
    assert p.returncode == 1
    assert "preflight failed on 1 node(s): b:" in p.stderr


def test_plan_probe_reads_memory_of_a_remote_node(tmp_path, sshd, env):
    import psutil

    c = ssh_cluster(tmp_path, sshd)
    c.write_text(c.read_text().replace("memory_gb = 6\n", ""))
    no = cli("plan", "-c", str(c), "-m", str(tiny_model_path()), "--context", "512", env=env)
    assert no.returncode == 78 and "node b has no memory_gb" in no.stderr
    p = cli("plan", "-c", str(c), "-m", str(tiny_model_path()), "--context", "512", "--probe", "--json",
            "--known-hosts", str(sshd.known_hosts), env=env)
    assert p.returncode == 0, p.stderr
    b = json.loads(p.stdout)["nodes"][1]
    assert abs(b["memory_gb"] - psutil.virtual_memory().total / 2**30) < 0.01


def test_replan_of_a_foreground_job_over_ssh_relaunches_it_in_the_foreground(tmp_path, sshd, env):
    """The old job's coordinator is asked to stop (verified), the new split starts on the same nodes, and the
    replan command becomes the new job's coordinator (Ctrl-C stops it, verified)."""
    dep = plan(tmp_path, sshd, env)
    kh = str(sshd.known_hosts)
    old = start_cli("launch", dep, "--known-hosts", kh, "--timeout", "180", env=env)
    new = None
    try:
        wait_line(old)
        [m] = manifests(tmp_path / "state")
        old_pids = [r["pid"] for r in m["ranks"]]
        assert [(r["start_layer"], r["end_layer"]) for r in m["ranks"]] == [(6, 8), (0, 6)]
        new = start_cli("replan", dep, "--allocation", "balanced", "--yes", "--json", "--known-hosts", kh,
                        "--timeout", "180", env=env)
        first = json.loads(wait_line(new))
        assert first["event"] == "replanned" and first["given"] == {"allocation": "balanced"}
        ready = json.loads(new.stdout.readline())  # written right after "replanned", once the new job is ready
        assert ready["event"] == "ready"
        assert old.wait(30) == 0  # the old coordinator stopped its ranks, verified, and exited
        assert wait_gone(old_pids, timeout=10) == []
        [m2] = manifests(tmp_path / "state")
        assert m2["job_id"] == ready["job_id"] and not m2["coordinator"]["detached"]
        assert [(r["start_layer"], r["end_layer"]) for r in m2["ranks"]] == [(4, 8), (0, 4)]
        new.send_signal(signal.SIGINT)
        assert new.wait(60) == 0
        assert processes_with_nonce(m2["nonce"]) == [] and manifests(tmp_path / "state") == []
    finally:
        for p in (old, new):
            if p is not None and p.poll() is None:
                p.kill()
        cli("teardown", "--force", "--known-hosts", kh, env=env)
