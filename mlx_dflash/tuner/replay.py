"""Acceptance replayed on the target's own greedy responses, without decoding.

On a greedy response the target's next tokens are the response itself, so greedy speculative decoding
can be replayed exactly from the drafter's proposals at every anchor (one batched drafter pass per
sequence). Used for the trainer's held-out evaluation and by bench/acceptance.py, which also scores
prompt lookup (a drafter with no weights) the same way as the yardstick.
"""

from collections import OrderedDict

import mlx.core as mx
import numpy as np

from ..decoding.lookup import LOOKUP_BELOW, PromptLookup
from ..errors import DFlashError
from ..models.dflash import DFlashDraftModel


def block_logits(drafter: DFlashDraftModel, features, block_ids, anchors):
    """Draft logits [A, B-1, V] for blocks at `anchors`, all against one sequence's features [1, T, F]."""
    hidden = drafter.hidden(block_ids, features, drafter.make_cache(), block_start=anchors)
    return drafter.logits(hidden[:, 1:])


def block_drafts(drafter: DFlashDraftModel, features, block_ids, anchors):
    """The drafted tokens [A, B-1] of those blocks, as greedy decoding proposes them (within its draft
    vocabulary; a DFlash 2 drafter's by its selector's walk), and the confidence [A] of each block's
    first draft."""
    hidden = drafter.hidden(block_ids, features, drafter.make_cache(), block_start=anchors)[:, 1:]
    if hasattr(drafter, "walk"):
        walk = drafter.walk(hidden, block_ids[:, 0])
        return walk.tokens, mx.take_along_axis(walk.probs[:, 0], walk.chosen[:, :1], axis=-1)[:, 0]
    logits = drafter.draft_logits(hidden)
    return drafter.draft_tokens(logits), mx.softmax(logits[:, 0].astype(mx.float32), axis=-1).max(axis=-1)


class TargetFeatures:
    """The frozen target's features of each sequence, computed once and kept (they never change), and
    with `choices` its greedy choice at every position, from the same forward.

    What is kept is bounded by `keep_bytes`, the least recently used dropped first: a long run over a
    large text set would otherwise hold every sequence's features (4 taps x 576 float32s a token for
    SmolLM2).
    """

    def __init__(self, target, keep_bytes: int = 4 << 30):
        self.target, self.keep_bytes, self._memo, self._bytes = target, keep_bytes, OrderedDict(), 0

    @classmethod
    def of(cls, target_or_features) -> "TargetFeatures":
        return target_or_features if isinstance(target_or_features, cls) else cls(target_or_features)

    def __call__(self, ids) -> mx.array:
        return self._run(ids, with_choices=False)[0]

    def choices(self, ids) -> np.ndarray:
        """The target's greedy token for each position of ids [T] given the ids before it, as int array [T]
        (position 0, which has nothing before it, keeps ids[0]): the labels a drafter learns the target's
        own choices from."""
        return self._run(ids, with_choices=True)[1]

    def _run(self, ids, with_choices: bool):
        ids = np.asarray(ids, dtype=np.int32)
        key = ids.tobytes()
        kept = self._memo.get(key)
        if kept is not None and (kept[1] is not None or not with_choices):
            self._memo.move_to_end(key)
            return kept
        logits, features = self.target.forward(mx.array(ids)[None], None)
        if not features.shape[-1]:
            raise DFlashError("the target captures no layers yet: bind the drafter to it before computing features")
        choices = None
        if with_choices:  # else the head's logits stay lazy and never run
            argmax = mx.argmax(logits[0, :-1], axis=-1)
            mx.eval(features, argmax)
            choices = np.concatenate([ids[:1], np.array(argmax).astype(np.int32)])
        else:
            mx.eval(features)
        return self._keep(key, (features, choices))

    def _keep(self, key, value):
        if key in self._memo:
            self._bytes -= self._memo.pop(key)[0].nbytes
        self._memo[key] = value
        self._bytes += value[0].nbytes
        while self._bytes > self.keep_bytes and len(self._memo) > 1:
            self._bytes -= self._memo.popitem(last=False)[1][0].nbytes
        return value


def replayed_blocks(drafter, features_of, ids, start):
    """One batched drafter pass over every anchor of a sequence: (drafts [A, B-1], whether the decoder's
    lookup rule replaces that anchor's block [A], lookup's proposals [A, B-1] with -1 where none)."""
    B = drafter.block_size
    anchors = np.arange(start, len(ids) - 1)
    block_ids = np.full((len(anchors), B), drafter.mask_token_id, dtype=np.int32)
    block_ids[:, 0] = ids[anchors]
    drafts, first_confidence = block_drafts(drafter, features_of(ids), mx.array(block_ids), mx.array(anchors))
    looked_up = prompt_lookup_drafts(ids, start, B - 1)
    replaced = (np.array(first_confidence) < LOOKUP_BELOW) & (looked_up[:, 0] >= 0)
    return np.array(drafts), replaced, looked_up


