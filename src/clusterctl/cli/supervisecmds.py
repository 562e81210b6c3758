"""``clusterctl supervise``: keep a detached deployment serving through lost ranks and nodes (docs/heal.md).
``launch --heal`` is the same supervisor over a job it launches in the foreground (jobcmds.launch)."""

from __future__ import annotations

from typing import Annotated

import typer

from clusterctl.cli.flaggroups import flag_groups
from clusterctl.cli.launchflags import RelaunchFlags
from clusterctl.cli.options import HealFlags, JsonOpt, QuietOpt, StateOpt, app, complete_targets, output, state_of


@app.command()
@flag_groups
def supervise(
    ctx: typer.Context,
    *,
    deployment: Annotated[str, typer.Argument(help="A deployment file or id (its running detached job is taken "
                                                   "over; launched detached when none runs).",
                                              autocompletion=complete_targets)],
    healing: HealFlags,
    serving: RelaunchFlags,
    state_dir: StateOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Supervise a detached deployment until SIGTERM: heal it onto the nodes that answer when a rank or node is
    lost, go back to its plan when they are healthy again. For systemd or launchd (docs/heal.md). A relaunch
    serves with the keys and rules given here (as `launch` takes them), on the running job's host and port."""
    o = output(ctx, json, quiet)
    import asyncio

    from clusterctl.supervise.run import run_supervised

    policy = healing.policy()
    # a relaunch binds the running job's host (""), unless --host says another
    opts = serving.options(detach=True, default_host="")
    raise typer.Exit(asyncio.run(run_supervised(o, state_of(state_dir), deployment, opts, policy, take_over=True)))
