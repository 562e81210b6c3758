"""``clusterctl supervise``: keep a detached deployment serving through lost ranks and nodes (docs/heal.md).
``launch --heal`` is the same supervisor over a job it launches in the foreground (jobcmds.launch)."""

from __future__ import annotations

from typing import Annotated

import typer

from clusterctl.cli.options import (AcceptNewOpt, AliasOpt, ApiKeyEnvOpt, ApiKeysFileOpt, CorsOpt, GraceOpt,
                                    HealBackoffOpt, HealGraceOpt, HealMaxOpt, HealWindowOpt, HostOpt, JsonOpt,
                                    KnownHostsOpt, MaxQueueOpt, NoApiKeyOpt, QuietOpt, RejoinAfterOpt, RejoinDrainOpt,
                                    SeedOpt, StateOpt, TimeoutOpt, api_key_of, app, complete_targets, set_access,
                                    heal_policy, lease_from_env, output, ssh_options, state_of)


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

    from clusterctl.launch.jobplan import LaunchOptions
    from clusterctl.supervise.run import run_supervised

    policy = heal_policy(heal_grace, heal_max, heal_window, heal_backoff, rejoin_after, rejoin_drain)
    opts = LaunchOptions(timeout=timeout, grace=grace, detach=True, http_host=host or "", seed=seed,
                         api_key=api_key_of(api_key_env, no_api_key), max_queue=max_queue,
                         ssh=ssh_options(known_hosts, accept_new_host_keys), lease_seconds=lease_from_env())
    set_access(opts, api_keys_file=api_keys_file, no_api_key=no_api_key, cors_origin=cors_origin,
               model_alias=model_alias, host=host)
    raise typer.Exit(asyncio.run(run_supervised(o, state_of(state_dir), deployment, opts, policy, take_over=True)))
