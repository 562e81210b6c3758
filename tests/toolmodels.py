"""Tiny models whose chat templates call tools and think, for the tool and reasoning tests (no downloads).

The tiny test model's tokenizer knows no markers and its template renders no tools. mlx-lm infers a model's
tool-call format from its chat template (``<tool_call>`` and ``tool_call.name`` in it: ``json_tools``;
``<tool_call>\\n<function=``: ``qwen3_coder``; ``[TOOL_CALLS]``: ``mistral``) and thinking from the vocabulary
(``<think>`` and ``</think>`` tokens). So the markers become tokens as in Qwen's tokenizers (added, not special,
so they detokenize as text):
they take the ids of the BPE's last merges, whose merges are dropped, and the vocabulary keeps its size — the
weights stay the tiny model's own, linked, and ranks can serve the folder.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

TOOL_MARKERS = {"json_tools": ["<tool_call>", "</tool_call>"], "qwen3_coder": ["<tool_call>", "</tool_call>"],
                "mistral": ["[TOOL_CALLS]", "[ARGS]"]}
THINK_MARKERS = ["<think>", "</think>"]

_SYSTEM_TOOLS = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\n' + CALL_HELP + '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
)

# Qwen2.5 / Hermes: one JSON object per call between <tool_call> markers (mlx-lm: json_tools)
_JSON_CALL = (
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
)
_JSON_HELP = ("For each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
              "\"arguments\": <args-json-object>}\\n</tool_call>")

# Qwen3-Coder: XML-ish parameters (mlx-lm: qwen3_coder)
_XML_CALL = (
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{%- for k, v in tool_call.arguments.items() %}"
    "{{- '<parameter=' + k + '>\\n' }}{{- v if v is string else v | tojson }}{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}"
)
_XML_HELP = ("To call a function reply:\\n<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n"
             "</parameter>\\n</function>\\n</tool_call>")

_MESSAGES = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}CALL{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
)

# Qwen3-style switch; when thinking, the generation prompt opens the block (as DeepSeek-R1 and Qwen3's
# thinking-only releases do), so the reply starts inside it
# Mistral: calls after [TOOL_CALLS], none closed (mlx-lm: mistral; no end marker, the rest of the reply is calls)
_MISTRAL_CALL = (
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '[TOOL_CALLS]' + tool_call.name + '[ARGS]' }}{{- tool_call.arguments | tojson }}"
)
_MISTRAL_HELP = "To call a function reply [TOOL_CALLS]NAME[ARGS]{JSON arguments}"

_PROMPT_THINKING = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"


def chat_template(call_format: str = "json_tools", thinking: bool = True) -> str:
    call, help_ = {"json_tools": (_JSON_CALL, _JSON_HELP), "qwen3_coder": (_XML_CALL, _XML_HELP),
                   "mistral": (_MISTRAL_CALL, _MISTRAL_HELP)}[call_format]
    system = _SYSTEM_TOOLS.replace("CALL_HELP", "'" + help_ + "'")
    return system + _MESSAGES.replace("CALL", call) + (_PROMPT_THINKING if thinking else _PROMPT)


def _tiny() -> Path:
    launch = str(Path(__file__).resolve().parent / "launch")
    if launch not in sys.path:  # the rank tests have it; other folders may not
        sys.path.insert(0, launch)
    from rankharness import tiny_model_path

    return tiny_model_path()


def write_tokenizer(dest: Path, *, call_format: str = "json_tools", thinking: bool = True,
                    source: Path | None = None, call_tokens: bool = True) -> Path:
    """``dest`` with tokenizer.json and tokenizer_config.json: the tiny model's tokenizer, the markers as
    tokens, and a chat template that renders tools (``call_format``) and, if ``thinking``, a think block.
    ``call_tokens`` False leaves the call markers text of several tokens (as SmolLM2's tokenizer spells them)."""
    source = source or _tiny()
    dest.mkdir(parents=True, exist_ok=True)
    tok = json.loads((source / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    by_id = {i: s for s, i in vocab.items()}
    markers = (TOOL_MARKERS[call_format] if call_tokens else []) + (THINK_MARKERS if thinking else [])
    size = len(vocab)
    for k, marker in enumerate(markers):
        i = size - len(markers) + k
        del vocab[by_id[i]]
        vocab[marker] = i
        tok["added_tokens"].append({"id": i, "content": marker, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
    # the last merges made the tokens whose ids the markers took; nothing merges after them
    merges = tok["model"]["merges"]
    tok["model"]["merges"] = merges[: len(merges) - len(markers)]
    (dest / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    cfg = json.loads((source / "tokenizer_config.json").read_text())
    cfg["chat_template"] = chat_template(call_format, thinking)
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return dest


def tool_model(dest: Path, *, call_format: str = "json_tools", thinking: bool = True, call_tokens: bool = True) -> Path:
    """A whole model folder at ``dest`` that ranks can serve: the tiny model's config and weights (linked) and
    the tool tokenizer of ``write_tokenizer``."""
    source = _tiny()
    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name.startswith("tokenizer") or f.name == "clusterctl-tiny.json":
            continue
        target = dest / f.name
        if f.suffix == ".safetensors":
            try:
                os.link(f, target)  # a hard link: the folder stays valid if the cache is rebuilt
            except OSError:
                shutil.copyfile(f, target)
        else:
            shutil.copyfile(f, target)
    return write_tokenizer(dest, call_format=call_format, thinking=thinking, source=source, call_tokens=call_tokens)
