"""Download mode, the node side: fetch model files from an HTTP(S) mirror straight into the node's model folder.

``<url>/<relative path>`` per manifest file (a hub's "resolve" URL or any static server of the folder). Each file
goes to ``<folder>/.clusterctl-partial/<path>`` first, resumes there with a Range request after an interruption,
is checked against the manifest's size and SHA-256, fsynced, then renamed into place: a failed or interrupted
download never leaves a wrong file under a real name, and files already right are never touched.
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from clusterctl.atomic import fsync_dir
from clusterctl.modelfiles.manifest import CHUNK, Manifest

PARTIAL_DIR = ".clusterctl-partial"


def _url_for(base: str, rel: str) -> str:
    return base.rstrip("/") + "/" + "/".join(urllib.parse.quote(p) for p in rel.split("/"))


def _resume_hash(path: Path) -> tuple[hashlib._Hash, int]:
    h = hashlib.sha256()
    done = 0
    if path.exists():
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                done += len(chunk)
    return h, done


def fetch_one(base: str, folder: Path, rel: str, size: int, sha256: str, *, timeout: float) -> int:
    """Download one file (resuming a partial one); returns the bytes transferred. Raises OSError/ValueError."""
    part = folder / PARTIAL_DIR / rel
    part.parent.mkdir(parents=True, exist_ok=True)
    h, done = _resume_hash(part)
    if done > size:  # not a prefix of this file: start over
        part.unlink()
        h, done = hashlib.sha256(), 0
    got = 0
    if done < size:
        req = urllib.request.Request(_url_for(base, rel), headers={"Range": f"bytes={done}-"} if done else {})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if done and resp.status != 206:  # the mirror ignored the range: take the whole file again
                h, done = hashlib.sha256(), 0
                mode = "wb"
            else:
                mode = "ab"
            with open(part, mode) as out:
                while chunk := resp.read(CHUNK):
                    out.write(chunk)
                    h.update(chunk)
                    done += len(chunk)
                    got += len(chunk)
                    if done > size:
                        break
                out.flush()
                os.fsync(out.fileno())
    if done != size or h.hexdigest() != sha256:
        part.unlink(missing_ok=True)
        raise ValueError(f"{rel}: the mirror sent {done} bytes that do not match the manifest "
                         f"(expected {size} bytes, sha256 {sha256[:12]}...)")
    dest = folder / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, dest)
    fsync_dir(dest.parent)
    return got


def fetch_files(base: str, folder: str, expected: Manifest, files: list[str], *, timeout: float = 60.0) -> dict:
    """Fetch the listed manifest files; per file ``done`` or an error, never raising for one file's failure."""
    want = expected.by_path()
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    done, failed, transferred = [], [], 0
    for rel in files:
        entry = want.get(rel)
        if entry is None:
            failed.append({"path": rel, "error": "not in the manifest"})
            continue
        try:
            transferred += fetch_one(base, root, rel, entry.size, entry.sha256, timeout=timeout)
            done.append(rel)
        except urllib.error.HTTPError as e:
            failed.append({"path": rel, "error": f"HTTP {e.code} {e.reason} for {_url_for(base, rel)}"})
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or e
            failed.append({"path": rel, "error": str(reason)})
            if isinstance(e, OSError) and getattr(e, "errno", None) == 28:  # ENOSPC: the rest cannot fit either
                break
    try:
        (root / PARTIAL_DIR).rmdir()  # only when empty: a partial file stays for the next resume
    except OSError:
        pass
    return {"done": done, "failed": failed, "bytes": transferred}
