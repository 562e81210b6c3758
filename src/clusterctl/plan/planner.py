"""inventory + model facts + options -> Deployment (unsigned). Pure: same inputs, same plan."""

from __future__ import annotations

from datetime import datetime, timezone
from fractions import Fraction

from clusterctl.errors import ConfigError
from clusterctl.plan import allocate
from clusterctl.plan.backend import all_links_fast, choose_backend
from clusterctl.protocol.deployment import (
    Deployment, KvFit, ModelRef, PlanOptions, RankAssignment, placement_signature, plan_hash, with_identity,
)
from clusterctl.plan.fit import (DEFAULT_BATCH, check_fit, longest_context, prompt_cache_tokens, rank_bytes,
                                 slots_that_fit)
from clusterctl.plan.kvquant import refuse as refuse_kv_bits
from clusterctl.plan.inventory import Cluster
from clusterctl.protocol.nodespec import Node
from clusterctl.plan.model import KvLayer, ModelFacts
from clusterctl.modelfiles.archs import STAGES


def _weights(nodes: list[Node], allocation: str) -> list[Fraction]:
    if allocation == "proportional":
        missing = [n.name for n in nodes if n.memory_gb is None]
        if missing:
            raise ConfigError(f"proportional allocation needs memory_gb for every node; missing on {', '.join(missing)}")
        # Exact: the decimal text of the float, never its binary rounding.
        return [Fraction(str(n.memory_gb)) * Fraction(str(n.usable_fraction)) for n in nodes]
    if allocation == "speed":
        missing = [n.name for n in nodes if n.speed is None]
        if missing:
            raise ConfigError(f"speed allocation needs a measured speed for every node; missing on {', '.join(missing)}",
                              hint="set speed = <tokens/s> per node, or use --allocation proportional")
        return [Fraction(str(n.speed)) for n in nodes]
    raise ConfigError(f"unknown allocation {allocation!r}")


def choose_allocation(asked: str, facts: ModelFacts, parallel: str, schedule: str) -> tuple[str, str]:
    """(balanced | proportional | speed | work, why). auto: work when the stages overlap (the slowest stage sets
    the pace, and rank 0 also runs the head), else balanced (ranks that take turns go at the same pace however
    the layers are split). Tensor parallel shards every layer evenly: only balanced."""
    if asked == "auto":
        if schedule != "overlap":
            return "balanced", "the ranks run in lockstep: the split does not set the pace, so layers spread evenly"
        asked, why = "work", "the stages overlap: the slowest sets the pace, and rank 0 also runs the head"
    else:
        why = "asked for"
    if parallel == "tensor" and asked != "balanced":
        raise ConfigError(f"--allocation {asked} is pipeline-only; tensor parallel shards every layer evenly",
                          hint="use --allocation balanced with --parallel tensor")
    if asked == "work" and not any(facts.layer_work):
        return "balanced", "the model's facts have no per-layer work figures: layers spread evenly"
    return asked, why


def layer_counts(nodes: list[Node], facts: ModelFacts, options: PlanOptions) -> list[int]:
    """Layers per rank for the resolved ``options.allocation`` (``choose_allocation``)."""
    if options.parallel == "tensor":
        return [facts.num_layers] * len(nodes)
    if options.allocation == "balanced":
        return allocate.balanced(facts.num_layers, len(nodes))
    if options.allocation == "work":
        return allocate.by_work(facts.layer_work, facts.head_work, len(nodes))
    return allocate.largest_remainder(facts.num_layers, _weights(nodes, options.allocation), [n.name for n in nodes])


def _resolve_offload(mode: str, facts: ModelFacts, nodes: list[Node], needs_for, warnings: list[str]) -> bool:
    """off: never; on: always (needs an untied head); auto: only when the plan fits with the table on SSD alone."""
    if mode == "off" or (mode == "auto" and facts.tie_word_embeddings):
        return False
    if facts.tie_word_embeddings:
        raise ConfigError("--embedding-offload on needs an untied lm_head: this model ties its head to the "
                          "embedding, so every rank needs the whole table in memory")
    if mode == "on":
        return True
    try:
        check_fit(nodes, needs_for(False))
        return False
    except ConfigError:
        warnings.append("the token embedding does not fit in memory: it is served from SSD (embedding offload)")
        return True


def choose_parallel(requested: str, facts: ModelFacts, nodes: list[Node], allocation: str = "auto"
                    ) -> tuple[str, str | None]:
    """(pipeline | tensor, why) for --parallel auto: tensor when every pair of nodes has a declared fast link
    and the model shards evenly over them, else pipeline. A mode asked for by name is kept (checked later)."""
    if requested != "auto":
        return requested, None
    if len(nodes) == 1:
        return "pipeline", None
    if allocation not in ("balanced", "auto"):
        return "pipeline", f"pipeline: --allocation {allocation} splits layers (tensor parallel shards them evenly)"
    if not all_links_fast(nodes):
        return "pipeline", "pipeline: not every pair of nodes has a declared fast link (tensor parallel would " \
                           "send activations twice per layer over them)"
    blockers = facts.tensor_blockers(len(nodes))
    if blockers:
        return "pipeline", f"pipeline: the model does not shard evenly over {len(nodes)} ranks ({'; '.join(blockers)})"
    return "tensor", f"tensor: every pair of nodes has a fast link and the model shards evenly over {len(nodes)} ranks"


