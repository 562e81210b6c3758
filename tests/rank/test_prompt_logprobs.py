"""echo and prompt log-probabilities (promptlogprobs.py): each schedule's prompt chunks scored as one mlx-lm
process scores the same tokens (one forward pass, float32 log-softmax), within 2e-3; the prompt cache never gives a
scored request its prefix; the API's echo (text, the legacy logprobs object, max_tokens 0); and lm-evaluation-harness's
``local-completions`` loglikelihood end to end against a 2-rank deployment."""

from __future__ import annotations

import http.client
import json
import math

import pytest

from clusterctl.rank.api.requests import REQUESTS, parse
from rankharness import RankCluster, _loaded, tiny_model_path

TOL = 2e-3
TEXT = "def main(argv):\n    total = sum(int(a) for a in argv)  # add them up\n    return total\n"


def _reference(tokens: list[int]) -> list[float | None]:
    """One mlx-lm process: each token's log-probability under the ones before it (the first has none)."""
    import mlx.core as mx

    model, _ = _loaded(str(tiny_model_path()))
    x = model(mx.array(tokens)[None]).astype(mx.float32)[0]
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    return [None] + [lp[i, tokens[i + 1]].item() for i in range(len(tokens) - 1)]


def _close(got: list, want: list) -> None:
    assert len(got) == len(want)
    assert got[0] is None and want[0] is None
    worst = max(abs(g - w) for g, w in zip(got[1:], want[1:]))
    assert worst <= TOL, worst


@pytest.fixture(scope="module")
def tokens():
    _, tok = _loaded(str(tiny_model_path()))
    return tok.encode(TEXT)


# -- in one process: the lockstep batch's prompt chunks (mlx-lm's PromptProcessingBatch) and the overlapped one's
# (prefill.py), several chunks each, rows of different lengths, one row not asking


def test_the_lockstep_batch_scores_every_prompt_token_as_one_mlx_lm_process(tokens):
    from clusterctl.rank.engine.batch import Batch
    from clusterctl.rank.engine.generation import GenRequest

    model, tok = _loaded(str(tiny_model_path()))
    tokens = tokens[:20]  # 3 chunks of 7
    batch = Batch(model, tok, max_batch=4, prefill_step=7)  # several chunks per prompt
    got: dict[str, list] = {"a": [], "b": [], "c": []}
    for rid, n, k in (("a", len(tokens), 2), ("b", 11, -1), ("c", 9, 0)):
        batch.add(GenRequest(id=rid, tokens=tokens[:n], max_tokens=2, temperature=0.0, logprobs=max(k, 0),
                             prompt_logprobs=k), emit=lambda s: None, emit_lp=got[rid].append)
    for _ in range(100):
        if not len(batch):
            break
        batch.step()
    want = _reference(tokens)
    _close([e["logprob"] for e in got["a"][:len(tokens)]], want)
    _close([e["logprob"] for e in got["c"][:9]], want[:9])
    assert len(got["b"]) == 2  # not asked: the generated tokens' entries only
    assert all(len(e["top_logprobs"]) == 2 for e in got["a"][1:len(tokens)])
    assert all(e["top_logprobs"] == [] for e in got["c"][1:9])
    assert got["a"][0]["top_logprobs"] is None


def test_the_overlapped_prompt_chunks_score_every_prompt_token_as_one_mlx_lm_process(tokens, monkeypatch):
    import clusterctl.rank.engine.prefill as prefill
    from clusterctl.rank.engine.generation import GenRequest
    from clusterctl.rank.engine.logprobs import Entries
    from clusterctl.rank.engine.overlap import Row
    from clusterctl.rank.engine.promptlogprobs import PromptScorer

    model, tok = _loaded(str(tiny_model_path()))
    tokens = tokens[:20]
    monkeypatch.setattr(prefill, "PREFILL_CHUNK", 4)
    lengths, got, rows = [len(tokens), 6, 13], [[], [], []], []
    for i, n in enumerate(lengths):
        req = GenRequest(id=str(i), tokens=tokens[:n], max_tokens=2, prompt_logprobs=-1 if i == 1 else 1)
        row = Row(req=req)
        if i != 1:
            row.scorer = PromptScorer(req.tokens, 1, Entries(tok, 1), got[i].append)
        rows.append(row)
    p = prefill.Prefill.start(model, rows, lambda r: 0)
    while p.left:
        p.advance(model, 5)  # slots of 5 columns, forward passes of 4: chunks that straddle slots
    want = _reference(tokens)
    for i in (0, 2):
        _close([e["logprob"] for e in got[i]], want[:lengths[i]])
    assert got[1] == []


