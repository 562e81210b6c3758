"""A node as the cluster file describes it and the deployment file records it: its address, SSH login, memory,
links and paths on the node; and the one rule for what a host and an SSH user may be (ssh_policy uses it too)."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from clusterctl.names import NAME_RE, clip

GIB = 1 << 30
DEFAULT_USABLE_FRACTION = 0.8
LOCAL_HOSTS = {"localhost"}
_PATH_BAD = re.compile(r"[\s\x00-\x1f\x7f'\"`$;&|<>\\]")  # an interpreter path goes into a command line
_HOSTNAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?\Z")
_USER = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*\Z")


def check_host(v: str) -> str:
    """The one rule for a node's host (cluster.toml and every SSH target): a plain host name or an IP address,
    never something ssh or a shell would read as more (an option, user@, a port, a path, quotes, whitespace)."""
    if not v:
        raise ValueError("empty host")
    if v.startswith("-"):
        raise ValueError(f"{v!r} starts with '-' (it would be read as an ssh option)")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in v):
        raise ValueError(f"{v!r} contains whitespace or control characters")
    if ":" in v:
        try:
            ipaddress.IPv6Address(v)
        except ValueError:
            raise ValueError(f"{v!r} is neither a host name nor an IP address") from None
        return v
    if not _HOSTNAME.match(v):
        raise ValueError(f"{v!r} is not a plain host name or IP address (no user@, ports, paths or quotes)")
    return v


def check_user(v: str) -> str:
    """The one rule for an SSH user name: plain (no '@', no leading '-', no shell characters)."""
    if not _USER.match(v):
        raise ValueError(f"{v!r} is not a plain user name")
    return v


def _check_ip(value: str) -> str:
    """Accept IPv4, IPv6 and link-local IPv6 with a zone id (fe80::1%en10)."""
    addr, pct, zone = value.partition("%")
    if pct and not zone:
        raise ValueError(f"{value!r}: empty zone id")
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        raise ValueError(f"{value!r} is not an IP address") from None
    if zone:
        if ip.version != 6:
            raise ValueError(f"{value!r}: a zone id is only valid on IPv6")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,32}", zone):
            raise ValueError(f"{value!r}: bad zone id")
    return value


class Link(BaseModel):
    """A direct link from this node to a peer (e.g. Thunderbolt), optionally RDMA-capable."""

    model_config = ConfigDict(extra="forbid")

    peer: str
    type: Literal["thunderbolt", "ethernet", "infiniband", "other"] = "other"
    rdma: bool = False
    device: str | None = Field(default=None, description="RDMA device name on this node (jaccl), e.g. rdma_en3")
    fast: bool | None = Field(default=None, description="known-fast link (thunderbolt/rdma imply it)")

    @property
    def is_fast(self) -> bool:
        return bool(self.fast) if self.fast is not None else (self.rdma or self.type in ("thunderbolt", "infiniband"))


class Node(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    host: str = "localhost"
    port: Annotated[int, Field(ge=1, le=65535, strict=True)] = 22
    user: str | None = None
    identity_file: str | None = None
    ips: list[str] = Field(default_factory=list)
    # strict: "8" or true are typos, not numbers; the bounds keep every later product finite
    memory_gb: Annotated[float, Field(gt=0, le=1_000_000, strict=True, allow_inf_nan=False)] | None = None
    usable_fraction: Annotated[float, Field(gt=0, le=1, strict=True, allow_inf_nan=False)] = DEFAULT_USABLE_FRACTION
    model_path: str | None = None
    links: list[Link] = Field(default_factory=list)
    speed: Annotated[float, Field(gt=0, le=1e9, strict=True, allow_inf_nan=False)] | None = None
    python: str = "python3"
    local: Annotated[bool, Field(strict=True)] | None = None
    runtime_dir: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError(f"{clip(v)!r} is not a valid node name (letters, digits, _ . -; starts with a letter or digit)")
        return v

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        return check_host(v)

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        return None if v is None else check_user(v)

    @field_validator("ips")
    @classmethod
    def _ips(cls, v: list[str]) -> list[str]:
        for ip in v:
            _check_ip(ip)
        if len(set(v)) != len(v):
            raise ValueError("duplicate address")
        return v

    @field_validator("model_path", "runtime_dir", "identity_file")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"{v!r} is relative: give an absolute path on that node")
        if v is not None and ("\x00" in v or "\n" in v):
            raise ValueError("path contains a NUL or newline")
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        # A bare command name is looked up on the node's PATH; anything with a slash must be absolute.
        if not v or ("/" in v and not v.startswith("/")):
            raise ValueError(f"{v!r} is relative: give an absolute path or a bare command name")
        if v.startswith("-") or _PATH_BAD.search(v):
            raise ValueError(f"{v!r} is not a valid interpreter path")
        return v

    @property
    def is_local(self) -> bool:
        return self.local if self.local is not None else self.host in LOCAL_HOSTS

    @property
    def usable_bytes(self) -> int | None:
        if self.memory_gb is None:
            return None
        return int(self.memory_gb * GIB * self.usable_fraction)

    def link_to(self, peer: str) -> Link | None:
        for link in self.links:
            if link.peer == peer:
                return link
        return None
