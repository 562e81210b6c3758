"""The flags of how a started job serves, shared by launch, replan and supervise, as one typed model defined once
(cli/flaggroups.py: each command names it by one parameter); and the one builder of the LaunchOptions those
commands hand the core (launch/jobplan.py): the API key read from its environment variable, the keys file, the
launcher lease from CLUSTERCTL_LAUNCHER_LEASE (or --lease), who may call rank 0, and the exposure checked (a key
is needed off loopback)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Optional

import typer

from clusterctl.cli.flaggroups import Without
from clusterctl.cli.options import (ENV_LEASE, AcceptNewOpt, AliasOpt, ApiKeyEnvOpt, ApiKeysFileOpt, CorsOpt,
                                    GraceOpt, HostOpt, KnownHostsOpt, MaxQueueOpt, NoApiKeyOpt, PortOpt, SeedOpt,
                                    TimeoutOpt, api_key_of, api_keys_of, lease_from_env, number, ssh_options)

# launch's own two (a relaunch by replan or the supervisor takes neither)
LeaseOpt = Annotated[Optional[float], typer.Option("--lease", envvar=ENV_LEASE,
                                                   help="Launcher lease in seconds: a rank whose lease goes stale exits.",
                                                   parser=number(1, 3600), metavar="SECONDS")]
VerifyOpt = Annotated[bool, typer.Option("--verify", help="Preflight re-hashes every node's model copy (default: sizes and cached hashes).")]


@dataclass(frozen=True)
class LaunchFlags:
    """The parsed flags (typer checked each one: no pydantic at the CLI's start); ``options()`` turns them into
    LaunchOptions. The defaults are the commands' (their --help shows them)."""

    timeout: TimeoutOpt = 600
    grace: GraceOpt = 10.0
    lease: LeaseOpt = None  # --lease (launch); None: CLUSTERCTL_LAUNCHER_LEASE or the default
    host: HostOpt = None  # --host (None: the command's default)
    port: PortOpt = None  # --port (launch)
    api_key_env: ApiKeyEnvOpt = None
    api_keys_file: ApiKeysFileOpt = None
    no_api_key: NoApiKeyOpt = False
    cors_origin: CorsOpt = None
    model_alias: AliasOpt = None
    seed: SeedOpt = 0
    max_queue: MaxQueueOpt = 64
    verify: VerifyOpt = False  # --verify (launch)
    known_hosts: KnownHostsOpt = None
    accept_new_host_keys: AcceptNewOpt = False

    def ssh(self):
        return ssh_options(self.known_hosts, self.accept_new_host_keys)

    def options(self, *, detach: bool, default_host: str = "127.0.0.1", default_port: int | None = None):
        """The launch options (launch/jobplan.py) of these flags: rank 0 on --host (else ``default_host``: ""
        is the running job's, supervise/loop.py) and --port (else ``default_port``). Raises what a flag's value
        turns out to be wrong for: an API key variable unset, a lease that is no number, a keys file, serving
        beyond loopback without a key."""
        from clusterctl.front.apikey import check_exposure
        from clusterctl.launch.jobplan import LaunchOptions

        api_key = api_key_of(self.api_key_env, self.no_api_key)
        ssh = self.ssh()
        lease_seconds = lease_from_env()
        api_keys = api_keys_of(self.api_keys_file, api_key, self.no_api_key)
        http_host = self.host or default_host
        check_exposure(http_host or "127.0.0.1", api_key or bool(api_keys), no_key=self.no_api_key)
        return LaunchOptions(
            timeout=self.timeout, grace=self.grace, detach=detach, http_host=http_host,
            http_port=self.port if self.port is not None else default_port, api_key=api_key, api_keys=api_keys,
            cors_origins=list(self.cors_origin or []), model_aliases=list(self.model_alias or []), seed=self.seed,
            max_queue=self.max_queue, ssh=ssh, verify_model=self.verify,
            lease_seconds=self.lease if self.lease is not None else lease_seconds)


# replan and supervise relaunch a running job: on the old job's port, with the lease of CLUSTERCTL_LAUNCHER_LEASE,
# without --verify
RelaunchFlags = Annotated[LaunchFlags, Without("lease", "port", "verify")]
