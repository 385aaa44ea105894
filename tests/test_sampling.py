"""Rejection sampling is exact: emitted tokens follow the target distribution, whatever the draft."""

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

from mlx_dflash.errors import DFlashError
from mlx_dflash.sampling import SamplingParams, greedy_accept, rejection_accept, target_probs

TRIALS = 6000
LOGITS = mx.array([[1.0, 0.2, 2.0, -0.5, 0.7, 1.4], [0.1, 1.8, -1.0, 0.9, 0.0, 0.5]])


def frequencies(tokens, vocab):
    return np.bincount(np.array(tokens), minlength=vocab)


def first_emitted(drafts, accepted, token):
    """The first token a round emits: the first draft if it was kept, else the replacement."""
    return drafts[0] if accepted else token


def assert_distributed_as(tokens, probs):
    """Chi-square goodness of fit over the tokens p allows; the rest must never appear."""
    probs = np.array(probs, dtype=np.float64)
    counts = frequencies(tokens, probs.size)
    assert counts[probs == 0].sum() == 0, f"tokens outside the target's support were emitted: {counts}"
    support = probs > 0
    expected = probs[support] / probs[support].sum() * counts.sum()
    result = chisquare(counts[support], expected)
    assert result.pvalue > 1e-3, f"counts {counts} vs expected {expected}: p={result.pvalue:.2g}"


@pytest.mark.parametrize(
    "params",
    [SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.0, top_k=3), SamplingParams(1.3, top_p=0.8)],
    ids=["t1", "t0.7", "top_k3", "top_p0.8"],
)
def test_point_mass_proposals_emit_the_target_distribution(params):
    mx.random.seed(0)
    p = target_probs(LOGITS, params)
    first = [first_emitted([2], *rejection_accept([2], p)) for _ in range(TRIALS)]
    assert_distributed_as(first, p[0])


def test_sampled_proposals_emit_the_target_distribution():
    """Drafts drawn from a full draft distribution q (far from p) still give exactly p."""
    mx.random.seed(1)
    p = target_probs(LOGITS, SamplingParams(1.0))
    q = mx.array([[0.05, 0.5, 0.05, 0.3, 0.05, 0.05]])
    drafts = mx.random.categorical(mx.log(q[0]), shape=(TRIALS,)).tolist()
    first = [first_emitted([d], *rejection_accept([d], p, q)) for d in drafts]
    assert_distributed_as(first, p[0])


def test_second_token_follows_the_target_given_the_first():
    """With two drafts, P(first kept) = p0(d1) and, after it, the next token is distributed as p1."""
    mx.random.seed(2)
    p = target_probs(mx.concatenate([LOGITS, LOGITS[:1]]), SamplingParams(1.0))
    kept, second = 0, []
    for _ in range(TRIALS):
        accepted, token = rejection_accept([2, 1], p)
        if accepted >= 1:
            kept += 1
            second.append(1 if accepted == 2 else token)
    p0_d1 = p[0, 2].item()
    assert abs(kept / TRIALS - p0_d1) < 4 * np.sqrt(p0_d1 * (1 - p0_d1) / TRIALS)
    assert_distributed_as(second, p[1])


def test_filters_keep_the_right_tokens():
    row = mx.array([3.0, 2.0, 1.0, 0.0, -1.0])
    top_k = target_probs(row, SamplingParams(1.0, top_k=2))
    assert (np.array(top_k) > 0).tolist() == [True, True, False, False, False]
    full = np.array(target_probs(row, SamplingParams(1.0)))
    top_p = np.array(target_probs(row, SamplingParams(1.0, top_p=0.9)))
    # Smallest prefix of the sorted distribution whose mass reaches 0.9.
    n_keep = int(np.searchsorted(np.cumsum(full), 0.9) + 1)
    assert (top_p > 0).sum() == n_keep
    np.testing.assert_allclose(top_p.sum(), 1.0, rtol=1e-6)


def test_greedy_accept_counts_the_matching_prefix():
    logits = mx.eye(6)[mx.array([4, 1, 3, 0])]  # argmax per row: 4, 1, 3, 0
    assert greedy_accept([4, 1, 5], logits) == (2, 3)
    assert greedy_accept([4, 1, 3], logits) == (3, 0)
    assert greedy_accept([0, 1, 3], logits) == (0, 4)
    assert greedy_accept([], logits[:1]) == (0, 4)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2)])
def test_bad_sampling_parameters_are_refused(kwargs):
    with pytest.raises(DFlashError):
        SamplingParams(**kwargs)
