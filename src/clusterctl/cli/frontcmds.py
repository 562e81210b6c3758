"""``clusterctl front``: the front door's command (list, run, start detached, stop); docs/front.md."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from clusterctl.cli.options import (AcceptNewOpt, JsonOpt, KnownHostsOpt, QuietOpt, StateOpt, app, complete_targets,
                                    number, output, ssh_options, state_of)
from clusterctl.errors import ClusterctlError, Exit, UsageError

if TYPE_CHECKING:
    from clusterctl.statedir.state import StateDir


@app.command()
def front(
    ctx: typer.Context,
    address: Annotated[Optional[str], typer.Argument(help="HOST:PORT the front listens on (none: list the fronts).",
                                                     metavar="HOST:PORT")] = None,
    target: Annotated[Optional[str], typer.Argument(help="The cluster to follow: its name, or one of its "
                                                         "deployments (file or id).",
                                                    autocompletion=complete_targets)] = None,
    detach: Annotated[bool, typer.Option("--detach", help="Run in the background; `clusterctl front --stop HOST:PORT` ends it.")] = False,
    stop: Annotated[bool, typer.Option("--stop", help="Stop the front on HOST:PORT (every front without one).")] = False,
    linger: Annotated[float, typer.Option("--linger", help="Exit after S seconds with no job of the cluster (0: never).",
                                          parser=number(0, 7 * 86400), metavar="S")] = 0.0,
    known_hosts: KnownHostsOpt = None,
    accept_new_host_keys: AcceptNewOpt = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """The front door: one stable address that forwards the OpenAI API to the cluster's current rank 0, across
    replans and heals (docs/front.md)."""
    o = output(ctx, json, quiet)
    from clusterctl.front import records as fs

    state = state_of(state_dir)
    if address is not None:
        try:
            host, port = fs.parse_front(address)
        except ValueError as e:
            raise UsageError(f"HOST:PORT: {e}") from None
    if stop:
        gone = [r for r in fs.live_fronts(state)
                if address is None or (r.bind_host, r.port) == (host, port)]
        if address is not None and not gone:
            o.info(f"no front serves {address}")
        stopped = [r for r in gone if fs.stop_front(state, r)]
        if o.json:
            o.data({"stopped": [fs.summary(r) for r in stopped]})
        for r in stopped:
            o.info(f"front {r.url} of cluster {r.cluster}: stopped")
        raise typer.Exit(0 if len(stopped) == len(gone) else int(Exit.FAILED))
    if address is None:
        fronts = [{**fs.summary(r), "state": fs.front_health(r)} for r in fs.live_fronts(state)]
        if o.json:
            o.data({"fronts": fronts})
            return
        for f in fronts:
            o.line(f"{f['url']}  cluster {f['cluster']}  {f['state']}  pid {f['pid']}")
        if not fronts:
            o.info("no front runs")
        return
    if target is None:
        raise UsageError("name the cluster to follow: clusterctl front HOST:PORT CLUSTER")
    cluster = _cluster_named(state, target)
    if detach:
        rec, started = fs.ensure_front(state, cluster, host, port, linger=linger, auto=False,
                                       known_hosts=known_hosts, accept_new=accept_new_host_keys)
        if o.json:
            o.data({**fs.summary(rec), "started": started})
        else:
            o.line(rec.url)
        o.info(f"front {rec.url}: {'started' if started else 'already running'}, follows cluster {cluster}")
        return
    import asyncio

    from clusterctl.front.proxy import serve

    for rec in fs.live_fronts(state):
        if (rec.bind_host, rec.port) == (host, port):
            raise UsageError(f"a front already serves {rec.url} (cluster {rec.cluster}, pid {rec.pid})")
    code = asyncio.run(serve(state, cluster, host, port, ssh=ssh_options(known_hosts, accept_new_host_keys),
                             linger=linger, ready=lambda rec: o.line(rec.url)))
    raise typer.Exit(code)


def _cluster_named(state: StateDir, target: str) -> str:
    """A cluster name, or the cluster of a deployment (file or id)."""
    from clusterctl.names import NAME_RE

    try:
        return state.load_deployment(target)[1].deployment.cluster
    except (ClusterctlError, OSError):
        if NAME_RE.match(target) and not target.endswith(".json"):
            return target
        raise


def front_for(o, state: StateDir, front: str | None, cluster_of, known_hosts, accept_new):
    """--front: the front of the deployment's cluster on that address, found or started detached before any
    rank starts (so a port in use ends the command with nothing started). Returns its record if started here."""
    if front is None:
        return None
    from clusterctl.front.records import ensure_front, parse_front

    host, port = parse_front(front)
    cluster = cluster_of()
    rec, started = ensure_front(state, cluster, host, port, known_hosts=known_hosts, accept_new=accept_new)
    o.info(f"front {rec.url}: {'started, ' if started else ''}follows cluster {cluster} (pid {rec.pid})")
    return rec if started else None


def stop_started(state: StateDir, rec) -> None:
    if rec is not None:
        from clusterctl.front.records import stop_front

        stop_front(state, rec, grace=5)
