"""The signing key: created all or nothing, and refused when it is not the operator's own private file."""

import os
import subprocess

import pytest

from cliutil import run
from diskutil import fill_disk
from clusters import THREE, write_cluster


@pytest.fixture
def c3(tmp_path):
    return write_cluster(tmp_path / "cluster.toml", THREE)


@pytest.fixture
def small_state(tmp_path, monkeypatch):
    """A state dir on a 256 KiB tmpfs: a real full disk (needs root and mount)."""
    d = tmp_path / "small"
    d.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(d)], capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.decode().strip()}")
    monkeypatch.setenv("CLUSTERCTL_STATE_DIR", str(d))
    yield d
    subprocess.run(["umount", "-l", str(d)])


def test_a_full_disk_leaves_no_key_behind_and_the_next_plan_works(c3, model32, small_state):
    # a first plan records the model's manifest; then the key is gone and the disk full, so the key's creation
    # is the first write of the next plan
    assert run("plan", "-c", str(c3), "-m", str(model32), "-q").code == 0
    for p in (small_state / "keys").iterdir():
        p.unlink()
    for p in (small_state / "deployments").iterdir():
        p.unlink()
    filler = fill_disk(small_state)
    r = run("plan", "-c", str(c3), "-m", str(model32), "--json")
    assert r.code == 73, r.stderr
    assert r.stderr.startswith("error: cannot write") and "Traceback" not in r.stderr
    assert r.json()["ok"] is False and r.json()["exit_code"] == 73
    assert list((small_state / "keys").iterdir()) == []  # no key, no half key, no temp file
    filler.unlink()
    r = run("plan", "-c", str(c3), "-m", str(model32), "-q")
    assert r.code == 0, r.stderr
    assert (small_state / "keys" / "deploy.key").stat().st_size > 0


def test_an_empty_key_without_a_public_key_is_replaced(c3, model32, state):
    keys = state / "keys"
    keys.mkdir(parents=True, mode=0o700)
    fd = os.open(keys / "deploy.key", os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)
    r = run("plan", "-c", str(c3), "-m", str(model32), "-q")
    assert r.code == 0, r.stderr
    assert b"PRIVATE KEY" in (keys / "deploy.key").read_bytes() and (keys / "deploy.pub").exists()


def test_an_empty_key_whose_public_half_exists_is_refused(c3, model32, state):
    assert run("plan", "-c", str(c3), "-m", str(model32), "-q").code == 0
    (state / "keys" / "deploy.key").write_bytes(b"")
    r = run("plan", "-c", str(c3), "-m", str(model32))
    assert r.code == 65 and "not an Ed25519 private key" in r.stderr


def test_a_key_others_may_read_is_refused(c3, model32, state):
    assert run("plan", "-c", str(c3), "-m", str(model32), "-q").code == 0
    key = state / "keys" / "deploy.key"
    key.chmod(0o644)
    r = run("plan", "-c", str(c3), "-m", str(model32))
    assert r.code == 78, r.stderr
    assert "readable by others (mode 0644)" in r.stderr and "chmod 600" in r.stderr
    key.chmod(0o600)
    assert run("plan", "-c", str(c3), "-m", str(model32), "-q").code == 0


def test_a_symlinked_key_is_refused(c3, model32, state, tmp_path):
    assert run("plan", "-c", str(c3), "-m", str(model32), "-q").code == 0
    key = state / "keys" / "deploy.key"
    elsewhere = tmp_path / "elsewhere.key"
    key.rename(elsewhere)
    key.symlink_to(elsewhere)
    r = run("plan", "-c", str(c3), "-m", str(model32))
    assert r.code == 78 and "is a symlink" in r.stderr
