"""Benchmark (issue 31 d): what enforcing response_format costs, and why llguidance (docs/dependencies.md).

Run: .venv/bin/python bench/grammar.py [--quick] [--served | --no-served] [--rounds N] [--steps N]
                                       [--models tiny,smollm2] [--skip-libraries] [--per-client N] [--tokens N]
     --quick: the tiny model only, no library tables, 1 request per client in the served phase (~2.5 min here)
     --served: only phase 4 (with --models)

1. libraries: per tokenizer (the tiny test model's 2,048 tokens, SmolLM2's 49,152), per installed library
   (llguidance; outlines-core and xgrammar when installed — they are not dependencies), the tokenizer set-up
   time, the compile time of a few schemas, and the median time of one row's mask per step along a scripted
   answer; for llguidance also the 8 rows of a batch computed together (its executor), as the rank does.
2. hostile schemas: compile time (or the refusal) and the mask time of the first steps.
3. decode: 8 rows of one model in one process (one forward for the batch per step, the rows' masks computed on
   the CPU each step and applied with one mx.where), every row unconstrained vs every row constrained; a row
   whose answer completes gets a new constrained request at once, so every row is constrained at every step.
   Interleaved rounds, medians; tokens/s = rows x steps / seconds. The ratio is the cost (goal: >= 0.90).
4. served (issue 31 d's own terms): a real 2-rank local deployment per model (`clusterctl plan` on two local
   nodes, pipeline, the default schedule; `clusterctl launch --detach`; `clusterctl teardown`) and 8 concurrent
   streaming HTTP clients, greedy chat requests (each prompt unique, so no arm gets more prompt-cache hits), in
   interleaved rounds (the arms' order rotates): every request unconstrained vs every request with a strict
   json_schema response_format (4 schemas in rotation) vs every request json_object. Per arm and round:
   aggregate tok/s = completion tokens (from `usage`) / (first request sent -> last stream ended); decode tok/s =
   clients x the median per-stream rate after its first token ((tokens - 1) / (end - first token): prefill
   excluded); time to first token p50; every constrained answer parsed and validated (jsonschema); the ranks'
   CPU seconds per completion token, and the cores the rest of the machine used meanwhile. Medians over rounds;
   ratio = constrained / unconstrained (goal >= 0.90).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (REPO, cpu_seconds, fmt, log, machine_busy_seconds, machine_note, med, say,  # noqa: E402
                     table)

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
        from clusterctl.gguf.importer import import_gguf, smollm2_gguf_path

        return Path(import_gguf(smollm2_gguf_path(), REPO / ".cache" / "smollm2").dest)
    from clusterctl.modelfiles import tiny

    return Path(tiny.build(REPO / ".cache" / "tiny-model-test"))


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

    from clusterctl.rank.grammar.mask import GrammarFactory

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

    from clusterctl.rank.grammar.mask import GrammarFactory

    path = model_path(kind)
    tok = load_tokenizer(path)
    f = GrammarFactory(tok)
    f.tables()  # made once per rank on first use: not a schema's cost
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

    from clusterctl.rank.grammar.mask import apply_masks

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

    from clusterctl.rank.grammar.mask import GrammarFactory

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


# ---- 4. served: 2 ranks, 8 HTTP clients ------------------------------------------------------------------------

PRODUCT = {"type": "object", "additionalProperties": False, "required": ["name", "price", "in_stock", "tags"],
           "properties": {"name": {"type": "string"}, "price": {"type": "number", "minimum": 0, "maximum": 10000},
                          "in_stock": {"type": "boolean"},
                          "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
EVENT = {"type": "object", "required": ["title", "day", "priority", "attendees"], "properties": {
    "title": {"type": "string"}, "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
    "priority": {"type": "integer", "minimum": 1, "maximum": 5},
    "attendees": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "role": {"enum": ["host", "guest"]}}}}}}
# (name, schema, prompt): the same prompts for every arm; each request adds its own number (unique prompts)
SERVED = [
    ("person", PERSON, "Give a person's name and age as JSON."),
    ("nested", NESTED, "Describe a pet owner, their favourite colour and their pets as JSON."),
    ("product", PRODUCT, "Describe a product for sale (name, price, whether it is in stock, tags) as JSON."),
    ("event", EVENT, "Describe a meeting (title, weekday, priority 1-5, attendees) as JSON."),
]
SERVED_ARMS = {"none": "unconstrained", "schema": "json_schema, strict (4 schemas)", "object": "json_object"}


def stream_request(base: str, body: dict, timeout: float) -> dict:
    """One streamed chat completion: its text, completion tokens (usage), finish reason, and times from sending
    (first content chunk, end of stream), monotonic."""
    req = urllib.request.Request(base.rstrip("/") + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out = {"text": [], "tokens": None, "finish": None, "first": None, "error": None}
    t0 = out["sent"] = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue  # blank lines, ": keepalive" comments
            data = line[5:].strip()
            if data == "[DONE]":
                break
            doc = json.loads(data)
            if doc.get("error"):
                out["error"] = str(doc["error"])[:200]
            if doc.get("usage"):
                out["tokens"] = doc["usage"].get("completion_tokens")
            for ch in doc.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece:
                    if out["first"] is None:
                        out["first"] = time.monotonic() - t0
                    out["text"].append(piece)
                if ch.get("finish_reason"):
                    out["finish"] = ch["finish_reason"]
    out["end"] = time.monotonic()
    out["text"] = "".join(out["text"])
    return out


def served_body(arm: str, n: int, max_tokens: int) -> tuple[dict, dict | None]:
    """Request number ``n`` of ``arm``: the body and the schema its answer must validate against (None: no
    check; {"type": "object"} for json_object)."""
    name, schema, prompt = SERVED[n % len(SERVED)]
    body = {"messages": [{"role": "user", "content": f"{prompt} (Request {n}.)"}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if arm == "schema":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": name, "schema": schema, "strict": True}}
        return body, schema
    if arm == "object":
        body["response_format"] = {"type": "json_object"}
        return body, {"type": "object"}
    return body, None


def valid(text: str, schema: dict) -> str | None:
    """None when ``text`` parses as JSON and validates against ``schema``; else why not (one line)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return None


