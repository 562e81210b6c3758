"""A rank's forward pass: one pipeline stage of any mlx-lm model whose caches are key/value caches or state
caches (``ArraysCache``: linear attention, state-space layers).

The model keeps its own ``__call__`` (embedding, masks, the loop over its blocks, final norm, head), so every
architecture's details (sliding-window masks, per-layer block types, softcapping) stay mlx-lm's. Only the list of
blocks changes, keeping its length (so a block's index, and the mask the model picks for it, stay the same):

- a block another rank runs becomes ``Skip``: it passes the hidden state on untouched and holds no weights; it
  still updates its cache with zero-width keys and values, so the cache's bookkeeping (offsets, batch padding,
  a rotating window's position) is exactly what it would be, and masks built from any block's cache are right;
  a skipped state layer moves its cache's padding and lengths on (``keep_state_bookkeeping``);
- this stage's first block receives the hidden state from the previous stage (``Recv``), its last block sends it
  on (``Send``, tied into that block's cache: a prompt chunk's logits are not evaluated, its caches are;
  promptlogprobs.py evaluates them on the last stage for a request that scores its prompt);
- lockstep (``gather``): the model's last block (on every rank: real or ``Skip``) ends in ``Gather``, an all_sum
  in which only the last stage contributes, so every rank gets the final hidden state and computes the same
  logits and the same token (a decode step's; a prompt chunk's logits are never used, so it has no all_sum). Overlapped (overlap.py): no ``Gather``; only the last stage (rank 0) computes logits
  and samples, and sends the token ids on to the first stage.

Stage order is mlx-lm's: rank ``world - 1`` runs the first blocks and rank 0 the last ones, so a deployment's
layer ranges mean what they always meant. Messages on each link come in the same order on both ends by
construction: per forward pass, one receive (from rank + 1), one send (to rank - 1), then (lockstep, a decode
step: every rank's input has one column, or every rank's has more) one all_sum.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from clusterctl.modelfiles.archs import text_model

_PLAIN = (bool, int, float, str, type(None))


def _call_parameters(block: nn.Module) -> list[str]:
    """The names of the arguments a block's ``__call__`` takes after the hidden state, in order. Blocks differ:
    most take (x, mask, cache), ministral3 and mistral4 (x, attn_scale, mask, cache=...)."""
    import inspect

    while isinstance(block, _Around):
        block = block.block
    try:
        params = inspect.signature(block.__call__).parameters.values()
    except (TypeError, ValueError):
        return []
    named = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return named[1:]


def _cache_of(names: list[str], args: tuple, kwargs: dict):
    """The cache a call passes the block (by keyword or by position), else None."""
    if "cache" in kwargs:
        return kwargs["cache"]
    if "cache" in names:
        return args[names.index("cache")] if names.index("cache") < len(args) else None
    return next((a for a in args if hasattr(a, "update_and_fetch")), None)  # a signature that hides its names


class Skip(nn.Module):
    """A block that runs on another rank."""

    def __init__(self, block: nn.Module):
        super().__init__()
        # the model's loop may ask a block what kind it is (llama: use_sliding): the answers stay
        for k, v in vars(block).items():
            if not k.startswith("_") and isinstance(v, _PLAIN):
                object.__setattr__(self, k, v)
        object.__setattr__(self, "_params", _call_parameters(block))

    def __call__(self, x, *args, **kwargs):
        cache = _cache_of(self._params, args, kwargs)
        if cache is not None and hasattr(cache, "update_and_fetch"):
            empty = mx.zeros((x.shape[0], 1, x.shape[1], 0), dtype=x.dtype)
            cache.update_and_fetch(empty, empty)
        elif isinstance(cache, ArraysCache):
            keep_state_bookkeeping(cache, x)
        return x


def keep_state_bookkeeping(cache: ArraysCache, x: mx.array) -> None:
    """What a state layer (linear attention, SSM) another rank runs must still do to its cache: move its
    padding and lengths on by the tokens passed (the model builds the state layers' mask from the first one's
    cache, which may be this one), and hold zero-width stand-ins for the state (one row per sequence), so that
    mlx-lm's batch operations on it (merge, extend, filter, extract a finished row) work as on a real one."""
    for i, c in enumerate(cache.cache):
        if c is None:
            cache[i] = mx.zeros((x.shape[0], 0), dtype=x.dtype)
    cache.advance(x.shape[1])


