"""Admission's parts in one process, on the real tiny model: a request whose sampling fails fails alone (the
lockstep batch and the overlapped sampler), the template budget, the byte cap before tokenizing."""

from __future__ import annotations

import contextlib
import json
import shutil
import time

import pytest

from clusterctl.rank.api.requests import REQUESTS, parse
from rankharness import tiny_model_path

PROMPT = "def main(argv):"


@pytest.fixture(scope="module")
def loaded():
    from mlx_lm import load

    return load(str(tiny_model_path()))


def _req(rid: str, tokens: list[int], **kw):
    from clusterctl.rank.engine.generation import GenRequest

    return GenRequest(id=rid, tokens=tokens, max_tokens=kw.pop("max_tokens", 6), **kw)


def _run(batch, ids: set[str]) -> dict:
    done = {}
    for _ in range(200):
        for rid, res in batch.step():
            done[rid] = res
        if ids <= set(done):
            return done
    raise AssertionError(f"not finished: {ids - set(done)}")


def test_a_row_whose_sampler_raises_fails_alone_in_the_lockstep_batch(loaded):
    """top_k past the vocabulary reaches the batch (admission would have dropped it): mlx-lm's top-k raises as
    the step is built; that request ends with an error, its neighbour gets the tokens it gets alone."""
    from clusterctl.rank.engine.batch import Batch

    model, tok = loaded
    tokens = tok.encode(PROMPT)
    alone = Batch(model, tok, max_batch=4)
    alone.add(_req("good", tokens, temperature=0.0))
    want = _run(alone, {"good"})["good"]
    alone.close()
    batch = Batch(model, tok, max_batch=4)
    batch.add(_req("good", tokens, temperature=0.0))
    batch.add(_req("bad", tokens, temperature=0.7, top_k=1 << 20))
    got = _run(batch, {"good", "bad"})
    batch.close()
    assert got["bad"].finish_reason == "error" and "top_k" in got["bad"].error, got["bad"]
    assert got["good"].tokens == want.tokens and got["good"].error is None
    # the failure left MLX's random state usable: the next sampled request of this rank is served (the sampler
    # raised inside a compiled function, which once left the state an array without a primitive, and every
    # later sampled request failed)
    import mlx.core as mx

    mx.eval(mx.random.state)
    after = Batch(model, tok, max_batch=4)
    after.add(_req("next", tokens, temperature=0.7, top_k=5))
    res = _run(after, {"next"})["next"]
    after.close()
    assert res.error is None and res.tokens, res


def test_the_overlapped_sampler_falls_back_and_says_why():
    import mlx.core as mx

    from clusterctl.rank.engine.sampling import RowSampler

    s = RowSampler(_req("r", [1, 2], temperature=0.5, top_k=500, seed=3))
    logits = mx.array([[0.0] * 99 + [5.0]])
    assert s(logits).item() == 99 and s.failed and "top_k" in s.failed
    ok = RowSampler(_req("r", [1, 2], temperature=0.5, top_k=5, seed=3))
    ok(logits)
    assert ok.failed is None


def _tokenizer_with_template(tmp_path, template: str):
    from mlx_lm.utils import load_tokenizer

    src = tiny_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return load_tokenizer(tmp_path)


def _builder(tok, context=4096):
    from clusterctl.rank.api.admission import limits_for
    from clusterctl.rank.api.openai import RequestBuilder
    from clusterctl.protocol.rankspec import RankSpec

    spec = RankSpec(deployment_id="d", job_id="j", nonce="n", node="a", rank=0, world_size=1, model_path="/m",
                    start_layer=0, end_layer=8, layer_counts=[8], num_layers=8, http_port=1, runtime_dir="/r",
                    marker_path="/r/m", gate_path="/r/g")
    return RequestBuilder(spec, limits_for(json.loads((tiny_model_path() / "config.json").read_text()), tok,
                                           context))


def _build(b, body: dict):
    """An ApiRequest from a body as rank 0 makes one: parsed into its route's model (requests.py), then built."""
    return b.build(parse(REQUESTS["chat" if "messages" in body else "completion"], body))


