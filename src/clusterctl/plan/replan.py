"""Replanning, the pure part: the new plan's inputs derived from the current deployment plus what the operator
gave, and the placement diff between two deployments. No files, no processes (the action is launch/replan.py).

Derivation: whatever is not given comes from the current deployment — its nodes (with hosts, links, memory and
measured speeds), backend, parallel mode, allocation, context, batch, headroom, embedding offload, path_map and
model. ``--cluster`` replaces the node records (a node the current deployment does not have can only come from
there); ``--nodes`` picks and orders nodes; a node's measured speed and its path_map entry are carried to the
new plan unless given. An explicit empty value wins over derivation (an empty path_map means every node uses
its own model_path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from pydantic import BaseModel

from clusterctl.errors import ConfigError, UsageError
from clusterctl.protocol.deployment import Deployment, PlanOptions, identity_changes
from clusterctl.plan.commands import plan_options
from clusterctl.plan.inventory import Cluster

OPTION_FIELDS = ("allocation", "backend", "parallel", "context", "batch", "headroom_gb", "embedding_offload",
                 "schedule", "prompt_cache_gb", "serving", "kv_bits", "kv_group_size", "quantized_kv_start")


@dataclass
class Inputs:
    cluster: Cluster
    options: PlanOptions
    path_map: dict[str, str]
    model_path: str
    given: dict[str, str] = field(default_factory=dict)  # field -> value as given
    derived: dict[str, str] = field(default_factory=dict)  # field -> value carried from the current deployment

    def to_json(self) -> dict:
        return {"given": self.given, "derived": self.derived}


def _show(v) -> str:
    if hasattr(v, "model_dump"):  # the serving defaults
        v = v.model_dump(exclude_defaults=True)
    if isinstance(v, dict) and isinstance(v.get("chat_template"), str):
        v = {**v, "chat_template": f"({len(v['chat_template'])} characters)"}
    if isinstance(v, dict):
        return ",".join(f"{k}={x}" for k, x in sorted(v.items())) or "(empty)"
    if isinstance(v, list):
        return ",".join(map(str, v))
    return "auto" if v is None else str(v)


def _show_option(k: str, v) -> str:
    return "off" if k == "kv_bits" and v is None else _show(v)


def _chosen_nodes(old: Deployment, pool: Cluster, cluster: Cluster | None, nodes: list[str] | None,
                  given: dict[str, str], derived: dict[str, str]) -> list:
    """The new plan's nodes, in rank order: ``nodes`` picked from ``pool``, or all of it (noted in ``given`` or
    ``derived``)."""
    names = [n.name for n in pool.nodes]
    if nodes is not None:
        if not nodes:
            raise UsageError("--nodes: give at least one node")
        unknown = [n for n in nodes if n not in names]
        if unknown:
            where = "the cluster file" if cluster is not None else f"deployment {old.deployment_id} (pass --cluster " \
                                                                    "to add a node it does not have)"
            raise ConfigError(f"--nodes: {', '.join(unknown)} not in {where}; known: {', '.join(names)}")
        if len(set(nodes)) != len(nodes):
            raise UsageError("--nodes: a node is named twice")
        chosen = [pool.node(n) for n in nodes]
        given["nodes"] = _show(nodes)
    else:
        chosen = list(pool.nodes)
        derived["nodes"] = _show(names)
    return chosen


def derive(old: Deployment, *, cluster: Cluster | None = None, nodes: list[str] | None = None,
           options: dict | None = None, path_map: dict[str, str] | None = None,
           model_path: str | None = None, speeds_seen: dict[str, float] | None = None) -> Inputs:
    """The new plan's inputs. ``options`` holds only what was given (a key present = given, even when None
    means "auto" for batch); ``path_map`` None = not given, {} = given empty. ``speeds_seen``: speeds measured
    in earlier deployments of the cluster (a node that left and comes back keeps its speed); the current
    deployment's win."""
    options = options or {}
    known_speeds = {**(speeds_seen or {}), **old.speeds}
    given: dict[str, str] = {}
    derived: dict[str, str] = {}
    if cluster is not None:
        given["cluster"] = cluster.source or cluster.name
        pool = cluster
    else:
        pool = Cluster(name=old.cluster, nodes=old.nodes)
        derived["cluster"] = f"{old.cluster} (the nodes of {old.deployment_id})"
    chosen = _chosen_nodes(old, pool, cluster, nodes, given, derived)
    # measured speeds travel with the node names
    carried_speeds = []
    out_nodes = []
    for n in chosen:
        if n.speed is None and n.name in known_speeds:
            n = n.model_copy(update={"speed": known_speeds[n.name]})
            carried_speeds.append(f"{n.name}={known_speeds[n.name]:g}")
        out_nodes.append(n)
    if carried_speeds:
        derived["speeds"] = ",".join(carried_speeds)
    new_cluster = Cluster(name=old.cluster if cluster is None else cluster.name, nodes=out_nodes,
                          source=pool.source)
    opts = {}
    for k in OPTION_FIELDS:
        if k == "serving" and k in options:  # the defaults given, over the current deployment's
            old_serving = old.options.serving.model_dump(exclude_defaults=True) if old.options.serving else {}
            opts[k] = {**old_serving, **options[k]}
            given[k] = _show(options[k])
        elif k in options:
            opts[k] = options[k]
            given[k] = _show_option(k, options[k])
        else:
            opts[k] = getattr(old.options, k)
            derived[k] = _show_option(k, opts[k])
    plan_opts = plan_options(**opts)  # a bad value: one line naming its flag
    if path_map is not None:
        unknown = sorted(set(path_map) - {n.name for n in out_nodes})
        if unknown:
            raise ConfigError(f"--path-map: {', '.join(unknown)} not among the new plan's nodes")
        bad = [f"{k}={v!r}" for k, v in sorted(path_map.items())
               if not isinstance(v, str) or not v.startswith("/") or "\x00" in v or "\n" in v]
        if bad:
            raise UsageError(f"--path-map: not an absolute path: {', '.join(bad)}")
        pm = dict(path_map)
        given["path_map"] = _show(pm)
    else:
        pm = {k: v for k, v in old.path_map.items() if k in {n.name for n in out_nodes}
              and (cluster is None or cluster.node(k).model_path is None)}
        derived["path_map"] = _show(pm)
    if model_path is not None:
        given["model"] = model_path
    else:
        model_path = old.model.source_path
        derived["model"] = model_path
    return Inputs(cluster=new_cluster, options=plan_opts, path_map=pm, model_path=model_path, given=given,
                  derived=derived)


