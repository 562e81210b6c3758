"""Preflight: before anything changes on a node, check every node at once and name every problem.

Each node answers one ``probe`` op (versions, backend, model folder and copy, free memory, ports, runtime dir);
``preflight`` turns the answers into one error naming every failure on every node (exit 69 when model copies
are the only problem, ``PortsBusy`` when busy ports are). ``check_inputs_unchanged`` is the coordinator's own
check: the deployment still plans the same from its inputs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from clusterctl.errors import ClusterctlError, Exit, IntegrityError, LaunchFailed
from clusterctl.connect.nodes import NODEOP_TIMEOUT, NodeHandle, first_error_code
from clusterctl.protocol.deployment import Deployment, diff_placement
from clusterctl.protocol.nodeops import (BadAnswer, CopySummary, ModelStatusAnswer, ModelStatusRequest, ProbeAnswer,
                                        ProbeRequest, WarmRequest)
from clusterctl.protocol.versions import coordinator_versions
from clusterctl.plan.model import inspect_model
from clusterctl.plan.planner import replan_same_inputs


class PortsBusy(LaunchFailed):
    """Preflight found nothing wrong but ports of the chosen block in use: another block may do."""

    def __init__(self, message: str, busy: set[int], **kw):
        super().__init__(message, **kw)
        self.busy = busy


def _version_problems(probe: ProbeAnswer, node: str) -> tuple[list[str], list[str]]:
    import sys

    errors, warnings = [], []
    v = probe.versions
    for dist, want in coordinator_versions().items():
        have = v.get(dist)
        if have is None:
            errors.append(f"{dist} is not installed")
        elif want is not None and have != want:
            errors.append(f"{dist} {have} differs from the coordinator's {want}")
    py = v.get("python", "0.0").split(".")
    mine = [str(x) for x in sys.version_info[:2]]
    if py[0] != mine[0]:
        errors.append(f"python {v.get('python')} (coordinator has {'.'.join(mine)}): major versions differ")
    elif py[:2] != mine:
        warnings.append(f"node {node}: python {v.get('python')} differs from the coordinator's {'.'.join(mine)}")
    return errors, warnings


def copy_problem(copy: CopySummary | ModelStatusAnswer, path: str, dep_ref: str, what: str = "model") -> str | None:
    """One line for a node whose model (or adapter) copy is not the planned one (None when it is), naming the fix."""
    state = copy.state
    if state == "ok":
        return None
    if state == "error":
        return f"cannot check the {what} copy at {path}: {copy.detail}"
    n = {"missing": copy.n_missing or 0, "stale": copy.n_stale or 0}
    counts = {"missing": f"{n['missing']} file(s) missing", "stale": f"{n['stale']} file(s) differ"}
    counted = ", ".join(counts[k] for k in ("stale", "missing") if n[k])
    first = f", e.g. {copy.first}" if getattr(copy, "first", None) else ""
    detail = copy.detail if "detail" in copy.model_fields_set else f"not the planned {what}"
    return (f"{what} copy at {path} is {state} ({counted or detail}{first}); "
            f"run `clusterctl sync {dep_ref}`")


async def preflight(dep: Deployment, hs: dict[str, NodeHandle], ports: dict[str, list[int]], *,
                    manifest=None, verify: bool = False, dep_ref: str | None = None,
                    adapter_manifest=None) -> list[str]:
    """Probe every node concurrently; raise one error naming every failure on every node. Returns warnings.

    With ``manifest`` each node also compares its copy of the model with it (sizes and cached hashes; every
    byte re-hashed with ``verify``), and with ``adapter_manifest`` its copy of the LoRA adapter. When copies are
    the only problem the exit code is 69 (unavailable).
    """
    warnings: list[str] = []
    copy_only: dict[str, bool] = {}
    busy_only: dict[str, set[int]] = {}
    mdoc = manifest.model_dump(mode="json") if manifest is not None else None
    rank_of = {r.node: r for r in dep.ranks}  # dep.rank_of per node would walk every rank N times

    async def one(h: NodeHandle) -> list[str]:
        rank = rank_of[h.name]
        path = dep.path_map[h.name]
        probe = await h.ask(ProbeRequest(backend=dep.backend if len(dep.ranks) > 1 else None, model_path=path,
                                         runtime_dir=h.runtime_dir, ports=ports.get(h.name, []), manifest=mdoc,
                                         verify=verify),
                            timeout=NODEOP_TIMEOUT if not verify else 3600.0)
        h.probe = probe
        rd = probe.runtime_dir
        if rd is None:
            raise BadAnswer(f"node {h.name}: probe answered no runtime dir", host=h.name)
        h.runtime_dir = rd.path
        errs, warns = _version_problems(probe, h.name)
        warnings.extend(warns)
        if len(dep.ranks) > 1 and not probe.backend_available:
            errs.append(f"mlx cannot use the {dep.backend} backend here"
                        + (f" ({probe.mlx_error})" if probe.mlx_error else ""))
        model = probe.model
        copy = copy_problem(probe.copy_check, path, dep_ref or dep.deployment_id) if probe.copy_check else None
        if copy:
            errs.append(copy)  # names the fix; the folder check below would only repeat part of it
        elif model is None or not model.ok:
            errs.append(model.error if model is not None and model.error is not None else "model check failed")
        copies = [copy] if copy else []
        if adapter_manifest is not None and dep.adapter is not None:
            apath = dep.adapter.path_map[h.name]
            st = await h.ask(ModelStatusRequest(manifest=adapter_manifest.model_dump(mode="json"), path=apath,
                                                verify=verify, only=None), timeout=NODEOP_TIMEOUT)
            if acopy := copy_problem(st, apath, dep_ref or dep.deployment_id, "adapter"):
                errs.append(acopy)
                copies.append(acopy)
        need = rank.planned.weights + rank.planned.kv
        if probe.mem_available < need:
            errs.append(f"needs {need / 2**30:.2f} GiB free memory, has {probe.mem_available / 2**30:.2f} GiB")
        if probe.ports_busy:
            errs.append(f"ports already in use: {', '.join(map(str, probe.ports_busy))}")
        if not rd.ok:
            errs.append(f"runtime dir {rd.path} is not usable: {rd.error}")
        copy_only[h.name] = bool(copies) and errs == copies
        if probe.ports_busy and len(errs) == 1:
            busy_only[h.name] = set(probe.ports_busy)
        return errs

    results = await asyncio.gather(*(one(h) for h in hs.values()), return_exceptions=True)
    problems, errors = [], []
    for h, res in zip(hs.values(), results):
        if isinstance(res, BaseException):
            if not isinstance(res, ClusterctlError):
                raise res
            errors.append(res)
            problems.append(f"{h.name}: {res.message}")
        elif res:
            errors.append(ClusterctlError(res[0], exit_code=Exit.UNAVAILABLE if copy_only.get(h.name) else Exit.FAILED))
            problems.extend(f"{h.name}: {p}" for p in res)
    if busy_only:  # busy ports, a node's only problem: another block first, then whatever else is wrong
        raise PortsBusy("preflight failed: " + "; ".join(problems), set().union(*busy_only.values()))
    if problems:
        code = first_error_code(errors) if all(isinstance(e, ClusterctlError) and e.message for e in errors) \
            else Exit.FAILED
        raise LaunchFailed(f"preflight failed on {len({p.split(':')[0] for p in problems})} node(s): "
                           + "; ".join(problems), exit_code=code)
    return warnings


async def warm(hs: dict[str, NodeHandle], dep: Deployment) -> None:
    """Start every node's session and import there what preflight and the ranks' start need; a failure here is
    left for preflight to report (one error naming every node)."""
    modules = ["psutil"] + (["mlx.core"] if len(dep.ranks) > 1 else [])
    await asyncio.gather(*(h.ask(WarmRequest(modules=modules)) for h in hs.values()), return_exceptions=True)


def check_inputs_unchanged(dep: Deployment) -> None:
    """Re-derive the plan from the deployment's own inputs and the model as it is now; refuse on any difference."""

    if not Path(dep.model.source_path).is_dir():
        return  # the coordinator holds no copy; each node's copy is checked in preflight
    try:
        new = replan_same_inputs(dep, inspect_model(dep.model.source_path, classify=False))
    except ClusterctlError as e:
        raise IntegrityError(f"deployment {dep.deployment_id} no longer plans from its inputs: {e.message}") from None
    if new.plan_hash != dep.plan_hash or new.placement != dep.placement:
        diff = diff_placement(dep, new)
        raise IntegrityError(f"deployment {dep.deployment_id} no longer matches its inputs: " + "; ".join(
            d.replace("\n", " / ") for d in diff), hint="run clusterctl plan again")
