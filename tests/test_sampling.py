"""Rejection sampling is exact: emitted tokens follow the target distribution, whatever the draft; and
that distribution is mlx-lm's own (`mlx_lm.sample_utils.make_sampler` with the same flags)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import _get_classes
from scipy.stats import chi2_contingency

from conftest import assert_distributed_as
from mlx_dflash.decoding.batch_decoder import speculative_rounds
from mlx_dflash.models.loader import drafter_config_for, init_drafter
from mlx_dflash.errors import DFlashError
from mlx_dflash.policies.width import make_policy
from mlx_dflash.decoding.sampling import SamplingParams, accept_rows, rejection_accept, target_probs
from mlx_dflash.models.target import Target

TRIALS = 6000
LOGITS = mx.array([[1.0, 0.2, 2.0, -0.5, 0.7, 1.4], [0.1, 1.8, -1.0, 0.9, 0.0, 0.5]])


def frequencies(tokens, vocab):
    return np.bincount(np.array(tokens), minlength=vocab)


def first_emitted(drafts, accepted, token):
    """The first token a round emits: the first draft if it was kept, else the replacement."""
    return drafts[0] if accepted else token


def verdict(accepted: mx.array, token: mx.array) -> tuple:
    """rejection_accept's lazy (number kept, next token), read back."""
    return accepted.item(), token.item()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.0, top_k=3), SamplingParams(1.3, top_p=0.8)],
    ids=["t1", "t0.7", "top_k3", "top_p0.8"],
)
def test_point_mass_proposals_emit_the_target_distribution(params):
    mx.random.seed(0)
    p = target_probs(LOGITS, params)
    first = [first_emitted([2], *verdict(*rejection_accept(mx.array([2]), p))) for _ in range(TRIALS)]
    assert_distributed_as(first, p[0])


def test_sampled_proposals_emit_the_target_distribution():
    """Drafts drawn from a full draft distribution q (far from p) still give exactly p."""
    mx.random.seed(1)
    p = target_probs(LOGITS, SamplingParams(1.0))
    q = mx.array([[0.05, 0.5, 0.05, 0.3, 0.05, 0.05]])
    drafts = mx.random.categorical(mx.log(q[0]), shape=(TRIALS,)).tolist()
    first = [first_emitted([d], *verdict(*rejection_accept(mx.array([d]), p, q))) for d in drafts]
    assert_distributed_as(first, p[0])


def test_second_token_follows_the_target_given_the_first():
    """With two drafts, P(first kept) = p0(d1) and, after it, the next token is distributed as p1."""
    mx.random.seed(2)
    p = target_probs(mx.concatenate([LOGITS, LOGITS[:1]]), SamplingParams(1.0))
    kept, second = 0, []
    for _ in range(TRIALS):
        accepted, token = verdict(*rejection_accept(mx.array([2, 1]), p))
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


def test_greedy_acceptance_counts_the_matching_prefix():
    logits = mx.eye(6)[mx.array([4, 1, 3, 0])]  # argmax per row: 4, 1, 3, 0
    def greedy(drafts, rows, limit=None):
        drafts = mx.array([drafts], dtype=mx.int32).reshape(1, -1)
        kept, token = accept_rows(drafts, rows[None], [SamplingParams()], [drafts.shape[1] if limit is None else limit])
        return verdict(kept[0], token[0])

    assert greedy([4, 1, 5], logits) == (2, 3)
    assert greedy([4, 1, 3], logits) == (3, 0)
    assert greedy([0, 1, 3], logits) == (0, 4)
    assert greedy([], logits[:1]) == (0, 4)
    assert greedy([4, 1, 3], logits, limit=1) == (1, 1)  # a row judges only its first `limit` drafts


def test_rows_are_judged_each_by_its_own_rule_and_limit():
    """A batch's verdicts are each row's alone: greedy rows as one request's, a sampled row drawing from its
    own stream as it would alone with the same key, a row with no drafts to judge as mlx-lm draws."""
    logits = mx.random.normal((3, 4, 12), key=mx.random.key(3))
    drafts = mx.argmax(logits[:, :3], axis=-1).astype(mx.int32)
    drafts = drafts.at[0, 1].add(1)  # row 0 is wrong at its second draft
    greedy, sampled = SamplingParams(), SamplingParams(0.8)
    keys = [None, mx.random.key(7), mx.random.key(9)]
    kept, tokens = accept_rows(drafts, logits, [greedy, sampled, sampled], [3, 2, 0], keys=keys)
    alone = [accept_rows(drafts[b:b + 1], logits[b:b + 1], [s], [n], keys=[k])
             for b, (s, n, k) in enumerate(zip([greedy, sampled, sampled], [3, 2, 0], keys))]
    assert verdict(kept[0], tokens[0]) == (1, np.argmax(np.array(logits[0, 1])))
    for b in range(3):
        assert verdict(kept[b], tokens[b]) == verdict(alone[b][0][0], alone[b][1][0])
    assert kept[2].item() == 0


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                    dict(min_p=-0.1), dict(min_p=1.0)])
def test_bad_sampling_parameters_are_refused(kwargs):
    with pytest.raises(DFlashError):
        SamplingParams(**kwargs)


