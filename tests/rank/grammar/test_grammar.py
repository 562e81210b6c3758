"""Structured output (rank/grammar/mask.py): every answer parses and validates, over 26 schemas and json_object
decoded in one batch by mlx-lm's own model with the masks applied per row; greedy and sampled rows; budgets that
end mid-object.

The tiny test model has random weights: unconstrained, it writes garbage, so every valid answer here is the mask's
doing (and its strings are long and odd). SmolLM2 answers a few schemas for real. Refusals are one-line
ValueErrors, fit for a 400."""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from clusterctl.rank.grammar.mask import GrammarFactory, apply_masks
from rankharness import REPO, tiny_model_path


def js(schema, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130}}}
SCHEMAS = {
    "object": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "boolean"}},
               "required": ["a", "b"]},
    "person": PERSON,
    "nested": {"type": "object", "required": ["owner", "pet"], "properties": {
        "owner": PERSON,
        "pet": {"type": "object", "required": ["kind", "legs"], "additionalProperties": False, "properties": {
            "kind": {"enum": ["cat", "dog", "fish"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}}}}},
    "array of objects": {"type": "object", "required": ["people"], "properties": {
        "people": {"type": "array", "items": PERSON, "minItems": 1, "maxItems": 3}}},
    "top-level array": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 5},
    "enum": {"type": "object", "required": ["color"], "properties": {"color": {"enum": ["red", "green", "blue"]}}},
    "top-level enum": {"enum": ["yes", "no", "maybe"]},
    "const": {"type": "object", "required": ["v"], "properties": {"v": {"const": "fixed"}}},
    "integer range": {"type": "object", "required": ["n"], "properties": {
        "n": {"type": "integer", "minimum": 10, "maximum": 99}}},
    "exclusive range": {"type": "object", "required": ["n"], "properties": {
        "n": {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 7}}},
    "number range": {"type": "object", "required": ["x"], "properties": {
        "x": {"type": "number", "minimum": -1.5, "maximum": 2.25}}},
    "multipleOf": {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer", "multipleOf": 5}}},
    "pattern": {"type": "object", "required": ["code"], "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}},
    "string length": {"type": "object", "required": ["s"], "properties": {
        "s": {"type": "string", "minLength": 2, "maxLength": 6}}},
    "format date": {"type": "object", "required": ["d"], "properties": {"d": {"type": "string", "format": "date"}}},
    "nullable": {"type": "object", "required": ["x", "y"], "properties": {
        "x": {"type": ["string", "null"]}, "y": {"type": ["integer", "null"]}}},
    "anyOf": {"type": "object", "required": ["v"], "properties": {
        "v": {"anyOf": [{"type": "integer"}, {"type": "object", "required": ["w"],
                                              "properties": {"w": {"type": "boolean"}}}]}}},
    "defs and ref": {"$defs": {"pt": {"type": "object", "required": ["x", "y"], "additionalProperties": False,
                                      "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}},
                     "type": "object", "required": ["from", "to"],
                     "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}}},
    "recursive tree": {"$defs": {"node": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "maxLength": 8},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}}},
        "$ref": "#/$defs/node"},
    "array of enums": {"type": "object", "required": ["tags"], "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1}}},
    "matrix": {"type": "object", "required": ["m"], "properties": {
        "m": {"type": "array", "minItems": 2, "maxItems": 2,
              "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}}}},
    "closed object": {"type": "object", "additionalProperties": False, "required": ["only"],
                      "properties": {"only": {"type": "boolean"}}},
    "optional fields": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}},
    "many required": {"type": "object", "required": [f"k{i}" for i in range(4)],
                      "properties": {f"k{i}": {"type": "integer"} for i in range(4)}},
    "additional typed": {"type": "object", "additionalProperties": {"type": "integer"}},
    "not strict": {"type": "object", "required": ["a"], "properties": {"a": {"type": "string"}}},
}
JSON_OBJECT = "json_object mode"


def formats() -> list[tuple[str, dict, dict]]:
    """(name, response_format, the schema its answers must validate against)."""
    out = [(k, js(s, strict=(k != "not strict")), s) for k, s in SCHEMAS.items()]
    return out + [(JSON_OBJECT, {"type": "json_object"}, {"type": "object"})]


def decode(model, tok, factory: GrammarFactory, prompt: list[int], rows: list, *, max_tokens: list[int],
           temperature: list[float], seed: int = 0) -> list[tuple[str, int, bool]]:
    """One batch, one row per constraint (None: unconstrained), the same prompt: the loop a sampler runs, each
    row greedy (temperature 0) or sampled. Returns each row's text, its number of tokens, and whether it ended by
    itself (EOS or a complete answer)."""
    from mlx_lm.models.cache import make_prompt_cache

    mx.random.seed(seed)
    n = len(rows)
    greedy = mx.array([t == 0 for t in temperature])[:, None]
    temp = mx.array([t or 1.0 for t in temperature])[:, None]
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt] * n), cache=cache)[:, -1, :]
    eos = factory.eos[0]
    out: list[list[int]] = [[] for _ in rows]
    ended = [False] * n
    for _ in range(max(max_tokens)):
        masks = factory.masks([None if ended[i] else c for i, c in enumerate(rows)])
        x = apply_masks(logits, masks)
        toks = mx.where(greedy[:, 0], mx.argmax(x, axis=-1), mx.random.categorical(x / temp)).tolist()
        for i, c in enumerate(rows):
            if ended[i]:
                toks[i] = eos
                continue
            if toks[i] in factory.eos:
                assert c is None or c.accepting, f"row {i}: EOS before the answer was complete"
                ended[i] = True
                continue
            if c is not None:
                c.advance(toks[i])
            out[i].append(toks[i])
            if c is not None and c.done:
                ended[i] = True
            elif len(out[i]) >= max_tokens[i]:
                ended[i] = "length"
        if all(ended):
            break
        logits = model(mx.array(toks)[:, None], cache=cache)[:, -1, :]
    return [(tok.decode(o), len(o), ended[i] is True) for i, o in enumerate(out)]


