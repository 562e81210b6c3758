"""Model manifests: every file of a model folder with its size and SHA-256, and one hash over them all.

Which files count (docs/sync.md):
- regular files anywhere below the folder, by their path relative to it (``/``-separated);
- hidden files and folders (a name starting with ``.``) are left out: rsync's partial folder, editors' and
  hub clients' scratch files, ``.git``;
- partial downloads (``*.incomplete``, ``*.tmp``, ``*.part``, ``*.partial``) are left out and listed as such;
- a symlink to a file inside the folder counts as that file's content under the link's name (so does a hub cache
  snapshot's link into its repository's ``blobs/``); a symlink with an absolute target, or one that leads
  outside the folder, or to a folder, is refused, as is any other kind of
  file (fifo, socket, device): a manifest never vouches for bytes that live elsewhere.

The manifest hash covers the sorted (path, size, sha256) triples only: the folder's own path, the model name
and file times never change it, so the same model at different paths on different nodes has one hash.

Hashes are cached per machine, keyed by (absolute path, size, mtime_ns, inode): a second run over an unchanged
folder reads no file. Files are hashed several at a time on threads (hashlib releases the GIL).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from clusterctl.errors import CannotWrite, ClusterctlError, Exit, IntegrityError, MissingInput, pydantic_line
from clusterctl.atomic import atomic_write_bytes, dumps, move_aside, read_json
from clusterctl.locks import locked

SCHEMA_VERSION = 1
PARTIAL_PATTERNS = ("*.incomplete", "*.tmp", "*.part", "*.partial")
CHUNK = 1 << 20
ENV_CACHE_DIR = "CLUSTERCTL_CACHE_DIR"
MAX_FILES = 100_000


class ManifestRefused(ClusterctlError):
    """The folder holds something a manifest cannot vouch for (a path escaping it, a special file)."""

    exit_code = Exit.DATAERR

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message, hint=hint or "copy the model into a plain folder with the links resolved "
                                               "(`cp -rL SRC DEST`) and use that one (docs/sync.md)")


class FileHash(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1] = SCHEMA_VERSION
    type: Literal["model-manifest"] = "model-manifest"
    name: str
    total_bytes: int
    files: list[FileHash]
    manifest_hash: str
    skipped: list[str] = Field(default_factory=list)  # partial downloads left out (informative, not hashed)

    def by_path(self) -> dict[str, FileHash]:
        return {f.path: f for f in self.files}


def manifest_hash(files: list[FileHash]) -> str:
    rows = sorted([f.path, f.size, f.sha256] for f in files)
    blob = json.dumps(rows, separators=(",", ":"), ensure_ascii=True).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def check_manifest(doc, source: str = "manifest") -> Manifest:
    """A manifest read from a file or a node, with its hash re-computed (a tampered file list is an error)."""
    try:
        m = Manifest.model_validate(doc)
    except ValidationError as e:
        raise IntegrityError(f"{source}: not a model manifest ({pydantic_line(e, 'document')})") from None
    if manifest_hash(m.files) != m.manifest_hash:
        raise IntegrityError(f"{source}: manifest hash does not match its file list (tampered or damaged)")
    paths = [f.path for f in m.files]
    if len(set(paths)) != len(paths) or any(not _safe_rel(p) for p in paths):
        raise IntegrityError(f"{source}: manifest lists a duplicate or unsafe path")
    return m


def _safe_rel(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and all(p not in ("", ".", "..") for p in parts) \
        and "\0" not in rel and "\\" not in rel


# ---------------------------------------------------------------------------------------------------- the walk

@dataclass(frozen=True)
class Found:
    rel: str
    path: str  # absolute path whose bytes are hashed (a symlink's target)
    size: int
    mtime_ns: int
    inode: int


def is_partial(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in PARTIAL_PATTERNS)


def scan(folder: str | os.PathLike) -> tuple[list[Found], list[str]]:
    """(files that count, partial downloads left out), sorted by relative path; refuses escaping symlinks."""
    root = Path(folder)
    try:
        real_root = root.resolve(strict=True)
        if not real_root.is_dir():
            raise MissingInput(f"model folder {folder} is not a folder")
    except FileNotFoundError:
        raise MissingInput(f"model folder {folder} does not exist") from None
    except OSError as e:
        raise MissingInput(f"cannot read model folder {folder}: {e.strerror or e}") from None
    found: list[Found] = []
    skipped: list[str] = []

    def walk(d: Path, prefix: str) -> None:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            raise MissingInput(f"cannot list {d}: {e.strerror or e}") from None
        for e in entries:
            rel = prefix + e.name
            if e.name.startswith("."):
                continue
            if "\\" in e.name or any(ord(c) < 32 for c in e.name):
                raise ManifestRefused(f"{folder}: file name {rel!r} has control characters or backslashes")
            if e.is_symlink():
                found.append(_symlink(root, real_root, Path(e.path), rel, folder))
                continue
            st = e.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                walk(Path(e.path), rel + "/")
            elif stat.S_ISREG(st.st_mode):
                if is_partial(e.name):
                    skipped.append(rel)
                else:
                    found.append(Found(rel, e.path, st.st_size, st.st_mtime_ns, st.st_ino))
            else:
                raise ManifestRefused(f"{folder}: {rel} is not a regular file (fifo, socket or device)")
            if len(found) > MAX_FILES:
                raise ManifestRefused(f"{folder}: more than {MAX_FILES} files; is this a model folder?")

    walk(real_root, "")
    return found, skipped


def _symlink(root: Path, real_root: Path, link: Path, rel: str, folder) -> Found:
    target = os.readlink(link)
    if os.path.isabs(target):
        raise ManifestRefused(f"{folder}: symlink {rel} -> {target} has an absolute target (refused: it leaves "
                              "the folder on another node)")
    try:
        real = link.resolve(strict=True)
    except (FileNotFoundError, RuntimeError):
        raise ManifestRefused(f"{folder}: symlink {rel} -> {target} is broken or loops") from None
    if real_root not in real.parents and not _in_hub_blobs(real_root, real):
        raise ManifestRefused(f"{folder}: symlink {rel} -> {target} leads outside the model folder")
    st = real.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ManifestRefused(f"{folder}: symlink {rel} -> {target} does not point at a regular file")
    return Found(rel, str(real), st.st_size, st.st_mtime_ns, st.st_ino)


def _in_hub_blobs(real_root: Path, real: Path) -> bool:
    """A hub cache snapshot (``models--ORG--NAME/snapshots/<commit>/``) links its files to the repository's own
    ``blobs/``: those bytes belong to the snapshot (sync copies them as plain files; docs/sync.md)."""
    repo = real_root.parent.parent
    return (real_root.parent.name == "snapshots" and repo.name.startswith("models--")
            and real.parent == repo / "blobs")


# ---------------------------------------------------------------------------------------------------- hashing

def sha256_file(path: str, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            n = os.readv(fd, [buf])
            if not n:
                break
            h.update(view[:n])
            if progress:
                progress(n)
    finally:
        os.close(fd)
    return h.hexdigest()


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def hash_files(found: list[Found], cache: "HashCache | None", *, use_cache: bool = True, workers: int = 0,
               progress: Callable[[int], None] | None = None) -> dict[str, str]:
    """rel -> sha256 for every file, from the cache where (path, size, mtime_ns, inode) still match."""
    out: dict[str, str] = {}
    todo: list[Found] = []
    for f in found:
        hit = cache.get(f) if (cache is not None and use_cache) else None
        if hit:
            out[f.rel] = hit
        else:
            todo.append(f)
    lock = threading.Lock()

    def one(f: Found) -> tuple[Found, str]:
        try:
            digest = sha256_file(f.path, progress)
        except FileNotFoundError:
            raise MissingInput(f"{f.path} disappeared while it was hashed") from None
        except OSError as e:
            raise MissingInput(f"cannot read {f.path}: {e.strerror or e}") from None
        if cache is not None:
            with lock:
                cache.put(f, digest)
        return f, digest

    # largest first, so one big file does not start last and run alone
    todo.sort(key=lambda f: -f.size)
    n = workers or default_workers()
    if len(todo) <= 1 or n == 1:
        results = [one(f) for f in todo]
    else:
        with ThreadPoolExecutor(max_workers=min(n, len(todo)), thread_name_prefix="hash") as pool:
            results = list(pool.map(one, todo))
    for f, digest in results:
        out[f.rel] = digest
    return out


def build_manifest(folder: str | os.PathLike, *, name: str | None = None, cache: "HashCache | None" = None,
                   use_cache: bool = True, workers: int = 0,
                   progress: Callable[[int], None] | None = None) -> Manifest:
    found, skipped = scan(folder)
    digests = hash_files(found, cache, use_cache=use_cache, workers=workers, progress=progress)
    if cache is not None:
        cache.save()
    files = [FileHash(path=f.rel, size=f.size, sha256=digests[f.rel]) for f in found]
    return Manifest(name=name or Path(folder).resolve().name, total_bytes=sum(f.size for f in files),
                    files=files, manifest_hash=manifest_hash(files), skipped=skipped)


# ---------------------------------------------------------------------------------------------------- the cache

def default_cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("clusterctl", appauthor=False))


class HashCache:
    """(path, size, mtime_ns, inode) -> sha256, one JSON file per machine, written atomically and merged under a
    lock so two runs never lose each other's entries. A damaged cache is moved aside and rebuilt (it only saves
    time; nothing in it is trusted beyond the key it was stored under)."""

    def __init__(self, folder: str | os.PathLike | None = None):
        self.folder = Path(folder) if folder else default_cache_dir()
        self.path = self.folder / "hashes.json"
        self._entries: dict[str, list] = {}
        self._new: dict[str, list] = {}
        self.warning: str | None = None
        self._entries = self._read()

    def _read(self) -> dict[str, list]:
        if not self.path.exists():
            return {}
        try:
            doc = read_json(self.path, limit=256 << 20, what="hash cache")
            if not isinstance(doc, dict) or doc.get("schema_version") != 1 or not isinstance(doc.get("entries"), dict):
                raise IntegrityError(f"{self.path}: not a hash cache")
            return {k: v for k, v in doc["entries"].items() if _valid_entry(v)}
        except (IntegrityError, MissingInput) as e:
            try:
                moved = move_aside(self.path, "corrupt")
                self.warning = f"hash cache {self.path} was damaged ({e.message}); moved to {moved.name}, rebuilding"
            except OSError:
                self.warning = f"hash cache {self.path} is damaged ({e.message}); not used"
            return {}

    def get(self, f: Found) -> str | None:
        e = self._new.get(f.path) or self._entries.get(f.path)
        if e and e[0] == f.size and e[1] == f.mtime_ns and e[2] == f.inode:
            return e[3]
        return None

    def put(self, f: Found, digest: str) -> None:
        self._new[f.path] = [f.size, f.mtime_ns, f.inode, digest]

    def save(self) -> None:
        """Merge new entries into the file (re-read under the lock); a cache that cannot be written is skipped."""
        if not self._new:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with locked(self.folder / "hashes.lock", blocking=True, what="hash cache"):
                merged = self._read()
                merged.update(self._new)
                blob = json.dumps({"schema_version": 1, "entries": merged}, separators=(",", ":")).encode()
                atomic_write_bytes(self.path, blob, mode=0o600)
            self._entries, self._new = merged, {}
        except (OSError, CannotWrite, ClusterctlError) as e:
            self.warning = f"hash cache not saved: {getattr(e, 'message', None) or e}"


def _valid_entry(v) -> bool:
    return (isinstance(v, list) and len(v) == 4 and all(isinstance(x, int) and not isinstance(x, bool) for x in v[:3])
            and isinstance(v[3], str) and len(v[3]) == 64)


# ---------------------------------------------------------------------------------------------------- stored

def manifest_file(folder: Path, digest: str) -> Path:
    return folder / f"{digest.removeprefix('sha256:')}.json"


def save_manifest(folder: Path, m: Manifest) -> Path:
    """Store ``m`` content-addressed (``<hex of its hash>.json``); an existing file of that name is the same."""

    path = manifest_file(folder, m.manifest_hash)
    if load_manifest(folder, m.manifest_hash) is None:  # content-addressed: an intact file is already this one
        atomic_write_bytes(path, dumps(m.model_dump(mode="json")))
    return path


def load_manifest(folder: Path, digest: str) -> Manifest | None:
    """The stored manifest with this hash, re-checked; None when there is none (or it is damaged)."""

    path = manifest_file(folder, digest)
    if not path.is_file():
        return None
    try:
        m = check_manifest(read_json(path, limit=64 << 20, what="model manifest"), str(path))
    except ClusterctlError:
        return None
    return m if m.manifest_hash == digest else None
