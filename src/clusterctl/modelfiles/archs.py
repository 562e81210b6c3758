"""How clusterctl can split a model, decided from the class mlx-lm builds for it (never from a list of names).

mlx-lm resolves ``config.json`` to a model class (remapping ``model_type``s, e.g. mistral to llama). The class is
built lazily here (MLX arrays are unevaluated until used, so no weights are made) and inspected:

- its transformer blocks: the one list of ``num_hidden_layers`` modules, found through wrappers
  (``model.model``, ``language_model.model``, ``language_model``, ...);
- its caches (``make_cache()``, else one KVCache per block): clusterctl's own stage code serves any model whose
  caches are key/value caches, plain or rotating (sliding window), because a block another rank runs keeps its
  cache's bookkeeping with zero-width keys (rank/engine/stage.py);
- a model that also has state caches (``ArraysCache``: linear attention, state-space layers) is split by
  mlx-lm's own ``pipeline()`` where its class has one (qwen3_next, qwen3_5, bailing_hybrid), else by the stage
  code, whose skipped state layers keep their cache's padding and lengths (bailing_moe_v3); anything else (caches
  that are not one per block, other cache kinds) is refused here, at plan time, with the reason.

Both sides use this module: ``plan`` for the decision, the rank to find the blocks it splits.
"""

from __future__ import annotations

import sys

from dataclasses import dataclass

STAGES = "stages"  # clusterctl's stage code (rank/engine/stage.py)
MLX_PIPELINE = "mlx-lm"  # mlx-lm's own pipeline() (hybrid models it supports)


@dataclass(frozen=True)
class Capability:
    model_class: str  # "mlx_lm.models.llama.Model"
    pipeline: str | None  # STAGES, MLX_PIPELINE, or None (refused: see reason)
    reason: str | None = None
    shard: bool = False  # the class can shard itself over ranks (tensor parallel: mlx-lm's ``shard(group)``)


def model_class(config: dict):
    """mlx-lm's (Model, ModelArgs) for this config, as its loader resolves them."""
    utils = mlx_lm_utils()

    resolve = getattr(utils, "_get_classes", None)
    if resolve is None:  # pragma: no cover - an mlx-lm without the resolver: import by model_type
        import importlib

        mt = utils.MODEL_REMAPPING.get(config["model_type"], config["model_type"])
        arch = importlib.import_module(f"mlx_lm.models.{mt}")
        return arch.Model, arch.ModelArgs
    return resolve(config)


def mlx_lm_utils():
    """``mlx_lm.utils``, imported without the open-file limit it sets: importing it calls
    ``setrlimit(RLIMIT_NOFILE, (2048, 4096))``, which would undo the CLI's raise (a coordinator holds one connection
    per node) and, being a hard limit, could never be raised again in this process. Every ``mlx_lm`` import runs it
    (the package's ``__init__`` imports ``utils``), so the first one goes through here (plan, launch's model check
    and replan reach mlx-lm only through ``model_class``)."""
    if "mlx_lm.utils" not in sys.modules:
        import resource

        real = resource.setrlimit

        def keep_nofile(which, limits):
            if which != resource.RLIMIT_NOFILE:
                real(which, limits)

        resource.setrlimit = keep_nofile  # only while mlx-lm imports (nothing else sets limits meanwhile)
        try:
            import mlx_lm.utils  # noqa: F401
        finally:
            resource.setrlimit = real
    return sys.modules["mlx_lm.utils"]


def build_lazy(config: dict):
    """An instance of the model's class with unevaluated (never computed) weights."""
    cls, args = model_class(config)
    return cls(args.from_dict(config))


def text_model(model):
    """The module whose ``layers`` list holds the transformer blocks (through wrappers), or None."""
    seen = set()
    todo = [model]
    while todo:
        m = todo.pop(0)
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))
        layers = m.get("layers") if isinstance(m, dict) else None
        if isinstance(layers, list) and layers:
            return m
        for name in ("model", "language_model", "text_model", "decoder", "transformer", "backbone"):
            child = m.get(name) if isinstance(m, dict) else None
            if child is not None:
                todo.append(child)
    return None


