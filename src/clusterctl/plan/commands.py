"""The plan command's inputs: flags checked, memory filled in, the model inspected, the plan made; returns data."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from clusterctl.errors import UsageError
from clusterctl.protocol.deployment import Deployment, PlanOptions, with_identity
from clusterctl.plan.adapter import inspect_adapter, refuse_tensor
from clusterctl.plan.inventory import load_cluster
from clusterctl.plan.model import inspect_model
from clusterctl.plan.planner import make_deployment


def plan_options(**kw) -> PlanOptions:
    try:
        return PlanOptions(**kw)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "option"
        choices = {"allocation": "auto, balanced, proportional, speed, work", "backend": "auto, ring, jaccl, mpi",
                   "parallel": "auto, pipeline, tensor", "embedding_offload": "off, on, auto",
                   "schedule": "auto, overlap, lockstep", "kv_bits": "4, 8", "kv_group_size": "32, 64, 128"}
        extra = f" (choose from {choices[field]})" if field in choices else ""
        raise UsageError(f"--{field.replace('_', '-')}: {kw.get(field)!r} is not valid{extra}") from None


def fill_memory(cluster, probe_remote=None):
    """Nodes without memory_gb: a local node's RAM is read here; a remote one's through ``probe_remote(nodes)``
    (an SSH probe, when the operator asked for it). Returns a new Cluster; the pure planner never probes."""
    missing = [n for n in cluster.nodes if n.memory_gb is None]
    if not missing:
        return cluster
    found: dict[str, float] = {}
    local = [n for n in missing if n.is_local]
    if local:
        import psutil

        total = psutil.virtual_memory().total / (1 << 30)
        found.update({n.name: round(total, 3) for n in local})
    remote = [n for n in missing if not n.is_local]
    if remote and probe_remote is not None:
        found.update(probe_remote(remote))
    nodes = [n.model_copy(update={"memory_gb": found[n.name]}) if n.name in found else n for n in cluster.nodes]
    return cluster.model_copy(update={"nodes": nodes})


def plan_deployment(cluster_file: Path, model: Path, *, probe_remote=None, adapter: Path | None = None,
                    **options) -> Deployment:
    """Read the inventory and the model, plan: the deployment, not yet signed or written (launch/plannedmodel.py's
    ``plan_and_record`` records the model's manifest in it and writes it). ``adapter``: a LoRA adapter folder."""
    opts = plan_options(**options)
    cluster = fill_memory(load_cluster(cluster_file), probe_remote)
    facts = inspect_model(model)
    dep = make_deployment(cluster, facts, str(model.resolve()), opts)
    return dep if adapter is None else with_adapter(dep, adapter, model)


def with_adapter(dep: Deployment, adapter: Path, model: Path) -> Deployment:
    """``dep`` serving the LoRA adapter at ``adapter`` (checked against ``model``); its id names the adapter."""
    refuse_tensor(dep)
    nodes = {r.node: (dep.path_map[r.node], dep.node(r.node).is_local) for r in dep.ranks}
    ref = inspect_adapter(adapter, model, dep.model.num_layers, nodes)
    return with_identity(dep.model_copy(update={"adapter": ref}))
