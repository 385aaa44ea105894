"""A target forward over draft trees: each node at its own position, attending to the context and its ancestors.

A round that verifies a tree (decoding/tree.py) feeds its nodes as one block per row, in an order where every
parent comes before its children. Two things differ from a chain's forward, and both are given to the model's
own code, on this model instance only, for the length of one call (`tree_forward`):

- Positions: node i of row b sits at lengths[b] + depth[b, i], not lengths[b] + i. Each RoPE module of the
  model (whatever its variant: scaled, YaRN, partial, proportional) is wrapped by a `TreeRope`, which runs that
  module on every node as a batch row of its own (MLX's RoPE takes one offset per batch row), so the model's
  rope computes every node's rotation itself.
- Mask: mlx-lm's families ask each cache layer for their attention mask (`make_mask`); a `TreeView` stands in
  for each layer and answers with the tree's: a node sees the row's context (within the layer's window, if
  any) and its own ancestors, nothing of its siblings, and nothing of another row's padding.

The cache itself is written as for a chain (every node's keys after the row's context); which nodes are kept is
the caller's to say afterwards (`keep_paths`), before the rejected ones are trimmed. A hybrid target's recurrent
layers read one sequence in order, so each runs every path from the anchor to a leaf as a batch row of its own,
from the row's state (`leaf_paths`; models/rollback.py), and keeps the records of the path its walk took.
mlx-lm's classes are never modified: the wrappers are put in the instance's module tree and taken out again, as
target.py's recorders are.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache

from ..kernels.attention import MAX_ROWS
from ..kernels.verify_attention import note_tree
from .batch_cache import RaggedKVCache


class TreeRope:
    """Stands in for one RoPE module during a tree forward: the module's own rotation at each node's position."""

    def __init__(self, rope, positions: mx.array):
        self._rope, self._positions = rope, positions  # positions [B, N]

    def __call__(self, x: mx.array, offset=0):
        B, H, N, D = x.shape
        rows = x.swapaxes(1, 2).reshape(B * N, H, 1, D)  # a node a batch row: its own offset
        out = self._rope(rows, offset=self._positions.reshape(-1))
        return out.reshape(B, N, H, D).swapaxes(1, 2)

    def __getattr__(self, name):
        return getattr(self._rope, name)


class TreeView:
    """Stands in for one cache layer during a tree forward: the layer itself, with the tree's attention mask."""

    def __init__(self, cache, mask):
        self._cache, self._mask = cache, mask

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        return self._mask(window_size)

    def __getitem__(self, i):  # a CacheList's parts (MLA with an indexer), which models also ask for masks
        return TreeView(self._cache[i], self._mask)

    def __bool__(self):
        return True

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def __setattr__(self, name, value):  # a model may set a cache's arrays (DeepSeek-V3.2's indexer does)
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._cache, name, value)


def rope_sites(layers) -> list:
    """[(module, key)] of every RoPE module under the decoder layers (an attribute named rope)."""
    sites = []
    for layer in layers:
        if layer is None:
            continue
        for _, module in layer.named_modules():
            sites += [(module, k) for k, v in module.items() if "rope" in k and isinstance(v, nn.Module)]
    return sites


def context_lengths(cache: list) -> list:
    """Each row's positions in the cache before a forward: one sequence's offset, or a batch's lengths."""
    for c in cache:
        c = c[0] if isinstance(c, CacheList) else c
        if isinstance(c, RaggedKVCache):
            return list(c.sizes)
        if isinstance(c, (KVCache, QuantizedKVCache)):
            return [c.offset]
    raise ValueError("a tree forward needs a target with attention caches")


def tree_mask(lengths: mx.array, longest: int, depth: mx.array, ancestors: mx.array, window=None) -> mx.array:
    """[B, 1, N, S] booleans, S = the longest row's length + N: query node i of row b (at position lengths[b] +
    depth[b, i]) sees the row's context and its own ancestors (ancestors[b, i, j]: node j is node i or above it),
    within `window` positions when given."""
    B, N = depth.shape
    column = mx.arange(longest + N)[None]  # [1, S]
    node = column - lengths[:, None]  # [B, S]: the node a column holds, where 0 <= node < N
    in_tree = (node >= 0) & (node < N)
    held = mx.clip(node, 0, N - 1)
    sees = mx.take_along_axis(ancestors, mx.broadcast_to(held[:, None, :], (B, N, held.shape[1])), axis=2)
    visible = (node < 0)[:, None, :] | (sees & in_tree[:, None, :])
    if window:
        query = lengths[:, None] + depth  # [B, N]
        key = mx.where(in_tree, lengths[:, None] + mx.take_along_axis(depth, held, axis=1), column)  # [B, S]
        visible = visible & (query[:, :, None] - key[:, None, :] < window)
    return visible[:, None]


@dataclass
class LeafPaths:
    """B rows' trees as their paths from the anchor to each leaf, for layers that read one sequence in order: row
    b's path p is nodes[b, p] (one node a depth, then its leaf repeated up to the deepest leaf's length; a row with
    fewer leaves repeats its first path), and node i of row b takes its output from step step[b, i] of path
    path[b, i] (the first path holding it; a dead node, whose output nobody reads, the anchor's)."""

    nodes: np.ndarray  # [B, P, T]
    path: np.ndarray  # [B, N]
    step: np.ndarray  # [B, N]


