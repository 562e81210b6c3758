"""Embedding offload: the token embedding served from SSD by ``clusterctl.ple`` instead of living in memory.

Only the rank that embeds tokens (rank N-1 in mlx-lm's pipeline order, the only rank in a world of one) reads
rows; every other rank gets a shape-only stand-in from ``loading.py``. The table is never materialised: the
module holds a reader, not an ``mx.array``, so ``mx.eval(model.parameters())`` leaves it on disk. Rows come back
in their storage dtype (BF16 as raw uint16, viewed back; quantized tables dequantized with the model's own
group size and bits), so the output is bit-identical to the in-memory embedding.
"""

from __future__ import annotations

from pathlib import Path

from clusterctl.errors import ConfigError

EMBED_NAME = "model.embed_tokens"


class SsdEmbedding:
    """Callable like ``nn.Embedding``: ids (mx.array of any shape) -> embeddings (ids.shape + (dims,))."""

    def __init__(self, model_path: str | Path, *, name: str = EMBED_NAME, quantization: dict | None = None):
        from clusterctl.ple import Reader

        self.reader = Reader(str(model_path))
        self.quantization = quantization or {}
        names = set(self.reader.names())
        if f"{name}.weight" not in names:
            raise ConfigError(f"no {name}.weight in {model_path}: nothing to offload")
        self.quantized = f"{name}.scales" in names
        if self.quantized:
            if not quantization:
                raise ConfigError(f"{name} is quantized but config.json has no quantization settings")
            self.table = self.reader.quantized_table(name)
            self.scale_dtype = self.reader.info(f"{name}.scales").dtype
        else:
            self.table = self.reader.table(f"{name}.weight")
        self.weight_dtype = self.reader.info(f"{name}.weight").dtype

    def __call__(self, ids):
        import mlx.core as mx
        import numpy as np

        host_ids = np.asarray(ids, dtype=np.int64)
        if self.quantized:
            q = self.table.rows(host_ids)
            scales = _to_mx(q.scales, self.scale_dtype)
            biases = _to_mx(q.biases, self.scale_dtype) if q.biases is not None else None
            return mx.dequantize(mx.array(q.weight), scales, biases,
                                 group_size=self.quantization.get("group_size", 64),
                                 bits=self.quantization.get("bits", 4))
        return _to_mx(self.table.rows(host_ids), self.weight_dtype)

    def as_linear(self, x):  # a tied head needs the whole table in memory: the planner refuses that case
        raise ConfigError("embedding offload cannot serve a tied lm_head")

    def close(self) -> None:
        self.reader.close()


def _to_mx(arr, storage: str):
    import mlx.core as mx

    a = mx.array(arr)
    if storage.upper() == "BF16":
        return a.view(mx.bfloat16)  # the reader keeps BF16 as raw uint16
    return a


def refuse_tied_head(model) -> None:
    """A tied lm_head multiplies by the whole table on every token: it cannot be served from SSD. A model that
    does not say (no ``args.tie_word_embeddings``) counts as tied, the safe side."""
    if getattr(getattr(model, "args", None), "tie_word_embeddings", True):
        raise ConfigError("embedding_offload needs an untied lm_head (this model ties it to the embedding)")


def install(model, model_path: str | Path, config: dict) -> SsdEmbedding:
    """Replace ``model.model.embed_tokens`` (still lazy, never evaluated) with an SSD-backed one."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens"):
        raise ConfigError("this model has no model.embed_tokens to offload")
    refuse_tied_head(model)
    emb = SsdEmbedding(model_path, quantization=config.get("quantization"))
    # nn.Module is a dict of its children: drop the lazy embedding from it, then keep ours as a plain attribute,
    # so the module tree (and mx.eval of its parameters) never sees the table.
    if "embed_tokens" in inner:
        del inner["embed_tokens"]
    object.__setattr__(inner, "embed_tokens", emb)
    return emb
