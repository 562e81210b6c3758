"""The rank's group: joining it and checking every peer runs the same job and split, handing it to a
tensor-parallel model, and the control collectives every rank calls in the same order (the meeting's small int32
vector, rank 0's payload, the token agreement after a request).

Nothing here imports mlx at module level: runtime.py and loading.py import this module before the environment
is final.
"""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

from clusterctl.errors import ConfigError, IntegrityError
from clusterctl.protocol.rankspec import RankSpec

HEADER_WORDS = 8
MAGIC = 0x434C5354  # "CLST": a stale rank of another protocol/job sums to something else
MAX_PAYLOAD = 64 << 20


class MeetingWords(NamedTuple):
    """A meeting's int32 vector (one all_sum), by name. Rank 0 writes the header's content (the others zeros);
    every rank adds its stop vote, a 1 to ``heads`` (the sum: how many met), its own load words and its grammar
    compiles still running. On the wire: the HEADER_WORDS header words in this order, the load words, the
    compiles."""

    magic: int  # MAGIC
    kind: int  # steploop's KIND_IDLE or KIND_REQUEST
    length: int  # bytes of batch changes shared after the header (0: none)
    stop: int  # stop votes
    seq: int  # the meeting's number
    heads: int  # ranks that met
    epoch: int  # rank 0's newest cancel epoch
    gap: int  # steps until the next meeting
    load: list[int]  # 3 words per rank (steploop.LoadWords)
    compiling: int  # grammar compiles still running, summed over the ranks

    def to_words(self) -> list[int]:
        return [*self[:HEADER_WORDS], *self.load, self.compiling]

    @classmethod
    def from_words(cls, words: list[int]) -> MeetingWords:
        return cls(*words[:HEADER_WORDS], words[HEADER_WORDS:-1], words[-1])


class GroupStandIn:
    """The two things ``PipelineMixin.pipeline`` and a model's ``shard()`` ask of a group, before the real group
    exists (the split needs only rank and size; ``attach_group`` puts the real one in its place)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def attach_group(model, group) -> None:
    """Give the sharded layers of a tensor-parallel model the group they sum over (they were made with a
    stand-in that knew only rank and size, before the ring was joined)."""
    for _, m in model.named_modules():
        for name, value in list(vars(m).items()):  # ``group`` on sharded linears, ``sharding_group`` on MoE blocks
            if isinstance(value, GroupStandIn):
                setattr(m, name, group)


def join_group(spec: RankSpec):
    """Join the distributed group (None for a world of one) and check it is the group the contract describes."""
    if spec.world_size == 1:
        return None
    import mlx.core as mx

    if not mx.distributed.is_available(spec.backend):
        raise ConfigError(f"MLX backend {spec.backend!r} is not available on this node")
    group = mx.distributed.init(strict=True, backend=spec.backend)
    if group.rank() != spec.rank or group.size() != spec.world_size:
        raise ConfigError(f"joined as rank {group.rank()} of {group.size()}, "
                          f"expected {spec.rank} of {spec.world_size}")
    return group


def _words(data: bytes, n: int) -> list[int]:
    d = hashlib.sha256(data).digest()
    return [int.from_bytes(d[4 * i:4 * i + 4], "little") & 0x7FFFFFFF for i in range(n)]


def verify_group(group, spec: RankSpec) -> None:
    """All ranks must run the same job with the same split: a stale rank of an old job on a reused port
    would otherwise pair silently and compute garbage."""
    import mlx.core as mx
    import numpy as np

    ident = json.dumps([spec.deployment_id, spec.job_id, spec.world_size, spec.layer_counts, spec.num_layers])
    mine = np.array([spec.rank, *_words(ident.encode(), 3)], dtype=np.int32)
    gathered = np.array(mx.distributed.all_gather(mx.array(mine), group=group), copy=True)
    gathered = gathered.reshape(spec.world_size, -1)
    if sorted(gathered[:, 0].tolist()) != list(range(spec.world_size)):
        raise IntegrityError(f"ring peers report ranks {gathered[:, 0].tolist()}: another job's rank is on this ring")
    if not (gathered[:, 1:] == mine[1:]).all():
        raise IntegrityError("a ring peer belongs to another job or split: refusing to serve")


# ---- control collectives (all ranks call them in the same order) ----

def share_words(group, words: list[int]) -> list[int]:
    """all_sum of a small int32 vector: each rank adds its own votes, rank 0 adds the content."""
    import mlx.core as mx
    import numpy as np

    out = mx.distributed.all_sum(mx.array(np.array(words, dtype=np.int32)), group=group, stream=mx.cpu)
    return np.array(out, copy=True).tolist()


def share_payload(group, data: bytes | None, length: int) -> bytes:
    """Rank 0 contributes ``data`` (length bytes), the others zeros: all_sum gives everyone rank 0's bytes."""
    import mlx.core as mx
    import numpy as np

    if length > MAX_PAYLOAD:
        raise IntegrityError(f"request payload of {length} bytes exceeds {MAX_PAYLOAD}")
    padded = (length + 3) // 4 * 4
    buf = np.zeros(padded, dtype=np.uint8)
    if data is not None:
        buf[:length] = np.frombuffer(data, dtype=np.uint8)
    out = mx.distributed.all_sum(mx.array(buf.view(np.int32)), group=group, stream=mx.cpu)
    return np.array(out, copy=True).view(np.uint8)[:length].tobytes()


def agree_on_tokens(group, spec: RankSpec, tokens: list[int]) -> bool:
    """After a request: did every rank produce the same tokens? (Divergence would otherwise be silent.)"""
    import numpy as np

    words = [0] * (4 * spec.world_size)
    words[4 * spec.rank:4 * spec.rank + 4] = _words(np.array(tokens, dtype=np.int32).tobytes(), 4)
    got = share_words(group, words)
    return all(got[4 * r:4 * r + 4] == got[0:4] for r in range(spec.world_size))
