"""What a GGUF file may say before ``model import`` builds anything from it (docs/models.md).

- ``meta``: every number the importer reads, checked for its type, that it is finite, and a range every real
  model is far inside (a context of at least MIN_CONTEXT tokens, a RoPE base above 1, a layer count plan
  accepts); outside, a ConfigError naming the key and the range.
- ``check_tensors``: the tensor table against the metadata, per tensor of the file (nothing is built per layer
  the metadata claims, so a lying layer count costs nothing).
- ``check_template``: the chat template parses in jinja2's sandbox, as transformers renders it, and renders a
  sample conversation within rank 0's size caps and time budget; one that does not would fail on rank 0 at every
  chat request.
"""

from __future__ import annotations

import math
import re
import unicodedata

from typing import TYPE_CHECKING

from clusterctl.errors import ConfigError, IntegrityError
from clusterctl.plan.model import MAX_LAYERS, MAX_SIZE  # so an import never writes a folder plan refuses

if TYPE_CHECKING:
    from clusterctl.gguf.reader import Header

MIN_CONTEXT = 64  # tokens: a chat template and one short question take about 30
MAX_CONTEXT = 1 << 24  # as plan's --context
MAX_HEAD_DIM = 4096  # real models: 64 to 256
ROPE_THETA = (1.0, 1e12)  # the base of RoPE's frequencies: above 1 (1 or less turns them around); real: 1e4 to 1e8
RMS_EPS = (1e-20, 0.5)  # real: 1e-6 to 1e-5
ROPE_FACTOR = (1.0, 1024.0)  # linear or Llama 3 scaling of the context; real: 2 to 32
MAX_TEMPLATE = 1 << 16  # characters of a chat template: real ones have 1,000 to 15,000; 1 MB took 16 s, 1.3 GB

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLK = re.compile(r"^blk\.(0|[1-9][0-9]{0,8})\.([a-z_]+)\.(weight|bias)$")  # one spelling per layer number
_TOP = re.compile(r"^([a-z_]+)\.(weight|bias)$")
_MOE = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def shown(v, limit: int = 60) -> str:
    """A metadata value in a message: strings quoted (repr escapes what would drive a terminal), lists counted."""
    if isinstance(v, list):
        return f"a list of {len(v)} values"
    if isinstance(v, int) and v.bit_length() > 64:
        return f"a {v.bit_length()}-bit integer"
    if isinstance(v, float) and math.isfinite(v) and abs(v) < 3.4e38 and f32(v) != v:
        import numpy as np

        if float(np.float32(v)) == v:  # a float32 value: shown as written (1e-05, not 9.999999747378752e-06)
            v = f32(v)
    text = repr(v) if isinstance(v, str) else str(v)
    return text if len(text) <= limit else text[:limit] + "..."


def meta(md: dict, key: str, path, *, kind=int, default=None, required: bool = True, lo=1, hi=MAX_SIZE,
         above: bool = False, why: str = ""):
    """``md[key]`` (or ``default``) as an int, or a float32-exact float for ``kind=float``, within [lo, hi]
    ((lo, hi] with ``above``); None for an absent optional key. ConfigError naming the key otherwise."""
    v = md.get(key, default)
    if v is None:
        if required:
            raise ConfigError(f"{path}: metadata {key} is missing")
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{path}: metadata {key} = {shown(v)} is not {what}"
                          + (" (per-layer values are not supported)" if isinstance(v, list) else ""))
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{path}: metadata {key} = {v} is not a finite number")
    if not (lo < v if above else lo <= v) or v > hi:
        raise ConfigError(f"{path}: metadata {key} = {shown(v)} is out of range "
                          f"({'above ' if above else ''}{_num(lo)} to {_num(hi)}{why})")
    return f32(v) if kind is float else v


