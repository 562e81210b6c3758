"""Identifiers that become file names are refused where they are parsed, however validly the file is signed."""

import json

import pytest

from cliutil import run
from clusters import THREE, write_cluster

HOSTILE = ["../../../somewhere/escape", "a/b", ".hidden", "-rf", "x" * 201, "a\x00b", "ab c", ""]


@pytest.fixture
def signed(tmp_path, model32, state):
    out = tmp_path / "dep.json"
    c3 = write_cluster(tmp_path / "cluster.toml", THREE)
    assert run("plan", "-c", str(c3), "-m", str(model32), "--out", str(out), "-q").code == 0
    return out


def _resign(path, state, **changes):
    from clusterctl.atomic import dumps
    from clusterctl.protocol.signing import Keyring, sign_payload

    doc = json.loads(path.read_text())
    doc.pop("signature")
    doc.update(changes)
    path.write_bytes(sign_payload(dumps(doc), "deployment", Keyring(state / "keys").signing_key()))


@pytest.mark.parametrize("bad", HOSTILE)
def test_a_signed_deployment_with_a_path_for_an_id_is_refused(signed, state, tmp_path, bad):
    _resign(signed, state, deployment_id=bad)
    before = sorted(p for p in tmp_path.rglob("*"))
    for args in (["verify", str(signed)], ["launch", str(signed), "--detach", "--timeout", "5"]):
        r = run(*args)
        assert r.code == 65, (args, r.stderr)
        assert "deployment_id" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert sorted(p for p in tmp_path.rglob("*")) == before  # no lock, contract or log was written anywhere


def test_a_signed_deployment_with_a_path_for_a_cluster_name_is_refused(signed, state):
    _resign(signed, state, cluster="../../history-escape")
    r = run("verify", str(signed))
    assert r.code == 65 and "cluster" in r.stderr


@pytest.mark.parametrize("bad", ["../x", "a/b", ".x"])
def test_manifests_contracts_and_markers_refuse_path_ids(bad):
    from pydantic import ValidationError

    from clusterctl.statedir.manifest import LaunchManifest
    from clusterctl.protocol.runtimefiles import Marker
    from clusterctl.protocol.rankspec import RankSpec

    for cls, field in ((LaunchManifest, "job_id"), (LaunchManifest, "deployment_id"), (Marker, "job_id"),
                       (RankSpec, "deployment_id"), (RankSpec, "job_id")):
        with pytest.raises(ValidationError) as e:
            cls.model_validate({field: bad})
        assert any(err["loc"] == (field,) and err["type"] == "string_pattern_mismatch" for err in e.value.errors())


def test_a_huge_cluster_name_is_not_echoed_whole(tmp_path, model32, state):
    c = tmp_path / "c.toml"
    c.write_text(f"[cluster]\nname = '{'n' * 1_000_000}'\n[[node]]\nname = 'a'\n")
    r = run("plan", "-c", str(c), "-m", str(model32))
    assert r.code == 78 and "not a valid cluster name" in r.stderr
    assert len(r.stderr) < 1000


def test_an_error_message_is_never_longer_than_a_screenful():
    from clusterctl.errors import MAX_MESSAGE, ClusterctlError

    e = ClusterctlError("x" * 1_000_000 + " tail")  # one long run: cut to its start and its length
    assert len(e.message) < 200 and e.message.endswith("(1000000 characters) tail")
    e = ClusterctlError("word " * 200_000 + "tail")  # many short words: the line keeps its start and end
    assert len(e.message) <= MAX_MESSAGE and e.message.endswith("tail") and "characters cut" in e.message
