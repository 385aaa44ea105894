"""Draft trees (decoding/tree.py, models/tree_verify.py): each node's logits are those of a plain forward of its
path, the kept path's cache is plain decoding's, ranking is best-first, and decoding with trees is lossless."""

import mlx.core as mx
import numpy as np
import pytest

from test_families import assert_arrays_close, cache_arrays
from tiny_families import FAMILIES, PROMPT, bound_pair, tiny_model
from mlx_dflash.decoding.tree import TreeBlock, grow
from mlx_dflash.policies.width import RoundSeen

TREE_FAMILIES = list(FAMILIES)
# parents of a 9-node tree, every parent before its children: branches at the root and deeper
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 6]


def block_of(parents: list, tokens: list) -> TreeBlock:
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    n = len(parents)
    return TreeBlock(np.array([tokens]), np.array([parents]), np.array([depth]), np.ones((1, n), bool), np.ones((1, n)),
                     np.zeros((1, n), bool))


@pytest.mark.parametrize("family", TREE_FAMILIES)
def test_every_node_scores_as_a_plain_forward_of_its_path_and_the_kept_path_is_plain_decoding(family):
    """Past the sliding windows (8) of the families that have them: the context is 12 + 9 tokens. A hybrid's
    recurrent layers run each node from its parent's state."""
    model = tiny_model(family)
    target, _ = bound_pair(model)
    mx.random.seed(3)
    context = PROMPT + mx.random.randint(0, target.vocab_size, (9,)).tolist()
    tokens = mx.random.randint(0, target.vocab_size, (len(PARENTS),)).tolist()
    block = block_of(PARENTS, tokens)

    wants = []  # each node's path through a plain forward, before the tree's (a hybrid rolls back the last one)
    for i in range(len(PARENTS)):
        path = block.path(0, i)
        plain = target.make_cache()
        target.prefill(mx.array(context), plain)
        want_logits, want_features = target.forward(mx.array([[tokens[j] for j in path]]), plain)
        wants.append((path, [want_logits[0, -1], want_features[0, -1]]))
    for end in (8, 5, 3):  # the deepest leaf (the whole of its path), a shallower leaf, a node inside the tree
        cache = target.make_cache()
        target.prefill(mx.array(context), cache)
        logits, features = target.forward(mx.array(block.tokens), cache, block)
        if end == 8:
            for i, (path, want) in enumerate(wants):
                assert_arrays_close([logits[0, i], features[0, i]], want, f"{family} node {i} (path {path})")
        kept = block.path(0, end)
        target.keep_paths(cache, [kept], len(PARENTS))
        target.trim(cache, len(PARENTS) - len(kept))
        plain = target.make_cache()
        target.prefill(mx.array(context + [tokens[j] for j in kept]), plain)
        assert_arrays_close(cache_arrays(cache), cache_arrays(plain), f"{family} cache after the path {kept}")


def brute_force_best(probs: np.ndarray, m: int) -> list:
    """The m best-scored paths (as tuples of candidate indices) of one row's candidates, by enumeration."""
    n, k = probs.shape
    paths = [()]
    for d in range(n):
        paths += [p + (c,) for p in paths if len(p) == d for c in range(k)]
    scored = sorted(paths[1:], key=lambda p: -np.prod([probs[j, c] for j, c in enumerate(p)]))
    return scored[:m]


@pytest.mark.parametrize("seed", range(5))
def test_the_ranking_is_best_first_and_every_prefix_of_it_is_a_tree(seed):
    rng = np.random.default_rng(seed)
    B, n, k, m = 3, 4, 3, 12
    probs = rng.dirichlet(np.ones(8), size=(B, n))[:, :, :k]
    ids = np.arange(B * n * k).reshape(B, n, k)  # token = which candidate, to read paths back
    trees = grow(ids, probs, m + 1, [n] * B)
    for b in range(B):
        want = brute_force_best(probs[b], m)
        got = []
        for r in range(m):
            path, node = [], r
            while node >= 0:
                path.append(int(trees.tokens[b, node]) % k)
                assert trees.parents[b, node] < node  # a parent ranks before its children
                node = trees.parents[b, node]
            got.append(tuple(path[::-1]))
        want_scores = [np.prod([probs[b, j, c] for j, c in enumerate(p)]) for p in want]
        got_scores = [np.prod([probs[b, j, c] for j, c in enumerate(p)]) for p in got]
        np.testing.assert_allclose(got_scores, want_scores)
        assert len(set(got)) == m


