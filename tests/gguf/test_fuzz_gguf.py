"""Fuzzing of a GGUF file's numeric metadata and counts, through `clusterctl model import` (issue 30: a
block_count of 10**6 in a 438 KB file took 19 s and 2.3 GB before its refusal, 10**9 ended in a MemoryError;
context_length 1 and rope_theta Infinity were imported).

What is fuzzed comes from the code and the file, not a hand list: every metadata key the importer reads (the
"llama." / "tokenizer." / "general." string constants of clusterctl's gguf modules) and every key of a tiny llama
file, and every count or length the file keeps (gguffiles.count_fields: the header's tensor and key counts, key
and string lengths, value and element types, array lengths, dimension counts, dimensions, tensor types and data
offsets). Each gets values at and past the limits — 0, -1, 2**31, 2**63, 2**64-1, 10**6, 10**9, the file's size
and one more, NaN, ±Infinity, 1e-50 and 1e308 (as f64), text, a bool, a list — and the importer's own declared
bounds (the MAX_* / MIN_* of clusterctl.gguf.reader and clusterctl.gguf.check) and one past them.

The promise of every case: exit 0 with a folder whose config.json is strict JSON with sane numbers (a context of
16 or more, a RoPE base above 1, a positive epsilon, KV heads dividing the heads, an even head size) and that
plan's own model reader accepts; or a clean refusal (65, 66, 78) with one 'error:' line. Never exit 70 or 1, a
traceback or a MemoryError; each case within CASE_SECONDS, in a worker process under an address-space cap of
MEMORY_CAP beyond what it maps after a first import (fuzzutil.CliWorker), so a count that makes the importer
build per claimed layer or entry fails fast instead of swapping the machine.

The suite runs the sweep (each field with each value class) and RANDOM_CASES random cases of a fixed seed;
``fuzz_gguf(seed, cases, root)`` is the random campaign for bench/faults.py, with a random seed there.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import random
import re
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # fuzzers of GGUF files (each imports a model)

sys.path.insert(0, str(Path(__file__).parent))
from fuzzutil import MAX_EXAMPLES, CliWorker, cli_problems, count, counting_fixtures  # noqa: E402
from gguffiles import Typed, count_fields, tiny_llama, write_gguf  # noqa: E402

CLEAN = {0, 65, 66, 78}
MEMORY_CAP = 512 << 20  # beyond what the worker maps after one import (a whole import of the tiny file: ~25 MB)
CASE_SECONDS = 5.0  # one case, on a loaded 2-core machine; a refusal takes milliseconds
RANDOM_CASES = max(40, MAX_EXAMPLES // 5)  # CLUSTERCTL_FUZZ_EXAMPLES=3000: 600 random cases
FAST_ROOT = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None  # an import fsyncs what it writes
OUT_OF_MEMORY = ("bad_alloc", "MemoryError", "memory allocation of", "Cannot allocate memory")
DROP = object()  # a metadata key removed

NAN, INF = float("nan"), float("inf")
VALUES = [0, -1, 1, 2, 3, 15, 16, 63, 64, 1023, 1025, 65536, 2**24 + 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1,
          10**6, 10**9, 0.5, -0.5, 1.0, 1e-45, Typed(12, 1e-50), Typed(12, 1e308), 3.4e38, NAN, INF, -INF,
          Typed(0, 255), Typed(1, -128), Typed(11, -(2**63)), "12", "", True, False, [1], [], ["x"], DROP]
# the sweep gives every numeric key each class of the list above once (a refusal costs ~8 ms, an import ~40),
# and the bounds ggufcheck declares; other keys (text, flags, lists) a few
SWEEP = [0, -1, 1, 2**31, 2**64 - 1, 0.5, 1e-45, NAN, INF, "12", [1], DROP]
SWEEP_OTHER = [0, 2**64 - 1, NAN, "", [1], DROP]
FIELD_VALUES = [0, 1, 2, 3, 5, 13, 31, 33, 64, 255, 2**16, 2**20 + 1, 2**22 + 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1,
                10**6, 10**9]
FIELD_SWEEP = [0, 1, 3, 33, 2**20 + 1, 2**32 - 1, 2**63, 10**9]


def importer_keys() -> list[str]:
    """The metadata keys clusterctl's GGUF modules name (their string constants that look like keys)."""
    import clusterctl.gguf.reader
    import clusterctl.gguf.check
    import clusterctl.gguf.importer
    import clusterctl.gguf.plan
    import clusterctl.gguf.tokenizer

    keys = set()
    for mod in (clusterctl.gguf.reader, clusterctl.gguf.check, clusterctl.gguf.importer, clusterctl.gguf.plan,
                clusterctl.gguf.tokenizer):
        for node in ast.walk(ast.parse(inspect.getsource(mod))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"(llama|tokenizer|general)(\.[a-z0-9_]+)+", node.value) and \
                    not node.value.endswith(".json"):
                keys.add(node.value)
    return sorted(keys)