def served_round(base: str, arm: str, clients: int, per_client: int, max_tokens: int, start: int,
                 pids: list[int], timeout: float) -> dict:
    """``clients`` threads at once, each sending ``per_client`` requests of ``arm`` one after another."""
    got: list[dict] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for j in range(per_client):
            n = start + i * per_client + j
            body, schema = served_body(arm, n, max_tokens)
            try:
                r = stream_request(base, body, timeout)
            except Exception as e:  # counted: a refused or broken request is a result too
                r = {"error": f"{type(e).__name__}: {e}"[:200], "tokens": 0, "text": ""}
            r["schema"] = schema
            with lock:
                got.append(r)

    cpu0, busy0, t0 = cpu_seconds(pids), machine_busy_seconds(), time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 60)
    wall = time.monotonic() - t0
    cpu, busy = cpu_seconds(pids) - cpu0, machine_busy_seconds() - busy0
    ok = [r for r in got if not r["error"]]  # a stream without text (tokens the tokenizer shows as nothing) counts
    tokens = sum(r["tokens"] or 0 for r in ok)
    rates = [(r["tokens"] - 1) / (r["end"] - r["sent"] - r["first"]) for r in ok
             if r["first"] is not None and (r["tokens"] or 0) > 1 and r["end"] - r["sent"] > r["first"]]
    checked = [r for r in got if r["schema"] is not None]
    bad = [(why if not r["error"] else r["error"]) for r in checked
           for why in [None if r["error"] else valid(r["text"], r["schema"])] if r["error"] or why]
    return {"agg": tokens / wall, "decode": clients * statistics.median(rates) if rates else None,
            "ttft": [r["first"] for r in ok if r["first"] is not None], "tokens": [r["tokens"] or 0 for r in ok],
            "empty": sum(r["first"] is None for r in ok),
            "length": sum(r["finish"] == "length" for r in ok), "errors": len(got) - len(ok),
            "why": [r["error"] for r in got if r["error"]],
            "checked": len(checked), "bad": bad, "cpu_per_token": cpu / tokens if tokens else None,
            "others": max(0.0, busy - cpu) / wall, "wall": wall}