def test_a_row_that_may_emit_little_gets_a_shallow_tree_whose_extra_nodes_are_dead():
    probs = np.full((2, 5, 2), 0.5)
    ids = np.arange(20).reshape(2, 5, 2)
    trees = grow(ids, probs, 9, [5, 1])
    assert trees.depth[1][trees.alive[1]].max() == 1 and trees.alive[1].sum() == 2
    assert trees.alive[0].all() and trees.depth[0].max() <= 5
    block = trees.first(9, [7, 7], [9, 9])
    assert (block.parents[:, 1:] < np.arange(1, 9)).all()  # every parent before its children


def tree_emitted(target, drafter, prompt, width, max_tokens, sampling=None, tree=True, lookup=True):
    from mlx_dflash.decoding.batch_decoder import speculative_rounds
    from mlx_dflash.decoding.sampling import SamplingParams
    from mlx_dflash.policies.width import DraftControls, make_policy

    policy = make_policy(drafter.block_size, width, controls=DraftControls(tree=tree, prompt_lookup=lookup))
    rounds = list(speculative_rounds(target, drafter, mx.array(prompt), policy, sampling or SamplingParams(),
                                     max_tokens))
    return [t for r in rounds for t in r.tokens], rounds


@pytest.mark.parametrize("family", TREE_FAMILIES)
@pytest.mark.parametrize("width", [2, 5, 16])
def test_greedy_with_trees_forced_equals_mlx_lm_on_every_family(family, width):
    from conftest import mlx_lm_greedy

    model = tiny_model(family)
    target, drafter = bound_pair(model, block_size=16)
    want = mlx_lm_greedy(model, PROMPT, 24)
    got, rounds = tree_emitted(target, drafter, PROMPT, width, 24)
    assert got == want, f"{family} at width {width}"
    assert all(r.tree for r in rounds[1:] if r.drafted)


class SecondChoice:
    """Wraps an OracleDrafter: its planted wrong token ranks first (probability 0.6) and the target's true
    token second (0.3), so a chain keeps nothing where a tree keeps the second choice."""

    def __init__(self, oracle, truth: list, prompt_len: int):
        self.oracle, self.truth, self.prompt_len = oracle, truth, prompt_len

    def __getattr__(self, name):
        return getattr(self.oracle, name)

    def draft(self, anchors, contexts, cache, block_size, width, samplings, keys=None):
        from mlx_dflash.models.base import Draft

        draft = self.oracle.draft(anchors, contexts, cache, block_size, width, samplings, keys)
        start = self.oracle.seen - self.prompt_len + 1
        true = [self.truth[i] if i < len(self.truth) else 0 for i in range(start, start + width - 1)]
        wrong = draft.ids[0].tolist()
        others = [[(t + 2) % 211, (t + 3) % 211] for t in true]
        ids = mx.array([[[w, t, *o] for w, t, o in zip(wrong, true, others)]], dtype=mx.int32)
        probs = mx.broadcast_to(mx.array([0.6, 0.3, 0.05, 0.05]), ids.shape)
        return Draft(draft.ids, mx.full(draft.ids.shape, 0.6), candidates=(ids, probs))


def test_a_tree_keeps_the_true_token_the_drafter_ranked_second_where_a_chain_keeps_nothing():
    from conftest import mlx_lm_greedy
    from oracles import OracleDrafter

    model = tiny_model("llama")
    target, real = bound_pair(model)
    want = mlx_lm_greedy(model, PROMPT, 20)
    every = set(range(40))  # the oracle's first choice is wrong everywhere
    chain_drafter = SecondChoice(OracleDrafter(real.config, len(PROMPT), want, every).bind(target), want, len(PROMPT))
    got, rounds = tree_emitted(target, chain_drafter, PROMPT, 4, 20, tree=False, lookup=False)
    assert got == want and all(r.accepted == 0 for r in rounds[1:])
    tree_drafter = SecondChoice(OracleDrafter(real.config, len(PROMPT), want, every).bind(target), want, len(PROMPT))
    got, rounds = tree_emitted(target, tree_drafter, PROMPT, 4, 20, lookup=False)
    # 3 nodes past the anchor: the two best depth-1 candidates (0.6, 0.3) and the first's first child (0.36): the
    # true token at depth 1 is kept every round, no deeper (the last rounds, with fewer tokens left, verify fewer)
    full = [r for r in rounds if r.drafted == 3]
    assert got == want and len(full) >= 6 and all(r.accepted == 1 and r.tree for r in full)


