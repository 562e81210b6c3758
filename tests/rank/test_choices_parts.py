"""n choices' parts without ranks (choices.py): the seed rule, the prompt shares every rank keeps, the scheduler's
decision to give a choice its prompt's KV, and the fan-out of one request into its prompt row and choice rows."""

from __future__ import annotations

import queue

import pytest

from clusterctl.errors import IntegrityError
from clusterctl.rank.api.requests import REQUESTS, parse
from clusterctl.rank.choices import (MAX_SHARES, PROMPT, ChoiceEvent, PromptShares, choice_rows, choice_seed,
                                     prompt_row, shareable)
from clusterctl.rank.engine.generation import GenRequest, GenResult
from clusterctl.rank.engine.requestqueue import ApiRequest, Done, RequestQueue, Text
from clusterctl.rank.engine.scheduler import Scheduler


def test_choice_zero_keeps_the_seed_and_the_others_are_fixed_64_bit_seeds_of_their_own():
    assert choice_seed(77, 0) == 77 and choice_seed((1 << 64) - 1, 0) == (1 << 64) - 1
    seeds = [choice_seed(77, i) for i in range(1, 9)]
    assert len(set(seeds + [77])) == 9 and all(0 <= s < 1 << 64 for s in seeds)
    # the documented rule (docs/api.md), whatever n is
    import hashlib

    assert choice_seed(77, 3) == int.from_bytes(hashlib.sha256(b"77/3").digest()[:8], "big")


def _kv(tokens: int):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    k = mx.arange(tokens * 4, dtype=mx.float32).reshape(1, 1, tokens, 4)
    c.update_and_fetch(k, k + 1)
    return [c]


@pytest.mark.slow  # (MLX's first import: seconds on a loaded machine)
def test_a_share_serves_each_of_its_choices_a_prefix_then_goes():
    s = PromptShares()
    ev = s.expect("p")
    s.keep("p", _kv(10), 10, takers=2)
    assert ev.is_set() and s.has("p")
    first = s.take("p", 9)
    assert first[0].offset == 9 and first[0].keys.shape[2] == 9 and s.has("p")
    second = s.take("p", 9)
    assert second[0].keys.tolist() == first[0].keys.tolist() and not s.has("p")
    assert s.take("p", 9, missing_ok=True) is None
    with pytest.raises(IntegrityError):
        s.take("p", 9)


@pytest.mark.slow
def test_the_oldest_share_goes_first_past_the_bound():
    s = PromptShares()
    for i in range(MAX_SHARES + 1):
        s.keep(f"p{i}", _kv(4), 4, takers=3)
    assert len(s) == MAX_SHARES and not s.has("p0") and s.has(f"p{MAX_SHARES}")


def test_a_choice_takes_its_prompts_kv_only_when_it_is_kept():
    q = RequestQueue()
    reqs = [GenRequest(id=f"c{i}", tokens=list(range(1, 21)), max_tokens=4, prompt_from=p)
            for i, p in enumerate(["kept", "gone", None])]
    for r in reqs:
        q.put(ApiRequest(id=r.id, kind="completion", prepare=lambda _: None, stream=False, req=r))
    s = Scheduler(q, lookup=lambda req: (5, 12), shared=lambda rid: rid == "kept")
    kept, gone, plain = s.meeting(room=3).adds
    assert (kept.prompt_from, kept.cache_from, kept.cache_len) == ("kept", None, 19)
    assert (gone.prompt_from, gone.cache_from, gone.cache_len) == (None, 5, 12)  # processed as any request
    assert (plain.prompt_from, plain.cache_from, plain.cache_len) == (None, 5, 12)


