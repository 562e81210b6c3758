"""Fuzzing of identifiers that become file names: deployment and job ids, cluster and node names, wherever a file
carries them — signed deployment files (re-signed with the state's key, so the signature never stops them),
launch manifests, rank contracts, markers, cancel files and acks, cluster.toml.

For every hostile id (``/``, ``..``, NUL, very long, leading ``-``, unicode, control characters, non-UTF-8) the
promise is: the parser refuses it with a one-line ClusterctlError that does not echo a long id whole, OR every path
the code derives from it stays inside its folder as one file name of at most 255 bytes. The derived paths are the
product's own (``StateDir``, ``ManifestStore.path``, ``history.path_of``, ``cancel_path``, ``ack_path``,
``teardown.reports_dir``) and, where the code builds the name inline, the same f-string (the locks
``locks/deploy-<id>.lock``, ``sync-<id>.lock``, ``replan-<cluster>.lock``; the launcher's job id
``<deployment>-<time>-<hex>`` and the rank files ``<job>-rank<r>.json/.contract/.hostfile.json/.log``,
``<job>.gate``, ``<job>.lease``; see launch/jobplan.py, protocol/runtimefiles.py, sync/engine.py, launch/replan.py, launch/reaper.py).
An id that passes is then handed to the real writers (save_deployment, ManifestStore save/remove, the teardown
report, write_ack, cancel_here, the locks, the replan history) in a sandbox, and nothing may appear outside the
state and runtime dirs. And an id the product makes from an accepted one (the launcher's job id) must pass the
product's own parsers: a launch must be able to read back what it wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzutil import counting_fixtures, count, fuzz_settings

from clusterctl.errors import ClusterctlError

pytestmark = pytest.mark.slow  # fuzzers of hostile ids through every command

NAME_MAX = 255
ECHO_LIMIT = 300
LONG = 1 << 20
TS, HEX = "20261204211500", "a1b2c3"  # what the launcher puts after a deployment id to make a job id
ABS = "\0ABS\0"  # replaced by an absolute path inside the sandbox (an absolute id must not reach "/")

HOSTILE_IDS = ["", ".", "..", "...", "../x", "../../../somewhere/escape", "a/b", "a/../b", "./a", "/", ABS + "/escape",
               "x\x00y", "\x00", "-rf", "--help", "-", ".hidden", "a.", "a..b", "~", "a b", " a", "a\nb", "a\rb",
               "\x1b[2J", "a\\b", "%2e%2e%2fx", "é", "é" * 130, "日本語", "🙂", "\u202egnp.exe", "\udcff",
               "x" * 63, "x" * 64, "x" * 180, "x" * 200, "x" * 201, "x" * 240, "x" * 256, "x" * 4097, "x" * LONG,
               "con", "NUL", "a:b", "a*b", "a;rm -rf x", "$(id)", "0", "a" + "/" * 3]
ID_TEXT = st.one_of(
    st.sampled_from([v for v in HOSTILE_IDS if len(v) < LONG]),  # the 1 MB id: once, in the sweep
    st.lists(st.sampled_from(["..", ".", "a", "", "-x", "é", "\x00", "b.c"]), min_size=1, max_size=5).map("/".join),
    st.text(alphabet=st.sampled_from("aZ09-._/\\\x00 é~\n:"), max_size=12),
    st.text(max_size=40),
    st.integers(0, 260).map(lambda n: "a" * n),
    st.integers(150, 260).map(lambda n: "b" * n),  # around every length limit
)


# ---- the sandbox ------------------------------------------------------------------------------------------------

class Box:
    """tmp/box/s1/s2/s3/s4/{state,run-a,run-b}: an id with up to four '..' that did escape stays in the box."""

    def __init__(self, root: Path):
        from clusterctl.statedir.state import StateDir

        self.box = root / "box"
        self.base = self.box / "s1" / "s2" / "s3" / "s4"
        self.state_dir = self.base / "state"
        self.runs = [self.base / "run-a", self.base / "run-b"]
        for d in (self.state_dir, *self.runs):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.state = StateDir(self.state_dir)
        self.key = self.state.keyring.signing_key()
        self.trusted = self.state.keyring.public_keys()
        self.inbox = root / "in"
        self.inbox.mkdir(exist_ok=True)
        for rd in self.runs:
            (rd / "trusted-keys").mkdir(exist_ok=True)
            for pub in self.trusted:
                (rd / "trusted-keys" / f"{pub.key_id}.pub").write_text(pub.to_text())

    def real(self, ident: str) -> str:
        return ident.replace(ABS, str(self.box / "abs"))

    def listing(self) -> set[str]:
        return {str(p.relative_to(self.box)) for p in self.box.rglob("*")}

    def allowed(self, rel: str) -> bool:
        """Inside the state or a runtime dir, or one of the folders above them."""
        p = self.box / rel
        return any(p == d or d in p.parents for d in (self.state_dir, *self.runs)) or p in self.base.parents \
            or p == self.base


FAST_ROOT = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None  # the real writers fsync: tmpfs


@pytest.fixture(scope="module")
def box():
    root = Path(tempfile.mkdtemp(prefix="ids-fuzz-", dir=FAST_ROOT))
    try:
        yield Box(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from clusterctl.protocol.deployment import PlanOptions
    from clusterctl.plan.inventory import parse_cluster
    from clusterctl.plan.model import inspect_model
    from clusterctl.plan.planner import make_deployment

    from modelfiles import make_model

    facts = inspect_model(make_model(tmp_path_factory.mktemp("m") / "m", layers=8, hidden=32))
    c = parse_cluster({"cluster": {"name": "f"}, "node": [
        {"name": "a", "memory_gb": 8, "host": "10.0.0.1", "ips": ["10.0.0.1"], "model_path": "/m"},
        {"name": "b", "memory_gb": 8, "host": "10.0.0.2", "ips": ["10.0.0.2"], "model_path": "/m"}]})
    return make_deployment(c, facts, "/m", PlanOptions())


_count_cases, _report_cases = counting_fixtures("identifier fuzz cases per source")


# ---- sources: a file carrying the id, and the product's parser of it ----------------------------------------------

def pretty(doc) -> bytes:
    """clusterctl.atomic.dumps's form, but ASCII: a lone surrogate travels as a JSON escape, as it could in a file
    someone wrote (dumps itself cannot encode one)."""
    return (json.dumps(doc, indent=2, ensure_ascii=True) + "\n").encode()


def _signed_deployment(box: Box, deployment, **fields) -> bytes:
    from clusterctl.protocol.deployment import KIND
    from clusterctl.protocol.signing import sign_payload

    doc = {**deployment.model_dump(mode="json"), **fields}
    return sign_payload(pretty(doc), KIND, box.key)


def _put(box: Box, name: str, data: bytes) -> Path:
    p = box.inbox / name
    tmp = box.inbox / f".{name}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, p)
    return p


def parse_deployment(box, deployment, field, ident) -> dict:
    path = _put(box, "dep.json", _signed_deployment(box, deployment, **{field: ident}))
    _, loaded = box.state.load_deployment(str(path))  # what verify, launch, sync and replan call
    d = loaded.deployment
    return {"deployment_id": d.deployment_id, "cluster": d.cluster, "dep": d}


def parse_manifest(box, deployment, field, ident) -> dict:
    from clusterctl.statedir.manifest import KIND, ManifestStore
    from clusterctl.protocol.signing import sign_payload

    doc = _manifest_doc(**{field: ident})
    path = _put(box, "job.json", sign_payload(pretty(doc), KIND, box.key))
    m = ManifestStore(box.state.launches, None, box.trusted).load(path)
    return {"job_id": m.job_id, "deployment_id": m.deployment_id, "manifest": m}


def _manifest_doc(job_id="j1", deployment_id="d1") -> dict:
    from clusterctl.statedir.manifest import this_coordinator

    return {"schema_version": 1, "type": "launch-manifest", "job_id": job_id, "deployment_id": deployment_id,
            "plan_hash": "h", "deployment_file": "/d.json", "created_at": "t", "nonce": "n",
            "coordinator": this_coordinator().model_dump(mode="json"), "nodes": [], "ranks": []}


def _spec(deployment_id: str, job_id: str, rd: Path) -> dict:
    return {"deployment_id": deployment_id, "job_id": job_id, "nonce": "n", "node": "a", "rank": 0,
            "world_size": 2, "model_path": "/m", "start_layer": 4, "end_layer": 8, "layer_counts": [4, 4],
            "num_layers": 8, "hostfile": str(rd / "h"), "http_port": 8000, "runtime_dir": str(rd),
            "marker_path": str(rd / "m.json"), "gate_path": str(rd / "g")}


def parse_contract(box, deployment, field, ident) -> dict:
    from clusterctl.protocol.contract import contract_kind, encode_contract, load_rank_contract
    from clusterctl.protocol.signing import sign_payload

    rd = box.runs[0]
    dep_id = ident if field == "deployment_id" else deployment.deployment_id
    dep_bytes = _signed_deployment(box, deployment, deployment_id=dep_id)
    spec = _spec(dep_id, ident if field == "job_id" else "j1", rd)
    path = rd / "fuzz-rank0.contract"
    tmp = rd / ".fuzz-rank0.contract.tmp"
    try:
        data = encode_contract(dep_bytes, spec, box.key)
    except UnicodeEncodeError:  # the same document, with the id as a JSON escape
        data = sign_payload(pretty({"schema_version": 1, "type": "rank-contract", "node": "a", "rank": 0,
                                    "job_id": spec["job_id"], "deployment_id": dep_id,
                                    "deployment": dep_bytes.decode(), "spec": spec}), contract_kind("a"), box.key)
    tmp.write_bytes(data)
    os.replace(tmp, path)
    s = load_rank_contract(path, "a")  # what the rank runs first
    return {"deployment_id": s.deployment_id, "job_id": s.job_id, "runtime_dir": s.runtime_dir}


def parse_marker(box, deployment, field, ident) -> dict:
    from clusterctl.protocol.runtimefiles import read_marker

    doc = {"schema_version": 1, "type": "rank-marker", "deployment_id": "d1", "job_id": "j1", "nonce": "n",
           "rank": 0, "node": "a", "host": "h", "pid": 123, "pgid": 123, "start_time": 1.5, "boot_id": "b",
           "state": "serving", "heartbeat_at": 2.5, field: ident}
    m = read_marker(_put(box, "m.json", json.dumps(doc).encode()))
    return {"job_id": m.job_id, "deployment_id": m.deployment_id}


def parse_cluster_toml(box, deployment, field, ident) -> dict:
    from clusterctl.plan.inventory import load_cluster

    name = json.dumps(ident)  # a TOML basic string is a JSON string (escapes included)
    text = (f"[cluster]\nname = {name if field == 'cluster' else json.dumps('c')}\n"
            f"[[node]]\nname = {name if field == 'node' else json.dumps('a')}\nlocal = true\nmemory_gb = 4\n")
    c = load_cluster(_put(box, "cluster.toml", text.encode("utf-8", "surrogatepass")))
    return {"cluster": c.name}


def parse_cancel(box, deployment, field, ident) -> dict:
    from clusterctl.protocol.runtimefiles import read_cancel

    doc = {"schema_version": 1, "type": "cancel", "deployment_id": "d1", "job_id": "j1", "epoch": 2,
           "requests": None, "created_at": 1.0, field: ident}
    read_cancel(_put(box, "c.json", json.dumps(doc).encode()))
    return {}  # the ids in a cancel file only name whose it is: nothing is built from them (see the watch test)


def parse_ack(box, deployment, field, ident) -> dict:
    from clusterctl.protocol.runtimefiles import read_ack

    doc = {"schema_version": 1, "type": "cancel-ack", "deployment_id": "d1", "job_id": "j1", "rank": 1,
           "epoch": 2, "applied": [], "at": 1.0, field: ident}
    read_ack(_put(box, "a.json", json.dumps(doc).encode()))
    return {}


SOURCES = {
    "deployment.deployment_id": (parse_deployment, "deployment_id"),
    "deployment.cluster": (parse_deployment, "cluster"),
    "manifest.job_id": (parse_manifest, "job_id"),
    "manifest.deployment_id": (parse_manifest, "deployment_id"),
    "contract.deployment_id": (parse_contract, "deployment_id"),
    "contract.job_id": (parse_contract, "job_id"),
    "marker.job_id": (parse_marker, "job_id"),
    "marker.deployment_id": (parse_marker, "deployment_id"),
    "marker.node": (parse_marker, "node"),
    "cluster.toml cluster": (parse_cluster_toml, "cluster"),
    "cluster.toml node": (parse_cluster_toml, "node"),
    "cancel.deployment_id": (parse_cancel, "deployment_id"),
    "cancel.job_id": (parse_cancel, "job_id"),
    "ack.deployment_id": (parse_ack, "deployment_id"),
    "ack.job_id": (parse_ack, "job_id"),
}


# ---- what the code derives from an accepted id ---------------------------------------------------------------------

def job_of(deployment_id: str) -> str:
    return f"{deployment_id}-{TS}-{HEX}"  # launch/jobplan.py, new_job_id


def derived_paths(box: Box, ids: dict) -> list[tuple[str, Path, Path]]:
    """(what, path, the folder it must be in) for every file the code names after these ids."""
    from clusterctl.statedir import history
    from clusterctl.protocol.runtimefiles import ack_path, cancel_path
    from clusterctl.statedir.manifest import ManifestStore
    from clusterctl.launch.teardown import reports_dir

    st_ = box.state
    store = ManifestStore(st_.launches, None, [])
    out = []
    rds = [Path(ids["runtime_dir"])] if ids.get("runtime_dir") else box.runs
    jobs = [ids["job_id"]] if "job_id" in ids else []
    if "deployment_id" in ids:
        d = ids["deployment_id"]
        out += [("deployment file", st_.deployments / f"{d}.json", st_.deployments),
                ("launch lock", st_.locks / f"deploy-{d}.lock", st_.locks),
                ("sync lock", st_.locks / f"sync-{d}.lock", st_.locks)]
        for rd in rds:
            out += [("cancel file", cancel_path(rd, d), rd)]
            out += [(f"rank {r} ack", ack_path(rd, d, r), rd) for r in (0, 1, 1023)]
        if "job_id" not in ids:
            jobs.append(job_of(d))
    for j in jobs:
        out += [("launch manifest", store.path(j), st_.launches),
                ("teardown report", reports_dir(store) / f"{j}.json", reports_dir(store))]
        for rd in rds:
            for r in (0, 1023):
                for suffix in (".json", ".contract", ".hostfile.json", ".log"):
                    out.append((f"rank {r} {suffix}", rd / f"{j}-rank{r}{suffix}", rd))
            out += [("gate", rd / f"{j}.gate", rd), ("lease", rd / f"{j}.lease", rd)]
    if "cluster" in ids:
        c = ids["cluster"]
        out += [("replan history", history.path_of(st_, c), st_.root / "history"),
                ("replan lock", st_.locks / f"replan-{c}.lock", st_.locks)]
    return out


def path_problems(what: str, path: Path, folder: Path) -> list[str]:
    s, f = os.fspath(path), os.fspath(folder)
    name = os.path.basename(s)
    if "\0" in s:
        return [f"{what}: the path holds a NUL byte"]
    if os.path.dirname(s) != f or name in ("", ".", ".."):
        return [f"{what}: {s[-120:]!r} is not one file name inside {f}"]
    if os.path.dirname(os.path.realpath(s)) != os.path.realpath(f):
        return [f"{what}: {s[-120:]!r} resolves outside {f}"]
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        return [f"{what}: file name of {len(name.encode('utf-8', 'surrogateescape'))} bytes (the limit is 255)"]
    return []


def write_everything(box: Box, ids: dict, deployment) -> None:
    """The real writers, with ids that passed path_problems: each may only write where it should."""
    from clusterctl.statedir import history
    from clusterctl.protocol.runtimefiles import cancel_here, write_ack
    from clusterctl.statedir.manifest import LaunchManifest, ManifestStore
    from clusterctl.launch.teardown import TeardownReport, save_report
    from clusterctl.locks import Lock

    st_ = box.state
    d, j, c = ids.get("deployment_id"), ids.get("job_id"), ids.get("cluster")
    if d is not None and j is None:
        j = job_of(d)
    if "dep" in ids:
        st_.save_deployment(ids["dep"])
    if d is not None:
        for name in (f"deploy-{d}.lock", f"sync-{d}.lock"):
            Lock(st_.locks / name).acquire().release()
        rd = ids.get("runtime_dir") or str(box.runs[0])
        write_ack(rd, d, j or "j", 1, 1, [])
        cancel_here(rd, d, j or "j", [])
    if j is not None:
        store = ManifestStore(st_.launches, box.key, box.trusted)
        m = ids.get("manifest") or LaunchManifest.model_validate(_manifest_doc(job_id=j, deployment_id=d or "d1"))
        store.save(m)
        save_report(store, TeardownReport(job_id=j, deployment_id=d or "d1"))
        store.remove(j)
    if c is not None:
        history.append(st_, c, {"applied_at": "t", "from": "a", "from_hash": "h", "to": "b", "to_hash": "i",
                                "changes": [], "file": None, "relaunched": None})
        Lock(st_.locks / f"replan-{c}.lock").acquire().release()


def made_ids_read_back(box: Box, ids: dict) -> list[str]:
    """The launcher makes a job id from an accepted deployment id and writes it into a manifest, the contracts and
    the markers: each of those parsers must take it, or the job could not be read back (reap, teardown, status)."""
    from pydantic import ValidationError

    from clusterctl.statedir.manifest import LaunchManifest
    from clusterctl.protocol.runtimefiles import Marker
    from clusterctl.protocol.rankspec import RankSpec

    if "deployment_id" not in ids or "job_id" in ids:
        return []
    d, j = ids["deployment_id"], job_of(ids["deployment_id"])
    out = []
    for what, build in (
            ("launch manifest", lambda: LaunchManifest.model_validate(_manifest_doc(job_id=j, deployment_id=d))),
            ("rank contract", lambda: RankSpec.model_validate(_spec(d, j, box.runs[0]))),
            ("marker", lambda: Marker.model_validate({
                "deployment_id": d, "job_id": j, "nonce": "n", "rank": 0, "node": "a", "host": "h", "pid": 2,
                "pgid": 2, "start_time": 1.0, "boot_id": None, "state": "loading", "heartbeat_at": 1.0}))):
        try:
            build()
        except ValidationError as e:
            err = e.errors()[0]
            out.append(f"the launcher's job id for deployment id {d[:40]!r}... ({len(j)} characters) is refused "
                       f"by the {what}: {'.'.join(map(str, err['loc']))}: {err['msg']}")
    return out


def echo_of(message: str, ident: str) -> int:
    """Characters of a long id (a run of one character, as the fuzzer makes them) repeated in a message."""
    if len(ident) <= ECHO_LIMIT or len(set(ident)) != 1:
        return 0
    ch = ident[0]
    best = run = 0
    for c in message:
        run = run + 1 if c == ch else 0
        best = max(best, run)
    return best


def one(box: Box, deployment, source: str, ident: str) -> list[str]:
    """Every broken promise for one id in one source (empty: kept)."""
    parse, field = SOURCES[source]
    ident = box.real(ident)
    try:
        ids = parse(box, deployment, field, ident)
    except ClusterctlError as e:
        count("refused")
        bad = []
        if not e.message or "\n" in e.message or int(e.exit_code) not in (1, 2, 65, 66, 69, 73, 75, 77, 78):
            bad.append(f"refused with exit {int(e.exit_code)} and message {e.message[:120]!r}")
        n = echo_of(e.message, ident) + echo_of(e.hint or "", ident)
        if n > ECHO_LIMIT:
            bad.append(f"the refusal echoes {n} characters of a {len(ident)}-character id")
        return bad
    except Exception as e:  # noqa: BLE001 - anything else would be a traceback for the user
        count("crashed")
        return [f"{type(e).__name__} (a traceback for the user): {str(e)[:160]}"]
    count("accepted")
    bad = []
    for what, path, folder in derived_paths(box, ids):
        bad += path_problems(what, path, folder)
    bad += made_ids_read_back(box, ids)
    if bad:
        return bad
    before = box.listing()
    try:
        write_everything(box, ids, deployment)
    except ClusterctlError:
        pass  # refused late is still no escape; a refusal at parse time is what the paths above asked for
    except Exception as e:  # noqa: BLE001
        return [f"writing the files of an accepted id: {type(e).__name__}: {str(e)[:160]}"]
    stray = sorted(p for p in box.listing() - before if not box.allowed(p))
    return [f"a file appeared outside the state and runtime dirs: {stray[0]}"] if stray else []


# ---- tests ----------------------------------------------------------------------------------------------------------

def test_the_samples_are_accepted_as_they_are(box, deployment):
    """Each source with a plain id passes and writes only where it should (else the fuzzing proves nothing)."""
    for source in SOURCES:
        assert one(box, deployment, source, "plain-id.1") == [], source


def _show(v: str) -> str:
    s = repr(v)
    return s if len(s) <= 50 else f"{s[:30]}...<{len(v)} chars>"


def _first(problems: list[str], n: int = 3) -> str:
    distinct = list(dict.fromkeys(problems))
    return "; ".join(distinct[:n]) + (f" (+{len(distinct) - n} more)" if len(distinct) > n else "")


@pytest.mark.parametrize("source", list(SOURCES))
def test_hostile_ids(box, deployment, source):
    """Every hostile id of the list in this source: refused cleanly, or safe as a file name everywhere."""
    found = {}
    for ident in HOSTILE_IDS:
        bad = one(box, deployment, source, ident)
        if bad:
            found[_show(ident)] = bad
    if found:
        pytest.fail(f"{source}: {len(found)} id(s) break a promise:\n  "
                    + "\n  ".join(f"{k}: {_first(v)}" for k, v in found.items()), pytrace=False)


@pytest.mark.parametrize("source", list(SOURCES))
def test_random_ids(box, deployment, source):
    @fuzz_settings(0.5)
    @given(ID_TEXT)
    def run(ident):
        bad = one(box, deployment, source, ident)
        assert not bad, bad

    run()


def test_a_cancel_file_of_another_id_is_never_applied_and_writes_nothing(box):
    """Rank 0's watch of its cancel file: a file whose ids are hostile names another job: ignored (logged once),
    and nothing is written anywhere."""
    from clusterctl.rank.cancelfile import CancelWatch, cancel_path

    rd = box.runs[1]
    t = [0.0]
    logs: list[str] = []
    w = CancelWatch(str(rd), "dep-1", "job-1", log=logs.append, clock=lambda: t[0])
    path = cancel_path(rd, "dep-1")

    @fuzz_settings(0.5)
    @given(st.sampled_from(["deployment_id", "job_id"]), ID_TEXT)
    def run(field, ident):
        ident = box.real(ident)
        doc = {"schema_version": 1, "type": "cancel", "deployment_id": "dep-1", "job_id": "job-1", "epoch": 10**6,
               "requests": None, "created_at": 1.0, field: ident}
        tmp = rd / ".c.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
        before = box.listing()
        t[0] += 1.0
        got = w.poll()
        assert got is None or (got.deployment_id, got.job_id) == ("dep-1", "job-1"), (got, ident)
        assert box.listing() == before
        count("refused" if got is None else "accepted")

    run()
