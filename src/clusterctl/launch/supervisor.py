"""Start one rank per node, wait until every rank is ready, open the gate, prove tokens flow, then supervise.

Order of a launch (docs/launch.md):
  verify the deployment and re-derive its plan -> lock the deployment -> reap dead jobs -> preflight every node
  concurrently (all failures at once) -> write the launch manifest -> write trusted key, hostfile and signed
  contract on each node -> start the ranks (manifest updated as each starts) -> renew the launcher lease ->
  wait for every marker to say ready -> write the gate -> wait for rank 0 to serve -> canary request -> ready.
A launch that fails part-way tears down what it started; the launch error is reported, and so is a teardown error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shlex
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from clusterctl import __version__
from clusterctl.errors import Busy, ClusterctlError, ConfigError, Exit, IntegrityError, RemoteCommandFailed
from clusterctl.launch import hostfile
from clusterctl.launch.contract import encode_contract
from clusterctl.launch.rank.peerprobe import grace_from_env
from clusterctl.launch.rank.priority import nice_from_env
from clusterctl.launch.manifest import LaunchManifest, ManifestStore, RankRecord, now_iso, this_coordinator
from clusterctl.launch.nodes import NODEOP_TIMEOUT, NodeHandle, SshOptions, close_all, first_error_code, handles
from clusterctl.launch.teardown import DEFAULT_GRACE, TeardownReport, teardown_job
from clusterctl.launch.transport import StartedProcess
from clusterctl.locks import Lock
from clusterctl.plan.deployment import Deployment, diff_placement

ENV_LEASE = "CLUSTERCTL_LAUNCHER_LEASE"
DEFAULT_LEASE = 30.0
POLL = 0.5  # longest wait of one marker long poll (it answers as soon as the markers are there)


class LaunchFailed(ClusterctlError):
    exit_code = Exit.FAILED

    def __init__(self, message: str, *, ranks: list[dict] | None = None, teardown: TeardownReport | None = None,
                 hint: str | None = None, exit_code: Exit | None = None):
        super().__init__(message, hint=hint, exit_code=exit_code)
        self.ranks = ranks or []
        self.teardown = teardown

    def to_json(self) -> dict:
        out = super().to_json()
        out["ranks"] = self.ranks
        if self.teardown is not None:
            out["teardown"] = self.teardown.to_json()
        return out


def lease_from_env() -> float:
    """The launcher lease from env CLUSTERCTL_LAUNCHER_LEASE (unset or empty: the default), checked like --lease."""
    import math

    from clusterctl.errors import UsageError

    text = os.environ.get(ENV_LEASE, "").strip()
    if not text:
        return DEFAULT_LEASE
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 1 <= value <= 3600):
        raise UsageError(f"{ENV_LEASE}={text[:40]!r} is not a number of seconds in [1, 3600]")
    return value


@dataclass
class LaunchOptions:
    timeout: float = 600.0
    grace: float = DEFAULT_GRACE
    lease_seconds: float = field(default_factory=lambda: lease_from_env())
    detach: bool = False
    http_host: str = "127.0.0.1"
    http_port: int | None = None
    api_key: str | None = None
    seed: int = 0
    max_queue: int = 64  # requests rank 0 holds beyond the batch before answering 429
    canary: bool = True
    ssh: SshOptions = field(default_factory=SshOptions)
    check_model: bool = True
    verify_model: bool = False  # preflight re-hashes every byte of each node's model copy
    reap_first: bool = True


@dataclass
class Running:
    """A launched job: the manifest, the node handles, and (in the foreground) each rank's keeper process."""

    manifest: LaunchManifest
    store: ManifestStore
    hs: dict[str, NodeHandle]
    procs: dict[int, StartedProcess]
    lock: Lock
    opts: LaunchOptions
    lease_task: asyncio.Task | None = None
    failure: str | None = None
    failed_rank: dict | None = None  # the rank whose exit ended supervision: rank, node, exit_code, detail
    waiters: dict[int, asyncio.Task] = field(default_factory=dict)  # one wait() per foreground rank

    def watch(self, rank: int, p: StartedProcess) -> None:
        self.procs[rank] = p
        self.waiters[rank] = asyncio.ensure_future(p.wait())

    def exited(self, rank: int) -> bool:
        t = self.waiters.get(rank)
        return t is not None and t.done()

    @property
    def endpoint(self) -> str | None:
        return self.manifest.endpoint

    def summary(self) -> dict:
        m = self.manifest
        return {"job_id": m.job_id, "deployment_id": m.deployment_id, "endpoint": m.endpoint, "state": m.state,
                "manifest": str(self.store.path(m.job_id)),
                "ranks": [{"rank": r.rank, "node": r.node, "host": r.host, "pid": r.pid, "state": r.state}
                          for r in m.ranks]}

    async def supervise(self, stop: asyncio.Event) -> int:
        """Stay in the foreground until asked to stop or a rank dies; then tear down verified. Returns exit code."""
        waits = {t: r for r, t in self.waiters.items()}
        stopper = asyncio.ensure_future(stop.wait())
        code = 0
        try:
            done, _ = await asyncio.wait([stopper, *waits], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t in waits:
                    r = waits[t]
                    rc = t.result() if not t.exception() else None
                    p = self.procs[r]
                    tail = p.stderr_tail.decode("utf-8", "replace").strip().splitlines()
                    self.failure = (f"rank {r} on {self.manifest.ranks[r].node} exited with code {rc}"
                                    + (f": {tail[-1]}" if tail else ""))
                    self.failed_rank = {"rank": r, "node": self.manifest.ranks[r].node, "exit_code": rc,
                                        "detail": tail[-1] if tail else ""}
                    code = int(Exit.FAILED)
        finally:
            stopper.cancel()
        report = await self.teardown()
        if not report.ok:
            code = int(Exit.FAILED)
        self.report = report
        return code

    async def teardown(self) -> TeardownReport:
        if self.lease_task:
            self.lease_task.cancel()
        for p in self.procs.values():
            await p.close_stdin()  # the keeper TERMs, waits its grace, KILLs
        self.manifest.state = "stopping"
        with contextlib.suppress(ClusterctlError):
            self.store.save(self.manifest)
        if self.waiters:
            # Let the keepers finish their own stop first, so no rank gets a second SIGTERM from the sweep
            # (a second signal means "exit at once" to a rank); the sweep then verifies and catches stragglers.
            await asyncio.wait([asyncio.shield(t) for t in self.waiters.values()], timeout=self.opts.grace + 5)
        try:
            return await teardown_job(self.manifest, self.store, self.opts.ssh, grace=self.opts.grace, hs=self.hs)
        finally:
            for t in self.waiters.values():
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(t), timeout=self.opts.grace + 5)
            await close_all(self.hs)
            self.lock.release()


