"""Real OpenSSH sshd fixtures: sshd on 127.0.0.1 (one or several "nodes"), and sshd per network namespace.

Everything here is real: /usr/sbin/sshd with a private config, keys from ssh-keygen, namespaces from `ip netns`.
Missing sshd, missing root or missing netns support skips the tests that need them, with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from clusterctl.connect.ssh_policy import SshTarget
from slowguard import require_slow
from testports import free_port  # noqa: F401  (this worker's own ports; test_transport takes it from here)

SSHD = "/usr/sbin/sshd"
READY_TIMEOUT = 10.0


def _why_no_sshd() -> str | None:
    if not os.path.exists(SSHD):
        return f"{SSHD} is not installed (scripts/bootstrap installs openssh-server)"
    if os.geteuid() != 0:
        return "sshd tests need root (sshd must switch to the test user)"
    if not shutil.which("ssh-keygen"):
        return "ssh-keygen is not installed"
    return None


def keygen(path: Path, comment: str = "clusterctl-test") -> Path:
    """A fresh ed25519 key pair without passphrase; returns the private key path (``.pub`` beside it)."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, stdin=subprocess.DEVNULL, capture_output=True)
    return path


def public_key(path: Path) -> str:
    """``type base64`` of a key pair's public half."""
    parts = Path(str(path) + ".pub").read_text().split()
    return f"{parts[0]} {parts[1]}"




def _wait_banner(host: str, port: int, proc: subprocess.Popen, log: Path, netns: str | None = None) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited with {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        if netns is None:
            try:
                with socket.create_connection((host, port), timeout=1.0) as s:
                    if s.recv(64).startswith(b"SSH-2.0"):
                        return
            except OSError:
                pass
        elif f" {host}:{port} ".encode() in subprocess.run(
                ["ip", "netns", "exec", netns, "ss", "-Hltn"], capture_output=True).stdout.replace(b"\t", b" ") + b" ":
            return
        time.sleep(0.05)
    raise RuntimeError(f"sshd on {host}:{port} did not come up: {log.read_text(errors='replace')[-2000:]}")


SSHD_CONFIG = """\
Port {port}
ListenAddress {host}
HostKey {host_key}
PidFile {folder}/sshd.pid
AuthorizedKeysFile {authorized_keys}
UsePAM no
StrictModes no
PermitRootLogin yes
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
AllowAgentForwarding no
X11Forwarding no
PrintMotd no
MaxStartups 64:30:128
MaxSessions 16
LogLevel VERBOSE
{extra}
"""


@dataclass
class Sshd:
    """One running sshd with its own host key; the client key is in its authorized_keys."""

    folder: Path
    host: str
    port: int
    host_key: Path
    client_key: Path
    known_hosts: Path
    proc: subprocess.Popen | None = None
    netns: str | None = None
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.folder / "sshd.log"

    @property
    def host_spec(self) -> str:
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"

    def target(self, **overrides) -> SshTarget:
        base = dict(host=self.host, port=self.port, identity_file=self.client_key, known_hosts=self.known_hosts,
                    user="root", connect_timeout=5.0)
        base.update(overrides)
        return SshTarget(**base)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_sshd(folder: Path, *, client_key: Path, host: str = "127.0.0.1", port: int | None = None,
               netns: str | None = None, extra_config: str = "") -> Sshd:
    """Start `sshd -D -e -f cfg` (inside ``netns`` when given) and wait until it answers."""
    require_slow("a real sshd" + (f" in network namespace {netns}" if netns else ""))
    folder.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege separation dir sshd insists on
    host_key = keygen(folder / "host_key", "clusterctl-test-host")
    authorized = folder / "authorized_keys"
    authorized.write_text(Path(str(client_key) + ".pub").read_text())
    known_hosts = folder / "known_hosts"
    for attempt in range(5):
        p = port or free_port(host)
        spec = host if p == 22 else f"[{host}]:{p}"
        known_hosts.write_text(f"{spec} {public_key(host_key)}\n")
        cfg = folder / "sshd_config"
        cfg.write_text(SSHD_CONFIG.format(port=p, host=host, host_key=host_key, folder=folder,
                                          authorized_keys=authorized, extra=extra_config))
        argv = [SSHD, "-D", "-e", "-f", str(cfg)]
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        log = open(folder / "sshd.log", "ab")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        node = Sshd(folder, host, p, host_key, client_key, known_hosts, proc, netns)
        try:
            _wait_banner(host, p, proc, node.log, netns)
            return node
        except RuntimeError:
            node.stop()
            if port is not None or attempt == 4:
                raise
    raise AssertionError("unreachable")


class SshdFactory:
    def __init__(self, root: Path):
        self.root = root
        self.client_key = keygen(root / "client_key", "clusterctl-test-client")
        self.started: list[Sshd] = []

    def __call__(self, **kwargs) -> Sshd:
        node = start_sshd(self.root / f"sshd{len(self.started)}", client_key=self.client_key, **kwargs)
        self.started.append(node)
        return node

    def close(self) -> None:
        for node in self.started:
            node.stop()


@pytest.fixture(scope="session")
def sshd_factory(tmp_path_factory):
    """Start extra sshd "nodes" on 127.0.0.1 (each its own port and host key, one shared client key)."""
    why = _why_no_sshd()
    if why:
        pytest.skip(why)
    factory = SshdFactory(tmp_path_factory.mktemp("sshd"))
    yield factory
    factory.close()


@pytest.fixture(scope="session")
def sshd(sshd_factory) -> Sshd:
    """One real sshd on 127.0.0.1 with a known_hosts file that trusts it."""
    return sshd_factory()


# ---------------------------------------------------------------------------------------------- namespaces

def _why_no_netns() -> str | None:
    why = _why_no_sshd()
    if why:
        return why
    if not shutil.which("ip"):
        return "iproute2 (`ip`) is not installed"
    probe = f"cctprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create network namespaces: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")


