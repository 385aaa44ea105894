"""Several requests decoding together: the DFlash round (decoder.py) for a batch whose rows come and go.

Each round, one drafter pass drafts a block for every row, one target forward verifies [anchor, drafts]
for every row, and every row keeps its own number of drafts and rolls back alone (models/batch_cache.py:
per-row lengths; hybrid targets rewind each row's recurrent state). A row joins from a request's prefilled
`DecodeState` (fresh, or from the prefix cache) and leaves as one, at once, when it finishes or its client
goes: nobody waits for the batch to drain.

Every row verifies the same number of rows, the round's width W (a batch forward pads its rows to the
longest, and MLX has no ragged batches: per-row RoPE offsets, not per-token positions), less where a row
has fewer tokens left. The width comes from the batch policy (policy.py `BatchPolicy`): fixed, or chosen
each round from every row's drafter confidence and the cost of a W-row verify of this many rows (D-cut).
Greedy rows keep the longest matching prefix; sampled rows (each with its own settings and, when seeded,
its own random stream) accept by rejection sampling, as a single request does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from .decoder import DecodeState, Round, log_softmax, read
from .lookup import PromptLookup, with_lookup
from .models.base import Draft
from .models.batch_cache import RaggedKVCache, add_row, batched, keep_rows, row_of
from .sampling import SamplingParams, rejection_accept, target_probs


@dataclass
class Row:
    """One request in the batch."""

    handle: object  # the caller's name for it
    anchor: int  # the last emitted token, not yet in the caches
    tokens: list  # token ids in the target's cache (for the prefix cache)
    history: PromptLookup
    sampling: SamplingParams
    remaining: int  # tokens it may still emit
    context: Optional[mx.array] = None  # feature rows its drafter row has not read
    key: Optional[mx.array] = None  # its own random stream (a seeded request), else the global one

    def next_key(self) -> Optional[mx.array]:
        if self.key is None:
            return None
        self.key, use = mx.random.split(self.key)
        return use


class Batch:
    """The rows decoding together, their batch caches, and one round at a time."""

    def __init__(self, target, drafter, policy):
        self.target, self.drafter, self.policy = target, drafter, policy
        self.cache = batched(target.make_cache())
        self.draft_cache = [RaggedKVCache() for _ in drafter.make_cache()]
        self.rows: list[Row] = []

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, handle, state: DecodeState, anchor: int, sampling: SamplingParams, max_tokens: int,
             seed: Optional[int] = None):
        """A prefilled request joins as the last row: `state` holds its prompt, `anchor` its first token
        (already emitted), so it may emit max_tokens - 1 more."""
        add_row(self.cache, state.cache)
        add_row(self.draft_cache, state.draft_cache)
        history = PromptLookup(state.tokens + [anchor])
        key = None if seed is None else mx.random.key(seed)
        self.rows.append(Row(handle, anchor, list(state.tokens), history, sampling, max_tokens - 1, state.context, key))

    def leave(self, handles: set) -> list:
        """Take these rows out; returns (handle, DecodeState) of each, for the prefix cache to keep."""
        gone = [(b, r) for b, r in enumerate(self.rows) if r.handle in handles]
        states = [(r.handle, DecodeState(row_of(self.cache, b), row_of(self.draft_cache, b), r.tokens, r.context))
                  for b, r in gone]
        stay = [b for b, r in enumerate(self.rows) if r.handle not in handles]
        keep_rows(self.cache, stay)
        keep_rows(self.draft_cache, stay)
        self.rows = [self.rows[b] for b in stay]
        return states

    def round(self) -> list:
        """One round for every row: [(handle, Round)]. A row with nothing left to emit must have left."""
        rows, policy = self.rows, self.policy
        width = policy.width(len(rows), max(r.remaining for r in rows))
        tic = time.perf_counter()
        drafts, proposal, confidence, looked_up = None, None, None, None
        if width > 1:
            draft = self.drafter.draft_rows([r.anchor for r in rows], [r.context for r in rows], self.draft_cache,
                                            self.drafter.block_size, width, [r.sampling for r in rows],
                                            [r.next_key() for r in rows] if any(r.key is not None for r in rows)
                                            else None)
            draft = self._with_lookup(draft, width)
            for r in rows:
                r.context = None  # the drafter's cache holds it now
            drafts, proposal, looked_up = draft.ids, draft.proposal, draft.looked_up
            if policy.uses_confidence:
                confidence, copied = read(draft.confidence, looked_up)
                width = policy.cut(width, confidence, copied, [r.remaining for r in rows])
                drafts = drafts[:, : width - 1]
        draft_seconds = time.perf_counter() - tic

        # Verify: every row's [anchor, drafts] in one forward; a row verifies fewer where it has fewer left.
        anchors = mx.array([[r.anchor] for r in rows], mx.int32)
        block = anchors if width == 1 else mx.concatenate([anchors, drafts.astype(mx.int32)], axis=1)
        logits, features = self.target.forward(block, self.cache)
        limits = [min(width - 1, r.remaining - 1) for r in rows]
        accepted, bonus = self._accept(block[:, 1:], logits, limits, proposal)
        values = read(block[:, 1:], accepted, bonus, looked_up if looked_up is not None else mx.zeros(len(rows)))
        block_drafts, accepted, bonus, copied = values
        self.target.trim_rows(self.cache, [width - 1 - a for a in accepted])
        policy.observe(confidence, limits, accepted, len(rows), width, draft_seconds,
                       time.perf_counter() - tic - draft_seconds, copied)

        out = []
        for b, r in enumerate(rows):
            kept = block_drafts[b][: accepted[b]]
            new = kept + [bonus[b]]
            rows_features = features[b : b + 1, : accepted[b] + 1]
            r.context = rows_features if r.context is None else mx.concatenate([r.context, rows_features], axis=1)
            r.tokens += [r.anchor] + kept
            r.history.extend(new)
            r.anchor, r.remaining = bonus[b], r.remaining - len(new)
            looked = min(int(copied[b]), limits[b]) if width > 1 else 0
            out.append((r.handle, Round(new, limits[b], accepted[b], looked, log_softmax(logits[b, : accepted[b] + 1]))))
        return out

    def _with_lookup(self, draft: Draft, width: int) -> Draft:
        """Prompt lookup row by row (lookup.py): each row's own history proposes."""
        if not self.policy.prompt_lookup:
            return draft
        rows = [with_lookup(Draft(draft.ids[b], draft.confidence[b],
                                  None if draft.proposal is None else tuple(p[b] for p in draft.proposal)),
                            r.history.propose(width - 1))
                for b, r in enumerate(self.rows)]
        looked = mx.stack([mx.array(0, mx.int32) if d.looked_up is None else d.looked_up for d in rows])
        return Draft(mx.stack([d.ids for d in rows]), mx.stack([d.confidence for d in rows]), draft.proposal, looked)

    def _accept(self, drafts: mx.array, logits: mx.array, limits: list, proposal) -> tuple:
        """(kept per row, next token per row), lazy. Greedy rows together; a sampled row by rejection
        sampling with its own settings, on its own first limits[b] drafts."""
        B = len(self.rows)
        greedy = [b for b, r in enumerate(self.rows) if r.sampling.greedy]
        accepted, tokens = [None] * B, [None] * B
        if greedy:
            allowed = mx.arange(drafts.shape[1])[None] < mx.array([limits[b] for b in greedy])[:, None]
            choices = mx.argmax(logits[mx.array(greedy)], axis=-1).astype(mx.int32)
            matches = (drafts[mx.array(greedy)] == choices[:, : drafts.shape[1]]) & allowed
            kept = mx.cumprod(matches.astype(mx.int32), axis=1).sum(axis=1) if drafts.shape[1] else \
                mx.zeros(len(greedy), mx.int32)
            token = mx.take_along_axis(choices, kept[:, None], axis=1)[:, 0]
            for i, b in enumerate(greedy):
                accepted[b], tokens[b] = kept[i], token[i]
        for b, r in enumerate(self.rows):
            if r.sampling.greedy:
                continue
            n = limits[b]
            p = target_probs(logits[b, : n + 1], r.sampling)
            candidates, q = (None, None) if proposal is None else (proposal[0][b, :n], proposal[1][b, :n])
            accepted[b], tokens[b] = rejection_accept(drafts[b, :n], p, q, candidates, key=r.next_key())
        return mx.stack(accepted), mx.stack(tokens)
