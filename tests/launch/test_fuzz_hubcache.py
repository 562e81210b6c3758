"""Seeded fuzzing of hub-cache layouts (issue 49): `plan --model ORG/NAME` offline against a repository's cache
with its refs/, snapshots/, blobs/ and trees/ mutated: symlinks out of the cache, dangling links, refs that are not
a commit or that climb with '../', a missing or lying listing, bytes swapped after their hashes were recorded,
folders others may write, FIFOs. Every outcome is a clean one-line refusal with a non-zero exit, or a plan whose
recorded content is what is on disk (each file's bytes hash to its blob's name and to the listing where it is
intact), and nothing outside the repository's cache is touched.

The first pass applies each mutation alone, then random pairs and triples (``CLUSTERCTL_FUZZ_SEED``, default 49;
``CLUSTERCTL_FUZZ_EXAMPLES`` scales the count: 300 gives 40 cases). Plans run in this process (hubcachefiles.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest

from clusterctl.modelfiles.manifest import HashCache, build_manifest, hash_files, scan
from fuzzutil import MAX_EXAMPLES, count, counting_fixtures
from hubcachefiles import CachedRepo, cluster_file, one_error_line, plan_offline, write_cache
from hubserver import git_blob_id
from modelfiles import make_model

pytestmark = pytest.mark.slow  # a fuzzer: tens of plans (a few seconds in all)

_count_cases, _report_cases = counting_fixtures("hub-cache layouts")

REPO_ID, OTHER_ID = "tiny-org/tiny-4bit", "evil-org/other"
SEED = int(os.environ.get("CLUSTERCTL_FUZZ_SEED", "49"))
N_CASES = max(20, MAX_EXAMPLES * 2 // 15)


@dataclass
class Bed:
    repo: CachedRepo
    other: CachedRepo
    outside: Path  # a folder beside the cache: a model of its own and a file nothing may remove
    rng: random.Random

    def snapshot_file(self) -> Path:
        return self.repo.snapshot / self.rng.choice(sorted(os.listdir(self.repo.snapshot)))

    def blob(self) -> Path:
        return self.repo.storage / "blobs" / self.rng.choice(sorted(os.listdir(self.repo.storage / "blobs")))

    def relink(self, link: Path, target: str | Path) -> None:
        if os.path.lexists(link):
            link.unlink()
        link.symlink_to(target)


def _regular_bytes(path: Path) -> bytes | None:
    """A file's bytes, or None for what a mutation must not open (a FIFO an earlier one left, a dangling link)."""
    try:
        real = os.path.realpath(path)
        return Path(real).read_bytes() if stat.S_ISREG(os.lstat(real).st_mode) else None
    except OSError:
        return None


def _ref_text(b: Bed):
    hexes = "0123456789abcdef"
    text = b.rng.choice(["", "main", b.repo.commit + "\n", b.repo.commit.upper(), b.repo.commit[:-1],
                         b.repo.commit + "0", "".join(b.rng.choice(hexes) for _ in range(40)),
                         os.path.relpath(b.other.snapshot, b.repo.storage / "snapshots"),
                         "../snapshots/" + b.repo.commit, str(b.other.snapshot), "\x00" * 40,
                         bytes(b.rng.randrange(256) for _ in range(40)).decode("latin-1")])
    (b.repo.storage / "refs" / "main").write_bytes(text.encode("latin-1"))


def _ref_special(b: Bed):
    ref = b.repo.storage / "refs" / "main"
    ref.unlink()
    kind = b.rng.choice(["fifo", "dir", "link-out", "link-in"])
    if kind == "fifo":
        os.mkfifo(ref)
    elif kind == "dir":
        ref.mkdir()
    else:
        target = b.outside / "ref" if kind == "link-out" else b.repo.storage / "refs" / "other"
        target.write_text(b.other.commit if kind == "link-out" else b.repo.commit)
        ref.symlink_to(target)


