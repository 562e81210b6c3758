"""Durable file writes and careful reads of state files.

Writes: temp file in the same folder (O_EXCL), write, fsync, rename, fsync the folder. A reader never sees a
half-written file and a crash never leaves the old one damaged.

Reads of state files: no symlinks followed, regular files only, size capped, and JSON parsed strictly
(no duplicate keys, no NaN/Infinity, bounded nesting) so a hostile or truncated file gives a clear error.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Any

from clusterctl.errors import CannotWrite, IntegrityError, MissingInput

MAX_STATE_BYTES = 8 * 1024 * 1024


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def private_dirs(folder: str | os.PathLike, mode: int = 0o700) -> Path:
    """Create ``folder`` and any missing parents, each new one with ``mode`` (``mkdir -p`` would give the missing
    parents the umask's 0755); folders that exist are left as they are."""
    folder = Path(folder)
    missing = []
    p = folder
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            pass
    return folder


def unsafe_folder(path: str | os.PathLike) -> str | None:
    """Why a folder that holds contracts, trusted keys or state must not be used, or None: it belongs to another
    user, or others may write into it (they could plant a trusted key or a launch manifest)."""
    st = os.stat(path)
    if st.st_uid != os.getuid():
        return f"it belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"other users may write into it (mode {st.st_mode & 0o777:04o}); chmod go-w {path}"
    return None


class Staged:
    """A replacement written and fsynced beside ``path`` but not yet in place: ``commit()`` renames it over the
    old file (no new space needed then), ``discard()`` removes it. For a write that must not fail after a step
    that cannot be undone (replan writes the new deployment before it stops the old job)."""

    def __init__(self, path: Path, tmp: Path):
        self.path, self.tmp = path, tmp

    def commit(self) -> None:
        try:
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.discard()
            raise CannotWrite(f"cannot write {self.path}: {e.strerror or e}") from None
        fsync_dir(self.path.parent)

    def discard(self) -> None:
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


def stage_bytes(path: str | os.PathLike, data: bytes, *, mode: int = 0o600) -> Staged:
    """Write ``data`` to a temp file beside ``path`` (fsynced, ``mode``); on failure nothing is left behind."""
    path = Path(path)
    folder = path.parent
    try:
        private_dirs(folder)
    except OSError as e:
        raise CannotWrite(f"cannot create folder {folder}: {e.strerror or e}") from None
    tmp = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as e:
        raise CannotWrite(f"cannot write {path}: {e.strerror or e}") from None
    staged = Staged(path, tmp)
    try:
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
    except OSError as e:
        staged.discard()
        raise CannotWrite(f"cannot write {path}: {e.strerror or e}") from None
    return staged


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` atomically; on any failure the old file is left as it was. clusterctl's
    files are private by default (0600, new folders 0700): state files, node files, markers, leases."""
    stage_bytes(path, data, mode=mode).commit()


def dumps(obj: Any) -> bytes:
    """The one pretty JSON form of clusterctl's own files (stable key order as given, trailing newline)."""
    return (json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode()


def atomic_write_json(path: str | os.PathLike, obj: Any, *, mode: int = 0o600) -> None:
    atomic_write_bytes(path, dumps(obj), mode=mode)


def open_regular(path: str | os.PathLike, *, what: str = "file",
                 follow_symlinks: bool = False) -> tuple[int, os.stat_result]:
    """Open a regular file for reading: (descriptor, its stat). Never blocks on a FIFO and never returns one, a
    device or a folder (IntegrityError); a symlink is refused unless ``follow_symlinks``; a missing file is
    MissingInput. The caller closes the descriptor."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise MissingInput(f"{what} not found: {path}") from None
    except OSError as e:
        raise IntegrityError(f"cannot open {what} {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise IntegrityError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise IntegrityError(f"{what} {path} is not a regular file")
    return fd, st


def read_capped(path: str | os.PathLike, *, limit: int = MAX_STATE_BYTES, what: str = "file",
                follow_symlinks: bool = False) -> bytes:
    """Read a regular file (never a FIFO, device or folder), refusing anything larger than ``limit``. A symlink
    is refused unless ``follow_symlinks`` (model folders: caches link their files to blobs)."""
    fd, st = open_regular(path, what=what, follow_symlinks=follow_symlinks)
    try:
        if st.st_size > limit:
            raise IntegrityError(f"{what} {path} is too large ({st.st_size} bytes, limit {limit})")
        chunks = []
        total = 0
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            total += len(b)
            if total > limit:
                raise IntegrityError(f"{what} {path} is too large (limit {limit} bytes)")
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON here")


def strict_loads(data: bytes | str, *, source: str = "input") -> Any:
    """Parse JSON strictly: duplicate keys, NaN/Infinity, overflowing floats and deep nesting are errors."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except UnicodeDecodeError:
        raise IntegrityError(f"{source} is not UTF-8 text", damaged=True) from None
    except RecursionError:
        raise IntegrityError(f"{source} is nested too deeply", damaged=True) from None
    except json.JSONDecodeError as e:
        raise IntegrityError(f"{source} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                             damaged=True) from None
    except ValueError as e:
        raise IntegrityError(f"{source} is not valid JSON ({e})", damaged=True) from None
    _reject_inf(obj, source)
    return obj


def _reject_inf(obj: Any, source: str, depth: int = 0) -> None:
    # json turns 1e400 into inf without calling parse_constant
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, float) and (o != o or o in (float("inf"), float("-inf"))):
            raise IntegrityError(f"{source} is not valid JSON (a number is out of range)", damaged=True)
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)


def read_json(path: str | os.PathLike, *, limit: int = MAX_STATE_BYTES, what: str = "file") -> Any:
    return strict_loads(read_capped(path, limit=limit, what=what), source=f"{what} {path}")


def move_aside(path: str | os.PathLike, reason: str = "corrupt") -> Path:
    """Move a damaged state file out of the way (never delete it) and return where it went."""
    path = Path(path)
    dest = path.with_name(f"{path.name}.{reason}-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(2)}")
    os.replace(path, dest)
    fsync_dir(path.parent)
    return dest


def clean_stale_folders(dest: str | os.PathLike) -> None:
    """Remove the temp folders (``.<name>.tmp-<pid>-…``, ``.<name>.old-<pid>-…``) that builds of ``dest`` killed
    part-way left beside it: those whose pid is gone. A folder of a build still running is left alone."""
    import shutil

    dest = Path(dest)
    for prefix in (f".{dest.name}.tmp-", f".{dest.name}.old-"):
        for d in dest.parent.glob(prefix + "*"):
            try:
                pid = int(d.name[len(prefix):].split("-", 1)[0])
                os.kill(pid, 0)
            except ValueError:
                continue
            except ProcessLookupError:
                shutil.rmtree(d, ignore_errors=True)
            except PermissionError:
                continue
