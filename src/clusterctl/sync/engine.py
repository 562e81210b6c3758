"""`clusterctl sync`: make every node of a deployment hold the planned model at its own path (docs/sync.md).

1. Every node compares its copy (at its ``path_map`` path) with the planned manifest, on the node, concurrently:
   ``ok``, ``missing``, ``partial``, ``stale``, or ``unreachable``.
2. A source is chosen: the coordinator's copy when it hashes to the plan, else a node that is ``ok`` (staged
   here first), else (``download``) an HTTP mirror. ``auto`` says which and why.
3. Nodes that are not ``ok`` get exactly the files they lack or hold wrong, a bounded number at a time, then
   re-hash those files on the node; a node is ``ok`` only once that check passes.

Nothing is ever deleted on a node: extra files stay, and a failed transfer leaves every complete file as it was.
Progress and results are reported as events (dicts) to ``emit``; the CLI renders them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from clusterctl.errors import (AuthRejected, CannotWrite, ClusterctlError, Exit, HostUnreachable, MissingInput,
                               UsageError)
from clusterctl.render import human_bytes
from clusterctl.connect.nodes import Connector, NodeHandle, close_all, handles, ssh_target
from clusterctl.modelfiles.copycheck import check_copy, needed_files
from clusterctl.modelfiles.manifest import Manifest, build_manifest, HashCache
from clusterctl.launch.plannedmodel import planned_adapter_manifest, planned_manifest
from clusterctl.launch.hubmodel import hub_resolve_url
from clusterctl.protocol.nodeops import (FetchRequest, ModelPrepareRequest, ModelStatusAnswer, ModelStatusRequest,
                                        RsyncFacts)
from clusterctl.sync.rsync import Endpoint, gnu_version, local_rsync, run_rsync
from clusterctl.locks import Lock
from clusterctl.statedir.state import StateDir

MODES = ("auto", "rsync", "download")
STATUS_TIMEOUT = 3600.0  # a --verify re-hash of a big model on a slow disk
FETCH_TIMEOUT = 24 * 3600.0
PROGRESS_EVERY = 0.5


@dataclass
class SyncOptions:
    mode: str = "auto"
    url: str | None = None
    dry_run: bool = False
    verify: bool = False  # re-hash every file on every node first, instead of trusting the nodes' hash caches
    jobs: int = 4
    ssh: Connector = field(default_factory=Connector)
    protect_args: bool | None = None  # None: rsync -s when both sides are GNU rsync


class SyncFailed(ClusterctlError):
    exit_code = Exit.FAILED


@dataclass
class NodeSync:
    node: str
    path: str
    state: str = "unknown"  # before: ok | missing | partial | stale | unreachable
    detail: str | None = None
    needed: list[str] = field(default_factory=list)
    bytes_needed: int = 0
    free_bytes: int | None = None
    rsync: RsyncFacts = field(default_factory=RsyncFacts)
    result: str | None = None  # after: ok | failed | skipped | would-sync
    error: str | None = None
    exit_code: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"node": self.node, "path": self.path, "state": self.state, "detail": self.detail,
                "files_needed": len(self.needed), "bytes_needed": self.bytes_needed, "result": self.result,
                "error": self.error, "bytes_sent": self.bytes_sent, "seconds": round(self.seconds, 3)}


@dataclass
class SyncReport:
    deployment_id: str
    manifest_hash: str
    mode: str | None
    source: str | None
    reason: str
    nodes: list[NodeSync]
    dry_run: bool
    adapter: "SyncReport | None" = None  # the deployment's LoRA adapter, synced after the model

    @property
    def ok(self) -> bool:
        if self.adapter is not None and not self.adapter.ok:
            return False
        if self.dry_run:
            return all(n.state != "unreachable" for n in self.nodes)
        return all(n.result == "ok" for n in self.nodes)

    def exit_code(self) -> int:
        every = self.nodes + (self.adapter.nodes if self.adapter is not None else [])
        codes = {n.exit_code for n in every if n.exit_code}
        if not codes:
            return 0
        return codes.pop() if len(codes) == 1 else int(Exit.FAILED)

    def to_json(self) -> dict:
        return {"ok": self.ok, "deployment_id": self.deployment_id, "manifest_hash": self.manifest_hash,
                "mode": self.mode, "source": self.source, "reason": self.reason, "dry_run": self.dry_run,
                "nodes": [n.to_json() for n in self.nodes],
                **({"adapter": self.adapter.to_json()} if self.adapter is not None else {})}


Emit = Callable[[dict], None]


# ---- step 1: where every node stands -------------------------------------------------------------------------

async def node_status(h: NodeHandle, manifest: Manifest, path: str, *, verify: bool,
                      only=None) -> ModelStatusAnswer:
    return await h.ask(ModelStatusRequest(manifest=manifest.model_dump(mode="json"), path=path, verify=verify,
                                          only=only), timeout=STATUS_TIMEOUT)


def _unreachable(e: ClusterctlError) -> bool:
    return isinstance(e, (HostUnreachable, AuthRejected))


async def survey(hs: dict[str, NodeHandle], dep, manifest: Manifest, *, verify: bool, emit: Emit,
                 paths: dict[str, str] | None = None) -> list[NodeSync]:
    """``paths``: where each node's copy is (None: the model's ``path_map``)."""
    sizes = {f.path: f.size for f in manifest.files}

    async def one(h: NodeHandle) -> NodeSync:
        ns = NodeSync(h.name, (paths or dep.path_map)[h.name])
        try:
            st = await node_status(h, manifest, ns.path, verify=verify)
        except ClusterctlError as e:
            ns.state, ns.detail = ("unreachable" if _unreachable(e) else "error"), e.message
            ns.exit_code = int(e.exit_code)
        else:
            ns.state, ns.detail = st.state, st.detail
            ns.needed = needed_files(manifest, st.copy_state())
            ns.bytes_needed = sum(sizes[p] for p in ns.needed)
            ns.free_bytes, ns.rsync = st.free_bytes, st.rsync
            if ns.state == "stale" and st.stale:
                ns.detail = ns.detail or f"{len(st.stale)} file(s) differ, e.g. {st.stale[0]}"
            elif ns.state == "partial":
                ns.detail = f"{len(st.missing)} of {len(manifest.files)} file(s) missing"
        emit({"event": "status", "node": ns.node, "path": ns.path, "state": ns.state, "detail": ns.detail,
              "files_needed": len(ns.needed), "bytes_needed": ns.bytes_needed})
        return ns

    return list(await asyncio.gather(*(one(h) for h in hs.values())))


# ---- step 2: where the bytes come from --------------------------------------------------------------------------

@dataclass
class Source:
    mode: str  # rsync | download
    describe: str
    reason: str
    folder: str | None = None  # rsync: a local folder holding the verified model
    node: str | None = None  # rsync: staged from this node first
    url: str | None = None


def local_copy_matches(folder: str, manifest: Manifest) -> str | None:
    """None when ``folder`` (on this machine) holds the planned model; else why not."""
    if not Path(folder).is_dir():
        return f"there is no copy at {folder} on this machine"
    try:
        m = build_manifest(folder, cache=HashCache())
    except ClusterctlError as e:
        return f"the copy at {folder} cannot be read ({e.message})"
    if m.manifest_hash != manifest.manifest_hash:
        return f"the copy at {folder} differs from the plan (manifest {m.manifest_hash[:19]}...)"
    return None


def choose_source(dep, manifest: Manifest, nodes: list[NodeSync], opts: SyncOptions,
                  source_path: str | None = None) -> Source:
    """``source_path``: the coordinator's copy (None: the model's)."""
    why_not = []
    mine = source_path or dep.model.source_path
    if opts.mode in ("auto", "rsync"):
        problem = local_copy_matches(mine, manifest)
        if problem is None:
            return Source("rsync", f"this machine:{mine}",
                          "the coordinator's copy matches the planned manifest", folder=mine)
        why_not.append(problem)
        ok = [n for n in nodes if n.state == "ok"]
        if ok:
            return Source("rsync", f"{ok[0].node}:{ok[0].path}",
                          f"{problem}; node {ok[0].node} holds a verified copy (staged on this machine first)",
                          node=ok[0].node)
        why_not.append("no node holds a verified copy")
    if opts.mode in ("auto", "download"):
        url, where = opts.url, "the mirror"
        if url is None and dep.model.hub is not None:  # planned by its hub name: the hub at the planned commit
            url, where = hub_resolve_url(dep.model.hub), f"the hub at commit {dep.model.hub.commit[:12]}"
        if url:
            reason = "; ".join(why_not) + f"; downloading from {where}" if why_not else "--mode download"
            return Source("download", url, reason, url=url)
        if opts.mode == "download":
            raise UsageError("--mode download needs --url (an HTTP mirror of the model folder)")
        why_not.append("no --url to download from")
    raise MissingInput("no verified copy of the model to sync from: " + "; ".join(why_not),
                       hint="restore the model at the deployment's source path, or pass --url of a mirror")


# ---- step 3: transfers ----------------------------------------------------------------------------------------

class _Progress:
    """Throttled progress events for one node."""

    def __init__(self, emit: Emit, node: str, total: int):
        self.emit, self.node, self.total, self.last = emit, node, total, 0.0

    def __call__(self, done: int, *, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last >= PROGRESS_EVERY:
            self.last = now
            self.emit({"event": "progress", "node": self.node, "bytes": min(done, self.total), "total": self.total})


async def stage_from_node(h: NodeHandle, ns: NodeSync, manifest: Manifest, state: StateDir, ssh: Connector,
                          opts: SyncOptions, emit: Emit) -> str:
    """Pull the whole model from a node holding a verified copy into <state>/staging/<hash>/, verified here."""

    folder = state.root / "staging" / manifest.manifest_hash.removeprefix("sha256:")
    folder.mkdir(parents=True, exist_ok=True)
    files = [f.path for f in manifest.files]
    progress = _Progress(emit, f"staging from {h.name}", manifest.total_bytes)
    emit({"event": "start", "node": f"staging from {h.name}", "source": f"{h.name}:{ns.path}", "mode": "rsync",
          "files": len(files), "bytes": manifest.total_bytes})
    remote = ssh_target(h.node, ssh)
    res = await run_rsync(Endpoint(ns.path, remote, gnu_version(ns.rsync.version)) if remote else Endpoint(ns.path),
                          Endpoint(str(folder)), files, progress=progress, protect_args=opts.protect_args)
    if res.error:
        raise SyncFailed(f"staging the model from node {h.name} failed: {res.error}")
    st = check_copy(manifest, str(folder), verify=True, cache=HashCache())
    if st["state"] != "ok":
        raise SyncFailed(f"the copy staged from node {h.name} does not match the plan ({st['state']})")
    return str(folder)


async def push(h: NodeHandle, ns: NodeSync, src: Source, manifest: Manifest, ssh: Connector, opts: SyncOptions,
               emit: Emit) -> None:
    progress = _Progress(emit, ns.node, ns.bytes_needed)
    prep = await h.ask(ModelPrepareRequest(path=ns.path))
    free = prep.free_bytes
    if free is not None and ns.bytes_needed > free:
        raise CannotWrite(f"needs {human_bytes(ns.bytes_needed)} at {ns.path}, only {human_bytes(free)} free there",
                          hint="free space on the node, or move its model folder (path_map) and plan again")
    emit({"event": "start", "node": ns.node, "source": src.describe, "mode": src.mode, "files": len(ns.needed),
          "bytes": ns.bytes_needed})
    if src.mode == "rsync":
        if h.node.is_local:
            dest = Endpoint(ns.path)
        else:
            if not ns.rsync.path:
                raise SyncFailed(f"rsync is not installed on node {ns.node}",
                                 hint="install rsync there, or sync with --mode download --url MIRROR")
            dest = Endpoint(ns.path, ssh_target(h.node, ssh), gnu_version(ns.rsync.version))
        res = await run_rsync(Endpoint(src.folder), dest, ns.needed, progress=progress,
                              protect_args=opts.protect_args)
        if res.error:
            raise SyncFailed(res.error)
        ns.bytes_sent = res.bytes_done
    else:
        done = 0
        sizes = {f.path: f.size for f in manifest.files}
        mdoc = manifest.model_dump(mode="json")
        for rel in ns.needed:  # one file per call: progress per file, and a failure names its file
            ans = await h.ask(FetchRequest(url=src.url, path=ns.path, manifest=mdoc, files=[rel]),
                              timeout=FETCH_TIMEOUT)
            if ans.failed:
                err = ans.failed[0].error
                if "No space left" in err:
                    raise CannotWrite(f"no space left at {ns.path} while downloading {rel}")
                raise SyncFailed(f"download of {rel} failed: {err}")
            ns.bytes_sent += ans.bytes
            done += sizes[rel]
            progress(done)
    progress(ns.bytes_needed, force=True)
    # the node re-hashes what it received: only then is it ok
    st = await node_status(h, manifest, ns.path, verify=True, only=ns.needed)
    if st.state != "ok":
        wrong = st.stale + st.missing
        raise SyncFailed(f"after the transfer {len(wrong)} file(s) still do not match the manifest"
                         + (f", e.g. {wrong[0]}" if wrong else ""))


# ---- the command --------------------------------------------------------------------------------------------------

async def sync_deployment(state: StateDir, dep_ref: str, opts: SyncOptions, emit: Emit = lambda e: None) -> SyncReport:
    if opts.mode not in MODES:
        raise UsageError(f"--mode: {opts.mode!r} is not valid (choose from {', '.join(MODES)})")
    if opts.url is not None and not opts.url.startswith(("http://", "https://")):
        raise UsageError(f"--url: {opts.url!r} is not an http:// or https:// URL")
    if opts.jobs < 1:
        raise UsageError("--jobs must be at least 1")
    _, loaded = state.load_deployment(dep_ref)
    dep = loaded.deployment
    manifest = planned_manifest(state, dep)
    if manifest is None:
        raise MissingInput(f"deployment {dep.deployment_id} records no model manifest (it was planned by an older "
                           "clusterctl)", hint="run `clusterctl plan` again; it records the manifest")
    lock = Lock(state.locks / f"sync-{dep.deployment_id}.lock").acquire(what=f"sync of deployment {dep.deployment_id}")
    try:
        nodes = [dep.node(r.node) for r in dep.ranks]
        hs = handles(nodes, opts.ssh)
        try:
            report = await _sync(state, dep, manifest, hs, opts, emit)
            adapter = planned_adapter_manifest(state, dep)
            if adapter is not None:  # small: always from the coordinator's copy (or a node's) over rsync
                report.adapter = await _sync(state, dep, adapter, hs, replace(opts, mode="rsync", url=None),
                                             lambda e: emit({**e, "what": "adapter"}),
                                             paths=dep.adapter.path_map, source_path=dep.adapter.source_path)
            return report
        finally:
            await close_all(hs)
    finally:
        lock.release()


async def _sync(state: StateDir, dep, manifest: Manifest, hs: dict[str, NodeHandle], opts: SyncOptions,
                emit: Emit, *, paths: dict[str, str] | None = None, source_path: str | None = None) -> SyncReport:
    nodes = await survey(hs, dep, manifest, verify=opts.verify, emit=emit, paths=paths)
    todo = [n for n in nodes if n.state in ("missing", "partial", "stale")]
    for n in nodes:
        if n.state == "ok":
            n.result = "ok"
        elif n.state in ("unreachable", "error"):
            n.result, n.error = "failed", n.detail
            n.exit_code = n.exit_code or int(Exit.UNAVAILABLE)
            emit({"event": "error", "node": n.node, "error": n.detail, "exit_code": n.exit_code})
    report = SyncReport(dep.deployment_id, manifest.manifest_hash, None, None, "every node already holds the model",
                        nodes, opts.dry_run)
    if not todo:
        return report
    src = choose_source(dep, manifest, nodes, opts, source_path)
    report.mode, report.source, report.reason = src.mode, src.describe, src.reason
    if opts.dry_run:
        for n in todo:
            n.result = "would-sync"
        return report
    if src.node is not None:
        holder = next(n for n in nodes if n.node == src.node)
        src.folder = await stage_from_node(hs[src.node], holder, manifest, state, opts.ssh, opts, emit)
    gate = asyncio.Semaphore(opts.jobs)

    async def one(n: NodeSync) -> None:
        async with gate:
            t0 = time.monotonic()
            try:
                await push(hs[n.node], n, src, manifest, opts.ssh, opts, emit)
            except ClusterctlError as e:
                n.result, n.error, n.exit_code = "failed", e.message, int(e.exit_code)
                emit({"event": "error", "node": n.node, "error": e.message, "exit_code": n.exit_code})
            else:
                n.result = "ok"
                emit({"event": "done", "node": n.node, "bytes_sent": n.bytes_sent,
                      "seconds": round(time.monotonic() - t0, 3)})
            finally:
                n.seconds = time.monotonic() - t0

    await asyncio.gather(*(one(n) for n in todo))
    return report
