"""The ONE place that decides how clusterctl talks SSH: options for asyncssh and for OpenSSH (rsync ``-e``).

Policy: host keys are always verified against a known_hosts file. ``accept_new_host_keys`` trusts a key the
file has never seen for that host by appending it (like OpenSSH ``StrictHostKeyChecking=accept-new``) and still
refuses a key that differs from a recorded one. No passwords or prompts (BatchMode): keys or the agent only.
This module builds data and messages; the asyncssh calls live in ``sshnode.py``.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import os
import shlex
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from clusterctl.errors import AuthRejected, ConfigError, HostUnreachable
from clusterctl.protocol.nodespec import check_host, check_user

_GLOB = set("*?[]")
# rsync >= 3.2.4 escapes remote args itself; this turns that off so our shell quoting is the only one (the
# same operand then works with old rsync and macOS openrsync, which pass it through the remote shell).
RSYNC_ENV = {"RSYNC_OLD_ARGS": "1"}


class SshTarget(BaseModel):
    """How to reach one node over SSH."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    host: str
    port: int = Field(22, ge=1, le=65535)
    user: str | None = None
    identity_file: Path | None = None
    known_hosts: Path | None = None  # default ~/.ssh/known_hosts
    accept_new_host_keys: bool = False
    connect_timeout: float = Field(10.0, gt=0)
    keepalive_interval: int = Field(15, ge=0)  # 0 disables
    keepalive_count_max: int = Field(3, ge=1)

    @field_validator("host")
    @classmethod
    def _check_host(cls, v: str) -> str:
        return check_host(v)

    @field_validator("user")
    @classmethod
    def _check_user(cls, v: str | None) -> str | None:
        return None if v is None else check_user(v)

    @field_validator("identity_file", "known_hosts")
    @classmethod
    def _check_path(cls, v: Path | None) -> Path | None:
        if v is not None and any(ord(c) < 32 or ord(c) == 127 for c in str(v)):
            raise ValueError(f"path {str(v)!r} contains control characters")
        return v


def known_hosts_path(target: SshTarget) -> Path:
    return (target.known_hosts or Path("~/.ssh/known_hosts")).expanduser()


def host_spec(target: SshTarget) -> str:
    """The host as known_hosts names it: ``host`` on port 22, ``[host]:port`` otherwise."""
    return target.host if target.port == 22 else f"[{target.host}]:{target.port}"


def describe(target: SshTarget) -> str:
    who = f"{target.user}@" if target.user else ""
    return f"{who}{target.host}:{target.port}"


# ---------------------------------------------------------------------------------------------- asyncssh

def asyncssh_connect_kwargs(target: SshTarget) -> dict:
    """Keyword arguments for ``asyncssh.connect``. Host keys are checked against known_hosts (never disabled);
    keys asyncssh cannot find there go through ``judge_unlisted_host_key`` (see sshnode.py)."""
    check_local_user(target)
    kh = known_hosts_path(target)
    kwargs: dict = {
        "host": target.host,
        "port": target.port,
        # a missing file is an empty list of trusted keys, not "checking off"
        "known_hosts": str(kh) if kh.is_file() else b"",
        "connect_timeout": target.connect_timeout,
        "keepalive_interval": target.keepalive_interval,
        "keepalive_count_max": target.keepalive_count_max,
        "agent_forwarding": False,
        "x11_forwarding": False,
        "password": None,
        "kbdint_auth": False,
        "password_auth": False,
    }
    if target.user:
        kwargs["username"] = target.user
    if target.identity_file:
        key = str(target.identity_file.expanduser())
        # like IdentitiesOnly=yes: exactly this key, from the file or (when it has a passphrase) from the agent
        kwargs.update(client_keys=[key], ignore_encrypted=True)
        if Path(key + ".pub").is_file():
            kwargs["agent_identities"] = [key + ".pub"]
        else:
            kwargs["agent_path"] = None
    return kwargs


def check_local_user(target: SshTarget) -> None:
    """asyncssh needs this machine's user name for every connection, even when the node names its own (``user``):
    it reads LOGNAME, USER, LNAME, USERNAME, then the password database. Under cron (no USER) in a container whose
    uid has no password entry none answers: one line naming what to set, not an unclassified ValueError."""
    try:
        getpass.getuser()
    except (KeyError, OSError):
        name = target.user or "<the SSH user name>"
        raise ConfigError(f"cannot tell which user runs clusterctl to connect to {describe(target)} (LOGNAME and "
                          f"USER are unset, as under cron, and uid {os.getuid()} has no password entry): set "
                          f"USER={name} in its environment (in a crontab, a line USER={name})") from None


def judge_unlisted_host_key(target: SshTarget, *, host_listed: bool, key_line: str, fingerprint: str) -> None:
    """Decide about a host key that is not in known_hosts: return to trust it, raise AuthRejected to refuse.

    ``host_listed``: known_hosts has other keys for this host, so the key CHANGED. ``key_line`` is the key in
    OpenSSH ``type base64`` form, appended to known_hosts when new keys may be accepted.
    """
    if host_listed:
        raise changed_host_key_error(target, fingerprint)
    if not target.accept_new_host_keys:
        raise unknown_host_key_error(target, fingerprint)
    remember_host_key(target, key_line)


