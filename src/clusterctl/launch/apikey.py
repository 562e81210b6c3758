"""Who may call rank 0's API: the key an operator names, and the rule for an endpoint without one.

The key comes from an environment variable (never argv) and leaves clusterctl's environment once read: no op
session or rank started from here inherits it; rank 0 gets it only inside its 0600 contract. A variable the
operator names must hold a key (a typo must not serve an open API), and rank 0 listens beyond loopback without a
key only when the operator says so (``--no-api-key``).
"""

from __future__ import annotations

import ipaddress
import os
import re

from clusterctl.errors import ConfigError, UsageError
from clusterctl.names import clip

DEFAULT_ENV = "CLUSTERCTL_API_KEY"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_HOST_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


def api_key_from_env(name: str | None, *, no_key: bool = False) -> str | None:
    """The key in env ``name`` (None: the default variable, which may be unset), removed from the environment.
    A named variable that is unset or empty is an error (78)."""
    if name is not None and no_key:
        raise UsageError("--api-key-env and --no-api-key contradict each other: give one")
    if name is not None and not _ENV_NAME.match(name):
        raise UsageError(f"--api-key-env: {clip(name, 60)!r} is not an environment variable name")
    value = os.environ.pop(name or DEFAULT_ENV, None)
    if no_key:
        return None
    if name is not None and not value:
        raise ConfigError(f"--api-key-env {name}: that variable is {'empty' if value == '' else 'not set'}; "
                          "refusing to serve without the key it should hold",
                          hint=f"export {name}=<key>, or pass --no-api-key to serve an open API on purpose")
    return value or None


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_bind_host(value: str) -> str:
    """An address rank 0 can bind: an IP literal (v4, v6) or a host name; anything else is refused at parse time."""
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if _HOST_NAME.match(value):
        return value
    raise ValueError(f"{clip(value, 60)!r} is not an IP address or host name")


def check_exposure(host: str, key: str | None, *, no_key: bool) -> None:
    """Refuse (78) an endpoint beyond loopback without a key unless the operator chose it with --no-api-key."""
    if key or no_key or is_loopback(host):
        return
    raise ConfigError(f"rank 0 would listen on {host} without an API key: anyone who reaches that port could use "
                      "the model",
                      hint=f"export {DEFAULT_ENV}=<key> (or name another variable with --api-key-env), "
                           "or pass --no-api-key to serve an open API on purpose")