@pytest.fixture(scope="module")
def tiny():
    from mlx_lm import load

    model, tok = load(str(tiny_model_path()))
    return model, tok, _untimed(GrammarFactory(tok, model.args.vocab_size))


@pytest.fixture(scope="module")
def smollm2():
    from clusterctl.gguf.importer import import_gguf, smollm2_gguf_path
    from mlx_lm import load

    model, tok = load(str(import_gguf(smollm2_gguf_path(), REPO / ".cache" / "smollm2").dest))
    return model, tok, _untimed(GrammarFactory(tok, model.args.vocab_size))


def _untimed(factory: GrammarFactory) -> GrammarFactory:
    """Roll-outs without their 20 ms bound (as lockstep ranks run them): what these tests check must not depend
    on how busy the machine is (a loaded one gave up the roll-out of a long schema: min_tokens None)."""
    factory.rollout_seconds = None
    return factory


def _check(cases, answers):
    bad = []
    for (name, _rf, schema), (text, _n, _ended) in zip(cases, answers):
        try:
            jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
        except (ValueError, jsonschema.ValidationError) as e:
            bad.append(f"{name}: {text!r}: {str(e).splitlines()[0]}")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_every_answer_of_the_random_model_parses_and_validates(tiny):
    """27 formats in one batch (greedy and sampled rows alternate) plus an unconstrained row. CPU time is scarce
    in CI: one batch of 28 rows, at most 63 steps."""
    model, tok, factory = tiny
    cases = formats()
    assert len(cases) >= 20
    prompt = tok.encode("JSON:", add_special_tokens=False)
    # budgets from tight (the shortest answer + 2) to roomy (+ 22): most rows of a random model end by the
    # budget, mid-string or mid-object
    shortest = [factory.compile(rf, max_tokens=1 << 20).min_tokens for _n, rf, _s in cases]
    budgets = [n + 2 + 4 * (i % 6) for i, n in enumerate(shortest)]
    rows = [factory.compile(rf, max_tokens=b) for (_n, rf, _s), b in zip(cases, budgets)]
    k = len(rows)
    answers = decode(model, tok, factory, prompt, rows + [None], max_tokens=budgets + [28],
                     temperature=[0.0, 1.0] * (k // 2) + [0.0] * (k % 2) + [0.0])
    _check(cases, answers[:k])
    assert all(n <= b for (_t, n, _e), b in zip(answers, budgets))
    assert any(r.closed_by_budget for r in rows) and not all(r.closed_by_budget for r in rows)
    with pytest.raises(ValueError):  # the unconstrained row of the same batch is garbage, not JSON
        json.loads(answers[-1][0])


@pytest.mark.slow
def test_smollm2_answers_for_real(smollm2):
    model, tok, factory = smollm2
    cases = [("person", js(PERSON), PERSON), (JSON_OBJECT, {"type": "json_object"}, {"type": "object"})]
    # no system prompt: SmolLM2's prefill is slow on a CPU (the test's time goes into the model, not the mask)
    prompt = tok.encode("<|im_start|>user\nAlice is 30. Answer in JSON.<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)
    rows = [factory.compile(rf, max_tokens=32) for _n, rf, _s in cases]
    answers = decode(model, tok, factory, prompt, rows, max_tokens=[32, 32], temperature=[0.0, 0.0])
    _check(cases, answers)
    assert json.loads(answers[0][0])["age"] == 30 and answers[0][2]  # a real answer, ended by itself


@pytest.mark.slow
def test_random_logits_over_smollm2s_tokenizer(smollm2):
    """The worst sampler there is: random logits over 49,152 tokens, many of them long (e.g. ``"]}`` or ``[{"``),
    every budget from the shortest answer up, every format; no forward pass, so it costs little."""
    _model, tok, factory = smollm2
    cases = formats()
    mx.random.seed(7)
    budgets = [factory.compile(rf, max_tokens=1 << 20).min_tokens + i % 7 for i, (_n, rf, _s) in enumerate(cases)]
    rows = [factory.compile(rf, max_tokens=b) for (_n, rf, _s), b in zip(cases, budgets)]
    out: list[list[int]] = [[] for _ in rows]
    ended = [False] * len(rows)
    while not all(ended):
        logits = mx.random.normal((len(rows), factory.vocab)) * 3.0
        masks = factory.masks([None if e else c for c, e in zip(rows, ended)])
        for i, t in enumerate(mx.random.categorical(apply_masks(logits, masks)).tolist()):
            if ended[i]:
                continue
            if t in factory.eos:
                assert rows[i].accepting
                ended[i] = True
                continue
            rows[i].advance(t)
            out[i].append(t)
            ended[i] = rows[i].done or len(out[i]) >= budgets[i]
    _check(cases, [(tok.decode(o), len(o), True) for o in out])
    assert sum(r.closed_by_budget for r in rows) >= len(rows) // 2


def test_a_tight_budget_still_closes_the_answer(tiny):
    model, tok, factory = tiny
    prompt = tok.encode("{", add_special_tokens=False)
    schema = SCHEMAS["array of objects"]
    rows = [factory.compile(js(schema), max_tokens=b) for b in (24, 30)]
    answers = decode(model, tok, factory, prompt, rows, max_tokens=[24, 30], temperature=[1.0, 1.0], seed=3)
    _check([("a", None, schema)] * 2, answers)
    assert all(r.closed_by_budget for r in rows)
    # what the client hears: finish "length" (max_tokens ended the answer; it still parses), as the ranks report
    from clusterctl.rank.engine.generation import GenRequest, Seq, StopMatcher
    from clusterctl.rank.engine.sampling import GrammarMask

    req = GenRequest(id="r", tokens=prompt, max_tokens=24)
    for procs, finish in (([GrammarMask(rows[0])], "length"), ([], "stop")):
        seq = Seq(req=req, uid=0, detok=tok.detokenizer, stops=StopMatcher([]), procs=procs)
        assert seq.result("stop").finish_reason == finish


def test_the_mask_pads_past_the_tokenizer_and_ends_with_only_eos(tiny):
    _model, tok, _f = tiny
    factory = GrammarFactory(tok, 2048 + 40)
    c = factory.compile(js({"enum": ["yes"]}))
    m = np.array(c.mask())
    assert m.shape == (2088,) and m.dtype == np.bool_ and not m[2048:].any() and m.sum() >= 1
    for t in tok.encode('"yes"', add_special_tokens=False):
        c.advance(t)
    assert c.done and c.accepting
    assert np.flatnonzero(np.array(c.mask())).tolist() == factory.eos
    with pytest.raises(RuntimeError, match="refused"):
        c.advance(tok.encode("x", add_special_tokens=False)[0])


def test_json_object_refuses_a_non_object_and_text_is_no_constraint(tiny):
    _model, tok, factory = tiny
    assert factory.compile({"type": "text"}) is None and factory.compile(None) is None
    c = factory.compile({"type": "json_object"})
    allowed = np.flatnonzero(np.array(c.mask())).tolist()
    assert allowed and all(tok.decode([t]).lstrip().startswith("{") for t in allowed)


@pytest.mark.parametrize("rf, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "strin"),
    (js({"type": "array", "uniqueItems": True}), "uniqueItems"),  # strict: unimplemented keywords refused
    (js({"type": "string", "pattern": "(["}), "regex"),
    (js({"$ref": "#/$defs/nope"}), "nope"),
    (js({"type": "string", "format": "no-such-format"}), "format"),
    (js(json.loads('{"type": "object", "properties": {"a": ' * 200 + "{}" + "}}" * 200)), "recursion"),
    (js({"enum": ["x" * 100] * 1000}), "too large"),
    (js({"type": "number", "minimum": float("nan")}), "not JSON"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}}, "schema"),
    ({"type": "json_schema"}, "schema"),
    ({"type": "xml"}, "type"),
    ("json", "object"),
])
def test_refusals_are_one_line_value_errors(tiny, rf, words):
    _model, _tok, factory = tiny
    with pytest.raises(ValueError) as e:
        factory.compile(rf)
    msg = str(e.value)
    assert "\n" not in msg and words in msg and len(msg) <= 400


