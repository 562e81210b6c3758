"""Every architecture family splits over 2 real ranks with clusterctl's own stage code: greedy text identical to
one mlx-lm process, for one request and for 4 concurrent ones (each identical to the same request alone)."""

from __future__ import annotations

import json
import threading

import pytest

from archmodels import (FAMILIES, MLX_PIPELINED, RELEASED, UNBATCHABLE, WRAPPERS, build, build_hf_layout, build_released,
                        config_of)
from rankharness import REPO, RankCluster, complete, reference_tokens, tiny_model_path

pytestmark = pytest.mark.slow  # every test here starts real ranks

PROMPTS = ["def main(argv):", "import sys\nclass Foo", "x = [", "for i in range(10):\n    print(i)\n" * 2]


@pytest.fixture(scope="module")
def models():
    tok = tiny_model_path()
    return {f: build(f, REPO / ".cache" / "arch-models" / f, tok) for f in FAMILIES}


LONG = "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(12))  # 172 tokens: 6 chunks on 2 stages


def completions(c, prompt: str, max_tokens: int, **body) -> list[dict]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=300)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, **body}))
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    assert r.status == 200, out
    return out["choices"]


def _check(c, path, *, long: bool = False):
    """One request, then all of PROMPTS at once: each identical to one process serving it alone. ``long``: first a
    prompt of several chunks (each family's caches fed chunk after chunk, as mlx-lm feeds them; more chunks than
    stages, so they flow through the pipeline; longer than the sliding windows of 6)."""
    if long:
        from mlx_lm.utils import load_tokenizer

        from clusterctl.rank.engine.scheduler import prefill_chunk

        n = len(load_tokenizer(path).encode(LONG))
        assert n > 3 * prefill_chunk(n, c.world), n
        assert complete(c, LONG, 6)["token_ids"] == reference_tokens(path, LONG, 6)
    want = {p: reference_tokens(path, p, 10 + 3 * i) for i, p in enumerate(PROMPTS)}
    assert complete(c, PROMPTS[0], 10)["token_ids"] == want[PROMPTS[0]]
    # n choices: each the same greedy answer, its prompt's KV shared where the family's caches allow (choices.py)
    assert [ch["token_ids"] for ch in completions(c, PROMPTS[0], 10, n=2)] == [want[PROMPTS[0]]] * 2
    got, errors = {}, []

    def run(i, p):
        try:
            got[p] = complete(c, p, 10 + 3 * i)["token_ids"]
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors and got == want


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_on_two_ranks_matches_one_process(family, models, tmp_path):
    from clusterctl.plan.model import inspect_model

    path = models[family]
    facts = inspect_model(path)
    assert facts.pipeline == "stages", facts.pipeline_reason
    with RankCluster(tmp_path, path, [1, 3], tag=family[:6]).up() as c:  # rank 1 runs blocks 0-2, rank 0 the last one
        _check(c, path, long=True)


def test_a_hybrid_whose_first_state_layer_another_rank_runs_serves_like_one_process(models, tmp_path):
    """Bailing V3 (linear attention on layers 0 and 2, MLA on 1 and 3; mlx-lm has no pipeline() for its class):
    split [2, 2], rank 0 runs layer 2, whose padding mask the model builds from layer 0's cache, which rank 0
    skips and keeps only the bookkeeping of (tests/rank/engine/test_stage.py checks the masks themselves). Lockstep: the
    family test above runs [1, 3] overlapped."""
    path = models["bailing_hybrid"]
    with RankCluster(tmp_path, path, [2, 2], tag="bailin", overrides={"schedule": "lockstep"}).up() as c:
        _check(c, path)


@pytest.mark.parametrize("name", sorted(MLX_PIPELINED))
def test_a_hybrid_split_by_mlx_lms_own_pipeline_serves_like_one_process(name, tmp_path):
    """qwen3_next, and model_type bailing_hybrid without Bailing V3's architecture (mlx-lm's bailing_hybrid class:
    gated linear attention beside MLA): their classes have mlx-lm's own pipeline(), which splits them, in
    lockstep."""
    from clusterctl.plan.model import inspect_model

    path = build(name, REPO / ".cache" / "arch-models" / name, tiny_model_path())
    facts = inspect_model(path)
    assert facts.pipeline == "mlx-lm" and facts.model_class.endswith(f".{name.removesuffix('_gla')}.Model")
    with RankCluster(tmp_path, path, [2, 2], tag=name[:6], overrides={"schedule": "lockstep"}).up() as c:
        _check(c, path)


def test_a_split_mlx_lms_own_pipeline_refuses_ends_the_rank_in_one_line(tmp_path):
    """mlx-lm's bailing_hybrid class refuses a split that leaves a rank without an MLA layer (it reads the
    positions from one): rank 1 running layer 0 alone exits 78 with one line, no traceback."""
    path = build("bailing_hybrid_gla", REPO / ".cache" / "arch-models" / "bailing_hybrid_gla", tiny_model_path())
    with RankCluster(tmp_path, path, [3, 1], tag="bailgr", overrides={"schedule": "lockstep"}) as c:
        c.start()
        assert c.wait_exit(1, 60) == 78, c.logs(1)
        assert "mlx-lm cannot split the model as planned ([3, 1])" in c.marker(1).error
        assert "Traceback" not in c.logs(1)