class NodeChange(BaseModel):
    """One node of a replan: whether it joins, leaves, moves (its layers or rank), is resized (its planned
    memory) or stays the same, with its rank, layers, planned memory and model path before -> after."""

    node: str
    change: Literal["joins", "leaves", "moves", "resized", "same"]
    rank_before: Optional[int]
    rank_after: Optional[int]
    layers_before: Optional[list[int]]
    layers_after: Optional[list[int]]
    memory_before: Optional[int]
    memory_after: Optional[int]
    path_before: Optional[str]
    path_after: Optional[str]

    @classmethod
    def of(cls, node: str, a, b, old: Deployment, new: Deployment) -> NodeChange:
        """Node ``node`` of ranks ``a`` (in ``old``) and ``b`` (in ``new``); None where it has none."""
        if a is None:
            change = "joins"
        elif b is None:
            change = "leaves"
        elif (a.start_layer, a.end_layer, a.rank) != (b.start_layer, b.end_layer, b.rank):
            change = "moves"
        elif a.planned.total != b.planned.total:
            change = "resized"
        else:
            change = "same"
        return cls(node=node, change=change, rank_before=a.rank if a else None, rank_after=b.rank if b else None,
                   layers_before=[a.start_layer, a.end_layer] if a else None,
                   layers_after=[b.start_layer, b.end_layer] if b else None,
                   memory_before=a.planned.total if a else None, memory_after=b.planned.total if b else None,
                   path_before=old.path_map.get(node), path_after=new.path_map.get(node))

    @property
    def path_moved(self) -> bool:
        """It stays with its model at another path."""
        return self.path_before != self.path_after and self.change not in ("joins", "leaves")


class FieldChange(BaseModel):
    """A setting of the plan (or of its options, as given: ``options.<name>``) before -> after."""

    field: str
    before: Any
    after: Any


