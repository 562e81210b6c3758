"""Benchmark (issue 31 d): what enforcing response_format costs, and why llguidance (docs/dependencies.md).

Run: .venv/bin/python bench/grammar.py [--rounds N] [--steps N] [--models tiny,smollm2] [--skip-libraries]

1. libraries: per tokenizer (the tiny test model's 2,048 tokens, SmolLM2's 49,152), per installed library
   (llguidance; outlines-core and xgrammar when installed — they are not dependencies), the tokenizer set-up
   time, the compile time of a few schemas, and the median time of one row's mask per step along a scripted
   answer; for llguidance also the 8 rows of a batch computed together (its executor), as the rank does.
2. hostile schemas: compile time (or the refusal) and the mask time of the first steps.
3. decode: 8 rows of one model in one process (one forward for the batch per step, the rows' masks computed on
   the CPU each step and applied with one mx.where), every row unconstrained vs every row constrained; a row
   whose answer completes gets a new constrained request at once, so every row is constrained at every step.
   Interleaved rounds, medians; tokens/s = rows x steps / seconds. The ratio is the cost (goal: >= 0.90).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, machine_note, say, table  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130}}}
NESTED = {"type": "object", "required": ["owner", "pets", "colour"], "properties": {
    "owner": PERSON, "colour": {"enum": ["red", "green", "blue"]},
    "pets": {"type": "array", "items": {"type": "object", "required": ["kind", "legs"], "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}}}}}}
# (name, schema or None for json_object, a valid answer to step through)
SCRIPTED = [
    ("person", PERSON, '{"name": "Alice Liddell", "age": 30}'),
    ("nested", NESTED, '{"owner": {"name": "Alice", "age": 30}, "colour": "red", "pets": [{"kind": "dog", '
                       '"legs": 4}, {"kind": "fish", "legs": 0}]}'),  # keys in the schema's order
    ("json_object", None, '{"title": "Notes", "tags": ["a", "b"], "n": 3.5, "ok": true, "sub": {"x": null}}'),
]
HOSTILE = {
    "3,000-value enum": {"enum": [f"value{i}" for i in range(3000)]},
    "500-branch anyOf": {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                    "required": [f"k{i}"]} for i in range(500)]},
    "regex (a|aa)*(a{1,50}){1,50}": {"type": "string", "pattern": "(a|aa|aaa)*(a{1,50}){1,50}"},
    "string of 1,000-2,000 chars x100": {"type": "array", "minItems": 100, "items": {
        "type": "string", "minLength": 1000, "maxLength": 2000}},
    "recursive tree": {"$defs": {"n": {"type": "object", "properties": {
        "c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"},
    "200-deep nesting": json.loads('{"type": "object", "properties": {"a": ' * 200 + "{}" + "}}" * 200),
}
PROMPT = [{"role": "user", "content": "Describe a person and their pets in JSON."}]


def rf(schema) -> dict:
    if schema is None:
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "b", "schema": schema, "strict": True}}


def model_path(kind: str) -> Path:
    if kind == "smollm2":
        from clusterctl.ggufimport import import_gguf, smollm2_gguf_path

        return Path(import_gguf(smollm2_gguf_path(), REPO / ".cache" / "smollm2").dest)
    from clusterctl import tinymodel

    return Path(tinymodel.build(REPO / ".cache" / "tiny-model-test"))


def ms(x: float) -> str:
    return f"{x * 1000:.3f}" if x < 0.01 else f"{x * 1000:.1f}"


# ---- 1. libraries ----------------------------------------------------------------------------------------------

def _steps(fill_and_advance, tokens: list[int]) -> float:
    """Median seconds of one mask computation along ``tokens``."""
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        fill_and_advance(None)
        times.append(time.perf_counter() - t0)
        fill_and_advance(t)
    return statistics.median(times)


def bench_llguidance(tok, vocab: int) -> list[list[str]]:
    import numpy as np

    from clusterctl.launch.rank.grammar import GrammarFactory

    t0 = time.perf_counter()
    f = GrammarFactory(tok, vocab)
    setup = time.perf_counter() - t0
    rows = []
    for name, schema, answer in SCRIPTED:
        t0 = time.perf_counter()
        c = f.compile(rf(schema))
        compile_s = time.perf_counter() - t0
        f._cache.clear()
        toks = tok.encode(answer, add_special_tokens=False)
        row = np.empty(f._words, dtype=np.int32)
        step = _steps(lambda t: c.fill(row) if t is None else c.advance(t), toks)
        cs = [f.compile(rf(schema)) for _ in range(8)]  # 8 rows, computed together as the rank does
        times = []
        for t in toks:
            t0 = time.perf_counter()
            f.masks(cs)
            times.append(time.perf_counter() - t0)
            for c8 in cs:
                c8.advance(t)
        rows.append(["llguidance", name, ms(setup), ms(compile_s), ms(step), ms(statistics.median(times))])
    return rows


def bench_outlines(tok) -> list[list[str]]:
    try:
        import numpy as np
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        return [["outlines-core", "(not installed)", "", "", "", ""]]
    # byte-level BPE: the tokens' bytes through GPT-2's byte-to-unicode table
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    u2b = {chr(c): b for b, c in zip(bs, cs)}
    hf = tok._tokenizer
    eos = sorted(tok.eos_token_ids)[0]
    t0 = time.perf_counter()
    table_ = {}
    special = set(hf.all_special_ids)
    for s, i in hf.get_vocab().items():
        if i not in special and all(ch in u2b for ch in s):
            table_.setdefault(bytes(u2b[ch] for ch in s), []).append(i)
    vocab = oc.Vocabulary(eos, table_)
    setup = time.perf_counter() - t0
    rows = []
    for name, schema, answer in SCRIPTED:
        if schema is None:
            rows.append(["outlines-core", name, ms(setup), "—", "(no recursive JSON: a regex has bounded depth)", ""])
            continue
        t0 = time.perf_counter()
        guide = oc.Guide(oc.Index(build_regex_from_schema(json.dumps(schema), r"[ ]?"), vocab))
        compile_s = time.perf_counter() - t0
        bm = np.full((1, (len(hf) + 31) // 32), -1, np.int32)
        step = _steps(lambda t: guide.write_mask_into(bm.ctypes.data, bm.size, 4) if t is None
                      else guide.advance(t, return_tokens=False), tok.encode(answer, add_special_tokens=False))
        rows.append(["outlines-core", name, ms(setup), ms(compile_s), ms(step), "(one row at a time)"])
    return rows


def bench_xgrammar(tok, vocab: int) -> list[list[str]]:
    try:
        import xgrammar as xgr
    except ImportError as e:  # its matcher imports torch at module level
        return [["xgrammar", f"(not importable: {e.name or e})", "", "", "", ""]]
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok._tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    rows = []
    for name, schema, answer in SCRIPTED:
        t0 = time.perf_counter()
        g = compiler.compile_builtin_json_grammar() if schema is None else compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        compile_s = time.perf_counter() - t0
        m = xgr.GrammarMatcher(g)
        bm = xgr.allocate_token_bitmask(1, vocab)
        step = _steps(lambda t: m.fill_next_token_bitmask(bm) if t is None else m.accept_token(t),
                      tok.encode(answer, add_special_tokens=False))
        rows.append(["xgrammar", name, ms(setup), ms(compile_s), ms(step), "(torch tensors)"])
    return rows


def libraries(kinds: list[str]) -> None:
    from mlx_lm.utils import load_tokenizer

    for kind in kinds:
        path = model_path(kind)
        tok = load_tokenizer(path)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        rows = bench_llguidance(tok, vocab) + bench_outlines(tok) + bench_xgrammar(tok, vocab)
        say(f"\n{kind} tokenizer ({len(tok._tokenizer)} tokens, logits {vocab}): ms, medians")
        say(table(rows, ["library", "schema", "tokenizer set-up", "compile", "mask/step, 1 row",
                         "mask/step, 8 rows"]))


def hostile(kind: str) -> None:
    import numpy as np
    from mlx_lm.utils import load_tokenizer

    from clusterctl.launch.rank.grammar import GrammarFactory

    path = model_path(kind)
    tok = load_tokenizer(path)
    f = GrammarFactory(tok)
    f._rollout_tables()  # made once per rank on first use: not a schema's cost
    rows = []
    for name, schema in HOSTILE.items():
        t0 = time.perf_counter()
        try:
            c = f.compile(rf(schema), max_tokens=4096)
        except ValueError as e:
            rows.append([name, ms(time.perf_counter() - t0), f"refused: {str(e)[:70]}", ""])
            continue
        compile_s = time.perf_counter() - t0
        row = np.empty(f._words, dtype=np.int32)
        times = []
        for _ in range(8):  # the first steps, sampling the lowest allowed token
            t0 = time.perf_counter()
            c.fill(row)
            times.append(time.perf_counter() - t0)
            bits = np.unpackbits(row.view(np.uint8), bitorder="little")
            if c.done:
                break
            c.advance(int(np.flatnonzero(bits)[0]))
        rows.append([name, ms(compile_s), "compiled", ms(max(times))])
    say(f"\nhostile schemas ({kind} tokenizer; compile includes the roll-out of max_tokens 4096): ms")
    say(table(rows, ["schema", "compile", "result", "worst mask of the first 8 steps"]))


# ---- 3. decode -------------------------------------------------------------------------------------------------

def decode_seconds(gen_model, tok, factory, prompt: list[int], rows: int, steps: int, constrained: bool,
                   max_tokens: int) -> tuple[float, float, int]:
    """Seconds for ``steps`` decode steps of ``rows`` rows (after the prefill and 2 warm-up steps), of which the
    grammar's CPU part (masks, advances, new requests), and how many constrained answers completed on the way."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from clusterctl.launch.rank.grammar import apply_masks

    schemas = [PERSON, NESTED, None]
    new = lambda i: factory.compile(rf(schemas[i % len(schemas)]), max_tokens=max_tokens) if constrained else None
    cs = [new(i) for i in range(rows)]
    cache = make_prompt_cache(gen_model)
    logits = gen_model(mx.array([prompt] * rows), cache=cache)[:, -1, :]
    completed, t0, cpu = 0, None, 0.0
    for s in range(steps + 2):
        if s == 2:
            mx.eval(logits)
            t0, cpu = time.perf_counter(), 0.0
        if constrained:
            mx.eval(logits)  # so that the mask's time below is the mask's alone
            c0 = time.perf_counter()
            masks = factory.masks(cs)
            cpu += time.perf_counter() - c0
            logits = apply_masks(logits, masks)
        toks = mx.argmax(logits, axis=-1).tolist()
        if constrained:
            c0 = time.perf_counter()
            for i, c in enumerate(cs):
                if toks[i] in factory.eos or c.done:
                    cs[i], completed = new(i), completed + 1  # the next request on this row
                    continue
                c.advance(toks[i])
            cpu += time.perf_counter() - c0
        logits = gen_model(mx.array(toks)[:, None], cache=cache)[:, -1, :]
    mx.eval(logits)
    return time.perf_counter() - t0, cpu, completed