# (temp, top_p, top_k, min_p) where the filter order matters: on the tempered distribution (the old
# rule) top-p 0.7 at temp 0.5 keeps fewer tokens than mlx-lm, which filters before tempering.
MLX_LM_SETTINGS = [(0.5, 0.7, 0, 0.0), (1.3, 1.0, 4, 0.0), (0.8, 1.0, 0, 0.1), (1.0, 0.9, 5, 0.05)]
SETTING_IDS = ["t0.5-top_p0.7", "t1.3-top_k4", "t0.8-min_p0.1", "t1-top_p0.9-top_k5-min_p0.05"]


def mlx_lm_draws(logits_rows, temp, top_p, top_k, min_p):
    """Tokens drawn by mlx-lm's own sampler, one per row of logits (as generate_step: log-softmax first)."""
    sampler = make_sampler(temp=temp, top_p=top_p if top_p < 1 else 0.0, min_p=min_p, top_k=top_k)
    logprobs = logits_rows - mx.logsumexp(logits_rows, axis=-1, keepdims=True)
    return np.array(sampler(logprobs))


@pytest.mark.parametrize("setting", MLX_LM_SETTINGS, ids=SETTING_IDS)
def test_target_distribution_is_mlx_lms(setting):
    """Chi-square: N draws of make_sampler against target_probs, and the same support."""
    mx.random.seed(3)
    row = mx.array([2.0, 1.6, 1.5, 1.1, 0.9, 0.4, 0.0, -0.3, -1.0, -2.0])
    draws = mlx_lm_draws(mx.broadcast_to(row, (TRIALS, row.size)), *setting)
    p = np.array(target_probs(row, SamplingParams(*setting[:3], min_p=setting[3])), dtype=np.float64)
    assert set(np.flatnonzero(frequencies(draws, p.size))) == set(np.flatnonzero(p > 0))
    assert_distributed_as(draws.tolist(), p)


def tiny_pair(vocab=16):
    config = dict(model_type="llama", hidden_size=32, num_hidden_layers=4, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=vocab,
                  tie_word_embeddings=False)
    model_class, args_class = _get_classes(config)
    mx.random.seed(11)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda w: w * 2 if w.ndim == 2 else w, model.parameters()))  # livelier logits
    mx.eval(model.parameters())
    target = Target(model)
    drafter = init_drafter(drafter_config_for(target, num_layers=1, block_size=4, num_target_features=2), seed=2)
    return model, target, drafter.bind(target)


@pytest.mark.slow
@pytest.mark.parametrize("setting", MLX_LM_SETTINGS, ids=SETTING_IDS)
def test_decoder_samples_like_mlx_lm(setting):
    """The decoder's first two tokens (the second through a drafted round's rejection sampling) against
    mlx-lm's own sampler on the same model: a two-sample chi-square test per position."""
    runs = 1000
    model, target, drafter = tiny_pair()
    prompt = [3, 9, 1, 12, 5]
    params = SamplingParams(*setting[:3], min_p=setting[3])
    policy = make_policy(drafter.block_size, 2)  # one draft per round
    mx.random.seed(5)
    ours = []
    for _ in range(runs):
        rounds = speculative_rounds(target, drafter, mx.array(prompt), policy, params, max_tokens=3)
        first, second = next(rounds), next(rounds)
        assert second.drafted == 1
        ours.append((first.tokens[0], second.tokens[0]))
        rounds.close()
    assert_first_two_like_mlx_lm(model, prompt, setting, ours)


def assert_first_two_like_mlx_lm(model, prompt: list, setting: tuple, ours: list):
    """Our (first, second) tokens drawn after `prompt`, against as many of mlx-lm's own draws on the same model
    (the first from the prompt's last logits, the second from the logits after it): a two-sample chi-square test
    per position."""
    runs = len(ours)
    first_logits = model(mx.array([prompt]))[:, -1]
    t1 = mlx_lm_draws(mx.broadcast_to(first_logits, (runs, first_logits.shape[-1])), *setting)
    after = model(mx.array([prompt + [t] for t in range(first_logits.shape[-1])]))[:, -1]
    t2 = mlx_lm_draws(after[mx.array(t1)], *setting)
    ours = np.array(ours)
    for position, theirs in ((0, t1), (1, t2)):
        counts = np.stack([np.bincount(ours[:, position], minlength=16), np.bincount(theirs, minlength=16)])
        counts = counts[:, counts.sum(axis=0) > 0]
        pvalue = chi2_contingency(counts).pvalue if counts.shape[1] > 1 else 1.0
        assert pvalue > 1e-3, f"position {position + 1}: decoder {counts[0]} vs mlx-lm {counts[1]}: p={pvalue:.2g}"
