"""cluster.toml -> Cluster: the nodes an operator has, as validated pydantic models.

Every error names the file, the node and the field, in one line (see docs/cluster-toml.md).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from clusterctl.errors import ConfigError, MissingInput
from clusterctl.names import NAME_RE, clip
from clusterctl.protocol.nodespec import Node

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
