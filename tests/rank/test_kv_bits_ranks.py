"""plan --kv-bits on real ranks: every rank stores its KV cache quantized (rank/engine/kvquant.py), and 2 pipeline
ranks answer greedy requests with the tokens of one mlx-lm process generating with the same kv_bits,
kv_group_size and quantized_kv_start, on both schedules; a prompt the prompt cache gives back (quantized) answers
the same again."""

from __future__ import annotations

import http.client
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from rankharness import RankCluster, complete, reference_tokens, tiny_model_path

PROMPTS = ["def main(argv):", "x = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14"]


def _cached(c: RankCluster, prompt: str, max_tokens: int) -> tuple[list[int], int]:
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=300)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}))
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    assert r.status == 200, out
    return out["choices"][0]["token_ids"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,start", [("overlap", 0), ("lockstep", 12)])
def test_two_pipeline_ranks_store_quantized_kv_like_one_mlx_lm_process(schedule, start, tmp_path):
    """start 0: quantized after the prompt; 12: during the decoding (each prompt served alone, so the batch's
    moment is the sequence's own)."""
    model = tiny_model_path()
    kv = {"kv_bits": 4, "kv_group_size": 64, "quantized_kv_start": start}
    want = {p: reference_tokens(model, p, 20, **kv) for p in PROMPTS}
    assert any(want[p] != reference_tokens(model, p, 20) for p in PROMPTS)  # quantizing changes the tokens
    over = {**kv, "schedule": schedule, "prompt_cache_tokens": 4096}
    with RankCluster(tmp_path, model, [4, 4], tag=f"kvq{schedule[:2]}", overrides=over).up() as c:
        for p in PROMPTS:
            assert complete(c, p, 20)["token_ids"] == want[p], p
        if start == 0:  # the prompt cache keeps the quantized KV; the same prompt reuses it and answers the same
            tokens, cached = _cached(c, PROMPTS[1], 20)
            assert cached > 0 and tokens == want[PROMPTS[1]]
            # decoded together (rows of different lengths in one quantized batch cache): each its own tokens
            fresh = ["import os\n", "while True:"]
            alone = {p: reference_tokens(model, p, 20, **kv) for p in fresh}
            with ThreadPoolExecutor(len(fresh)) as pool:
                together = dict(zip(fresh, pool.map(lambda p: complete(c, p, 20)["token_ids"], fresh)))
            assert together == alone


@pytest.mark.slow
def test_two_tensor_ranks_store_quantized_kv_like_one_mlx_lm_process(tmp_path):
    """Tensor parallel: each rank quantizes the keys and values of its own heads."""
    model = tiny_model_path()
    kv = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}
    want = {p: reference_tokens(model, p, 20, **kv) for p in PROMPTS}
    with RankCluster(tmp_path, model, [8, 8], tag="kvqtp", tensor=True, overrides=kv).up() as c:
        assert {p: complete(c, p, 20)["token_ids"] for p in PROMPTS} == want
