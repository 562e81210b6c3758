"""Issue 31 with the official `openai` client, as users' programs call it, against 2 real ranks of each decode
schedule (the session's shared clusters, conftest.py): every sampling control, logprobs, structured output,
usage details, model names and aliases, paths without /v1, and refusals as the client's typed exceptions — each
stream and not. (Tools and reasoning with this client: test_api_tools.py; SmolLM2 with it: test_smollm2.py.)"""

from __future__ import annotations

import json

import pytest

from rankharness import tiny_model_path
from test_api import PROMPT, _close, reference, reference_logprobs

pytestmark = pytest.mark.slow  # every test here starts real ranks

openai = pytest.importorskip("openai")
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model():
    return tiny_model_path()


def _client(c):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{c.http_port}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(cluster):
    """A client of each schedule's cluster: for what the decode schedule could change (tokens, logprobs, masks)."""
    return _client(cluster)


@pytest.fixture(scope="module")
def one(shared_clusters):
    """A client of the overlapped cluster alone: for what admission decides, before any schedule."""
    return _client(shared_clusters("overlap"))


@pytest.fixture(scope="module")
def chat_prompt(model):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(model).apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


def streamed(chunks) -> tuple[str, str | None, list, object]:
    """A chat stream read as a client reads it: the text, the finish reason, the logprob entries, the usage."""
    text, finish, lps, usage = [], None, [], None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
            if c.logprobs is not None and c.logprobs.content:
                lps += [e.model_dump() for e in c.logprobs.content]
    return "".join(text), finish, lps, usage


def test_every_sampling_control_gives_one_mlx_lm_process_tokens(client, model):
    """Penalties, logit_bias and mlx-lm's own extras (top_k, min_p, repetition_penalty through extra_body), greedy:
    the tokens of one mlx-lm process with mlx-lm's processors for the same settings, stream and not."""
    controls = dict(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={"7": 5})
    extra = {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.3, "return_token_ids": True}
    want = reference(model, PROMPT, 8, presence_penalty=1.5, frequency_penalty=0.5, logit_bias={7: 5.0},
                     repetition_penalty=1.3)
    out = client.completions.create(model="tiny-model-test", prompt=PROMPT, max_tokens=8, temperature=0, top_p=0.9,
                                    seed=3, extra_body=extra, **controls)
    assert out.choices[0].model_extra["token_ids"] == want
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model="tiny-model-test", prompt=PROMPT, max_tokens=8, temperature=0, top_p=0.9, seed=3, stream=True,
        extra_body=extra, **controls) if ch.choices)
    assert text == out.choices[0].text
    # a seed makes a sampled answer repeat itself; another seed, another answer
    a, b, c = (client.completions.create(model="tiny-model-test", prompt=PROMPT, max_tokens=12, temperature=1.0,
                                         seed=s).choices[0].text for s in (11, 11, 12))
    assert a == b and a != c


def test_logprobs_stream_and_not_equal_one_mlx_lm_process(client, model, chat_prompt):
    want = reference_logprobs(model, chat_prompt, 5)
    out = client.chat.completions.create(model="tiny-model-test", messages=CHAT, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3)
    _close([e.model_dump() for e in out.choices[0].logprobs.content], want)
    _, finish, lps, _ = streamed(client.chat.completions.create(
        model="tiny-model-test", messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
        stream=True))
    _close(lps, want)
    assert finish == "length"
    # the legacy completions shape: an integer logprobs
    want = reference_logprobs(model, PROMPT, 4)
    lp = client.completions.create(model="tiny-model-test", prompt=PROMPT, max_tokens=4, temperature=0,
                                   logprobs=2).choices[0].logprobs
    assert [round(x, 3) for x in lp.token_logprobs] == [round(w[1], 3) for w in want]
    assert all(len(t) == 2 for t in lp.top_logprobs) and len(lp.text_offset) == 4


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_parses_and_validates(one, stream):
    """(Every schedule, more schemas, tight budgets: test_api.py and test_grammar.py.)"""
    import jsonschema

    client = one
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "kind": {"enum": ["big", "small"]}},
              "required": ["city", "rank", "kind"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    for seed in range(1 if stream else 2):
        args = dict(model="tiny-model-test", messages=CHAT, max_tokens=48, temperature=1.0, seed=seed,
                    response_format=fmt)
        if stream:
            text, _, _, _ = streamed(client.chat.completions.create(stream=True, **args))
        else:
            text = client.chat.completions.create(**args).choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
    if stream:
        return
    out = client.chat.completions.create(model="tiny-model-test", messages=CHAT, max_tokens=40, temperature=1.0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_usage_fingerprint_and_a_context_long_answer(one):
    client = one
    first = client.chat.completions.create(model="tiny-model-test", messages=[{"role": "user", "content": "once"}],
                                           max_tokens=3, temperature=0)
    again = client.chat.completions.create(model="tiny-model-test", messages=[{"role": "user", "content": "once"}],
                                           max_tokens=3, temperature=0)
    assert first.system_fingerprint.startswith("fp_") and again.system_fingerprint == first.system_fingerprint
    # these clusters plan no prompt cache: nothing is cached (a cache hit with this client: test_smollm2.py)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    _, _, _, usage = streamed(client.chat.completions.create(
        model="tiny-model-test", messages=CHAT, max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert usage.completion_tokens == 3 and usage.total_tokens == usage.prompt_tokens + 3
    # no max_tokens: the operator's default (the harness sets 16; without one, until the context is full:
    # test_serving_defaults.py)
    out = client.completions.create(model="tiny-model-test", prompt=PROMPT, temperature=0,
                                    logit_bias={"0": -100, "1": -100, "2": -100})  # no end of text before it
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 16


def test_model_names_aliases_and_paths_without_v1(one, shared_clusters):
    client, cluster = one, shared_clusters("overlap")
    assert [m.id for m in client.models.list().data] == ["tiny-model-test"]
    for name in ("tiny-model-test", "my-alias", "default_model"):
        assert client.chat.completions.create(model=name, messages=CHAT, max_tokens=1).choices
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-5", messages=CHAT, max_tokens=1)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-5")
    assert e.value.code == "model_not_found" and e.value.param == "model"
    bare = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}", api_key="unused", max_retries=0)
    assert bare.completions.create(model="tiny-model-test", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("args, param", [
    ({"n": 9}, "n"), ({"extra_body": {"best_of": 2}}, "best_of"), ({"extra_body": {"echo": True}}, "echo"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"temperature": 3.0}, "temperature"), ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"extra_body": {"chat_template_kwargs": "x"}}, "chat_template_kwargs"),
])
def test_what_cannot_be_honoured_is_a_bad_request_naming_the_field(one, args, param):
    with pytest.raises(openai.BadRequestError) as e:
        one.chat.completions.create(model="tiny-model-test", messages=CHAT, max_tokens=2, **args)
    assert e.value.param == param, e.value.body


def test_a_prompt_past_the_plans_context_is_refused_before_any_compute(one):
    with pytest.raises(openai.BadRequestError) as e:
        one.completions.create(model="tiny-model-test", prompt=PROMPT, max_tokens=200)
    assert e.value.code == "context_length_exceeded" and "128" in e.value.message
