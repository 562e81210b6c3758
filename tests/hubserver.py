"""A local stand-in for the Hugging Face hub: the few routes huggingface_hub's snapshot_download calls.

- ``GET /api/models/{org}/{name}/revision/{rev}``: the commit (``sha``) a branch, tag or commit names;
- ``GET /api/models/{org}/{name}/tree/{commit}``: every file with its size, git blob id and, for weights, its LFS
  SHA-256;
- ``HEAD`` / ``GET /{org}/{name}/resolve/{commit}/{path}``: the file, with ``X-Repo-Commit``, ``ETag`` (the LFS
  SHA-256 or the git blob id, as the hub sends) and its size.

Errors carry the hub's ``X-Error-Code`` header (RepoNotFound, RevisionNotFound, GatedRepo), which is what the
library turns into its typed exceptions. Every request is counted by (method, path) so a test can tell what was
downloaded twice. ``corrupt[(repo, path)]`` serves other bytes for a file than the tree lists.
"""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from testports import free_port


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    """The text git stores for an LFS file (git-lfs's pointer format)."""
    return (b"version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize %d\n"
            % (hashlib.sha256(data).hexdigest().encode(), len(data)))


def is_lfs(path: str) -> bool:
    return path.endswith(".safetensors")


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> path -> bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    gated_token: str | None = None  # set: only this bearer token may read the repository


class FakeHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.corrupt: dict[tuple[str, str], bytes] = {}
        self.requests: Counter = Counter()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                hub._answer(self, body=True)

            def do_HEAD(self):
                hub._answer(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    # ---- content ----
    def add(self, repo_id: str, folder: Path, *, commit_seed: str = "", branch: str = "main",
            tags: tuple[str, ...] = ()) -> str:
        """Publish the files of ``folder`` as a new commit of ``repo_id`` on ``branch``; returns the commit."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        digest = hashlib.sha1(json.dumps(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in files.items()))
                              .encode() + commit_seed.encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, Repo())
        repo.commits[digest] = files
        repo.refs[branch] = digest
        for t in tags:
            repo.refs[t] = digest
        return digest

    def downloads(self, repo_id: str) -> Counter:
        """GETs of each file of the repository (any commit)."""
        out = Counter()
        for (method, path), n in self.requests.items():
            prefix = f"/{repo_id}/resolve/"
            if method == "GET" and path.startswith(prefix):
                out[path[len(prefix):].split("/", 1)[1]] += n
        return out

    # ---- serving ----
    def _answer(self, h: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(h.path).path)
        self.requests[(h.command, path)] += 1
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo_id, what, rev = f"{parts[2]}/{parts[3]}", parts[4], "/".join(parts[5:])
            api = True
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo_id, what, rev, rel = f"{parts[0]}/{parts[1]}", "resolve", parts[3], "/".join(parts[4:])
            api = False
        else:
            return self._send(h, 404, b"{}", body=body)
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._send(h, 404, b'{"error":"Repository not found"}', code="RepoNotFound", body=body)
        if repo.gated_token is not None and h.headers.get("Authorization") != f"Bearer {repo.gated_token}":
            return self._send(h, 401, b'{"error":"Access to model is restricted"}', code="GatedRepo", body=body)
        commit = repo.refs.get(rev, rev if rev in repo.commits else None)
        if commit is None:
            return self._send(h, 404, b'{"error":"Invalid rev id"}', code="RevisionNotFound", body=body)
        files = repo.commits[commit]
        if what == "revision":
            doc = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                   "siblings": [{"rfilename": p} for p in files]}
            return self._send(h, 200, json.dumps(doc).encode(), commit=commit, body=body)
        if what == "tree":
            doc = [self._entry(p, data) for p, data in files.items()]
            return self._send(h, 200, json.dumps(doc).encode(), commit=commit, body=body)
        if rel not in files:
            return self._send(h, 404, b"{}", code="EntryNotFound", commit=commit, body=body)
        data = files[rel]
        etag = hashlib.sha256(data).hexdigest() if is_lfs(rel) else git_blob_id(data)
        served = self.corrupt.get((repo_id, rel), data) if body else data
        return self._send(h, 200, served, commit=commit, etag=etag, length=len(served), body=body,
                          ctype="application/octet-stream")

    @staticmethod
    def _entry(path: str, data: bytes) -> dict:
        e = {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}
        if is_lfs(path):
            # as the hub lists an LFS file: the git blob id is the pointer file's, the SHA-256 the content's
            pointer = lfs_pointer(data)
            e["oid"] = git_blob_id(pointer)
            e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": len(pointer)}
        return e

    @staticmethod
    def _send(h, status: int, data: bytes, *, body: bool, code: str | None = None, commit: str | None = None,
              etag: str | None = None, length: int | None = None, ctype: str = "application/json") -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data) if length is None else length))
        if code:
            h.send_header("X-Error-Code", code)
        if commit:
            h.send_header("X-Repo-Commit", commit)
        if etag:
            h.send_header("ETag", f'"{etag}"')
        h.end_headers()
        if body:
            h.wfile.write(data)
