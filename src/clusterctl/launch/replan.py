"""``clusterctl replan``, the action: from the running plan to a new one in one step.

propose()  the current deployment (a file, a deployment id, a job id, or the only one running), the new plan
           derived from it plus what the operator gave (plan/replan.py), its placement diff. Nothing changes.
apply()    under the cluster's replan lock: an unchanged plan only rewrites the deployment record; otherwise
           refuse unless every rank is idle (after ``drain`` seconds), verified teardown of the old job (if it
           cannot be verified, stop: the old deployment stays current), atomic swap of the deployment file the
           operator named (the old one stays signed in the state dir), a history entry, and a launch of the new
           deployment the way the old job ran (detached or in the foreground: launch/foreground.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from clusterctl.errors import ClusterctlError, ConfigError, Exit, IntegrityError, LaunchFailed, MissingInput, UsageError
from clusterctl.protocol.deployment import Deployment, decode, identity_changes
from clusterctl.statedir import history
from clusterctl.atomic import atomic_write_bytes, read_capped, stage_bytes
from clusterctl.launch.foreground import run_foreground
from clusterctl.launch.hubmodel import refetch, with_hub
from clusterctl.launch.jobplan import LaunchOptions
from clusterctl.statedir.manifest import manifest_store, now_iso
from clusterctl.connect.nodes import close_all, handles
from clusterctl.launch.plannedmodel import planned_manifest, record_manifest
from clusterctl.launch.preflight import copy_problem
from clusterctl.protocol.nodeops import ModelFolder, ProbeRequest
from clusterctl.launch.quiescence import refuse_activity
from clusterctl.launch.reaper import live_jobs
from clusterctl.launch.start import launch
from clusterctl.launch.teardown import teardown_command
from clusterctl.locks import Lock
from clusterctl.plan.commands import fill_memory
from clusterctl.plan.inventory import load_cluster
from clusterctl.plan.model import inspect_model
from clusterctl.plan.adapter import carried
from clusterctl.plan.planner import make_deployment
from clusterctl.plan.replan import PlanDiff, derive, placement_diff
from clusterctl.statedir.state import StateDir


@dataclass
class Proposal:
    old_path: Path
    old: Deployment
    new: Deployment
    diff: PlanDiff
    operator_file: Path | None  # the deployment FILE the operator named (swapped in place), if not in the state dir
    inputs: dict = field(default_factory=dict)  # {"given": {...}, "derived": {...}}
    jobs: list = field(default_factory=list)  # live launch manifests of the old deployment
    rollback_to: str | None = None
    new_bytes: bytes | None = None  # --to: the signed file of that deployment as kept, put back byte for byte

    def to_json(self) -> dict:
        return {"current": self.old.deployment_id, "new": self.new.deployment_id, "unchanged": self.diff.unchanged,
                **self.inputs, "diff": self.diff.to_json(), "jobs": [m.job_id for m in self.jobs],
                "deployment_file": str(self.operator_file or self.old_path), "rollback_to": self.rollback_to}


def _manifests(state: StateDir):
    if not state.launches.is_dir():
        return []
    good, _ = manifest_store(state).all()
    return [m for _, m in good]


def resolve_current(state: StateDir, ref: str | None) -> tuple[Path, Deployment, Path | None]:
    """The deployment to replan: FILE, deployment id, job id, or (no ref) the one deployment that runs."""
    jobs = _manifests(state)
    if ref is None:
        ids = sorted({m.deployment_id for m in jobs})
        if len(ids) != 1:
            raise UsageError("name the deployment to replan" + (f": {len(ids)} are running ({', '.join(ids)})"
                                                                 if ids else ": none is running"))
        ref = ids[0]
    else:
        by_job = [m for m in jobs if m.job_id == ref]
        if by_job:
            ref = by_job[0].deployment_id
    path, loaded = state.load_deployment(ref)
    operator_file = None if state.is_deployment_file(path) else path
    return path, loaded.deployment, operator_file


class PlanChange(BaseModel):
    """What a replan asks of the new plan (the operator's flags, or a heal's nodes); whatever it leaves out comes
    from the current deployment (plan/replan.py derive). ``to``: a previous deployment as it is, alone."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cluster_file: Path | None = None  # a cluster.toml whose nodes replace the current ones
    nodes: list[str] | None = None  # the nodes to plan on, in rank order
    options: dict[str, Any] | None = None  # PlanOptions fields given (a key present = given, even when None)
    path_map: dict[str, str] | None = None  # per-node model paths ({}: every node its model_path)
    to: str | None = None  # a previous deployment id


