"""Prompt lookup: its proposals, how it joins the drafter's draft, and decoding with it stays lossless."""

import random

import mlx.core as mx
import numpy as np
import pytest

from conftest import PROMPTS, WORD_PROBLEMS, chat_ids, mlx_lm_greedy
from oracles import observe_one
from mlx_dflash.decoding.batch_decoder import speculative_rounds
from mlx_dflash.models.base import Draft
from mlx_dflash.models.loader import drafter_from_dir
from mlx_dflash.downloads import shipped_drafter_dir
from mlx_dflash.decoding.lookup import PromptLookup, with_lookup
from mlx_dflash.policies.dcut import DCutPolicy
from mlx_dflash.policies.verify_costs import interpolate_costs
from mlx_dflash.policies.width import DraftControls, make_policy
from mlx_dflash.tuner.replay import decoding_acceptance, looked_up_acceptance
from mlx_dflash.decoding.sampling import SamplingParams
from mlx_dflash.models.target import Target


def scanned_proposal(history: list, k: int, longest: int = 3) -> list:
    """The rule written as a plain scan: what followed the latest earlier occurrence of the longest
    suffix (n <= longest) of the history."""
    last = len(history) - 1
    for n in range(min(longest, last), 0, -1):
        tail = history[last - n + 1 :]
        for end in range(last - 1, n - 2, -1):
            if history[end - n + 1 : end + 1] == tail:
                return history[end + 1 : min(end + 1 + k, last + 1)]
    return []


@pytest.mark.parametrize("seed", range(5))
def test_indexed_proposals_equal_a_scan_of_the_history(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(300)]  # a small vocabulary: many repeats
    lookup = PromptLookup(tokens[:1])
    for i in range(1, len(tokens)):
        for k in (1, 3, 15):
            assert lookup.propose(k) == scanned_proposal(tokens[:i], k), (i, k)
        lookup.extend(tokens[i : i + 1])


def test_nothing_is_proposed_without_an_earlier_occurrence():
    assert PromptLookup([1, 2, 3]).propose(4) == []
    assert PromptLookup([7]).propose(4) == []
    assert PromptLookup([1, 2, 1]).propose(4) == [2, 1]  # only tokens the history holds


def draft_of(ids, confidence):
    """A draft of one row."""
    return Draft(mx.array([ids], dtype=mx.int32), mx.array([confidence], dtype=mx.float32))


def test_lookup_replaces_the_leading_drafts_only_where_the_drafter_is_unsure():
    unsure = with_lookup(draft_of([5, 6, 7, 8], [0.3, 0.9, 0.9, 0.9]), [[1, 2]])
    assert unsure.ids.tolist() == [[1, 2, 7, 8]] and unsure.looked_up.tolist() == [2]
    assert np.allclose(unsure.confidence.tolist(), [[1, 1, 0.9, 0.9]])
    sure = with_lookup(draft_of([5, 6, 7, 8], [0.7, 0.2, 0.2, 0.2]), [[1, 2]])
    assert sure.ids.tolist() == [[5, 6, 7, 8]] and sure.looked_up.tolist() == [0]
    longer = with_lookup(draft_of([5, 6], [0.1, 0.1]), [[1, 2, 3, 4]])
    assert longer.ids.tolist() == [[1, 2]] and longer.looked_up.tolist() == [2]
    nothing = draft_of([5, 6], [0.1, 0.1])
    assert with_lookup(nothing, [[]]) is nothing and nothing.looked_up is None
    # Drafts sampled over candidate sets carry their q, which a copied token would not match.
    sampled = Draft(nothing.ids, nothing.confidence, proposal=(mx.zeros((1, 2, 4)), mx.zeros((1, 2, 4))))
    assert with_lookup(sampled, [[1, 2]]) is sampled


def test_each_row_looks_up_its_own_context():
    """Rows of a batch: each is replaced by its own copy, and only where its own first draft is unsure."""
    rows = Draft(mx.array([[5, 6, 7], [8, 9, 10], [11, 12, 13]], dtype=mx.int32),
                 mx.array([[0.3, 0.9, 0.9], [0.9, 0.9, 0.9], [0.1, 0.1, 0.1]]))
    got = with_lookup(rows, [[1, 2], [3, 4], []])
    assert got.ids.tolist() == [[1, 2, 7], [8, 9, 10], [11, 12, 13]] and got.looked_up.tolist() == [2, 0, 0]


@pytest.fixture(scope="module")
def pair(smollm2):
    target = Target(smollm2[0].model)
    return target, drafter_from_dir(shipped_drafter_dir()).bind(target), smollm2[1]


@pytest.fixture(scope="module")
def greedy(pair):
    """The target's own greedy continuation of a prompt, computed once per prompt."""
    target, _, tokenizer = pair
    memo = {}

    def of(prompt: str, max_tokens: int):
        if (prompt, max_tokens) not in memo:
            ids = chat_ids(tokenizer, prompt)
            memo[prompt, max_tokens] = ids, mlx_lm_greedy(target.model, ids, max_tokens)
        return memo[prompt, max_tokens]
    return of


