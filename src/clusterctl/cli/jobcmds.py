"""The commands of running jobs: launch, teardown, replan, history, cancel, reap, status."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from clusterctl.cli.flaggroups import flag_groups
from clusterctl.cli.frontcmds import front_for, stop_started
from clusterctl.cli.launchflags import LaunchFlags, RelaunchFlags
from clusterctl.cli.options import (AcceptNewOpt, DrainOpt, FrontOpt, GraceOpt, HealFlags, JsonOpt, KnownHostsOpt,
                                    QuietOpt, StateOpt, app, complete_targets, number, output, ssh_options, state_of)
from clusterctl.cli.replanview import PlanFlags, ReplanRequest, run_replan
from clusterctl.errors import Exit, UsageError
from clusterctl.statedir import history as hist
from clusterctl.render import heal_line, history_line, serving_line, status_table, watch_view

if TYPE_CHECKING:
    from clusterctl.statedir.state import StateDir


@app.command()
@flag_groups
def launch(
    ctx: typer.Context,
    *,
    deployment: Annotated[str, typer.Argument(help="A deployment file or id.", autocompletion=complete_targets)],
    detach: Annotated[bool, typer.Option("--detach", help="Return once ready; `clusterctl teardown` ends it.")] = False,
    serving: LaunchFlags,
    front: FrontOpt = None,
    heal: Annotated[bool, typer.Option("--heal", help="Supervise: heal onto the nodes that answer when a rank or node is lost, go back when it is healthy (docs/heal.md).")] = False,
    healing: HealFlags,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Preflight every node, start one rank per node, wait until all are ready, then supervise them."""
    o = output(ctx, json, quiet)
    import asyncio

    opts = serving.options(detach=detach)
    if heal and detach:
        raise UsageError("--heal supervises in the foreground: leave out --detach, or launch detached and run "
                         "`clusterctl supervise` (docs/heal.md)")
    policy = healing.policy() if heal else None

    state = state_of(state_dir)
    started = front_for(o, state, front, lambda: state.load_deployment(deployment)[1].deployment.cluster,
                         serving.known_hosts, serving.accept_new_host_keys)
    try:
        code = asyncio.run(_launched(o, state, deployment, opts, detach, policy))
    except BaseException:
        stop_started(state, started)  # a front this launch started does not outlive its failed launch
        raise
    raise typer.Exit(code)