def propose(state: StateDir, ref: str | None, change: PlanChange = PlanChange()) -> Proposal:
    """The preview. ``jobs`` lists every launch manifest of the current deployment (``live_jobs`` narrows it to
    the live ones once SSH is at hand)."""

    cluster_file, nodes, options, path_map, to = (change.cluster_file, change.nodes, change.options,
                                                  change.path_map, change.to)
    old_path, old, operator_file = resolve_current(state, ref)
    new_bytes = None
    if to is not None:
        if cluster_file or nodes or options or path_map is not None:
            raise UsageError("--to takes a previous deployment as it is: give no other plan option with it")
        to_path, loaded = state.load_deployment(to)
        new = loaded.deployment
        if new.cluster != old.cluster:
            raise ConfigError(f"deployment {to} is of cluster {new.cluster}, not {old.cluster}")
        if state.is_deployment_file(to_path):  # kept in the state dir: put back as it is, byte for byte
            new_bytes = read_capped(to_path, what="deployment file")
        inputs = {"given": {"to": new.deployment_id}, "derived": {}}
    else:
        cluster = fill_memory(load_cluster(cluster_file)) if cluster_file is not None else None
        ins = derive(old, cluster=cluster, nodes=nodes, options=options, path_map=path_map,
                     speeds_seen=speeds_seen(state, old.cluster))
        if not Path(ins.model_path).is_dir() and old.model.hub and ins.model_path == old.model.source_path:
            refetch(old.model.hub)  # the hub cache was cleaned: the planned commit, downloaded to the same place
        if not Path(ins.model_path).is_dir():
            raise MissingInput(f"the model {ins.model_path} is not on this machine: replan needs it to plan",
                               hint="run replan where the deployment was planned")
        new = make_deployment(ins.cluster, inspect_model(Path(ins.model_path)), ins.model_path, ins.options,
                              path_map=ins.path_map)
        # the same hub snapshot keeps its repository and commit (and its name); another folder is another model
        new = with_hub(new, old.model.hub if ins.model_path == old.model.source_path else None)
        if old.adapter is not None:  # the same adapter content, at the new nodes' paths
            new = carried(old.adapter, new)
        new = record_manifest(state, new, ins.model_path)
        inputs = ins.to_json()
    named = _named(old, new)
    if named.deployment_id != new.deployment_id:
        new_bytes = None  # the same deployment under the current id: re-signed as such
    jobs = [m for m in _manifests(state) if m.deployment_id == old.deployment_id]
    return Proposal(old_path=old_path, old=old, new=named, diff=placement_diff(old, named),
                    operator_file=operator_file, inputs=inputs, jobs=jobs, rollback_to=old.deployment_id,
                    new_bytes=new_bytes)


def _named(old: Deployment, new: Deployment) -> Deployment:
    """The new deployment's id: the old one's when nothing in the identity differs (only measurements or the
    manifest record: the running job stays the deployment's job, even for a file whose id predates the identity
    hash); else its own, which never equals the old one (the old record is never overwritten)."""

    if not identity_changes(old, new):
        return new.model_copy(update={"deployment_id": old.deployment_id})
    if new.deployment_id == old.deployment_id:
        raise IntegrityError(f"deployment {old.deployment_id}: the new plan differs but would have the same id",
                             hint="plan again with `clusterctl plan` (the old record is kept)")
    return new


async def check_new_paths(state: StateDir, p: Proposal, ssh) -> list[str]:
    """Before anything stops: every model folder the new deployment uses that the current one does not (a new
    --path-map entry, a node that joins, a deployment gone back to) is checked on its node the way launch
    preflight checks it (the folder and its files, and the copy against the planned manifest). One error naming
    every bad path, exit 69; nothing has changed then. Returns the ``node=path`` pairs checked."""
    import asyncio

    todo = {n: path for n, path in p.new.path_map.items()
            if n in {r.node for r in p.new.ranks} and p.old.path_map.get(n) != path}
    if not todo:
        return []
    manifest = await asyncio.to_thread(planned_manifest, state, p.new)
    mdoc = manifest.model_dump(mode="json") if manifest is not None else None
    hs = handles([p.new.node(n) for n in todo], ssh)

    async def one(name: str) -> str | None:
        ans = await hs[name].ask(ProbeRequest(model_path=todo[name], manifest=mdoc))
        model = ans.model or ModelFolder(ok=False)
        if not model.ok and model.absent:
            return model.error  # said plainly, not as a copy with every file missing
        if ans.copy_check is not None:
            bad = copy_problem(ans.copy_check, todo[name], p.new.deployment_id)
            if bad:
                return bad
        return None if model.ok else (model.error or f"model check of {todo[name]} failed")

    try:
        results = await asyncio.gather(*(one(n) for n in todo), return_exceptions=True)
    finally:
        await close_all(hs)
    problems = []
    for name, res in zip(todo, results):
        if isinstance(res, BaseException):
            if not isinstance(res, ClusterctlError):
                raise res
            res = res.message
        if res:
            problems.append(f"{name}: {res}")
    if problems:
        raise LaunchFailed(f"the new deployment {p.new.deployment_id} could not launch: " + "; ".join(problems)
                           + f"; nothing was changed, deployment {p.old.deployment_id} stays current",
                           hint="copy the model there (clusterctl sync), or give another --path-map",
                           exit_code=Exit.UNAVAILABLE)
    return [f"{n}={path}" for n, path in todo.items()]