def _num(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def f32(v: float) -> float:
    """A float32 metadata value in its shortest decimal form (1e-05, not 9.999999747378752e-06)."""
    import numpy as np

    return float(str(np.float32(v)))


def check_template(template: str, path, args: dict | None = None) -> None:
    """A chat template rank 0 can run: it parses, with the extensions transformers enables, in rank 0's bounded
    sandbox (protocol/chattemplate.py), and one rendering of a sample conversation stays within rank 0's size caps
    and time budget (a template that refuses the sample, e.g. without a system role, is not refused for it)."""
    if len(template) > MAX_TEMPLATE:
        raise ConfigError(f"{path}: its chat template has {len(template)} characters (at most {MAX_TEMPLATE})")
    from jinja2 import TemplateError

    from clusterctl.protocol import chattemplate

    try:
        chattemplate.environment().from_string(template)
    except TemplateError as e:
        line = getattr(e, "lineno", None)
        raise ConfigError(f"{path}: its chat template does not parse"
                          f"{f' (line {line})' if line else ''}: {e.message or type(e).__name__}") from None
    except (SyntaxError, RecursionError, MemoryError) as e:  # Python's own limits on what jinja2 compiled
        raise ConfigError(f"{path}: its chat template cannot be compiled ({type(e).__name__}: "
                          f"{str(e)[:80] or 'nested too deeply'})") from None
    try:
        chattemplate.check_render(template, args)
    except chattemplate.TemplateTooLarge as e:
        raise ConfigError(f"{path}: rendering a sample conversation, {e.message}") from None
    except chattemplate.BudgetExceeded:
        raise ConfigError(f"{path}: rendering a sample conversation took over {chattemplate.BUDGET_S:g} s "
                          f"(rank 0's budget for one request)") from None


def terminal_text(text: str, limit: int = 200) -> str:
    """Text from a file for a human line: control characters (C0, DEL, C1), line and paragraph separators and
    bidirectional overrides shown as escapes, so a model's name cannot move the cursor, recolour the terminal
    or break the line; cut to ``limit`` characters."""
    out = []
    for ch in text[:limit]:
        cat = unicodedata.category(ch)
        if cat in ("Cc", "Zl", "Zp") or 0x202A <= ord(ch) <= 0x202E or 0x2066 <= ord(ch) <= 0x2069:
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out) + ("..." if len(text) > limit else "")


def check_tensors(h: Header, path, config: dict, head_dim: int):
    """Every tensor named, of the shape the metadata implies, none missing. Returns the renames (GGUF prefix ->
    mlx-lm prefix), the rope_freqs tensor or None, and which bias groups are present. Works per tensor of the
    file (nothing per layer of the metadata is built)."""
    layers, hidden, inter = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    vocab = config["vocab_size"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    rows = {"attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden), "attn_output": (hidden, q),
            "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter),
            "attn_norm": (hidden,), "ffn_norm": (hidden,)}

    renames: dict[str, str] = {}
    rope_freqs = None
    found: dict[str, set[int]] = {kind: set() for kind in rows}  # "attn_q" -> the layers with its weight
    biases: dict[str, set[int]] = {kind: set() for kind in rows}
    for t in h.tensors:
        m, top = _BLK.match(t.name), _TOP.match(t.name)
        if t.name == "rope_freqs.weight":
            rope_freqs = t
            continue
        if m and m.group(2) == "attn_rot_embd":  # precomputed rotary frequencies of old files
            continue
        if m and m.group(2) in _LAYER and int(m.group(1)) < layers:
            i, kind, part = int(m.group(1)), m.group(2), m.group(3)
            renames[t.name.rsplit(".", 1)[0]] = f"model.layers.{i}.{_LAYER[kind]}"
            want = rows[kind] if part == "weight" else rows[kind][:1]
            (found if part == "weight" else biases)[kind].add(i)
            if part == "bias" and kind in ("attn_norm", "ffn_norm"):
                want = None  # a norm has no bias in mlx-lm's llama
        elif top and top.group(1) in _GLOBAL:
            renames[top.group(1)] = _GLOBAL[top.group(1)]
            want = shapes.get(t.name)
        else:
            what = ("mixture-of-experts tensors are" if m and m.group(2) in _MOE else f"tensor {t.name!r} is")
            raise ConfigError(f"{path}: {what} not part of a llama model that can be imported")
        if want != t.shape:
            raise IntegrityError(f"{path}: tensor {t.name} has shape {list(t.shape)}, expected "
                                 f"{list(want or [])} from the metadata")
        if t.name.endswith(".bias") and t.type not in ("F16", "F32"):
            raise ConfigError(f"{path}: bias {t.name} is {t.type}; only F16/F32 biases are supported")
    names = {t.name for t in h.tensors}
    missing = [n for n in ("token_embd.weight", "output_norm.weight") if n not in names]
    missing += [f"blk.{min(set(range(layers)) - have)}.{kind}.weight" for kind, have in found.items()
                if len(have) < layers]
    if missing:
        count = sum(layers - len(have) for have in found.values()) + sum(not n.startswith("blk.") for n in missing)
        raise IntegrityError(f"{path}: {count} tensors are missing, e.g. {missing[0]}")
    # mlx-lm's llama has biases on all of q/k/v/o or none, and on all of gate/up/down or none
    has_bias = {}
    for group, kinds in (("attention", ("attn_q", "attn_k", "attn_v", "attn_output")),
                         ("mlp", ("ffn_gate", "ffn_up", "ffn_down"))):
        present = sum(len(biases[k]) for k in kinds)
        if present not in (0, layers * len(kinds)):
            raise ConfigError(f"{path}: {present} of the {layers * len(kinds)} {group} biases are present; mlx-lm's "
                              f"llama needs all or none")
        has_bias[group] = present > 0
    return renames, rope_freqs, has_bias
