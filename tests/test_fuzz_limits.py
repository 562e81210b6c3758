"""Fuzzing of configuration values at their limits, through `clusterctl plan` (the CLI entry, in a worker process).

The fields come from the code and the samples, not from a hand list: every key the model reader asks
config.json for (the string arguments of ``_int_cfg`` / ``_cfg`` calls in ``clusterctl.plan.model`` and
``clusterctl.plan.kvcache``, each alias with the keys before it removed so that the alias is the one read; the
random test nests them under ``text_config`` too), every numeric leaf of a sample config.json (a quantized one
too), and every numeric field of a node in a sample cluster.toml. Each gets the values at the limits: 0, -1, 2**31, 2**63, 10**12, 10**100,
1e308, NaN, Infinity, a string, a bool, null, a list, an object, and the reader's own MAX_* bounds and one past.

The promise: a plan (exit 0) or a clean refusal (65, 66, 78) with the CLI's usual one-line error — never an
internal error (exit 70), a MemoryError or an OverflowError, and never more than 1 GiB of memory for a model of
a few KiB (a refusal that says bad_alloc / MemoryError under the cap counts as needing more). The cases run in
one worker process (fuzzutil.CliWorker) under an address-space cap (RLIMIT_AS: what it maps plus 1 GiB), so a
value that makes plan allocate per layer or per token fails fast (and is reported: a MemoryError, or the worker
killed by an abort in native code, then restarted) instead of swapping the machine or taking the test run down.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzutil import counting_fixtures, CliWorker, cli_problems, count, fuzz_settings

pytestmark = pytest.mark.slow  # fuzzers: every field at its limits (minutes)

LIMITS = [0, -1, 1, 2, 65536, 65537, 2**24 + 1, 2**31 - 1, 2**31, 2**53 + 1, 2**63, 2**64, 10**12, 10**19, 10**100,
          -(2**63), 0.5, 1e-300, 1e308, -1e308, float("nan"), float("inf"), float("-inf"), "12", "", True, False,
          None, [1], {}]
# the sweep of every config.json key (there are dozens, and a plan that passes costs ~40 ms): the values that
# stand for each class of the list above; the random test draws from all of them
CONFIG_LIMITS = [0, -1, 2**31, 2**63, 10**12, 10**100, 0.5, 1e308, float("nan"), float("inf"), "12", True, None,
                 [1], {}]
ALIAS_LIMITS = [-1, 2**63, "12", None]  # an alias goes through the same check as its key


def declared_limits() -> list[int]:
    """The bounds the model reader declares (its modules' MAX_* / MIN_* integers), and one past each."""
    import clusterctl.plan.model as model
    import clusterctl.modelfiles.folder as files

    out = []
    for name, v in sorted({**vars(files), **vars(model)}.items()):
        if name.startswith(("MAX_", "MIN_")) and isinstance(v, int) and not isinstance(v, bool):
            out += [v, v + 1 if name.startswith("MAX_") else v - 1]
    return out
CLEAN = {0, 65, 66, 78}
MEMORY_CAP = 1 << 30  # what plan may take beyond its start, for a model of a few KiB
TINY = "4-layer, 32-wide"
OUT_OF_MEMORY = ("bad_alloc", "MemoryError", "memory allocation of", "Cannot allocate memory")
FAST_ROOT = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None  # plan fsyncs what it writes


def config_keys() -> list[tuple[str, ...]]:
    """The key groups the model reader asks config.json for: the string arguments of each ``_int_cfg(...)`` and
    ``_cfg(...)`` call in clusterctl.plan.model and clusterctl.plan.kvcache, in the order it tries them."""
    import clusterctl.plan.kvcache as kvcache
    import clusterctl.plan.model as model

    groups = []
    for node in ast.walk(ast.parse(inspect.getsource(model) + "\n" + inspect.getsource(kvcache))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("_int_cfg", "_cfg"):
            keys = tuple(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
            if keys and keys not in groups:
                groups.append(keys)
    return groups


def numeric_leaves(doc, prefix=()):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from numeric_leaves(v, prefix + (k,))
    elif isinstance(doc, (int, float)) and not isinstance(doc, bool):
        yield prefix


def _set(doc: dict, path: tuple, value) -> dict:
    out = json.loads(json.dumps(doc))
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def cluster_text(nodes: list[dict]) -> str:
    lines = ["[cluster]", 'name = "lim"']
    for n in nodes:
        lines.append("[[node]]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in n.items() if v is not None]
    return "\n".join(lines) + "\n"


class Lab:
    def __init__(self, root: Path):
        from modelfiles import make_model

        self.root = root
        self.state = root / "state"
        self.cluster = root / "cluster.toml"
        self.models = {}
        for name, kw in (("plain", {}), ("quantized", {"quant_bits": 4, "hidden": 64})):
            folder = make_model(root / name, layers=4, hidden=kw.pop("hidden", 32), inter=64, vocab=64, **kw)
            self.models[name] = (folder, json.loads((folder / "config.json").read_text()))
        self.nodes = [{"name": n, "local": True, "memory_gb": 4.0, "usable_fraction": 0.8, "speed": 1.0, "port": 22,
                       "runtime_dir": f"{root}/run-{n}"} for n in "ab"]

    def restore(self) -> None:
        for folder, sample in self.models.values():
            (folder / "config.json").write_text(json.dumps(sample))
        self.cluster.write_text(cluster_text(self.nodes))

    def warm_up(self) -> None:
        """The worker runs one plan before its memory is capped: imports and first-use work are done then."""
        folder, _ = self.models["plain"]
        self.restore()
        warm = ["plan", "-c", str(self.cluster), "-m", str(folder), "--state-dir", str(self.state), "--json", "-q"]
        self.worker = CliWorker(extra_memory=MEMORY_CAP, warm=warm)
        self.worker.ensure()

    def plan(self, model: str, config: dict | None = None, nodes: list[dict] | None = None,
             allocation: str = "balanced"):
        folder, sample = self.models[model]
        if not self.worker.alive:  # (re)started on the samples: its warm-up must be a plan that works
            self.restore()
            self.worker.ensure()
        (folder / "config.json").write_text(json.dumps(sample if config is None else config))
        self.cluster.write_text(cluster_text(self.nodes if nodes is None else nodes))
        argv = ["plan", "-c", str(self.cluster), "-m", str(folder), "--state-dir", str(self.state),
                "--allocation", allocation, "--json"]
        how, r = self.worker.run(argv, cwd=str(self.root))
        if how != "ok":
            count("crashed")
            if how == "died":
                return [f"plan killed its process ({r}: an abort in native code, often memory)"], None
            return [f"plan did not answer in {r} s"], None
        bad = cli_problems(r, argv, [], [])
        if r.code not in CLEAN:
            bad.append(f"exit {r.code}")
        elif r.code and any(m in r.stderr for m in OUT_OF_MEMORY):
            # refused, but only because the cap stopped it: uncapped, plan would have taken that memory (and time)
            bad.append(f"plan needed more than {MEMORY_CAP >> 30} GiB beyond its start for a {TINY} model: "
                       f"{[ln for ln in r.stderr.splitlines() if ln.startswith('error:')][:1]}")
        count("accepted" if r.code == 0 else "refused")
        return bad, r


@pytest.fixture(scope="module")
def lab():
    root = Path(tempfile.mkdtemp(prefix="limits-fuzz-", dir=FAST_ROOT))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(root)
            mp.setenv("CLUSTERCTL_STATE_DIR", str(root / "state"))
            lab = Lab(root)
            lab.warm_up()
            try:
                yield lab
            finally:
                lab.worker.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


_count_cases, _report_cases = counting_fixtures("limit fuzz cases per source")


def _fail_with(found: dict) -> None:
    if found:
        pytest.fail(f"{len(found)} case(s) break a promise:\n  "
                    + "\n  ".join(f"{k}: {'; '.join(dict.fromkeys(v))}" for k, v in found.items()), pytrace=False)


def test_the_samples_plan(lab):
    for model in lab.models:
        bad, r = lab.plan(model)
        assert r.code == 0 and not bad, (model, r.stderr[-500:])


def test_config_json_fields_at_their_limits(lab):
    """Every key the model reader asks for and every numeric leaf of the samples, with a value of each class of
    limits and the reader's own declared bounds (and one past them); each alias, made the one read, with a few
    (the random test nests keys under text_config too)."""
    found = {}
    cases = []
    groups = config_keys()
    assert any("num_hidden_layers" in g for g in groups), f"the model reader's keys were not found: {groups}"
    values = CONFIG_LIMITS + declared_limits()
    for model, (_, sample) in lab.models.items():
        for group in groups if model == "plain" else []:  # the quantized sample adds its own leaves below
            for i, key in enumerate(group):
                base = {k: v for k, v in sample.items() if k not in group[:i]}
                cases.append((model, f"{key}", lambda v, base=base, key=key: {**base, key: v},
                              values if i == 0 else ALIAS_LIMITS))
        for path in numeric_leaves(sample):
            if len(path) > 1:  # top-level keys are covered above
                cases.append((model, ".".join(path), lambda v, path=path, sample=sample: _set(sample, path, v),
                              values))
    for model, where, make, vals in cases:
        for v in vals:
            bad, _ = lab.plan(model, make(v))
            if bad:
                found[f"{model} config.json {where} = {v!r}"[:120]] = bad
    _fail_with(found)


def test_cluster_toml_fields_at_their_limits(lab):
    """Every numeric field of a node (memory_gb, usable_fraction, speed, port, and any the sample gains), with
    every limit value; the allocation rotates (speed always with --allocation speed, which reads it)."""
    found = {}
    fields = [k for k, v in lab.nodes[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    assert "memory_gb" in fields
    allocations = ("balanced", "proportional", "speed")
    for field in fields:
        for i, v in enumerate(LIMITS):
            nodes = [dict(lab.nodes[0], **{field: v}), lab.nodes[1]]
            allocation = allocations[i % 3] if field != "speed" else "speed"
            bad, _ = lab.plan("plain", nodes=nodes, allocation=allocation)
            if bad:
                found[f"cluster.toml node.{field} = {v!r} --allocation {allocation}"[:120]] = bad
    _fail_with(found)


def test_random_config_values(lab):
    """Hypothesis: two or three reader keys at once, random big or odd numbers, at the top level or nested under
    text_config (how wrapper models ship: the reader looks there when the top level has no layer count)."""
    keys = sorted({k for g in config_keys() for k in g})
    numbers = st.one_of(st.integers(-(2**70), 2**70), st.integers(0, 2**20), st.floats(), st.sampled_from(LIMITS))

    @fuzz_settings(0.3)
    @given(st.dictionaries(st.sampled_from(keys), numbers, min_size=2, max_size=3), st.booleans())
    def run(changes, nested):
        _, sample = lab.models["plain"]
        config = {**sample, **changes}
        if nested:
            config = {"model_type": sample["model_type"], "text_config": config}
        bad, _ = lab.plan("plain", config)
        assert not bad, bad

    run()