def leaf_paths(depth: np.ndarray, ancestors: np.ndarray, alive: np.ndarray) -> LeafPaths:
    """The `LeafPaths` of trees given as depth [B, N], ancestors [B, N, N] (ancestor-or-self) and alive [B, N]:
    the leaves are the alive nodes with no alive node below them (a dead node never gets a path of its own)."""
    B, N = depth.shape
    above = ancestors & ~np.eye(N, dtype=bool)[None]  # above[b, i, j]: j is a strict ancestor of i
    is_leaf = alive & ~(above & alive[:, :, None]).any(axis=1)
    count, T = is_leaf.sum(axis=1), int(np.where(alive, depth, 0).max()) + 1
    P = int(count.max())
    leaves = np.argsort(~is_leaf, axis=1, kind="stable")[:, :P]
    leaves = np.where(np.arange(P)[None] < count[:, None], leaves, leaves[:, :1])
    holds = np.take_along_axis(ancestors, leaves[:, :, None], axis=1)  # [B, P, N]: path p holds node i
    at = holds[:, :, None, :] & (depth[:, None, None, :] == np.arange(T)[None, None, :, None])  # [B, P, T, N]
    nodes = np.where(at.any(axis=3), at.argmax(axis=3), leaves[:, :, None])
    return LeafPaths(nodes, np.where(alive, holds.argmax(axis=1), 0), np.where(alive, depth, 0))


def ancestor_bits(ancestors: mx.array) -> mx.array:
    """[B, N] uint32: bit j of node i's word set when node j is node i or above it (N <= 32)."""
    N = ancestors.shape[-1]
    return (ancestors.astype(mx.uint32) << mx.arange(N, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32)


@contextmanager
def tree_forward(sites: list, cache: list, depth: mx.array, ancestors: mx.array):
    """For one forward of B rows x N tree nodes on `cache`: yields the cache list to pass the model, the RoPE
    modules at `sites` (`rope_sites`) and the layers' masks set to the trees' (depth [B, N]; ancestors [B, N, N],
    ancestor-or-self)."""
    sizes, N = context_lengths(cache), depth.shape[1]
    lengths = mx.array(sizes, mx.int32)
    positions = lengths[:, None] + depth
    masks = {}

    def mask(window):
        if window not in masks:
            masks[window] = tree_mask(lengths, max(sizes), depth, ancestors, window)
            if window is None and N <= MAX_ROWS:  # what our verify kernel computes it from (Metal)
                note_tree(masks[window], [n + N for n in sizes], ancestor_bits(ancestors))
        return masks[window]

    originals = [(module, key, module[key]) for module, key in sites]
    try:
        for module, key, rope in originals:
            module[key] = TreeRope(rope, positions)
        # a recurrent layer's cache keeps its own (no) mask: its layer runs the tree's paths (models/rollback.py)
        yield [c if isinstance(c, ArraysCache) else TreeView(c, mask) for c in cache]
    finally:
        for module, key, rope in originals:
            module[key] = rope


def keep_paths(cache: list, paths: list, nodes: int):
    """After a forward of `nodes` tree nodes a row on `cache`: row b's path paths[b] (node indices, the anchor
    first) moves to the positions right after its context, in order. The caller then trims what follows. Rows
    whose path is the nodes in order (a chain's) move nothing."""
    if all(p == list(range(len(p))) for p in paths):
        return
    lengths = [n - nodes for n in context_lengths(cache)]
    for c in cache:
        for layer in (c.caches if isinstance(c, CacheList) else [c]):
            if not isinstance(layer, ArraysCache):  # a recurrent state: its tape keeps the path's (rollback.py)
                _move(layer, lengths, paths)


def _move(layer, lengths: list, paths: list):
    if isinstance(layer, RaggedKVCache):
        N = max(map(len, paths))
        source = mx.array([[n + (p[i] if i < len(p) else i) for i in range(N)] for n, p in zip(lengths, paths)])
        target = mx.array(lengths)[:, None] + mx.arange(N)[None]

        def moved(parts: tuple) -> tuple:
            out = []
            for x in parts:
                at = lambda i: mx.broadcast_to(i[:, None, :, None], (x.shape[0], x.shape[1], N, x.shape[3]))
                out.append(mx.put_along_axis(x, at(target), mx.take_along_axis(x, at(source), axis=2), axis=2))
            return tuple(out)

        layer.stored_keys, layer.stored_values = moved(layer.stored_keys), moved(layer.stored_values)
        return
    (n,), (path,) = lengths, paths
    source, end = mx.array([n + i for i in path]), n + len(path)
    for stored in (layer.keys, layer.values):
        for x in stored if isinstance(stored, tuple) else (stored,):  # a quantized cache's parts, or the array
            x[..., n:end, :] = x[..., source, :]  # in place: the cache holds this very array
