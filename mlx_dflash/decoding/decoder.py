"""The DFlash decoding loop (DFlash paper, arXiv 2602.06036, section 3): a prompt read, then rounds of draft,
verify, accept, roll back. `speculative_round` is one round, written once over rows, and `plain_rounds` the
target's steps alone where drafting does not pay; the scheduler (decoding/batch_decoder.py) runs them for the
rows decoding together, one request being its one-row case (`Scheduler.alone`, which `generate.py` wraps in
the tokenizer, stop handling, streaming text and statistics).

Host round trips: the loop reads the device back through `to_host` only, once per round where it can.
- Every round: the drafts, the number kept, the next token and prompt lookup's count come back
  together after the verify (greedy and sampled rounds alike: acceptance runs on the device).
- `--width auto` and `--p-min` (policies that read the drafter's confidence) add one before the verify:
  the width to verify depends on the confidence, and the verify's shape on the width.
- A plain target step reads its token once, overlapped with the next step's forward (as mlx-lm's
  generate_step); a prompt's read reads nothing back (its last token is the first round's anchor).
Under a sharded target every rank also exchanges rank 0's choices (distributed.py), a round trip each.
"""

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Iterator, Optional

import mlx.core as mx
import numpy as np

from ..models.base import DraftModel
from ..models.no_drafter import NoDrafter
from ..models.target import Target
from ..policies.width import RoundSeen, WidthPolicy
from .lookup import PromptLookup, with_lookup
from .sampling import SamplingParams, accept_rows
from .tree import TreeVerdict, accept_trees, copy_trees, grow, tree_verdict


class SingleProcess:
    """The decoding loop's view of one process: nothing to agree on."""

    rank = 0
    comm_seconds = 0.0
    lockstep = False  # ranks must take every round together (no pipelined plain steps)

    def decide(self, choice: int) -> int:
        """A choice made by the clock (a scheduler's), as rank 0 made it."""
        return choice

    def agree(self, drafts: mx.array, confidence) -> tuple:
        """The rows' drafts [B, n] and the confidence read of them (None: none), as rank 0 made them."""
        return drafts, confidence

    def agree_trees(self, trees):
        """The rows' draft trees (decoding/tree.py `Trees`; None: a chain this round), as rank 0 made them."""
        return trees

    def settle(self, accepted: list, tokens: list) -> tuple:
        """Each row's kept drafts (or, after a tree's verify, the node its walk ended at) and next token, as rank 0
        judged them."""
        return accepted, tokens

    def whole_features(self, rows: mx.array) -> mx.array:
        return rows

    def watch(self):
        return nullcontext(self)


@dataclass
class Round:
    tokens: list  # tokens this round emits (accepted drafts, then the target's own token)
    drafted: int  # drafted tokens the target verified
    accepted: int  # of those, how many it kept
    looked_up: int = 0  # of those, how many prompt lookup proposed (decoding/lookup.py)
    logprobs: Optional[mx.array] = None  # [len(tokens), V] the target's log-probabilities, lazy
    plain: bool = False  # a plain target step: the policy skipped the drafter
    tree: bool = False  # the target verified a tree of drafts (decoding/tree.py), not one path

    @property
    def width(self) -> int:
        """Rows the target verified (anchor included); 1 for the prefill and plain steps."""
        return self.drafted + 1


@dataclass
class DecodeState:
    """What decoding has built: the target's cache over `tokens`, the drafter's cache, and the feature vectors
    of `tokens` the drafter has not read yet (`context`). The drafter's cache and the context together hold
    the features of every token in `tokens` (unless `dropped_features`: drafting off keeps none); the
    target's cache holds `tokens`, or during a run of plain steps one more (the next step's forward is
    already under way). A prefix cache keeps states and starts later requests from them (decoding/prompt_cache.py)."""

    cache: list
    draft_cache: list
    tokens: list = field(default_factory=list)
    context: Optional[mx.array] = None
    dropped_features: bool = False

    @classmethod
    def fresh(cls, target: Target, drafter: DraftModel) -> "DecodeState":
        return cls(target.make_cache(), drafter.make_cache())

    def hand_context_to(self, drafter: DraftModel):
        """The drafter's cache takes the unread feature vectors now (a prompt's, as part of reading it), so that
        no round pays for them: at a long context the first draft would cost several target steps. The first
        draft reads one new feature vector still: the prompt's last token's, which the request's first round reads."""
        if self.context is not None and self.context.shape[1] > 0:
            drafter.read_context(self.context, self.draft_cache)
            self.context = None

    def extend(self, tokens: list, features: Optional[mx.array]):
        """`tokens` entered the target's cache; `features` are their rows (None: not kept)."""
        self.tokens.extend(tokens)
        if features is None:
            self.dropped_features = self.dropped_features or bool(tokens)
        else:
            self.context = features if self.context is None else mx.concatenate([self.context, features], axis=1)