def choose_schedule(asked: str, facts: ModelFacts, nodes: list[Node], parallel: str) -> tuple[str, str]:
    """(schedule, why): overlap needs a pipeline of 2 or more ranks split by clusterctl's stage code."""

    if len(nodes) < 2:
        blocker = "one rank has no stages to overlap"
    elif parallel != "pipeline":
        blocker = "tensor parallel ranks compute every layer together"
    elif facts.pipeline not in (STAGES, None):
        blocker = f"model type {facts.model_type!r} is split by mlx-lm's own pipeline(), which runs in lockstep"
    else:
        blocker = None
    if asked == "overlap" and blocker:
        raise ConfigError(f"--schedule overlap: {blocker}", hint="use --schedule lockstep (or auto)")
    if asked == "lockstep":
        return "lockstep", "asked for"
    if blocker:
        return "lockstep", blocker
    return "overlap", "asked for" if asked == "overlap" else "a micro-batch per stage in flight"


def make_deployment(cluster: Cluster, facts: ModelFacts, model_path: str, options: PlanOptions, *,
                    path_map: dict[str, str] | None = None, now: datetime | None = None) -> Deployment:
    nodes = cluster.nodes
    warnings: list[str] = list(facts.notes)
    given = options
    parallel, why = choose_parallel(options.parallel, facts, nodes, options.allocation)
    schedule, schedule_why = choose_schedule(options.schedule, facts, nodes, parallel)
    allocation, allocation_why = choose_allocation(options.allocation, facts, parallel, schedule)
    options = options.model_copy(update={"parallel": parallel, "allocation": allocation})
    counts = layer_counts(nodes, facts, options)
    if parallel == "tensor" and len(nodes) > 1:
        blockers = facts.tensor_blockers(len(nodes))
        if blockers:
            raise ConfigError(f"cannot shard model type {facts.model_type!r} over {len(nodes)} ranks: "
                              + "; ".join(blockers),
                              hint="use --parallel pipeline" + ("" if facts.shardable is False else
                                                                ", or a number of nodes that divides the heads"))
    if options.parallel == "pipeline" and len(nodes) > 1 and not facts.pipeline_capable:
        raise ConfigError(f"cannot split model type {facts.model_type!r} over {len(nodes)} nodes: "
                          f"{facts.pipeline_reason or 'no pipeline support'}",
                          hint="serve it on one node (a cluster.toml with one [[node]])")
    if options.parallel == "tensor" and len(nodes) > 1 and not all_links_fast(nodes):
        warnings.append("tensor parallel sends activations every layer: recommended only on known-fast links "
                        "(thunderbolt/rdma); some pairs have none declared")
    backend = choose_backend(options.backend, nodes)
    if options.parallel == "tensor":
        ranges = [(0, facts.num_layers)] * len(nodes)
    else:
        ranges = allocate.layer_ranges(counts)
    refuse_kv_bits(facts.model_type, facts.kv_layer_list(), facts.head_dim, facts.kv_quant_reason, options)

    def needs_for(off: bool, batch: int | None = None, context: int | None = None, quant: bool = True):
        return [rank_bytes(facts, s, e, parallel=options.parallel, world=len(nodes),
                           context=context or options.context, batch=batch or options.batch or 1,
                           headroom_gb=options.headroom_gb, embedding_offload=off,
                           prompt_cache_gb=options.prompt_cache_gb or 0.0, quant=options if quant else None)
                for s, e in ranges]

    offload = _resolve_offload(options.embedding_offload, facts, nodes, needs_for, warnings)
    slots = slots_that_fit(nodes, needs_for(offload, 1))
    # options.batch None: as many slots as fit, up to the default (at least one: check_fit says if not even that)
    batch = options.batch or max(1, min(DEFAULT_BATCH, slots if slots is not None else 1))
    if facts.batchable is False:  # requests are then served one at a time from rank 0's queue
        if options.batch and options.batch > 1:
            raise ConfigError(f"--batch {options.batch}: {facts.batch_reason}", hint="use --batch 1")
        batch = 1
        warnings.append(f"one request at a time: {facts.batch_reason}")
    needs = needs_for(offload, batch)
    check_fit(nodes, needs)
    ranks = [RankAssignment(rank=i, node=n.name, host=n.host, ips=n.ips, start_layer=s, end_layer=e, layers=e - s,
                            planned=need, usable_bytes=n.usable_bytes)
             for i, (n, (s, e), need) in enumerate(zip(nodes, ranges, needs))]
    pm = _path_map(nodes, path_map, model_path)
    h = plan_hash(facts.facts_hash, facts.num_layers, nodes, [(r.node, r.start_layer, r.end_layer) for r in ranks],
                  backend, options.parallel)
    created = (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return with_identity(Deployment(
        deployment_id=f"{cluster.name}-{h[:10]}",  # replaced by with_identity: the id names everything that runs
        created_at=created,
        cluster=cluster.name,
        model=ModelRef(name=facts.name, model_type=facts.model_type, source_path=model_path,
                       facts_hash=facts.facts_hash, num_layers=facts.num_layers, layer_bytes=facts.layer_bytes,
                       shared_bytes=facts.shared_bytes, kv_bytes_per_token_per_layer=facts.kv_bytes_per_token_per_layer,
                       embed_bytes=facts.embed_bytes, kv_layers=facts.kv_layer_list(), layer_work=facts.layer_work,
                       head_work=facts.head_work),
        nodes=nodes, ranks=ranks, backend=backend, parallel=options.parallel, allocation=options.allocation,
        allocation_reason=allocation_why, options=given, parallel_reason=why, path_map=pm,
        speeds={n.name: n.speed for n in nodes if n.speed is not None},
        placement=placement_signature(ranks), plan_hash=h, warnings=warnings, embedding_offload=offload,
        slots=slots, batch=batch, schedule=schedule, schedule_reason=schedule_why,
        prompt_cache_tokens=prompt_cache_tokens(facts, ranges, parallel=options.parallel,
                                                reserve=needs[0].prompt_cache, quant=options),
        kv_fit=_kv_fit(nodes, options, lambda c, q: needs_for(offload, batch, c, q)),
    ))


def _path_map(nodes: list[Node], path_map: dict[str, str] | None, model_path: str) -> dict[str, str]:
    """Each node's copy of the model: the path_map's, else its model_path, else (a local node) the one planned."""
    pm = {}
    for n in nodes:
        p = (path_map or {}).get(n.name) or n.model_path or (model_path if n.is_local else None)
        if not p:
            raise ConfigError(f"node {n.name} has no model_path (its copy of the model)",
                              hint="set model_path for every remote node in cluster.toml")
        if not p.startswith("/") or "\x00" in p or "\n" in p:
            # such a file would not load (deployment._check_consistent): refuse it before writing
            raise ConfigError(f"node {n.name}: model path {p!r} is not an absolute path")
        pm[n.name] = p
    return pm


def _kv_fit(nodes: list[Node], options: PlanOptions, needs_at) -> KvFit | None:
    """What plan --kv-bits buys: the context that fits every rank with the KV cache quantized, and without
    (``needs_at(context, quantized)``: each rank's bytes)."""
    if options.kv_bits is None:
        return None
    return KvFit(max_context=longest_context(nodes, lambda c: needs_at(c, True)),
                 max_context_full=longest_context(nodes, lambda c: needs_at(c, False)))


def replan_same_inputs(dep: Deployment, facts: ModelFacts) -> Deployment:
    """Recompute a deployment from its own recorded inputs and the model as it is now (for launch/replan checks).

    While the model is unchanged (same facts hash) the KV cache and the work are counted as the deployment
    recorded them, so a newer estimate never invalidates an approved placement; a file from before per-layer
    estimates (``model.kv_layers`` None) recorded one size for every layer. The allocation is the one the plan
    resolved: auto follows the schedule, which needs mlx-lm's class (the launch re-check does not build it)."""
    cluster = Cluster(name=dep.cluster, nodes=dep.nodes)
    if facts.facts_hash == dep.model.facts_hash and dep.model.num_layers == facts.num_layers:
        facts = _as_recorded(dep, facts)
    options = dep.options.model_copy(update={"allocation": dep.allocation})
    new = make_deployment(cluster, facts, dep.model.source_path, options, path_map=dep.path_map)
    if dep.model.kv_layers is None:
        new = with_identity(new.model_copy(update={"model": new.model.model_copy(update={"kv_layers": None})}))
    return new


def _as_recorded(dep: Deployment, facts: ModelFacts) -> ModelFacts:
    """The facts with the KV cache and the work the deployment recorded (those it has, one per layer)."""
    recorded = dep.model.kv_layers or [KvLayer(kind="full", bytes_per_token=dep.model.kv_bytes_per_token_per_layer)
                                       ] * dep.model.num_layers
    update = {}
    if len(recorded) == facts.num_layers:
        update["kv_layers"] = recorded
    if len(dep.model.layer_work) == facts.num_layers:
        update.update(layer_work=dep.model.layer_work, head_work=dep.model.head_work)
    return facts.model_copy(update=update)