def speeds_seen(state: StateDir, cluster: str) -> dict[str, float]:
    """Node speeds recorded by the cluster's earlier deployments (history), the newest winning."""

    out: dict[str, float] = {}
    for e in history.entries(state, cluster):  # oldest first: later entries overwrite
        for dep_id in (e.get("from"), e.get("to")):
            try:
                _, loaded = state.load_deployment(dep_id)
            except ClusterctlError:
                continue  # a deployment file that is gone or damaged only loses its speeds
            out.update(loaded.deployment.speeds)
    return out


def lock_for(state: StateDir, p: Proposal):
    return Lock(state.locks / f"replan-{p.old.cluster}.lock").acquire(what=f"replan of cluster {p.old.cluster}")


def write_new(state: StateDir, p: Proposal):
    """The new deployment signed into the state dir, and staged (written, fsynced, not yet in place) over the
    file the operator named: ``.commit()`` swaps it in, ``.discard()`` drops it. Done before the old job is
    stopped, so a full disk or a read-only folder stops the replan while the old job still serves. Returns an
    object with ``commit``/``discard`` (which do nothing when there is no operator file to swap)."""
    if not (state.deployments / f"{p.old.deployment_id}.json").exists():
        _keep(state, p)  # the way back must stay signed in the state dir
    if p.new_bytes is not None:  # --to: that deployment's file is in the state dir already, as it was kept
        return stage_bytes(p.operator_file, p.new_bytes) if p.operator_file is not None else _NothingStaged()
    return state.stage_deployment(p.new, p.operator_file) or _NothingStaged()


def _keep(state: StateDir, p: Proposal) -> None:
    """The current deployment into the state dir as the very bytes it was read from (so `--to` gives back the
    same file, even one written by an older clusterctl), or re-signed when those bytes no longer say it."""

    try:
        data = read_capped(p.old_path, what="deployment file")
        same = decode(data, state.keyring.public_keys(), source=str(p.old_path)).deployment == p.old
    except ClusterctlError:
        same = False
    if same:
        atomic_write_bytes(state.deployments / f"{p.old.deployment_id}.json", data)
    else:
        state.save_deployment(p.old)


class _NothingStaged:
    def commit(self) -> None:
        pass

    def discard(self) -> None:
        pass


def record(state: StateDir, p: Proposal, *, changes: list[str], relaunched: str | None, kind: str | None = None) -> None:
    """A history entry; ``kind`` ``heal`` or ``rejoin`` when the supervisor made it (supervise/loop.py)."""

    history.append(state, p.old.cluster, {
        "applied_at": now_iso(), "from": p.old.deployment_id, "from_hash": p.old.plan_hash,
        "to": p.new.deployment_id, "to_hash": p.new.plan_hash, "changes": changes,
        "file": str(p.operator_file) if p.operator_file else None, "relaunched": relaunched,
        **({"kind": kind} if kind else {})})


def changes_of(p: Proposal) -> list[str]:
    out = []
    for r in p.diff.nodes:
        if r.change in ("joins", "leaves"):
            out.append(f"{r.node} {r.change}")
        elif r.change == "moves":
            a, b = r.layers_before, r.layers_after
            out.append(f"{r.node} [{a[0]},{a[1]})->[{b[0]},{b[1]})")
        if r.path_moved:
            out.append(f"{r.node} path {r.path_before}->{r.path_after}")
    out += [f"{o.field} {o.before}->{o.after}" for o in p.diff.other]
    if not p.diff.unchanged and not out:  # e.g. a node's record (memory, python, links): name the fields
        out += [f"{f} changed" for f in p.diff.fields_changed]
    if p.diff.unchanged:
        out += [f"{c} updated" for c in p.diff.records_changed] or ["nothing"]
    return out