def to_host(*arrays: mx.array) -> list:
    """The arrays' values on the host, in one round trip (one evaluation, then copies)."""
    mx.eval(*arrays)
    return [a.tolist() for a in arrays]


def log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@dataclass
class Row:
    """One request decoding: its state (its caches, or while it is in a batch its row of the batch's), the
    token it reads next, and what it may still emit and how."""

    state: DecodeState
    anchor: int  # the next token to read, not yet in the caches: the last emitted (or the prompt's last)
    sampling: SamplingParams
    remaining: int  # tokens it may still emit
    history: PromptLookup  # the prompt and every emitted token, for prompt lookup
    handle: object = None  # the caller's name for it
    key: Optional[mx.array] = None  # its own random stream (a seeded request in a batch), else the global one
    first: bool = False  # `anchor` is its prompt's last token: the next round picks its first token only
    first_key: Optional[mx.array] = None  # the key that first token is drawn with (a seeded request)

    def next_key(self) -> Optional[mx.array]:
        if self.key is None:
            return None
        self.key, use = mx.random.split(self.key)
        return use


def seeded_keys(seed: Optional[int]) -> tuple:
    """(the key a seeded request's first token is drawn with, its own random stream for every later draw);
    (None, None) without a seed: MLX's global stream. One request alone and in a batch draw alike."""
    if seed is None:
        return None, None
    return mx.random.split(mx.random.key(seed))[0], mx.random.key(seed + 1)