def declared_limits(only: str | None = None) -> list[int]:
    """The bounds the reader and the checks declare (MAX_* / MIN_* integers), and one past each."""
    import clusterctl.gguf.reader as gguf
    import clusterctl.gguf.check as check

    out = []
    for mod in (gguf, check) if only is None else (check,):
        for name, v in sorted(vars(mod).items()):
            if name.startswith(("MAX_", "MIN_")) and isinstance(v, int) and not isinstance(v, bool):
                out += [v, v + 1 if name.startswith("MAX_") else v - 1]
    return out


def _pack(fmt: str, v: int) -> bytes:
    return struct.pack(fmt, v % (1 << (8 * struct.calcsize(fmt))))


class Lab:
    """The tiny base file (1 layer, 32 wide), its metadata and tensors to rewrite, and the capped CLI worker."""

    def __init__(self, root: Path):
        self.root = root
        self.n = 0
        base, _, _ = tiny_llama(root / "base.gguf", layers=1, hidden=32, heads=2, kv_heads=1, inter=64)
        from clusterctl.gguf.reader import read_header

        h = read_header(base)
        raw = base.read_bytes()
        self.base, self.meta = base, dict(h.metadata)
        self.tensors = {t.name: (t.type, t.shape, raw[t.offset:t.offset + t.nbytes]) for t in h.tensors}
        self.fields = count_fields(raw)
        self.keys = sorted(set(importer_keys()) | set(self.meta))
        # the same vocabulary as a SentencePiece tokenizer (merges from scores): the other tokenizer path
        n = len(self.meta["tokenizer.ggml.tokens"])
        self.sentencepiece = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.merges": DROP,
                              "tokenizer.ggml.scores": [-float(i) for i in range(n)], "tokenizer.ggml.unknown_token_id": 0}
        self.env = {"CLUSTERCTL_STATE_DIR": str(root / "state")}  # the hash cache of the source files
        self.worker = CliWorker(extra_memory=MEMORY_CAP, warm=["model", "import", str(base), str(root / "warm")],
                                timeout=60)
        old = os.environ.get("CLUSTERCTL_STATE_DIR")
        os.environ.update(self.env)  # the worker's warm-up import runs with it too
        try:
            self.worker.ensure()
        finally:
            if old is None:
                os.environ.pop("CLUSTERCTL_STATE_DIR")
            else:
                os.environ["CLUSTERCTL_STATE_DIR"] = old

    def close(self) -> None:
        self.worker.close()

    def write(self, changes: dict | None = None, patches: list[tuple[int, int]] | None = None) -> Path:
        """The base file with metadata ``changes`` (DROP removes a key) and then count ``patches`` (index into
        self.fields, value) applied to the bytes of the unchanged layout."""
        self.n += 1
        path = self.root / "case.gguf"  # one name: the hash cache keeps one entry, not one per case
        meta = {k: v for k, v in {**self.meta, **(changes or {})}.items() if v is not DROP}
        write_gguf(path, meta, self.tensors)
        if patches:
            data = bytearray(path.read_bytes() if changes else self.base.read_bytes())
            fields = count_fields(bytes(data)) if changes else self.fields
            for i, v in patches:
                off, fmt, _ = fields[i % len(fields)]
                data[off:off + struct.calcsize(fmt)] = _pack(fmt, v)
            path.write_bytes(bytes(data))
        return path

    def run(self, src: Path, *, as_json: bool = False) -> list[str]:
        """Import ``src``: every broken promise, as short strings."""
        dest = self.root / f"out{self.n}"
        argv = ["model", "import", str(src), str(dest)] + (["--json"] if as_json else [])
        t0 = time.monotonic()
        if not self.worker.alive:  # a case killed it: started again (its warm-up imports the base file)
            shutil.rmtree(self.root / "warm", ignore_errors=True)
        how, r = self.worker.run(argv, env=self.env, cwd=str(self.root))
        took = time.monotonic() - t0
        try:
            if how != "ok":
                count("crashed")
                return [f"the import killed its process ({r}: an abort in native code, often memory)" if how == "died"
                        else f"the import did not answer in {r} s"]
            bad = cli_problems(r, argv, [], [])
            if r.code not in CLEAN:
                bad.append(f"exit {r.code}")
            elif r.code and any(m in r.stderr for m in OUT_OF_MEMORY):
                bad.append(f"refused only because it ran out of {MEMORY_CAP >> 20} MiB (uncapped it takes more): "
                           f"{r.stderr.strip()[:160]}")
            if took > CASE_SECONDS:
                bad.append(f"took {took:.1f} s")
            if r.code == 0:
                bad += folder_problems(dest)
            elif dest.exists() or any(p.name.startswith(f".{dest.name}.") for p in self.root.iterdir()):
                bad.append("a refusal left something at DEST")
            count("accepted" if r.code == 0 else "refused" if r.code in CLEAN else "broken")
            return bad
        finally:
            shutil.rmtree(dest, ignore_errors=True)
            src.unlink(missing_ok=True)