def test_ranks_in_lockstep_verify_rank0s_trees():
    """A sharded run's round (`Ranks`: in lockstep, every agreement a real all_sum, here over a group of this one
    process): each round's trees come from rank 0 and its walk's end is settled, and decoding keeps the target's
    greedy output with nodes kept off the tree's first path. Two ranks: tests/test_distributed.py (slow tier)."""
    from conftest import mlx_lm_greedy
    from oracles import OracleDrafter
    from mlx_dflash.decoding.batch_decoder import Request, Scheduler
    from mlx_dflash.distributed import Ranks
    from mlx_dflash.policies.width import DraftControls, make_policy

    model = tiny_model("llama")
    target, real = bound_pair(model)
    want = mlx_lm_greedy(model, PROMPT, 20)
    drafter = SecondChoice(OracleDrafter(real.config, len(PROMPT), want, set(range(40))).bind(target), want,
                           len(PROMPT))
    policy = make_policy(real.block_size, 4, controls=DraftControls(tree=True, prompt_lookup=False))
    ranks = Ranks(mx.distributed.init(), policy.block_size, False)
    rounds = list(Scheduler(target, drafter, policy, 1, ranks=ranks).alone(Request(0, PROMPT, 20)))
    assert [t for r in rounds for t in r.tokens] == want
    assert sum(r.tree and r.accepted == 1 for r in rounds) >= 6 and ranks.exchanges >= 4 * len(rounds[1:])


@pytest.fixture(scope="module")
def chat_pairs(tiny_chat_pair):
    from test_batch import bound
    from tiny_families import tiny_chat_target

    llama, tokenizer, drafter = tiny_chat_pair
    kv8 = tiny_chat_target("llama", llama.vocab_size, seed=5, num_hidden_layers=4, hidden_size=128,
                           tie_word_embeddings=True)
    kv8.quantize_kv(8, group_size=32, start=16)
    hybrid = tiny_chat_target("qwen3_5", llama.vocab_size, seed=3)  # each row's recurrent state rewound to its path
    return {"dense": (llama, drafter, tokenizer), "kv8": (kv8, bound(kv8), tokenizer),
            "hybrid": (hybrid, bound(hybrid), tokenizer)}


LIMITS = [20, 7, 15, 3, 12]


@pytest.mark.parametrize("name", ["dense", "hybrid", pytest.param("kv8", marks=pytest.mark.slow)])
def test_batched_trees_give_each_request_its_single_output(chat_pairs, name):
    """Each row its own tree in one padded forward, rows of their own lengths, rows leaving: every request's
    greedy tokens are those of a chain alone (the target's own), trees forced at widths 3 and 8, and D-cut's."""
    from conftest import PROMPTS, chat_ids
    from mlx_dflash.decoding.batch_decoder import batch_generate
    from mlx_dflash.generate import generate

    target, drafter, tokenizer = chat_pairs[name]
    ids = [chat_ids(tokenizer, p) for p in PROMPTS[: len(LIMITS)]]
    want = [generate(target, drafter, tokenizer, p, max_tokens=n, width=4, tree=False).tokens
            for p, n in zip(ids, LIMITS)]
    for width in (3, 8, "auto"):
        got = batch_generate(target, drafter, tokenizer, ids, max_tokens=LIMITS, max_batch=3, width=width, tree=True)
        assert got.token_ids == want, (name, width)
        # forced widths verify trees; D-cut picks them by measured costs, which this machine's noise may not favour
        assert (width == "auto" or sum(s.tree_rounds for s in got.stats) > 0) and max(got.batch.rows) == 3
    alone = [generate(target, drafter, tokenizer, p, max_tokens=n, width=8, tree=True) for p, n in zip(ids, LIMITS)]
    assert [a.tokens for a in alone] == want and all(a.stats.tree_rounds > 0 for a in alone)


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_a_prefix_cache_state_left_by_tree_rounds_continues_exactly(chat_pairs, name):
    """A second turn starts from the state the first turn's tree rounds left (its kept paths' keys, a hybrid's
    recurrent states, the drafter's context): its tokens are those of a fresh run."""
    from conftest import chat_ids
    from mlx_dflash.decoding.prompt_cache import PromptCache
    from mlx_dflash.generate import generate

    target, drafter, tokenizer = chat_pairs[name]
    first = chat_ids(tokenizer, "Tell me a short story about a lighthouse keeper.")
    cache = PromptCache("tiny", target.trimmable)
    turn = generate(target, drafter, tokenizer, first, max_tokens=16, width=8, tree=True, prompt_cache=cache)
    follow = first + turn.tokens + chat_ids(tokenizer, "And then?")[1:]
    again = generate(target, drafter, tokenizer, follow, max_tokens=16, width=8, tree=True, prompt_cache=cache)
    fresh = generate(target, drafter, tokenizer, follow, max_tokens=16, width=4, tree=False)
    assert again.stats.cached_tokens > len(first) and again.tokens == fresh.tokens


