"""Two "hosts" with their own IPs (network namespaces, sshd in each): ranks talk over a real bridge."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launchutil import manifests, processes_with_nonce
from rankharness import tiny_model_path

pytestmark = pytest.mark.slow


def cluster_toml(tmp: Path, cluster) -> Path:
    lines = ["[cluster]", 'name = "ns"']
    for i, n in enumerate(cluster.nodes):
        lines += ["[[node]]", f'name = "{n.name}"', f'host = "{n.ip}"', 'user = "root"',
                  f'identity_file = "{cluster.client_key}"', f'ips = ["{n.ip}"]', f"memory_gb = {2 + 4 * i}",
                  f'python = "{sys.executable}"', f'model_path = "{tiny_model_path()}"',
                  f'runtime_dir = "{tmp}/run-{n.name}"']
    p = tmp / "cluster.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_two_hosts_serve_and_an_unreachable_host_keeps_the_manifest(tmp_path, netns_cluster):
    cluster = netns_cluster(2)
    env = {"CLUSTERCTL_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": ":".join(sys.path)}

    def cli(*args, timeout=240):
        return subprocess.run(cluster.exec_argv(["env", *[f"{k}={v}" for k, v in env.items()], sys.executable,
                                                 "-m", "clusterctl", *args]),
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    c = cluster_toml(tmp_path, cluster)
    dep = tmp_path / "dep.json"
    r = cli("plan", "-c", str(c), "-m", str(tiny_model_path()), "--allocation", "proportional", "--context", "512",
            "-o", str(dep), "-q")
    assert r.returncode == 0, r.stderr
    r = cli("launch", str(dep), "--detach", "--json", "--known-hosts", str(cluster.known_hosts), "--grace", "2")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    [m] = manifests(tmp_path / "state")
    assert m["mlx_launch_hostfile"]["hosts"][1]["ips"] == [cluster.nodes[1].ip]
    # rank 0 listens on its own host's loopback: ask from inside that host
    q = subprocess.run(["ip", "netns", "exec", cluster.nodes[0].netns, "curl", "-sf",
                        doc["endpoint"] + "/v1/completions", "-H", "Content-Type: application/json",
                        "-d", json.dumps({"prompt": "hello", "max_tokens": 4, "temperature": 0})],
                       capture_output=True, text=True, timeout=60)
    if q.returncode == 127:
        pytest.skip("no curl")
    assert q.returncode == 0 and json.loads(q.stdout)["usage"]["completion_tokens"] == 4

    cluster.cut(cluster.nodes[1])
    try:
        r = cli("teardown", "--json", "--known-hosts", str(cluster.known_hosts), "--grace", "2")
        assert r.returncode == 1, r.stderr
        ranks = json.loads(r.stdout)["jobs"][0]["ranks"]
        assert ranks[1]["status"] == "unreachable" and ranks[1]["node"] == "node1"
        assert len(manifests(tmp_path / "state")) == 1  # kept for a retry
    finally:
        cluster.restore(cluster.nodes[1])
    r = cli("teardown", "--json", "--known-hosts", str(cluster.known_hosts), "--grace", "2")
    assert r.returncode == 0, r.stderr
    assert manifests(tmp_path / "state") == []
    assert processes_with_nonce(m["nonce"]) == []
