"""Start one rank per node, wait until every rank is ready, open the gate, prove tokens flow.

Order of a launch (docs/launch.md):
  verify the deployment and re-derive its plan -> lock the deployment -> reap dead jobs -> preflight every node
  concurrently (all failures at once; another port block when only ports are busy) -> the job plan
  (launch/jobplan.py: every rank's validated spec and files) -> write the launch manifest -> write trusted key,
  hostfile and signed contract on each node -> start the ranks (manifest saves coalesced as they start: one in
  flight, one pending) -> renew the launcher lease -> wait for every marker to say ready -> write the gate -> wait for rank 0 to serve -> canary
  request -> ready. A launch that fails part-way tears down what it started; the launch error is reported, and
  so is a teardown error. What follows (supervision, lease renewals, stop signals) is launch/foreground.py.
Work that grows with the cluster (planning, contracts: JSON, signatures; manifest saves; name lookups) runs in
threads, so the event loop keeps driving every node's connection (bench/scale.py measures its longest stall).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import shlex
import time
from pathlib import Path

from clusterctl.errors import Busy, ClusterctlError, ConfigError, Exit, FailedRank, LaunchFailed
from clusterctl.launch import hostfile
from clusterctl.protocol import runtimefiles as rf
from clusterctl.protocol.contract import deployment_proof, encode_contract
from clusterctl.launch.foreground import Running, lease_loop, renew_leases
from clusterctl.launch.jobplan import JobPlan, LaunchOptions, contract_payload, mlx_view, new_job_id, new_nonce, \
    plan_job, port_requests
from clusterctl.statedir.manifest import LaunchManifest, ManifestStore, manifest_store, now_iso, this_coordinator
from clusterctl.connect.nodes import NodeHandle, close_all, handles
from clusterctl.launch.preflight import PortsBusy, check_inputs_unchanged, preflight, warm
from clusterctl.launch.ranklogs import explain, failing_rank, keep_logs, last_lines, printable, with_own_failure
from clusterctl.locks import Lock
from clusterctl.protocol.deployment import Deployment
from clusterctl.protocol.nodeops import AliveRequest, CanaryRequest, SpawnRequest, WatchedRank
from clusterctl.connect import fdlimit
from clusterctl.launch.plannedmodel import planned_adapter_manifest, planned_manifest
from clusterctl.launch.reaper import live_jobs, reap
from clusterctl.launch.teardown import reports_dir
from clusterctl.protocol.rankspec import MLX_ENV_DEFAULTS, abort_grace_from_env, compute_nice_from_env
from clusterctl.statedir.state import StateDir

PORT_ATTEMPTS = 5
POLL = 0.5  # longest wait of one marker long poll (it answers as soon as the markers are there)
YIELD_EVERY = 64  # ranks looked at between two turns of the event loop


async def launch(dep_ref: str, state: StateDir, opts: LaunchOptions, *, log=lambda msg: None) -> Running:
    with _frozen_heap():
        return await _launch(dep_ref, state, opts, log=log)


async def _launch(dep_ref: str, state: StateDir, opts: LaunchOptions, *, log) -> Running:
    # verified and re-hashed in a thread: hundreds of KB at hundreds of nodes
    dep_path, loaded = await asyncio.to_thread(state.load_deployment, dep_ref)
    dep: Deployment = loaded.deployment
    _check_connections(dep, opts)
    # The nodes' sessions start now (SSH connection, channel, Python, mlx import) while this machine checks the
    # deployment, the model and the other launches: preflight then finds them ready. Nothing on a node changes.
    hs = handles(dep.rank_nodes(), opts.ssh, keeper_grace=opts.grace)
    warming = asyncio.ensure_future(warm(hs, dep))
    try:
        manifest = adapter_manifest = None
        if opts.check_model:
            # in a thread: the event loop meanwhile drives the nodes' SSH handshakes
            await asyncio.to_thread(check_inputs_unchanged, dep)
            manifest = await asyncio.to_thread(planned_manifest, state, dep)
            adapter_manifest = await asyncio.to_thread(planned_adapter_manifest, state, dep)
        key = state.keyring.signing_key()
        store = manifest_store(state, key)
        lock = Lock(state.deployment_lock(dep.deployment_id)).acquire(what=f"deployment {dep.deployment_id}")
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
                                    dep_ref=shlex.quote(dep_ref), adapter_manifest=adapter_manifest)
    except BaseException:
        warming.cancel()
        await close_all(hs)
        lock.release()
        raise


def _check_connections(dep: Deployment, opts: LaunchOptions) -> None:
    """A foreground job holds one connection per remote node for its whole life (its ranks' keepers): it cannot
    run in waves (fdlimit.SLOTS), so it must fit under the open-file limit at once."""

    remote = sum(not n.is_local for n in dep.rank_nodes())
    if not opts.detach and remote > fdlimit.SLOTS.limit:
        raise ConfigError(f"a foreground launch keeps one connection per node open: {remote} nodes, but the "
                          f"open-file limit ({fdlimit.soft_limit()}) allows {fdlimit.SLOTS.limit}",
                          hint="raise it (`ulimit -n`), or launch --detach (docs/scale.md)")


async def _preflight_ports(dep: Deployment, hs, store: ManifestStore, opts: LaunchOptions, log, *, manifest,
                           dep_ref, adapter_manifest=None) -> list[int]:
    """Preflight with a fresh port block (world + 1 ports); another block when only ports are busy."""
    good, _ = store.all()
    avoid = {p for _, m in good for p in m.ports}
    for attempt in range(PORT_ATTEMPTS):
        block = hostfile.choose_ports(len(dep.ranks) + 1, avoid)
        try:
            warnings = await preflight(dep, hs, port_requests(dep, block, opts.http_port), manifest=manifest,
                                       verify=opts.verify_model, dep_ref=dep_ref, adapter_manifest=adapter_manifest)
        except PortsBusy as e:
            # a random block met ports in use (often short-lived client sockets): another block, unless the
            # operator fixed the HTTP port and that is the one taken
            if attempt == PORT_ATTEMPTS - 1 or (opts.http_port is not None and opts.http_port in e.busy):
                raise LaunchFailed(e.message, exit_code=Exit.FAILED) from None
            log(f"ports {', '.join(map(str, sorted(e.busy)))} are in use; choosing another block")
            avoid |= set(block)
            continue
        for w in warnings:
            log(f"warning: {w}")
        return block
    raise AssertionError("unreachable")


def _plan(dep: Deployment, state: StateDir, opts: LaunchOptions, hs, block: list[int], addrs: list[str], job_id: str,
          nonce: str) -> JobPlan:
    # the ranks' settings read from this machine's environment, and the MLX environment every rank applies
    pub = state.keyring.public_keys()[0]
    return plan_job(dep, opts, block=block, runtime_dirs={n: h.runtime_dir for n, h in hs.items()}, addrs=addrs,
                    job_id=job_id, nonce=nonce, trusted_key=(pub.key_id, pub.to_text()),
                    abort_grace_s=abort_grace_from_env(), compute_nice=compute_nice_from_env(),
                    mlx_env=mlx_view(MLX_ENV_DEFAULTS))


async def _launch_locked(dep, dep_path, state: StateDir, store, key, lock, opts: LaunchOptions, log, hs, *, manifest=None,
                         dep_ref: str | None = None, adapter_manifest=None) -> Running:
    job_id, nonce = new_job_id(dep.deployment_id), new_nonce()
    try:
        addrs = await rank_addresses(dep)
        block = await _preflight_ports(dep, hs, store, opts, log, manifest=manifest, dep_ref=dep_ref,
                                       adapter_manifest=adapter_manifest)
        plan = await asyncio.to_thread(_plan, dep, state, opts, hs, block, addrs, job_id, nonce)
    except BaseException:
        await close_all(hs)
        raise
    m = LaunchManifest(
        job_id=job_id, deployment_id=dep.deployment_id, plan_hash=dep.plan_hash, deployment_file=str(dep_path),
        created_at=now_iso(), nonce=nonce, coordinator=this_coordinator(detached=opts.detach),
        http_port=plan.http_port, ports=plan.block, lease_seconds=plan.lease_seconds or None,
        mlx_launch_hostfile=plan.mlx_launch_hostfile, nodes=dep.rank_nodes(),
        ranks=plan.records())
    await asyncio.to_thread(store.save, m)  # BEFORE the first rank starts: a crash from here on leaves a trail
    run = Running(manifest=m, store=store, hs=hs, procs={}, lock=lock, opts=opts)
    try:
        gc.freeze()  # the plan and the manifest too (_frozen_heap)
        await _start(run, plan, dep, Path(dep_path), key, log)
        if opts.detach:
            await close_all(hs)
            lock.release()
        return run
    except BaseException as e:
        other = await _after_failure(run, e)
        if other is None:
            raise
        raise other from None


@contextlib.contextmanager
def _frozen_heap():
    """What exists when a launch begins, and again when its ranks start (the deployment, the plan, the manifest,
    every node's connection), lives through the fan-out: kept out of the garbage collector's full collections
    meanwhile. Each walked all of it on the event loop, 76-124 ms at 1,000 nodes, about half the loop's longest
    stalls (bench/scale.py). Collected as usual once the launch returns."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def rank_addresses(dep: Deployment) -> list[str]:
    """jobplan.rank_addresses with the name lookups (nodes without ``ips``) made concurrently, in threads."""
    nodes = dep.rank_nodes()
    all_local = all(n.is_local for n in nodes)

    async def one(n) -> str:
        if all_local or n.ips or n.is_local:  # no lookup
            return hostfile.rank_address(n, all_local=all_local, backend=dep.backend)
        return await asyncio.to_thread(hostfile.rank_address, n, all_local=all_local, backend=dep.backend)

    return list(await asyncio.gather(*(one(n) for n in nodes)))


class ManifestSaver:
    """Coalesced saves of a changing manifest: one in flight, and one more that covers every change made while it
    ran (so N ranks starting together cost 2-3 saves, not N). The snapshot is taken on the loop; the JSON, the
    signature and the fsyncs in a thread."""

    def __init__(self, store, m):
        self.store, self.m = store, m
        self.lock = asyncio.Lock()
        self.changed = self.saved = self.saves = 0

    async def save(self) -> None:
        self.changed += 1
        want = self.changed
        async with self.lock:
            if self.saved >= want:
                return  # a save that began after this change covered it
            covers = self.changed
            await asyncio.to_thread(self.store.save_doc, self.m.job_id, self.m.model_dump(mode="json"))
            self.saved, self.saves = covers, self.saves + 1


def _contracts(plan: JobPlan, dep: Deployment, dep_path: Path, key) -> dict[str, bytes]:
    """Every rank's signed contract by path (in a thread: a hash of the deployment file, N signatures)."""
    proof = deployment_proof(dep_path.read_bytes(), dep)
    return {f.path: encode_contract(proof, contract_payload(f.spec), key) for f in plan.files if f.spec is not None}


async def _start(run: Running, plan: JobPlan, dep: Deployment, dep_path: Path, key, log) -> None:
    """Files, lease, ranks, ready, gate, serving, canary: the job from its plan to ready."""
    hs, opts, records = run.hs, run.opts, run.manifest.ranks
    save = ManifestSaver(run.store, run.manifest).save
    contracts = await asyncio.to_thread(_contracts, plan, dep, dep_path, key)
    files: dict[str, list] = {}
    for f in plan.files:  # grouped once (plan.files_of per node would walk every file N times)
        files.setdefault(f.node, []).append(f)
    await asyncio.gather(*(_write_files(hs[node], fs, contracts) for node, fs in files.items()))
    if plan.lease_seconds:
        await renew_leases(hs, plan.lease_paths(), plan.lease_seconds, seq=0)
        run.lease_task = asyncio.ensure_future(lease_loop(hs, plan.lease_paths(), plan.lease_seconds))
    results = await asyncio.gather(*(_start_rank(run, r, save) for r in dep.ranks), return_exceptions=True)
    errs = [e for e in results if isinstance(e, BaseException)]
    if errs:
        raise errs[0]
    log(f"started {plan.world} rank(s); waiting for them to load")
    await _wait_markers(run, dep, {"ready", "serving"}, opts.timeout, "load and become ready")
    for r in dep.ranks:
        records[r.rank].state = "ready"
    await asyncio.gather(*(hs[n].write_file(p, rf.GATE_OPEN) for n, p in plan.gate_paths().items()))
    await _wait_markers(run, dep, {"serving"}, opts.timeout, "start serving", only_rank=0)
    rank0 = hs[dep.ranks[0].node]
    m0 = rf.parse_marker(await rank0.read_json(records[0].marker_path))
    endpoint = (m0.endpoint if m0 else None) or f"http://{opts.http_host}:{plan.http_port}"
    if opts.canary:
        ans = await rank0.ask(CanaryRequest(url=endpoint, api_key=opts.any_key, timeout=120))
        if not ans.ok:
            raise LaunchFailed(f"canary request to rank 0 produced no tokens: {ans.error or ans.wire()}")
    run.manifest.state, run.manifest.endpoint = "ready", endpoint
    await save()


async def _write_files(h: NodeHandle, files: list, contracts: dict[str, bytes]) -> None:
    """A node's files of the plan (trusted key, hostfile, contract signed beforehand), all at once: one round
    trip, not three; nothing reads them before every write is done (the rank starts after)."""
    await asyncio.gather(*(h.write_file(f.path, f.data if f.spec is None else contracts[f.path], mode=f.mode)
                           for f in files))


async def _start_rank(run: Running, r, save) -> None:
    h, rec, opts = run.hs[r.node], run.manifest.ranks[r.rank], run.opts
    argv = [h.transport.python, "-m", "clusterctl.rank", "--contract", rec.contract_path, "--node", r.node]
    env = {"CLUSTERCTL_NONCE": run.manifest.nonce}
    if opts.detach:
        info = await h.ask(SpawnRequest(argv=argv, env=env, log_path=rec.log_path))
        rec.pid, rec.pgid, rec.start_time, rec.boot_id = info.pid, info.pgid, info.start_time, info.boot_id
    else:
        p = await h.transport.start(argv, env=env, grace=opts.grace)
        run.watch(r.rank, p)
        rec.pid, rec.pgid, rec.start_time, rec.boot_id = p.info.pid, p.info.pgid, p.info.start_time, p.info.boot_id
    rec.state = "started"
    await save()


async def _after_failure(run: Running, launch_error: BaseException) -> BaseException | None:
    """Tear down what a failed launch started. Returns the error to raise instead, or None: raise the original.

    A launch that failed after ranks started (load, join, gate, serving, canary) keeps every rank's log under
    ``<state>/reports/<job>/`` once the ranks are stopped and before their node files go, and its error names
    the failing rank's last line and that folder (launch/ranklogs.py). An interrupted launch keeps nothing."""
    failed = isinstance(launch_error, ClusterctlError) and any(r.pid for r in run.manifest.ranks)
    kept: list = []

    async def keep() -> None:
        if failed and not kept:
            kept.append(await _keep_logs(run, launch_error, gone))

    gone = await _gone_ranks(run) if failed else {}
    try:
        report = await run.teardown(before_clean=keep)
    except Exception as te:  # the teardown error is reported too, never instead
        report = None
        teardown_note = f"; teardown also failed: {te}"
        with contextlib.suppress(Exception):
            await keep()  # what the coordinator holds (a foreground rank's output) is kept all the same
    else:
        teardown_note = "" if report.ok else "; teardown could not confirm: " + "; ".join(report.survivors())
    if isinstance(launch_error, (KeyboardInterrupt, asyncio.CancelledError)):
        if report is not None and not report.ok:
            return LaunchFailed("launch interrupted" + teardown_note, teardown=report)
        return None
    if isinstance(launch_error, LaunchFailed):
        err = launch_error
    elif isinstance(launch_error, ClusterctlError):
        err = LaunchFailed(launch_error.message, hint=launch_error.hint, exit_code=launch_error.exit_code)
    else:
        return None
    err.teardown = report
    if kept and kept[0] is not None:
        err = explain(err, kept[0])
    err.message += teardown_note
    err.args = (err.message,)
    return None if err is launch_error else err


async def _gone_ranks(run: Running) -> dict[int, bool]:
    """The started ranks whose process is gone now, as the launch fails (before its teardown stops the rest),
    each with whether it only followed another: it exited for a lost peer, lease or parent (exit 69, or a
    marker that says so). A foreground rank's keeper has exited; a detached rank's process is dead on its node
    (identity-checked)."""

    gone = {r: run.procs[r].returncode == int(Exit.UNAVAILABLE) for r in run.procs if run.exited(r)}
    detached = [rec for rec in run.manifest.ranks if rec.pid and rec.rank not in run.procs]
    by_node: dict[str, list] = {}
    for rec in detached:
        by_node.setdefault(rec.node, []).append(rec)

    async def one(node: str, recs: list) -> None:
        targets = [x.identity(run.manifest.nonce) for x in recs]
        with contextlib.suppress(ClusterctlError):
            ans = await run.hs[node].ask(AliveRequest(targets=targets), timeout=30)
            for x, st in zip(recs, ans.status):
                if st in ("dead", "foreign"):
                    mk = rf.parse_marker(await run.hs[node].read_json(x.marker_path))
                    gone[x.rank] = mk is not None and rf.followed_a_peer(mk.state, mk.reason)

    await asyncio.gather(*(one(n, recs) for n, recs in by_node.items()))
    return gone


async def _keep_logs(run: Running, error: BaseException, gone: dict[int, bool]):
    """Every rank's log into ``<state>/reports/<job>/``; None when even that folder cannot be made."""

    try:
        logs = await keep_logs(run, reports_dir(run.store) / run.manifest.job_id)
    except (OSError, ClusterctlError):
        return None
    logs.failing = with_own_failure(failing_rank(error, run, gone), logs)
    return logs


async def _wait_markers(run: Running, dep: Deployment, states: set[str], timeout: float, what: str,
                        only_rank: int | None = None) -> None:
    deadline = time.monotonic() + timeout
    ranks = [r for r in dep.ranks if only_rank is None or r.rank == only_rank]
    last: dict[int, str] = {}
    while True:
        for r in ranks:
            p = run.procs.get(r.rank)
            if p is not None and run.exited(r.rank):
                tail = last_lines(p.stderr_tail)
                raise LaunchFailed(f"rank {r.rank} on {r.node} exited with code {p.returncode} before it was ready"
                                   + (f": {tail[-1].strip()}" if tail else ""),
                                   ranks=[FailedRank(r.rank, r.node, stderr_tail="\n".join(tail))])
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
                 for r, d, e in zip(rs, ans.markers, ans.exited)}
        pending = []
        for i, r in enumerate(ranks):
            if i and not i % YIELD_EVERY:
                await asyncio.sleep(0)  # hundreds of markers: let the loop serve the nodes' connections between
            doc, exited = found[r.rank]
            mk = rf.parse_marker(doc)
            st = mk.state if mk else "starting"
            last[r.rank] = st
            if st == "failed":
                raise LaunchFailed(f"rank {r.rank} on {r.node} failed: {printable(mk.error or 'no reason given')}",
                                   ranks=[FailedRank(r.rank, r.node, error=mk.error)])
            if exited is not None:
                tail = [printable(x) for x in exited.log_tail]
                log_path = run.manifest.ranks[r.rank].log_path
                raise LaunchFailed(f"rank {r.rank} on {r.node} exited before it was ready"
                                   + (f": {tail[-1]}" if tail else f" (nothing in {log_path})"),
                                   ranks=[FailedRank(r.rank, r.node, stderr_tail="\n".join(tail[-20:]),
                                                     log_path=log_path)])
            if st not in states:
                pending.append(r)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise LaunchFailed(f"timed out after {timeout:g} s waiting for ranks to {what}: " + ", ".join(
                f"rank {r.rank} on {r.node} is {last.get(r.rank)}" for r in pending))


def _detached(run: Running, r) -> WatchedRank | None:
    """What the marker wait watches of a detached rank: its process (pid, start time, nonce) and its log. A
    foreground rank is watched through its keeper instead."""
    rec = run.manifest.ranks[r.rank]
    if r.rank in run.procs or not rec.pid or not rec.log_path:
        return None
    return WatchedRank(**rec.identity(run.manifest.nonce).model_dump(), log_path=rec.log_path)
