"""The plan command's core: read inputs, plan, sign and write. Called by the CLI; returns data."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from clusterctl.errors import UsageError
from clusterctl.plan.deployment import Deployment, PlanOptions
from clusterctl.plan.inventory import load_cluster
from clusterctl.plan.model import inspect_model
from clusterctl.plan.planner import make_deployment


def plan_options(**kw) -> PlanOptions:
    try:
        return PlanOptions(**kw)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "option"
        choices = {"allocation": "balanced, proportional, speed", "backend": "auto, ring, jaccl, mpi",
                   "parallel": "auto, pipeline, tensor", "embedding_offload": "off, on, auto"}
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


def plan_command(cluster_file: Path, model: Path, *, out: Path | None, state, probe_remote=None,
                 **options) -> tuple[Deployment, list[Path]]:
    opts = plan_options(**options)
    cluster = fill_memory(load_cluster(cluster_file), probe_remote)
    facts = inspect_model(model)
    dep = make_deployment(cluster, facts, str(model.resolve()), opts)
    # the content every node's copy must match (launch preflight and `clusterctl sync` check it)
    from clusterctl.sync.planned import manifest_of_folder

    manifest = manifest_of_folder(state, model, name=dep.model.name)
    dep.model = dep.model.model_copy(update={"manifest_hash": manifest.manifest_hash})
    written = state.save_deployment(dep, out)
    return dep, written
