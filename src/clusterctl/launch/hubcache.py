"""What ``plan --model ORG/NAME`` trusts of the hub cache on disk (``models--ORG--NAME/``), and how it checks it.

Whoever can write the cache chooses the weights, so it is held to the state dir's rule (``atomic.unsafe_folder``):
every folder of the repository's cache (and the cache itself) must belong to this user and be writable by no one
else, and no folder in it may be a symlink. A ref (``refs/<branch>``) must be a regular file holding a 40-hex
commit: the library uses its text as a path. And the content is checked from what is on disk, not from earlier
hashes: every file of the snapshot links to ``blobs/<hash>`` (the library names a blob by the hash the hub sent:
SHA-256 for LFS files, the git blob id for the others), its bytes are hashed again and must match that name and,
where the library kept it, the commit's file listing (``trees/<commit>.json``).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from clusterctl.atomic import read_capped, read_json, unsafe_folder
from clusterctl.errors import ClusterctlError, ConfigError, IntegrityError
from clusterctl.modelfiles.manifest import Found, HashCache, hash_files, scan

COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
GIT_BLOB_MAX = 64 << 20  # the hub keeps non-LFS files small (configs, tokenizers); a bigger git blob is refused
LISTING_MAX = 64 << 20


@dataclass(frozen=True)
class Expected:
    """What one file's bytes must hash to: SHA-256 (LFS files) or the git blob id (the others)."""

    sha256: str | None = None
    git_blob: str | None = None


def repo_folder(cache: str | os.PathLike, repo: str) -> Path:
    return Path(cache) / ("models--" + repo.replace("/", "--"))


def check_folders(cache: Path, storage: Path) -> None:
    """Refuse a cache others may write into (as ``StateDir.check_safe`` does): the cache folder, and every folder
    of the repository's cache, owned by this user, not group/world-writable, not a symlink (the cache folder
    itself may be one). The files of ``refs/`` and ``trees/`` must be regular files: the library opens them."""
    for p in (cache, storage):
        _check_folder(p, link_ok=p == cache)
    if not os.path.isdir(storage):
        return
    for top, dirs, files in os.walk(storage, onerror=_walk_error):
        for d in dirs:
            _check_folder(Path(top, d))
        if Path(top).relative_to(storage).parts[:1] in (("refs",), ("trees",)):
            for f in files:
                if not stat.S_ISREG(os.lstat(os.path.join(top, f)).st_mode):
                    raise IntegrityError(f"hub cache {os.path.join(top, f)} is not a regular file",
                                         hint="remove it; a plan with the hub reachable writes it again")


def _check_folder(p: Path, *, link_ok: bool = False) -> None:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError(f"cannot use hub cache {p}: {e.strerror or e}") from None
    if stat.S_ISLNK(st.st_mode) and not link_ok:
        raise ConfigError(f"hub cache {p} is a symlink", hint="replace it with a folder")
    if not stat.S_ISDIR(os.stat(p).st_mode if link_ok else st.st_mode):
        raise ConfigError(f"hub cache {p} is not a folder")
    why = unsafe_folder(p)
    if why:
        raise ConfigError(f"hub cache {p} cannot be used: {why}", hint="use a cache of your own (HF_HUB_CACHE)")


def _walk_error(e: OSError) -> None:
    raise ConfigError(f"cannot use hub cache {e.filename}: {e.strerror or e}")


def read_ref(storage: Path, revision: str) -> str | None:
    """The commit ``refs/<revision>`` names, or None when there is no such ref; refused unless it is a regular
    file holding exactly 40 hex digits (the library would use any text there as a path)."""
    if COMMIT.fullmatch(revision):
        return revision
    path = storage / "refs" / revision
    if not os.path.lexists(path):
        return None
    data = read_capped(path, limit=4096, what="hub cache ref")  # never a symlink, a FIFO or a folder
    text = data.decode("ascii", "replace")
    if not COMMIT.fullmatch(text):
        raise IntegrityError(f"hub cache ref {path} does not hold a commit (40 hex digits): {text[:60]!r}",
                             hint="remove it; a plan with the hub reachable writes it again")
    return text


def snapshot_commit(storage: Path, folder: Path) -> str:
    """The commit of the snapshot folder the library returned: ``snapshots/<40 hex>`` of this repository."""
    commit = folder.name
    if not COMMIT.fullmatch(commit) or os.path.abspath(folder.parent) != os.path.abspath(storage / "snapshots"):
        raise IntegrityError(f"hub cache snapshot {folder} is not a commit of {storage}")
    if os.path.islink(folder) or not folder.is_dir():
        raise ConfigError(f"hub cache snapshot {folder} is a symlink or not a folder", hint="remove it")
    return commit


