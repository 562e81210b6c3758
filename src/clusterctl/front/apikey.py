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
from clusterctl.names import NAME_RE, clip
from clusterctl.atomic import read_capped

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


def check_exposure(host: str, key: str | bool | None, *, no_key: bool) -> None:
    """Refuse (78) an endpoint beyond loopback without a key unless the operator chose it with --no-api-key."""
    if key or no_key or is_loopback(host):
        return
    raise ConfigError(f"rank 0 would listen on {host} without an API key: anyone who reaches that port could use "
                      "the model",
                      hint=f"export {DEFAULT_ENV}=<key> (or name another variable with --api-key-env), "
                           "or pass --no-api-key to serve an open API on purpose")


MAX_KEYS = 1024
_KEY = re.compile(r"^[\x21-\x7e]{16,512}$")  # printable ASCII without spaces: what a Bearer header can carry


def api_keys_from_file(path: str | None, *, default_key: str | None = None) -> dict[str, str]:
    """Tenants and their keys from ``path``: one ``NAME KEY`` per line (``#`` comments, blank lines). The file
    must be a regular file readable by its owner alone (it holds secrets); a name, or a key, given twice is
    refused (78), and so is a key that equals the default tenant's."""
    import os
    import stat

    if path is None:
        return {}
    data = read_capped(path, limit=1 << 20, what="API keys file")
    st = os.lstat(path)
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ConfigError(f"API keys file {clip(str(path), 120)} is readable by others (mode "
                          f"{stat.S_IMODE(st.st_mode):04o})", hint=f"chmod 600 {path}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"API keys file {clip(str(path), 120)} is not UTF-8 text") from None
    keys: dict[str, str] = {}
    seen = {default_key} if default_key else set()
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"API keys file {clip(str(path), 120)} line {n}"
        if len(parts) != 2:  # never echo the line: it may hold a key
            raise ConfigError(f"{where}: want NAME KEY (two fields), found {len(parts)}")
        name, key = parts
        if not NAME_RE.match(name):
            raise ConfigError(f"{where}: {clip(name, 40)!r} is not a tenant name (letters, digits, . _ -)")
        if not _KEY.match(key):
            raise ConfigError(f"{where}: the key of {name} must be 16-512 printable characters without spaces")
        if name in keys or (name == "default" and default_key):
            raise ConfigError(f"{where}: tenant {name} is given twice")
        if key in seen:
            raise ConfigError(f"{where}: the key of {name} is another tenant's too (each tenant needs its own)")
        keys[name] = key
        seen.add(key)
        if len(keys) > MAX_KEYS:
            raise ConfigError(f"{where}: more than {MAX_KEYS} tenants")
    if not keys:
        raise ConfigError(f"API keys file {clip(str(path), 120)} names no tenant")
    return keys
