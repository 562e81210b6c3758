"""What the front follows: the cluster's current job, its rank 0's endpoint, and the access rules rank 0 enforces.

The current job of a cluster is picked from the live launch manifests (``<state>/launches/*.json``, signed; only
those re-read whose file changed): a ``ready`` job with an endpoint, of a deployment of this cluster, whose
coordinator is alive — the replan history's current deployment first, else the newest. Its API keys and CORS
origins are read from rank 0's own signed contract (on rank 0's node, through the node seam), so the front
enforces exactly what rank 0 enforces, for any job however it was launched (launch, replan, a heal).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from clusterctl.errors import ClusterctlError, IntegrityError
from clusterctl.statedir import history
from clusterctl.front.records import cluster_of_deployment
from clusterctl.statedir.manifest import coordinator_alive, manifest_store
from clusterctl.connect.nodes import close_all, handles
from clusterctl.protocol.contract import MAX_CONTRACT_BYTES, read_contract
from clusterctl.protocol.httpedge import Access
from clusterctl.statedir.state import StateDir


@dataclass(frozen=True)
class Target:
    job_id: str
    deployment_id: str
    endpoint: str  # rank 0's base URL
    rules: Access  # who may call, from which origins (the edge's rules: protocol/httpedge.py)


def rules_of_spec(spec) -> Access:
    return Access.of(spec.tenant_keys(), spec.cors_origins)


async def read_rules(state: StateDir, m, ssh) -> Access:
    """Rank 0's keys and CORS origins from its contract on its node, read as the rank reads it
    (protocol/contract.read_contract) with this state dir's keys. ClusterctlError when it cannot be read or verified."""

    r0 = m.ranks[0]
    node = next(n for n in m.nodes if n.name == r0.node)
    hs = handles([node], ssh)
    try:
        data = await hs[node.name].read_file(r0.contract_path, limit=MAX_CONTRACT_BYTES)
    finally:
        await close_all(hs)
    source = f"rank 0's contract of job {m.job_id}"
    spec = read_contract(data, r0.node, state.keyring.public_keys(), source=source)
    if spec.job_id != m.job_id:
        raise IntegrityError(f"{source} names another job")
    return rules_of_spec(spec)


def reachable(m) -> str:
    """Rank 0's endpoint as this machine reaches it: a rank bound to every address (0.0.0.0, ::) is reached at its
    node's host (loopback for a local node)."""
    from urllib.parse import urlsplit

    url = m.endpoint.rstrip("/")
    parts = urlsplit(url)
    if parts.hostname not in ("0.0.0.0", "::"):
        return url
    r0 = m.ranks[0]
    host = "127.0.0.1" if r0.local else r0.host
    return f"{parts.scheme}://{'[' + host + ']' if ':' in host else host}:{parts.port}"


@dataclass
class Follower:
    """The front's view of its cluster, refreshed by ``refresh()`` (cheap when nothing changed)."""

    state: object
    cluster: str
    ssh: object
    target: Target | None = None
    last_rules: Access | None = None  # the last job's rules: still enforced while no rank 0 serves
    has_jobs: bool = False  # any launch manifest of this cluster (live or not)
    _files: dict = field(default_factory=dict)  # path -> ((mtime_ns, size), manifest | None)
    _clusters: dict = field(default_factory=dict)  # deployment id -> cluster name
    _stamp: int | None = None  # the launches folder's mtime at the last scan
    _bad_rules: dict = field(default_factory=dict)  # job id -> error seen (said once)
    down: set = field(default_factory=set)  # jobs whose rank 0 did not answer: passed over while another serves
    log: object = print

    def _manifests(self) -> list:
        try:  # every manifest write is a rename into the folder: an unchanged folder has unchanged files
            stamp = os.stat(self.state.launches).st_mtime_ns
        except OSError:
            stamp = None
        if stamp is not None and stamp == self._stamp:
            return [m for _, m in self._files.values() if m is not None]
        # a folder changed within the clock's tick (a few ms) may change again under the same mtime: look again
        self._stamp = stamp if stamp is not None and time.time_ns() - stamp > 100_000_000 else None
        store = manifest_store(self.state)
        seen = {}
        try:
            entries = list(os.scandir(self.state.launches))
        except OSError:
            entries = []
        for e in entries:
            if not e.name.endswith(".json") or e.name.startswith("."):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            key = (st.st_mtime_ns, st.st_size)
            old = self._files.get(e.path)
            if old is not None and old[0] == key:
                seen[e.path] = old
                continue
            try:
                m = store.load(e.path)
            except Exception:  # a manifest being replaced, or foreign: skipped until it changes
                m = None
            seen[e.path] = (key, m)
        self._files = seen
        return [m for _, m in seen.values() if m is not None]

    def rescan(self) -> None:
        """The next refresh reads the launches folder whatever its mtime says."""
        self._stamp = None

    def _cluster_of(self, m) -> str | None:
        if m.deployment_id not in self._clusters:
            name = cluster_of_deployment(self.state, m.deployment_id, m.deployment_file)
            if name is None:
                return None  # not cached: the file may appear later
            self._clusters[m.deployment_id] = name
        return self._clusters[m.deployment_id]

    def _pick(self, ms: list):
        ours = [m for m in ms if self._cluster_of(m) == self.cluster]
        self.has_jobs = bool(ours)
        live = [m for m in ours if m.state == "ready" and m.endpoint and coordinator_alive(m.coordinator)]
        if not live:
            return None
        live = [m for m in live if m.job_id not in self.down] or live  # all silent: the best one all the same
        try:
            current = history.current(self.state, self.cluster)
        except ClusterctlError:
            current = None
        return max(live, key=lambda m: (m.deployment_id == current, m.created_at, m.job_id))

    async def refresh(self) -> Target | None:
        m = self._pick(self._manifests())
        if m is None:
            self.target = None
            return None
        if self.target is not None and self.target.job_id == m.job_id:
            return self.target
        try:
            rules = await read_rules(self.state, m, self.ssh)
        except (ClusterctlError, OSError, StopIteration, IndexError) as e:
            if m.job_id not in self._bad_rules:
                self._bad_rules[m.job_id] = str(e)
                self.log(f"front: job {m.job_id} not followed: {getattr(e, 'message', e)}")
            self.target = None
            return None
        self.target = Target(job_id=m.job_id, deployment_id=m.deployment_id, endpoint=reachable(m), rules=rules)
        self.last_rules = rules
        self.log(f"front: following job {m.job_id} at {self.target.endpoint}")
        return self.target