def speculative_round(target: Target, drafter: DraftModel, cache: list, draft_cache: list, rows: list,
                      policy: WidthPolicy, ranks: SingleProcess = SingleProcess()) -> tuple:
    """One round for every row: returns ([Round] in row order, the width verified).

    cache, draft_cache: the rows' caches (one request's own at one row; a batch's, models/batch_cache.py).
    ranks: a sharded target's (distributed.py), whose ranks decode the same rows in step.
    Every row verifies the same width W, less where it has fewer tokens left: a batch forward pads its rows
    to the longest, so a row verifying fewer drafts would cost the same and keep fewer. The W rows are one
    path of drafts (a chain) or a tree of the drafter's likeliest paths (decoding/tree.py), as the policy
    chooses. A row with nothing left to emit must not be here. The caller has told the policy the rows'
    context (`at_context`)."""
    most = [1 if r.first else r.remaining for r in rows]  # tokens each row may emit this round
    width, lookup = policy.width(len(rows), max(most)), policy.controls.prompt_lookup
    proposals = [r.history.propose(min(width, n) - 1) if lookup else [] for r, n in zip(rows, most)]
    runs = [r.history.run for r in rows]  # how long each row's copy has run: lookup's acceptance is kept by it
    depths = [min(width - 1, n - 1) for n in most]
    may_tree, trees = bool(policy.controls.tree), None
    if isinstance(drafter, NoDrafter):  # no drafter: lookup's copies are the only drafts, and no more is verified
        if may_tree and width > 1:  # the copies of every earlier occurrence, as one tree
            trees = copy_trees([r.history.copies(d) for r, d in zip(rows, depths)], width, depths)
            width = min(width, 1 + int(trees.alive.sum(axis=1).max()))
        else:
            width = min(width, 1 + max(map(len, proposals)))

    # Draft: one drafter pass over [anchor, MASK...] per row proposes block positions 1..width-1; where a row's
    # first draft is unsure, prompt lookup's copy of its context may replace it (with no drafter, it always
    # does). A sampled draft brings its proposal q. Nothing is evaluated here unless the policy reads the
    # confidence or ranks a tree: otherwise the drafter runs in the same evaluation as the verify below.
    tic = time.perf_counter()
    # (made here, not at import: an MLX array belongs to the stream of the thread that made it)
    drafts, proposal, confidence = mx.zeros((len(rows), 0), dtype=mx.int32), None, None
    looked_up = mx.zeros(len(rows), dtype=mx.int32)
    if width > 1:
        # a row draws from its own stream only when it drafts: what it samples never depends on its neighbours
        keys = [r.next_key() if n > 1 else None for r, n in zip(rows, most)] \
            if any(r.key is not None for r in rows) else None
        draft = drafter.draft([r.anchor for r in rows], [r.state.context for r in rows], draft_cache,
                              policy.block_size, width, [r.sampling for r in rows], keys)
        if lookup:
            draft = with_lookup(draft, proposals)
        for r in rows:
            r.state.context = None  # the drafter's cache holds it now
        drafts, proposal = draft.ids.astype(mx.int32), draft.proposal
        if draft.looked_up is not None:
            looked_up = draft.looked_up
        tree = may_tree and (draft.candidates is not None or trees is not None)
        if policy.uses_confidence or tree:
            ranked = tree and trees is None  # the drafter's candidates, for a tree of them
            candidates = draft.candidates if ranked else ()
            confidence, looked_up_host, *top = to_host(draft.confidence, looked_up, *candidates)
            if ranked:  # prompt lookup's copies, where there are some, are branches beside the drafter's candidates
                copies = [r.history.copies(d) if lookup else [] for r, d in zip(rows, depths)]
                trees = grow(*map(np.array, top), width, depths, copies)
            if tree:
                width, tree = policy.cut_tree(width, trees, confidence, looked_up_host, most, runs)
                trees = trees if tree else None
            else:
                width = policy.cut(width, confidence, looked_up_host, most, runs)
            drafts = drafts[:, : width - 1]
    drafts, confidence = ranks.agree(drafts, confidence)
    width = drafts.shape[1] + 1  # rank 0's, under a sharded target
    if may_tree:
        trees = ranks.agree_trees(trees)
    draft_seconds = time.perf_counter() - tic

    # Verify: the target scores every row's [anchor, drafts] in one forward (a tree's nodes, each at its depth
    # and seeing its ancestors only); row i judges drafts[i]. Each row's kept path: its node indices.
    limits = [min(width - 1, n - 1) for n in most]
    # a sampled row's own stream (a seeded request): its first token's key, then the next of its stream
    keys = [None if r.sampling.greedy else r.first_key if r.first else r.next_key() for r in rows]
    if trees is not None and width > 1:
        v = verify_trees(target, cache, rows, trees, width, most, keys, ranks)
    else:
        v = verify_chains(target, cache, rows, drafts, proposal, limits, keys, looked_up, ranks)
    logits, features, accepted, bonus, looked_up = v.logits, v.features, v.accepted, v.bonus, v.looked_up
    policy.observe(RoundSeen(confidence, limits, accepted, width, draft_seconds,
                             time.perf_counter() - tic - draft_seconds, looked_up, v.tree, runs))

    # Roll back: each row's cache keeps its anchor and accepted drafts, whose features join its context.
    target.trim_rows(cache, [width - 1 - a for a in accepted])
    rounds = []
    for b, r in enumerate(rows):
        kept = v.drafts[b][: accepted[b]]
        path = slice(0, accepted[b] + 1) if v.paths is None else mx.array(v.paths[b])
        r.state.extend([r.anchor] + kept, ranks.whole_features(features[b : b + 1, path]))
        new = kept + [bonus[b]]
        r.history.extend(new)
        r.anchor, r.remaining, r.first = bonus[b], r.remaining - len(new), False
        rounds.append(Round(new, limits[b], accepted[b], min(looked_up[b], limits[b]), log_softmax(logits[b, path]),
                            tree=v.tree is not None))
    return rounds, width


@dataclass
class Verified:
    """A verify forward and its verdict, read back: every row's drafts (as lists) and how many it keeps, its next
    token and looked-up drafts, and for a tree the node indices of each row's kept path and what its nodes showed
    (a chain keeps its first nodes: None)."""

    logits: mx.array
    features: mx.array
    drafts: list
    accepted: list
    bonus: list
    looked_up: list
    paths: Optional[list] = None
    tree: Optional[TreeVerdict] = None


