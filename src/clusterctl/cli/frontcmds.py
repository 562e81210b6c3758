"""``clusterctl front``: the front door's commands (list, run in the foreground or detached, stop); docs/front.md.

The one-command form they replace (``clusterctl front [HOST:PORT CLUSTER] [--detach] [--stop]``) still runs, as
it did: ``FrontGroup`` hands every ``front`` whose first word is no subcommand to the hidden command ``legacy``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from typer.core import TyperCommand

from clusterctl.cli.flaggroups import flag_groups
from clusterctl.cli.options import (AcceptNewOpt, Group, JsonOpt, KnownHostsOpt, QuietOpt, StateOpt, app,
                                    complete_targets, number, output, ssh_options, state_of)
from clusterctl.errors import ClusterctlError, Exit, UsageError

if TYPE_CHECKING:
    from clusterctl.statedir.state import StateDir


class FrontGroup(Group):
    """``front``'s subcommands, and the one-command form of before: a ``front`` whose first word is not a
    subcommand (an address, a flag, nothing: the list) runs ``default_command``."""

    default_command = "legacy"

    def parse_args(self, ctx, args):
        if not args or (args[0] not in self.commands and args[0] not in ctx.help_option_names):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


class _AsFront(typer.Context):
    """The hidden command's context: its usage lines and errors say ``clusterctl front``, as they did."""

    @property
    def command_path(self) -> str:
        return self.parent.command_path if self.parent is not None else super().command_path


class _LegacyCommand(TyperCommand):
    context_class = _AsFront


front_app = typer.Typer(
    help="The front door: one stable address that forwards the OpenAI API to the cluster's current rank 0, across "
         "replans and heals (docs/front.md).\n\n"
         "`clusterctl front` alone lists the fronts; the older form `clusterctl front [HOST:PORT CLUSTER] "
         "[--detach] [--stop]` still works.",
    cls=FrontGroup)
app.add_typer(front_app, name="front")

AddressArg = Annotated[str, typer.Argument(help="HOST:PORT the front listens on.", metavar="HOST:PORT")]
FollowArg = Annotated[str, typer.Argument(help="The cluster to follow: its name, or one of its deployments (file or "
                                               "id).", metavar="CLUSTER", autocompletion=complete_targets)]
DetachOpt = Annotated[bool, typer.Option("--detach", help="Run in the background; `clusterctl front stop HOST:PORT` ends it.")]
LingerOpt = Annotated[float, typer.Option("--linger", help="Exit after S seconds with no job of the cluster (0: never).",
                                          parser=number(0, 7 * 86400), metavar="S")]


@dataclass(frozen=True)
class RunFlags:
    """How a front runs (front run, and the one-command form), taken as one (cli/flaggroups.py)."""

    detach: DetachOpt = False
    linger: LingerOpt = 0.0
    known_hosts: KnownHostsOpt = None
    accept_new_host_keys: AcceptNewOpt = False


@front_app.command("list")
def list_fronts(ctx: typer.Context, state_dir: StateOpt = None, json: JsonOpt = False, quiet: QuietOpt = False) -> None:
    """The running fronts: URL, cluster, state, pid."""
    _list(output(ctx, json, quiet), state_of(state_dir))


@front_app.command()
@flag_groups
def run(
    ctx: typer.Context,
    *,
    address: AddressArg,
    target: FollowArg,
    how: RunFlags,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run a front on HOST:PORT that follows the cluster's current job: in the foreground until Ctrl-C, or
    detached."""
    _run(output(ctx, json, quiet), state_of(state_dir), address, target, how)


@front_app.command()
def stop(
    ctx: typer.Context,
    address: Annotated[Optional[str], typer.Argument(help="HOST:PORT of the front to stop (none: every front).",
                                                     metavar="HOST:PORT")] = None,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Stop the front on HOST:PORT (every front without one): SIGTERM, then SIGKILL, its identity checked."""
    o = output(ctx, json, quiet)
    raise typer.Exit(_stop(o, state_of(state_dir), address))


@front_app.command("legacy", hidden=True, cls=_LegacyCommand)
@flag_groups
def legacy(
    ctx: typer.Context,
    *,
    address: Annotated[Optional[str], typer.Argument(help="HOST:PORT the front listens on (none: list the fronts).",
                                                     metavar="HOST:PORT")] = None,
    target: Annotated[Optional[str], typer.Argument(help="The cluster to follow: its name, or one of its "
                                                         "deployments (file or id).",
                                                    autocompletion=complete_targets)] = None,
    how: RunFlags,
    stop: Annotated[bool, typer.Option("--stop", help="Stop the front on HOST:PORT (every front without one).")] = False,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """The front door: one stable address that forwards the OpenAI API to the cluster's current rank 0, across
    replans and heals (docs/front.md)."""
    o = output(ctx, json, quiet)
    state = state_of(state_dir)
    if address is not None:
        _address(address)
    if stop:
        raise typer.Exit(_stop(o, state, address))
    if address is None:
        _list(o, state)
        return
    if target is None:
        raise UsageError("name the cluster to follow: clusterctl front HOST:PORT CLUSTER")
    _run(o, state, address, target, how)


def _address(address: str) -> tuple[str, int]:
    from clusterctl.front.records import parse_front

    try:
        return parse_front(address)
    except ValueError as e:
        raise UsageError(f"HOST:PORT: {e}") from None


def _list(o, state: StateDir) -> None:
    from clusterctl.front import records as fs

    fronts = [{**fs.summary(r), "state": fs.front_health(r)} for r in fs.live_fronts(state)]
    if o.json:
        o.data({"fronts": fronts})
        return
    for f in fronts:
        o.line(f"{f['url']}  cluster {f['cluster']}  {f['state']}  pid {f['pid']}")
    if not fronts:
        o.info("no front runs")


def _stop(o, state: StateDir, address: str | None) -> int:
    """Stop the front on ``address`` (every front when None); the exit code."""
    from clusterctl.front import records as fs

    where = _address(address) if address is not None else None
    gone = [r for r in fs.live_fronts(state) if where is None or (r.bind_host, r.port) == where]
    if address is not None and not gone:
        o.info(f"no front serves {address}")
    stopped = [r for r in gone if fs.stop_front(state, r)]
    if o.json:
        o.data({"stopped": [fs.summary(r) for r in stopped]})
    for r in stopped:
        o.info(f"front {r.url} of cluster {r.cluster}: stopped")
    return 0 if len(stopped) == len(gone) else int(Exit.FAILED)


def _run(o, state: StateDir, address: str, target: str, how: RunFlags) -> None:
    """A front on ``address`` following ``target``'s cluster: detached (its URL on stdout), or served here until
    it stops (raises typer.Exit with its code)."""
    from clusterctl.front import records as fs

    host, port = _address(address)
    cluster = _cluster_named(state, target)
    if how.detach:
        rec, started = fs.ensure_front(state, cluster, host, port, linger=how.linger, auto=False,
                                       known_hosts=how.known_hosts, accept_new=how.accept_new_host_keys)
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
    code = asyncio.run(serve(state, cluster, host, port, ssh=ssh_options(how.known_hosts, how.accept_new_host_keys),
                             linger=how.linger, ready=lambda rec: o.line(rec.url)))
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
