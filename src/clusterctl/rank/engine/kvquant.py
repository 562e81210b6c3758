"""The KV cache stored quantized (plan --kv-bits), on every rank and in both schedules.

mlx-lm quantizes one sequence's cache the way ``generate_step`` does (``maybe_quantize_kv_cache``): after a forward
pass, a ``KVCache`` holding at least ``quantized_kv_start`` tokens becomes a ``QuantizedKVCache`` (``mx.quantize``,
affine, ``kv_group_size`` numbers per scale and bias), so the pass that crossed the threshold attended over full
precision keys and every later one over quantized keys (``base.scaled_dot_product_attention`` takes the quantized
path when the cache has ``bits``). mlx-lm's batch caches have no quantized form; ``BatchQuantizingKVCache`` is one:
a ``BatchKVCache`` that turns its keys and values into quantized triples at the start of the first update after
it holds ``start`` columns — the same moment as mlx-lm's, so a sequence served alone gets mlx-lm's tokens. In a
batch, the columns held (``_idx``, the longest row with its padding) decide for every row of the layer, and a
group joining a quantized batch is quantized when it joins: a row that shares a batch with a longer one may be
quantized earlier than it would be alone (never later). Both schedules build their caches through the model's
``make_cache`` (mlx-lm's ``make_prompt_cache``), so one hook (``quantize_kv``) serves them both.

Only models whose every layer keeps a plain ``KVCache`` are planned with kv-bits (plan/kvquant.py refuses the
others by name), so every cache here is one of these.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll


class _Settings:
    bits = 4
    group_size = 64
    start = 0
    seq: type = None  # type: ignore[assignment]  # the classes of one sequence's caches (quantize_kv)
    qseq: type = None  # type: ignore[assignment]


def _quantize(x: mx.array, s: type[_Settings]) -> list[mx.array]:
    return list(mx.quantize(x, group_size=s.group_size, bits=s.bits))


class SeqQuantizingKVCache(KVCache):
    """One sequence's cache before it joins a batch: a plain KVCache whose batches quantize (``merge``)."""

    settings: type[_Settings] = _Settings

    @classmethod
    def merge(cls, caches):
        return BatchQuantizingKVCache.merge_with(cls.settings, caches)


class SeqQuantizedKVCache(QuantizedKVCache):
    """One sequence's quantized cache (a batch row extracted for the prompt cache); its batches quantize too."""

    settings: type[_Settings] = _Settings

    @classmethod
    def merge(cls, caches):
        return BatchQuantizingKVCache.merge_with(cls.settings, caches)