def test_not_strict_ignores_what_is_not_implemented(tiny):
    _model, _tok, factory = tiny
    assert factory.compile(js({"type": "array", "uniqueItems": True}, strict=False)) is not None


@pytest.mark.slow
def test_a_sampler_that_keeps_opening_content_still_gets_a_closed_answer(smollm2):
    """The adversary of the budget: whenever the grammar allows a token that opens more content (",", "{", "["
    outside a string, e.g. ``},`` that ends one array item and commits to another with required keys), take it.
    Such a token near the end once lengthened the way out from 2 tokens to 15 with 12 left (bench/grammar.py
    --served: 6 of 24 SmolLM2 answers cut). Every answer must still parse and validate, at every budget."""
    _model, tok, factory = smollm2
    texts = factory.tables().texts
    opens = np.array([any(ch in t for ch in ",{[") for t in texts] + [False] * (factory.vocab - len(texts)))
    cases = formats()
    rng = np.random.default_rng(11)
    for budget_extra in (0, 3, 9, 17, 30):
        rows = [factory.compile(rf, max_tokens=1 << 20) for _n, rf, _s in cases]
        budgets = [r.min_tokens + budget_extra for r in rows]
        rows = [factory.compile(rf, max_tokens=b) for (_n, rf, _s), b in zip(cases, budgets)]
        out: list[list[int]] = [[] for _ in rows]
        for i, c in enumerate(rows):
            while not c.done and len(out[i]) < budgets[i]:
                allowed = np.array(c.mask())
                pick = np.flatnonzero(allowed & opens)
                pick = pick if len(pick) else np.flatnonzero(allowed)
                t = int(rng.choice(pick))
                if t in factory.eos:
                    break
                c.advance(t)
                out[i].append(t)
        _check(cases, [(tok.decode(o), len(o), True) for o in out])


