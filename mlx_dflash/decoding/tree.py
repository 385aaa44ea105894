"""Draft trees (DDTree, arXiv 2604.12989): verify the drafter's likeliest continuations, not one path.

One drafter pass gives, at each block position j, its k likeliest tokens with their probabilities. A path's
score is the product of its tokens' probabilities (the positions are drafted independently, so a node at depth
d has as children the candidates of position d + 1, whatever the path). The tree of n nodes the target verifies
is the anchor and the n - 1 best-scored paths; since a child never scores above its parent, those are a tree
(every node's parent among them), and the tree of a smaller budget is a prefix of the same order: `grow` ranks
once, `Trees.first` takes any budget of it. Prompt lookup's copy of the context, where there is one, is one more
branch of its own (`grow`).

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
    copied: np.ndarray  # [B, M]: prompt lookup's copy proposed the node (its probability is lookup's prior)

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
    copied: np.ndarray  # [B, N] proposed by prompt lookup's copy

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


def tree_verdict(block: TreeBlock, paths: list) -> TreeVerdict:
    B, N = block.tokens.shape
    reached = np.zeros((B, N), bool)
    for b, path in enumerate(paths):
        reached[b, path] = True
    parent_reached = np.take_along_axis(reached, np.maximum(block.parents, 0), axis=1)
    judged = parent_reached & block.alive & (np.arange(N) > 0)[None]
    return TreeVerdict(block.probs, block.depth, block.copied, judged, reached)


def grow(ids: np.ndarray, probs: np.ndarray, nodes: int, depths: list, copies: tuple = None) -> Trees:
    """Rank each row's best `nodes` - 1 paths from its candidates (ids, probs [B, n, k]: position j's k
    likeliest tokens), row b's no deeper than depths[b]. Best-first by the product of probabilities: at each
    depth only the m = nodes - 1 best so far can have ranked children, so a beam of m per depth finds them.

    copies: (tokens [B, n], lengths [B]): prompt lookup's copy of each row's context (its first lengths[b]
    tokens), a branch of its own: its token at depth d + 1 follows only its token at depth d, scored by lookup's
    prior acceptance by position; where the drafter proposes the same token under the same parent, the copy
    takes that node (at the better score). Nodes after a copied token are the drafter's candidates as anywhere."""
    B, n, k = ids.shape
    m = nodes - 1
    copy_tokens, copy_lengths = copies if copies is not None else (np.zeros((B, n), np.int64), np.zeros(B, int))
    copy_prob = np.array(ACCEPTANCE_PRIOR + (ACCEPTANCE_PRIOR[-1],) * n)[:n]
    with np.errstate(divide="ignore"):
        logp = np.log(probs.astype(np.float64))
        copy_logp = np.log(copy_prob)
    found = {x: [] for x in ("score", "parent", "token", "prob", "copied")}
    beam_score, beam_index = np.zeros((B, 1)), np.full((B, 1), -1)  # the anchor
    copy_score, copy_parent = np.zeros(B), np.full(B, -1)  # the copy's last node kept (-1: the anchor)
    rows = np.arange(B)
    offset = 0  # index of the first candidate of this depth in the concatenation
    for d in range(min(n, max(depths, default=0))):
        P = beam_score.shape[1]
        score = np.concatenate([(beam_score[:, :, None] + logp[:, d][:, None, :]).reshape(B, -1),
                                (copy_score + copy_logp[d])[:, None]], axis=1)  # [B, P * k + 1]: the copy last
        parent = np.concatenate([np.repeat(beam_index, k, axis=1), copy_parent[:, None]], axis=1)
        token = np.concatenate([np.tile(ids[:, d], (1, P)), copy_tokens[:, d, None]], axis=1)
        prob = np.concatenate([np.tile(probs[:, d], (1, P)), np.full((B, 1), copy_prob[d])], axis=1)
        copied = np.zeros_like(score, bool)
        copied[:, -1] = True
        score[np.asarray(copy_lengths) <= d, -1] = -np.inf  # the copy ended (or its parent fell out of the beam)
        same = (parent[:, :-1] == copy_parent[:, None]) & (token[:, :-1] == copy_tokens[:, d, None])
        same &= np.isfinite(score[:, -1:])
        score[:, -1] = np.maximum(score[:, -1], np.where(same, score[:, :-1], -np.inf).max(axis=1))
        score[:, :-1][same] = -np.inf
        # a tie between a child and its parent (probability 1) ranks the parent first: deeper costs a hair
        score = score - 1e-9 * (d + 1)
        score[np.array(depths) <= d] = -np.inf
        keep = np.argsort(-score, axis=1, kind="stable")[:, :m]
        for name, values in (("score", score), ("parent", parent), ("token", token), ("prob", prob),
                             ("copied", copied)):
            found[name].append(np.take_along_axis(values, keep, axis=1))
        width = keep.shape[1]
        beam_score, beam_index = found["score"][-1], offset + np.arange(width)[None].repeat(B, 0)
        at = keep == score.shape[1] - 1  # where the copy's candidate was kept
        copy_parent = np.where(at.any(axis=1), offset + at.argmax(axis=1), -2)  # -2: no parent, the copy ends
        copy_score = np.where(at.any(axis=1), score[rows, -1], -np.inf)
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
    """The trees of prompt lookup's copies, for a target without a drafter: copies[b] holds row b's copies of what
    followed the earlier occurrences of its context's last tokens, the latest first (decoding/lookup.py
    `PromptLookup.copies`). A row's copies form a trie: a node's probability is the share of the copies reaching
    its parent that go on with its token. Ranked: the latest copy's path first (the chain a round without a tree
    verifies; `copied`, so lookup's calibration judges it), then the other nodes by the product of the shares
    along their path (judged as a drafter's by their share); row b's no deeper than depths[b]."""
    m, B = nodes - 1, len(copies)
    tokens, parents, depth = np.zeros((B, m), np.int64), np.full((B, m), -1), np.ones((B, m), np.int64)
    probs, alive, copied = np.zeros((B, m)), np.zeros((B, m), bool), np.zeros((B, m), bool)
    for b, row in enumerate(copies):
        token, parent, level, reached, children = [0], [-1], [0], [len(row)], [{}]  # node 0: the anchor
        principal = []
        for i, copy in enumerate(row):
            node = 0
            for t in copy[: depths[b]]:
                if t not in children[node]:
                    children[node][t] = len(token)
                    token.append(t), parent.append(node), level.append(level[node] + 1), reached.append(0)
                    children.append({})
                node = children[node][t]
                reached[node] += 1
            if i == 0:
                principal = list(range(1, len(token)))  # the latest copy made every node so far
        share = [1.0] + [reached[n] / reached[parent[n]] for n in range(1, len(token))]
        score = [1.0]
        for n in range(1, len(token)):  # parents come before children
            score.append(score[parent[n]] * share[n])
        others = sorted(range(len(principal) + 1, len(token)), key=lambda n: (-score[n], level[n]))
        ranked = (principal + others)[:m]
        rank_of = {0: -1, **{n: r for r, n in enumerate(ranked)}}
        k = len(ranked)
        tokens[b, :k] = [token[n] for n in ranked]
        parents[b, :k] = [rank_of[parent[n]] for n in ranked]
        depth[b, :k] = [level[n] for n in ranked]
        probs[b, :k] = [share[n] for n in ranked]
        alive[b, :k] = True
        copied[b, : min(k, len(principal))] = True
    return Trees(tokens, parents, depth, probs, alive, copied)


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
