"""A tiny random-weight qwen2 model built locally, for tests, demos and benchmarks (no model hub here).

qwen2 is pipeline-capable in mlx-lm; the lm_head is untied and the init std larger than usual so greedy output
varies (tied random embeddings just repeat one token). Weights come from numpy's PCG64 so the same parameters give
the same bytes. The tokenizer is a byte-level BPE trained on the sorted standard-library sources of this Python.

``build(path, ...)`` is idempotent: a folder already holding a model built with the same parameters (recorded in
``clusterctl-tiny.json``) is reused; a new one is built in a temp folder beside it and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import sysconfig
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from clusterctl.atomic import atomic_write_json, clean_stale_folders, read_json
from clusterctl.errors import CannotWrite, ClusterctlError, ConfigError

BUILDER_VERSION = 1
PARAMS_FILE = "clusterctl-tiny.json"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ≈103M parameters (8 layers so a 6/2 split is possible); fp32 ≈ 0.41 GB.
BENCH_100M = dict(layers=8, hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab=6144)


class TinyParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    seed: int
    init_std: float
    max_position_embeddings: int
    corpus_bytes: int
    corpus_sha256: str
    builder_version: int = BUILDER_VERSION


class TinyRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = 1
    type: str = "clusterctl-tiny-model"
    params: TinyParams
    files: dict[str, int]  # name -> size in bytes, checked on reuse


def _corpus(limit: int) -> tuple[list[str], str]:
    """The first ``limit`` bytes of the stdlib's .py files in sorted order, and their digest."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    digest = hashlib.sha256()
    for p in sorted(root.rglob("*.py"), key=lambda q: q.relative_to(root).as_posix()):
        if "site-packages" in p.parts:
            continue
        try:
            data = p.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        data = data[: limit - total]
        text = data.decode("utf-8", errors="ignore")
        texts.append(text)
        digest.update(text.encode())
        total += len(data)
        if total >= limit:
            break
    if not texts:
        raise ConfigError(f"no standard-library sources found under {root} to train the tiny tokenizer")
    return texts, digest.hexdigest()


def _train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def _weights(p: TinyParams) -> dict:
    """Random weights keyed like mlx-lm's qwen2, drawn in sorted-name order from one PCG64 stream."""
    import numpy as np

    head_dim = p.hidden // p.heads
    q, kv = p.heads * head_dim, p.kv_heads * head_dim
    shapes: dict[str, tuple] = {
        "model.embed_tokens.weight": (p.vocab, p.hidden),
        "model.norm.weight": (p.hidden,),
        "lm_head.weight": (p.vocab, p.hidden),
    }
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        shapes.update({
            pre + "input_layernorm.weight": (p.hidden,),
            pre + "post_attention_layernorm.weight": (p.hidden,),
            pre + "self_attn.q_proj.weight": (q, p.hidden),
            pre + "self_attn.q_proj.bias": (q,),
            pre + "self_attn.k_proj.weight": (kv, p.hidden),
            pre + "self_attn.k_proj.bias": (kv,),
            pre + "self_attn.v_proj.weight": (kv, p.hidden),
            pre + "self_attn.v_proj.bias": (kv,),
            pre + "self_attn.o_proj.weight": (p.hidden, q),
            pre + "mlp.gate_proj.weight": (p.intermediate, p.hidden),
            pre + "mlp.up_proj.weight": (p.intermediate, p.hidden),
            pre + "mlp.down_proj.weight": (p.hidden, p.intermediate),
        })
    rng = np.random.default_rng(p.seed)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, dtype=np.float32)
        else:
            out[name] = (rng.standard_normal(shape, dtype=np.float32) * p.init_std).astype(np.float32)
    return out


def _config(p: TinyParams, eos_ids: list[int]) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": p.hidden,
        "num_hidden_layers": p.layers,
        "intermediate_size": p.intermediate,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": p.vocab,
        "max_position_embeddings": p.max_position_embeddings,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": eos_ids,
    }