def test_a_sampled_walk_emits_each_token_as_the_target_draws_it():
    """Sample then match, at a fixed tree and fixed logits: the first token emitted is distributed as the root's
    distribution, and the token after a kept child as that child's (chi-square). Every draw that lands on a
    child's token moves to that child: the walk goes on with the target's probability of the children, the
    most an exact scheme can (docs/architecture.md, Sampling)."""
    from conftest import assert_distributed_as
    from mlx_dflash.decoding.sampling import SamplingParams, target_probs
    from mlx_dflash.decoding.tree import accept_trees

    mx.random.seed(0)
    V, params = 6, SamplingParams(1.0)
    block = block_of([-1, 0, 0, 1, 2], [0, 1, 2, 3, 4])  # children of the root hold tokens 1 and 2
    logits = mx.random.normal((1, 5, V)) * 1.5
    firsts, after_one = [], []
    for trial in range(1500):
        last, bonus = accept_trees(block, logits, [params], [mx.random.key(trial)])
        path = block.path(0, last.item())
        emitted = [int(block.tokens[0, i]) for i in path[1:]] + [bonus.item()]
        firsts.append(emitted[0])
        assert (len(path) > 1) == (emitted[0] in (1, 2)), (trial, path, emitted)
        if emitted[0] == 1 and len(emitted) > 1:
            after_one.append(emitted[1])
    assert_distributed_as(firsts, target_probs(logits[0, 0], params))
    assert_distributed_as(after_one, target_probs(logits[0, 1], params))


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_a_seeded_row_with_trees_samples_the_same_alone_and_batched(chat_pairs, name):
    from conftest import chat_ids
    from test_batch import scheduled
    from mlx_dflash.decoding.batch_decoder import Request
    from mlx_dflash.decoding.sampling import SamplingParams
    from mlx_dflash.policies.dcut import build_policy
    from mlx_dflash.policies.width import WidthOptions

    target, drafter, tokenizer = chat_pairs[name]
    ids = [chat_ids(tokenizer, p) for p in ("Write a haiku about autumn rain.", "List five fruits that are red.")]
    policy = build_policy(target, drafter, WidthOptions(4, tree=True), 2)

    def run(requests):
        return scheduled(target, drafter, tokenizer, policy, 2, requests)

    sampled = Request("s", ids[0], 12, SamplingParams(0.9, top_k=20), seed=11)
    alone = run([sampled])["s"]
    assert alone == run([Request("g", ids[1], 12), sampled])["s"]


