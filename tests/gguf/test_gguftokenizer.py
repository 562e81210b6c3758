"""clusterctl.gguf.tokenizer: tokenizers rebuilt from GGUF metadata (the byte-level BPE of SmolLM2 is tested on
the real file in test_ggufimport.py)."""

import json

import pytest
from tokenizers import Tokenizer

from clusterctl.errors import ConfigError, IntegrityError
from clusterctl.gguf.tokenizer import build_tokenizer
from gguffiles import tiny_vocab

PIECES = ["he", "ll", "▁he", "llo", "▁hello", "or", "▁w", "▁wor", "ld", "▁world"]


def _sentencepiece_md(**extra) -> dict:
    chars = ["▁", "h", "e", "l", "o", "w", "r", "d"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars + PIECES
    scores = [0.0] * 259 + [-100.0 - i for i in range(len(chars))] + [-1.0 - i for i in range(len(PIECES))]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(chars) + len(PIECES))
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, **extra}


def test_sentencepiece_merges_come_from_the_scores():
    """Llama 2 / Mistral style: no merges in the file; pieces merge by score, unknown characters fall back to
    their bytes, a space goes in front of the text (and after a special token, as llama.cpp does)."""
    md = _sentencepiece_md()
    files = build_tokenizer(md, "spm.gguf")
    tok = Tokenizer.from_str(files.tokenizer_json)
    vocab = md["tokenizer.ggml.tokens"]
    assert [vocab[i] for i in tok.encode("hello world").ids] == ["<s>", "▁hello", "▁world"]  # bos: the default
    assert [vocab[i] for i in tok.encode("hé").ids] == ["<s>", "▁", "h", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("hé hello").ids, skip_special_tokens=True) == "hé hello"
    assert [vocab[i] for i in tok.encode("</s>hello").ids] == ["<s>", "</s>", "▁hello"]
    assert files.tokenizer_config["add_bos_token"] is True and files.tokenizer_config["bos_token"] == "<s>"
    plain = Tokenizer.from_str(build_tokenizer(_sentencepiece_md(**{"tokenizer.ggml.add_bos_token": False,
                                                                    "tokenizer.ggml.add_space_prefix": False}),
                                               "spm.gguf").tokenizer_json)
    assert [vocab[i] for i in plain.encode("hello").ids] == ["he", "llo"]  # no "▁": no "▁hello"


def _byte_level_md(**extra) -> dict:
    tokens, types, merges = tiny_vocab()
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 1, **extra}


def test_byte_level_end_tokens_and_template():
    files = build_tokenizer(_byte_level_md(**{"tokenizer.chat_template": "{{ messages }}"}), "bpe.gguf",
                            context_length=256)
    assert files.eos_token_ids == [2, 1] and files.bos_token_id is None
    assert files.tokenizer_config["chat_template"] == "{{ messages }}"
    assert files.tokenizer_config["model_max_length"] == 256
    added = {t["content"]: t["special"] for t in json.loads(files.tokenizer_json)["added_tokens"]}
    assert added == {"<|endoftext|>": True, "<|im_start|>": True, "<|im_end|>": True}


@pytest.mark.parametrize("extra, error, text", [
    ({"tokenizer.ggml.pre": "deepseek-llm"}, ConfigError, "pre-tokenizer 'deepseek-llm' is not supported"),
    ({"tokenizer.ggml.pre": None}, ConfigError, "pre-tokenizer None"),
    ({"tokenizer.ggml.model": "bert"}, ConfigError, "tokenizer type 'bert'"),
    ({"tokenizer.ggml.merges": ["a"]}, IntegrityError, "merge 'a'"),
    ({"tokenizer.ggml.eos_token_id": 10 ** 6}, IntegrityError, "not a token id"),
    ({"tokenizer.ggml.token_type": [1]}, IntegrityError, "1 entries"),
])
def test_refusals(extra, error, text):
    md = {k: v for k, v in _byte_level_md(**extra).items() if v is not None}
    with pytest.raises(error, match=text):
        build_tokenizer(md, "x.gguf")


@pytest.mark.parametrize("extra, error, text", [
    ({"tokenizer.ggml.pre": ["gpt2"]}, ConfigError, "pre-tokenizer ['gpt2'] is not supported"),
    ({"tokenizer.ggml.merges": ["h e", 7]}, IntegrityError, "merges is not a list of text"),
    ({"tokenizer.ggml.merges": ["zz qq"]}, IntegrityError, "cannot be built: Error while initializing BPE"),
    ({"tokenizer.ggml.token_type": ["x"] * 265}, IntegrityError, "token_type is not a list of integers"),
    ({"tokenizer.ggml.token_type": 3}, IntegrityError, "token_type has no list for 265 tokens"),
    ({"tokenizer.chat_template": "{% endfor %}"}, ConfigError, "chat template does not parse (line 1)"),
    ({"tokenizer.chat_template": ["x"]}, ConfigError, "tokenizer.chat_template is not text"),
    ({"tokenizer.chat_template": "{{ x }}" * 10000}, ConfigError, "chat template has 70000 characters (at most 65536)"),
    # issue 41 item 7: templates that compile but render past rank 0's caps
    ({"tokenizer.chat_template": "{{ ('x' * 300000000)|length }}"}, ConfigError,
     "rendering a sample conversation, the chat template would make a repeated str of 300,000,000 characters"),
    ({"tokenizer.chat_template": "{{ (['ab'] * 30000000)|join }}"}, ConfigError,
     "rendering a sample conversation, the chat template would make a repeated list"),
])
def test_lists_of_the_wrong_kind_are_refused(extra, error, text):
    """Found by tests/gguf/test_fuzz_gguf.py: these reached Python errors (exit 70) or a bare tokenizers exception."""
    with pytest.raises(error) as e:
        build_tokenizer(_byte_level_md(**extra), "x.gguf")
    assert text in e.value.message


def test_sentencepiece_scores_and_piece_length():
    n = len(_sentencepiece_md()["tokenizer.ggml.tokens"])
    with pytest.raises(IntegrityError, match="scores is not a list of finite numbers"):
        build_tokenizer(_sentencepiece_md(**{"tokenizer.ggml.scores": [float("nan")] * n}), "spm.gguf")
    md = _sentencepiece_md()
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"][:-1] + ["▁" * 300]
    with pytest.raises(ConfigError, match="a SentencePiece piece of 300 characters"):
        build_tokenizer(md, "spm.gguf")


def test_transformers_generation_tags_parse():
    files = build_tokenizer(_byte_level_md(**{"tokenizer.chat_template": "{% for m in messages %}{% generation %}"
                                                                          "{{ m }}{% endgeneration %}{% endfor %}"}),
                            "bpe.gguf")
    assert "generation" in files.tokenizer_config["chat_template"]