def _write(folder: Path, p: TinyParams, texts: list[str]) -> None:
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.models import qwen2
    from mlx_lm.utils import save_config, save_model

    tok = _train_tokenizer(texts, p.vocab)
    if tok.get_vocab_size() > p.vocab:
        raise ConfigError(f"tokenizer has {tok.get_vocab_size()} tokens, more than vocab={p.vocab}")
    tok.save(str(folder / "tokenizer.json"))
    eos_ids = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": p.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")

    config = _config(p, eos_ids)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    weights = _weights(p)
    model.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))
    del weights
    try:
        save_model(folder, model, donate_model=True)
    except RuntimeError as e:  # mlx reports a failed write (a full disk) as "[write] Unable to write N bytes"
        import errno

        raise OSError(errno.EIO, f"the weights could not be written ({e}); is the disk full?") from None
    save_config(config, folder / "config.json")


def _matches(path: Path, params: TinyParams) -> bool:
    try:
        rec = TinyRecord.model_validate(read_json(path / PARAMS_FILE, limit=1 << 16, what="tiny model record"))
    except (ClusterctlError, ValueError):
        return False
    if rec.params != params:
        return False
    for name, size in rec.files.items():
        try:
            if (path / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def build(
    path: str | os.PathLike,
    *,
    layers: int = 8,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 2048,
    seed: int = 0,
    init_std: float = 0.08,
    max_position_embeddings: int = 4096,
    corpus_bytes: int = 1_000_000,
    overwrite: bool = False,
) -> Path:
    """Build (or reuse) a random-weight qwen2 model in ``path`` and return the path.

    A folder holding a tiny model built with other parameters is replaced only with ``overwrite=True``; a folder
    holding anything else is never touched (ConfigError).
    """
    path = Path(path).absolute()
    if hidden % heads or heads % kv_heads:
        raise ConfigError(f"hidden={hidden} must divide by heads={heads}, and heads by kv_heads={kv_heads}")
    if min(layers, hidden, heads, kv_heads, vocab, intermediate or 1, max_position_embeddings) <= 0:
        raise ConfigError("tiny model sizes must be positive")
    if vocab < 256 + len(SPECIAL_TOKENS):
        raise ConfigError(f"vocab={vocab} is too small for a byte-level tokenizer (at least 259)")
    texts, corpus_sha = _corpus(corpus_bytes)
    params = TinyParams(
        layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
        intermediate=intermediate if intermediate is not None else 2 * hidden,
        vocab=vocab, seed=seed, init_std=init_std, max_position_embeddings=max_position_embeddings,
        corpus_bytes=corpus_bytes, corpus_sha256=corpus_sha,
    )
    if path.exists():
        if _matches(path, params):
            return path
        ours = path.is_dir() and (path / PARAMS_FILE).exists()
        empty = path.is_dir() and not any(path.iterdir())
        if not ours and not empty:
            raise ConfigError(f"{path} exists and is not a tiny model built by clusterctl; not touching it")
        if ours and not overwrite:
            raise ConfigError(f"{path} holds a tiny model built with other parameters, or a damaged one",
                              hint="remove it, or pass --overwrite (overwrite=True from Python)")

    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_folders(path)
        tmp.mkdir()
        _write(tmp, params, texts)
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        atomic_write_json(tmp / PARAMS_FILE, TinyRecord(params=params, files=files).model_dump())
        _install(tmp, path, params)
    except OSError as e:  # a read-only or full filesystem, or a place no file can be made (/proc)
        raise CannotWrite(f"cannot build the tiny model in {path}: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _install(tmp: Path, path: Path, params: TinyParams) -> None:
    try:
        os.rename(tmp, path)  # onto a missing or empty folder
        return
    except OSError:
        pass
    if _matches(path, params):  # someone else finished the same build first
        return
    old = path.parent / f".{path.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def parameter_count(path: str | os.PathLike) -> int:
    """Parameters recorded in the model's safetensors index (fp32: total bytes / 4)."""
    index = read_json(Path(path) / "model.safetensors.index.json", what="safetensors index")
    return int(index["metadata"]["total_parameters"])


def main(argv: list[str] | None = None) -> int:
    """``python -m clusterctl.modelfiles.tiny PATH [--bench]``: build a model and print its path."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m clusterctl.modelfiles.tiny")
    ap.add_argument("path")
    ap.add_argument("--bench", action="store_true", help="the ≈100M-parameter preset")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    kw = dict(BENCH_100M) if ns.bench else {}
    if ns.layers:
        kw["layers"] = ns.layers
    try:
        print(build(ns.path, seed=ns.seed, **kw))
    except ClusterctlError as e:
        print(f"error: {e.message}", flush=True)
        return int(e.exit_code)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