@app.command()
def teardown(
    ctx: typer.Context,
    target: Annotated[Optional[str], typer.Argument(help="A deployment file, deployment id or job id (default: every job).",
                                                    autocompletion=complete_targets)] = None,
    grace: GraceOpt = 10.0,
    force: Annotated[bool, typer.Option("--force", help="Stop even while ranks report requests in flight.")] = False,
    drain: DrainOpt = 0.0,
    known_hosts: KnownHostsOpt = None,
    accept_new_host_keys: AcceptNewOpt = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Stop ranks verified: TERM, grace, KILL, confirm every process is gone; keep the manifest if not. A
    supervised cluster's supervisor is stopped first (docs/heal.md)."""
    o = output(ctx, json, quiet)
    import asyncio

    from clusterctl.launch.teardown import MALFORMED_HINT, teardown_command

    malformed: list[dict] = []
    reports = asyncio.run(teardown_command(state_of(state_dir), target, ssh_options(known_hosts, accept_new_host_keys),
                                           grace=grace, force=force, drain=drain, log=o.info, malformed=malformed,
                                           supervisors=True))
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
    if ok:
        from clusterctl.front.records import stop_idle_auto_fronts

        for rec in stop_idle_auto_fronts(state_of(state_dir), grace=grace):
            o.info(f"front {rec.url} of cluster {rec.cluster}: stopped (its cluster has no job left)")
    raise typer.Exit(0 if ok else int(Exit.FAILED))


async def _launched(o, state: StateDir, deployment: str, opts, detach: bool, policy) -> int:
    """The launch in the foreground (or detached), or under the supervisor with --heal (supervise/loop.py)."""
    if policy is not None:
        from clusterctl.supervise.run import run_supervised

        return await run_supervised(o, state, deployment, opts, policy, take_over=False)
    from clusterctl.launch.foreground import run_foreground
    from clusterctl.launch.start import launch as do_launch

    return await run_foreground(o, lambda: do_launch(deployment, state, opts, log=o.info), detach)


@app.command()
@flag_groups
def replan(
    ctx: typer.Context,
    *,
    target: Annotated[Optional[str], typer.Argument(help="The current deployment: file, deployment id or job id (default: the one running).",
                                                    autocompletion=complete_targets)] = None,
    plan: PlanFlags,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Apply without asking.")] = False,
    drain: DrainOpt = 0.0,
    detach: Annotated[bool, typer.Option("--detach", help="The new job runs detached (default: as the old one did).")] = False,
    foreground: Annotated[bool, typer.Option("--foreground", help="The new job runs in the foreground (default: as the old one did).")] = False,
    serving: RelaunchFlags,
    front: FrontOpt = None,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Preview a new plan for a running deployment, then drain, stop verified, swap the deployment file and
    relaunch. Whatever is not given is derived from the current deployment."""
    o = output(ctx, json, quiet)
    if detach and foreground:
        raise UsageError("--detach and --foreground contradict each other: give one")
    req = ReplanRequest(target=target, detach=True if detach else False if foreground else None, drain=drain,
                        yes=yes, front=front, plan=plan, launch=serving)
    raise typer.Exit(run_replan(o, state_of(state_dir), req))


@app.command()
def history(
    ctx: typer.Context,
    target: Annotated[Optional[str], typer.Argument(help="A deployment file, deployment id or cluster name (default: every cluster).",
                                                    autocompletion=complete_targets)] = None,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Applied replans, oldest first: when, from which deployment to which (plan_hash), and what changed."""
    o = output(ctx, json, quiet)
    state = state_of(state_dir)
    found = {c: hist.entries(state, c) for c in hist.clusters_of(state, target)}
    if o.json:
        o.data({"clusters": [{"cluster": c, "current": (e[-1]["to"] if e else None), "entries": e}
                             for c, e in found.items()]})
        return
    for c, items in found.items():
        for e in items:
            o.line(history_line(c, e, kept=(state.deployments / f"{e['from']}.json").exists()))
    if not any(found.values()):
        o.info("no replan applied yet")


@app.command()
def cancel(
    ctx: typer.Context,
    target: Annotated[str, typer.Argument(help="A deployment file, deployment id or job id.",
                                          autocompletion=complete_targets)],
    request: Annotated[Optional[list[str]], typer.Option("--request", "-r", help="A request id to cancel (repeatable).")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Cancel every request in flight or queued.")] = False,
    wait: Annotated[float, typer.Option("--wait", help="Wait up to S seconds for every rank to ack this cancel (0: write it and return without proof).",
                                        parser=number(0, 86400), metavar="SECONDS")] = 10.0,
    known_hosts: KnownHostsOpt = None,
    accept_new_host_keys: AcceptNewOpt = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Cancel requests on a running deployment (at the ranks' next step boundary; the ranks stay up)."""
    o = output(ctx, json, quiet)
    import asyncio

    from clusterctl.launch.cancel import CancelNotAcked, cancel_command

    if bool(request) == all_:
        raise UsageError("say which requests: --request ID (repeatable) or --all")
    try:
        results = asyncio.run(cancel_command(state_of(state_dir), target, ssh_options(known_hosts, accept_new_host_keys),
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
    ctx: typer.Context,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be reaped; signal nothing.")] = False,
    grace: GraceOpt = 10.0,
    known_hosts: KnownHostsOpt = None,
    accept_new_host_keys: AcceptNewOpt = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """For cron: reap the ranks of launches whose coordinator died. Silent when there is nothing to do."""
    o = output(ctx, json, quiet)
    import asyncio

    from clusterctl.launch.reaper import reap as do_reap

    report = asyncio.run(do_reap(state_of(state_dir), ssh_options(known_hosts, accept_new_host_keys), grace=grace,
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
    ctx: typer.Context,
    target: Annotated[Optional[str], typer.Argument(help="Only this deployment: its file, deployment id or job id.",
                                                    autocompletion=complete_targets)] = None,
    all_: Annotated[bool, typer.Option("--all", "-a", help="Show every column.")] = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh in place until Ctrl-C (with --json: one "
                                                              "JSON line per refresh).")] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between refreshes of --watch.",
                                            parser=number(0.2, 3600), metavar="S")] = 2.0,
    known_hosts: KnownHostsOpt = None,
    accept_new_host_keys: AcceptNewOpt = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """What runs where, per rank: node, pid, state, layers, heartbeat age, active requests, endpoint."""
    o = output(ctx, json, quiet)
    import asyncio

    from clusterctl.launch.status import status as do_status

    if watch:
        _watch(o, state_of(state_dir), ssh_options(known_hosts, accept_new_host_keys), target, interval)
        return
    doc = asyncio.run(do_status(state_of(state_dir), ssh_options(known_hosts, accept_new_host_keys),
                                ref=target)).to_json()
    if o.json:
        o.data(doc)
        return
    if not doc["jobs"]:
        o.info(f"no launches of {target}" if target else "no launches")
    for job in doc["jobs"]:
        o.table(status_table(job, wide=all_))
        if all_:
            o.info(serving_line(job.get("serving")))
    for f in doc.get("fronts") or []:
        o.info(f"front {f['url']}: cluster {f['cluster']} (pid {f['pid']}; clients keep this URL across replans)")
    for m in doc["malformed"]:
        o.warn(f"malformed manifest: {m['manifest']}: {m['error']}")
    if doc.get("heal"):
        for h in doc["heal"]:
            o.info(heal_line(h, plain=True))


def _watch(o, state: StateDir, ssh, target, interval: float) -> None:
    """The live view: a Rich table redrawn in place on a terminal, one JSON line per refresh with --json."""
    from clusterctl.launch.watch import watch
    if o.json:
        watch(state, ssh, target, interval, lambda doc: o.event("status", doc))
        return
    if not o.console.is_terminal:  # piped: one table per refresh, nothing redrawn
        watch(state, ssh, target, interval, lambda doc: o.table(watch_view(doc)))
        return
    from rich.live import Live

    with Live(console=o.console, auto_refresh=False, transient=False) as live:
        watch(state, ssh, target, interval, lambda doc: live.update(watch_view(doc), refresh=True))
