"""``clusterctl supervise``: keep a detached deployment serving through lost ranks and nodes (docs/heal.md).
``launch --heal`` is the same supervisor over a job it launches in the foreground (jobcmds.launch)."""

from __future__ import annotations

from typing import Annotated

import typer

from clusterctl.cli.launchflags import LaunchFlags
from clusterctl.cli.options import (AcceptNewOpt, AliasOpt, ApiKeyEnvOpt, ApiKeysFileOpt, CorsOpt, GraceOpt,
                                    HealBackoffOpt, HealGraceOpt, HealMaxOpt, HealWindowOpt, HostOpt, JsonOpt,
                                    KnownHostsOpt, MaxQueueOpt, NoApiKeyOpt, QuietOpt, RejoinAfterOpt, RejoinDrainOpt,
                                    SeedOpt, StateOpt, TimeoutOpt, app, complete_targets, heal_policy, output,
                                    state_of)


@app.command()
def supervise(
    ctx: typer.Context,
    deployment: Annotated[str, typer.Argument(help="A deployment file or id (its running detached job is taken "
                                                   "over; launched detached when none runs).",
                                              autocompletion=complete_targets)],
    heal_grace: HealGraceOpt = None,
    heal_max: HealMaxOpt = None,
    heal_window: HealWindowOpt = None,
    heal_backoff: HealBackoffOpt = None,
    rejoin_after: RejoinAfterOpt = None,
    rejoin_drain: RejoinDrainOpt = None,
    timeout: TimeoutOpt = 600,
    grace: GraceOpt = 10.0,
    host: HostOpt = None,
    api_key_env: ApiKeyEnvOpt = None,
    api_keys_file: ApiKeysFileOpt = None,
    no_api_key: NoApiKeyOpt = False,
    cors_origin: CorsOpt = None,
    model_alias: AliasOpt = None,
    seed: SeedOpt = 0,
    max_queue: MaxQueueOpt = 64,
    known_hosts: KnownHostsOpt = None,
    accept_new_host_keys: AcceptNewOpt = False,
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

    policy = heal_policy(heal_grace, heal_max, heal_window, heal_backoff, rejoin_after, rejoin_drain)
    # a relaunch binds the running job's host (""), unless --host says another
    opts = LaunchFlags(timeout=timeout, grace=grace, host=host, api_key_env=api_key_env, api_keys_file=api_keys_file,
                       no_api_key=no_api_key, cors_origin=cors_origin, model_alias=model_alias, seed=seed,
                       max_queue=max_queue, known_hosts=known_hosts, accept_new_host_keys=accept_new_host_keys
                       ).options(detach=True, default_host="")
    raise typer.Exit(asyncio.run(run_supervised(o, state_of(state_dir), deployment, opts, policy, take_over=True)))