def test_a_request_scoring_its_prompt_takes_no_prefix_from_the_prompt_cache():
    from clusterctl.rank.engine.generation import GenRequest
    from clusterctl.rank.engine.scheduler import Scheduler

    sched = Scheduler(None, lookup=lambda req: (3, 40))
    plain, scored = (GenRequest(id=i, tokens=list(range(50)), max_tokens=1, prompt_logprobs=k)
                     for i, k in (("p", -1), ("s", 1)))
    sched._cache_hit(plain)
    sched._cache_hit(scored)
    assert plain.took == (3, 40)
    assert scored.took is None and scored.cache_len == 0


def _build(b, body: dict):
    """An ApiRequest from a body as rank 0 makes one: parsed into its route's model (requests.py), then built."""
    return b.build(parse(REQUESTS["chat" if "messages" in body else "completion"], body))


def test_echo_is_answered_on_completions_and_refused_where_it_means_nothing(tokens):
    from clusterctl.rank.api.admission import Preparer, limits_for
    from clusterctl.rank.api.openai import RequestBuilder
    from clusterctl.rank.api.wire import ApiError
    from clusterctl.protocol.rankspec import RankSpec

    _, tok = _loaded(str(tiny_model_path()))
    spec = RankSpec(deployment_id="d", job_id="j", nonce="n", node="a", rank=0, world_size=1, model_path="/m",
                    start_layer=0, end_layer=8, layer_counts=[8], num_layers=8, http_port=1, runtime_dir="/r",
                    marker_path="/r/m", gate_path="/r/g")
    b = RequestBuilder(spec, limits_for(json.loads((tiny_model_path() / "config.json").read_text()), tok, 4096))
    r = _build(b, {"prompt": tokens, "echo": True, "logprobs": 3, "max_tokens": 0})
    req = Preparer(tok).prepare(r)
    assert (req.prompt_logprobs, req.logprobs, req.max_tokens) == (3, 3, 1)
    assert r.echo.score_only and r.echo.text == tok.decode(tokens)
    assert Preparer(tok).prepare(_build(b, {"prompt": "x", "echo": True})).prompt_logprobs == -1  # no logprobs asked
    for body, param in (({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "x", "echo": "yes"}, "echo")):
        with pytest.raises(ApiError) as e:
            _build(b, body)
        assert e.value.param == param
    with pytest.raises(ApiError) as e:
        _build(b, {"messages": [{"role": "user", "content": "x"}], "echo": True})
    assert e.value.param == "echo"


# -- real ranks


