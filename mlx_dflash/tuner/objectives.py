"""Training objectives (`mlx-dflash train --objective`): what a block shows the drafter and how much each
of its rows weighs in the loss.

Every objective trains on blocks `[anchor, x_1 .. x_v, MASK x (B-1-v)]` anchored in the target's own
responses, where x_k is the true token at anchor + k, and weighs the cross-entropy of the masked rows.

* `decay` (the default; DFlash, arXiv 2602.06036, Eq. 4): v = 0 and row k weighs w_k = exp(-(k-1)/gamma),
  gamma 7 for block 16 (5 for 10, 4 for 8). A draft counts only if every draft before it is kept, so
  later rows matter less. `--gamma` moves the decay: flatter (larger) for drafters that keep long runs,
  steeper (smaller) for drafters that keep one or two tokens a round.
* `verified`: v = 0 and row k weighs the measured chance that draft k is verified at all,
  P(drafts 1..k-1 kept), read from the held-out replay at every evaluation (the published decay until the
  first). Why: the published gamma suits drafters that keep ~6 tokens a round; one that keeps ~1 spends
  most of that weight on rows the target never judges. It is measured at the full block width
  (`--width auto` verifies a subset of those rows, never more), and floored at VERIFIED_FLOOR so a row
  the drafter starts to reach keeps learning.
* `variable-prefix` (D2SD's VP-Drafter, arXiv 2606.04446; NeMo's `variable_prefix` loss): per block a
  visible-prefix length v is drawn with P(v) proportional to 0.9^v on v = 0..B-2 (and at most what the
  sequence has left); rows 1..v hold the true tokens instead of MASK and only the masked rows are
  supervised, row v + j weighing the published w_j. The drafter learns to re-draft behind a partly
  accepted block. With v = 0 it is `decay`.
"""

from typing import Optional

import mlx.core as mx
import numpy as np

from ..errors import DFlashError

OBJECTIVES = ("decay", "verified", "variable-prefix")
PUBLISHED_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # DFlash, App. A.1
PREFIX_BASE = 0.9  # the truncated geometric prior of the visible-prefix length
VERIFIED_FLOOR = 0.05


def position_weights(block_size: int, gamma: Optional[float] = None) -> mx.array:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1."""
    gamma = gamma or PUBLISHED_GAMMA.get(block_size, max(1.0, block_size / 2.3))
    return mx.exp(-mx.arange(block_size - 1) / gamma)


def verified_weights(reach) -> np.ndarray:
    """w_1 = 1 and w_k = P(draft k-1 kept) (the chance draft k is verified), floored at VERIFIED_FLOOR.
    reach: a replay's P(draft k kept) for k = 1..B-1."""
    reach = np.asarray(reach, dtype=np.float64)
    return np.maximum(np.concatenate([[1.0], reach[:-1]]), VERIFIED_FLOOR)


def prefix_lengths(room: np.ndarray, block_size: int, rng, base: float = PREFIX_BASE) -> np.ndarray:
    """A visible-prefix length per block, v_i with P(v) proportional to base^v on 0..min(B-2, room_i):
    the prior truncated to what each block can show (room_i: true tokens after the anchor, less the one
    a masked row needs as its label)."""
    cdf = np.cumsum(base ** np.arange(block_size - 1))
    top = np.minimum(np.asarray(room), block_size - 2)
    return np.searchsorted(cdf, rng.random(len(top)) * cdf[top], side="right")


def suffix_row_weights(weights: np.ndarray, valid: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Row weights [A, B-1]: row k of block i weighs weights[k - visible_i - 1] when it is masked and
    its label lies inside the sequence, else 0."""
    after = np.arange(valid.shape[1])[None] - visible[:, None]  # rows past the visible prefix: 0, 1, ..
    return np.where((after >= 0) & valid, weights[np.clip(after, 0, None)], 0.0)


class Objective:
    """One objective for blocks of `block_size`: `blocks` turns plain blocks into its own and weighs their
    rows; `measured` takes the held-out replay's per-position acceptance (only `verified` uses it)."""

    def __init__(self, name: str, block_size: int, gamma: Optional[float] = None, prefix_base: float = PREFIX_BASE):
        if name not in OBJECTIVES:
            raise DFlashError(f"unknown training objective {name!r}; known: {', '.join(OBJECTIVES)}")
        self.name, self.block_size, self.prefix_base = name, block_size, prefix_base
        self.weights = np.array(position_weights(block_size, gamma), dtype=np.float64)

    def blocks(self, block_ids, anchors, labels, valid, length: int, rng):
        """(block ids [A, B] as the drafter sees them, row weights [A, B-1] numpy) for blocks from
        trainer.make_blocks over a sequence of `length` tokens."""
        valid = np.asarray(valid)
        visible = np.zeros(len(valid), dtype=np.int64)
        if self.name == "variable-prefix":
            visible = prefix_lengths(length - 2 - np.asarray(anchors), self.block_size, rng, self.prefix_base)
            shown = np.arange(1, self.block_size)[None] <= visible[:, None]
            ids = np.array(block_ids)
            ids[:, 1:] = np.where(shown, np.array(labels), ids[:, 1:])
            block_ids = mx.array(ids)
        return block_ids, suffix_row_weights(self.weights, valid, visible)

    def measured(self, reach):
        if self.name == "verified":
            self.weights = verified_weights(reach)