@dataclass
class NetnsNode:
    name: str
    netns: str
    ip: str
    device: str  # the node's end of its veth pair, inside its namespace
    sshd: Sshd

    def target(self, **overrides) -> SshTarget:
        return self.sshd.target(**overrides)


@dataclass
class NetnsCluster:
    """A coordinator namespace with a bridge (10.77.S.1) and one namespace per node (10.77.S.10+i), each with
    its own sshd on port 22. Nothing is addressed outside these namespaces."""

    coordinator: str
    coordinator_ip: str
    nodes: list[NetnsNode]
    known_hosts: Path
    client_key: Path
    namespaces: list[str]

    def exec_argv(self, argv: list[str], netns: str | None = None) -> list[str]:
        """Run ``argv`` inside a namespace (the coordinator's by default)."""
        return ["ip", "netns", "exec", netns or self.coordinator, *argv]

    def cut(self, node: NetnsNode) -> None:
        _ip("link", "set", node.device, "down", netns=node.netns)

    def restore(self, node: NetnsNode) -> None:
        _ip("link", "set", node.device, "up", netns=node.netns)


class NetnsBed:
    """Builds NetnsClusters under ``root`` and deletes every namespace and sshd it made in ``close()``. The
    ``netns_cluster`` fixture and bench/faults.py use it; ``why_not()`` says why it cannot run here."""

    why_not = staticmethod(lambda: _why_no_netns())

    def __init__(self, root: Path):
        self.root = Path(root)
        self.made: list[str] = []
        self.daemons: list[Sshd] = []
        self.tag = f"cct{os.getpid() % 100000}x{time.monotonic_ns() % 1000}"
        self.subnet = 10 + (os.getpid() + time.monotonic_ns() // 1000) % 200
        self.built = 0

    def build(self, n: int, *, sshd_extra: str = "") -> NetnsCluster:
        require_slow(f"{n + 1} network namespaces with sshd")
        b = self.built
        self.built += 1
        tag, subnet = f"{self.tag}{'abcdefghij'[b % 10]}", (self.subnet + b) % 200 + 10
        root = self.root / f"netns{b}" if b else self.root
        root.mkdir(parents=True, exist_ok=True)
        made, daemons = self.made, self.daemons
        client_key = keygen(root / "netns_client_key")
        coord = f"{tag}c"
        _ip("netns", "add", coord)
        made.append(coord)
        _ip("link", "set", "lo", "up", netns=coord)
        _ip("link", "add", "br0", "type", "bridge", netns=coord)
        _ip("addr", "add", f"10.77.{subnet}.1/24", "dev", "br0", netns=coord)
        _ip("link", "set", "br0", "up", netns=coord)
        nodes: list[NetnsNode] = []
        lines = []
        for i in range(n):
            ns = f"{tag}n{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "set", "lo", "up", netns=ns)
            # create the pair inside the coordinator namespace, then move one end into the node's
            _ip("link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0", netns=coord)
            _ip("link", "set", "eth0", "netns", ns, netns=coord)
            _ip("link", "set", f"h{i}", "master", "br0", netns=coord)
            _ip("link", "set", f"h{i}", "up", netns=coord)
            ip = f"10.77.{subnet}.{10 + i}"
            _ip("addr", "add", f"{ip}/24", "dev", "eth0", netns=ns)
            _ip("link", "set", "eth0", "up", netns=ns)
            node_sshd = start_sshd(root / f"ns{i}", client_key=client_key, host=ip, port=22, netns=ns,
                                   extra_config=sshd_extra)
            daemons.append(node_sshd)
            lines.append(node_sshd.known_hosts.read_text())
            nodes.append(NetnsNode(f"node{i}", ns, ip, "eth0", node_sshd))
        known_hosts = root / "netns_known_hosts"
        known_hosts.write_text("".join(lines))
        for node in nodes:
            node.sshd.known_hosts = known_hosts
        return NetnsCluster(coord, f"10.77.{subnet}.1", nodes, known_hosts, client_key, list(made))

    def close(self) -> None:
        for d in self.daemons:
            with contextlib.suppress(Exception):
                d.stop()
        for ns in reversed(self.made):
            _kill_namespace_processes(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()
        self.daemons.clear()


@pytest.fixture
def netns_cluster(tmp_path):
    """Factory: ``netns_cluster(n, sshd_extra="...")`` -> NetnsCluster. Always deleted in teardown."""
    why = _why_no_netns()
    if why:
        pytest.skip(why)
    bed = NetnsBed(tmp_path)
    yield bed.build
    bed.close()


def _kill_namespace_processes(ns: str) -> None:
    # Only processes inside a namespace this fixture created (sessions, keepers, test drivers).
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in r.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