def test_a_request_fans_out_into_a_prompt_row_and_n_choice_rows_with_tagged_events():
    req = GenRequest(id="cmpl-x", tokens=list(range(1, 21)), max_tokens=8, temperature=0.7, seed=11, stop=["\n"],
                     logprobs=2, grammar={"lark": "start: /a+/"}, logit_bias={"3": 1.0})
    base = ApiRequest(id="cmpl-x", kind="completion", prepare=lambda _: None, stream=True, req=req, n=3,
                      grammar="compiled")
    p = prompt_row(base)
    assert (p.req.keep_prompt, p.req.max_tokens, p.req.temperature, p.req.grammar, p.req.logprobs, p.req.stop,
            p.req.logit_bias) == (3, 1, 0.0, None, -1, [], None)
    rows = choice_rows(base, lambda r: f"another for {r.id}", p.id)
    assert [r.req.id for r in rows] == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2"]
    assert [r.req.seed for r in rows] == [choice_seed(11, i) for i in range(3)]
    assert all(r.req.prompt_from == p.id and r.req.tokens == req.tokens and r.req.logprobs == 2 for r in rows)
    assert [r.grammar for r in rows] == ["compiled", "another for cmpl-x-1", "another for cmpl-x-2"]
    done = Done(GenResult(tokens=[], text="", finish_reason="length", prompt_tokens=3))
    rows[2].events.put(Text("a"))
    p.events.put(done)
    got = [base.events.get_nowait(), base.events.get_nowait()]
    assert got == [ChoiceEvent(2, Text("a")), ChoiceEvent(PROMPT, done)]
    with pytest.raises(queue.Empty):
        base.events.get_nowait()
    assert shareable(req.tokens) and not shareable([1, 2, 3])


def _builder(max_n: int | None):
    import json

    from mlx_lm.utils import load_tokenizer

    from clusterctl.rank.api.admission import limits_for
    from clusterctl.rank.api.openai import RequestBuilder
    from clusterctl.protocol.deployment import ServingDefaults
    from clusterctl.protocol.rankspec import RankSpec
    from rankharness import tiny_model_path

    spec = RankSpec(deployment_id="d", job_id="j", nonce="n", node="a", rank=0, world_size=1, model_path="/m",
                    start_layer=0, end_layer=8, layer_counts=[8], num_layers=8, http_port=1, runtime_dir="/r",
                    marker_path="/r/m", gate_path="/r/g", serving=ServingDefaults(max_n=max_n))
    tok = load_tokenizer(tiny_model_path())
    return RequestBuilder(spec, limits_for(json.loads((tiny_model_path() / "config.json").read_text()), tok, 4096))


def _build(b, body: dict):
    """An ApiRequest from a body as rank 0 makes one: parsed into its route's model (requests.py), then built."""
    return b.build(parse(REQUESTS["chat" if "messages" in body else "completion"], body))


@pytest.mark.slow  # (a real tokenizer: transformers' import)
@pytest.mark.parametrize("max_n, fine, refused", [(None, 8, 9), (2, 2, 3), (128, 128, 129)])
def test_n_is_bounded_by_the_operators_limit(max_n, fine, refused):
    from clusterctl.rank.api.wire import ApiError

    b = _builder(max_n)
    assert _build(b, {"prompt": "hello", "n": fine}).n == fine
    assert _build(b, {"messages": [{"role": "user", "content": "hi"}], "n": fine}).n == fine
    for n in (refused, 0, -1):
        with pytest.raises(ApiError) as e:
            _build(b, {"prompt": "hello", "n": n})
        assert e.value.status == 400 and e.value.param == "n" and f"between 1 and {fine}" in e.value.message
    with pytest.raises(ApiError) as e:
        _build(b, {"prompt": "hello", "n": 2, "best_of": 2})
    assert e.value.param == "best_of"


@pytest.mark.slow  # (mlx-lm's model classes)
def test_every_rank_decides_from_the_whole_models_config_whether_prompts_are_shared():
    """A pipeline rank holds a slice of the layers; a gemma3 slice of full-attention layers alone would keep plain
    caches, the whole model does not: every rank says no, from config.json alone."""
    import json

    from clusterctl.rank.choices import shares_prompts
    from rankharness import tiny_model_path

    config = json.loads((tiny_model_path() / "config.json").read_text())
    assert shares_prompts(config)
    mixed = {**config, "model_type": "gemma3_text", "sliding_window": 16, "sliding_window_pattern": 6,
             "num_hidden_layers": 12}
    assert not shares_prompts(mixed)
    assert not shares_prompts({**config, "model_type": "no-such-model"})
