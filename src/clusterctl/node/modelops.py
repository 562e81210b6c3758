"""The node operations on a model copy (nodeops.py serves them): is a folder one this node can serve from, how
its copy compares with the planned manifest, the folder a sync writes into, and a download from an HTTP mirror."""

from __future__ import annotations

import os
from pathlib import Path

from clusterctl.errors import ClusterctlError
from clusterctl.modelfiles.copycheck import check_copy, free_bytes, local_rsync
from clusterctl.node.download import fetch_files
from clusterctl.modelfiles.folder import weight_files
from clusterctl.modelfiles.manifest import HashCache, check_manifest
from clusterctl.protocol.nodeops import (CopySummary, FetchAnswer, FetchRequest, ModelFolder, ModelPrepareAnswer,
                                        ModelPrepareRequest, ModelStatusAnswer, ModelStatusRequest, RsyncFacts)


def model_check(path: str) -> ModelFolder:
    """Is ``path`` a model folder this node can serve from: config.json, the weight files (those the index names,
    or every *.safetensors without one: modelfiles/folder.py) and a tokenizer."""
    p = Path(path)
    if not p.is_dir():
        return ModelFolder(ok=False, absent=True, error=f"model folder {path} does not exist")
    missing = [] if (p / "config.json").is_file() else ["config.json"]
    try:
        files = [f.name for f in weight_files(p)]
    except ClusterctlError as e:
        return ModelFolder(ok=False, error=f"model folder {path}: {e}")
    missing += [n for n in files if not (p / n).is_file()]
    if not any(p.glob("tokenizer*")):
        missing.append("tokenizer.json")
    if missing:
        return ModelFolder(ok=False, error=f"model folder {path} lacks {', '.join(missing[:5])}")
    return ModelFolder(ok=True, files=files)


def copy_state(manifest: dict, path: str, verify: bool) -> CopySummary:
    """The copy check of preflight: state and counts only (the file lists stay on the node)."""

    try:
        st = check_copy(check_manifest(manifest, "manifest sent by the coordinator"), path, verify=verify,
                        cache=HashCache())
    except ClusterctlError as e:
        return CopySummary(state="error", detail=e.message)
    keep = ("state", "detail", "n_missing", "n_stale", "checked_bytes")
    return CopySummary(**{k: st[k] for k in keep if k in st}, first=(st.get("stale") or st.get("missing") or [None])[0])


def op_model_status(req: ModelStatusRequest) -> ModelStatusAnswer:
    """Compare the model copy at ``path`` with the manifest ``manifest`` (clusterctl.modelfiles.copycheck)."""

    expected = check_manifest(req.manifest, "manifest sent by the coordinator")
    out = check_copy(expected, req.path, verify=req.verify, cache=HashCache(), only=req.only)
    return ModelStatusAnswer(**out, free_bytes=free_bytes(req.path), rsync=rsync_facts())


def rsync_facts() -> RsyncFacts:
    """Which rsync runs here as the remote side of a sync: missing, GNU rsync (version), or openrsync."""

    path, line = local_rsync()
    if not path:
        return RsyncFacts(path=None)
    return RsyncFacts(path=path, version=line[:200] if line is not None else None)


def op_model_prepare(req: ModelPrepareRequest) -> ModelPrepareAnswer:
    """Create the model folder (and parents) a sync will write into; report the free space there. A failure is
    an answer holding only ``error`` (the coordinator raises it)."""

    path = req.path
    if not os.path.isabs(path):
        return ModelPrepareAnswer(error=f"model path {path!r} is not absolute")
    try:
        os.makedirs(path, mode=0o755, exist_ok=True)
    except OSError as e:
        return ModelPrepareAnswer(error=f"cannot create {path}: {e.strerror or e}")
    return ModelPrepareAnswer(path=path, free_bytes=free_bytes(path))


def op_fetch(req: FetchRequest) -> FetchAnswer:
    """Download manifest files from an HTTP mirror into ``path`` (clusterctl.node.download)."""

    expected = check_manifest(req.manifest, "manifest sent by the coordinator")
    return FetchAnswer(**fetch_files(req.url, req.path, expected, req.files, timeout=req.timeout))