PORT_ATTEMPTS = 5


class PortsBusy(LaunchFailed):
    """Preflight found nothing wrong but ports of the chosen block in use: another block may do."""

    def __init__(self, message: str, busy: set[int], **kw):
        super().__init__(message, **kw)
        self.busy = busy


# ---- preflight ----------------------------------------------------------------------------------------------------

def _version_problems(probe: dict, node: str) -> tuple[list[str], list[str]]:
    import sys
    from importlib import metadata

    errors, warnings = [], []
    v = probe.get("versions", {})
    ours = {"clusterctl": __version__}
    for dist in ("mlx", "mlx-lm"):
        try:
            ours[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            ours[dist] = None
    for dist, want in ours.items():
        have = v.get(dist)
        if have is None:
            errors.append(f"{dist} is not installed")
        elif want is not None and have != want:
            errors.append(f"{dist} {have} differs from the coordinator's {want}")
    py = v.get("python", "0.0").split(".")
    mine = [str(x) for x in sys.version_info[:2]]
    if py[0] != mine[0]:
        errors.append(f"python {v.get('python')} (coordinator has {'.'.join(mine)}): major versions differ")
    elif py[:2] != mine:
        warnings.append(f"node {node}: python {v.get('python')} differs from the coordinator's {'.'.join(mine)}")
    return errors, warnings


def copy_problem(copy: dict, path: str, dep_ref: str) -> str | None:
    """One line for a node whose model copy is not the planned one (None when it is), naming the fix."""
    state = copy.get("state")
    if state == "ok":
        return None
    if state == "error":
        return f"cannot check the model copy at {path}: {copy.get('detail')}"
    counts = {"missing": f"{copy.get('n_missing', 0)} file(s) missing", "stale": f"{copy.get('n_stale', 0)} file(s) differ"}
    what = ", ".join(counts[k] for k in ("stale", "missing") if copy.get(f"n_{k}"))
    first = f", e.g. {copy['first']}" if copy.get("first") else ""
    return (f"model copy at {path} is {state} ({what or copy.get('detail', 'not the planned model')}{first}); "
            f"run `clusterctl sync {dep_ref}`")


async def preflight(dep: Deployment, hs: dict[str, NodeHandle], ports: dict[str, list[int]], *,
                    manifest=None, verify: bool = False, dep_ref: str | None = None) -> list[str]:
    """Probe every node concurrently; raise one error naming every failure on every node. Returns warnings.

    With ``manifest`` each node also compares its copy of the model with it (sizes and cached hashes; every
    byte re-hashed with ``verify``). When copies are the only problem the exit code is 69 (unavailable).
    """
    warnings: list[str] = []
    copy_only: dict[str, bool] = {}
    busy_only: dict[str, set[int]] = {}
    mdoc = manifest.model_dump(mode="json") if manifest is not None else None

    async def one(h: NodeHandle) -> list[str]:
        rank = dep.rank_of(h.name)
        path = dep.path_map[h.name]
        probe = await h.op("probe", {"backend": dep.backend if len(dep.ranks) > 1 else None,
                                     "model_path": path, "runtime_dir": h.runtime_dir,
                                     "ports": ports.get(h.name, []), "manifest": mdoc, "verify": verify},
                           timeout=NODEOP_TIMEOUT if not verify else 3600.0)
        h.probe = probe
        h.runtime_dir = probe["runtime_dir"]["path"]
        errs, warns = _version_problems(probe, h.name)
        warnings.extend(warns)
        if len(dep.ranks) > 1 and not probe.get("backend_available", False):
            errs.append(f"mlx cannot use the {dep.backend} backend here"
                        + (f" ({probe['mlx_error']})" if probe.get("mlx_error") else ""))
        model = probe.get("model", {})
        copy = copy_problem(probe["model_copy"], path, dep_ref or dep.deployment_id) if "model_copy" in probe else None
        if copy:
            errs.append(copy)  # names the fix; the folder check below would only repeat part of it
        elif not model.get("ok"):
            errs.append(model.get("error", "model check failed"))
        need = rank.planned.weights + rank.planned.kv
        if probe.get("mem_available", 0) < need:
            errs.append(f"needs {need / 2**30:.2f} GiB free memory, has {probe.get('mem_available', 0) / 2**30:.2f} GiB")
        if probe.get("ports_busy"):
            errs.append(f"ports already in use: {', '.join(map(str, probe['ports_busy']))}")
        if not probe["runtime_dir"]["ok"]:
            errs.append(f"runtime dir {probe['runtime_dir']['path']} is not usable: {probe['runtime_dir'].get('error')}")
        copy_only[h.name] = errs == [copy] if copy else False
        if probe.get("ports_busy") and len(errs) == 1:
            busy_only[h.name] = {int(p) for p in probe["ports_busy"]}
        return errs

    results = await asyncio.gather(*(one(h) for h in hs.values()), return_exceptions=True)
    problems, errors = [], []
    for h, res in zip(hs.values(), results):
        if isinstance(res, BaseException):
            if not isinstance(res, ClusterctlError):
                raise res
            errors.append(res)
            problems.append(f"{h.name}: {res.message}")
        elif res:
            errors.append(ClusterctlError(res[0], exit_code=Exit.UNAVAILABLE if copy_only.get(h.name) else Exit.FAILED))
            problems.extend(f"{h.name}: {p}" for p in res)
    if busy_only:  # busy ports, a node's only problem: another block first, then whatever else is wrong
        raise PortsBusy("preflight failed: " + "; ".join(problems), set().union(*busy_only.values()))
    if problems:
        code = first_error_code(errors) if all(isinstance(e, ClusterctlError) and e.message for e in errors) \
            else Exit.FAILED
        raise LaunchFailed(f"preflight failed on {len({p.split(':')[0] for p in problems})} node(s): "
                           + "; ".join(problems), exit_code=code)
    return warnings


# ---- launch -------------------------------------------------------------------------------------------------------

def check_inputs_unchanged(dep: Deployment) -> None:
    """Re-derive the plan from the deployment's own inputs and the model as it is now; refuse on any difference."""
    from clusterctl.plan.model import inspect_model
    from clusterctl.plan.planner import replan_same_inputs

    if not Path(dep.model.source_path).is_dir():
        return  # the coordinator holds no copy; each node's copy is checked in preflight
    try:
        new = replan_same_inputs(dep, inspect_model(dep.model.source_path, classify=False))
    except ClusterctlError as e:
        raise IntegrityError(f"deployment {dep.deployment_id} no longer plans from its inputs: {e.message}") from None
    if new.plan_hash != dep.plan_hash or new.placement != dep.placement:
        diff = diff_placement(dep, new)
        raise IntegrityError(f"deployment {dep.deployment_id} no longer matches its inputs: " + "; ".join(
            d.replace("\n", " / ") for d in diff), hint="run clusterctl plan again")


async def live_jobs(store: ManifestStore, ssh: SshOptions, deployment_id: str | None = None) -> list[LaunchManifest]:
    from clusterctl.launch.reaper import job_is_live

    good, _ = store.all()
    return [m for _, m in good
            if (deployment_id is None or m.deployment_id == deployment_id) and await job_is_live(m, ssh)]


async def launch(dep_ref: str, state, opts: LaunchOptions, *, log=lambda msg: None) -> Running:
    from clusterctl.launch.reaper import reap

    dep_path, loaded = state.load_deployment(dep_ref)
    dep: Deployment = loaded.deployment
    # The nodes' sessions start now (SSH connection, channel, Python, mlx import) while this machine checks the
    # deployment, the model and the other launches: preflight then finds them ready. Nothing on a node changes.
    hs = handles([dep.node(r.node) for r in dep.ranks], opts.ssh, keeper_grace=opts.grace)
    warming = asyncio.ensure_future(_warm(hs, dep))
    try:
        manifest = None
        if opts.check_model:
            from clusterctl.sync.planned import planned_manifest

            # in a thread: the event loop meanwhile drives the nodes' SSH handshakes
            await asyncio.to_thread(check_inputs_unchanged, dep)
            manifest = await asyncio.to_thread(planned_manifest, state, dep)
        key = state.keyring.signing_key()
        store = ManifestStore(state.launches, key, state.keyring.public_keys())
        lock = Lock(state.locks / f"deploy-{dep.deployment_id}.lock").acquire(what=f"deployment {dep.deployment_id}")
    except BaseException:
        warming.cancel()
        await close_all(hs)
        raise
    try:
        if opts.reap_first:
            with contextlib.suppress(Busy):
                await reap(state, opts.ssh, grace=opts.grace, log=log, held=frozenset({dep.deployment_id}))
        running = await live_jobs(store, opts.ssh, dep.deployment_id)
        if running:
            raise Busy(f"deployment {dep.deployment_id} is already running as job {running[0].job_id}",
                       hint="clusterctl teardown it first")
        await asyncio.gather(warming, return_exceptions=True)
        return await _launch_locked(dep, dep_path, state, store, key, lock, opts, log, hs, manifest=manifest,
                                    dep_ref=shlex.quote(dep_ref))
    except BaseException:
        warming.cancel()
        await close_all(hs)
        lock.release()
        raise


async def _warm(hs: dict[str, NodeHandle], dep: Deployment) -> None:
    """Start every node's session and import there what preflight and the ranks' start need; a failure here is
    left for preflight to report (one error naming every node)."""
    modules = ["psutil"] + (["mlx.core"] if len(dep.ranks) > 1 else [])
    await asyncio.gather(*(h.op("warm", {"modules": modules}) for h in hs.values()), return_exceptions=True)


async def _launch_locked(dep, dep_path, state, store, key, lock, opts: LaunchOptions, log, hs, *, manifest=None,
                         dep_ref: str | None = None) -> Running:
    world = len(dep.ranks)
    job_id = f"{dep.deployment_id}-{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"
    nonce = secrets.token_hex(16)
    good, _ = store.all()
    avoid = {p for _, m in good for p in m.ports}
    nodes = [dep.node(r.node) for r in dep.ranks]
    all_local = all(n.is_local for n in nodes)
    addrs = [hostfile.rank_address(n, all_local=all_local, backend=dep.backend) for n in nodes]
    for attempt in range(PORT_ATTEMPTS):
        block = hostfile.choose_ports(world + 1, avoid)
        ring_ports, http_port = block[:world], (opts.http_port or block[world])
        port_req = {r.node: ([ring_ports[r.rank]] if world > 1 else []) + ([http_port] if r.rank == 0 else [])
                    for r in dep.ranks}
        try:
            warnings = await preflight(dep, hs, port_req, manifest=manifest, verify=opts.verify_model,
                                       dep_ref=dep_ref)
            break
        except PortsBusy as e:
            # a random block met ports in use (often short-lived client sockets): another block, unless the
            # operator fixed the HTTP port and that is the one taken
            if attempt == PORT_ATTEMPTS - 1 or (opts.http_port is not None and opts.http_port in e.busy):
                await close_all(hs)
                raise LaunchFailed(e.message, exit_code=Exit.FAILED) from None
            log(f"ports {', '.join(map(str, sorted(e.busy)))} are in use; choosing another block")
            avoid |= set(block)
        except BaseException:
            await close_all(hs)
            raise
    for w in warnings:
        log(f"warning: {w}")

    env_view = {"MLX_MAX_OPS_PER_BUFFER": "16", "MLX_MAX_MB_PER_BUFFER": "512"}
    lease_seconds = 0.0 if opts.detach else opts.lease_seconds
    records = []
    for r in dep.ranks:
        h = hs[r.node]
        base = f"{job_id}-rank{r.rank}"
        records.append(RankRecord(rank=r.rank, node=r.node, host=h.node.host, local=h.node.is_local,
                                  runtime_dir=h.runtime_dir, marker_path=h.path(base + ".json"),
                                  contract_path=h.path(base + ".contract"),
                                  hostfile_path=h.path(base + ".hostfile.json") if world > 1 else None,
                                  log_path=h.path(base + ".log") if opts.detach else None,
                                  port=ring_ports[r.rank] if world > 1 else None,
                                  start_layer=r.start_layer, end_layer=r.end_layer))
    rank0 = hs[dep.ranks[0].node]
    manifest = LaunchManifest(
        job_id=job_id, deployment_id=dep.deployment_id, plan_hash=dep.plan_hash, deployment_file=str(dep_path),
        created_at=now_iso(), nonce=nonce, coordinator=this_coordinator(detached=opts.detach),
        http_port=http_port, ports=block, lease_seconds=lease_seconds or None,
        mlx_launch_hostfile=hostfile.mlx_launch_hostfile(dep, addrs, env_view), nodes=nodes, ranks=records)
    store.save(manifest)  # BEFORE the first rank starts: a crash from here on leaves a trail for the reaper
    save_lock = asyncio.Lock()

    async def save() -> None:
        async with save_lock:
            await asyncio.to_thread(store.save, manifest)

    run = Running(manifest=manifest, store=store, hs=hs, procs={}, lock=lock, opts=opts)
    try:
        dep_bytes = Path(dep_path).read_bytes()
        pub = state.keyring.public_keys()[0]
        hostfiles = hostfile.ring_hostfiles(addrs, ring_ports) if world > 1 else None

        async def prepare(r) -> None:
            h, rec = hs[r.node], records[r.rank]
            await h.write_file(h.path(f"trusted-keys/{pub.key_id}.pub"), pub.to_text().encode())
            if hostfiles:
                await h.write_file(rec.hostfile_path, json.dumps(hostfiles[r.rank]).encode())
            counts = [x.layers for x in dep.ranks]
            spec = {"deployment_id": dep.deployment_id, "job_id": job_id, "nonce": nonce, "node": r.node,
                    "rank": r.rank, "world_size": world, "backend": dep.backend, "parallel": dep.parallel,
                    "model_path": dep.path_map[r.node], "start_layer": r.start_layer, "end_layer": r.end_layer,
                    "layer_counts": counts, "num_layers": dep.model.num_layers, "hostfile": rec.hostfile_path,
                    "http_host": opts.http_host, "http_port": http_port if r.rank == 0 else None,
                    "api_key": opts.api_key if r.rank == 0 else None, "seed": opts.seed,
                    "runtime_dir": h.runtime_dir, "marker_path": rec.marker_path,
                    "gate_path": h.path(f"{job_id}.gate"),
                    "lease_path": h.path(f"{job_id}.lease") if lease_seconds else None,
                    "lease_seconds": lease_seconds or 30.0, "embedding_offload": dep.embedding_offload,
                    "abort_grace_s": grace_from_env(), "compute_nice": nice_from_env(), "max_batch": dep.batch_slots,
                    "max_queue": opts.max_queue}
            await h.write_file(rec.contract_path, encode_contract(dep_bytes, spec, key), mode=0o600)

        await asyncio.gather(*(prepare(r) for r in dep.ranks))
        if lease_seconds:
            await _renew_leases(hs, dep, job_id, lease_seconds, seq=0)
            run.lease_task = asyncio.ensure_future(_lease_loop(hs, dep, job_id, lease_seconds))

        async def start(r) -> None:
            h, rec = hs[r.node], records[r.rank]
            argv = [h.transport.python, "-m", "clusterctl.launch.rank", "--contract", rec.contract_path,
                    "--node", r.node]
            env = {"CLUSTERCTL_NONCE": nonce}
            if opts.detach:
                info = await h.op("spawn", {"argv": argv, "env": env, "log_path": rec.log_path})
                rec.pid, rec.pgid, rec.start_time, rec.boot_id = info["pid"], info["pgid"], info["start_time"], info["boot_id"]
            else:
                p = await h.transport.start(argv, env=env, grace=opts.grace)
                run.watch(r.rank, p)
                rec.pid, rec.pgid, rec.start_time, rec.boot_id = p.info.pid, p.info.pgid, p.info.start_time, p.info.boot_id
            rec.state = "started"
            await save()

        results = await asyncio.gather(*(start(r) for r in dep.ranks), return_exceptions=True)
        errs = [e for e in results if isinstance(e, BaseException)]
        if errs:
            raise errs[0]
        log(f"started {world} rank(s); waiting for them to load")
        await _wait_markers(run, dep, {"ready", "serving"}, opts.timeout, "load and become ready")
        for r in dep.ranks:
            records[r.rank].state = "ready"
        await asyncio.gather(*(hs[r.node].write_file(hs[r.node].path(f"{job_id}.gate"), b"open\n")
                               for r in dep.ranks))
        await _wait_markers(run, dep, {"serving"}, opts.timeout, "start serving", only_rank=0)
        m0 = await rank0.read_json(records[0].marker_path)
        endpoint = (m0 or {}).get("endpoint") or f"http://{opts.http_host}:{http_port}"
        if opts.canary:
            ans = await rank0.op("canary", {"url": endpoint, "api_key": opts.api_key, "timeout": 120})
            if not ans.get("ok"):
                raise LaunchFailed(f"canary request to rank 0 produced no tokens: {ans.get('error', ans)}")
        manifest.state, manifest.endpoint = "ready", endpoint
        await save()
        if opts.detach:
            await close_all(hs)
            lock.release()
        return run
    except BaseException as e:
        launch_error = e
        try:
            report = await run.teardown()
        except Exception as te:  # the teardown error is reported too, never instead
            report = None
            teardown_note = f"; teardown also failed: {te}"
        else:
            teardown_note = "" if report.ok else "; teardown could not confirm: " + "; ".join(report.survivors())
        if isinstance(launch_error, (KeyboardInterrupt, asyncio.CancelledError)):
            if report is not None and not report.ok:
                raise LaunchFailed("launch interrupted" + teardown_note, teardown=report) from None
            raise
        if isinstance(launch_error, LaunchFailed):
            launch_error.teardown = report
            launch_error.message += teardown_note
            launch_error.args = (launch_error.message,)
            raise
        if isinstance(launch_error, ClusterctlError):
            raise LaunchFailed(launch_error.message + teardown_note, teardown=report, hint=launch_error.hint,
                               exit_code=launch_error.exit_code) from None
        raise


async def _renew_leases(hs, dep, job_id: str, duration: float, seq: int) -> None:
    body = json.dumps({"schema_version": 1, "type": "lease", "holder": f"{socket.gethostname()}:{os.getpid()}",
                       "seq": seq, "duration_s": duration}).encode()
    await asyncio.gather(*(hs[r.node].write_file(hs[r.node].path(f"{job_id}.lease"), body)
                           for r in dep.ranks), return_exceptions=True)


async def _lease_loop(hs, dep, job_id: str, duration: float) -> None:
    seq = 0
    while True:
        await asyncio.sleep(duration / 3)
        seq += 1
        await _renew_leases(hs, dep, job_id, duration, seq)


async def _wait_markers(run: Running, dep: Deployment, states: set[str], timeout: float, what: str,
                        only_rank: int | None = None) -> None:
    deadline = time.monotonic() + timeout
    ranks = [r for r in dep.ranks if only_rank is None or r.rank == only_rank]
    last: dict[int, str] = {}
    while True:
        for r in ranks:
            p = run.procs.get(r.rank)
            if p is not None and run.exited(r.rank):
                tail = p.stderr_tail.decode("utf-8", "replace").strip().splitlines()
                raise LaunchFailed(f"rank {r.rank} on {r.node} exited with code {p.returncode} before it was ready"
                                   + (f": {tail[-1]}" if tail else ""),
                                   ranks=[{"rank": r.rank, "node": r.node, "stderr_tail": "\n".join(tail[-20:])}])
        # one long poll per node (answers as soon as its markers are there, one failed, or a detached rank's
        # process is gone); a foreground rank that exits is noticed within one poll
        by_node: dict[str, list] = {}
        for r in ranks:
            by_node.setdefault(r.node, []).append(r)
        wait = max(0.05, min(POLL, deadline - time.monotonic()))
        got = await asyncio.gather(*(run.hs[n].wait_markers([run.manifest.ranks[r.rank].marker_path for r in rs],
                                                             states, wait, watch=[_detached(run, r) for r in rs])
                                     for n, rs in by_node.items()))
        found = {r.rank: (d, e) for rs, ans in zip(by_node.values(), got)
                 for r, d, e in zip(rs, ans["markers"], ans["exited"])}
        pending = []
        for r in ranks:
            doc, exited = found[r.rank]
            st = (doc or {}).get("state", "starting")
            last[r.rank] = st
            if st == "failed":
                raise LaunchFailed(f"rank {r.rank} on {r.node} failed: {(doc or {}).get('error') or 'no reason given'}",
                                   ranks=[{"rank": r.rank, "node": r.node, "error": (doc or {}).get("error")}])
            if exited is not None:
                tail = [str(x) for x in exited.get("log_tail") or []]
                log_path = run.manifest.ranks[r.rank].log_path
                raise LaunchFailed(f"rank {r.rank} on {r.node} exited before it was ready"
                                   + (f": {tail[-1]}" if tail else f" (nothing in {log_path})"),
                                   ranks=[{"rank": r.rank, "node": r.node, "stderr_tail": "\n".join(tail[-20:]),
                                           "log_path": log_path}])
            if st not in states:
                pending.append(r)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise LaunchFailed(f"timed out after {timeout:g} s waiting for ranks to {what}: " + ", ".join(
                f"rank {r.rank} on {r.node} is {last.get(r.rank)}" for r in pending))


def _detached(run: Running, r) -> dict | None:
    """What the marker wait watches of a detached rank: its process (pid, start time, nonce) and its log. A
    foreground rank is watched through its keeper instead."""
    rec = run.manifest.ranks[r.rank]
    if r.rank in run.procs or not rec.pid or not rec.log_path:
        return None
    return {"pid": rec.pid, "start_time": rec.start_time, "nonce": run.manifest.nonce, "pgid": rec.pgid,
            "boot_id": rec.boot_id, "log_path": rec.log_path}


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)


__all__ = ["launch", "LaunchOptions", "Running", "LaunchFailed", "install_stop_signals", "RemoteCommandFailed"]
