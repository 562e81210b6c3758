"""The tiny random-weight qwen2: deterministic bytes, idempotent reuse, loads with mlx-lm, no half-built folder."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterctl.modelfiles import tiny
from clusterctl.errors import ConfigError

from rankharness import reference_tokens, tiny_model_path

pytestmark = pytest.mark.slow  # every test here builds tiny models

SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, corpus_bytes=200_000)


def _digests(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def test_same_parameters_give_the_same_bytes_and_another_seed_does_not(tmp_path):
    a = tiny.build(tmp_path / "a", **SMALL)
    b = tiny.build(tmp_path / "b", **SMALL)
    c = tiny.build(tmp_path / "c", **SMALL, seed=1)
    da, db, dc = _digests(a), _digests(b), _digests(c)
    assert set(da) >= {"config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
                       "tokenizer_config.json", tiny.PARAMS_FILE}
    assert da == db
    assert da["model.safetensors"] != dc["model.safetensors"]
    assert da["tokenizer.json"] == dc["tokenizer.json"]  # the tokenizer does not depend on the seed


def test_reuse_is_idempotent_and_other_parameters_are_refused(tmp_path):
    p = tiny.build(tmp_path / "m", **SMALL)
    st = (p / "model.safetensors").stat()
    assert tiny.build(tmp_path / "m", **SMALL) == p
    again = (p / "model.safetensors").stat()
    assert (again.st_ino, again.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)  # reused, not rebuilt
    with pytest.raises(ConfigError, match="other parameters"):
        tiny.build(tmp_path / "m", **{**SMALL, "layers": 3})
    tiny.build(tmp_path / "m", **{**SMALL, "layers": 3}, overwrite=True)
    assert json.loads((p / "config.json").read_text())["num_hidden_layers"] == 3
    assert not [d for d in tmp_path.iterdir() if d.name.startswith(".")]


def test_a_foreign_folder_is_never_touched(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a tiny model"):
        tiny.build(d, **SMALL, overwrite=True)
    assert (d / "notes.txt").read_text() == "keep me"


def test_a_damaged_model_is_rebuilt_only_on_request(tmp_path):
    p = tiny.build(tmp_path / "m", **SMALL)
    with open(p / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError):
        tiny.build(p, **SMALL)
    tiny.build(p, **SMALL, overwrite=True)
    assert _digests(p) == _digests(tiny.build(tmp_path / "fresh", **SMALL))


def test_a_killed_build_leaves_no_model_and_the_next_build_cleans_up(tmp_path):
    target = tmp_path / "big"
    code = ("import sys; from clusterctl.modelfiles import tiny; "
            "tiny.build(sys.argv[1], layers=8, hidden=512, heads=8, kv_heads=4, vocab=1024)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(target)])
    deadline = time.monotonic() + 60
    try:
        while not any(d.name.startswith(".big.tmp-") for d in tmp_path.iterdir()):
            assert proc.poll() is None, "build finished before it could be interrupted"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(10)
    assert not target.exists()
    tiny.build(target, **SMALL)
    assert (target / "model.safetensors").is_file()
    assert [d.name for d in tmp_path.iterdir()] == ["big"]


def test_loads_with_mlx_lm_untied_and_greedy_output_varies():
    path = tiny_model_path()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["tie_word_embeddings"] is False
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" in index["weight_map"]
    tokens = reference_tokens(path, "def main(argv):", 48)
    assert len(tokens) == 48
    assert len(set(tokens)) > 24  # not one token repeated
    tc = json.loads((path / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>" and "<|im_start|>" in tc["chat_template"]


def test_bench_preset_is_about_100m_parameters():
    p = tiny.BENCH_100M
    head = p["hidden"] // p["heads"]
    per_layer = (p["hidden"] * head * (2 * p["heads"] + 2 * p["kv_heads"]) + 3 * p["hidden"] * p["intermediate"])
    total = p["layers"] * per_layer + 2 * p["vocab"] * p["hidden"]
    assert 95e6 < total < 110e6