def test_dcut_costs_a_tree_by_its_nodes_reach_and_learns_from_every_node_judged():
    """cut_tree picks the node count with the best expected tokens per second, a node expected as the product
    of its path's calibrated acceptances; a tree round's verdict trains the calibration of each node judged."""
    from mlx_dflash.decoding.tree import TreeVerdict
    from mlx_dflash.policies.dcut import DCutPolicy

    costs = {1: {w: 0.01 + 0.001 * w for w in range(1, 9)}}
    policy = DCutPolicy(8, 8, costs)
    probs = np.array([[[0.9, 0.05, 0.03, 0.02], [0.5, 0.3, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1]] + [[0.25] * 4] * 4])
    ids = np.arange(probs.size).reshape(probs.shape)
    trees = grow(ids, probs, 8, [7])
    width, tree = policy.cut_tree(8, trees, [list(probs[0, :, 0])], [0], [50])
    rates = {w: policy.tree_expected[w] / policy.cost(1, w) for w in range(1, 9)}
    assert tree and width == max(rates, key=rates.get)
    # by hand: the best three nodes are 0.9, 0.45 (0.9 x 0.5) and 0.27 (0.9 x 0.3)
    assert policy.tree_expected[4] == pytest.approx(1 + 0.9 + 0.45 + 0.27)
    block = trees.first(4, [0], [4])
    reached = np.array([[True, True, False, False]])  # the 0.9 node kept, its two children judged and refused
    before = policy.calibration.trials.sum()
    verdict = TreeVerdict(block.probs, block.depth, block.copied, np.array([[False, True, True, True]]), reached)
    policy.observe(RoundSeen([list(probs[0, :, 0])], [3], [1], 4, 0.001, 0.028, [0], verdict))
    assert policy.calibration.trials.sum() == before + 3 and policy.calibration.hits.sum() == 1
    # the tree took twice the 4-row cell's 0.014 s: the ratio moves from 1 towards 2, and the cell keeps a chain's time
    assert policy.tree_cost(4) == pytest.approx(0.8 + 0.2 * 2) and policy.costs[1][4] == pytest.approx(0.028 / 1.2)
    assert policy.tree_cost(8) == policy.tree_cost(4) and policy.tree_cost(3) == 1.0  # untimed: from fewer nodes


def test_dcut_verifies_a_chain_where_trees_cost_more_than_they_gain():
    from mlx_dflash.policies.dcut import DCutPolicy

    policy = DCutPolicy(8, 8, {1: {w: 0.01 + 0.001 * w for w in range(1, 9)}})
    probs = np.array([[[0.55, 0.4, 0.03, 0.02]] * 7])  # a second choice nearly as likely: trees gain
    trees = grow(np.arange(28).reshape(1, 7, 4), probs, 8, [7])
    assert policy.cut_tree(8, trees, [[0.55] * 7], [0], [50])[1]
    policy.tree_costs = {2: 2.0}  # trees' verifies have cost twice a chain's
    assert not policy.cut_tree(8, trees, [[0.55] * 7], [0], [50])[1]


def test_dcut_keeps_trees_to_the_sizes_whose_verifies_it_timed_cheap():
    """A hybrid target's trees cost more the more nodes they have (its recurrent layers run their paths): D-cut
    times each size on its own, so a dear 8-node tree does not make a 4-node one look dear, nor the reverse."""
    from mlx_dflash.policies.dcut import DCutPolicy

    policy = DCutPolicy(8, 8, {1: {w: 0.01 + 0.001 * w for w in range(1, 9)}})
    probs = np.array([[[0.55, 0.4, 0.03, 0.02]] * 7])
    trees = grow(np.arange(28).reshape(1, 7, 4), probs, 8, [7])
    policy.tree_costs = {4: 1.0, 5: 3.0}  # cheap up to 4 nodes, three times a chain's from 5
    width, tree = policy.cut_tree(8, trees, [[0.55] * 7], [0], [50])
    assert tree and width <= 4


def test_generate_tree_flags_say_how_many_rounds_verified_a_tree(tiny_pair_dirs):
    from click.testing import CliRunner
    from mlx_dflash.cli import main

    target, drafter = tiny_pair_dirs
    args = ["generate", "--model", str(target), "--drafter", str(drafter), "--prompt", "hi", "--max-tokens", "12"]
    texts = {}
    for flag in ("--tree", "--no-tree"):
        result = CliRunner().invoke(main, [*args, "--width", "6", flag])
        assert result.exit_code == 0, result.output
        trees = int(result.stderr.split("; trees in ")[1].split(";")[0])
        assert (trees > 0) if flag == "--tree" else (trees == 0)
        texts[flag] = result.stdout
    assert texts["--tree"] == texts["--no-tree"]