def decoding_acceptance(drafter, features_of, sequences, widths=(4, 8, 16), prompt_lookup=False) -> dict:
    """Greedy decoding's acceptance, replayed exactly on the target's own greedy responses.

    The drafter's proposals at every anchor depend only on the true prefix, so one batched drafter pass
    per sequence gives them all (`replay_greedy` does the walk). features_of: a TargetFeatures (or the
    target, which is wrapped in one). prompt_lookup: with the decoder's lookup rule (decoding/lookup.py) on top.
    Returns what `replay_greedy` returns.
    """
    features_of = TargetFeatures.of(features_of)

    def drafts_of(ids, start):
        drafts, replaced, looked_up = replayed_blocks(drafter, features_of, ids, start)
        if prompt_lookup:  # lookup's tokens over the leading drafts; the rest stay the drafter's
            drafts = np.where(replaced[:, None] & (looked_up >= 0), looked_up, drafts)
        return drafts

    return replay_greedy(drafts_of, sequences, widths)


def replay_greedy(drafts_of, sequences, widths) -> dict:
    """Acceptance of greedy speculative decoding replayed on greedy responses (ids, response start).

    Decoding from the response start, a round anchored at position s keeps the leading drafts that equal
    the target's next tokens, which for a greedy response are the response itself, and the next round
    anchors at s + kept + 1. drafts_of(ids, start) gives the proposals [anchors start..len-2, K] at every
    anchor (-1 where there is none). Returns, per verify width, {"tau": tokens per round (bonus included),
    "rounds": n, "reach": [P(draft k kept)]}.
    """
    results = {w: {"lengths": [], "reach": np.zeros(w - 1)} for w in widths}
    for ids, start in sequences:
        ids = np.array(ids)
        drafts = drafts_of(ids, start)
        for w, r in results.items():
            s = start
            while s < len(ids) - 1:
                limit = min(w - 1, drafts.shape[1], len(ids) - 1 - s - 1)  # drafts that have a true token to match
                kept = 0
                while kept < limit and drafts[s - start, kept] == ids[s + 1 + kept]:
                    kept += 1
                r["reach"][:kept] += 1
                r["lengths"].append(kept + 1)
                s += kept + 1
    return {
        w: {"tau": float(np.mean(r["lengths"])), "rounds": len(r["lengths"]),
            "reach": (r["reach"] / max(1, len(r["lengths"]))).tolist()}
        for w, r in results.items()
    }


def prompt_lookup_drafts(ids, start, k: int):
    """Prompt lookup's proposals (decoding/lookup.py) at every anchor, for `replay_greedy`: [anchors
    start..len-2, k], -1 where there are none. Alone, it is the yardstick a trained drafter must beat
    (it has no weights)."""
    ids = [int(t) for t in ids]
    drafts = np.full((len(ids) - 1 - start, k), -1, dtype=np.int64)
    history = PromptLookup(ids[: start + 1])
    for s in range(start, len(ids) - 1):
        copied = history.propose(k)
        drafts[s - start, : len(copied)] = copied
        history.extend([ids[s + 1]])
    return drafts


def looked_up_acceptance(drafter, features_of, sequences) -> dict:
    """Under the decoder's lookup rule, the chance that looked-up draft k+1 is kept once the ones
    before it were, at every anchor where lookup replaces the drafter's block: {"kept": [...],
    "judged": [...]} per position (policies/width.py's ACCEPTANCE_PRIOR comes from this)."""
    features_of = TargetFeatures.of(features_of)
    kept, judged = np.zeros(drafter.block_size - 1), np.zeros(drafter.block_size - 1)
    for ids, start in sequences:
        ids = np.array(ids)
        _, replaced, looked_up = replayed_blocks(drafter, features_of, ids, start)
        for a in np.flatnonzero(replaced):
            s = start + a
            m = min(int((looked_up[a] >= 0).sum()), len(ids) - 2 - s)  # drafts with a true token to match
            for k in range(m):
                judged[k] += 1
                if looked_up[a, k] != ids[s + 1 + k]:
                    break
                kept[k] += 1
    return {"kept": kept.tolist(), "judged": judged.tolist()}