def remember_host_key(target: SshTarget, key_line: str) -> None:
    """Append ``[host]:port type base64`` to known_hosts (created 0600, its folder 0700); locked, idempotent."""
    parts = key_line.split()
    if len(parts) < 2 or any(ord(c) < 32 for c in key_line):
        raise AuthRejected(f"host key of {host_spec(target)} could not be recorded", host=target.host)
    entry = f"{host_spec(target)} {parts[0]} {parts[1]}\n".encode()
    path = known_hosts_path(target)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise AuthRejected(f"cannot record the host key of {host_spec(target)} in {path}: {e.strerror or e}",
                           host=target.host) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with os.fdopen(os.dup(fd), "rb") as f:
            existing = f.read()
        if entry in existing.splitlines(keepends=True):
            return
        prefix = b"\n" if existing and not existing.endswith(b"\n") else b""
        os.write(fd, prefix + entry)
        os.fsync(fd)
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def unknown_host_key_error(target: SshTarget, fingerprint: str) -> AuthRejected:
    kh = known_hosts_path(target)
    return AuthRejected(
        f"host key of {host_spec(target)} is not known (it offered {fingerprint}); not connecting",
        host=target.host,
        hint=(f"check that fingerprint with the node's owner (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` "
              f"on the node), then trust it with `ssh-keyscan -p {target.port} {shlex.quote(target.host)} >> "
              f"{shlex.quote(str(kh))}`, or run once with --accept-new-host-keys"))


def changed_host_key_error(target: SshTarget, fingerprint: str) -> AuthRejected:
    kh = known_hosts_path(target)
    return AuthRejected(
        f"host key of {host_spec(target)} has CHANGED (it now offers {fingerprint}); not connecting",
        host=target.host,
        hint=("someone may be intercepting the connection, or the node was reinstalled; only if you know it was, "
              f"remove the old key with `ssh-keygen -R {shlex.quote(host_spec(target))} -f {shlex.quote(str(kh))}` "
              "and trust the new one (docs/ssh.md). --accept-new-host-keys never overrides a changed key"))


def auth_failed_error(target: SshTarget, detail: str) -> AuthRejected:
    key = f"key {target.identity_file}" if target.identity_file else "the default keys and the ssh agent"
    return AuthRejected(
        f"authentication to {describe(target)} failed with {key} ({detail})", host=target.host,
        hint=("add the public key to ~/.ssh/authorized_keys of that user on the node; a key with a passphrase "
              "must be loaded in ssh-agent (docs/ssh.md)"))


def unreachable_error(target: SshTarget, detail: str) -> HostUnreachable:
    return HostUnreachable(
        f"cannot reach {describe(target)}: {detail}", host=target.host,
        hint="check that the node is up, sshd runs there and the host/port in the inventory are right")


# ---------------------------------------------------------------------------------------------- OpenSSH / rsync

def _ssh_option_value(value: str) -> str:
    # OpenSSH expands %-tokens and splits file lists on whitespace inside option values.
    value = value.replace("%", "%%")
    if any(c.isspace() or c in "\"'\\" for c in value):
        value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


def ssh_command(target: SshTarget) -> list[str]:
    """The ``ssh`` argv (without the host) for rsync ``-e``: same verification policy as asyncssh_connect_kwargs."""
    kh = str(known_hosts_path(target))
    argv = [
        "ssh", "-p", str(target.port),
        "-o", f"StrictHostKeyChecking={'accept-new' if target.accept_new_host_keys else 'yes'}",
        "-o", f"UserKnownHostsFile={_ssh_option_value(kh)}",
        "-o", "BatchMode=yes",
        "-o", f"ConnectTimeout={max(1, round(target.connect_timeout))}",
        "-o", f"ServerAliveInterval={target.keepalive_interval}",
        "-o", f"ServerAliveCountMax={target.keepalive_count_max}",
        "-o", "ForwardAgent=no",
        "-o", "ForwardX11=no",
    ]
    if target.user:
        argv += ["-l", target.user]
    if target.identity_file:
        argv += ["-i", str(target.identity_file.expanduser()).replace("%", "%%"), "-o", "IdentitiesOnly=yes"]
    return argv


def rsync_rsh(target: SshTarget) -> str:
    """ssh_command joined the way rsync splits ``-e`` (spaces separate words; single quotes, doubled inside)."""
    def q(word: str) -> str:
        if word and not any(c.isspace() or c in "'\"" for c in word):
            return word
        return "'" + word.replace("'", "''") + "'"

    return " ".join(q(w) for w in ssh_command(target))


def rsync_remote_operand(target: SshTarget, path: str) -> str:
    """``host:'path'`` for rsync, the path quoted for the remote shell (run rsync with RSYNC_ENV in its env)."""
    if not path or "\0" in path:
        raise ConfigError(f"remote path {path!r} cannot be passed to rsync")
    if _GLOB & set(path):
        # older rsync and openrsync servers expand wildcards in source names themselves, quoted or not
        # (3.5 does not): refuse rather than copy the wrong files on some nodes
        raise ConfigError(f"remote path {path!r} contains wildcard characters (* ? [ ]) rsync would expand")
    host = f"[{target.host}]" if ":" in target.host else target.host
    return f"{host}:{shlex.quote(path)}"


def rsync_remote_spec(target: SshTarget, path: str, *, protect_args: bool) -> tuple[list[str], str, dict[str, str]]:
    """(extra rsync flags, ``host:path`` operand, environment) for a remote path.

    ``protect_args`` (both sides are GNU rsync >= 3.0): ``-s`` sends the path inside rsync's own protocol, so no
    remote shell ever parses it. Otherwise (macOS openrsync, older rsync) the path is shell-quoted in the operand
    and RSYNC_ENV keeps a new local rsync from quoting it a second time.
    """
    operand = rsync_remote_operand(target, path)  # the same checks either way
    if protect_args:
        host = f"[{target.host}]" if ":" in target.host else target.host
        return ["-s"], f"{host}:{path}", {}
    return [], operand, dict(RSYNC_ENV)
