"""Draft-length controls (n-max, p-min, n-min) and `--width auto` (D-cut) for one request: exact cuts, best
depths, lossless."""

import itertools

import mlx.core as mx
import pytest

from conftest import PROMPTS, chat_ids, mlx_lm_greedy
from oracles import cut_one, observe_one
from mlx_dflash.decoding.batch_decoder import speculative_rounds
from mlx_dflash.errors import DFlashError
from mlx_dflash.policies.dcut import DCutPolicy
from mlx_dflash.policies.width import DraftControls, make_policy
from mlx_dflash.policies.verify_costs import interpolate_costs
from mlx_dflash.decoding.sampling import SamplingParams, next_token


def test_p_min_cuts_before_the_first_low_confidence_position():
    policy = make_policy(16, 8, controls=DraftControls(p_min=0.5))
    confidence = [0.9, 0.8, 0.45, 0.99, 0.99, 0.99, 0.99]
    assert cut_one(policy, 8, confidence) == 3  # drafts 1-2 survive; 3 is below 0.5
    assert cut_one(policy, 8, [0.9] * 7) == 8
    assert cut_one(policy, 8, [0.1] * 7) == 1
    assert cut_one(policy, 3, confidence) == 3  # the width bound comes first


def test_n_min_verifies_nothing_when_too_few_drafts_survive():
    policy = make_policy(16, 8, controls=DraftControls(p_min=0.5, n_min=3))
    assert cut_one(policy, 8, [0.9, 0.8, 0.45, 0.9, 0.9, 0.9, 0.9]) == 1  # 2 survive < 3
    assert cut_one(policy, 8, [0.9, 0.8, 0.7, 0.45, 0.9, 0.9, 0.9]) == 4  # 3 survive
    assert cut_one(make_policy(16, 8, controls=DraftControls(n_min=8)), 8, [1.0] * 7) == 1  # 7 possible drafts < 8


@pytest.mark.parametrize("kwargs", [dict(p_min=1.0), dict(p_min=-0.1), dict(n_min=16), dict(n_min=-1)])
def test_bad_controls_are_refused(kwargs):
    with pytest.raises(DFlashError, match="p_min must be in|n_min must be"):
        make_policy(16, controls=DraftControls(**kwargs))


def brute_force_best(confidence, cost, draft_seconds, max_width):
    """The analytically best width: enumerate every width, expected tokens over cost."""
    def expected(w):
        return 1 + sum(
            float(mx.prod(mx.array(confidence[:k])).item()) for k in range(1, w)
        )
    return max(range(1, max_width + 1), key=lambda w: expected(w) / (draft_seconds + cost[w]))


@pytest.mark.parametrize("profile, table", list(itertools.product(
    ["confident", "falling", "cliff", "uncertain"], ["linear", "metal_cliff", "flat"])))
def test_auto_width_picks_the_analytically_best_depth(profile, table):
    confidence = {
        "confident": [0.97] * 15,
        "falling": [0.95 - 0.06 * k for k in range(15)],
        "cliff": [0.99] * 4 + [0.05] * 11,
        "uncertain": [0.3] * 15,
    }[profile]
    cost = {
        "linear": {w: 0.10 + 0.01 * w for w in range(1, 17)},  # a CPU: cost grows with every row
        "metal_cliff": {w: 0.02 if w <= 5 else 0.045 for w in range(1, 17)},  # the quantized cliff at 6
        "flat": {w: 0.05 for w in range(1, 17)},
    }[table]
    policy = DCutPolicy(16, 16, {1: cost})
    policy.draft_seconds = 0.01
    # No observations yet: calibration returns the raw probabilities.
    want = brute_force_best(confidence, cost, 0.01, 16)
    assert cut_one(policy, 16, confidence) == want


def test_auto_width_calibrates_on_observed_acceptance():
    """A drafter that claims 0.95 but is accepted a fifth of the time gets its confidence corrected."""
    cost = {w: 0.10 + 0.01 * w for w in range(1, 17)}
    policy = DCutPolicy(16, 16, {1: cost})
    policy.draft_seconds = 0.01
    confidence = [0.95] * 15
    assert cut_one(policy, 16, confidence) > 8
    for round_ in range(200):  # verify 4 drafts; the first is accepted one round in five
        observe_one(policy, confidence, drafted=4, accepted=1 if round_ % 5 == 0 else 0,
                       draft_seconds=0.01, verify_seconds=cost[5])
    assert abs(policy.calibration.calibrated(0.95) - 0.2) < 0.05
    assert cut_one(policy, 16, confidence) <= 2


def test_cost_tables_interpolate_and_extend():
    full = interpolate_costs({1: 1.0, 4: 4.0, 8: 6.0}, 10)
    assert [full[w] for w in (1, 2, 4, 6, 8, 10)] == pytest.approx([1.0, 2.0, 4.0, 5.0, 6.0, 7.0])
    with pytest.raises(DFlashError):
        interpolate_costs({}, 4)


