"""The front's files on the coordinator: who serves which stable address, and what the heal supervisor says.

    <state>/fronts/<host>_<port>.json   FrontRecord, written atomically by the front itself once it listens,
                                        removed when it exits; identity = (host, pid, start time, boot id, nonce)
    <state>/fronts/<host>_<port>.log    a detached front's stdout and stderr
    <state>/heal/<cluster>.json         {"state": "serving|healing|degraded", "reason": str|null, "since": ISO}
                                        (written by the heal supervisor; read here, tolerantly)

Signals go only to a front whose record's pid, start time and nonce still match (node/procs.py). docs/front.md.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from clusterctl.atomic import atomic_write_bytes, dumps, read_capped, read_json
from clusterctl.errors import ClusterctlError, ConfigError, Exit, one_line
from clusterctl.names import clip
from clusterctl.front.apikey import check_bind_host
from clusterctl.statedir.state import StateDir
from clusterctl.statedir.manifest import manifest_store
from clusterctl.protocol.deployment import decode
from clusterctl.node.procs import Identity, signal_process, status_of

SCHEMA_VERSION = 1


class FrontRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1] = SCHEMA_VERSION
    type: Literal["front"] = "front"
    url: str
    bind_host: str
    port: int
    cluster: str
    host: str  # this machine's name: a record is judged only where it was written
    pid: int
    start_time: float | None
    boot_id: str | None
    nonce: str | None  # in the environment of a front started detached; None for one run in a terminal
    started_at: str
    auto: bool = False  # started by `launch --front` / `replan --front`: teardown and the linger end it
    linger_s: float = 0.0  # exit after this long with nothing to follow (0: never)


# ---- addresses ----------------------------------------------------------------------------------------------------

def parse_front(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for an IPv6 address) -> (host, port); ValueError says what is wrong."""

    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{clip(value, 60)!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{clip(value, 60)!r}: write an IPv6 address in brackets, [ADDR]:PORT")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{clip(value, 60)!r}: the port must be 1-65535")
    return check_bind_host(host), int(port)


def url_of(host: str, port: int) -> str:
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def _slug(host: str, port: int) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in host) + f"_{port}"


def record_path(state: StateDir, host: str, port: int) -> Path:
    return state.fronts / f"{_slug(host, port)}.json"


def log_path(state: StateDir, host: str, port: int) -> Path:
    return state.fronts / f"{_slug(host, port)}.log"


# ---- records ------------------------------------------------------------------------------------------------------

def write_record(state: StateDir, rec: FrontRecord) -> Path:
    p = record_path(state, rec.bind_host, rec.port)
    atomic_write_bytes(p, dumps(rec.model_dump(mode="json")), mode=0o600)
    return p


def read_record(path: Path) -> FrontRecord | None:
    """A front record, or None when missing, truncated or foreign (never raises)."""
    try:
        return FrontRecord.model_validate(read_json(path, limit=65536, what="front record"))
    except (ClusterctlError, ValidationError, OSError, ValueError, TypeError):
        return None


def records(state: StateDir) -> list[tuple[Path, FrontRecord]]:
    folder = state.fronts
    try:
        paths = sorted(folder.glob("*.json"))
    except OSError:
        return []
    return [(p, r) for p in paths if (r := read_record(p)) is not None]


def identity_of(rec: FrontRecord):
    return Identity(pid=rec.pid, start_time=rec.start_time, nonce=rec.nonce, boot_id=rec.boot_id)


def is_alive(rec: FrontRecord) -> bool:
    """Is the front of this record still running? (another machine's record: assumed so)"""

    if rec.host != socket.gethostname():
        return True
    return status_of(identity_of(rec)) in ("alive", "unverifiable")


def live_fronts(state: StateDir, cluster: str | None = None) -> list[FrontRecord]:
    """Every running front (of ``cluster``); a record whose front is gone is removed on the way."""
    out = []
    for p, rec in records(state):
        if is_alive(rec):
            if cluster is None or rec.cluster == cluster:
                out.append(rec)
        else:
            remove_record(p, rec)
    return out


def remove_record(path: Path, rec: FrontRecord | None = None) -> None:
    """Remove a record (only if it still names ``rec``'s process, when given)."""
    if rec is not None:
        now = read_record(path)
        if now is not None and (now.pid, now.nonce) != (rec.pid, rec.nonce):
            return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---- starting and stopping a detached front -----------------------------------------------------------------------

def front_argv(state: StateDir, cluster: str, host: str, port: int, *, linger: float, auto: bool,
               known_hosts: Path | None = None, accept_new: bool = False) -> list[str]:
    argv = [sys.executable, "-m", "clusterctl.front.proxy", "--state-dir", str(state.root), "--cluster", cluster,
            "--host", host, "--port", str(port), "--linger", f"{linger:g}"]
    if auto:
        argv.append("--auto")
    if known_hosts is not None:
        argv += ["--known-hosts", str(known_hosts)]
    if accept_new:
        argv.append("--accept-new-host-keys")
    return argv


def ensure_front(state: StateDir, cluster: str, host: str, port: int, *, linger: float = 300.0, auto: bool = True,
                 known_hosts: Path | None = None, accept_new: bool = False,
                 timeout: float = 20.0) -> tuple[FrontRecord, bool]:
    """The front serving ``host:port`` for ``cluster``: the running one, or a detached one started now.
    Returns (its record, whether it was started here). ConfigError when that address is another cluster's
    front; a front that cannot listen (port in use, an address not of this machine) is one line (exit 69)."""
    for rec in live_fronts(state):
        if (rec.bind_host, rec.port) == (host, port):
            if rec.cluster != cluster:
                raise ConfigError(f"{url_of(host, port)} is the front of cluster {rec.cluster}, not {cluster}",
                                  hint="give another --front address, or stop that front: clusterctl front --stop "
                                       f"{host}:{port}")
            return rec, False
    return spawn_front(state, front_argv(state, cluster, host, port, linger=linger, auto=auto,
                                         known_hosts=known_hosts, accept_new=accept_new), host, port,
                       timeout=timeout), True