def _link_out(b: Bed):
    link = b.snapshot_file()
    target = b.rng.choice(["abs-out", "rel-out", "other-blob", "dangling", "fifo", "in-snapshot", "unnamed-blob"])
    if target == "abs-out":
        b.relink(link, b.outside / "model" / "config.json")
    elif target == "rel-out":
        b.relink(link, os.path.relpath(b.outside / "model" / "model.safetensors", link.parent))
    elif target == "other-blob":
        b.relink(link, os.path.relpath(b.other.blob_of("config.json"), link.parent))
    elif target == "dangling":
        b.relink(link, "../../blobs/" + "f" * 64)
    elif target == "fifo":
        os.mkfifo(b.repo.storage / "blobs" / ("a" * 64))
        b.relink(link, "../../blobs/" + "a" * 64)
    elif target == "in-snapshot":
        b.relink(link, b.rng.choice([n for n in os.listdir(link.parent) if n != link.name]))
    elif (data := _regular_bytes(link)) is not None:
        (b.repo.storage / "blobs" / "weights").write_bytes(data)
        b.relink(link, "../../blobs/weights")


def _plain_file(b: Bed):
    """A snapshot file as a copy of its bytes (as on a filesystem without links): checkable only by the listing."""
    link = b.snapshot_file()
    data = _regular_bytes(link)
    if data is not None:
        link.unlink()
        link.write_bytes(data)


def _fifo_in_snapshot(b: Bed):
    name = b.rng.choice(["extra.json", os.path.basename(b.snapshot_file())])
    if os.path.lexists(b.repo.snapshot / name):
        (b.repo.snapshot / name).unlink()
    os.mkfifo(b.repo.snapshot / name)


def _swap_in_place(b: Bed):
    """A blob's bytes rewritten after their hashes were recorded, size, inode and mtime kept."""
    blob = b.blob()
    raw = _regular_bytes(blob)
    if not raw:
        return
    st = blob.stat()
    data = bytearray(raw)
    data[b.rng.randrange(len(data))] ^= 1 << b.rng.randrange(8)
    blob.write_bytes(data)
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))


def _swap_consistent(b: Bed):
    """Other bytes in a blob named by their own hash, the link moved to it: only the listing can tell."""
    link = b.repo.snapshot / b.rng.choice(["config.json", "model.safetensors"])
    data = _regular_bytes(link)
    if not data or len(data) < 2:
        return
    if link.name == "config.json":
        data = data.replace(b'"num_hidden_layers": 2', b'"num_hidden_layers": 1')
        name = git_blob_id(data)
    else:
        data = data[:-2] + bytes([data[-2] ^ 1, data[-1]])
        name = hashlib.sha256(data).hexdigest()
    (b.repo.storage / "blobs" / name).write_bytes(data)
    b.relink(link, "../../blobs/" + name)


def _relink_in_repo(b: Bed):
    link = b.snapshot_file()
    others = [p for p in os.listdir(b.repo.snapshot) if p != link.name and not os.path.isdir(b.repo.snapshot / p)]
    b.relink(link, os.path.relpath(os.path.realpath(b.repo.snapshot / b.rng.choice(others)), link.parent))


def _remove_blob(b: Bed):
    b.blob().unlink()


def _listing(b: Bed):
    path = b.repo.storage / "trees" / f"{b.repo.commit}.json"
    if _regular_bytes(path) is None or os.path.islink(path):
        return
    kind = b.rng.choice(["missing", "garbled", "fifo", "lies", "other-format", "link"])
    if kind == "missing":
        shutil.rmtree(path.parent)
    elif kind == "garbled":
        path.write_bytes(bytes(b.rng.randrange(256) for _ in range(b.rng.randrange(1, 200))))
    elif kind == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif kind == "lies" and path.read_bytes().startswith(b'{"format_version": 1'):
        doc = json.loads(path.read_text())
        entry = doc["files"][b.rng.choice(sorted(doc["files"]))]
        entry["lfs_sha256" if "lfs_sha256" in entry else "blob_id"] = "0" * len(entry.get("lfs_sha256") or "0" * 40)
        path.write_text(json.dumps(doc))
    elif kind == "other-format":
        path.write_text(json.dumps({"format_version": 2, "files": []}))
    else:
        shutil.move(path, b.outside / "listing.json")
        path.symlink_to(b.outside / "listing.json")


def _no_listing(b: Bed):
    """The cache an older client filled: no trees/ (every blob's name still vouches for its bytes)."""
    if os.path.isdir(b.repo.storage / "trees") and not os.path.islink(b.repo.storage / "trees"):
        shutil.rmtree(b.repo.storage / "trees")


