"""Draft trees (DDTree, arXiv 2604.12989): verify the drafter's likeliest continuations, not one path.

One drafter pass gives, at each block position j, its k likeliest tokens with their probabilities. A path's
score is the product of its tokens' probabilities (the positions are drafted independently, so a node at depth
d has as children the candidates of position d + 1, whatever the path). The tree of n nodes the target verifies
is the anchor and the n - 1 best-scored paths; since a child never scores above its parent, those are a tree
(every node's parent among them), and the tree of a smaller budget is a prefix of the same order: `grow` ranks
once, `Trees.first` takes any budget of it. Prompt lookup's copies of the context (what followed each earlier
occurrence of its last tokens), where there are some, are branches of their own beside the drafter's (`grow`);
without a drafter they are the whole tree (`copy_trees`).

The target scores every node in one forward (models/tree_verify.py); `accept_trees` then walks each row from
the root: at each node the target's own token (argmax for greedy; a draw with the row's sampler), on to the
child holding it, and where no child does, that token is the round's bonus. Every token emitted is the target's
choice at its own prefix, so greedy output is the target's and sampled output is distributed as the target's.

Ranking runs on the host, numpy over every row at once, one step a depth (no Python loop over nodes): the
round has read the drafter's candidates back by then for the policy, and a tree's shape is host data anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np

from ..policies.width import ACCEPTANCE_PRIOR
from .sampling import filtered_logprobs

NODE_KEYS = 64  # a seeded row's key splits into this many, one for each node of its tree


@dataclass
class Trees:
    """B rows' trees in rank order (best-scored first; node 0, the anchor, is not ranked): for ranked node r of
    row b, its token, its parent (an index into the ranked nodes, -1: the anchor), its depth (1 = the first
    draft) and its drafter probability (of that token at that depth); `alive` is False where a row had fewer
    candidates than nodes asked for (never accepted)."""

    tokens: np.ndarray  # [B, M]
    parents: np.ndarray  # [B, M]
    depth: np.ndarray  # [B, M]
    probs: np.ndarray  # [B, M]
    alive: np.ndarray  # [B, M]
    copied: np.ndarray  # [B, M]: prompt lookup's latest copy proposed the node (its probability is lookup's prior)

    def first(self, nodes: int, anchors: list, caps: list) -> "TreeBlock":
        """The trees of `nodes` rows each (the anchor and the nodes - 1 best), as the verify forward takes them:
        row b's first caps[b] alive (what it would verify alone, with fewer tokens left than the batch's widest
        row): first its principal path (from the anchor, each node's best-ranked child), then the others in depth
        order (every parent before its children), then its dead ones. A round that keeps a prefix of the
        principal path, the likeliest, has its kept entries in place already (`keep_paths` moves nothing); a
        row's alive nodes sit where they would alone, so a seeded row draws at each from the same key."""
        m = nodes - 1
        B = len(anchors)
        alive = self.alive[:, :m] & (np.arange(m)[None] < np.array(caps)[:, None] - 1)
        depth = self.depth[:, :m]
        principal, tip = np.zeros((B, m), bool), np.full(B, -1)
        for r in range(m):  # in rank order, a node's best child comes first
            principal[:, r] = alive[:, r] & (self.parents[:, r] == tip)
            tip = np.where(principal[:, r], r, tip)
        key = np.where(principal, depth, np.where(alive, depth + nodes, depth + 2 * nodes))
        order = np.argsort(key, axis=1, kind="stable")  # ranked node per position
        where = np.empty_like(order)
        np.put_along_axis(where, order, np.arange(1, m + 1)[None].repeat(B, 0), axis=1)
        rank_parent = np.take_along_axis(self.parents[:, :m], order, axis=1)
        position_of = np.concatenate([np.zeros((B, 1), np.int64), where], axis=1)  # rank + 1 -> position
        parents = np.take_along_axis(position_of, rank_parent + 1, axis=1)

        def placed(x: np.ndarray, root) -> np.ndarray:
            return np.concatenate([np.full((B, 1), root, x.dtype), np.take_along_axis(x[:, :m], order, axis=1)], axis=1)

        return TreeBlock(
            tokens=np.concatenate([np.array(anchors)[:, None], placed(self.tokens, 0)[:, 1:]], axis=1),
            parents=np.concatenate([np.full((B, 1), -1), parents], axis=1),
            depth=placed(self.depth, 0),
            alive=placed(alive, True),
            probs=placed(self.probs, 1.0),
            copied=placed(self.copied, False),
        )


@dataclass
class TreeBlock:
    """The block a tree verify feeds: B rows of N nodes, node 0 the anchor, every parent before its children."""

    tokens: np.ndarray  # [B, N]
    parents: np.ndarray  # [B, N], -1 for the anchor
    depth: np.ndarray  # [B, N]
    alive: np.ndarray  # [B, N]
    probs: np.ndarray  # [B, N] the drafter's probability of each node's token at its depth (1 for the anchor)
    copied: np.ndarray  # [B, N] proposed by prompt lookup's latest copy

    @cached_property
    def ancestors(self) -> np.ndarray:
        """[B, N, N]: node j is node i or one of its ancestors (the verify's mask and the walk both read it)."""
        B, N = self.parents.shape
        out = np.zeros((B, N, N), bool)
        rows = np.arange(B)
        for i in range(N):  # parents come first, so their rows are complete
            out[:, i, i] = True
            if i:
                out[:, i] |= out[rows, self.parents[:, i]]
        return out

    @cached_property
    def one_path(self) -> bool:
        """Every row's nodes are one path in order (a tree of 2 always is): its verify is a chain's."""
        return bool((self.parents == np.arange(-1, self.parents.shape[1] - 1)[None]).all())

    def path(self, b: int, last: int) -> list:
        """Node indices from the anchor to `last` in row b."""
        nodes = [last]
        while nodes[-1] > 0:
            nodes.append(int(self.parents[b, nodes[-1]]))
        return nodes[::-1]


@dataclass
class TreeVerdict:
    """What a tree round showed, for the policy to learn from: each node's probability, depth and source (the
    drafter or prompt lookup's copy), and whether it was judged (its parent was reached, so the target's pick there decided it) and reached."""

    probs: np.ndarray  # [B, N]
    depth: np.ndarray  # [B, N]
    copied: np.ndarray  # [B, N]
    judged: np.ndarray  # [B, N]
    reached: np.ndarray  # [B, N]
    branched: bool = True  # its forward ran as a tree's (False: every row's tree was one path, verified as a chain)


def tree_verdict(block: TreeBlock, paths: list) -> TreeVerdict:
    B, N = block.tokens.shape
    reached = np.zeros((B, N), bool)
    for b, path in enumerate(paths):
        reached[b, path] = True
    parent_reached = np.take_along_axis(reached, np.maximum(block.parents, 0), axis=1)
    judged = parent_reached & block.alive & (np.arange(N) > 0)[None]
    return TreeVerdict(block.probs, block.depth, block.copied, judged, reached, not block.one_path)


def copy_trie(copies: list, n: int) -> tuple:
    """Each row's copies (decoding/lookup.py `PromptLookup.copies`, the latest first) as one trie laid out by depth,
    as `grow` reads it: at depth d, slot s holds a node's token, the slot of its parent at depth d - 1 (-1: the
    anchor), the share of the copies reaching its parent that go on with its token (0: no node there), and whether
    the latest copy (the chain's proposal) passes through it; each [B, n, S], S the most copies a row has."""
    B, S = len(copies), max(map(len, copies), default=0) or 1
    token, parent = np.zeros((B, n, S), np.int64), np.full((B, n, S), -1)
    count, latest = np.zeros((B, n, S)), np.zeros((B, n, S), bool)
    for b, row in enumerate(copies):
        slots = [{} for _ in range(n)]  # per depth: (parent slot, token) -> slot
        for i, copy in enumerate(row):
            up = -1
            for d, t in enumerate(copy[:n]):
                s = slots[d].setdefault((up, t), len(slots[d]))
                token[b, d, s], parent[b, d, s] = t, up
                count[b, d, s] += 1
                latest[b, d, s] |= i == 0
                up = s
    reaching = np.concatenate([np.array([len(r) for r in copies], float)[:, None, None].repeat(S, 2),
                               np.take_along_axis(count[:, :-1], np.maximum(parent[:, 1:], 0), axis=2)], axis=1)
    return token, parent, count / np.maximum(reaching, 1), latest


def grow(ids: np.ndarray, probs: np.ndarray, nodes: int, depths: list, copies: list = None) -> Trees:
    """Rank each row's best `nodes` - 1 paths from its candidates (ids, probs [B, n, k]: position j's k
    likeliest tokens), row b's no deeper than depths[b]. Best-first by the product of probabilities: at each
    depth only the m = nodes - 1 best so far can have ranked children, so a beam of m per depth finds them.

    copies[b]: prompt lookup's copies of row b's context, the latest first (`PromptLookup.copies`), as a trie of
    branches beside the drafter's candidates (`copy_trie`): a copied token at depth d + 1 follows only the copies'
    token at depth d. The latest copy's nodes are scored by lookup's prior acceptance by position and judged by
    lookup's calibration (`copied`); another copy's node by that prior times its share of the copies reaching its
    parent, judged as a drafter's by its share. Where the drafter proposes a copied token under the same parent,
    the copies take that node (at the better score). Nodes after a copied token are the drafter's candidates as
    anywhere."""
    B, n, k = ids.shape
    m = nodes - 1
    copy_token, copy_parent, share, latest = copy_trie(copies if copies is not None else [[]] * B, n)
    S = copy_token.shape[2]
    prior = np.array(ACCEPTANCE_PRIOR + (ACCEPTANCE_PRIOR[-1],) * n)[None, :n, None]
    copy_prob = np.where(latest, prior, share)
    with np.errstate(divide="ignore"):
        logp = np.log(probs.astype(np.float64))
        copy_logp = np.log(prior * np.where(latest, 1.0, share))  # -inf where a slot holds no node
    found = {x: [] for x in ("score", "parent", "token", "prob", "copied")}
    beam_score, beam_index = np.zeros((B, 1)), np.full((B, 1), -1)  # the anchor
    slot_score, slot_index = np.zeros((B, S)), np.full((B, S), -1)  # the copies' nodes a depth up, as kept
    offset = 0  # index of the first candidate of this depth in the concatenation
    for d in range(min(n, max(depths, default=0))):
        P = beam_score.shape[1]
        D = P * k  # the drafter's candidates at this depth, then the copies' S
        up = np.maximum(copy_parent[:, d], 0)
        c_score = copy_logp[:, d] + (np.take_along_axis(slot_score, up, axis=1) if d else 0)
        c_parent = np.take_along_axis(slot_index, up, axis=1) if d else np.full((B, S), -1)
        score = np.concatenate([(beam_score[:, :, None] + logp[:, d][:, None, :]).reshape(B, -1), c_score], axis=1)
        parent = np.concatenate([np.repeat(beam_index, k, axis=1), c_parent], axis=1)
        token = np.concatenate([np.tile(ids[:, d], (1, P)), copy_token[:, d]], axis=1)
        prob = np.concatenate([np.tile(probs[:, d], (1, P)), copy_prob[:, d]], axis=1)
        copied = np.concatenate([np.zeros((B, D), bool), latest[:, d]], axis=1)
        # a drafter candidate the copies hold too (its token under the same parent) is the copies' node
        same = (parent[:, :D, None] == c_parent[:, None]) & (token[:, :D, None] == copy_token[:, d][:, None])
        same &= np.isfinite(c_score)[:, None]
        score[:, D:] = np.maximum(c_score, np.where(same, score[:, :D, None], -np.inf).max(axis=1, initial=-np.inf))
        drafted = np.where(same, prob[:, :D, None], 0).max(axis=1, initial=0)
        prob[:, D:] = np.where(latest[:, d], prob[:, D:], np.maximum(prob[:, D:], drafted))
        score[:, :D][same.any(axis=2)] = -np.inf
        # a tie between a child and its parent (probability 1) ranks the parent first: deeper costs a hair
        score = score - 1e-9 * (d + 1)
        score[np.array(depths) <= d] = -np.inf
        keep = np.argsort(-score, axis=1, kind="stable")[:, :m]
        for name, values in (("score", score), ("parent", parent), ("token", token), ("prob", prob),
                             ("copied", copied)):
            found[name].append(np.take_along_axis(values, keep, axis=1))
        width = keep.shape[1]
        beam_score, beam_index = found["score"][-1], offset + np.arange(width)[None].repeat(B, 0)
        at = keep[:, :, None] == (D + np.arange(S))[None, None]  # [B, width, S]: where each copy slot was kept
        slot_index = np.where(at.any(axis=1), offset + at.argmax(axis=1), -2)  # -2: not kept, its copies end
        slot_score = np.where(at.any(axis=1), score[:, D:], -np.inf)
        offset += width
    if not found["score"]:
        raise ValueError("a tree needs at least one position to draft")
    scores, parents, tokens, prob, copied = (np.concatenate(found[x], axis=1)
                                             for x in ("score", "parent", "token", "prob", "copied"))
    depth = np.concatenate([np.full(x.shape, d + 1) for d, x in enumerate(found["score"])], axis=1)
    rank = np.argsort(-scores, axis=1, kind="stable")[:, :m]
    if rank.shape[1] < m:  # fewer candidates than nodes: pad with dead ones
        rank = np.concatenate([rank, rank[:, :1].repeat(m - rank.shape[1], 1)], axis=1)
    rank_of = np.full((B, scores.shape[1] + 1), -1)  # candidate index + 1 -> rank (-1: the anchor, or unranked)
    np.put_along_axis(rank_of, rank + 1, np.arange(m)[None].repeat(B, 0), axis=1)
    alive = np.isfinite(np.take_along_axis(scores, rank, axis=1))
    alive[:, 1:] &= rank[:, 1:] != rank[:, :1]  # padding repeats the first
    return Trees(
        tokens=np.take_along_axis(tokens, rank, axis=1),
        parents=np.take_along_axis(rank_of, np.take_along_axis(parents, rank, axis=1) + 1, axis=1),
        depth=np.take_along_axis(depth, rank, axis=1),
        probs=np.take_along_axis(prob, rank, axis=1),
        alive=alive,
        copied=np.take_along_axis(copied, rank, axis=1),
    )


def copy_trees(copies: list, nodes: int, depths: list) -> Trees:
    """The trees of prompt lookup's copies alone, for a target without a drafter: `grow` with no candidates (the
    latest copy's path is what a round without a tree verifies)."""
    none = np.zeros((len(copies), nodes - 1, 0))
    return grow(none.astype(np.int64), none, nodes, depths, copies)


def accept_trees(block: TreeBlock, logits: mx.array, samplings: list, keys: list) -> tuple:
    """(deepest accepted node [B], the token the target picks there [B]), lazy: each row's walk from the root
    (module docstring). A greedy row picks argmax at every node; a sampled row draws at every node from its
    filtered distribution (its own random stream keys[b], else MLX's global one): draws at distinct nodes are
    independent, and the walk uses each at most once, so every emitted token is drawn as the target draws it."""
    B, N = block.tokens.shape
    picks = []
    for b, params in enumerate(samplings):
        if params.greedy:
            picks.append(mx.argmax(logits[b], axis=-1))
            continue
        scaled = filtered_logprobs(logits[b], params) * (1 / params.temperature)
        if keys[b] is None:
            picks.append(mx.random.categorical(scaled))
            continue
        # a seeded row: the anchor's draw with its key (as a round with nothing drafted draws it), node i's with
        # the i-th of a fixed split, whatever the batch's tree size
        node_keys = mx.random.split(keys[b], max(NODE_KEYS, N))
        picks.append(mx.stack([mx.random.categorical(scaled[0], key=keys[b])]
                              + [mx.random.categorical(scaled[i], key=node_keys[i]) for i in range(1, N)]))
    picks = mx.stack(picks).astype(mx.int32)  # [B, N]
    parents = mx.array(np.maximum(block.parents, 0))
    tokens = mx.array(block.tokens, mx.int32)
    matches = (mx.take_along_axis(picks, parents, axis=1) == tokens) & mx.array(block.alive)
    matches = matches | (mx.arange(N) == 0)[None]  # the anchor is always there
    ancestors = mx.array(block.ancestors)
    reached = mx.all(mx.where(ancestors, matches[:, None, :], True), axis=2)  # [B, N]
    last = mx.argmax(mx.where(reached, mx.array(block.depth) + 1, 0), axis=1)
    return last, mx.take_along_axis(picks, last[:, None], axis=1)[:, 0]