def test_prompt_lookups_copy_is_a_branch_beside_the_drafters_candidates():
    """Row 0 copies [7, 8, 9]: the copy runs as one branch (its token at depth 2 follows only its own), beside
    the drafter's candidates; where the drafter proposes the copy's token under the same parent (row 1: 5 at
    depth 1), the copy takes that node, never a twin."""
    ids = np.array([[[1, 2], [3, 4], [5, 6]], [[5, 2], [3, 4], [5, 6]]])
    probs = np.array([[[0.45, 0.3], [0.6, 0.3], [0.6, 0.3]]] * 2)
    trees = grow(ids, probs, 9, [3, 3], [[[7, 8, 9]], [[5, 8]]])
    for b in range(2):
        nodes = {}
        for r in range(8):
            path, node = [], r
            while node >= 0:
                path.append(int(trees.tokens[b, node]))
                node = trees.parents[b, node]
            nodes[tuple(path[::-1])] = bool(trees.copied[b, r])
        assert len(nodes) == 8  # no twin paths
        if b == 0:
            assert nodes[(7,)] and nodes[(7, 8)] and (1,) in nodes and (2,) in nodes
            assert not any(p[1:2] == (8,) and p[0] != 7 for p in nodes)  # 8 follows the copy's 7 only
        else:
            assert nodes[(5,)] and nodes[(5, 8)] and (2,) in nodes


def test_the_copies_of_several_occurrences_are_branches_beside_the_drafters_candidates():
    """Three earlier occurrences copied [7, 8, 9], [7, 3] and [2, 6] (the latest first): one trie beside the
    drafter's candidates. The copies' 7 is one node (never a twin), holding both 8 and 3 under it; the drafter's 2
    at depth 1 is the third copy's node, and 6 follows it; only the latest copy's nodes are lookup's (`copied`),
    the others judged by their share of the copies or the drafter's probability where that is higher (3 under 7: a
    half of the copies, 0.6 drafted; 2: a third, 0.4 drafted)."""
    ids = np.array([[[1, 2], [3, 4], [5, 6]]])
    probs = np.array([[[0.45, 0.4], [0.6, 0.3], [0.6, 0.3]]])
    trees = grow(ids, probs, 16, [3], [[[7, 8, 9], [7, 3], [2, 6]]])
    nodes = {}
    for r in range(15):
        path, node = [], r
        while node >= 0:
            path.append(int(trees.tokens[0, node]))
            node = trees.parents[0, node]
        nodes[tuple(path[::-1])] = (bool(trees.copied[0, r]), float(trees.probs[0, r]))
    assert len(nodes) == 15  # no twin paths
    assert nodes[(7,)][0] and nodes[(7, 8)][0] and nodes[(7, 8, 9)][0]  # the latest copy: lookup's
    assert nodes[(7, 3)] == (False, 0.6) and nodes[(2,)] == (False, 0.4) and (2, 6) in nodes
    assert not any(p[:1] == (1,) and p[1:2] == (8,) for p in nodes)  # 8 follows the copies' 7 only
    assert grow(ids, probs, 16, [3], [[[7, 8, 9], [7, 3]]]).tokens.shape == (1, 15)


def test_chains_unless_trees_are_asked_for(chat_pairs):
    """The default (width auto) and a fixed width verify chains; `tree=True` trees (D-cut's choice between the two
    under auto: test_dcut_*)."""
    from conftest import chat_ids
    from mlx_dflash.generate import generate

    target, drafter, tokenizer = chat_pairs["dense"]
    ids = chat_ids(tokenizer, "Janet has 3 apples and buys 5 more. She eats 2. How many are left?")
    runs = [generate(target, drafter, tokenizer, ids, max_tokens=24, **kw) for kw in ({}, {"width": 4},
                                                                                      {"width": 4, "tree": True})]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens
    assert [r.stats.tree_rounds > 0 for r in runs] == [False, False, True]