@pytest.mark.slow
def test_a_template_that_runs_past_its_budget_is_interrupted(tmp_path):
    from clusterctl.rank.api.admission import Preparer
    from clusterctl.rank.api.openai import ApiError

    slow = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tok = _tokenizer_with_template(tmp_path, slow)
    job = _build(_builder(tok), {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    t0 = time.monotonic()
    with pytest.raises(ApiError) as e:
        Preparer(tok, budget_s=0.5).prepare(job)
    assert e.value.status == 400 and e.value.code == "prompt_budget_exceeded"
    assert time.monotonic() - t0 < 30  # interrupted, not run to its end (10^10 iterations)
    # the thread's tracing is gone afterwards, and a normal template still renders under the budget
    import sys

    assert sys.gettrace() is None
    fine = _tokenizer_with_template(tmp_path, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    req = Preparer(fine, budget_s=0.5).prepare(_build(_builder(fine), {"messages": [{"role": "user", "content": "hi"}],
                                                                       "max_tokens": 4}))
    assert req.tokens


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(loaded):
    from clusterctl.rank.api.openai import ApiError

    _, tok = loaded
    b = _builder(tok, context=64)
    cap = b.limits.prompt_bytes
    assert b.limits.context == 64 and cap == 64 * b.limits.token_bytes
    with pytest.raises(ApiError) as e:  # refused by the builder itself: no ApiRequest, no tokenizer
        _build(b, {"prompt": "x" * (cap + 1), "max_tokens": 4})
    assert e.value.code == "context_length_exceeded" and "planned context of 64 tokens" in e.value.message
    with pytest.raises(ApiError):
        _build(b, {"messages": [{"role": "user", "content": "é" * (cap // 2 + 1)}], "max_tokens": 4})
    assert _build(b, {"prompt": "x" * 10, "max_tokens": 4}) is not None


def test_a_prompt_at_the_context_is_scored_and_refusals_name_what_was_sent(loaded):
    """issue 49 item 10: scoring (echo, max_tokens 0) needs no room to generate, so a prompt of exactly the
    context is scored; a refusal names the values the client sent (never the one token made inside, never a
    default it did not send), and an operator's default max_tokens is cut to what the prompt leaves."""
    from clusterctl.rank.api.admission import Preparer
    from clusterctl.rank.api.openai import ApiError

    _, tok = loaded
    b = _builder(tok, context=64)

    def refusal(body) -> str:
        with pytest.raises(ApiError) as e:
            Preparer(tok).prepare(_build(b, body))
        assert e.value.status == 400 and e.value.code == "context_length_exceeded", e.value.message
        return e.value.message

    req = Preparer(tok).prepare(_build(b, {"prompt": [5] * 64, "echo": True, "max_tokens": 0, "logprobs": 1}))
    assert len(req.tokens) == 64 and req.prompt_logprobs == 1
    assert "prompt (65 tokens) exceeds" in refusal({"prompt": [5] * 65, "echo": True, "max_tokens": 0})
    said = refusal({"prompt": [5] * 64})  # nothing sent: no room for a completion, and no max_tokens named
    assert "prompt (64 tokens) leaves no room" in said and "max_tokens" not in said
    assert "plus max_tokens (5)" in refusal({"prompt": [5] * 60, "max_tokens": 5})
    chat = {"messages": [{"role": "user", "content": "hi " * 70}], "max_completion_tokens": 3}
    assert "plus max_completion_tokens (3)" in refusal(chat)
    b = _builder(tok, context=64)
    b.spec = b.spec.model_copy(update={"max_tokens_default": 16})
    assert Preparer(tok).prepare(_build(b, {"prompt": [5] * 60})).max_tokens == 4
    assert Preparer(tok).prepare(_build(b, {"prompt": [5] * 10})).max_tokens == 16


# Template expressions that make one large value in one step (issue 41 item 7): the line tracer cannot see time
# or memory inside one operation or filter. {n} is a size from SIZES; at the largest each would make 200 MB to
# 1 GB without the caps (scaled so that running them on code without the caps cannot exhaust the machine).
EXPRESSIONS = [
    "{{{{ ('x' * {n})|length }}}}", "{{{{ (['ab'] * ({n} // 10))|join }}}}", "{{{{ 'x'|center({n})|length }}}}",
    "{{{{ 'x'.ljust({n})|length }}}}", "{{{{ ('%{n}s' % 'x')|length }}}}", "{{{{ ('{{:>{n}}}'.format('x'))|length }}}}",
    "{{{{ (2 ** ({n} // 1000))|string|length }}}}", "{{{{ range(3)|map('center', {n} // 3)|join|length }}}}",
    "{{% set s = 'xy' * 1000 %}}{{{{ (s|replace('x', s * ({n} // 3000000 + 1)))|length }}}}",
    "{{% set s = 'x' * ({n} // 30) %}}{{{{ (s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s)|length }}}}",
    "{{% set s = 'x' * ({n} // 30) %}}{{% for i in range(10) %}}{{{{ s }}}}{{% endfor %}}",
    "{{% set s = 'x' * ({n} // 30) %}}{{{{ [s, s, s, s, s, s]|tojson|length }}}}",
    "{{{{ ('a\\tb' * 1000).expandtabs({n} // 1000)|length }}}}", "{{{{ 'x\\ny'|indent({n})|length }}}}",
    "{{{{ ([1]|batch({n} // 10, 'x')|list|first)|length }}}}",
]
SIZES = [10, 100000, 300000000]


def _random_template(rng) -> str:
    """A chat template built from pieces that can take long: nested loops, recursive macros, filters, and
    expressions that make a large value in one step."""
    loops = rng.randint(0, 3)
    body = "{{ m['content'] | trim }}"
    for i in range(loops):
        body = f"{{% for i{i} in range({rng.choice([10, 300, 100000])}) %}}{body}{{% endfor %}}"
    parts = [f"{{% for m in messages %}}{body}{{% endfor %}}"]
    if rng.random() < 0.3:
        parts.insert(0, "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
    if rng.random() < 0.3:
        parts.append("{{ (messages | map(attribute='content') | join(' ')) | upper | replace('A', 'b') }}")
    for _ in range(rng.choice([0, 1, 1, 2])):
        parts.insert(rng.randint(0, len(parts)), rng.choice(EXPRESSIONS).format(n=rng.choice(SIZES)))
    return "".join(parts)


@contextlib.contextmanager
def _peak_mb():
    """The most memory Python allocated meanwhile, in MB (yields a list the peak is appended to)."""
    import tracemalloc

    got: list[float] = []
    tracemalloc.start()
    try:
        yield got
    finally:
        got.append(tracemalloc.get_traced_memory()[1] / 1e6)
        tracemalloc.stop()


@pytest.mark.slow
@pytest.mark.parametrize("template", [e.format(n=300000000) for e in EXPRESSIONS])
def test_one_step_past_the_cap_is_refused_before_it_is_made(tmp_path, template):
    """Each expression at 3e8: refused (400 prompt_budget_exceeded) before the value exists, fast."""
    from clusterctl.rank.api.admission import Preparer
    from clusterctl.rank.api.openai import ApiError

    tok = _tokenizer_with_template(tmp_path, template + "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    job = _build(_builder(tok), {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    t0 = time.monotonic()
    with _peak_mb() as peak, pytest.raises(ApiError) as e:
        Preparer(tok, budget_s=5.0).prepare(job)
    assert e.value.status == 400 and e.value.code == "prompt_budget_exceeded", e.value.message
    assert "the chat template" in e.value.message
    assert time.monotonic() - t0 < 5 and peak[0] < 200, (time.monotonic() - t0, peak)


@pytest.mark.slow
def test_fuzzed_templates_render_or_are_refused_within_their_budget(tmp_path):
    """Templates of random shape (seeded): each renders, or is refused with a 4xx, in about its budget."""
    import random

    from clusterctl.rank.api.admission import Preparer
    from clusterctl.rank.api.openai import ApiError

    rng = random.Random(30)
    outcomes = {"rendered": 0, "refused": 0}
    peaks = []
    for n in range(12):
        d = tmp_path / str(n)
        d.mkdir()
        tok = _tokenizer_with_template(d, _random_template(rng))
        job = _build(_builder(tok), {"messages": [{"role": "user", "content": "hi " * rng.randint(1, 50)}],
                                     "max_tokens": 2})
        t0 = time.monotonic()
        with _peak_mb() as peak:
            try:
                Preparer(tok, budget_s=0.3).prepare(job)
                outcomes["rendered"] += 1
            except ApiError as e:
                assert 400 <= e.status < 500 and e.message
                outcomes["refused"] += 1
        peaks.extend(peak)
        # the budget, plus what runs outside template code (the byte cap bounds the tokenizer's share)
        assert time.monotonic() - t0 < 10, (n, time.monotonic() - t0)
    # no value past the cap was ever made (a 3e8-character string alone is 286 MB)
    assert max(peaks) < 200, peaks
    assert outcomes["rendered"] and outcomes["refused"], outcomes