def listing(storage: Path, commit: str) -> dict[str, Expected] | None:
    """The commit's file listing as the library cached it (``trees/<commit>.json``), read tolerantly: None when it
    is missing or unreadable (the blobs' names are checked anyway)."""
    path = storage / "trees" / f"{commit}.json"
    if not os.path.lexists(path):
        return None
    try:
        doc = read_json(path, limit=LISTING_MAX, what="hub cache listing")
        files = doc["files"] if isinstance(doc, dict) and doc.get("format_version") == 1 else None
    except (ClusterctlError, RecursionError):
        return None
    if not isinstance(files, dict):
        return None
    out = {}
    for rel, info in files.items():
        if not isinstance(info, dict):
            return None
        sha, blob = info.get("lfs_sha256"), info.get("blob_id")
        out[rel] = Expected(sha256=sha) if isinstance(sha, str) else Expected(
            git_blob=blob if isinstance(blob, str) else None)
    return out


def expected_of(storage: Path, folder: Path, f: Found, listed: dict[str, Expected] | None) -> Expected:
    """What ``f``'s bytes must hash to, from its blob's name and the listing; refused when they disagree or when
    nothing names a hash (a plain file in the snapshot and no listing)."""
    where = f"{folder.name[:12]}: {f.rel}"
    by_name = Expected()
    if os.path.islink(folder / f.rel):
        blob = Path(f.path)
        if os.path.abspath(blob.parent) != os.path.abspath(Path(storage, "blobs").resolve()):
            raise IntegrityError(f"hub cache {where} does not link to the repository's own blobs/")
        if _SHA256.fullmatch(blob.name):
            by_name = Expected(sha256=blob.name)
        elif COMMIT.fullmatch(blob.name):
            by_name = Expected(git_blob=blob.name)
        else:
            raise IntegrityError(f"hub cache {where} links to blob {blob.name[:80]!r}, which is not named by a hash")
    entry = (listed or {}).get(f.rel)
    if entry is not None and (entry.sha256 or entry.git_blob):
        if (by_name.sha256 or by_name.git_blob) and by_name != entry:
            raise IntegrityError(f"hub cache {where} links to a blob the commit's listing does not name for it")
        return entry
    if not (by_name.sha256 or by_name.git_blob):
        raise IntegrityError(f"hub cache {where} cannot be checked: not linked to a blob named by its hash, and "
                             "the commit's listing does not name it", hint="remove the snapshot and plan again")
    return by_name


def check_content(repo: str, storage: Path, folder: Path) -> None:
    """Every file of the snapshot hashed from disk against its expected hash; a wrong one is removed from the
    cache (its link and its blob). The SHA-256s go to the hash cache, so the manifest reads no file again."""
    commit = folder.name
    listed = listing(storage, commit)
    found, _ = scan(folder)
    want = {f.rel: expected_of(storage, folder, f, listed) for f in found}
    cache = HashCache()
    # use_cache=False: an earlier hash of a file whose bytes were rewritten in place (size and mtime kept) is no
    # proof; the fresh digests replace the cache's entries
    digests = hash_files([f for f in found if want[f.rel].sha256], cache, use_cache=False)
    cache.save()
    for f in found:
        w = want[f.rel]
        if w.sha256:
            ok = digests[f.rel] == w.sha256
        else:
            ok = f.size <= GIT_BLOB_MAX and git_blob_id(Path(f.path)) == w.git_blob
        if not ok:
            _drop(storage, folder / f.rel)
            raise IntegrityError(f"{repo}@{commit[:12]}: {f.rel} holds bytes that do not match the hub's hash; "
                                 "removed from the cache", hint="run the plan again to download it again")


def git_blob_id(path: Path) -> str:
    data = read_capped(path, limit=GIT_BLOB_MAX, what="hub cache file", follow_symlinks=True)
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _drop(storage: Path, link: Path) -> None:
    """The snapshot's link and the blob it points at, when that blob is this repository's: the next download
    fetches the file again. Nothing outside the repository's cache is touched."""
    blob = link.resolve()
    link.unlink(missing_ok=True)
    if blob.parent == Path(storage, "blobs").resolve() and blob.is_file():
        blob.unlink(missing_ok=True)