def cache_kinds(model) -> list[str]:
    """Class names of the caches mlx-lm makes for this model, one per block."""
    if hasattr(model, "make_cache"):
        return [type(c).__name__ for c in model.make_cache()]
    return ["KVCache"] * len(text_model(model).layers)


KV_CACHES = {"KVCache", "RotatingKVCache", "QuantizedKVCache", "ChunkedKVCache"}
STATE_CACHES = {"ArraysCache"}  # a fixed state per sequence; rank/engine/stage.py keeps a skipped one's bookkeeping


def split_method(model) -> str | None:
    """How a model is split into pipeline stages (STAGES, MLX_PIPELINE), or None when it cannot be; ``plan``
    and every rank decide with this one function. Key/value caches only: the stage code. With state caches too:
    mlx-lm's own ``pipeline()`` where the class has one (what mlx-lm itself runs), else the stage code."""
    inner = text_model(model)
    if inner is None:
        return None
    kinds = cache_kinds(model)
    one_per_block = len(kinds) == len(inner.layers)
    if one_per_block and all(k in KV_CACHES for k in kinds):
        return STAGES
    if hasattr(inner, "pipeline"):
        return MLX_PIPELINE
    if one_per_block and all(k in KV_CACHES | STATE_CACHES for k in kinds):
        return STAGES
    return None


def capability(config: dict, num_layers: int) -> Capability:
    """What clusterctl can do with this model's class (for a plan over more than one node)."""
    try:
        model = build_lazy(config)
    except Exception as e:  # an unknown model_type, or a config its ModelArgs refuses
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return Capability("?", None, f"mlx-lm cannot build this model: {first[:200]}")
    name = f"{type(model).__module__}.{type(model).__name__}"
    inner = text_model(model)
    if inner is None or len(inner.layers) != num_layers:
        found = "no list of blocks" if inner is None else f"{len(inner.layers)} blocks"
        return Capability(name, None, f"{name} has {found}, config.json says {num_layers} layers")
    try:
        kinds = cache_kinds(model)
    except Exception as e:
        return Capability(name, None, f"{name}: cannot make its caches ({type(e).__name__}: {e})"[:300])
    shard = callable(getattr(model, "shard", None))
    method = split_method(model)
    if method is not None:
        return Capability(name, method, shard=shard)
    other = (sorted(set(kinds) - KV_CACHES - STATE_CACHES) if len(kinds) == len(inner.layers)
             else None) or ["a cache list that does not match its blocks"]
    return Capability(name, None, f"{name} keeps {', '.join(other)} (linear attention or state layers): "
                                  "no pipeline split for it yet", shard=shard)


# The size fields of configs, and what a probe shrinks them to: the class's code paths stay, the cost goes.
_SMALL = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "vocab_size": 256,
          "head_dim": 16, "num_attention_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24,
          "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16, "num_experts": 4,
          "n_routed_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
          "sliding_window": 6, "query_pre_attn_scalar": 16}
PROBE_LAYERS = 4


def small_config(config: dict) -> dict:
    """The same architecture at toy size (the same class, block kinds and attention types)."""
    out = dict(config)
    for k, v in _SMALL.items():
        if isinstance(out.get(k), int) and not isinstance(out.get(k), bool):
            out[k] = v
    if isinstance(out.get("num_key_value_heads"), int):
        out["num_key_value_heads"] = 4 if out["num_key_value_heads"] >= config.get("num_attention_heads", 1) else 2
    if isinstance(out.get("num_hidden_layers"), int):
        out["num_hidden_layers"] = min(out["num_hidden_layers"], PROBE_LAYERS)
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][:out.get("num_hidden_layers", PROBE_LAYERS)]
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = small_config(out["text_config"])
    out.pop("quantization", None)
    out.pop("quantization_config", None)
    return out