def folder_problems(dest: Path) -> list[str]:
    """What is wrong with an imported folder: config.json strict JSON with sane numbers, plan reads it."""
    def no_constant(c):
        raise ValueError(f"{c} in config.json")

    try:
        config = json.loads((dest / "config.json").read_text(), parse_constant=no_constant)
    except (OSError, ValueError) as e:
        return [f"imported, but config.json is not strict JSON: {e}"]
    bad = []
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    checks = {"context below 16": config.get("max_position_embeddings", 0) < 16,
              "rope_theta not above 1": not config.get("rope_theta", 0) > 1,
              "rms_norm_eps not positive": not config.get("rms_norm_eps", 0) > 0,
              "KV heads do not divide the heads": heads % kv != 0,
              "an odd head size": head_dim % 2 != 0}
    bad += [f"imported with {what}: {json.dumps(config)[:200]}" for what, yes in checks.items() if yes]
    from clusterctl.errors import ClusterctlError
    from clusterctl.plan.model import inspect_model

    try:
        inspect_model(dest, classify=False)
    except ClusterctlError as e:
        bad.append(f"imported, but plan refuses the folder: {e.message[:160]}")
    return bad


def random_case(lab: Lab, rng: random.Random) -> tuple[str, dict, list]:
    """One to three lies: metadata values (any key, any value class, random numbers of every size) and counts
    in the layout (random field, a limit or a random number of the field's width)."""
    changes, patches = dict(lab.sentencepiece) if rng.random() < 0.3 else {}, []
    limits = declared_limits()
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.6:
            key = rng.choice(lab.keys)
            pick = rng.random()
            if pick < 0.5:
                v = rng.choice(VALUES + limits)
            elif pick < 0.75:
                v = rng.choice([rng.randrange(1 << rng.choice([4, 8, 16, 32, 63])), -rng.randrange(1 << 31)])
            else:
                v = rng.choice([Typed(12, 10 ** rng.uniform(-320, 308)), Typed(12, -(10 ** rng.uniform(-10, 30))),
                                rng.uniform(0, 2)])
            changes[key] = v
        else:
            i = rng.randrange(len(lab.fields))
            fmt = lab.fields[i][1]
            v = rng.choice(FIELD_VALUES + [lab.base.stat().st_size, lab.base.stat().st_size + 1,
                                           rng.randrange(1 << (8 * struct.calcsize(fmt)))])
            patches.append((i, v))
    what = ", ".join([f"{k} = {v!r}"[:80] for k, v in changes.items()]
                     + [f"{lab.fields[i][2]} = {v}" for i, v in patches])
    return what, changes, patches


def fuzz_gguf(seed: int, cases: int, root: Path | None = None) -> tuple[list[str], int]:
    """The random campaign with ``seed``: (broken promises, each with its case; cases run). For bench/faults.py
    (a random seed each run) and the suite (a fixed one)."""
    own = root is None
    root = Path(tempfile.mkdtemp(prefix="gguf-fuzz-", dir=FAST_ROOT)) if own else root
    root.mkdir(parents=True, exist_ok=True)
    lab = Lab(root)
    rng = random.Random(seed)
    found = []
    try:
        for n in range(cases):
            what, changes, patches = random_case(lab, rng)
            bad = lab.run(lab.write(changes, patches), as_json=n % 2 == 1)
            if bad:
                found.append(f"seed {seed} case {n} ({what}): {'; '.join(dict.fromkeys(bad))}")
    finally:
        lab.close()
        if own:
            shutil.rmtree(root, ignore_errors=True)
    return found, cases


