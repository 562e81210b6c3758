"""Is the model copy at this path the planned one? Runs where the copy is (on the node, through nodeops).

States: ``ok`` (every manifest file present with its size and hash), ``missing`` (no folder, or none of the
files), ``partial`` (some files absent, the present ones right), ``stale`` (a file of the wrong size or hash).
Files the manifest does not list are ignored (and counted). Quick mode compares sizes, then hashes through this
machine's cache, so a copy verified once (by ``sync``) is checked again without reading it; ``verify`` re-hashes
every file and ignores the cache.
"""

from __future__ import annotations

import os
from pathlib import Path

from clusterctl.errors import ClusterctlError
from clusterctl.modelfiles.manifest import Found, HashCache, Manifest, hash_files, scan


def check_copy(expected: Manifest, folder: str, *, verify: bool = False, cache: HashCache | None = None,
               only: list[str] | None = None) -> dict:
    """``only``: check just these paths (after a transfer), the rest is taken as checked before."""
    out: dict = {"path": folder, "expected_hash": expected.manifest_hash, "missing": [], "stale": [],
                 "extra": 0, "checked_bytes": 0}
    if not os.path.isdir(folder):
        out.update(state="missing", detail=f"{folder} does not exist", n_missing=len(expected.files), n_stale=0)
        return out
    try:
        found, _skipped = scan(folder)
    except ClusterctlError as e:
        out.update(state="stale", detail=e.message, n_missing=0, n_stale=len(expected.files))
        return out
    have = {f.rel: f for f in found}
    want = expected.by_path()
    out["extra"] = len(set(have) - set(want))
    wanted = set(want) if only is None else set(only) & set(want)
    names = sorted(wanted)
    missing = [p for p in names if p not in have]
    present = [p for p in names if p in have]
    wrong_size = {p for p in present if have[p].size != want[p].size}
    to_hash: list[Found] = [have[p] for p in present if p not in wrong_size]
    digests = hash_files(to_hash, cache, use_cache=not verify)
    if cache is not None:
        cache.save()
    out["checked_bytes"] = sum(f.size for f in to_hash)
    stale = sorted(wrong_size | {p for p in digests if digests[p] != want[p].sha256})
    if stale:
        state = "stale"
    elif missing and len(missing) == len(want):
        state = "missing"
    elif missing:
        state = "partial"
    else:
        state = "ok"
    out.update(state=state, n_missing=len(missing), n_stale=len(stale), missing=missing, stale=stale)
    if cache is not None and cache.warning:
        out["warning"] = cache.warning
    return out


def needed_files(expected: Manifest, status: dict) -> list[str]:
    """The paths a sync must send to a node in this state."""
    if status.get("state") == "ok":
        return []
    if not status.get("missing") and not status.get("stale"):  # no folder, or a folder that cannot be read
        return [f.path for f in expected.files]
    return sorted(set(status.get("missing", [])) | set(status.get("stale", [])))


def free_bytes(folder: str) -> int | None:
    """Free space where ``folder`` is (or would be created)."""
    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def local_rsync() -> tuple[str | None, str | None]:
    """(path, first line of --version) of this machine's rsync; (None, None) when it is not installed. The
    coordinator asks it of itself, a node of itself (nodeops), to choose rsync's options on both sides."""
    import shutil
    import subprocess

    path = shutil.which("rsync")
    if not path:
        return None, None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return path, None
    return path, (out.splitlines() or [""])[0]
