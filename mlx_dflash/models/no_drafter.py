"""The drafter of a target that has none (`--drafter none`): speculation from the context itself.

It drafts no token of its own: every position it returns has confidence 0, so each round's drafts are prompt
lookup's copies of the context (decoding/lookup.py), and a round with nothing to copy verifies no draft. The
target verifies every copied token as it verifies a drafter's, so the output is the target's own (greedy) or
distributed as its own (sampling: a copied token is a point-mass proposal, decoding/sampling.py). It reads no
target features and keeps no cache. An `nn.Module` without parameters, so what inspects a drafter's layers
(the quantized rule, the pitfalls) finds none.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .base import Draft

LOOKUP_BLOCK = 16  # tokens of a copy one round may verify at most, the anchor included (as the shipped drafter's block)


class NoDrafter(nn.Module):
    source = None  # no checkpoint
    mask_token_id = None

    @property
    def block_size(self) -> int:
        return LOOKUP_BLOCK

    @property
    def is_bound(self) -> bool:
        return True

    def bind(self, target) -> "NoDrafter":
        return self  # it borrows nothing (a target that captures no layers returns zero-width features)

    def set_context_window(self, positions: Optional[int]) -> "NoDrafter":
        return self  # it reads no context

    def make_cache(self) -> list:
        return []

    def read_context(self, context: mx.array, cache: list):
        pass

    def draft(self, anchors: list, contexts: list, cache: list, block_size: int, width: int, samplings,
              keys=None) -> Draft:
        """Nothing drafted: ids 0 at confidence 0, every position for prompt lookup to fill."""
        shape = (len(anchors), width - 1)
        return Draft(ids=mx.zeros(shape, dtype=mx.int32), confidence=mx.zeros(shape))