CONTROLS = {
    "n_max_3": lambda d: make_policy(d.block_size, 4),
    "p_min_0.3": lambda d: make_policy(d.block_size, controls=DraftControls(p_min=0.3)),
    "p_min_0.9_n_min_2": lambda d: make_policy(d.block_size, controls=DraftControls(p_min=0.9, n_min=2)),
    "auto": lambda d: DCutPolicy(d.block_size, d.block_size, {1: interpolate_costs({1: 0.1, 16: 0.25}, d.block_size)}),
}


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_every_control_stays_lossless_on_the_real_model(smollm2, random_drafter, control):
    target, tokenizer = smollm2
    for prompt in PROMPTS[:3]:
        ids = chat_ids(tokenizer, prompt)
        want = mlx_lm_greedy(target.model, ids, 16)
        policy = CONTROLS[control](random_drafter)
        rounds = list(speculative_rounds(target, random_drafter, mx.array(ids), policy, SamplingParams(), 16))
        assert [t for r in rounds for t in r.tokens] == want, (control, prompt)


def test_plain_steps_equal_rounds_of_width_one(tiny_chat_pair):
    """The pipelined plain steps give the tokens, features and cache of one-row verify rounds."""
    from mlx_dflash.decoding.decoder import DecodeState, Row, plain_rounds
    from mlx_dflash.decoding.lookup import PromptLookup

    target, tokenizer, drafter = tiny_chat_pair
    ids = chat_ids(tokenizer, "Say hello.")
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8)):
        results = []
        for pipelined in (True, False):
            mx.random.seed(5)
            cache = target.make_cache()
            logits, _ = target.prefill(mx.array(ids), cache)
            anchor, tokens, features = 11, [], []
            if pipelined:
                row = Row(DecodeState(cache, []), anchor, sampling, 12, PromptLookup(ids + [anchor]))
                for (rnd,) in plain_rounds(target, cache, [row], 12, keep_features=True):
                    tokens += rnd.tokens
                assert row.remaining == 0 and row.anchor == tokens[-1] and row.state.tokens == [anchor] + tokens[:-1]
                features = [row.state.context]
            else:
                for _ in range(12):
                    logits, f = target.forward(mx.array([[anchor]]), cache)
                    anchor = next_token(logits[0, -1], sampling).item()
                    tokens.append(anchor)
                    features.append(f)
            results.append((tokens, mx.concatenate(features, axis=1), cache[0].offset))
        (t1, f1, o1), (t2, f2, o2) = results
        assert t1 == t2 and o1 == o2 == len(ids) + 12
        assert mx.allclose(f1, f2, atol=1e-5).item()


def test_drafting_off_runs_only_plain_steps():
    policy = make_policy(16, 1)
    assert policy.plain_steps(40) == 40
    assert make_policy(16, 2).plain_steps(40) == 0


def test_probe_costs_are_made_non_decreasing():
    from mlx_dflash.policies.verify_costs import non_decreasing

    assert non_decreasing({1: 1.0, 2: 2.0, 4: 4.0, 8: 3.0, 16: 5.0}) == {1: 1.0, 2: 2.0, 4: 3.5, 8: 3.5, 16: 5.0}
    assert non_decreasing({1: 3.0, 2: 1.0, 4: 2.0}) == {1: 2.0, 2: 2.0, 4: 2.0}
    increasing = {1: 1.0, 3: 2.0, 5: 2.5}
    assert non_decreasing(increasing) == increasing


def test_a_round_reads_the_device_back_once_and_twice_when_the_policy_reads_confidence(tiny_chat_pair, monkeypatch):
    """Host round trips per round, counted: one for fixed widths (greedy or sampled, prompt lookup on), two
    for policies that cut on the drafter's confidence (p-min, auto), one for a plain step (auto's, where
    drafting does not pay)."""
    from mlx_dflash.decoding import decoder

    target, tokenizer, drafter = tiny_chat_pair
    reads = []
    real_to_host = decoder.to_host
    monkeypatch.setattr(decoder, "to_host", lambda *arrays: (reads.append(len(arrays)), real_to_host(*arrays))[1])
    ids = mx.array(chat_ids(tokenizer, "Count to twenty."))
    auto = DCutPolicy(drafter.block_size, drafter.block_size, {1: {w: 0.01 for w in range(1, 9)}})  # wider is free
    cases = [("fixed, greedy", make_policy(drafter.block_size, 4), SamplingParams(), 1),
             ("fixed, sampled", make_policy(drafter.block_size, 4), SamplingParams(0.8), 1),
             ("p-min", make_policy(drafter.block_size, controls=DraftControls(p_min=0.01)), SamplingParams(), 2),
             ("auto", auto, SamplingParams(), 2)]
    for name, policy, sampling, per_round in cases:
        reads.clear()
        produced, seen = 0, []
        for rnd in speculative_rounds(target, drafter, ids, policy, sampling, max_tokens=24):
            seen.append((produced, rnd.drafted, len(reads), rnd.plain))
            produced += len(rnd.tokens)
            reads.clear()
        assert seen[0][2] == 1, name  # the prefill's token
        assert any(drafted for _, drafted, _, _ in seen), name
        # Every round with room for a draft (the last token is a one-row round that drafts nothing).
        assert all(n == (1 if plain else per_round) for before, _, n, plain in seen[1:] if before + 1 < 24), \
            (name, seen)


