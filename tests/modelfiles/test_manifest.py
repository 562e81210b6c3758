"""Model manifests: which files count, their hashes, the hash cache, tampering, and the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from cliutil import run
from clusterctl.errors import Exit, IntegrityError, MissingInput
from clusterctl.modelfiles.copycheck import check_copy, needed_files
from clusterctl.modelfiles.manifest import (HashCache, ManifestRefused, build_manifest, check_manifest, load_manifest,
                                      save_manifest)


def model_folder(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "qwen2"}')
    (root / "model-00001-of-00002.safetensors").write_bytes(os.urandom(300_000))
    (root / "model-00002-of-00002.safetensors").write_bytes(os.urandom(70_000))
    (root / "sub").mkdir()
    (root / "sub" / "tokenizer.json").write_text("{}")
    (root / "empty.txt").write_bytes(b"")
    return root


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_every_file_with_size_and_sha256(tmp_path):
    root = model_folder(tmp_path / "m")
    m = build_manifest(root, cache=HashCache(tmp_path / "cache"))
    assert [f.path for f in m.files] == ["config.json", "empty.txt", "model-00001-of-00002.safetensors",
                                        "model-00002-of-00002.safetensors", "sub/tokenizer.json"]
    for f in m.files:
        assert f.size == (root / f.path).stat().st_size and f.sha256 == sha(root / f.path)
    assert m.total_bytes == sum(f.size for f in m.files) and m.name == "m"
    assert m.manifest_hash.startswith("sha256:")


def test_hash_depends_on_content_only(tmp_path):
    a = model_folder(tmp_path / "a")
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    os.utime(b / "config.json", (1, 1))
    ma, mb = build_manifest(a, use_cache=False), build_manifest(b, name="other", use_cache=False)
    assert ma.manifest_hash == mb.manifest_hash  # path, name and times do not count
    with open(b / "model-00002-of-00002.safetensors", "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    assert build_manifest(b, use_cache=False).manifest_hash != ma.manifest_hash  # one bit of one file does


def test_hidden_and_partial_files_are_left_out(tmp_path):
    root = model_folder(tmp_path / "m")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref")
    (root / ".rsync-partial").mkdir()
    (root / ".rsync-partial" / "model-00001-of-00002.safetensors").write_bytes(b"half")
    (root / ".DS_Store").write_bytes(b"x")
    for name in ("big.safetensors.incomplete", "x.tmp", "y.part", "sub/z.partial"):
        (root / name).write_bytes(b"partial")
    m = build_manifest(root, use_cache=False)
    assert not any(f.path.startswith(".") or "/." in f.path for f in m.files)
    assert sorted(m.skipped) == ["big.safetensors.incomplete", "sub/z.partial", "x.tmp", "y.part"]
    for junk in (".git", ".rsync-partial", ".DS_Store", "big.safetensors.incomplete", "x.tmp", "y.part",
                 "sub/z.partial"):
        p = root / junk
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    assert build_manifest(root, use_cache=False).manifest_hash == m.manifest_hash  # they never counted


def test_relative_symlink_inside_counts_as_its_target(tmp_path):
    root = model_folder(tmp_path / "m")
    (root / "tokenizer.json").symlink_to("sub/tokenizer.json")
    m = build_manifest(root, use_cache=False)
    link = m.by_path()["tokenizer.json"]
    assert link.sha256 == sha(root / "sub" / "tokenizer.json") and link.size == 2


@pytest.mark.parametrize("kind", ["absolute", "escaping", "folder", "broken", "fifo"])
def test_what_a_manifest_cannot_vouch_for_is_refused(tmp_path, kind):
    root = model_folder(tmp_path / "m")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not the model")
    if kind == "absolute":
        (root / "w.safetensors").symlink_to(outside)
    elif kind == "escaping":
        (root / "sub" / "w.safetensors").symlink_to("../../outside.bin")
    elif kind == "folder":
        (root / "more").symlink_to("sub")
    elif kind == "broken":
        (root / "gone").symlink_to("nothing-here")
    else:
        os.mkfifo(root / "pipe")
    with pytest.raises(ManifestRefused) as e:
        build_manifest(root, use_cache=False)
    assert e.value.exit_code == Exit.DATAERR
    r = run("manifest", str(root))
    assert r.code == 65 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) <= 2


def test_the_cache_answers_without_reading_and_a_changed_file_is_rehashed(tmp_path):
    root = model_folder(tmp_path / "m")
    cache_dir = tmp_path / "cache"
    first = build_manifest(root, cache=HashCache(cache_dir))
    w = root / "model-00002-of-00002.safetensors"
    st = w.stat()
    # same size, same mtime, same inode, different bytes: only a cache hit can still give the old hash
    with open(w, "r+b") as f:
        f.write(b"\xff" * 16)
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert build_manifest(root, cache=HashCache(cache_dir)).manifest_hash == first.manifest_hash
    assert build_manifest(root, cache=HashCache(cache_dir), use_cache=False).manifest_hash != first.manifest_hash
    # a normal write changes mtime: the cache entry no longer matches and the file is hashed again
    w.write_bytes(b"new content")
    again = build_manifest(root, cache=HashCache(cache_dir))
    assert again.by_path()[w.name].sha256 == sha(w)


def test_a_damaged_cache_is_moved_aside_and_rebuilt(tmp_path):
    root = model_folder(tmp_path / "m")
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (cache_dir / "hashes.json").write_text('{"schema_version": 1, "entries": {')
    c = HashCache(cache_dir)
    assert c.warning and "damaged" in c.warning
    m = build_manifest(root, cache=c)
    assert m.files and json.loads((cache_dir / "hashes.json").read_text())["schema_version"] == 1
    assert [p for p in cache_dir.iterdir() if "corrupt" in p.name]


def test_tampered_manifest_is_refused_and_stored_ones_are_rechecked(tmp_path):
    m = build_manifest(model_folder(tmp_path / "m"), use_cache=False)
    doc = m.model_dump(mode="json")
    doc["files"][0]["sha256"] = "0" * 64
    with pytest.raises(IntegrityError, match="does not match its file list"):
        check_manifest(doc)
    doc = m.model_dump(mode="json")
    doc["files"].append({"path": "../etc/passwd", "size": 1, "sha256": "0" * 64})
    from clusterctl.modelfiles.manifest import FileHash, manifest_hash

    doc["manifest_hash"] = manifest_hash([FileHash(**f) for f in doc["files"]])
    with pytest.raises(IntegrityError, match="unsafe path"):
        check_manifest(doc)
    store = tmp_path / "manifests"
    path = save_manifest(store, m)
    assert load_manifest(store, m.manifest_hash) == m
    path.write_text(path.read_text().replace(m.files[0].sha256, "1" * 64))
    assert load_manifest(store, m.manifest_hash) is None


def test_copy_states(tmp_path):
    src = model_folder(tmp_path / "src")
    m = build_manifest(src, use_cache=False)
    dest = tmp_path / "dest"
    assert check_copy(m, str(dest))["state"] == "missing"
    dest.mkdir()
    assert check_copy(m, str(dest))["state"] == "missing"
    shutil.copy(src / "config.json", dest / "config.json")
    st = check_copy(m, str(dest))
    assert st["state"] == "partial" and len(st["missing"]) == len(m.files) - 1
    assert needed_files(m, st) == sorted(set(f.path for f in m.files) - {"config.json"})
    shutil.rmtree(dest)
    shutil.copytree(src, dest)
    (dest / "extra-file").write_text("left alone")
    st = check_copy(m, str(dest), cache=HashCache(tmp_path / "c"))
    assert st["state"] == "ok" and st["extra"] == 1 and needed_files(m, st) == []
    (dest / "sub" / "tokenizer.json").write_text("{ }")  # one byte more
    (dest / "config.json").write_text('{"model_type": "QWEN2"}')  # same size, other bytes
    st = check_copy(m, str(dest), cache=HashCache(tmp_path / "c"))
    assert st["state"] == "stale" and st["stale"] == ["config.json", "sub/tokenizer.json"]


def test_manifest_cli(tmp_path):
    root = model_folder(tmp_path / "m")
    r = run("manifest", str(root), "--json")
    assert r.code == 0, r.stderr
    doc = r.json()
    assert doc["type"] == "model-manifest" and doc["schema_version"] == 1
    assert check_manifest(doc).manifest_hash == build_manifest(root, use_cache=False).manifest_hash
    plain = run("manifest", str(root))
    assert plain.code == 0 and plain.stdout.strip() == doc["manifest_hash"]
    missing = run("manifest", str(tmp_path / "nope"))
    assert missing.code == int(MissingInput.exit_code) == 66 and "does not exist" in missing.stderr