_BATCHING_TRIED: dict[tuple[str, str], tuple[bool | None, str | None]] = {}  # (class, its args) -> answer
_BATCHING_TRIED_MAX = 256


def batching(config: dict) -> tuple[bool | None, str | None]:
    """Can mlx-lm decode several requests of this architecture together? Tried, not looked up: a toy-size model
    of the same class runs mlx-lm's BatchGenerator on requests of different lengths, one joining late.
    (False, why) when that fails (gemma2 in mlx-lm 0.32: a mask broadcast error); (None, why) when the toy
    model cannot be made (then nothing is known: batching stays on).

    The toy model is ``cls(args)``, so the answer is one per (class, args): a process that plans many times (the
    limit fuzzer's worker plans ~800 configs, most differing only in keys this class never reads) tries each once
    (~70 ms a try)."""
    import dataclasses

    import mlx.core as mx

    try:
        small = small_config(config)
        cls, args_cls = model_class(small)
        args = args_cls.from_dict(small)
        key = (f"{cls.__module__}.{cls.__qualname__}", repr(args)) if dataclasses.is_dataclass(args) else None
        if key in _BATCHING_TRIED:
            return _BATCHING_TRIED[key]
        model = cls(args)
        mx.eval(model.parameters())
    except Exception as e:
        return None, f"no toy-size model to try batching on ({type(e).__name__})"
    answer = _try_batching(model)
    if key is not None and len(_BATCHING_TRIED) < _BATCHING_TRIED_MAX:
        _BATCHING_TRIED[key] = answer
    return answer


def _try_batching(model) -> tuple[bool | None, str | None]:
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    greedy = make_sampler(0.0)
    gen = BatchGenerator(model, stop_tokens=[[-1]], completion_batch_size=4, prefill_batch_size=4)
    try:
        gen.insert([list(range(1, 12)), [4, 5]], max_tokens=[6, 6], samplers=[greedy, greedy])
        for step in range(6):
            gen.next_generated()
            if step == 1:
                gen.insert([[7, 8, 9]], max_tokens=[3], samplers=[greedy])
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return False, f"mlx-lm cannot decode several requests of this model together ({first[:160]})"
    finally:
        gen.close()
    return True, None


_MX_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "U64": "uint64", "I32": "int32", "U32": "uint32", "I16": "int16", "U16": "uint16", "I8": "int8",
              "U8": "uint8", "BOOL": "bool_",
              # FP8 (DeepSeek-V3, Mistral-4, MiniMax checkpoints): mx.load gives the bytes as uint8, which the
              # classes' sanitize turns into bfloat16 with mx.from_fp8
              "F8_E4M3": "uint8", "F8_E5M2": "uint8"}


def kept_tensors(config: dict, tensors: dict[str, tuple[str, list[int]]]) -> dict[str, tuple[str, list[int]]] | None:
    """What mlx-lm's loader keeps of a checkpoint, by name, with (safetensors dtype, shape): the class's own
    ``sanitize`` run on stand-ins of the real shapes (never computed), so per-expert tensors come back stacked and
    layers it drops (multi-token-prediction heads) are gone. None when that cannot be found out (then the names
    are taken as they are)."""
    import mlx.core as mx

    try:
        model = build_lazy(config)
        stand_ins = {n: mx.zeros(tuple(shape), dtype=getattr(mx, _MX_DTYPES[dt])) for n, (dt, shape) in tensors.items()}
        kept = model.sanitize(stand_ins) if hasattr(model, "sanitize") else stand_ins
        names = {}
        for st, m in _MX_DTYPES.items():  # a uint8 that comes back is U8 (same size as FP8)
            names.setdefault(getattr(mx, m), st)
        return {n: (names[v.dtype], list(v.shape)) for n, v in kept.items()}
    except Exception:
        return None
