"""cluster.toml -> Cluster: the nodes an operator has, as validated pydantic models.

Every error names the file, the node and the field, in one line (see docs/cluster-toml.md).
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from clusterctl.errors import ConfigError, MissingInput
from clusterctl.names import NAME_RE, clip

GIB = 1 << 30
DEFAULT_USABLE_FRACTION = 0.8
LOCAL_HOSTS = {"localhost"}
_HOST_BAD = re.compile(r"[\s\x00-\x1f\x7f'\"`$;&|<>\\]")


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
        if not v:
            raise ValueError("empty host")
        if v.startswith("-"):
            raise ValueError(f"{v!r} starts with '-' (it would be read as an ssh option)")
        if _HOST_BAD.search(v):
            raise ValueError(f"{v!r} contains whitespace, quotes or shell characters")
        return v

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None and (not v or v.startswith("-") or _HOST_BAD.search(v) or "@" in v):
            raise ValueError(f"{v!r} is not a valid ssh user")
        return v

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
        if v.startswith("-") or _HOST_BAD.search(v):
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


class ClusterInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "cluster"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError(f"{clip(v)!r} is not a valid cluster name (letters, digits, _ . -; starts with a letter or digit; at most 63)")
        return v


class Cluster(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    nodes: list[Node]
    source: str | None = None

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


def _field_path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def parse_cluster(data: dict, *, source: str = "cluster.toml") -> Cluster:
    """Validate a parsed cluster.toml document. Errors name the file, node and field."""
    unknown = set(data) - {"cluster", "node"}
    if unknown:
        raise ConfigError(f"{source}: unknown top-level key {sorted(unknown)[0]!r} (expected [cluster] and [[node]])")
    try:
        info = ClusterInfo.model_validate(data.get("cluster", {}))
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"{source}: [cluster] {_field_path(err['loc'])}: {_msg(err)}") from None
    raw_nodes = data.get("node", [])
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise ConfigError(f"{source}: no [[node]] entries", hint="add at least one [[node]] with a name")
    nodes: list[Node] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(raw_nodes):
        label = clip(raw["name"]) if isinstance(raw, dict) and isinstance(raw.get("name"), str) else f"#{i + 1}"
        try:
            node = Node.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            raise ConfigError(f"{source}: node {label}: {_field_path(err['loc'])}: {_msg(err)}") from None
        if node.name in seen:
            raise ConfigError(f"{source}: node {node.name}: name: duplicate node name (also node #{seen[node.name] + 1})")
        seen[node.name] = i
        nodes.append(node)
    names = set(seen)
    for node in nodes:
        for link in node.links:
            if link.peer not in names:
                raise ConfigError(f"{source}: node {node.name}: links: unknown peer {link.peer!r}")
            if link.peer == node.name:
                raise ConfigError(f"{source}: node {node.name}: links: a node cannot link to itself")
    return Cluster(name=info.name, nodes=nodes, source=source)


def _msg(err: dict) -> str:
    msg = err.get("msg", "invalid")
    if err.get("type") == "extra_forbidden":
        return "unknown key"
    if err.get("type") == "missing":
        return "required"
    return msg.removeprefix("Value error, ")


def load_cluster(path: str | Path) -> Cluster:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise MissingInput(f"cluster file not found: {path}", hint="pass --cluster FILE or set CLUSTERCTL_CLUSTER") from None
    except OSError as e:
        raise MissingInput(f"cannot read cluster file {path}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    return parse_cluster(data, source=str(path))
