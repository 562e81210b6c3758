"""Does each rank's share fit its node? weights + KV cache + headroom vs usable memory.

needed(rank) = bytes of its layers (pipeline) or 1/N of every layer (tensor)
             + shared bytes (embedding, norm, head: every pipeline rank keeps them)
             + KV: the sum over its layers of bytes/token x min(context, the layer's window) + a state layer's
               fixed bytes, x batch (tensor: 1/N of the per-head caches, the whole of an MLA latent)
             + headroom (MLX allocator, activations, the Python process)
             + the prompt cache's reserve (plan --prompt-cache-gb)
usable(node) = memory_gb x 2^30 x usable_fraction
"""

from __future__ import annotations

from clusterctl.errors import DoesNotFit
from clusterctl.plan.kvquant import quantized_layer
from clusterctl.plan.model import ModelFacts
from clusterctl.protocol.deployment import KvLayer, RankBytes  # noqa: F401  (RankBytes: a record of the deployment file)
from clusterctl.protocol.deployment import PlanOptions
from clusterctl.protocol.nodespec import GIB, Node

DEFAULT_HEADROOM_GB = 0.5
DEFAULT_BATCH = 8  # batch slots a plan reserves when --batch is not given (fewer when fewer fit)


def kv_bytes(layers: list[KvLayer], context: int, batch: int, world: int = 1) -> int:
    """KV-cache bytes of ``batch`` sequences of ``context`` tokens over these layers, on one of ``world`` tensor
    ranks: caches kept per head are divided by the ranks (rounded up), an MLA latent is kept whole on each."""
    sharded = whole = 0
    for layer in layers:
        if layer.sharded:
            sharded += layer.bytes_at(context)
        else:
            whole += layer.bytes_at(context)
    return -(-sharded * batch // world) + whole * batch


def planned_kv_bytes(layers: list[KvLayer], context: int, batch: int, world: int, dtype_bytes: int,
                     quant: PlanOptions | None) -> int:
    """``kv_bytes``, with plan --kv-bits (``quant.kv_bits``): a sequence is stored in full precision until it
    holds quantized_kv_start tokens, quantized whole from then on (plan/kvquant.py): the larger of the two."""
    if quant is None or quant.kv_bits is None:
        return kv_bytes(layers, context, batch, world)
    full = kv_bytes(layers, min(context, quant.quantized_kv_start), batch, world)
    if context < quant.quantized_kv_start:
        return full
    return max(full, kv_bytes([quantized_layer(k, quant, dtype_bytes) for k in layers], context, batch, world))


def rank_bytes(facts: ModelFacts, start: int, end: int, *, parallel: str, world: int,
               context: int, batch: int, headroom_gb: float, embedding_offload: bool = False,
               prompt_cache_gb: float = 0.0, quant: PlanOptions | None = None) -> RankBytes:
    # With embedding offload the token embedding stays on SSD (read row by row by clusterctl.ple).
    shared = facts.shared_bytes - (facts.embed_bytes if embedding_offload else 0)
    if parallel == "tensor":
        weights = -(-sum(facts.layer_bytes) // world) + shared
        kv = planned_kv_bytes(facts.kv_layer_list(), context, batch, world, facts.kv_dtype_bytes, quant)
    else:
        weights = sum(facts.layer_bytes[start:end]) + shared
        kv = planned_kv_bytes(facts.kv_layer_list()[start:end], context, batch, 1, facts.kv_dtype_bytes, quant)
    headroom = int(headroom_gb * GIB)
    cache = int(prompt_cache_gb * GIB)
    return RankBytes(weights=weights, kv=kv, headroom=headroom, prompt_cache=cache,
                     total=weights + kv + headroom + cache)


def prompt_cache_tokens(facts: ModelFacts, ranges: list[tuple[int, int]], *, parallel: str,
                        reserve: int, quant: PlanOptions | None = None) -> int:
    """Tokens of KV the prompt cache may hold: what ``reserve`` bytes keep on the rank whose layers (or heads)
    cost the most per token (quantized when every entry is: plan --kv-bits from the first token on)."""
    world = len(ranges)
    worst = 0
    every = quant is not None and quant.kv_bits is not None and quant.quantized_kv_start == 0
    for s, e in ranges:
        layers = facts.kv_layer_list() if parallel == "tensor" else facts.kv_layer_list()[s:e]
        if every:
            layers = [quantized_layer(k, quant, facts.kv_dtype_bytes) for k in layers]
        worst = max(worst, kv_bytes(layers, 1, 1, world if parallel == "tensor" else 1))
    if reserve <= 0 or worst <= 0:
        return 0
    return min(reserve // worst, 1 << 26)


def slots_that_fit(nodes: list[Node], one_slot: list[RankBytes]) -> int | None:
    """How many batch slots fit on every rank, given each rank's bytes planned for ONE slot (KV grows linearly
    with the slots; weights and headroom do not). None when a node's memory is unknown."""
    best = None
    for node, need in zip(nodes, one_slot):
        usable = node.usable_bytes
        if usable is None:
            return None
        room = usable - need.weights - need.headroom - need.prompt_cache
        n = room // need.kv if need.kv > 0 else 1 << 20
        best = n if best is None else min(best, n)
    return max(0, best if best is not None else 0)


def longest_context(nodes: list[Node], needs_at, most: int = 1 << 26) -> int | None:
    """The longest context per sequence (at most ``most``) for which every rank's ``needs_at(context)`` fits its
    node (0: not even one token); None when a node's memory is unknown. Needs grow with the context."""
    if any(n.usable_bytes is None for n in nodes):
        return None

    def fits(c: int) -> bool:
        return all(need.total <= n.usable_bytes for n, need in zip(nodes, needs_at(c)))

    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


def check_fit(nodes: list[Node], needs: list[RankBytes]) -> None:
    """Raise DoesNotFit naming every node that does not fit, with what it needs and what it has."""
    bad = []
    for node, need in zip(nodes, needs):
        usable = node.usable_bytes
        if usable is None or need.total > usable:
            bad.append({"node": node.name, "needs": need.total, "usable": usable, "weights": need.weights,
                        "kv": need.kv, "headroom": need.headroom, "prompt_cache": need.prompt_cache})
    if not bad:
        return
    parts = []
    for b in bad:
        if b["usable"] is None:
            parts.append(f"node {b['node']} has no memory_gb (set it in cluster.toml, or plan --probe)")
        else:
            # every term of the total, so the parts add up to what is needed
            parts.append(f"node {b['node']} needs {gib(b['needs'])} (weights {gib(b['weights'])} + KV {gib(b['kv'])} "
                         f"+ headroom {gib(b['headroom'])} + prompt cache {gib(b['prompt_cache'])}) but has "
                         f"{gib(b['usable'])} usable")
    raise DoesNotFit("the model does not fit: " + "; ".join(parts), nodes=bad,
                     hint="add memory_gb, use more nodes, a smaller --context/--batch/--prompt-cache-gb, "
                          "--allocation proportional, or a quantized KV cache (--kv-bits 4|8)")
