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


def ns_cli(cluster, env: dict, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The CLI run inside the coordinator's namespace."""
    return subprocess.run(cluster.exec_argv(["env", *[f"{k}={v}" for k, v in env.items()], sys.executable,
                                             "-m", "clusterctl", *args]),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_two_hosts_serve_and_an_unreachable_host_keeps_the_manifest(tmp_path, netns_cluster):
    cluster = netns_cluster(2)
    env = {"CLUSTERCTL_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": ":".join(sys.path)}

    def cli(*args, timeout=240):
        return ns_cli(cluster, env, *args, timeout=timeout)

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


def test_a_cut_link_shorter_than_the_grace_is_survived_a_longer_one_ends_every_rank(tmp_path, netns_cluster):
    import time

    cluster = netns_cluster(2)
    env = {"CLUSTERCTL_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": ":".join(sys.path),
           "CLUSTERCTL_PEER_ABORT_GRACE": "6"}

    def cli(*args, timeout=240):
        return ns_cli(cluster, env, *args, timeout=timeout)

    def ask() -> int:
        q = subprocess.run(["ip", "netns", "exec", cluster.nodes[0].netns, "curl", "-sf",
                            doc["endpoint"] + "/v1/completions", "-H", "Content-Type: application/json",
                            "-d", json.dumps({"prompt": "hello", "max_tokens": 4, "temperature": 0})],
                           capture_output=True, text=True, timeout=60)
        if q.returncode == 127:
            pytest.skip("no curl")
        assert q.returncode == 0, q.stderr
        return json.loads(q.stdout)["usage"]["completion_tokens"]

    def rank_log(r: int) -> str:
        p = Path(m["ranks"][r]["log_path"])
        return p.read_text(errors="replace") if p.exists() else ""

    def ladder(log: str) -> list[str]:
        keys = ("missed 2 probes", "abort stage", "answers again", " lost: ")
        return [k for ln in log.splitlines() for k in keys if k in ln]

    c = cluster_toml(tmp_path, cluster)
    dep = tmp_path / "dep.json"
    r = cli("plan", "-c", str(c), "-m", str(tiny_model_path()), "--context", "512", "-o", str(dep), "-q")
    assert r.returncode == 0, r.stderr
    r = cli("launch", str(dep), "--detach", "--json", "--known-hosts", str(cluster.known_hosts), "--grace", "2")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    [m] = manifests(tmp_path / "state")
    assert ask() == 4

    cluster.cut(cluster.nodes[1])  # 3.5 s: 2 probes (1 s each) miss, the ladder starts, the grace (6 s) is not used up
    time.sleep(3.5)
    cluster.restore(cluster.nodes[1])
    deadline = time.monotonic() + 15
    while "answers again" not in rank_log(0):
        assert time.monotonic() < deadline, rank_log(0)
        time.sleep(0.1)
    assert ladder(rank_log(0)) == ["missed 2 probes", "abort stage", "answers again"]
    assert len(processes_with_nonce(m["nonce"])) == 2
    assert ask() == 4  # the ring is whole again

    cluster.cut(cluster.nodes[1])  # longer than 2 probes + the grace: both sides give up
    try:
        deadline = time.monotonic() + 30
        while processes_with_nonce(m["nonce"]):
            assert time.monotonic() < deadline, (rank_log(0)[-1500:], rank_log(1)[-1500:])
            time.sleep(0.2)
    finally:
        cluster.restore(cluster.nodes[1])
    for r in (0, 1):
        assert ladder(rank_log(r))[-3:] == ["missed 2 probes", "abort stage", " lost: "], rank_log(r)
        marker = json.loads(Path(m["ranks"][r]["marker_path"]).read_text())
        assert marker["state"] == "lost"
    st = cli("status", "--json", "--known-hosts", str(cluster.known_hosts))
    assert [x["state"] for x in json.loads(st.stdout)["jobs"][0]["ranks"]] == ["lost", "lost"]
    rp = cli("reap", "--json", "--known-hosts", str(cluster.known_hosts), "--grace", "2")
    assert rp.returncode == 0, rp.stderr
    assert manifests(tmp_path / "state") == []