def _shardable(family: str) -> bool:
    from clusterctl.modelfiles.archs import capability

    return capability(config_of(family), 4).shard


TENSOR = sorted(f for f in FAMILIES if _shardable(f))  # the classes with mlx-lm's shard(): llama, qwen2, qwen3


@pytest.mark.parametrize("family", TENSOR)
def test_a_family_sharded_over_two_ranks_matches_one_process(family, models, tmp_path):
    """Tensor parallel: each rank holds half of every block (q/k/v/gate/up by rows, o/down by columns, one
    all_sum each); the sums' order differs from one process's matmul, the greedy tokens must not."""
    from clusterctl.plan.model import inspect_model

    path = models[family]
    assert inspect_model(path).tensor_blockers(2) == []
    with RankCluster(tmp_path, path, [4, 4], tag=family[:6], tensor=True).up() as c:
        _check(c, path)


@pytest.mark.parametrize("family", sorted(UNBATCHABLE))
def test_a_family_mlx_lm_cannot_batch_serves_requests_one_at_a_time(family, tmp_path):
    """gemma2: batched decoding fails inside mlx-lm (in one process too). Planned with one batch slot, the
    deployment queues concurrent requests and answers each, identical to the same request alone: no 500."""
    from clusterctl.plan.model import inspect_model

    path = build(family, REPO / ".cache" / "arch-models" / family, tiny_model_path())
    assert inspect_model(path).batchable is False
    with RankCluster(tmp_path, path, [1, 3], tag=family[:6], overrides={"max_batch": 1}).up() as c:
        _check(c, path)


def test_a_hugging_face_moe_checkpoint_plans_and_serves_as_mlx_lm_loads_it(tmp_path):
    """One tensor per expert (mlx-lm's sanitize stacks them): the plan counts what mlx-lm keeps, the ranks'
    weight check passes, and 2 ranks answer like one process."""
    from clusterctl.plan.model import inspect_model

    path = build_hf_layout("qwen3_moe", REPO / ".cache" / "arch-models" / "qwen3_moe-hf", tiny_model_path())
    facts = inspect_model(path)
    stacked = inspect_model(REPO / ".cache" / "arch-models" / "qwen3_moe-hf-mlx")
    assert facts.layer_bytes == stacked.layer_bytes and facts.num_layers == 4 and not facts.notes
    with RankCluster(tmp_path, path, [1, 3], tag="qwen3m").up() as c:
        _check(c, path)


# (released layout, decode schedule): both schedules run the same stage blocks (Skip, Recv, Send; lockstep adds
# Gather), so each schedule once rather than every family twice (the suite's time)
RELEASED_CASES = [("ministral3", "lockstep"), ("mistral4", "overlap"), ("glm4_moe", "overlap")]


@pytest.mark.parametrize("name,schedule", RELEASED_CASES)
def test_a_released_checkpoint_layout_serves_like_one_process(name, schedule, tmp_path):
    """Checkpoints as their families publish them (tests/archmodels.py RELEASED): Ministral-3 and Mistral-4
    (blocks called as ``block(h, attn_scale, mask, cache=c)``; a vision tower mlx-lm drops; Mistral-4's
    ``kv_b_proj`` and fused experts, which it absorbs and splits), GLM-4.5 with its multi-token-prediction layer.
    Plan and the launch's re-check agree on what the ranks hold, and 2 ranks answer like one process."""
    from clusterctl.plan.model import inspect_model

    path = build_released(name, REPO / ".cache" / "arch-models" / f"{name}-released", tiny_model_path())
    facts = inspect_model(path)
    assert facts.pipeline == "stages" and facts.num_layers == 4, facts.pipeline_reason
    assert inspect_model(path, classify=False).layer_bytes == facts.layer_bytes
    with RankCluster(tmp_path, path, [1, 3], tag=name[:6], overrides={"schedule": schedule}).up() as c:
        _check(c, path)


@pytest.mark.parametrize("family", sorted(WRAPPERS))
def test_a_wrapper_model_splits_by_its_inner_text_model(family, tmp_path):
    """mistral3 keeps its text model in ``language_model`` and its sizes in ``text_config``: the blocks are
    found through the wrapper, in plan and in the ranks."""
    from clusterctl.plan.model import inspect_model

    path = build(family, REPO / ".cache" / "arch-models" / family, tiny_model_path())
    facts = inspect_model(path)
    assert facts.model_class == f"mlx_lm.models.{family}.Model" and facts.pipeline == "stages"
    assert facts.num_layers == 4 and all(facts.layer_bytes)
    with RankCluster(tmp_path, path, [1, 3], tag=family[:6]).up() as c:
        _check(c, path)