def served(kind: str, ns) -> None:
    from overlap import plan
    from serve import Round, arm_clusterctl, rotate

    path = model_path(kind)
    tokens = ns.tokens
    with tempfile.TemporaryDirectory(prefix="bench-grammar-") as tmp:
        workdir = Path(tmp)
        env = {"CLUSTERCTL_STATE_DIR": str(workdir / "state")}
        dep = plan(workdir, env, path, f"grammar-{kind}", "--schedule", ns.schedule)
        doc = json.loads(dep.read_text())
        r = Round("served", kind)
        got: dict[str, list[dict]] = {a: [] for a in SERVED_ARMS}
        warm: dict[str, float] = {}
        with arm_clusterctl(dep, env, r) as (_t0, base, pids, layers, all_pids):
            log(f"{kind}: 2 ranks ready in {r.ready:.1f} s ({doc.get('schedule')}, batch {doc.get('batch')}; "
                f"layers " + ", ".join(f"rank {k} {v}" for k, v in sorted(layers.items())) + ")")
            # warm-up: a plain request, then each schema once and json_object (the ranks' grammar factories are
            # made on first use, ~1-2 s; compiled schemas are cached): not part of any round
            for arm, n in [("none", 0), *(("schema", i) for i in range(len(SERVED))), ("object", 0)]:
                t = time.monotonic()
                stream_request(base, served_body(arm, n, 8)[0], ns.timeout)
                warm.setdefault(arm, time.monotonic() - t)
            per_round = ns.clients * ns.per_client
            for i in range(ns.rounds):
                for arm in rotate(list(SERVED_ARMS), i):
                    x = served_round(base, arm, ns.clients, ns.per_client, tokens, 1000 + i * per_round, all_pids,
                                     ns.timeout)
                    got[arm].append(x)
                    log(f"{kind} round {i + 1} {SERVED_ARMS[arm]}: {x['agg']:.1f} tok/s, decode "
                        f"{fmt(x['decode'], '', 1)}, TTFT p50 {fmt(med(x['ttft']), ' s')}, "
                        f"{sum(x['tokens'])} tokens in {x['wall']:.1f} s, others {x['others']:.2f} cores"
                        + (f", {len(x['bad'])} invalid" if x["bad"] else "") + (f", {x['errors']} errors"
                                                                               if x["errors"] else ""))
        if r.error:
            say(f"{kind}: {r.error.strip()}")
    base_agg = med(x["agg"] for x in got["none"])
    base_dec = med(x["decode"] for x in got["none"])
    rows = []
    for arm, xs in got.items():
        agg, dec = med(x["agg"] for x in xs), med(x["decode"] for x in xs)
        n_checked, n_bad = sum(x["checked"] for x in xs), sum(len(x["bad"]) for x in xs)
        toks = [t for x in xs for t in x["tokens"]]
        rows.append([SERVED_ARMS[arm], fmt(agg, "", 1), fmt(agg / base_agg if agg and base_agg else None, "", 3),
                     fmt(dec, "", 1), fmt(dec / base_dec if dec and base_dec else None, "", 3),
                     fmt(med(med(x["ttft"]) for x in xs), "", 2),
                     f"{statistics.mean(toks):.1f}" if toks else "n/a",
                     str(sum(x["length"] for x in xs)),
                     "—" if not n_checked else f"{n_checked - n_bad}/{n_checked} ({100 * (n_checked - n_bad) / n_checked:.0f}%)",
                     fmt(med(x["cpu_per_token"] for x in xs) and 1000 * med(x["cpu_per_token"] for x in xs), "", 1),
                     fmt(med(x["others"] for x in xs), "", 2),
                     str(sum(x["errors"] for x in xs))])
    say(f"\n{kind}: served through 2 ranks ({doc.get('parallel')}, {doc.get('schedule')}), {ns.clients} streaming "
        f"clients x {ns.per_client} request(s), max_tokens {tokens}, greedy, medians of {ns.rounds} interleaved "
        f"rounds")
    say(table(rows, ["arm", "aggregate tok/s", "ratio", "decode tok/s", "ratio", "TTFT p50 s", "tokens/request",
                     "finish length", "valid JSON", "ranks' CPU ms/token", "others' cores", "errors"]))
    empty = {a: sum(x["empty"] for x in xs) for a, xs in got.items()}
    if any(empty.values()):
        say("  answers without any text (counted; no time to first token): "
            + ", ".join(f"{SERVED_ARMS[a]} {n}" for a, n in empty.items()))
    say("  first request of each arm (warm-up, 8 tokens; the ranks' grammar factories are made on first use): "
        + ", ".join(f"{SERVED_ARMS[a]} {v:.2f} s" for a, v in warm.items()))
    for arm, xs in got.items():
        for why in [w for x in xs for w in x["bad"]][:5]:
            say(f"  invalid ({SERVED_ARMS[arm]}): {why}")
        for why in sorted({w for x in xs for w in x["why"]})[:5]:
            say(f"  failed ({SERVED_ARMS[arm]}): {why}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per arm and round")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--models", help="comma list of tiny, smollm2 (decode and served phases; default both, "
                                      "--quick tiny)")
    ap.add_argument("--skip-libraries", action="store_true", help="no library tables, no hostile schemas")
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, --skip-libraries, 1 request per client when served (~2.5 min here)")
    ap.add_argument("--served", action="store_true", help="only the served phase (2 ranks, HTTP clients)")
    ap.add_argument("--no-served", action="store_true", help="everything but the served phase")
    ap.add_argument("--clients", type=int, default=8, help="served: concurrent streaming clients")
    ap.add_argument("--per-client", type=int, help="served: requests each client sends in turn "
                                                   "(default 2; --quick and smollm2 1)")
    ap.add_argument("--tokens", type=int, default=64, help="served: max_tokens of every request")
    ap.add_argument("--schedule", default="auto", help="served: plan --schedule (auto = overlap here)")
    ap.add_argument("--timeout", type=float, default=900, help="served: seconds per request")
    ns = ap.parse_args()
    kinds = [k for k in (ns.models or ("tiny" if ns.quick else "tiny,smollm2")).split(",") if k]
    if set(kinds) - {"tiny", "smollm2"}:
        ap.error("--models: tiny, smollm2")
    per_client = ns.per_client
    say(f"bench/grammar.py  {time.strftime('%Y-%m-%d %H:%M')}  {machine_note()}  rounds={ns.rounds} "
        f"steps={ns.steps} rows={ns.rows}")
    started = time.monotonic()
    if not (ns.skip_libraries or ns.quick or ns.served):
        libraries(["tiny", "smollm2"])
        hostile("smollm2")
    if not ns.served:
        for kind in kinds:
            decode(kind, ns.rounds, ns.steps, ns.rows)
    if not ns.no_served:
        for kind in kinds:
            ns.per_client = per_client or (1 if ns.quick or kind == "smollm2" else 2)
            served(kind, ns)
    say(f"\n(total {time.monotonic() - started:.0f} s; at the end: {machine_note()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
