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
                   "parallel": "pipeline, tensor"}
        extra = f" (choose from {choices[field]})" if field in choices else ""
        raise UsageError(f"--{field.replace('_', '-')}: {kw.get(field)!r} is not valid{extra}") from None


def plan_command(cluster_file: Path, model: Path, *, out: Path | None, state, **options) -> tuple[Deployment, list[Path]]:
    opts = plan_options(**options)
    cluster = load_cluster(cluster_file)
    facts = inspect_model(model)
    dep = make_deployment(cluster, facts, str(model.resolve()), opts)
    written = state.save_deployment(dep, out)
    return dep, written
