"""Property-based and mutation fuzzing of every parser that reads a file from disk or the network.

Each parser gets a valid sample and hypothesis-made variants of it: random bytes, truncations, flipped bytes,
and structural mutations (a JSON leaf or a TOML value replaced by another type, huge numbers, deep nesting),
re-signed where a signature would otherwise stop them before the schema check. The promise checked: the parser
returns a valid object or raises ClusterctlError (one line, an exit code) — never another exception, which would
reach the user as a traceback. Case counts: `pytest tests/test_fuzz.py --hypothesis-show-statistics`
(MAX_EXAMPLES per parser and source of variants, env CLUSTERCTL_FUZZ_EXAMPLES; docs/testing.md).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzutil import (counting_fixtures, FUZZ, JSON_ANY, byte_variants, count, fuzz_settings, json_variants,
                      only_clean_errors, write_file as _write)

pytestmark = pytest.mark.slow  # fuzzers: hundreds of cases per test, 10-25 s each


_count_cases, _report_cases = counting_fixtures("fuzz cases per parser")


# ---- samples -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    from clusterctl.protocol.signing import Keyring

    ring = Keyring(tmp_path_factory.mktemp("keys"))
    return ring.signing_key(), ring.public_keys()


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


CLUSTER_TOML = b'''[cluster]
name = "lab"
[[node]]
name = "a"
host = "10.0.0.1"
ips = ["10.0.0.1"]
memory_gb = 64
model_path = "/models/m"
[[node]]
name = "b"
local = true
memory_gb = 16.5
speed = 12.5
runtime_dir = "/tmp/x"
[[node.links]]
peer = "a"
type = "thunderbolt"
rdma = true
device = "rdma_en3"
'''


# ---- cluster.toml ------------------------------------------------------------------------------------------------

def test_cluster_toml_bytes(tmp_path):
    from clusterctl.plan.inventory import load_cluster

    assert load_cluster(_write(tmp_path, "c.toml", CLUSTER_TOML)).name == "lab"

    @FUZZ
    @given(byte_variants(CLUSTER_TOML))
    def run(data):
        only_clean_errors(load_cluster, _write(tmp_path, "c.toml", data))

    run()


def test_cluster_toml_values():
    import tomllib

    from clusterctl.plan.inventory import parse_cluster

    doc = tomllib.loads(CLUSTER_TOML.decode())

    @FUZZ
    @given(json_variants(doc).filter(lambda d: isinstance(d, dict)))  # a TOML document is always a table
    def run(d):
        only_clean_errors(parse_cluster, d)

    run()


# ---- signed files: deployment, launch manifest ---------------------------------------------------------------------

def test_deployment_file_bytes_and_resigned_structures(deployment, keys):
    from clusterctl.atomic import dumps
    from clusterctl.protocol.deployment import KIND, decode, encode
    from clusterctl.protocol.signing import sign_payload

    key, trusted = keys
    good = encode(deployment, key)
    assert decode(good, trusted).deployment.deployment_id == deployment.deployment_id
    doc = deployment.model_dump(mode="json")

    @FUZZ
    @given(byte_variants(good))
    def raw(data):
        only_clean_errors(decode, data, trusted)

    @FUZZ
    @given(json_variants(doc))
    def signed(d):  # behind a valid signature: the schema and the v1 migration must hold their ground
        if isinstance(d, dict) and d:  # what can be signed at all is a non-empty object
            only_clean_errors(decode, sign_payload(dumps(d), KIND, key), trusted)

    raw()
    signed()


def test_launch_manifest_bytes_and_resigned_structures(tmp_path, keys):
    from clusterctl.atomic import dumps
    from clusterctl.statedir.manifest import KIND, LaunchManifest, ManifestStore, this_coordinator
    from clusterctl.protocol.signing import sign_payload

    key, trusted = keys
    store = ManifestStore(tmp_path, key, trusted)
    m = LaunchManifest(job_id="j1", deployment_id="d", plan_hash="h", deployment_file="/d.json", created_at="t",
                       nonce="n", coordinator=this_coordinator(), nodes=[], ranks=[])
    path = store.save(m)
    good = path.read_bytes()
    doc = m.model_dump(mode="json")

    @FUZZ
    @given(byte_variants(good))
    def raw(data):
        only_clean_errors(store.load, _write(tmp_path, "j1.json", data))

    @FUZZ
    @given(json_variants(doc))
    def signed(d):
        if isinstance(d, dict) and d:
            only_clean_errors(store.load, _write(tmp_path, "j1.json", sign_payload(dumps(d), KIND, key)))

    raw()
    signed()


def test_rank_contract(tmp_path, deployment, keys):
    from clusterctl.atomic import dumps
    from clusterctl.protocol.contract import contract_kind, encode_contract, load_rank_contract
    from clusterctl.protocol.deployment import encode
    from clusterctl.protocol.signing import sign_payload

    key, trusted = keys
    (tmp_path / "trusted-keys").mkdir()
    for pub in trusted:
        (tmp_path / "trusted-keys" / f"{pub.key_id}.pub").write_text(pub.to_text())
    dep_bytes = encode(deployment, key)
    spec = {"deployment_id": deployment.deployment_id, "job_id": "j", "nonce": "n", "node": "a", "rank": 0,
            "world_size": 2, "model_path": "/m", "start_layer": 4, "end_layer": 8, "layer_counts": [4, 4],
            "num_layers": 8, "hostfile": "/h", "http_port": 8000, "runtime_dir": "/r", "marker_path": "/r/m",
            "gate_path": "/r/g"}
    good = encode_contract(dep_bytes, spec, key)
    assert load_rank_contract(_write(tmp_path, "c.contract", good), "a").rank == 0
    payload = {"schema_version": 1, "type": "rank-contract", "node": "a", "rank": 0, "job_id": "j",
               "deployment_id": deployment.deployment_id, "spec": spec}

    @FUZZ
    @given(byte_variants(good))
    def raw(data):
        only_clean_errors(load_rank_contract, _write(tmp_path, "c.contract", data), "a")

    @FUZZ
    @given(json_variants(payload))
    def signed(d):  # a validly signed contract whose fields are wrong: refused, never a crash
        if not isinstance(d, dict):
            return
        d = {**d, "deployment": dep_bytes.decode()}
        only_clean_errors(load_rank_contract,
                          _write(tmp_path, "c.contract", sign_payload(dumps(d), contract_kind("a"), key)), "a")

    raw()
    signed()


# ---- node files: markers, leases, cancel files and acks ---------------------------------------------------------

def _json_file_cases(tmp_path, name, reader, doc):
    good = json.dumps(doc).encode()
    assert reader(_write(tmp_path, name, good)) is not None

    @FUZZ
    @given(byte_variants(good))
    def raw(data):
        only_clean_errors(reader, _write(tmp_path, name, data))

    @FUZZ
    @given(json_variants(doc))
    def structure(d):
        only_clean_errors(reader, _write(tmp_path, name, json.dumps(d).encode()))

    raw()
    structure()


def test_marker(tmp_path):
    from clusterctl.protocol.runtimefiles import read_marker

    _json_file_cases(tmp_path, "m.json", read_marker, {
        "schema_version": 1, "type": "rank-marker", "deployment_id": "d", "job_id": "j", "nonce": "n", "rank": 0,
        "node": "a", "host": "h", "pid": 123, "pgid": 123, "start_time": 1.5, "boot_id": "b", "state": "serving",
        "active_requests": ["r1"], "cancel_epoch": 3, "heartbeat_at": 2.5, "env": {"MLX_RANK": "0"}})


def test_lease(tmp_path):
    from clusterctl.protocol.runtimefiles import read_lease

    _json_file_cases(tmp_path, "l.json", read_lease,
                     {"schema_version": 1, "type": "lease", "holder": "h", "seq": 4, "duration_s": 30.0})


def test_cancel_file_and_ack(tmp_path):
    from clusterctl.protocol.runtimefiles import read_ack, read_cancel

    _json_file_cases(tmp_path, "c.json", read_cancel, {"schema_version": 1, "type": "cancel", "deployment_id": "d",
                                                       "job_id": "j", "epoch": 2, "requests": ["a"],
                                                       "created_at": 1.0})
    _json_file_cases(tmp_path, "a.json", read_ack, {"schema_version": 1, "type": "cancel-ack", "deployment_id": "d",
                                                    "job_id": "j", "rank": 1, "epoch": 2, "applied": [], "at": 1.0})


def test_model_manifest(tmp_path):
    from clusterctl.atomic import read_json
    from clusterctl.modelfiles.manifest import FileHash, check_manifest, manifest_hash

    files = [FileHash(path="config.json", size=10, sha256="a" * 64),
             FileHash(path="model.safetensors", size=99, sha256="b" * 64)]
    doc = {"schema_version": 1, "type": "model-manifest", "name": "m", "total_bytes": 109,
           "files": [f.model_dump() for f in files], "manifest_hash": manifest_hash(files)}
    check_manifest(doc)

    def reader(path):
        return check_manifest(read_json(path, what="model manifest"), str(path))

    _json_file_cases(tmp_path, "mf.json", reader, doc)


def test_replan_history(tmp_path):
    from clusterctl.statedir import history
    from clusterctl.statedir.state import StateDir

    state = StateDir(tmp_path)
    (tmp_path / "history").mkdir()

    def reader(path):
        return history.entries(state, "c")

    _json_file_cases(tmp_path / "history", "c.json", reader, {"cluster": "c", "entries": [
        {"applied_at": "t", "from": "a", "from_hash": "h", "to": "b", "to_hash": "i", "changes": [], "file": None,
         "relaunched": None}]})


# ---- safetensors headers -----------------------------------------------------------------------------------------

def test_safetensors_header(tmp_path):
    from clusterctl.plan.model import read_safetensors_header

    header = json.dumps({"__metadata__": {"format": "pt"},
                         "w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                         "b": {"dtype": "BF16", "shape": [2], "data_offsets": [16, 20]}}).encode()
    good = struct.pack("<Q", len(header)) + header + bytes(20)
    read_safetensors_header(_write(tmp_path, "t.safetensors", good))
    doc = json.loads(header)

    @FUZZ
    @given(byte_variants(good))
    def raw(data):
        only_clean_errors(read_safetensors_header, _write(tmp_path, "t.safetensors", data))

    @FUZZ
    @given(json_variants(doc))
    def structure(d):
        h = json.dumps(d).encode()
        only_clean_errors(read_safetensors_header,
                          _write(tmp_path, "t.safetensors", struct.pack("<Q", len(h)) + h + bytes(20)))

    raw()
    structure()


# ---- rank 0's request bodies ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.utils import load_tokenizer

    from clusterctl.modelfiles import tiny

    return load_tokenizer(tiny.build(Path(__file__).resolve().parents[1] / ".cache" / "tiny-model-test"))


def test_request_bodies(tokenizer):
    """Any JSON body: an ApiRequest whose prepare() yields a request within the context, or a 4xx ApiError."""
    from clusterctl.rank.api.openai import ApiError, RequestBuilder
    from clusterctl.rank.api.requests import REQUESTS, parse
    from clusterctl.protocol.rankspec import RankSpec

    spec = RankSpec(deployment_id="d", job_id="j", nonce="n", node="a", rank=0, world_size=1, model_path="/m",
                    start_layer=0, end_layer=8, layer_counts=[8], num_layers=8, http_port=1, runtime_dir="/r",
                    marker_path="/r/m", gate_path="/r/g")
    from clusterctl.rank.api.admission import Limits, Preparer

    builder = RequestBuilder(spec, Limits(context=512, model_context=4096, vocab=len(tokenizer.get_vocab()),
                                          token_bytes=82))
    preparer = Preparer(tokenizer)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.5, "top_p": 0.9,
            "stop": ["x"], "seed": 3, "stream": True, "stream_options": {"include_usage": True}}
    completion = {"prompt": "def f():", "max_tokens": 8, "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.1}

    def one(kind, body):
        try:
            job = builder.build(parse(REQUESTS[kind], body))
            req = preparer.prepare(job)
        except ApiError as e:
            assert 400 <= e.status < 500 and e.message, (e.status, e.message)
            count("refused")
            return
        count("accepted")
        assert 1 <= req.max_tokens and len(req.tokens) + req.max_tokens <= 512 and req.tokens

    @FUZZ
    @given(st.one_of(json_variants(chat).map(lambda b: ("chat", b)),
                     json_variants(completion).map(lambda b: ("completion", b)),
                     JSON_ANY.map(lambda b: ("chat", b)), JSON_ANY.map(lambda b: ("completion", b))))
    def run(case):
        kind, body = case
        if not isinstance(body, dict):
            count("refused")
            return  # the HTTP layer answers 400 before a builder sees a non-object (tests/rank)
        one(kind, body)

    run()


def test_constrained_chat_bodies_on_a_thinking_template(tmp_path_factory):
    """Chat bodies with tools, tool_choice and response_format, varied, on a template whose generation prompt opens
    <think> (tests/toolmodels.py): a 4xx, or a request whose grammar compiles; and when the request forces a call
    or a JSON answer as given (not varied) on a prompt that opened the block, the grammar lets the reasoning end
    and closes the answer within max_tokens whatever the model picks (random tokens the mask allows), the answer
    after the reasoning (issue 41: it landed in the reasoning, or ran to max_tokens with no call)."""
    import numpy as np
    import toolmodels
    from mlx_lm.tokenizer_utils import load

    from clusterctl.rank.api import tools as T
    from clusterctl.rank.api.admission import Limits, Preparer
    from clusterctl.rank.grammar.compiler import Compiler, GrammarRefused
    from clusterctl.rank.api.openai import ApiError, RequestBuilder
    from clusterctl.rank.api.requests import ChatRequest, parse
    from clusterctl.protocol.rankspec import RankSpec

    tok = load(toolmodels.write_tokenizer(tmp_path_factory.mktemp("thinktok") / "t"))
    spec = RankSpec(deployment_id="d", job_id="j", nonce="n", node="a", rank=0, world_size=1, model_path="/m",
                    start_layer=0, end_layer=8, layer_counts=[8], num_layers=8, http_port=1, runtime_dir="/r",
                    marker_path="/r/m", gate_path="/r/g")
    builder = RequestBuilder(spec, Limits(context=512, model_context=4096, vocab=len(tok), token_bytes=82))
    preparer = Preparer(tok)
    compiler = Compiler(tok)  # admission's compile (rank 0's Api): its roll-outs have no time bound, so what is
    factory = compiler.factory()  # checked does not depend on the machine's load
    add = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a"]}}}
    pick = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"c": {"enum": ["r", "g"]}}, "required": ["c"]}}}
    msgs = [{"role": "user", "content": "hi"}]
    bases = [
        {"messages": msgs, "tools": [add, pick], "tool_choice": "required", "max_tokens": 40},
        {"messages": msgs, "tools": [add], "tool_choice": {"type": "function", "function": {"name": "add"}},
         "max_tokens": 32},
        {"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}}},
         "max_tokens": 24},
        {"messages": msgs, "response_format": {"type": "json_object"}, "max_tokens": 16},
        {"messages": msgs, "tools": [add], "tool_choice": "none", "max_tokens": 8,
         "chat_template_kwargs": {"enable_thinking": False}},
    ]
    shaping = ("tools", "tool_choice", "response_format", "max_tokens", "chat_template_kwargs")

    def one(body, seed):
        try:
            job = builder.chat(parse(ChatRequest, body))
            req = preparer.prepare(job)
            c = compiler.admit(req)  # admitted: it compiled, within its bounds (a GrammarRefused is a 400)
        except ApiError as e:
            assert 400 <= e.status < 500 and e.message, (e.status, e.message)
            count("refused")
            return
        except GrammarRefused as e:
            assert str(e) and "\n" not in str(e), e
            count("refused")
            return
        count("accepted")
        if c is None:
            return
        base = next((b for b in bases if all(b.get(k) == body.get(k) for k in shaping)), None)
        if base is None or T.initial_state(tok, req.tokens) != "reasoning":
            return
        rng = np.random.default_rng(seed)
        out = []
        while len(out) < req.max_tokens and not c.done:
            allowed = np.flatnonzero(np.array(c.mask()))
            t = int(rng.choice(allowed))
            if t in factory.eos:
                break
            c.advance(t)
            out.append(t)
        assert c.accepting and tok.think_end_id in out, (body, tok.decode(out))
        sp = job.splitter
        reply = sp.feed(tok.decode(out)) + sp.finish("stop")
        kinds = {e.kind for e in reply}
        assert ("tool_call" if "tools" in body else "content") in kinds, (body, tok.decode(out), reply)
        count("answered after the reasoning")

    @fuzz_settings(0.5)
    @given(st.sampled_from(range(len(bases))).flatmap(
        lambda i: st.one_of(st.just(bases[i]), json_variants(bases[i]))), st.integers(0, 1 << 16))
    def run(body, seed):
        if isinstance(body, dict):
            one(body, seed)
        else:
            count("refused")

    run()