def test_the_principal_path_comes_first_so_keeping_a_prefix_of_it_moves_nothing():
    probs = np.array([[[0.5, 0.4], [0.6, 0.3], [0.7, 0.2]]])
    trees = grow(np.arange(6).reshape(1, 3, 2), probs, 7, [3])
    block = trees.first(7, [9], [7])
    assert list(block.parents[0, :4]) == [-1, 0, 1, 2]  # anchor, then the best child of each in turn
    assert list(block.tokens[0, 1:4]) == [0, 2, 4]
    assert (block.parents[0, 1:] < np.arange(1, 7)).all()


def test_a_tree_that_is_one_path_verifies_as_a_chain():
    """A tree of 2 nodes is always one path (the anchor and the top-1 draft): its round runs the chain's forward,
    without per-node positions or a tree mask, and emits what a tree forward would."""
    from conftest import mlx_lm_greedy

    model = tiny_model("llama")
    target, drafter = bound_pair(model, block_size=16)
    trees_seen = []
    forward = target.forward

    def spy(ids, cache, tree=None):
        trees_seen.append(tree is not None)
        return forward(ids, cache, tree)

    target.forward = spy
    got, rounds = tree_emitted(target, drafter, PROMPT, 2, 16)
    assert got == mlx_lm_greedy(model, PROMPT, 16)
    assert any(r.tree for r in rounds) and not any(trees_seen)
    trees_seen.clear()
    tree_emitted(target, drafter, PROMPT, 8, 16)
    assert any(trees_seen)  # wider trees branch


@pytest.mark.parametrize("seed", range(5))
def test_a_hybrids_paths_are_the_alive_leaves_and_each_node_reads_a_path_through_it(seed):
    """tree_verify.leaf_paths, which a hybrid's recurrent layers run: one path per alive leaf (a dead node never
    adds one), and each alive node's output comes from a path whose steps up to it are the node's own path."""
    from mlx_dflash.models.tree_verify import leaf_paths

    rng = np.random.default_rng(seed)
    B, n = 3, 6
    probs = -np.sort(-rng.dirichlet(np.ones(4), size=(B, n)), axis=2)
    trees = grow(np.arange(B * n * 4).reshape(B, n, 4), probs, 12, [n] * B)
    block = trees.first(12, [0] * B, [12, int(rng.integers(1, 6)), int(rng.integers(6, 12))])
    paths = leaf_paths(block.depth, block.ancestors, block.alive)
    leaves = [[i for i in range(12) if block.alive[b, i]
               and not any(block.alive[b, j] and block.ancestors[b, j, i] for j in range(12) if j != i)]
              for b in range(B)]
    assert paths.nodes.shape[1] == max(map(len, leaves))
    for b in range(B):
        assert {int(paths.nodes[b, p, block.depth[b, leaf]]) for p, leaf in enumerate(leaves[b])} == set(leaves[b])
        for i in np.flatnonzero(block.alive[b]):
            along = paths.nodes[b, paths.path[b, i], : paths.step[b, i] + 1].tolist()
            assert along == block.path(b, int(i)), (b, i)


def test_a_one_path_tree_round_teaches_dcut_a_chains_cost():
    """A round whose tree was one path ran as a chain (decoder.verify_trees): D-cut leaves the trees' cost ratio
    alone and keeps the round's time in the chain's cell as it was timed."""
    from mlx_dflash.decoding.tree import TreeVerdict
    from mlx_dflash.policies.dcut import DCutPolicy

    policy = DCutPolicy(8, 8, {1: {w: 0.01 + 0.001 * w for w in range(1, 9)}})
    probs = np.array([[[0.95, 0.02, 0.02, 0.01]] * 3])  # the best 3 nodes are the top-1 path
    trees = grow(np.arange(12).reshape(1, 3, 4), probs, 4, [3])
    policy.cut_tree(4, trees, [[0.95] * 3], [0], [50])
    policy.tree_costs = {2: 5.0}  # branched trees were dear
    block = trees.first(4, [0], [4])
    assert block.one_path
    verdict = TreeVerdict(block.probs, block.depth, block.copied, np.array([[False, True, True, True]]),
                          np.array([[True, True, True, True]]), branched=False)
    policy.observe(RoundSeen([[0.95] * 3], [3], [3], 4, 0.001, 0.014, [0], verdict))
    assert policy.tree_costs == {2: 5.0} and policy.costs[1][4] == pytest.approx(0.014)