class _Around(nn.Module):
    """A block with something before or after it; reads through to the block's own attributes."""

    def __init__(self, block: nn.Module, peer: int, group):
        super().__init__()
        self.block = block
        self.peer = peer
        self._group = group
        object.__setattr__(self, "_params", _call_parameters(block))  # plain attributes: not module children

    def __getattr__(self, name):
        if (v := self.get(name)) is not None:
            return v
        block = self.get("block")
        if block is None:
            raise AttributeError(name)
        return getattr(block, name)


class Recv(_Around):
    """What arrives is what a block makes of the embedding (the embedding may be float16 and the blocks float32):
    its dtype is the one this block gives the same input (a graph is built for it once per input dtype, never
    computed: the call's own arguments, without its mask and cache)."""

    def __init__(self, block: nn.Module, peer: int, group):
        super().__init__(block, peer, group)
        object.__setattr__(self, "_dtypes", {})

    def __call__(self, x, *args, **kwargs):
        dtype = self._dtypes.get(x.dtype)
        if dtype is None:
            probe = list(args)
            for name in ("mask", "cache"):
                if name in self._params and self._params.index(name) < len(probe):
                    probe[self._params.index(name)] = None
            extra = {k: (None if k in ("mask", "cache") else v) for k, v in kwargs.items()}
            dtype = self._dtypes[x.dtype] = self.block(mx.zeros(x.shape, dtype=x.dtype), *probe, **extra).dtype
        h = mx.distributed.recv(x.shape, dtype, self.peer, group=self._group)
        return self.block(h, *args, **kwargs)


class Send(_Around):
    def __call__(self, x, *args, **kwargs):
        h = mx.distributed.send(self.block(x, *args, **kwargs), self.peer, group=self._group)
        cache = _cache_of(self._params, args, kwargs)
        if cache is not None and getattr(cache, "keys", None) is not None:
            cache.keys = mx.depends(cache.keys, h)
        elif isinstance(cache, ArraysCache) and cache[-1] is not None:  # a state layer: its state is evaluated
            cache[-1] = mx.depends(cache[-1], h)
        return h


class Gather(_Around):
    """The model's last block: ``last`` on the last stage (its hidden state is the result), others add zeros."""

    def __init__(self, block: nn.Module, last: bool, group):
        super().__init__(block, -1, group)
        self.last = last

    def __call__(self, x, *args, **kwargs):
        h = self.block(x, *args, **kwargs)
        if x.shape[1] > 1:  # a prompt chunk (mlx-lm feeds a prompt's last token with the first step): its logits
            return h  # are never evaluated, so no rank waits for the last stage and the chunks flow through
        if not self.last:
            h = mx.depends(mx.zeros(h.shape, h.dtype), h)
        return mx.distributed.all_sum(h, group=self._group)


def split_blocks(model: nn.Module, rank: int, world: int, start: int, end: int, group=None, *,
                 gather: bool = True) -> nn.Module:
    """Keep blocks [start, end) of ``model`` for this rank (the others become Skip, their weights dropped).
    ``group`` None: the process's group, once joined (the split is made before the ring is). ``gather``: end the
    model in an all_sum of the last stage's hidden state (the lockstep schedule)."""
    inner = text_model(model)
    blocks = list(inner.layers)
    n = len(blocks)
    if not 0 <= start < end <= n:
        raise ValueError(f"layer range [{start}, {end}) does not fit a model of {n} blocks")
    for i in range(n):
        if not start <= i < end:
            blocks[i] = Skip(blocks[i])
    if world > 1:
        if start > 0:
            blocks[start] = Recv(blocks[start], rank + 1, group)
        if end < n:
            blocks[end - 1] = Send(blocks[end - 1], rank - 1, group)
        if gather:
            blocks[n - 1] = Gather(blocks[n - 1], end == n, group)
    inner.layers = blocks
    return model


def is_split(model: nn.Module) -> bool:
    """Was the model split by ``split_blocks`` (and not by mlx-lm's own ``pipeline()``)?"""
    inner = text_model(model)
    return inner is not None and any(isinstance(b, (Skip, _Around)) for b in inner.layers)


def weight_name(param: str) -> str:
    """A parameter's name as the checkpoint has it (without the wrappers' ``block.``)."""
    while ".block." in param:
        param = param.replace(".block.", ".", 1)
    return param
