"""The flags of how a started job serves, shared by launch, replan and supervise, as one typed model; and the one
builder of the LaunchOptions those commands hand the core (launch/jobplan.py): the API key read from its
environment variable, the keys file, the launcher lease from CLUSTERCTL_LAUNCHER_LEASE (or --lease), who may
call rank 0, and the exposure checked (a key is needed off loopback)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from clusterctl.cli.options import api_key_of, api_keys_of, lease_from_env, ssh_options


@dataclass(frozen=True)
class LaunchFlags:
    """The parsed flags (typer checked each one: no pydantic at the CLI's start); ``options()`` turns them into
    LaunchOptions."""

    timeout: float = 600.0
    grace: float = 10.0
    host: str | None = None  # --host (None: the command's default)
    port: int | None = None  # --port (launch)
    api_key_env: str | None = None
    api_keys_file: Path | None = None
    no_api_key: bool = False
    cors_origin: list[str] | None = None
    model_alias: list[str] | None = None
    seed: int = 0
    max_queue: int = 64
    known_hosts: Path | None = None
    accept_new_host_keys: bool = False
    lease: float | None = None  # --lease (launch); None: CLUSTERCTL_LAUNCHER_LEASE or the default
    verify: bool = False  # --verify (launch)

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