def strict_json(text: str):
    """json.loads as JavaScript's JSON.parse and Go's encoding/json read it: no Infinity, -Infinity or NaN."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_logprobs_under_a_grammar_are_finite_and_list_no_forbidden_token(tiny):
    """A grammar's mask leaves -inf on every token it forbids: an entry's alternatives are only allowed tokens and
    every value is finite (OpenAI's floor, -9999.0), at every step of a constrained answer."""
    from clusterctl.rank.engine.logprobs import Entries
    from clusterctl.rank.engine.sampling import GrammarMask

    model, tok, factory = tiny
    proc = GrammarMask(factory.compile(js({"enum": ["yes", "no"]}), max_tokens=8))
    entries, toks, cache = Entries(tok, 20), tok.encode("say", add_special_tokens=False), None
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(toks)[None], cache=cache)[0, -1]
    for _ in range(8):
        masked = proc(mx.array(toks), logits[None])[0]
        allowed = set(np.flatnonzero(np.array(masked > -np.inf)).tolist())
        lp = masked - mx.logsumexp(masked)
        t = int(mx.argmax(lp).item())
        e = strict_json(json.dumps(entries.entry(t, entries.pending(lp))))
        assert e["top_logprobs"] and {a["id"] for a in e["top_logprobs"]} <= allowed, e
        assert all(a["logprob"] > -9999.0 for a in e["top_logprobs"]) and e["logprob"] >= -9999.0
        if t in factory.eos:
            break
        toks.append(t)
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    assert proc.c.done or proc.c.accepting


def test_a_forbidden_chosen_token_reads_as_the_floor():
    """The chosen token's value is clamped too (a sampler that fell back to the argmax of a fully masked row)."""
    from clusterctl.rank.engine.logprobs import FLOOR, Entries

    class Tok:
        def decode(self, ids):
            return f"t{ids[0]}"

    row = mx.array([0.0, -float("inf"), -float("inf"), -1e9])
    e = Entries(Tok(), 3).entry(1, Entries(Tok(), 3).pending(row))
    assert strict_json(json.dumps(e)) == e and e["logprob"] == FLOOR
    assert [a["id"] for a in e["top_logprobs"]] == [0]