def _post(c: RankCluster, body: dict, *, stream: bool = False):
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=120)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({**body, **({"stream": True} if stream else {})}))
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    assert r.status == 200, raw
    if not stream:
        return json.loads(raw)
    return [json.loads(line[6:]) for line in raw.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _check_scoring(c: RankCluster, tokens: list[int]) -> dict:
    """max_tokens 0: the prompt alone, scored; then echo with a completion: prompt entries, then generated ones."""
    alone = _post(c, {"prompt": tokens[:2], "echo": True, "logprobs": 1, "max_tokens": 0})  # a one-column chunk
    _close(alone["choices"][0]["logprobs"]["token_logprobs"], _reference(tokens[:2]))
    want = _reference(tokens)
    out = _post(c, {"prompt": tokens, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0})
    ch = out["choices"][0]
    lp = ch["logprobs"]
    _close(lp["token_logprobs"], want)
    assert lp["top_logprobs"][0] is None and all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert ch["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0
    _, tok = _loaded(str(tiny_model_path()))
    assert ch["text"] == tok.decode(tokens)
    out = _post(c, {"prompt": TEXT[:40], "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0,
                    "return_token_ids": True})
    ch = out["choices"][0]
    n_prompt = out["usage"]["prompt_tokens"]
    assert ch["text"].startswith(TEXT[:40])
    assert len(ch["logprobs"]["token_logprobs"]) == n_prompt + len(ch["token_ids"])
    return out


@pytest.mark.slow
def test_echo_scores_the_prompt_on_both_schedules(cluster, tokens):
    _check_scoring(cluster, tokens)
    chunks = _post(cluster, {"prompt": tokens[:12], "echo": True, "logprobs": 1, "max_tokens": 0}, stream=True)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    scored = [v for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
              for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    _, tok = _loaded(str(tiny_model_path()))
    assert text == tok.decode(tokens[:12])
    _close(scored, _reference(tokens[:12]))
    # several at once (lm-eval's num_concurrent), prompts of different lengths in one batch; a 2-token prompt's
    # chunk is one column wide (lockstep: it ends in the Gather's all_sum, which every rank must then evaluate)
    from concurrent.futures import ThreadPoolExecutor

    lengths = [2, 5, len(tokens), 17]
    with ThreadPoolExecutor(len(lengths)) as pool:
        outs = list(pool.map(lambda n: _post(cluster, {"prompt": tokens[:n], "echo": True, "logprobs": 1,
                                                       "max_tokens": 1, "temperature": 0}), lengths))
    for n, out in zip(lengths, outs):
        lp = out["choices"][0]["logprobs"]["token_logprobs"]
        _close(lp[:n], _reference(tokens[:n]))
        assert len(lp) == n + 1  # the generated token last (an EOS too): what lm-eval drops


@pytest.mark.slow
def test_echo_on_tensor_parallel_ranks_recomputes_a_prompt_the_cache_holds(tmp_path, tokens):
    with RankCluster(tmp_path, tiny_model_path(), [8, 8], tag="echotp", tensor=True,
                     overrides={"prompt_cache_tokens": 4096, "context_tokens": 256}).up() as c:
        _post(c, {"prompt": tokens, "max_tokens": 2, "temperature": 0})  # its KV now in the prompt cache
        hit = _post(c, {"prompt": tokens + [5], "max_tokens": 1, "temperature": 0})
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the cache is on and would give it
        out = _check_scoring(c, tokens)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# -- lm-evaluation-harness


TASK = """task: clusterctl_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
DOCS = [
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"], "answer": 0},
    {"question": "import os\nprint(os.path.", "choices": ["join('a', 'b'))", "basename(__file__))"], "answer": 1},
    {"question": "for i in range(10):\n    if i", "choices": [" > 3: break", " == 2: pass", ": print(i)"],
     "answer": 2},
]


@pytest.mark.slow
def test_lm_eval_local_completions_gives_the_loglikelihoods_of_one_mlx_lm_process(shared_clusters, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    c = shared_clusters("overlap")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tasks / "tiny_mc.yaml").write_text(TASK.format(data=tasks / "docs.jsonl"))
    model_dir = tiny_model_path()
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=30)
    conn.request("GET", "/v1/models")
    served = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.close()
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={c.url}/v1/completions,model={served},tokenizer_backend=huggingface,"
                   f"tokenizer={model_dir},num_concurrent=1,max_retries=1,timeout=120",
        tasks=["clusterctl_tiny_mc"], log_samples=True, bootstrap_iters=0,  # no stderr resampling: seconds saved
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False))  # its own task only, not ~10k
    samples = results["samples"]["clusterctl_tiny_mc"]
    assert len(samples) == len(DOCS)
    _, tok = _loaded(str(model_dir))
    checked = 0
    for s in samples:
        for (context, continuation), resp in zip(s["arguments"], s["resps"]):
            ll = resp[0][0]
            whole = tok.encode(context + continuation)  # lm-eval's split of the pair (TemplateLM._encode_pair)
            ctx = tok.encode(context)
            want = sum(_reference(whole)[len(ctx):])
            assert math.isfinite(ll) and abs(ll - want) <= TOL, (context, continuation, ll, want)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in DOCS)
    assert 0.0 <= results["results"]["clusterctl_tiny_mc"]["acc,none"] <= 1.0