# ---------------------------------------------------------------------------------------------------- the suite

@pytest.fixture(scope="module")
def lab():
    root = Path(tempfile.mkdtemp(prefix="gguf-fuzz-", dir=FAST_ROOT))
    try:
        lab = Lab(root)
        try:
            yield lab
        finally:
            lab.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


_count_cases, _report_cases = counting_fixtures("GGUF fuzz cases")


def _fail_with(found: dict | list) -> None:
    if found:
        items = [f"{k}: {'; '.join(dict.fromkeys(v))}" for k, v in found.items()] if isinstance(found, dict) \
            else found
        pytest.fail(f"{len(items)} case(s) break a promise:\n  " + "\n  ".join(items[:40]), pytrace=False)


def test_the_base_file_imports(lab):
    assert lab.run(lab.write()) == []
    keys = importer_keys()
    assert {"llama.block_count", "llama.context_length", "llama.rope.freq_base",
            "llama.attention.layer_norm_rms_epsilon"} <= set(keys), keys
    whats = {what for _, _, what in lab.fields}
    assert {"header: tensor count", "length of array tokenizer.ggml.tokens", "dimension 1 of token_embd.weight",
            "data offset of blk.0.ffn_down.weight"} <= whats, sorted(whats)


def test_every_key_at_its_limits(lab):
    """Every key the importer reads (and every key of the file), each with a value of every class and the
    declared bounds and one past them; the numeric keys of the model with every value."""
    found = {}
    limits = declared_limits("ggufcheck")
    numeric = {k for k, v in lab.meta.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for key in lab.keys:
        values = SWEEP + limits if key in numeric or key.startswith("llama.") else SWEEP_OTHER
        for v in values:
            bad = lab.run(lab.write({key: v}), as_json=len(found) % 2 == 1)
            if bad:
                found[f"{key} = {v!r}"[:100]] = bad
    _fail_with(found)


def test_sentencepiece_keys_at_their_limits(lab):
    """The tokenizer keys again with the vocabulary read as SentencePiece (scores, no merges)."""
    assert lab.run(lab.write(lab.sentencepiece)) == []
    found = {}
    for key in [k for k in lab.keys if k.startswith("tokenizer.")]:
        for v in SWEEP_OTHER + [Typed(6, NAN), [-INF] * len(lab.meta["tokenizer.ggml.tokens"])]:
            bad = lab.run(lab.write({**lab.sentencepiece, key: v}))
            if bad:
                found[f"{key} = {v!r}"[:100]] = bad
    _fail_with(found)


def test_every_count_in_the_layout_at_its_limits(lab):
    """Each kind of count the file keeps (the first of each: the header's, a key's length, a text's length, an
    array's type and length, a tensor's name length, dimension count, dimensions, type and offset), the lengths
    of the vocabulary arrays and the last tensor's dimensions and offset, with every value class and the file's
    size (and one more)."""
    size = lab.base.stat().st_size
    chosen, seen = [], set()
    last_tensor = lab.fields[-1][2].rsplit(" of ", 1)[-1]
    for i, (_, _, what) in enumerate(lab.fields):
        kind = what.split(" of ")[0]
        if kind not in seen or what.startswith("length of array tokenizer.ggml") or \
                (what.endswith(last_tensor) and kind.startswith(("dimension ", "data offset"))):
            seen.add(kind)
            chosen.append(i)
    found = {}
    for i in chosen:
        for v in FIELD_SWEEP + [size, size + 1]:
            bad = lab.run(lab.write(patches=[(i, v)]))
            if bad:
                found[f"{lab.fields[i][2]} = {v}"[:100]] = bad
    _fail_with(found)


def test_random_lies(lab):
    """RANDOM_CASES cases of one to three lies at once, from a fixed seed (bench/faults.py: a random one)."""
    rng = random.Random(30)
    found = []
    for n in range(RANDOM_CASES):
        what, changes, patches = random_case(lab, rng)
        bad = lab.run(lab.write(changes, patches), as_json=n % 2 == 1)
        if bad:
            found.append(f"case {n} ({what}): {'; '.join(dict.fromkeys(bad))}")
    _fail_with(found)