def verify_chains(target: Target, cache: list, rows: list, drafts: mx.array, proposal, limits: list, keys: list,
                  looked_up: mx.array, ranks: SingleProcess) -> Verified:
    """The target's forward over each row's [anchor, drafts], then each row's longest kept prefix."""
    block = mx.concatenate([mx.array([[r.anchor] for r in rows], dtype=mx.int32), drafts], axis=1)
    logits, features = target.forward(block, cache)
    accepted, bonus = accept_rows(drafts, logits, [r.sampling for r in rows], limits, proposal, keys)
    drafts, accepted, bonus, looked_up = to_host(drafts, accepted, bonus, looked_up)
    accepted, bonus = ranks.settle(accepted, bonus)
    return Verified(logits, features, drafts, accepted, bonus, looked_up)


def verify_trees(target: Target, cache: list, rows: list, trees, nodes: int, most: list, keys: list,
                 ranks: SingleProcess) -> Verified:
    """The target's forward over each row's tree of `nodes` nodes (decoding/tree.py), then the walk along it. The
    kept path's cache entries move to follow the context; the other nodes' go with the round's rollback."""
    block = trees.first(nodes, [r.anchor for r in rows], [min(nodes, n) for n in most])
    # every row's tree one path in order (a tree of 2 always is): a chain's forward, without per-node positions
    logits, features = target.forward(mx.array(block.tokens, mx.int32), cache, None if block.one_path else block)
    last, bonus = ranks.settle(*to_host(*accept_trees(block, logits, [r.sampling for r in rows], keys)))
    paths = [block.path(b, n) for b, n in enumerate(last)]
    target.keep_paths(cache, paths, nodes)
    drafts = [block.tokens[b, p[1:]].tolist() for b, p in enumerate(paths)]
    looked_up = [int(block.copied[b, p].sum()) for b, p in enumerate(paths)]  # kept tokens lookup's copy proposed
    return Verified(logits, features, drafts, [len(p) - 1 for p in paths], bonus, looked_up, paths,
                    tree_verdict(block, paths))


def plain_rounds(target: Target, cache: list, rows: list, n: int, keep_features: bool,
                 stop_ids: frozenset = frozenset()) -> Iterator[list]:
    """n steps of the target alone for every row, no drafter: yields each step's [Round] in row order (one
    token a row), the rows brought up to date as the speculative round does. keep_features: the rows'
    feature vectors join their contexts (the drafter drafts again later); otherwise they are dropped.

    As mlx-lm's generate_step does, each step's forward is built and started before the host reads the
    tokens before it, so building the graph overlaps the computation. The last tokens are not run here:
    they are the next anchors, and enter the cache with the next forward. Every row must have n tokens left.
    stop_ids: a step where a row picks one ends the run (so that row leaves at once), the step already under
    way rolled back, where the target can trim (a batch's rows; one request's caller closes the run itself)."""

    no_drafts = mx.zeros((len(rows), 0), dtype=mx.int32)

    def step(anchors: mx.array, first: bool) -> tuple:
        logits, features = target.forward(anchors[:, None], cache)
        target.trim_rows(cache, [0] * len(rows))  # nothing to roll back: drops a hybrid target's tapes
        # a sampled row's own stream (a seeded request): its first token's key, then the next of its stream
        keys = [None if r.sampling.greedy else r.first_key if first and r.first else r.next_key() for r in rows]
        _, chosen = accept_rows(no_drafts, logits, [r.sampling for r in rows], [0] * len(rows), None, keys)
        chosen = chosen.astype(mx.int32)
        mx.async_eval(chosen, features)
        return chosen, logits, features

    current = step(mx.array([r.anchor for r in rows], dtype=mx.int32), first=True)
    for i in range(n):
        keys = [r.key for r in rows]  # the rows' streams before the next step draws from them
        upcoming = step(current[0], first=False) if i + 1 < n else None
        chosen, logits, features = current
        tokens, rounds = to_host(chosen)[0], []
        for b, (r, token) in enumerate(zip(rows, tokens)):
            # the row of the token before entered the cache; its features are the drafter's context
            r.state.extend([r.anchor], features[b : b + 1] if keep_features else None)
            r.history.extend([token])
            r.anchor, r.remaining, r.first = token, r.remaining - 1, False
            rounds.append(Round([token], drafted=0, accepted=0, logprobs=log_softmax(logits[b]), plain=True))
        yield rounds
        if upcoming is not None and target.trimmable and not stop_ids.isdisjoint(tokens):
            target.trim_rows(cache, [1] * len(rows))  # the step under way read tokens nobody needs now,
            for r, key in zip(rows, keys):  # and drew from streams the next round draws from again
                r.key = key
            return
        current = upcoming