def decode(kind: str, rounds: int, steps: int, rows: int) -> None:
    from mlx_lm import load

    from clusterctl.launch.rank.grammar import GrammarFactory

    gen_model, tok = load(str(model_path(kind)))
    factory = GrammarFactory(tok, gen_model.args.vocab_size)
    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True)
    got: dict[bool, list[float]] = {False: [], True: []}
    cpu: list[float] = []
    done = 0
    for r in range(rounds):
        for arm in ((False, True) if r % 2 == 0 else (True, False)):
            secs, grammar_s, n = decode_seconds(gen_model, tok, factory, prompt, rows, steps, arm, max_tokens=48)
            got[arm].append(secs)
            if arm:
                cpu.append(grammar_s)
            done += n
    tps = {arm: rows * steps / statistics.median(v) for arm, v in got.items()}
    step = statistics.median(got[False]) / steps
    mask = statistics.median(cpu) / steps
    say(f"\n{kind}: decode, {rows} rows x {steps} steps, one process, greedy (median of {rounds} rounds)")
    say(table([["unconstrained", f"{tps[False]:.1f}", "1.00", f"{step * 1000:.1f}", ""],
               ["every row constrained", f"{tps[True]:.1f}", f"{tps[True] / tps[False]:.3f}", "",
                f"{mask * 1000:.2f} (ratio without noise: {step / (step + mask):.3f})"]],
              ["arm", "tok/s", "ratio", "ms/step", "grammar's CPU ms/step (8 masks + advances)"]))
    say(f"  ({done} constrained answers completed and were replaced on the way; max_tokens 48 each, so the "
        f"roll-out that closes an answer in time runs at every step: the worst case)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per arm and round")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--models", default="tiny,smollm2", help="comma list of tiny, smollm2 (decode arm)")
    ap.add_argument("--skip-libraries", action="store_true")
    ns = ap.parse_args()
    kinds = [k for k in ns.models.split(",") if k]
    say(f"bench/grammar.py  {time.strftime('%Y-%m-%d %H:%M')}  {machine_note()}  rounds={ns.rounds} "
        f"steps={ns.steps} rows={ns.rows}")
    if not ns.skip_libraries:
        libraries(["tiny", "smollm2"])
        hostile("smollm2")
    for kind in kinds:
        decode(kind, ns.rounds, ns.steps, ns.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
