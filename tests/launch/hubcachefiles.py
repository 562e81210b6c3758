"""A repository's hub cache written straight to disk, as huggingface_hub leaves it after a download, and `plan
--model ORG/NAME` run in this process against it (offline: tests/conftest.py sets HF_HUB_OFFLINE).

    <cache>/models--ORG--NAME/blobs/<sha256 | git blob id>   the bytes, named by the hash the hub sent
    <cache>/models--ORG--NAME/snapshots/<commit>/<file>      relative links to the blobs
    <cache>/models--ORG--NAME/refs/main                      the commit (40 hex, no newline)
    <cache>/models--ORG--NAME/trees/<commit>.json            the commit's listing (the library's format 1)
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from fuzzutil import CliResult, run_cli
from hubserver import git_blob_id, is_lfs, lfs_pointer


@dataclass(frozen=True)
class CachedRepo:
    cache: Path
    storage: Path
    commit: str
    snapshot: Path

    def blob_of(self, rel: str) -> Path:
        return Path(os.path.realpath(self.snapshot / rel))


def write_cache(cache: Path, repo: str, model: Path, *, commit: str = "c0ffee" + "0" * 34,
                with_listing: bool = True) -> CachedRepo:
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    for d in (storage / "blobs", snapshot, storage / "refs"):
        d.mkdir(parents=True, exist_ok=True)
    files = {}
    for f in sorted(model.iterdir()):
        data = f.read_bytes()
        name = hashlib.sha256(data).hexdigest() if is_lfs(f.name) else git_blob_id(data)
        (storage / "blobs" / name).write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(storage / "blobs" / name, snapshot))
        files[f.name] = ({"size": len(data), "blob_id": git_blob_id(lfs_pointer(data)), "lfs_sha256": name,
                          "lfs_size": len(data)} if is_lfs(f.name) else {"size": len(data), "blob_id": name})
    (storage / "refs" / "main").write_text(commit)
    if with_listing:
        (storage / "trees").mkdir(exist_ok=True)
        (storage / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": files}))
    return CachedRepo(cache, storage, commit, snapshot)


def cluster_file(folder: Path, extra_nodes: str = "") -> Path:
    """cluster.toml of one local node ``a`` (runtime dir under ``folder``), then ``extra_nodes`` as written."""
    path = folder / "cluster.toml"
    path.write_text(f"""
[cluster]
name = "h"
[[node]]
name = "a"
local = true
memory_gb = 4
ips = ["127.0.0.1"]
runtime_dir = "{folder}/run-a"
{extra_nodes}""")
    return path


def plan_offline(monkeypatch, cache: Path, toml: Path, state: Path, model: str) -> CliResult:
    """``clusterctl plan -m MODEL --json`` in this process, the hub cache at ``cache`` and no network."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return run_cli(["plan", "-c", str(toml), "-m", model, "--context", "256", "--json"],
                   env={"CLUSTERCTL_STATE_DIR": str(state), "HF_HUB_OFFLINE": "1"})


def one_error_line(r: CliResult) -> str:
    """The refusal's one line (besides hints): exit neither 0 nor 70, no traceback."""
    assert r.code not in (0, 70), (r.code, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip() and not x.lstrip().startswith("hint:")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]
