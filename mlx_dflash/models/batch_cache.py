"""Caches of several sequences decoding together, each row with its own length.

mlx-lm's `BatchKVCache` keeps one write position for the batch and trims every row by the same amount; a
speculative round keeps a different number of tokens per row. `RaggedKVCache` holds B rows right-padded,
row b's `lengths[b]` positions valid: a forward writes each row's new keys at that row's own end (one
scatter), RoPE takes the lengths as per-row offsets, the mask hides every row's padding, and a row rolls
back by lowering its length. Recurrent layers keep mlx-lm's batched `ArraysCache` (their rollback is the
target's, per row). Rows join from a single-sequence cache and leave as one, so a request's state moves
between the batch and the prefix cache unchanged. With a quantized KV cache (`--kv-bits`) a batch layer
becomes a `RaggedQuantizedKVCache` once its longest row passes the quantization start (or a quantized row
joins): every row of it is then stored quantized, as its own QuantizedKVCache would store it.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, _BaseCache

from ..kernels.verify_attention import note_ragged_causal


class RaggedKVCache(_BaseCache):
    step = 256

    def __init__(self):
        # tuples of [B, H, capacity, d] arrays: the stored parts (one, unquantized)
        self.stored_keys = self.stored_values = None
        self.sizes: list = []  # valid positions per row, on the host (no read-back to place a write)
        self.lengths = mx.zeros((0,), mx.int32)  # the same on the device

    # What a position is stored as, and what attention is given: overridden by RaggedQuantizedKVCache.
    def _parts(self, x: mx.array) -> tuple:
        return (x,)

    def _fetched(self, parts: tuple):
        return parts[0]

    def _row_parts(self, row) -> tuple:
        """A single sequence's cache layer as (keys parts, values parts), each [1, H, length, d]."""
        n = row.offset
        return self._parts(row.keys[..., :n, :]), self._parts(row.values[..., :n, :])

    def _single(self, keys: tuple, values: tuple, length: int):
        c = KVCache()
        if length:  # else an empty row: a drafter's cache while drafting was off
            c.update_and_fetch(mx.array(keys[0]), mx.array(values[0]))
        return c

    # The stored arrays as mlx-lm's caches show them (an array; a quantized layer's parts), for a model that reads
    # or sets them (DeepSeek-V3.2's indexer evaluates its cache through `keys`).
    @property
    def keys(self):
        return None if self.stored_keys is None else self._fetched(self.stored_keys)

    @keys.setter
    def keys(self, value):
        self.stored_keys = None if value is None else self._as_parts(value)

    @property
    def values(self):
        return None if self.stored_values is None else self._fetched(self.stored_values)

    @values.setter
    def values(self, value):
        self.stored_values = None if value is None else self._as_parts(value)

    def _as_parts(self, fetched) -> tuple:
        return (fetched,)

    @property
    def offset(self) -> mx.array:
        """Each row's next position (RoPE offsets, per row)."""
        return self.lengths

    @property
    def batch_size(self) -> int:
        return len(self.sizes)

    @property
    def max_length(self) -> int:
        return max(self.sizes, default=0)

    def _set_sizes(self, sizes: list):
        self.sizes = list(sizes)
        self.lengths = mx.array(self.sizes, mx.int32)

    def _upto(self, end: int) -> tuple:
        return self._fetched(tuple(x[..., :end, :] for x in self.stored_keys)), \
            self._fetched(tuple(x[..., :end, :] for x in self.stored_values))

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Write keys/values [B, H, L, D] after each row's valid positions; returns the columns up to the
        longest row's new end. Every row advances by L (rows verifying fewer roll back after the round)."""
        L = keys.shape[2]
        end = self.max_length + L
        if L == 0:  # nothing new (a drafter round in which no row has unread context)
            return (keys, values) if self.stored_keys is None else self._upto(end)
        keys, values = self._parts(keys), self._parts(values)
        if self.stored_keys is None or end > self.stored_keys[0].shape[2]:
            self._grow(end, keys, values)
        if len(set(self.sizes)) == 1:  # rows of one length (one request, always): a slice, as KVCache writes
            n = self.sizes[0]
            for stored, new in zip(self.stored_keys + self.stored_values, keys + values):
                stored[..., n : n + L, :] = new
        else:  # each row at its own end: one scatter
            at = (self.lengths[:, None] + mx.arange(L))[:, None, :, None]  # [B, 1, L, 1]

            def write(stored: tuple, new: tuple) -> tuple:
                return tuple(mx.put_along_axis(s, mx.broadcast_to(at, n.shape), n, axis=2) for s, n in zip(stored, new))

            self.stored_keys, self.stored_values = write(self.stored_keys, keys), write(self.stored_values, values)
        self._set_sizes([n + L for n in self.sizes])
        return self._upto(end)

    def _grow(self, end: int, keys: tuple, values: tuple):
        capacity = -(-end // self.step) * self.step
        if self.stored_keys is None:
            B, H = keys[0].shape[:2]
            self.stored_keys = tuple(mx.zeros((B, H, capacity, k.shape[3]), k.dtype) for k in keys)
            self.stored_values = tuple(mx.zeros((B, H, capacity, v.shape[3]), v.dtype) for v in values)
        else:
            self._pad_to(capacity)

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """Who each of the N new positions sees, before this forward writes them: row b's query i sits at
        position lengths[b] + i and sees columns up to itself (and within the window, if any). Rows of one
        length (one request, always) have no padding to hide: then the mask is what mlx-lm's KVCache
        gives, None for one query and the plain "causal" otherwise, which MLX's attention takes without an
        array. Both that and the array of rows of different lengths (no window) are what our multi-row
        verify kernel computes (kernels/verify_attention.py)."""
        if window_size is None and not return_array and len(set(self.sizes)) <= 1:
            return None if N == 1 else "causal"
        query = self.lengths[:, None, None, None] + mx.arange(N)[:, None]  # [B, 1, N, 1]
        column = mx.arange(self.max_length + N)[None, None, None]  # [1, 1, 1, S]
        mask = column <= query
        if window_size:
            return mask & (query - column < window_size)
        note_ragged_causal(mask, [n + N for n in self.sizes])  # our verify kernel computes it from the lengths
        return mask

    def shorten(self, sizes: list):
        """Roll rows back to these lengths (a speculative round's kept tokens)."""
        self._set_sizes(sizes)

    def is_trimmable(self):
        return True

    @property
    def state(self):
        return self.stored_keys, self.stored_values, self.lengths

    @property
    def nbytes(self):
        return 0 if self.stored_keys is None else sum(x.nbytes for x in self.stored_keys + self.stored_values)

    def empty(self):
        return self.stored_keys is None

    # Rows in and out.
    def add(self, row):
        """Append a single-sequence cache layer as the last row."""
        length = row.offset
        if self.stored_keys is None and self.sizes:  # rows so far are all empty: start their arrays now
            if row.keys is not None:
                keys, values = self._row_parts(row)
                B = len(self.sizes)
                self.stored_keys = tuple(mx.zeros((B, k.shape[1], 0, k.shape[3]), k.dtype) for k in keys)
                self.stored_values = tuple(mx.zeros((B, v.shape[1], 0, v.shape[3]), v.dtype) for v in values)
        if self.stored_keys is None:
            if row.keys is not None:
                self.stored_keys, self.stored_values = self._row_parts(row)
                self._pad_to(-(-length // self.step) * self.step)
            self._set_sizes(self.sizes + [length])
            return
        if row.keys is None:  # an empty row: zeros of the batch's shapes
            keys = tuple(mx.zeros((1, *x.shape[1:]), x.dtype) for x in self.stored_keys)
            values = tuple(mx.zeros((1, *x.shape[1:]), x.dtype) for x in self.stored_values)
        else:
            capacity = max(self.stored_keys[0].shape[2], -(-length // self.step) * self.step)
            self._pad_to(capacity)
            pad = [(0, 0), (0, 0), (0, capacity - length), (0, 0)]
            keys, values = (tuple(mx.pad(x, pad) for x in parts) for parts in self._row_parts(row))
        self.stored_keys = tuple(mx.concatenate([s, k]) for s, k in zip(self.stored_keys, keys))
        self.stored_values = tuple(mx.concatenate([s, v]) for s, v in zip(self.stored_values, values))
        self._set_sizes(self.sizes + [length])

    def _pad_to(self, capacity: int):
        extra = capacity - self.stored_keys[0].shape[2]
        if extra > 0:
            pad = [(0, 0), (0, 0), (0, extra), (0, 0)]
            self.stored_keys = tuple(mx.pad(x, pad) for x in self.stored_keys)
            self.stored_values = tuple(mx.pad(x, pad) for x in self.stored_values)

    def row(self, b: int):
        """Row b as a single-sequence cache of its own (a copy nobody else writes)."""
        length = self.sizes[b]
        if self.stored_keys is None or not length:
            return self._single(None, None, 0)
        keys = tuple(x[b : b + 1, :, :length] for x in self.stored_keys)
        return self._single(keys, tuple(x[b : b + 1, :, :length] for x in self.stored_values), length)

    def keep(self, rows: list):
        """Only these rows, in this order."""
        if self.stored_keys is not None:
            index = mx.array(rows, mx.int32)
            self.stored_keys = tuple(x[index] for x in self.stored_keys)
            self.stored_values = tuple(x[index] for x in self.stored_values)
        self._set_sizes([self.sizes[r] for r in rows])


class RaggedQuantizedKVCache(RaggedKVCache):
    """A RaggedKVCache holding keys and values quantized as mlx-lm's QuantizedKVCache holds them (per position,
    packed values with per-group scales and biases, in groups along the head dim), for a target whose KV cache
    is quantized (`Target.quantize_kv`): a position is stored exactly as a row's own QuantizedKVCache stores
    it, so a row joins and leaves unchanged, and mlx-lm's attention takes its quantized path (`bits`)."""

    def __init__(self, group_size: int = 64, bits: int = 8):
        super().__init__()
        self.group_size, self.bits = group_size, bits

    def _parts(self, x: mx.array) -> tuple:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def _fetched(self, parts: tuple):
        return parts

    def _as_parts(self, fetched) -> tuple:
        return tuple(fetched)

    def _row_parts(self, row) -> tuple:
        if not isinstance(row, QuantizedKVCache):  # a row read before its cache passed the quantization start
            return super()._row_parts(row)
        n = row.offset
        return tuple(x[..., :n, :] for x in row.keys), tuple(x[..., :n, :] for x in row.values)

    def _single(self, keys, values, length: int):
        c = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        if length:
            c.keys, c.values, c.offset = tuple(map(mx.array, keys)), tuple(map(mx.array, values)), length
        return c

    @classmethod
    def of(cls, ragged: RaggedKVCache, group_size: int, bits: int) -> "RaggedQuantizedKVCache":
        """`ragged`'s rows, quantized (once the batch's longest row passes the quantization start)."""
        out = cls(group_size, bits)
        if ragged.stored_keys is not None:
            out.stored_keys, out.stored_values = out._parts(ragged.stored_keys[0]), out._parts(ragged.stored_values[0])
        out._set_sizes(ragged.sizes)
        return out


def is_ragged(cache: list) -> bool:
    """Whether `cache` is a batch's (RaggedKVCache layers) rather than one sequence's."""
    return any(isinstance(c, RaggedKVCache) for c in cache)


def batched(single: list) -> list:
    """A batch cache with no rows, of the same kinds as a single sequence's cache (`Target.make_cache()`). A
    CacheList (MLA with an indexer: DeepSeek-V3.2, GLM-DSA) holds a batch layer for each of its parts."""
    def empty(c):
        if isinstance(c, ArraysCache):
            return ArraysCache(len(c.cache))
        return CacheList(*map(empty, c.caches)) if isinstance(c, CacheList) else RaggedKVCache()

    return [empty(c) for c in single]


def add_row(batch: list, single: list):
    """Append one sequence's cache layers as the batch's last row. A row whose layer is quantized (its read
    passed the target's quantization start) makes the batch's layer quantized too."""
    for i, (b, s) in enumerate(zip(batch, single)):
        if isinstance(b, CacheList):
            parts = list(b.caches)
            add_row(parts, list(s.caches))
            b.caches = tuple(parts)
            continue
        if isinstance(s, QuantizedKVCache) and type(b) is RaggedKVCache:
            batch[i] = b = RaggedQuantizedKVCache.of(b, s.group_size, s.bits)
        if isinstance(b, RaggedKVCache):
            b.add(s)
        elif b.empty():
            b.cache = list(s.cache)
        else:
            b.extend(s)


def row_of(batch: list, b: int) -> list:
    """Row b's cache layers, as a single sequence's."""
    return [CacheList(*row_of(list(c.caches), b)) if isinstance(c, CacheList) else
            c.row(b) if isinstance(c, RaggedKVCache) else c.extract(b) for c in batch]


def keep_rows(batch: list, rows: list):
    for c in batch:
        if isinstance(c, CacheList):
            keep_rows(list(c.caches), rows)
        elif isinstance(c, RaggedKVCache):
            c.keep(rows)
        else:
            c.filter(mx.array(rows, mx.int32))


def shorten_rows(batch: list, drop: list):
    """Roll each row of the batch's attention layers back by drop[b] positions (recurrent layers are the target's
    to rewind: models/rollback.py)."""
    for c in batch:
        if isinstance(c, CacheList):
            shorten_rows(list(c.caches), drop)
        elif isinstance(c, RaggedKVCache):
            c.shorten([n - d for n, d in zip(c.sizes, drop)])