def spawn_front(state: StateDir, argv: list[str], host: str, port: int, *, timeout: float = 20.0) -> FrontRecord:
    """Start a front detached (its own session, stdin closed, output to its log) and wait until it listens."""
    log = log_path(state, host, port)
    log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    nonce = secrets.token_hex(8)
    env = {**os.environ, "CLUSTERCTL_NONCE": nonce}
    for k in ("CLUSTERCTL_API_KEY",):  # the front reads keys from rank 0's contract, never from here
        env.pop(k, None)
    with open(log, "ab", buffering=0) as out:
        os.chmod(log, 0o600)
        start = out.tell()
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                             start_new_session=True, close_fds=True)
    deadline = time.monotonic() + timeout
    path = record_path(state, host, port)
    while time.monotonic() < deadline:
        rec = read_record(path)
        if rec is not None and rec.pid == p.pid and rec.nonce == nonce:
            return rec
        if p.poll() is not None:
            raise ClusterctlError(f"the front on {url_of(host, port)} did not start: {_last_line(log, start)}",
                                  exit_code=Exit.UNAVAILABLE)
        time.sleep(0.05)
    p.kill()
    raise ClusterctlError(f"the front on {url_of(host, port)} did not listen within {timeout:g} s (log: {log})",
                          exit_code=Exit.UNAVAILABLE)


def _last_line(log: Path, start: int) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(start)
            lines = [x for x in f.read(65536).decode("utf-8", "replace").splitlines() if x.strip()]
    except OSError:
        lines = []
    line = lines[-1] if lines else "it exited without a word"
    return one_line(line.removeprefix("error: "))


def stop_front(state: StateDir, rec: FrontRecord, *, grace: float = 10.0) -> bool:
    """TERM the front (identity checked), wait up to ``grace``, then KILL; True once it is gone."""

    if rec.host != socket.gethostname():
        return False
    ident = identity_of(rec)
    if signal_process(ident, signal.SIGTERM) not in ("alive",):
        remove_record(record_path(state, rec.bind_host, rec.port), rec)
        return status_of(ident) != "alive"
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and status_of(ident) == "alive":
        time.sleep(0.05)
    if status_of(ident) == "alive":
        signal_process(ident, signal.SIGKILL)
        time.sleep(0.2)
    gone = status_of(ident) != "alive"
    if gone:
        remove_record(record_path(state, rec.bind_host, rec.port), rec)
    return gone


def summary(rec: FrontRecord) -> dict:
    return {"url": rec.url, "cluster": rec.cluster, "pid": rec.pid, "auto": rec.auto, "started_at": rec.started_at,
            "linger_s": rec.linger_s}


def cluster_of_deployment(state: StateDir, deployment_id: str, deployment_file: str | None = None) -> str | None:
    """The cluster of a deployment, read only (the state dir's record, else the file a launch was given)."""

    for path in (state.deployments / f"{deployment_id}.json", deployment_file):
        if not path:
            continue
        try:
            return decode(read_capped(path, what="deployment file"), state.keyring.public_keys(),
                          source=str(path)).deployment.cluster
        except (ClusterctlError, OSError):
            continue
    return None


def clusters_with_jobs(state: StateDir) -> set[str]:
    """The clusters that have a launch manifest (live or not) in the state dir."""

    if not state.launches.is_dir():
        return set()
    good, _ = manifest_store(state).all()
    return {c for _, m in good if (c := cluster_of_deployment(state, m.deployment_id, m.deployment_file))}


def stop_idle_auto_fronts(state: StateDir, *, grace: float = 10.0) -> list[FrontRecord]:
    """After a teardown: every front a launch started (``auto``) whose cluster has no job left, stopped."""
    fronts = [r for r in live_fronts(state) if r.auto]
    if not fronts:
        return []
    busy = clusters_with_jobs(state)
    return [r for r in fronts if r.cluster not in busy and stop_front(state, r, grace=grace)]


def front_health(rec: FrontRecord, timeout: float = 1.0) -> str:
    """What the front's own /health says: serving, healing, degraded, unavailable, or unreachable."""
    import json
    import urllib.error
    import urllib.request

    host = rec.bind_host if rec.bind_host not in ("0.0.0.0", "::") else "127.0.0.1"
    try:
        with urllib.request.urlopen(url_of(host, rec.port) + "/health", timeout=timeout) as r:
            doc = json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            doc = json.loads(e.read())
        except ValueError:
            return "unreachable"
    except (OSError, ValueError):
        return "unreachable"
    st = doc.get("status") if isinstance(doc, dict) else None
    return "serving" if st == "ok" else str(st or "unreachable")


def annotate_jobs(state: StateDir, jobs: list) -> list[dict]:
    """For ``status``: every running front (url, cluster, pid...), and on each job (launch/status.py's
    JobStatus) of a cluster with a front ``front`` = its URL (None without one). Reads files only."""
    fronts = live_fronts(state)
    by_cluster: dict[str, str] = {}
    for r in fronts:
        by_cluster.setdefault(r.cluster, r.url)
    for j in jobs:
        c = cluster_of_deployment(state, j.deployment_id) if by_cluster else None
        j.front = by_cluster.get(c) if c else None
    return [summary(r) for r in fronts]