def _writable_by_others(b: Bed):
    s = b.repo.storage
    where = b.rng.choice([b.repo.cache, s, s / "refs", s / "blobs", s / "snapshots", b.repo.snapshot, s / "trees"])
    if where.is_dir():
        os.chmod(where, stat.S_IMODE(os.stat(where).st_mode) | b.rng.choice([0o002, 0o020, 0o022]))


def _folder_link(b: Bed):
    """A folder of the cache moved beside it and linked back (the links' targets still resolve)."""
    s = b.repo.storage
    where = b.rng.choice([s / "refs", s / "blobs", b.repo.snapshot, s / "trees"])
    if not where.is_dir():
        return
    moved = where.parent / (where.name + "-moved")
    where.rename(moved)
    where.symlink_to(moved.name)


MUTATIONS = [_ref_text, _ref_special, _link_out, _plain_file, _fifo_in_snapshot, _swap_in_place, _swap_consistent,
             _relink_in_repo, _remove_blob, _listing, _no_listing, _writable_by_others, _folder_link]


def _listed(repo: CachedRepo) -> dict | None:
    path = repo.storage / "trees" / f"{repo.commit}.json"
    if os.path.islink(path) or not path.is_file():
        return None
    try:
        doc = json.loads(path.read_bytes())
    except ValueError:
        return None
    return doc.get("files") if isinstance(doc, dict) and doc.get("format_version") == 1 else None


def _assert_planned_what_is_on_disk(r, repo: CachedRepo) -> None:
    dep = json.loads(r.stdout)
    assert dep["model"]["hub"]["commit"] == repo.commit and dep["model"]["source_path"] == str(repo.snapshot)
    assert dep["model"]["manifest_hash"] == build_manifest(repo.snapshot, use_cache=False).manifest_hash
    listed = _listed(repo) or {}
    for f in scan(repo.snapshot)[0]:
        data = Path(f.path).read_bytes()
        digests = {hashlib.sha256(data).hexdigest(), git_blob_id(data)}
        named = os.path.islink(repo.snapshot / f.rel) and Path(f.path).name in digests
        entry = listed.get(f.rel) or {}
        by_listing = entry.get("lfs_sha256") or entry.get("blob_id")
        assert named or by_listing, f.rel  # something on disk vouches for every file
        assert by_listing is None or by_listing in digests, f.rel


def _alarm(signum, frame):
    raise AssertionError("a case took more than 30 s (a FIFO opened?)")


def test_every_hub_cache_layout_is_refused_cleanly_or_planned_as_it_is_on_disk(monkeypatch, tmp_path):
    published = make_model(tmp_path / "published", layers=2)
    theirs = make_model(tmp_path / "theirs", layers=3)
    toml = cluster_file(tmp_path)
    rng = random.Random(SEED)
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for case in range(N_CASES):
            muts = [MUTATIONS[case]] if case < len(MUTATIONS) else rng.sample(MUTATIONS, rng.choice([1, 2, 3]))
            signal.alarm(30)
            root = tmp_path / f"case{case}"
            outside = root / "outside"
            shutil.copytree(theirs, outside / "model")
            (outside / "keep").write_text("nothing may remove this")
            bed = Bed(write_cache(root / "hub", REPO_ID, published),
                      write_cache(root / "hub", OTHER_ID, theirs, commit="e" * 40), outside, rng)
            cache = HashCache()  # the hashes recorded before the mutations (the hash cache's key still matches)
            hash_files(scan(bed.repo.snapshot)[0], cache)
            cache.save()
            for m in muts:
                try:
                    m(bed)
                except OSError:  # an earlier mutation took what this one changes (a combination only)
                    assert case >= len(MUTATIONS), m.__name__
            r = plan_offline(monkeypatch, bed.repo.cache, toml, root / "state", REPO_ID)
            what = f"case {case} ({', '.join(m.__name__ for m in muts)})"
            if r.code == 0:
                _assert_planned_what_is_on_disk(r, bed.repo)
                count("accepted")
            else:
                one_error_line(r)
                assert not list((root / "state").glob("deployments/*.json")), what
                count("refused")
            assert (outside / "keep").is_file() and sorted(os.listdir(outside / "model")) == \
                sorted(os.listdir(theirs)), what
            assert build_manifest(bed.other.snapshot, use_cache=False).manifest_hash == \
                build_manifest(theirs, use_cache=False).manifest_hash, what
            signal.alarm(0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