class PlanDiff(BaseModel):
    """What a replan changes: the plan hashes and deployment ids before -> after; ``unchanged`` when the
    deployment's identity is the same (nothing that runs changes), then ``records_changed`` names what an
    unchanged replan writes back in place; else ``fields_changed`` names what differs. Per node and per
    setting: ``nodes``, ``other``."""

    plan_hash_before: str
    plan_hash_after: str
    deployment_before: str
    deployment_after: str
    unchanged: bool
    placement_unchanged: bool
    fields_changed: list[str]
    nodes: list[NodeChange]
    other: list[FieldChange]
    records_changed: list[str]

    @property
    def nothing_to_do(self) -> bool:
        """Unchanged, and no record to write back either."""
        return self.unchanged and not self.records_changed

    def to_json(self) -> dict:
        return self.model_dump(mode="json")

    def lines(self) -> list[str]:
        """The diff as lines for a terminal."""
        def mem(b):
            return "-" if b is None else f"{b / (1 << 30):.2f} GiB"

        def rng(x):
            return "-" if x is None else f"[{x[0]}, {x[1]})"

        lines = [f"plan_hash {self.plan_hash_before[:16]} -> {self.plan_hash_after[:16]}"
                 + ("  (unchanged)" if self.unchanged else "  (same placement)" if self.placement_unchanged else "")]
        if not self.unchanged:
            lines.append(f"  a new deployment: {', '.join(self.fields_changed)} differ (running ranks restart with it)")
        for r in self.nodes:
            lines.append(f"  {r.node:<12} {r.change:<8} layers {rng(r.layers_before)} -> {rng(r.layers_after)}"
                         f"   memory {mem(r.memory_before)} -> {mem(r.memory_after)}"
                         + (f"   path {r.path_before} -> {r.path_after}" if r.path_moved else ""))
        for o in self.other:
            lines.append(f"  {o.field}: {o.before} -> {o.after}")
        return lines


def placement_diff(old: Deployment, new: Deployment) -> PlanDiff:
    """Per node: layers and planned memory before -> after, and whether it joins, leaves, moves or stays."""
    before = {r.node: r for r in old.ranks}
    after = {r.node: r for r in new.ranks}
    order = [r.node for r in new.ranks] + [n for n in before if n not in after]
    rows = [NodeChange.of(node, before.get(node), after.get(node), old, new) for node in order]
    other = []
    for what, x, y in (("backend", old.backend, new.backend), ("parallel", old.parallel, new.parallel),
                       ("schedule", old.schedule or "overlap", new.schedule or "overlap"),
                       ("allocation", old.allocation, new.allocation), ("batch", old.batch_slots, new.batch_slots),
                       ("context", old.options.context, new.options.context),
                       ("prompt_cache_tokens", old.prompt_cache_tokens, new.prompt_cache_tokens),
                       ("embedding_offload", old.embedding_offload, new.embedding_offload),
                       ("model", old.model.facts_hash[:12], new.model.facts_hash[:12])):
        if x != y:
            other.append(FieldChange(field=what, before=x, after=y))
    for k in ("allocation", "backend", "parallel", "batch", "headroom_gb", "embedding_offload", "schedule",
              "prompt_cache_gb", "serving", "kv_bits", "kv_group_size", "quantized_kv_start"):  # as given (what a later replan derives from); context is listed above
        x, y = getattr(old.options, k), getattr(new.options, k)
        if x != y:
            other.append(FieldChange(field=f"options.{k}", before=_show_option(k, x), after=_show_option(k, y)))
    # the same deployment (same identity, so the same id): nothing that runs changes
    fields = identity_changes(old, new)
    return PlanDiff(plan_hash_before=old.plan_hash, plan_hash_after=new.plan_hash,
                    deployment_before=old.deployment_id, deployment_after=new.deployment_id,
                    unchanged=not fields, placement_unchanged=old.plan_hash == new.plan_hash,
                    fields_changed=fields, nodes=rows, other=other, records_changed=records_changed(old, new))


def records_changed(old: Deployment, new: Deployment) -> list[str]:
    """What differs outside the deployment's identity (measured speeds, the model manifest's hash): what an
    unchanged replan writes back in place, under the same id, without restarting a rank."""
    out = []
    if old.speeds != new.speeds or [n.speed for n in old.nodes] != [n.speed for n in new.nodes]:
        out.append("speeds")
    if old.model.manifest_hash != new.model.manifest_hash:
        out.append("model manifest")
    return out
