"""Caches of several sequences decoding together, each row with its own length.

mlx-lm's `BatchKVCache` keeps one write position for the batch and trims every row by the same amount; a
speculative round keeps a different number of tokens per row. `RaggedKVCache` holds B rows right-padded,
row b's `lengths[b]` positions valid: a forward writes each row's new keys at that row's own end (one
scatter), RoPE takes the lengths as per-row offsets, the mask hides every row's padding, and a row rolls
back by lowering its length. Recurrent layers keep mlx-lm's batched `ArraysCache` (their rollback is the
target's, per row). Rows join from a single-sequence cache and leave as one, so a request's state moves
between the batch and the prefix cache unchanged.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, _BaseCache


class RaggedKVCache(_BaseCache):
    step = 256

    def __init__(self):
        self.keys = self.values = None  # [B, H, capacity, D]
        self.sizes: list = []  # valid positions per row, on the host (no read-back to place a write)
        self.lengths = mx.zeros((0,), mx.int32)  # the same on the device

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

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Write keys/values [B, H, L, D] after each row's valid positions; returns the columns up to the
        longest row's new end. Every row advances by L (rows verifying fewer roll back after the round)."""
        L = keys.shape[2]
        end = self.max_length + L
        if L == 0:  # nothing new (a drafter round in which no row has unread context)
            return (keys, values) if self.keys is None else (self.keys[..., :end, :], self.values[..., :end, :])
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(end, keys, values)
        at = (self.lengths[:, None] + mx.arange(L))[:, None, :, None]  # [B, 1, L, 1]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(at, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, values.shape), values, axis=2)
        self._set_sizes([n + L for n in self.sizes])
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _grow(self, end: int, keys: mx.array, values: mx.array):
        capacity = -(-end // self.step) * self.step
        if self.keys is None:
            B, H, _, D = keys.shape
            self.keys = mx.zeros((B, H, capacity, D), keys.dtype)
            self.values = mx.zeros((B, H, capacity, values.shape[3]), values.dtype)
        else:
            self._pad_to(capacity)

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """Who each of the N new rows sees, before this forward writes them: row b's query i sits at
        position lengths[b] + i and sees columns up to itself (and within the window, if any). Rows of one
        length (one request, always) have no padding to hide: then the mask is what mlx-lm's KVCache
        gives, None for one query and the plain "causal" otherwise, which MLX's attention takes without an
        array and our multi-row verify kernel serves (kernels/verify_attention.py)."""
        if window_size is None and not return_array and len(set(self.sizes)) <= 1:
            return None if N == 1 else "causal"
        query = self.lengths[:, None, None, None] + mx.arange(N)[:, None]  # [B, 1, N, 1]
        column = mx.arange(self.max_length + N)[None, None, None]  # [1, 1, 1, S]
        mask = column <= query
        if window_size:
            mask = mask & (query - column < window_size)
        return mask

    def shorten(self, sizes: list):
        """Roll rows back to these lengths (a speculative round's kept tokens)."""
        self._set_sizes(sizes)

    def is_trimmable(self):
        return True

    @property
    def state(self):
        return self.keys, self.values, self.lengths

    @property
    def nbytes(self):
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def empty(self):
        return self.keys is None

    # Rows in and out.
    def add(self, row: KVCache):
        """Append a single-sequence cache as the last row."""
        length = row.offset
        if self.keys is None and self.sizes:  # rows so far are all empty: start their arrays now
            if row.keys is not None:
                shape = (len(self.sizes), *row.keys.shape[1:2], 0, row.keys.shape[3])
                self.keys = mx.zeros(shape, row.keys.dtype)
                self.values = mx.zeros((*shape[:3], row.values.shape[3]), row.values.dtype)
        if self.keys is None:
            if row.keys is not None:
                self.keys, self.values = row.keys[..., :length, :], row.values[..., :length, :]
                self._pad_to(-(-length // self.step) * self.step)
            self._set_sizes(self.sizes + [length])
            return
        if row.keys is None:  # an empty row: zeros of the batch's shapes
            k = mx.zeros((1, *self.keys.shape[1:]), self.keys.dtype)
            v = mx.zeros((1, *self.values.shape[1:]), self.values.dtype)
        else:
            capacity = max(self.keys.shape[2], -(-length // self.step) * self.step)
            self._pad_to(capacity)
            pad = [(0, 0), (0, 0), (0, capacity - length), (0, 0)]
            k, v = mx.pad(row.keys[..., :length, :], pad), mx.pad(row.values[..., :length, :], pad)
        self.keys = mx.concatenate([self.keys, k])
        self.values = mx.concatenate([self.values, v])
        self._set_sizes(self.sizes + [length])

    def _pad_to(self, capacity: int):
        extra = capacity - self.keys.shape[2]
        if extra > 0:
            pad = [(0, 0), (0, 0), (0, extra), (0, 0)]
            self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)

    def row(self, b: int) -> KVCache:
        """Row b as a single-sequence cache of its own (a copy nobody else writes)."""
        c = KVCache()
        length = self.sizes[b]
        if self.keys is not None and length:
            c.update_and_fetch(mx.array(self.keys[b : b + 1, :, :length]), mx.array(self.values[b : b + 1, :, :length]))
        return c

    def keep(self, rows: list):
        """Only these rows, in this order."""
        if self.keys is not None:
            index = mx.array(rows, mx.int32)
            self.keys, self.values = self.keys[index], self.values[index]
        self._set_sizes([self.sizes[r] for r in rows])


def batched(single: list) -> list:
    """A batch cache with no rows, of the same kinds as a single sequence's cache (`Target.make_cache()`)."""
    return [ArraysCache(len(c.cache)) if isinstance(c, ArraysCache) else RaggedKVCache() for c in single]


def add_row(batch: list, single: list):
    """Append one sequence's cache layers as the batch's last row."""
    for b, s in zip(batch, single):
        if isinstance(b, RaggedKVCache):
            b.add(s)
        elif b.empty():
            b.cache = list(s.cache)
        else:
            b.extend(s)


def row_of(batch: list, b: int) -> list:
    """Row b's cache layers, as a single sequence's."""
    return [c.row(b) if isinstance(c, RaggedKVCache) else c.extract(b) for c in batch]


def keep_rows(batch: list, rows: list):
    for c in batch:
        if isinstance(c, RaggedKVCache):
            c.keep(rows)
        else:
            c.filter(mx.array(rows, mx.int32))