class BatchQuantizingKVCache(BatchKVCache):
    """A BatchKVCache that stores quantized triples (weights, scales, biases) from ``settings.start`` columns on."""

    def __init__(self, left_padding: list[int], settings: type[_Settings] = _Settings):
        super().__init__(left_padding)
        self.settings = settings
        self.quantized = False

    # ``base.scaled_dot_product_attention`` asks ``hasattr(cache, "bits")``: only once the keys are quantized
    @property
    def bits(self) -> int:
        if not self.quantized:
            raise AttributeError("bits")
        return self.settings.bits

    @property
    def group_size(self) -> int:
        if not self.quantized:
            raise AttributeError("group_size")
        return self.settings.group_size

    def to_quantized_now(self) -> None:
        self.quantized = True
        if self.keys is not None:
            self.keys = _quantize(self.keys[..., : self._idx, :], self.settings)
            self.values = _quantize(self.values[..., : self._idx, :], self.settings)

    def update_and_fetch(self, keys, values):
        if not self.quantized and self.keys is not None and self._idx >= self.settings.start:
            self.to_quantized_now()  # mlx-lm's moment: after the pass that reached the threshold
        if not self.quantized:
            return super().update_and_fetch(keys, values)
        prev, n = self._idx, keys.shape[2]
        qk, qv = _quantize(keys, self.settings), _quantize(values, self.settings)
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            grow = (self.step + n - 1) // self.step * self.step

            def grown(old: list[mx.array] | None, new: list[mx.array]) -> list[mx.array]:
                zeros = [mx.zeros((*x.shape[:2], grow, x.shape[3]), dtype=x.dtype) for x in new]
                if old is None:
                    return zeros
                return [mx.concatenate([o[..., :prev, :], z], axis=2) for o, z in zip(old, zeros)]

            self.keys, self.values = grown(self.keys, qk), grown(self.values, qv)
        self.keys, self.values = list(self.keys), list(self.values)
        for i in range(3):
            self.keys[i][..., prev: prev + n, :] = qk[i]
            self.values[i][..., prev: prev + n, :] = qv[i]
        self._idx += n
        self.offset = self.offset + n
        return self.keys_and_values()

    def keys_and_values(self):
        if not self.quantized:
            return super().keys_and_values()
        return ([x[..., : self._idx, :] for x in self.keys], [x[..., : self._idx, :] for x in self.values])

    def finalize(self):
        if not self.quantized or self._right_padding is None:
            return super().finalize()
        padding = self._right_padding
        self.keys = [dynamic_roll(x, padding[:, None], axis=2) for x in self.keys]
        self.values = [dynamic_roll(x, padding[:, None], axis=2) for x in self.values]
        self.offset = self.offset - padding
        self.left_padding += padding
        self._right_padding = None

    def filter(self, batch_indices):
        if not self.quantized:
            return super().filter(batch_indices)
        if self.keys is not None:
            self.keys = [x[batch_indices] for x in self.keys]
            self.values = [x[batch_indices] for x in self.values]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        trim = min(self.left_padding.tolist())
        if trim > 0:
            if self.keys is not None:
                self.keys = [x[..., trim:, :] for x in self.keys]
                self.values = [x[..., trim:, :] for x in self.values]
            self._idx -= trim
            self.left_padding -= trim

    def extend(self, other: "BatchQuantizingKVCache"):
        if self.quantized or other.quantized:  # a batch is quantized whole: the other side joins quantized
            for c in (self, other):
                if not c.quantized:
                    c.to_quantized_now()
        if not self.quantized:
            return super().extend(other)
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        like_k = (self.keys if self.keys is not None else other.keys)
        like_v = (self.values if self.values is not None else other.values)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c, arrays, like):
            rows = c.offset.shape[0]
            if arrays is None:
                arrays = [mx.zeros((rows, x.shape[1], 0, x.shape[3]), dtype=x.dtype) for x in like]
            left = idx - c._idx
            right = size - arrays[0].shape[2] - left
            if right < 0:
                arrays, right = [x[..., :right, :] for x in arrays], 0
            if left or right:
                arrays = [mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]) for x in arrays]
            return arrays

        self.keys = [mx.concatenate(p) for p in zip(pad(self, self.keys, like_k), pad(other, other.keys, like_k))]
        self.values = [mx.concatenate(p) for p in zip(pad(self, self.values, like_v),
                                                      pad(other, other.values, like_v))]
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([self.left_padding + (idx - self._idx),
                                            other.left_padding + (idx - other._idx)])
        self._idx = idx

    def extract(self, idx):
        if not self.quantized:
            seq = self.settings.seq()
            if self.keys is None:
                return seq
            plain = super().extract(idx)
            seq.keys, seq.values, seq.offset = plain.keys, plain.values, plain.offset
            return seq
        cache = self.settings.qseq(group_size=self.settings.group_size, bits=self.settings.bits)
        pad = self.left_padding.tolist()[idx]
        cache.keys = [mx.contiguous(x[idx: idx + 1, :, pad: self._idx]) for x in self.keys]
        cache.values = [mx.contiguous(x[idx: idx + 1, :, pad: self._idx]) for x in self.values]
        cache.offset = self._idx - pad
        return cache

    @classmethod
    def merge_with(cls, settings: type[_Settings], caches: list) -> "BatchQuantizingKVCache":
        """Sequences' caches (full precision, or quantized ones the prompt cache kept) as one batch cache: quantized
        when any of them is."""
        if not any(isinstance(c, QuantizedKVCache) for c in caches):
            plain = BatchKVCache.merge(caches)
            out = cls([0] * len(caches), settings)
            out.keys, out.values, out.offset, out.left_padding, out._idx = plain.state
            return out
        caches = [c if isinstance(c, QuantizedKVCache) else c.to_quantized(settings.group_size, settings.bits)
                  for c in caches]
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        out = cls([longest - n for n in lengths], settings)
        out.quantized = True
        like = next((c for c in caches if c.keys is not None), None)
        if like is None:
            return out
        B = len(caches)

        def stacked(get) -> list[mx.array]:
            arrays = [mx.zeros((B, x.shape[1], longest, x.shape[3]), dtype=x.dtype) for x in get(like)]
            for i, (p, c) in enumerate(zip(out.left_padding.tolist(), caches)):
                if c.keys is not None:
                    for a, x in zip(arrays, get(c)):
                        a[i: i + 1, :, p: p + c.offset] = x[..., : c.offset, :]
            return arrays

        out.keys, out.values = stacked(lambda c: c.keys), stacked(lambda c: c.values)
        out.offset = out.offset + longest
        out._idx = longest
        return out

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))


def quantize_kv(model, bits: int | None, group_size: int, start: int) -> None:
    """Every cache the model makes from now on (``make_prompt_cache``: the prefill of both schedules, mlx-lm's
    BatchGenerator) quantizes as mlx-lm's generate does with these settings; ``bits`` None: nothing changes.
    Called once the rank has decided what it decides from the model's cache kinds (archs, promptcache)."""
    if bits is None:
        return
    settings = type("KvSettings", (_Settings,), {"bits": bits, "group_size": group_size, "start": start})
    seq = type("SeqQuantizingKVCache", (SeqQuantizingKVCache,), {"settings": settings})
    settings.seq = seq
    settings.qseq = type("SeqQuantizedKVCache", (SeqQuantizedKVCache,), {"settings": settings})
    layers = len(model.layers)
    object.__setattr__(model, "make_cache", lambda: [seq() for _ in range(layers)])
