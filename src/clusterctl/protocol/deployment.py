"""The deployment file (schema version 2): what runs where, signed.

See docs/deployment-file.md. ``plan_hash`` covers only what decides placement (model facts, layer ranges, nodes'
names and addresses, backend, parallel mode): moving a model folder (path_map), a new timestamp or a new signature
never changes it. ``deployment_hash`` (the id's suffix) covers everything a deployment runs with and everything a
replan derives from (placement, schedule, prompt cache, batch, context, path_map, options as given, node records),
so two plans that differ in any of it never share an id. Version 1 files (no path_map: one model path for every
node) are migrated in memory.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from clusterctl.atomic import dumps, strict_loads
from clusterctl.errors import IntegrityError, pydantic_line
from clusterctl.names import DeploymentIdent, Name
from clusterctl.protocol.nodespec import Node
from clusterctl.protocol.signing import PublicKey, SigningKey, sign_payload, verify_signed

SCHEMA_VERSION = 2
KIND = "deployment"



class KvLayer(BaseModel):
    """What one layer's cache holds for one sequence (one batch slot), as mlx-lm's class stores it.

    bytes at a context of C tokens = bytes_per_token x min(C, window) + state_bytes (window None: all C tokens).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: str  # full | sliding | mla (a compressed latent) | mla-heads (MLA expanded per head) | linear (a state)
    bytes_per_token: int = Field(default=0, ge=0)  # keys + values of one token
    window: int | None = Field(default=None, ge=1)  # a sliding window keeps at most this many tokens
    state_bytes: int = Field(default=0, ge=0)  # a fixed state, whatever the context (linear attention)
    sharded: bool = True  # tensor parallel divides it over the ranks; False: every rank keeps it whole

    def bytes_at(self, context: int) -> int:
        tokens = context if self.window is None else min(context, self.window)
        return self.bytes_per_token * tokens + self.state_bytes


