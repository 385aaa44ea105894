"""Our MLX DFlash 2 drafter against z-lab's PyTorch DFlash2DraftModel (PyPI dflash==0.1.0), same weights.

float32 end to end, tolerance 1e-4: the hidden states, the logits, the candidate selector's scores, its
greedy walk, its sampling distribution q along a path (the reference is made to follow our sampled path,
so the distributions are compared row by row), and context given across calls through our cache.
The reference module comes from the wheel exactly as in test_parity_torch.py.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash2_tiny import H, VOCAB, randomize, tiny_config
from mlx_dflash.models.config import parse_config
from mlx_dflash.models.dflash import Borrowed
from mlx_dflash.models.loader import init_drafter
from conftest import TORCH_MISSING

torch = pytest.importorskip("torch", reason=TORCH_MISSING)

TOLERANCE = dict(rtol=1e-4, atol=1e-4)
N_FEAT = 5 * H


def build_pair(reference, cfg, seed=0):
    ours = randomize(init_drafter(parse_config(cfg), seed=seed), seed)
    config = reference.Qwen3Config(**cfg)
    config._attn_implementation = "sdpa"
    theirs = reference.DFlash2DraftModel(config).eval()
    state = {k: torch.from_numpy(np.array(v)) for k, v in tree_flatten(ours.parameters())}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)

    embed = mx.random.normal((VOCAB, H), key=mx.random.key(seed + 1))
    head = mx.random.normal((VOCAB, H), key=mx.random.key(seed + 2)) * 0.5
    ours._borrowed = Borrowed(embed=lambda ids: embed[ids], head=lambda h: h @ head.T, embed_scale=1.0)
    torch_head = torch.from_numpy(np.array(head))
    return ours, theirs, embed, lambda h: h @ torch_head.T


def torch_hidden(theirs, embed, block_ids, context, start):
    L = block_ids.shape[1]
    with torch.no_grad():
        return theirs(position_ids=torch.arange(start + L)[None],
                      noise_embedding=torch.from_numpy(np.array(embed[block_ids])),
                      target_hidden=torch.from_numpy(np.array(context)))


def by_token(candidates, values):
    """Row-wise values keyed by candidate token, as [n, k] sorted by token (candidate order is free)."""
    candidates, values = np.asarray(candidates), np.asarray(values)
    order = np.argsort(candidates, axis=-1)
    return np.take_along_axis(candidates, order, -1), np.take_along_axis(values, order, -1)


CONFIGS = {
    "published": {},  # the fixture's own settings: sliding non-causal layers, softcap, output multiplier
    "wide_groups": dict(conv_group_size=32, conv_kernel_size=3, selector_top_k=20),
}


@pytest.fixture(params=sorted(CONFIGS))
def pair(request, reference):
    cfg = tiny_config(**CONFIGS[request.param])
    return build_pair(reference, cfg)


def test_hidden_logits_and_greedy_walk_match_reference(pair):
    ours, theirs, embed, torch_head = pair
    S, L = 11, 16
    context = mx.random.normal((1, S, N_FEAT), key=mx.random.key(7))
    block = mx.array([[5] + [VOCAB - 1] * (L - 1)])

    hidden = ours.hidden(block, context, ours.make_cache())
    want_hidden = torch_hidden(theirs, embed, block, context, S)
    np.testing.assert_allclose(np.array(hidden), want_hidden.numpy(), **TOLERANCE)

    with torch.no_grad():
        want_logits = theirs.compute_logits(want_hidden[:, 1:], torch_head)
        want_path, want_candidates, _ = theirs.propose(want_hidden[:, 1:], torch.tensor([5]), torch_head, 0.0)
    np.testing.assert_allclose(np.array(ours.logits(hidden[:, 1:])), want_logits.numpy(), **TOLERANCE)

    walk = ours.walk(hidden[:, 1:], block[:, 0])
    assert np.array_equal(np.sort(np.array(walk.candidates), -1), np.sort(want_candidates.numpy(), -1))
    assert np.array(walk.tokens).tolist() == want_path.numpy().tolist()
    # The pairwise term really steers the walk somewhere: not every step is the unary argmax.
    unary_argmax = np.argmax(np.array(ours.logits(hidden[:, 1:])), -1)
    assert (unary_argmax != np.array(walk.tokens)).any()


def test_sampled_scores_and_q_match_reference(pair, reference, monkeypatch):
    """Our walk samples a path at T = 0.7; the reference is forced along the same path, and at every step
    its scores and its distribution q over the candidates equal ours."""
    ours, theirs, embed, torch_head = pair
    S, L, T = 9, 16, 0.7
    context = mx.random.normal((1, S, N_FEAT), key=mx.random.key(8))
    block = mx.array([[17] + [VOCAB - 1] * (L - 1)])
    hidden = ours.hidden(block, context, ours.make_cache())[:, 1:]
    mx.random.seed(3)
    walk = ours.walk(hidden, block[:, 0], T)

    want_hidden = torch_hidden(theirs, embed, block, context, S)[:, 1:]
    with torch.no_grad():
        logits = theirs.compute_logits(want_hidden, torch_head)
    _, their_candidates = torch.topk(logits, theirs.candidate_selector.top_k, dim=-1, sorted=False)
    path = np.array(walk.tokens)[0]
    recorded_scores, step = [], iter(range(L - 1))
    real_probs = reference._sampling_probs

    def record(scores, temperature, *args):
        recorded_scores.append(scores[:, 0].clone())
        return real_probs(scores, temperature, *args)

    def follow_our_path(q):
        t = next(step)
        return torch.tensor([int(np.flatnonzero(their_candidates[0, t].numpy() == path[t])[0])])

    monkeypatch.setattr(reference, "_sampling_probs", record)
    monkeypatch.setattr(reference, "_sample_probs", follow_our_path)
    with torch.no_grad():
        their_path, candidates, their_q = theirs.propose(want_hidden, torch.tensor([17]), torch_head, T)
    assert their_path.numpy()[0].tolist() == path.tolist()

    ours_tokens, ours_scores = by_token(walk.candidates[0], walk.scores[0])
    theirs_tokens, theirs_scores = by_token(candidates[0], torch.cat(recorded_scores).numpy())
    assert np.array_equal(ours_tokens, theirs_tokens)
    np.testing.assert_allclose(ours_scores, theirs_scores, **TOLERANCE)
    _, ours_q = by_token(walk.candidates[0], walk.probs[0])
    _, theirs_q = by_token(candidates[0], their_q[0].numpy())
    np.testing.assert_allclose(ours_q, theirs_q, **TOLERANCE)
    assert ours_q.max(-1).min() < 0.99  # q is a real distribution here, not a point mass


def test_incremental_context_matches_reference(reference):
    """Context given across three calls through our cache == the reference given it all at once."""
    ours, theirs, embed, torch_head = build_pair(reference, tiny_config(), seed=3)
    context = mx.random.normal((1, 13, N_FEAT), key=mx.random.key(11))
    L, cache = 16, ours.make_cache()
    for end in (6, 9, 13):
        begin = cache[0].offset
        block = mx.array([[end % VOCAB] + [VOCAB - 1] * (L - 1)])
        hidden = ours.hidden(block, context[:, begin:end], cache)
        want = torch_hidden(theirs, embed, block, context[:, :end], end)
        np.testing.assert_allclose(np.array(hidden), want.numpy(), **TOLERANCE)
        with torch.no_grad():
            want_path = theirs.propose(want[:, 1:], torch.tensor([end]), torch_head, 0.0)[0]
        assert np.array(ours.walk(hidden[:, 1:], block[:, 0]).tokens).tolist() == want_path.numpy().tolist()
