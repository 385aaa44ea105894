"""What the decoder needs of a drafter, whatever its architecture: one pass that drafts a block.

`Draft` is what a pass returns; `DraftModel` is the protocol every drafter (DFlash v1, DFlash 2, the
tests' oracles) implements for the decoder (`decoding/decoder.py`).
"""

from dataclasses import dataclass
from typing import Optional, Protocol

import mlx.core as mx

# A drafter's candidates per block position for a draft tree (decoding/tree.py): the tree's gain was measured
# with 4 (docs/benchmarks.md).
TREE_CANDIDATES = 4


@dataclass
class Draft:
    """One drafter pass: proposals for block positions 1..n. Arrays stay lazy: unless someone reads them
    first, the decoder evaluates the drafter together with the verify that judges its drafts."""

    ids: mx.array  # [B, n] drafted token ids ([n]: one row of them, `row`)
    confidence: mx.array  # [B, n] the drafter's probability of each drafted token
    # (candidates [B, n, k], q [B, n, k]) when token j was drawn from q[j] over candidates[j] (q is 0 elsewhere);
    # None when every draft is a point mass (argmax proposals).
    proposal: Optional[tuple] = None
    looked_up: Optional[mx.array] = None  # [B] leading positions copied by prompt lookup (decoding/lookup.py), lazy
    # (ids [B, n, k], probs [B, n, k]): each position's k likeliest tokens and their probabilities, for a draft
    # tree (decoding/tree.py); lazy, so computed only when a round reads them. None: the drafter has none.
    candidates: Optional[tuple] = None

    @property
    def tokens(self) -> list:
        return self.ids.tolist()

    def row(self, b: int) -> "Draft":
        """Row b of a batch's drafts, as one request's."""
        proposal = None if self.proposal is None else tuple(p[b] for p in self.proposal)
        return Draft(self.ids[b], self.confidence[b], proposal, None if self.looked_up is None else self.looked_up[b])


class DraftModel(Protocol):
    """A drafter as the decoding loop sees it."""

    @property
    def block_size(self) -> int:
        """Rows of one drafted block, anchor included (the size it was trained for)."""

    @property
    def is_bound(self) -> bool:
        """Whether `bind(target)` has run."""

    def bind(self, target) -> "DraftModel":
        """Check the pair fits, borrow what the drafter uses of the target; returns self."""

    def make_cache(self) -> list:
        """A fresh cache for the drafter's own context."""

    def read_context(self, context: mx.array, cache: list):
        """Take target feature vectors into `cache` without drafting (the decoder hands over a prompt's as
        part of reading it, so that no decoding round pays for them)."""

    def draft(self, anchors: list, contexts: list, cache: list, block_size: int, width: int, samplings,
              keys=None) -> Draft:
        """Drafts for block positions 1..width-1 of B rows in one pass (B = 1: one request): row b drafts after
        anchors[b]; contexts[b] ([1, c_b, F] or None) holds its target feature vectors new since its last draft,
        which join its row of `cache` (one request's cache at B = 1, a batch's RaggedKVCache layers otherwise);
        ids and confidence [B, width-1]. keys: each row's own random stream, or None (MLX's global one)."""
