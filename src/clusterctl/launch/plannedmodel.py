"""The coordinator's side of "which model was planned": the manifest a deployment names, found or rebuilt.

``plan`` computes the manifest of the operator's copy, stores it in ``<state>/manifests/`` (named by its hash)
and records the hash in the deployment (signed). Anyone holding the deployment can then check a copy anywhere:
a stored manifest is re-hashed when read, so it needs no signature of its own.
"""

from __future__ import annotations

from pathlib import Path

from clusterctl.errors import IntegrityError, MissingInput
from clusterctl.modelfiles.manifest import HashCache, Manifest, build_manifest, load_manifest, save_manifest
from clusterctl.plan.commands import plan_deployment
from clusterctl.launch.hubmodel import resolve_model, with_hub
from clusterctl.statedir.state import StateDir


def manifest_of_folder(state: StateDir, folder: str | Path, *, name: str | None = None) -> Manifest:
    """Manifest of a folder on this machine (hashes from this machine's cache), stored in the state dir."""
    m = build_manifest(folder, name=name, cache=HashCache())
    save_manifest(state.manifests, m)
    return m


def planned_manifest(state: StateDir, dep) -> Manifest | None:
    """The manifest ``dep`` was planned with; None for a deployment planned before manifests existed.

    Looked up in the state dir; when it is not there (a deployment copied from another coordinator) it is
    rebuilt from the coordinator's copy of the model, which must then hash to the planned value.
    """
    digest = dep.model.manifest_hash
    if not digest:
        return None
    m = load_manifest(state.manifests, digest)
    if m is not None:
        return m
    src = Path(dep.model.source_path)
    if not src.is_dir():
        raise MissingInput(
            f"the model manifest {digest} of deployment {dep.deployment_id} is not in {state.manifests}, and "
            f"there is no copy of the model at {src} to rebuild it from",
            hint="copy the manifest file from the coordinator that ran `clusterctl plan`, or plan again here")
    m = build_manifest(src, name=dep.model.name, cache=HashCache())
    if m.manifest_hash != digest:
        raise IntegrityError(
            f"the model at {src} is not the one deployment {dep.deployment_id} was planned with "
            f"(manifest {m.manifest_hash}, planned {digest})",
            hint="restore that copy, or run `clusterctl plan` again for the model as it is now")
    save_manifest(state.manifests, m)
    return m


def planned_adapter_manifest(state: StateDir, dep) -> Manifest | None:
    """The manifest of the LoRA adapter ``dep`` serves (None: no adapter): from the state dir, else rebuilt from
    the coordinator's copy, which must hash to the planned value."""
    if dep.adapter is None:
        return None
    digest = dep.adapter.manifest_hash
    m = load_manifest(state.manifests, digest)
    if m is not None:
        return m
    src = Path(dep.adapter.source_path)
    if not src.is_dir():
        raise MissingInput(f"the adapter manifest {digest} of deployment {dep.deployment_id} is not in "
                           f"{state.manifests}, and there is no adapter at {src} to rebuild it from",
                           hint="copy the manifest file from the coordinator that ran `clusterctl plan`")
    m = build_manifest(src, cache=HashCache())
    if m.manifest_hash != digest:
        raise IntegrityError(f"the adapter at {src} is not the one deployment {dep.deployment_id} was planned "
                             f"with (manifest {m.manifest_hash}, planned {digest})",
                             hint="restore that adapter, or run `clusterctl plan` again")
    save_manifest(state.manifests, m)
    return m


def record_manifest(state: StateDir, dep, folder: str | Path):
    """``dep`` with the manifest hash of the model at ``folder`` (built here, stored in the state dir): the
    content every node's copy must match (launch preflight and `clusterctl sync` check it)."""
    manifest = manifest_of_folder(state, Path(folder), name=dep.model.name)
    dep.model = dep.model.model_copy(update={"manifest_hash": manifest.manifest_hash})
    return dep


def plan_and_record(cluster_file: Path, model: str | Path, *, out: Path | None, state: StateDir, probe_remote=None,
                    progress: bool = False, **options):
    """``clusterctl plan``: the model found (a folder, or a hub name downloaded: hubmodel.py), planned
    (plan/commands.py), its manifest recorded, signed and written. Returns (deployment, the files written)."""
    src = resolve_model(model, progress=progress)
    dep = with_hub(plan_deployment(cluster_file, src.folder, probe_remote=probe_remote, **options), src.hub)
    dep = record_manifest(state, dep, src.folder)
    if dep.adapter is not None:  # stored beside the model's: sync and launch check every node's copy against it
        manifest_of_folder(state, dep.adapter.source_path)
    return dep, state.save_deployment(dep, out)