class RankBytes(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weights: int
    kv: int
    headroom: int
    total: int
    prompt_cache: int = 0


class HubRef(BaseModel):
    """Where a model named by its hub name came from: the repository, the revision asked for, the commit it was."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    repo_id: str = Field(min_length=3, max_length=200, pattern=r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
    revision: Optional[str] = Field(default=None, max_length=200)  # as given after @ (None: the default branch)
    commit: str = Field(pattern=r"^[0-9a-f]{40}$")  # what the revision resolved to when planned


class ModelRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    model_type: str
    source_path: str  # the coordinator's copy, used to re-derive the plan
    facts_hash: str
    manifest_hash: str | None = None
    num_layers: int
    layer_bytes: list[int]
    shared_bytes: int
    kv_bytes_per_token_per_layer: int  # the largest of kv_layers' bytes_per_token (older files: every layer's)
    embed_bytes: int = 0
    # each layer's KV cache as planned (model.KvLayer: bytes per token, sliding window, fixed state, sharded);
    # None in files planned before per-layer estimates: every layer kv_bytes_per_token_per_layer, the whole context
    kv_layers: Optional[list[KvLayer]] = None
    # logical parameters a token goes through in each layer and in the head (model.work), what --allocation work
    # splits by; empty / 0 in files planned before them
    layer_work: list[int] = Field(default_factory=list)
    head_work: int = 0
    # plan --model ORG/NAME[@REV]: the hub repository and the commit planned (source_path is its snapshot in the
    # hub cache); None for a model planned from a folder
    hub: Optional[HubRef] = None


class AdapterRef(BaseModel):
    """A LoRA adapter (an ``mlx_lm.lora`` output folder) the ranks apply to the model (docs/architectures.md)."""

    model_config = ConfigDict(extra="forbid")
    source_path: str  # the coordinator's copy, what sync sends
    manifest_hash: str  # its content (adapters.safetensors + adapter_config.json): part of the identity
    fine_tune_type: Literal["lora", "dora"] = "lora"
    num_layers: int  # the model's last num_layers blocks are adapted
    rank: int  # the LoRA rank
    path_map: dict[str, str]  # node -> the adapter folder there (sync puts it there; launch checks it)


class KvFit(BaseModel):
    """What plan --kv-bits buys: the longest context per sequence every rank fits with the planned batch, the KV
    cache quantized and in full precision (None: a node's memory is not known)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_context: Optional[int] = None
    max_context_full: Optional[int] = None


class RankAssignment(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rank: int
    node: Name
    host: str
    ips: list[str]
    start_layer: int  # [start_layer, end_layer) in model order; mlx-lm gives rank 0 the last layers
    end_layer: int
    layers: int
    planned: RankBytes
    usable_bytes: int | None


class ServingDefaults(BaseModel):
    """What rank 0 uses when a request leaves a field out (plan/replan --temperature ...). None: OpenAI's default
    (temperature 1, top_p 1, no top_k or min_p; max_tokens: until the request's context is full); ``max_n`` is a
    limit, not a default."""

    model_config = ConfigDict(extra="forbid")
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, ge=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=0, le=1 << 20)
    min_p: Optional[float] = Field(default=None, ge=0, le=1)
    max_tokens: Optional[int] = Field(default=None, ge=1, le=1 << 26)
    max_n: Optional[int] = Field(default=None, ge=1, le=128)  # the most choices (n) a request may ask (None: 8)
    chat_template: Optional[str] = Field(default=None, min_length=1, max_length=65536)  # replaces the model's
    chat_template_args: dict[str, Any] = Field(default_factory=dict)  # passed to every template rendering

    @model_validator(mode="after")
    def _args(self) -> "ServingDefaults":
        if len(json.dumps(self.chat_template_args)) > 16384:
            raise ValueError("chat_template_args: at most 16 KiB of JSON")
        return self


class PlanOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # auto: work when the stages overlap, else balanced (planner.choose_allocation)
    allocation: Literal["auto", "balanced", "proportional", "speed", "work"] = "auto"
    backend: Literal["auto", "ring", "jaccl", "mpi"] = "auto"
    parallel: Literal["auto", "pipeline", "tensor"] = "auto"
    context: int = Field(default=4096, ge=1)
    batch: Optional[int] = Field(default=None, ge=1)  # None: as many slots as fit, up to DEFAULT_BATCH
    headroom_gb: float = Field(default=0.5, ge=0)
    embedding_offload: Literal["off", "on", "auto"] = "off"
    schedule: Literal["auto", "lockstep", "overlap"] = "auto"
    # bytes per rank kept for the prompt cache (None: a file from before it, no cache)
    prompt_cache_gb: Optional[float] = Field(default=None, ge=0, le=1 << 20)
    # rank 0's defaults for what a request leaves out (None: a file from before them, OpenAI's defaults)
    serving: Optional[ServingDefaults] = None
    # the KV cache stored quantized (mlx-lm's QuantizedKVCache: affine, kv_group_size numbers per scale and bias)
    # once a sequence holds quantized_kv_start tokens; None: full precision (and every file from before it)
    kv_bits: Optional[Literal[4, 8]] = None
    kv_group_size: Literal[32, 64, 128] = 64
    quantized_kv_start: int = Field(default=5000, ge=0, le=1 << 26)  # mlx-lm's default (generate and server)


class Deployment(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[2] = SCHEMA_VERSION
    type: Literal["deployment"] = KIND
    deployment_id: DeploymentIdent
    created_at: str
    cluster: Name
    model: ModelRef
    nodes: list[Node]
    ranks: list[RankAssignment]
    backend: Literal["ring", "jaccl", "mpi"]
    parallel: Literal["pipeline", "tensor"]
    allocation: Literal["balanced", "proportional", "speed", "work"]  # resolved: options.allocation is as given
    allocation_reason: Optional[str] = None  # why the plan split the layers this way (None: a file from before)
    options: PlanOptions
    path_map: dict[str, str]
    speeds: dict[str, float] = Field(default_factory=dict)
    placement: str
    plan_hash: str
    warnings: list[str] = Field(default_factory=list)
    embedding_offload: bool = False  # resolved from options.embedding_offload; ranks serve the embedding from SSD
    slots: Optional[int] = None  # how many batch slots (sequences of options.context tokens) fit on every rank
    batch: Optional[int] = None  # the batch slots the ranks serve: options.batch, or as many as fit up to 8
    parallel_reason: Optional[str] = None  # why --parallel auto chose what it chose
    # how the ranks decode: micro-batches in flight on every stage, or every step on every rank together
    # (None: a file from before schedules; the ranks overlap where they can)
    schedule: Optional[Literal["lockstep", "overlap"]] = None
    schedule_reason: Optional[str] = None
    # tokens of KV every rank keeps for reuse: what options.prompt_cache_gb holds on the rank with the most KV
    # bytes per token (0: no prompt cache)
    prompt_cache_tokens: int = 0
    # a LoRA adapter every rank applies to its layers (None: the base model)
    adapter: Optional[AdapterRef] = None
    # plan --kv-bits: the context that fits with the KV cache quantized and without (None: full precision)
    kv_fit: Optional[KvFit] = None
    # SHA-256 of the deployment's identity (``deployment_hash()``); the id is ``<cluster>-`` + its first 10 hex.
    # None in files planned before it (their id came from plan_hash: it is kept, never recomputed)
    deployment_hash: Optional[str] = None

    @property
    def batch_slots(self) -> int:
        return self.batch or self.options.batch or 1

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def rank_of(self, node: str) -> RankAssignment:
        for r in self.ranks:
            if r.node == node:
                return r
        raise KeyError(node)

    def rank_nodes(self) -> list[Node]:
        """Each rank's node, in rank order, in one pass (``node()`` per rank walks the list N times)."""
        by_name = {n.name: n for n in self.nodes}
        return [by_name[r.node] for r in self.ranks]


def canonical(obj) -> bytes:
    """Canonical JSON for hashing: sorted keys, no spaces, ASCII only, no floats allowed to drift."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def plan_hash(model_facts_hash: str, num_layers: int, nodes: list[Node], ranks: list[tuple[str, int, int]],
              backend: str, parallel: str) -> str:
    doc = {
        "v": 1,
        "model": {"facts_hash": model_facts_hash, "num_layers": num_layers},
        "nodes": [{"name": n.name, "host": n.host, "port": n.port, "user": n.user, "ips": sorted(n.ips),
                   "local": n.is_local} for n in nodes],
        "ranks": [{"rank": i, "node": node, "start": s, "end": e} for i, (node, s, e) in enumerate(ranks)],
        "backend": backend,
        "parallel": parallel,
    }
    return hashlib.sha256(canonical(doc)).hexdigest()


# Not in the identity: the id and the hash themselves, timestamps, measured speeds (a measurement, carried by
# node name; an allocation by speed shows in the ranks), warnings and the planner's reasons (text derived from the
# rest), the placement digest (derived from the ranks), and the model's manifest hash (recorded after planning,
# checked by launch preflight on every node). Values equal to their defaults are left out, so a field added later
# with a default never changes the hash of a file written before it.
_NOT_IDENTITY = {"deployment_id": True, "created_at": True, "deployment_hash": True, "speeds": True,
                 "warnings": True, "allocation_reason": True, "parallel_reason": True, "schedule_reason": True,
                 "placement": True, "nodes": {"__all__": {"speed"}}, "model": {"manifest_hash"}}


def identity_doc(dep: "Deployment") -> dict:
    """What the deployment's id stands for: every field that changes what runs or what a replan derives."""
    return {"v": 1, **dep.model_dump(mode="json", exclude_defaults=True, exclude=_NOT_IDENTITY)}


def deployment_hash(dep: "Deployment") -> str:
    return hashlib.sha256(canonical(identity_doc(dep))).hexdigest()


def with_identity(dep: "Deployment") -> "Deployment":
    """``dep`` named by its identity: ``deployment_hash`` set and the id ``<cluster>-<hash[:10]>``."""
    h = deployment_hash(dep)
    return dep.model_copy(update={"deployment_hash": h, "deployment_id": f"{dep.cluster}-{h[:10]}"})


def identity_changes(old: "Deployment", new: "Deployment") -> list[str]:
    """The identity's top-level fields that differ between two deployments (empty: the same deployment)."""
    a, b = identity_doc(old), identity_doc(new)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def placement_signature(ranks: list[RankAssignment]) -> str:
    """What an operator approves: per-rank node, layer range and planned bytes, as a short hash."""
    doc = [[r.rank, r.node, r.start_layer, r.end_layer, r.planned.total] for r in ranks]
    return hashlib.sha256(canonical(doc)).hexdigest()[:12]


def placement_lines(ranks: list[RankAssignment]) -> list[str]:
    return [f"rank {r.rank} {r.node} layers [{r.start_layer}, {r.end_layer}) {r.planned.total} B" for r in ranks]


def diff_placement(old: Deployment, new: Deployment) -> list[str]:
    """Human lines describing how two deployments' placements differ (empty when they match)."""
    out = []
    if old.model.facts_hash != new.model.facts_hash:
        out.append("model: weights or config changed (facts hash differs)")
    if old.backend != new.backend:
        out.append(f"backend: {old.backend} -> {new.backend}")
    if old.parallel != new.parallel:
        out.append(f"parallel: {old.parallel} -> {new.parallel}")
    if (old.schedule or "overlap") != (new.schedule or "overlap"):
        out.append(f"schedule: {old.schedule or 'overlap'} -> {new.schedule or 'overlap'}")
    a, b = placement_lines(old.ranks), placement_lines(new.ranks)
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else "(none)"
        y = b[i] if i < len(b) else "(none)"
        if x != y:
            out.append(f"- {x}\n+ {y}")
    if not out and old.plan_hash != new.plan_hash:
        out.append("nodes: names or addresses changed")
    return out


# ---- files -----------------------------------------------------------------------------------------------------

def encode(dep: Deployment, key: SigningKey) -> bytes:
    payload = dumps(dep.model_dump(mode="json"))
    return sign_payload(payload, KIND, key)


class Loaded(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    deployment: Deployment
    migrated_from: int | None = None


def decode(data: bytes, trusted: list[PublicKey], *, source: str = "deployment file") -> Loaded:
    """Verify, then parse. Version 1 is migrated in memory (the caller writes it back); newer versions refused."""
    payload = verify_signed(data, KIND, trusted, source=source)
    doc = strict_loads(payload, source=source)
    if not isinstance(doc, dict):
        raise IntegrityError(f"{source} is not a JSON object", damaged=True)
    if doc.get("type") != KIND:
        raise IntegrityError(f"{source} is a {doc.get('type')!r} file, not a deployment")
    version = doc.get("schema_version")
    migrated_from = None
    if not isinstance(version, int):
        raise IntegrityError(f"{source} has no schema_version")
    if version > SCHEMA_VERSION:
        raise IntegrityError(f"{source} has schema_version {version}; this clusterctl reads up to {SCHEMA_VERSION}",
                             hint="upgrade clusterctl (the file was left untouched)")
    if version == 1:
        doc = migrate_v1(doc)
        migrated_from = 1
    elif version != SCHEMA_VERSION:
        raise IntegrityError(f"{source} has unknown schema_version {version}")
    try:
        dep = Deployment.model_validate(doc)
    except ValidationError as e:
        raise IntegrityError(f"{source}: {pydantic_line(e)}") from None
    _check_consistent(dep, source)
    return Loaded(deployment=dep, migrated_from=migrated_from)


def migrate_v1(doc: dict) -> dict:
    """v1 had one ``model.path`` for every node; v2 has a per-node ``path_map``."""
    doc = dict(doc)
    # tolerant of what is not a v1 file (the schema check after migration names the field)
    model = dict(doc["model"]) if isinstance(doc.get("model"), dict) else {}
    path = model.pop("path", None)
    model.setdefault("source_path", path or "")
    doc["model"] = model
    nodes = doc.get("nodes") if isinstance(doc.get("nodes"), list) else []
    doc["path_map"] = {n["name"]: (n.get("model_path") or path or "") for n in nodes
                       if isinstance(n, dict) and isinstance(n.get("name"), str)}
    doc["schema_version"] = SCHEMA_VERSION
    return doc


def _check_consistent(dep: Deployment, source: str) -> None:
    names = [n.name for n in dep.nodes]
    if [r.rank for r in dep.ranks] != list(range(len(dep.ranks))):
        raise IntegrityError(f"{source}: ranks are not numbered 0..N-1")
    for r in dep.ranks:
        if r.node not in names:
            raise IntegrityError(f"{source}: rank {r.rank} names unknown node {r.node!r}")
        if r.node not in dep.path_map or not dep.path_map[r.node].startswith("/"):
            raise IntegrityError(f"{source}: path_map has no absolute model path for node {r.node}")
    expected = plan_hash(dep.model.facts_hash, dep.model.num_layers, dep.nodes,
                         [(r.node, r.start_layer, r.end_layer) for r in dep.ranks], dep.backend, dep.parallel)
    if expected != dep.plan_hash:
        raise IntegrityError(f"{source}: plan_hash does not match its contents")
    if dep.deployment_hash is not None and dep.deployment_hash != deployment_hash(dep):
        raise IntegrityError(f"{source}: deployment_hash does not match its contents")