POLICIES = {
    "width 2": lambda d: make_policy(d.block_size, 2),
    "width 4": lambda d: make_policy(d.block_size, 4),
    "width 8": lambda d: make_policy(d.block_size, 8),
    "width 16": lambda d: make_policy(d.block_size, 16),
    "p-min 0.6": lambda d: make_policy(d.block_size, 16, controls=DraftControls(p_min=0.6)),
    "auto": lambda d: DCutPolicy(d.block_size, d.block_size,
                                 {1: interpolate_costs({1: 0.08, 4: 0.11, 16: 0.16}, d.block_size)}),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_decoding_with_lookup_is_lossless_and_uses_it(pair, greedy, name):
    target, drafter, tokenizer = pair
    looked_up = 0
    for prompt in WORD_PROBLEMS[:3] + PROMPTS[:2]:
        ids, want = greedy(prompt, 40)
        policy = POLICIES[name](drafter)
        rounds = list(speculative_rounds(target, drafter, mx.array(ids), policy, SamplingParams(), 40))
        assert [t for r in rounds for t in r.tokens] == want, (name, prompt)
        looked_up += sum(r.looked_up > 0 for r in rounds)
    assert looked_up > 0  # the looked-up path really ran


def test_sampling_with_lookup_keeps_the_target_distribution(pair, greedy):
    """top-k 1 makes the target's distribution a point mass on its argmax: rejection sampling with
    looked-up drafts must then give exactly the greedy output."""
    target, drafter, tokenizer = pair
    sampling = SamplingParams(temperature=1.0, top_k=1)
    for prompt in WORD_PROBLEMS[:2]:
        ids, want = greedy(prompt, 40)
        rounds = list(speculative_rounds(target, drafter, mx.array(ids), make_policy(drafter.block_size, 8),
                                         sampling, 40))
        assert [t for r in rounds for t in r.tokens] == want
        assert any(r.looked_up for r in rounds)


def test_lookup_off_drafts_only_from_the_drafter(pair, greedy):
    target, drafter, tokenizer = pair
    ids, want = greedy(WORD_PROBLEMS[0], 40)
    policy = make_policy(drafter.block_size, 8, controls=DraftControls(prompt_lookup=False))
    rounds = list(speculative_rounds(target, drafter, mx.array(ids), policy, SamplingParams(), 40))
    assert [t for r in rounds for t in r.tokens] == want
    assert not any(r.looked_up for r in rounds)


def test_replayed_acceptance_with_lookup_equals_decoding(pair, greedy):
    target, drafter, tokenizer = pair
    for prompt in WORD_PROBLEMS[1:3]:
        ids, response = greedy(prompt, 40)
        sequence = ids + response
        rounds = list(speculative_rounds(target, drafter, mx.array(ids), make_policy(drafter.block_size, 8),
                                         SamplingParams(), 40))
        decoded_tau = np.mean([len(r.tokens) for r in rounds[1:]])
        replay = decoding_acceptance(drafter, target, [(sequence, len(ids))], (8,), prompt_lookup=True)[8]
        assert replay["tau"] == pytest.approx(decoded_tau), prompt
        alone = decoding_acceptance(drafter, target, [(sequence, len(ids))], (8,))[8]
        assert replay["rounds"] != alone["rounds"]  # lookup changed some rounds
        rates = looked_up_acceptance(drafter, target, [(sequence, len(ids))])
        kept, judged = np.array(rates["kept"]), np.array(rates["judged"])
        assert judged[0] > 0 and (kept <= judged).all()
        assert (judged[1:] <= kept[:-1]).all()  # a draft is judged only once the one before it was kept


def test_auto_learns_looked_up_acceptance_apart_from_the_drafters_by_how_long_the_copy_has_run():
    policy = DCutPolicy(16, 16, {1: interpolate_costs({1: 0.1, 16: 0.2}, 16)})
    calibration = policy.calibration
    before = calibration.calibrated(0.99)
    assert calibration.expected_tokens([1.0] * 3, 4, looked_up=3) < 2.2  # the prior: 1 + 0.5 + 0.35 + 0.26
    for _ in range(50):
        # a fresh copy (run 1): its first token kept, its second (run 2) rejected
        observe_one(policy, [1.0, 1.0, 1.0, 0.4], drafted=4, accepted=1, draft_seconds=0.01, verify_seconds=0.1,
                    looked_up=3, run=1)
        # a copy under way (run 8): all three kept (runs 8, 9, 10)
        observe_one(policy, [1.0, 1.0, 1.0, 0.4], drafted=4, accepted=3, draft_seconds=0.01, verify_seconds=0.1,
                    looked_up=3, run=8)
    assert calibration.calibrated(0.99) == before  # the drafter's calibration is untouched
    got = calibration.copied_acceptance([1, 2, 3, 8, 15])
    assert got[0] > 0.9 and got[1] < 0.1 and got[2] < 0.1 and got[3] > 0.9 and got[4] > 0.9
    assert calibration.expected_tokens([1.0] * 3, 4, looked_up=3, run=8) > 3.6
    assert calibration.expected_tokens([1.0] * 3, 4, looked_up=3, run=1) < 2.1
    # a longer run never judged starts from the judged shorter runs' estimate, not from the prior
    assert calibration.copied_acceptance(40) > 0.9


def test_a_copys_run_counts_the_tokens_matching_its_source():
    lookup = PromptLookup([5, 1, 2, 3, 4, 9, 1, 2, 3])
    assert lookup.propose(3) == [4, 9, 1] and lookup.run == 3  # 1 2 3 matched (3-gram), and 5 != 9 before
    lookup = PromptLookup([7, 8, 1, 2, 3, 4, 0, 7, 8, 1, 2, 3])
    assert lookup.propose(2) == [4, 0] and lookup.run == 5  # the 3-gram's match reaches back over 7 8
    assert PromptLookup([1, 2, 3]).propose(2) == [] and PromptLookup([1, 2, 3]).run == 0


