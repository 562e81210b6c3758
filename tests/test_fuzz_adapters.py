"""Fuzzing of LoRA adapter folders through `clusterctl plan --adapter` (the CLI entry, in-process), seeded.

Each case starts from a true adapter of the tiny random-weight model (tests/adaptermodels.py: a drawn
num_layers, rank, keys, LoRA or DoRA, dropout), then changes up to three things: a field of adapter_config.json
to a value at its limits (NaN, Infinity, 0, -1, 2**63, a string, a bool, null, a list, a module the model does not
have, ...), or its tensors (one dropped, one added for no LoRA layer, one transposed).

The promise: a clean refusal (exit 66 or 78, one `error:` line, no traceback) or an adapter that really serves
what it says: mlx-lm's own ``load(model, adapter_path=...)`` takes it, the rank's ``apply_adapter`` takes it and
gives the same logits, and those differ from the base model's (the adapter is not silently dropped).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptermodels import adapted_logits, build_adapter
from fuzzutil import cli_problems, count, counting_fixtures, fuzz_settings, run_cli

pytestmark = pytest.mark.slow  # a fuzzer (about 10 s)

_count_cases, _report_cases = counting_fixtures("adapter folders fuzzed through plan --adapter")

CLEAN = {66, 78}
TOKENS = [5, 17, 3, 99, 42, 7, 1, 64]
KEYS = [None, ["self_attn.q_proj", "self_attn.v_proj"], ["mlp.down_proj"]]
LIMITS = [0, -1, 1, 2, 8, 9, 2**31, 2**63, 10**100, 0.5, 1e-300, 1e308, float("nan"), float("inf"),
          float("-inf"), "4", "", True, False, None, [1], {}]
FIELDS = {  # where a config change goes, and the values besides LIMITS that mean something there
    ("fine_tune_type",): ["lora", "dora", "full", "LoRA"],
    ("num_layers",): [],
    ("lora_parameters", "rank"): [3, 4, 8],
    ("lora_parameters", "scale"): [-20.0, 1e-6],
    ("lora_parameters", "dropout"): [0.05, 0.99, 1.0],
    ("lora_parameters", "keys"): [[], ["self_attn.nope"], ["input_layernorm"], ["lm_head"], "self_attn.q_proj",
                                  ["self_attn.q_proj"], ["mlp.down_proj", "self_attn.q_proj"], [None]],
}
GONE = object()  # the field removed


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    from rankharness import tiny_model_path

    model = tiny_model_path()
    root = tmp_path_factory.mktemp("fuzz-adapters")
    cluster = root / "cluster.toml"
    cluster.write_text('[cluster]\nname = "lab"\n[[node]]\nname = "a"\nmemory_gb = 64\n')
    base = adapted_logits(model, None, TOKENS, rank_side=False)
    return model, root, cluster, base


def _change_config(folder: Path, path: tuple, value) -> None:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    node = cfg
    for k in path[:-1]:
        node = node[k]
    if value is GONE:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value
    (folder / "adapter_config.json").write_text(json.dumps(cfg))  # NaN and Infinity as Python's json writes them


def _change_tensors(folder: Path, how: str, pick: int) -> None:
    import mlx.core as mx

    file = str(folder / "adapters.safetensors")
    weights = dict(mx.load(file))
    if not weights:  # all dropped already
        return
    name = sorted(weights)[pick % len(weights)]
    if how == "drop":
        weights.pop(name)
    elif how == "extra":
        weights[name.replace("layers.", "layers.1", 1).replace("proj", "prj")] = weights[name]
    else:
        weights[name] = weights[name].T if weights[name].ndim == 2 else weights[name][:-1]
    mx.save_safetensors(file, weights)


CHANGE = st.one_of(
    st.sampled_from(sorted(FIELDS)).flatmap(
        lambda f: st.tuples(st.just("config"), st.just(f), st.sampled_from([GONE, *FIELDS[f], *LIMITS]))),
    st.tuples(st.just("tensors"), st.sampled_from(["drop", "extra", "transpose"]), st.integers(0, 1000)),
)


def _serves_what_it_says(model: Path, folder: Path, base) -> list[str]:
    import mlx.core as mx

    try:
        want = adapted_logits(model, folder, TOKENS, rank_side=False)
    except Exception as e:  # noqa: BLE001  (whatever mlx-lm raises is the finding)
        return [f"planned, but mlx-lm's own load refuses it: {type(e).__name__}: {str(e)[:160]}"]
    try:
        got = adapted_logits(model, folder, TOKENS, rank_side=True)
    except Exception as e:  # noqa: BLE001
        return [f"planned, but the rank refuses it: {type(e).__name__}: {str(e)[:160]}"]
    bad = []
    if mx.abs(got - want).max().item() > 1e-4:
        bad.append(f"the rank's logits differ from mlx-lm's by {mx.abs(got - want).max().item():.3g}")
    if mx.abs(want - base).max().item() < 1e-6:
        bad.append("planned, but it serves the base model (the adapter changes nothing)")
    return bad


@fuzz_settings(0.1)
@given(num_layers=st.sampled_from([1, 2, 8]), rank=st.sampled_from([1, 4]), keys=st.sampled_from(KEYS),
       dora=st.booleans(), dropout=st.sampled_from([0.0, 0.1]), changes=st.lists(CHANGE, max_size=3))
def test_every_planned_adapter_serves_what_it_says(tiny_setup, num_layers, rank, keys, dora, dropout, changes):
    model, root, cluster, base = tiny_setup
    folder = root / "lora"
    shutil.rmtree(folder, ignore_errors=True)
    build_adapter(model, folder, num_layers=num_layers, rank=rank, keys=keys, dora=dora, dropout=dropout)
    said = []
    for what, where, arg in changes:
        if what == "config":
            _change_config(folder, where, arg)
            said.append(f"{'.'.join(where)}={'(gone)' if arg is GONE else repr(arg)[:40]}")
        else:
            _change_tensors(folder, where, arg)
            said.append(f"tensors: {where} #{arg}")
    argv = ["plan", "-c", str(cluster), "-m", str(model), "--adapter", str(folder)]
    r = run_cli(argv, env={"CLUSTERCTL_STATE_DIR": str(root / "state")})
    bad = cli_problems(r, argv, [], [])
    if r.code == 0:
        count("accepted")
        bad += _serves_what_it_says(model, folder, base)
    elif r.code in CLEAN:
        count("refused")
        if len([ln for ln in r.stderr.splitlines() if ln.strip()]) > 2:
            bad.append(f"the refusal is not one line: {r.stderr[:200]!r}")
    else:
        bad.append(f"exit {r.code}: {r.stderr.strip()[-200:]}")
    assert not bad, f"{said}: {bad}"
