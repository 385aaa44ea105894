"""Exact rollback of recurrent (GatedDeltaNet) state in hybrid targets: Qwen3.5/3.6, Qwen3-Next.

Their linear-attention layers keep a conv state (the last K-1 inputs of a depthwise conv) and a
recurrent state in an `ArraysCache`; neither can be trimmed, and the recurrence cannot be run
backwards. After a verify of L rows of which the target keeps `keep`, each such layer must hold what
plain decoding of those `keep` tokens would leave.

Design: record during the verify, replay the accepted prefix at the trim.
- `Target.forward` swaps each linear-attention module of the model instance, in its decoder layer,
  for a `RecurrentTape` for the length of that one call. The tape keeps (a) the layer's cache before
  the call (references: MLX arrays are immutable, so the snapshot costs nothing), (b) the call's
  arguments, and (c) the output of each of the module's own child modules (input projections,
  depthwise conv, gated norm, output projection): arrays the verify computes anyway.
- `Target.trim(cache, n)` gives each tape its snapshot back and calls the same mlx-lm module again on
  the first `keep = L - n` rows, its children now playing back the first `keep` rows of what they
  returned in the verify. The module is causal, so those rows are exactly what it would have seen
  for the prefix alone. What runs again is only the code between the children: the concatenation
  with the conv state (which is then rebuilt from it), SiLU, q/k normalisation and
  `gated_delta_update` over `keep` steps. No weight is read twice, and mlx-lm's own code stays the
  authority for the layer (its splits, its kernel choice), so nothing here tracks its internals.
- Full acceptance needs no replay (the tape is dropped); a full rejection restores the snapshot.
- Nothing is patched: only attributes of this model instance are swapped, and put back at once.
- Memory: a tape holds one round's arrays (L rows per child output, one state per layer) and is freed
  by the trim (or the next forward). It never grows with the context.

The alternative designs (reference peers.md): re-running the whole target on the accepted prefix
(a second forward), re-running the layer with its projections (reads the projection weights again),
or an innovation tape written by a custom kernel (dflash-mlx: the fastest, but a kernel per mlx-lm
code path). Measured cost of this design: `bench/rollback.py`, README "Hybrid targets".
"""

from contextlib import contextmanager

import mlx.nn as nn
from mlx.utils import tree_map

from .errors import DFlashError

# The recurrent layer types whose rollback is tested (tests/test_hybrid.py), by mlx-lm module and class.
SUPPORTED = {
    ("mlx_lm.models.qwen3_5", "GatedDeltaNet"),  # qwen3_5, qwen3_5_moe (Qwen3.5, Qwen3.6)
    ("mlx_lm.models.qwen3_next", "Qwen3NextGatedDeltaNet"),  # qwen3_next (Qwen3-Next, Qwen3-Coder-Next)
}


def is_supported(module) -> bool:
    return (type(module).__module__, type(module).__name__) in SUPPORTED


def _child_modules(module: nn.Module) -> dict:
    return {name: child for name, child in module.items() if isinstance(child, nn.Module)}


class _ChildTape:
    """Stands in for one child module: records its outputs, or plays back their first rows."""

    def __init__(self, child, outputs: list, keep=None):
        self._child, self._outputs, self._keep, self._calls = child, outputs, keep, 0

    def __call__(self, *args, **kwargs):
        if self._keep is None:
            out = self._child(*args, **kwargs)
            self._outputs.append(out)
            return out
        out = self._outputs[self._calls]
        self._calls += 1
        return tree_map(lambda a: a[:, : self._keep], out)

    def __getattr__(self, name):
        return getattr(self._child, name)


class RecurrentTape:
    """Takes the place of one linear-attention module for one verify call, then rewinds its cache."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.cache = self.snapshot = self.args = None
        self.outputs = {}

    def __call__(self, x, mask=None, cache=None):
        if cache is None:  # nothing to roll back (a forward without cache)
            return self.module(x, mask, cache)
        self.cache, self.args = cache, (x, mask)
        self.snapshot = (list(cache.cache), cache.left_padding, cache.lengths)
        self.outputs = {name: [] for name in _child_modules(self.module)}
        with self._children(keep=None):
            return self.module(x, mask, cache)

    @contextmanager
    def _children(self, keep):
        """Record the children's outputs (keep None) or play back their first `keep` rows."""
        originals = _child_modules(self.module)
        try:
            for name, child in originals.items():
                self.module[name] = _ChildTape(child, self.outputs[name], keep)
            yield
        finally:
            for name, child in originals.items():
                self.module[name] = child

    def rewind(self, keep: int) -> list:
        """Leave the cache as plain decoding of the first `keep` rows would. Returns the new state arrays."""
        cache = self.cache
        conv_and_state, cache.left_padding, cache.lengths = self.snapshot
        cache.cache = list(conv_and_state)
        if keep > 0:
            x, mask = self.args
            with self._children(keep):
                self.module(x[:, :keep], None if mask is None else mask[:, :keep], cache)
        self.release()
        return [a for a in cache.cache if a is not None]

    def release(self):
        self.cache = self.snapshot = self.args = None
        self.outputs = {}


def find_recurrent(layer, index: int, cache_entry, kind: str):
    """The attribute name of the supported recurrent module in `layer`, or a one-line refusal."""
    children = _child_modules(layer)
    for name, child in children.items():
        if is_supported(child):
            return name
    parts = ", ".join(sorted({type(c).__name__ for c in children.values()}))
    supported = " or ".join(sorted(cls for _, cls in SUPPORTED))
    raise DFlashError(
        f"target '{kind}' keeps state that cannot be rolled back (layer {index}, {type(layer).__name__} of {parts}, "
        f"in an {type(cache_entry).__name__}); mlx-dflash rewinds recurrent layers of type {supported} "
        "(qwen3_5, qwen3_5_moe, qwen3_next) and trims KV caches, nothing else"
    )


@contextmanager
def taping(sites: list):
    """Tapes on the recurrent modules at `sites` ([(layer, attribute name)]) for one call; yields them."""
    tapes = [RecurrentTape(layer[name]) for layer, name in sites]
    try:
        for (layer, name), tape in zip(sites, tapes):
            layer[name] = tape
        yield tapes
    finally:
        for (layer, name), tape in zip(sites, tapes):
            layer[name] = tape.module
