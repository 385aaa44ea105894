"""Prompt lookup: drafts copied from the context, for the rounds where the drafter is unsure.

Where the drafter's first draft has probability below LOOKUP_BELOW and the context holds an earlier
occurrence of its last few tokens, the round verifies the tokens that followed that occurrence
instead (the rest of the block, past what lookup has, stays the drafter's). Either way the target
verifies every draft, so output is unchanged: lookup's tokens are point-mass proposals like a v1
drafter's argmax (decoding/sampling.py), and which source a position uses depends only on the prefix.

`bench/acceptance.py` measures what it buys: tau for the drafter alone, for lookup alone and for this
rule, replayed on the target's own greedy answers.
"""

import mlx.core as mx

from ..models.base import Draft

LOOKUP_BELOW = 0.5  # use lookup when the drafter's first draft is less likely than this
LONGEST_NGRAM = 3
LONGEST_RUN = 64  # how far back `run` compares a copy's source with the history
LOOKUP_SCAN = 16  # earlier occurrences whose copies a copy tree holds (decoding/tree.py `copy_trees`), the latest first


class PromptLookup:
    """Proposals from the token history (prompt + emitted tokens): the tokens that followed the latest
    earlier occurrence of the history's last n tokens, for the longest n <= longest_ngram found. `run` says how
    long the copy has run: how many of the history's last tokens equal those before that occurrence (up to
    LONGEST_RUN), which the width policy's calibration keeps lookup's acceptance by (policies/width.py).

    An index of every n-gram's end positions makes a proposal O(longest_ngram), whatever the context length (a
    scan of the history per round would grow with it)."""

    def __init__(self, tokens: list, longest_ngram: int = LONGEST_NGRAM):
        self.history = []
        self.longest_ngram = longest_ngram
        self._ends = {}  # n-gram tuple -> end positions of its occurrences before the last token, in order
        self.run = 0  # the last proposal's: tokens of the history matching the copy's source (0: no proposal)
        self.extend(tokens)

    def extend(self, tokens: list):
        """Tokens appended to the history; the n-grams that end before the newest token get indexed."""
        h = self.history
        for t in tokens:
            h.append(int(t))
            end = len(h) - 2  # the n-grams ending at the previous token become "earlier occurrences"
            for n in range(1, min(self.longest_ngram, end + 1) + 1):
                self._ends.setdefault(tuple(h[end - n + 1 : end + 1]), []).append(end)

    def _occurrences(self) -> list:
        """End positions of the earlier occurrences of the history's longest matched last n-gram, in order."""
        h, last = self.history, len(self.history) - 1
        for n in range(min(self.longest_ngram, last), 0, -1):
            ends = self._ends.get(tuple(h[last - n + 1 :]))
            if ends:
                return ends
        return []

    def propose(self, k: int) -> list:
        """Up to k tokens to follow the history (only tokens it already holds can be copied)."""
        h, last = self.history, len(self.history) - 1
        ends = self._occurrences()
        if not ends:
            self.run = 0
            return []
        end, run = ends[-1], 0
        while run < min(LONGEST_RUN, end + 1) and h[end - run] == h[last - run]:
            run += 1
        self.run = run
        return h[end + 1 : min(end + 1 + k, last + 1)]

    def copies(self, k: int, scan: int = LOOKUP_SCAN) -> list:
        """Up to k tokens after each of the latest `scan` earlier occurrences of what `propose` matches, the
        latest first (its proposal), for a tree of copies (decoding/tree.py `copy_trees`)."""
        h, last = self.history, len(self.history) - 1
        return [h[end + 1 : min(end + 1 + k, last + 1)] for end in reversed(self._occurrences()[-scan:])]


def with_lookup(draft: Draft, proposals: list, below: float = LOOKUP_BELOW) -> Draft:
    """The drafter's drafts [B, n] with each row's leading positions replaced by proposals[b] (its copy of its
    own context) when its first draft's confidence is below `below`. Decided on the device, so nothing is
    read back before the verify; `looked_up` (how many positions each row replaced) is read with the
    round's results. Looked-up positions carry confidence 1 (they have no probability; p-min never cuts them).

    Drafts sampled over candidate sets (DFlash 2 at temperature > 0) carry their proposal q, which a
    copied token would not match: those are returned unchanged."""
    n = draft.ids.shape[1]
    if not any(proposals) or n == 0 or draft.proposal is not None:
        return draft
    counts = [min(len(p), n) for p in proposals]
    looked_up = mx.where(draft.confidence[:, 0] < below, mx.array(counts, dtype=mx.int32), 0)
    copied = mx.arange(n)[None] < looked_up[:, None]
    padded = mx.array([p[:m] + [0] * (n - m) for p, m in zip(proposals, counts)], dtype=draft.ids.dtype)
    return Draft(
        ids=mx.where(copied, padded, draft.ids),
        confidence=mx.where(copied, 1.0, draft.confidence),
        looked_up=looked_up,
        candidates=draft.candidates,  # the drafter's own: a tree takes the copy as a branch beside them (tree.py)
    )
