"""A Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) rebuilt from a GGUF file's metadata.

A GGUF carries its tokenizer as metadata under llama.cpp's keys (``tokenizer.ggml.*``). llama.cpp is the
reference for what those keys mean, so the rebuilt tokenizer splits text the way llama.cpp does:

- ``gpt2`` (byte-level BPE): the vocabulary and merges as stored; the text is first split by the regexes
  llama.cpp picks for ``tokenizer.ggml.pre``. A pre-tokenizer name not listed in PRE_SPLITS is refused: a wrong
  split gives a tokenizer that works but feeds the model token sequences it never saw.
- ``llama`` (SentencePiece BPE, Llama 2 / Mistral): the merges are not stored; they are recovered from the
  token scores (a higher score merges first), with byte fallback for characters outside the vocabulary.

Tokens marked CONTROL become special added tokens (matched whole, skipped by ``decode(skip_special_tokens)``),
USER_DEFINED ones plain added tokens (matched whole).

Nothing is trusted: every list has the type and length it must have before it is used, a SentencePiece piece
is at most MAX_PIECE characters (recovering merges costs the square of a piece's length), and the chat template
must parse (clusterctl.gguf.check).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from clusterctl.errors import ConfigError, IntegrityError
from clusterctl.gguf.check import check_template

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
MAX_PIECE = 256  # characters of a SentencePiece piece that merges (SentencePiece's own default limit is 16)

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> the regexes llama.cpp (src/llama-vocab.cpp) applies one after the other, and whether it
# ignores the merges for a word that is itself a token (llama 3)
PRE_SPLITS: dict[str, tuple[tuple[str, ...], bool]] = {
    **{name: ((_GPT2,), False) for name in ("gpt2", "gpt-2", "mpt", "olmo", "jais")},
    **{name: ((r"\p{N}", _GPT2), False)
       for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")},
    **{name: ((_LLAMA3,), True) for name in ("llama3", "llama-v3", "llama-bpe")},
    **{name: ((_LLAMA3,), False) for name in ("dbrx", "smaug-bpe")},
    "tekken": ((_TEKKEN,), False),
}


@dataclass(frozen=True)
class TokenizerFiles:
    tokenizer_json: str
    tokenizer_config: dict
    bos_token_id: int | None
    eos_token_ids: list[int]  # the eos token first, then end-of-turn / end-of-message tokens if the file names them
    vocab_size: int


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, as byte-level BPE vocabularies use it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


BYTE_SPELLING = _bytes_to_unicode()


def _token_id(md: dict, key: str, n: int, path) -> int | None:
    v = md.get(f"tokenizer.ggml.{key}")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n:
        raise IntegrityError(f"{path}: tokenizer.ggml.{key} = {v!r} is not a token id (vocabulary of {n})")
    return v


def build_tokenizer(md: dict, path, *, context_length: int | None = None) -> TokenizerFiles:
    """The tokenizer files for GGUF metadata ``md``; ConfigError for a tokenizer this cannot rebuild."""
    from tokenizers import AddedToken

    kind = md.get("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ConfigError(f"{path} has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    n = len(tokens)
    types = md.get("tokenizer.ggml.token_type") or [NORMAL] * n
    if not isinstance(types, list) or len(types) != n:
        got = f"{len(types)} entries" if isinstance(types, list) else "no list"
        raise IntegrityError(f"{path}: tokenizer.ggml.token_type has {got} for {n} tokens")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in types):
        raise IntegrityError(f"{path}: tokenizer.ggml.token_type is not a list of integers")
    if kind == "gpt2":
        tok, add_bos_default = _byte_level(md, tokens, path), False
    elif kind == "llama":
        tok, add_bos_default = _sentencepiece(md, tokens, types, path), True
    else:
        raise ConfigError(f"{path}: tokenizer type {kind!r} is not supported (byte-level BPE 'gpt2' and "
                          f"SentencePiece 'llama' are)")

    ids = {k: _token_id(md, f"{k}_token_id", n, path) for k in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    for key in ("bos", "eos", "unknown", "padding", "eot", "eom"):  # some files mark these NORMAL
        i = ids[key]
        if i is not None and types[i] not in (CONTROL, USER_DEFINED):
            special.append(AddedToken(tokens[i], special=True, normalized=False))
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != n:
        raise IntegrityError(f"{path}: the rebuilt tokenizer has {tok.get_vocab_size(with_added_tokens=True)} "
                             f"tokens, the file {n} (duplicate tokens in tokenizer.ggml.tokens?)")
    _post_processor(tok, kind, add_bos and ids["bos"] is not None, add_eos and ids["eos"] is not None,
                    ids, tokens)

    def name(key):
        return tokens[ids[key]] if ids[key] is not None else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # loads tokenizer.json as it is (a model class rebuilds it)
        "bos_token": name("bos"),
        "eos_token": name("eos"),
        "pad_token": name("padding"),
        "unk_token": name("unknown"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length or 1 << 30,
    }
    template = md.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"{path}: tokenizer.chat_template is not text")
    if template:
        check_template(template, path)
        config["chat_template"] = template
    eos = [i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None]
    return TokenizerFiles(tokenizer_json=tok.to_str(pretty=True), tokenizer_config=config,
                          bos_token_id=ids["bos"], eos_token_ids=list(dict.fromkeys(eos)), vocab_size=n)


def _byte_level(md: dict, tokens: list[str], path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = md.get("tokenizer.ggml.pre")
    if not isinstance(pre, str) or pre not in PRE_SPLITS:
        raise ConfigError(f"{path}: byte-level pre-tokenizer {pre!r} is not supported (known: "
                          f"{', '.join(sorted(PRE_SPLITS))})",
                          hint="each pre-tokenizer splits text differently; a guessed one would change the "
                               "token ids the model sees")
    splits, ignore_merges = PRE_SPLITS[pre]
    merges = md.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or not merges:
        raise ConfigError(f"{path}: a byte-level BPE tokenizer without merges (tokenizer.ggml.merges)")
    pairs = []
    for m in merges:
        if not isinstance(m, str):
            raise IntegrityError(f"{path}: tokenizer.ggml.merges is not a list of text")
        left, sep, right = m.partition(" ")
        if not sep or not left or not right:
            raise IntegrityError(f"{path}: tokenizer merge {m!r} is not two tokens separated by one space")
        pairs.append((left, right))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise IntegrityError(f"{path}: tokenizer.ggml.tokens lists {len(tokens) - len(vocab)} tokens twice")
    tok = _bpe(path, Tokenizer, models.BPE, vocab=vocab, merges=pairs, ignore_merges=ignore_merges)
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                 use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(md: dict, tokens: list[str], types: list[int], path):
    """Llama 2 / Mistral style: BPE over SentencePiece pieces ('▁' for a space), merges ranked by score."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = md.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise ConfigError(f"{path}: a SentencePiece tokenizer needs one score per token (tokenizer.ggml.scores)")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in scores):
        raise IntegrityError(f"{path}: tokenizer.ggml.scores is not a list of finite numbers")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise IntegrityError(f"{path}: tokenizer.ggml.tokens lists {len(tokens) - len(vocab)} tokens twice")
    # a merge (l, r) exists for every token that splits into two tokens; it ranks by the merged token's score,
    # as SentencePiece's BPE merges the best-scoring pair first. Control and byte tokens never merge.
    skip = {t for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED, UNKNOWN, BYTE, UNUSED)}
    ranked = []
    for t, score in zip(tokens, scores):
        if t in skip or len(t) < 2:
            continue
        if len(t) > MAX_PIECE:
            raise ConfigError(f"{path}: a SentencePiece piece of {len(t)} characters (at most {MAX_PIECE})")
        local = [(t[:i], t[i:]) for i in range(1, len(t)) if t[:i] in vocab and t[i:] in vocab
                 and t[:i] not in skip and t[i:] not in skip]
        local.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked.extend((score, p) for p in local)
    ranked.sort(key=lambda x: (-x[0], len(x[1][0]), len(x[1][1])))
    unk = _token_id(md, "unknown_token_id", len(tokens), path)
    tok = _bpe(path, Tokenizer, models.BPE, vocab=vocab, merges=[p for _, p in ranked], fuse_unk=True,
               byte_fallback=True, unk_token=tokens[unk] if unk is not None else None)
    # SentencePiece (and llama.cpp) put a space before every piece of text, also one that follows a special
    # token, and keep the text's own leading spaces: a normalizer does that, Metaspace would drop one
    prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", "▁")]
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁")] + steps) if prefix else steps[0]
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _bpe(path, tokenizer, bpe, **kw):
    """The tokenizers library's BPE model, its refusal (a merge of a token not in the vocabulary ...) as ours."""
    try:
        return tokenizer(bpe(**kw))
    except Exception as e:  # tokenizers raises a bare Exception
        raise IntegrityError(f"{path}: the tokenizer cannot be built: {str(e)[:200]}") from None


def _post_processor(tok, kind: str, add_bos: bool, add_eos: bool, ids: dict, tokens: list[str]) -> None:
    from tokenizers import processors

    steps = [processors.ByteLevel(trim_offsets=False)] if kind == "gpt2" else []
    if add_bos or add_eos:
        bos = f"{tokens[ids['bos']]}:0 " if add_bos else ""
        eos = f" {tokens[ids['eos']]}:0" if add_eos else ""
        specials = [(tokens[ids[k]], ids[k]) for k, on in (("bos", add_bos), ("eos", add_eos)) if on]
        steps.append(processors.TemplateProcessing(
            single=f"{bos}$A:0{eos}", pair=f"{bos}$A:0{eos} {bos.replace(':0', ':1')}$B:1{eos.replace(':0', ':1')}",
            special_tokens=list(dict.fromkeys(specials))))
    if steps:
        tok.post_processor = steps[0] if len(steps) == 1 else processors.Sequence(steps)