HOSTILE = {
    # 2,000 optional properties, no others: seconds to compile (0.7-3 s), and its mask then allows '{"' that its
    # parser refuses ("Current row has 7999 items")
    "many properties": {"type": "object", "additionalProperties": False,
                        "properties": {f"k{i}": {"type": "integer"} for i in range(2000)}},
    # a recursive $ref with required: its first mask takes 0.1-0.8 s, and its parser refuses '{"' ("Too many items")
    "recursive required": {"$defs": {"n": {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"$ref": "#/$defs/n"}, "b": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
}


@pytest.fixture(scope="module")
def compiler(smollm2):
    from clusterctl.rank.grammar.compiler import Compiler

    _model, tok, _f = smollm2
    c = Compiler(tok)
    c.factory()
    return c


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_costly_schema_is_refused_at_admission_by_its_kind(compiler, name):
    """Refused before any compute, with a typed reason; a second time at once (remembered)."""
    import time

    from clusterctl.rank.grammar.compiler import GrammarRefused, Refusal
    from clusterctl.rank.engine.generation import GenRequest

    def req():
        return GenRequest(id="r", tokens=[1], max_tokens=64, grammar={"response_format": js(HOSTILE[name])})

    with pytest.raises(GrammarRefused) as e:
        compiler.admit(req())
    assert e.value.kind in (Refusal.COMPILE_COST, Refusal.MASK_COST, Refusal.PARSER_LIMIT), e.value
    t0 = time.monotonic()
    with pytest.raises(GrammarRefused) as again:
        compiler.admit(req())
    assert time.monotonic() - t0 < 0.05  # (nothing compiled: it is a look-up)
    assert (again.value.kind, str(again.value)) == (e.value.kind, str(e.value))


@pytest.mark.slow
def test_admission_hands_over_the_constraint_and_its_roll_out_bound(compiler):
    """What admission accepts comes back compiled (the step loop uses it as is) with a roll-out bound in masks that
    every rank applies alike; a rank that compiles it on announcement makes the same constraint."""
    from clusterctl.rank.grammar.compiler import Compiler
    from clusterctl.rank.engine.generation import GenRequest

    req = GenRequest(id="r", tokens=[1], max_tokens=40, grammar={"response_format": js(PERSON)})
    c = compiler.admit(req)
    assert c is not None and 16 <= req.rollout_steps <= 512 and c.rollout_steps == req.rollout_steps
    other = Compiler(compiler.tokenizer)
    other._made = compiler._made  # the same tables (made once per rank)
    other.announce(GenRequest(**req.__dict__))
    mine = other.take(req)
    assert (mine.min_tokens, mine.rollout_steps) == (c.min_tokens, c.rollout_steps) and other.pending == 0
    assert np.array_equal(np.array(mine.mask()), np.array(c.mask()))


@pytest.mark.slow
def test_a_schema_whose_shortest_answer_cannot_fit_max_tokens_is_refused_at_admission(compiler):
    """A shortest answer longer than max_tokens would be forced from its first token and then cut (invalid JSON
    after the compute): refused at admission with a typed kind, naming max_tokens. Not remembered: the same schema
    with a budget it fits is admitted."""
    from clusterctl.rank.grammar.compiler import GrammarRefused, Refusal
    from clusterctl.rank.engine.generation import GenRequest

    def req(n):
        return GenRequest(id="r", tokens=[1], max_tokens=n, grammar={"response_format": js(PERSON)})

    shortest = compiler.admit(req(400)).min_tokens
    with pytest.raises(GrammarRefused) as e:
        compiler.admit(req(shortest - 1))
    assert e.value.kind is Refusal.BUDGET and f"max_tokens {shortest - 1}" in str(e.value), e.value
    assert compiler.admit(req(shortest)).min_tokens == shortest


@pytest.mark.slow
def test_a_failed_roll_out_is_not_repeated_every_step(smollm2):
    """A string of minLength 10^9 has no way out: the roll-out fails and is tried again after 1, 2, 4, ... tokens,
    not at every step of the window (each costs up to its bound in masks)."""
    _model, tok, factory = smollm2
    c = factory.compile_request({"response_format": js({"type": "string", "minLength": 10 ** 9})}, 40, 32)
    calls = []
    real = c._rollout
    c._rollout = lambda state, seconds: calls.append(1) or real(state, seconds)
    a = tok.encode("a", add_special_tokens=False)[0]
    c.advance(tok.encode('"', add_special_tokens=False)[0])
    for _ in range(38):
        c.fill(np.empty(factory._words, dtype=np.int32))
        c.advance(a)
    assert c.min_tokens is None and 3 <= len(calls) <= 6, len(calls)