async def stop_old(state: StateDir, p: Proposal, ssh, *, grace: float, drain: float, log) -> None:
    """Refuse unless idle, then verified teardown of every job of the old deployment."""

    if not p.jobs:
        return
    # replan stops nothing that works: busy OR unknown (a rank unreachable or stale) refuses
    await refuse_activity(p.jobs, ssh, refuse=("busy", "unknown"), drain=drain, log=log, hints={
        "busy": "wait (--drain SECONDS) or cancel the requests, then replan again",
        "unknown": "check the ranks (clusterctl status), or tear the job down first"})
    for m in p.jobs:
        reports = await teardown_command(state, m.job_id, ssh, grace=grace, force=True, log=log)
        bad = [r for r in reports if not r.ok]
        if bad:
            raise ClusterctlError(
                f"teardown of job {m.job_id} could not be verified: {'; '.join(bad[0].survivors())}; deployment "
                f"{p.old.deployment_id} stays current and nothing was relaunched",
                hint=f"stop what is left, then `clusterctl teardown {m.job_id}` and replan again")


def relaunch_endpoint(p: Proposal) -> tuple[str, int | None, bool]:
    """Where and how the new job runs unless told otherwise: the old job's host, port and mode (detached)."""

    m = p.jobs[0] if p.jobs else None
    old_host, port = "127.0.0.1", None
    if m is not None and m.endpoint:
        hostport = m.endpoint.split("://", 1)[-1]
        h, _, pt = hostport.rpartition(":")
        old_host, port = h.strip("[]") or old_host, int(pt) if pt.isdigit() else m.http_port
    return old_host, port, m.coordinator.detached if m is not None else True


def deployment_ref(p: Proposal) -> str:
    return str(p.operator_file) if p.operator_file else p.new.deployment_id


def way_back(state: StateDir, p: Proposal) -> str:
    return f"clusterctl replan {os.fspath(p.operator_file) if p.operator_file else p.new.deployment_id} " \
           f"--to {p.old.deployment_id} --yes"


async def live_jobs_of(state: StateDir, p: Proposal, ssh) -> list:
    """The live jobs of the current deployment (``p.jobs`` lists its launch manifests, live or not)."""

    if not p.jobs:
        return []
    return await live_jobs(manifest_store(state), ssh,
                           p.old.deployment_id)


def apply(state: StateDir, p: Proposal, opts: LaunchOptions, *, drain: float, out, doc: dict) -> int:
    """Apply a previewed replan under the cluster's replan lock (see the module docstring): the old job stopped
    with ``opts``' SSH options and grace, the new one launched with ``opts``; ``out`` is the command's output,
    ``doc`` the preview as data. Returns the exit code (of the new job, in the foreground)."""
    import asyncio

    ssh, grace = opts.ssh, opts.grace

    lock = lock_for(state, p)
    try:
        if p.diff.unchanged:
            write_new(state, p).commit()
            record(state, p, changes=changes_of(p), relaunched=None)
            if out.json:
                out.data({**doc, "action": "unchanged"})
            out.info(f"unchanged plan: {', '.join(p.diff.records_changed)} updated in {deployment_ref(p)}; "
                     "no rank was restarted")
            return 0
        staged = write_new(state, p)  # before anything stops: a full disk ends the replan here
        try:
            asyncio.run(stop_old(state, p, ssh, grace=grace, drain=drain, log=out.info))
        except BaseException:
            staged.discard()
            raise
        staged.commit()
        if not p.jobs:
            record(state, p, changes=changes_of(p), relaunched=None)
            if out.json:
                out.data({**doc, "action": "applied", "job": None})
            out.info(f"deployment {p.new.deployment_id} is current (it was not running: nothing relaunched)")
            return 0
        return asyncio.run(run_foreground(out, lambda: _relaunch(state, p, opts, lock, out.info), opts.detach,
                                          ready_extra={**doc, "action": "applied"}))
    finally:
        lock.release()


async def _relaunch(state: StateDir, p: Proposal, opts, lock, log):
    try:
        running = await launch(deployment_ref(p), state, opts, log=log)
    except ClusterctlError as e:
        record(state, p, changes=changes_of(p), relaunched=None)
        raise ClusterctlError(f"deployment {p.new.deployment_id} did not launch: {e.message}",
                              hint=f"the previous deployment is kept: {way_back(state, p)}",
                              exit_code=e.exit_code) from None
    record(state, p, changes=changes_of(p), relaunched=running.manifest.job_id)
    lock.release()  # the new job runs: another replan may now follow it
    return running
