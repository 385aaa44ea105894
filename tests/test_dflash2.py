"""DFlash 2 drafters: the published checkpoint layout, bad input, lossless decoding, exact sampling with the
selector's q, the draft controls, conversion, and training's refusal to turn a v1 drafter into one.

Checkpoints follow the real Muse-Glimmer DFlash 2 config and safetensors header (tests/fixtures, verbatim
from z-lab); the target is a tiny random mlx-lm `muse_glimmer` model (mlx-lm 0.32.2 has that family; it has
no Qwen3.8 model type).
"""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner

from dflash2_tiny import REAL_CONFIG, REAL_HEADER, VOCAB, randomize, tiny_checkpoint, tiny_config, tiny_glimmer
from conftest import assert_distributed_as, mlx_lm_greedy
from oracles import OracleDFlash2, Recorder, expected_acceptance
from mlx_dflash.cli import main
from mlx_dflash.models.config import config_to_dict, parse_config
from mlx_dflash.convert import Quantization, convert_drafter
from mlx_dflash.decoding.batch_decoder import speculative_rounds
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.models.dflash2 import DFlash2DraftModel
from mlx_dflash.models.loader import drafter_from_dir, init_drafter
from mlx_dflash.errors import DFlashError
from mlx_dflash.policies.dcut import DCutPolicy
from mlx_dflash.policies.width import DraftControls, make_policy
from mlx_dflash.decoding.sampling import SamplingParams, accept_rows, target_probs
from mlx_dflash.models.target import Target

PROMPT = [5, 17, 42, 99, 3, 150, 7, 61, 88, 23, 11, 190]
MAX_TOKENS = 24


def write_checkpoint(path, cfg, weights):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


# ------------------------------------------------------------------------------------------------
# The published layout.

def test_real_config_builds_exactly_the_real_tensors():
    """The real config gives the real header's names and shapes (lazily: nothing is allocated)."""
    config = parse_config(REAL_CONFIG)
    assert (config.conv_kernel_size, config.conv_group_size, config.selector_rank, config.selector_top_k) == (2, 16, 256, 16)
    assert config.layer_types == ("sliding_attention",) * 5 and not config.layer_is_causal(0)
    assert config.layer_window(0) == 2048 and config.final_logit_softcapping == 20.0
    model = DFlash2DraftModel(config)
    shapes = {k: list(v.shape) for k, v in model.checkpoint_weights().items()}
    assert shapes == {k: v["shape"] for k, v in REAL_HEADER.items()}


def test_tiny_checkpoint_with_the_real_names_loads_strictly(tmp_path):
    cfg = tiny_config()
    weights = tiny_checkpoint(cfg)
    assert {v.dtype for v in weights.values()} == {mx.bfloat16}  # the header's dtype
    drafter = drafter_from_dir(write_checkpoint(tmp_path / "d", cfg, weights))
    assert isinstance(drafter, DFlash2DraftModel)
    got = drafter.checkpoint_weights()
    assert set(got) == set(REAL_HEADER)
    for name, value in weights.items():
        assert got[name].dtype == value.dtype and mx.array_equal(got[name], value), name


def test_config_round_trip_keeps_dflash2():
    out = config_to_dict(parse_config(REAL_CONFIG))
    assert out["architectures"] == ["DFlash2DraftModel"]
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        assert out["dflash_config"][name] == REAL_CONFIG["dflash_config"][name]
    assert parse_config(out) == parse_config(REAL_CONFIG)


def _without(weights, name):
    return {k: v for k, v in weights.items() if k != name}


@pytest.mark.parametrize("case, expected", [
    ("missing_codebook", "no tensor candidate_selector.successor_codebook"),
    ("group_size_mismatch", "layers.0.attention_conv.kernel_projection.weight has 16 rows, but "
                            "dflash_config.conv_group_size 32"),
    ("group_size_not_dividing", "dflash_config.conv_group_size 48 does not divide hidden_size 64"),
    ("missing_field", "needs dflash_config.selector_top_k"),
])
def test_bad_checkpoints_get_one_line_errors(tmp_path, case, expected):
    cfg, weights = tiny_config(), tiny_checkpoint(tiny_config())
    if case == "missing_codebook":
        weights = _without(weights, "candidate_selector.successor_codebook")
    elif case == "group_size_mismatch":
        cfg["dflash_config"]["conv_group_size"] = 32
    elif case == "group_size_not_dividing":
        cfg["dflash_config"]["conv_group_size"] = 48
    else:
        del cfg["dflash_config"]["selector_top_k"]
    path = write_checkpoint(tmp_path / "d", cfg, weights)
    with pytest.raises(DFlashError, match=expected) as err:
        drafter_from_dir(path)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------
# Decoding.

@pytest.fixture(scope="module")
def glimmer():
    model = tiny_glimmer()
    want = mlx_lm_greedy(model, PROMPT, MAX_TOKENS)  # 12 + 24 positions: past the target's 8-token window
    assert len(set(want)) > 3, "degenerate reference: make the random model livelier"
    return Target(model), want


@pytest.fixture(scope="module")
def drafter(glimmer):
    target, _ = glimmer
    return randomize(init_drafter(parse_config(tiny_config()), seed=1)).bind(target)


def run(target, drafter, policy, sampling=SamplingParams(), max_tokens=MAX_TOKENS):
    rounds = list(speculative_rounds(target, drafter, mx.array(PROMPT), policy, sampling, max_tokens))
    return [t for r in rounds for t in r.tokens], rounds


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


DEFAULT_WIDTHS = (1, 2, 5, 8, 16)  # the others run in the slow tier
WIDTHS = [w if w in DEFAULT_WIDTHS else pytest.param(w, marks=pytest.mark.slow) for w in range(1, 17)]


@pytest.mark.parametrize("width", WIDTHS)
def test_greedy_output_is_the_target_greedy_output(glimmer, drafter, width):
    """A random DFlash 2 drafter at every width: same tokens, and each round keeps exactly the drafts
    that agree with the target's own continuation."""
    target, want = glimmer
    recorder = Recorder(drafter)
    got, rounds = run(target, recorder, make_policy(drafter.block_size, width))
    assert got == want
    produced, drafts = 1, iter(recorder.drafts)
    for rnd in rounds[1:]:
        n = min(width, MAX_TOKENS - produced) - 1  # the drafter runs only when there is something to draft
        tokens = next(drafts).tokens if n else []
        assert rnd.drafted == n == len(tokens)
        assert rnd.accepted == common_prefix(tokens, want[produced:])
        produced += len(rnd.tokens)
    assert next(drafts, None) is None


@pytest.mark.parametrize("width", [4, 16, pytest.param(2, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_oracle_through_the_selector_accepts_exactly(glimmer, drafter, width):
    target, want = glimmer
    oracle = OracleDFlash2(drafter.config)
    oracle.update(drafter.parameters())
    oracle.bind(target).plant(len(PROMPT), want, errors={3, 4, 11, 19, 20})
    no_lookup = DraftControls(prompt_lookup=False)
    got, rounds = run(target, oracle, make_policy(oracle.block_size, width, controls=no_lookup))
    assert got == want
    assert [r.accepted for r in rounds[1:]] == expected_acceptance(MAX_TOKENS, width, {3, 4, 11, 19, 20})
    if width > 5:
        assert max(r.accepted for r in rounds) >= 5


def test_p_min_cuts_on_the_selector_confidence(glimmer, drafter):
    target, want = glimmer
    probe = Recorder(drafter)
    run(target, probe, make_policy(drafter.block_size, 16))
    p_min = float(np.median([c for d in probe.drafts for c in d.confidence.tolist()]))
    recorder = Recorder(drafter)
    # (without prompt lookup, which would replace unsure drafts: this checks the cut on the selector's own)
    controls = DraftControls(p_min=p_min, prompt_lookup=False)
    got, rounds = run(target, recorder, make_policy(drafter.block_size, 16, controls=controls))
    assert got == want
    drafted = [r.drafted for r in rounds[1:]]
    for n, draft in zip(drafted, recorder.drafts):
        confidence = draft.confidence.tolist()
        assert n == next((k for k, c in enumerate(confidence) if c < p_min), len(confidence))
    assert min(drafted) < 15 and max(drafted) > 0


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(0.8)], ids=["greedy", "sampled"])
def test_draft_confidence_is_the_selector_probability_of_the_chosen_candidate(glimmer, drafter, sampling):
    target, _ = glimmer
    context = target.prefill(mx.array(PROMPT), target.make_cache())[1]
    mx.random.seed(0)
    draft = drafter.draft([7], [context], drafter.make_cache(), 16, 12, [sampling]).row(0)
    hidden = drafter.hidden(mx.array([[7] + [drafter.mask_token_id] * 15]), context, drafter.make_cache())
    walk = drafter.walk(hidden[:, 1:12], mx.array([7]))
    if sampling.greedy:
        assert draft.tokens == walk.tokens[0].tolist() and draft.proposal is None
        want = walk.probs[0].max(axis=-1)  # softmax of the scores: the chosen one is the most likely
    else:
        candidates, q = draft.proposal
        assert candidates.shape == q.shape == (11, 8) and np.allclose(np.array(q.sum(-1)), 1, atol=1e-5)
        want = (q * (candidates == mx.array(draft.tokens)[:, None])).sum(-1)
    assert len(draft.tokens) == 11
    np.testing.assert_allclose(np.array(draft.confidence), np.array(want), rtol=1e-5)


def test_width_auto_stays_lossless(glimmer, drafter):
    target, want = glimmer
    policy = DCutPolicy(drafter.block_size, 16, {1: {w: 0.01 + 0.001 * w for w in range(1, 17)}})
    got, _ = run(target, drafter, policy)
    assert got == want


def test_quantized_drafter_keeps_the_quantized_rule(glimmer, drafter, tmp_path):
    target, want = glimmer
    src = write_checkpoint(tmp_path / "src", tiny_config(), drafter.checkpoint_weights())
    out = convert_drafter(src, tmp_path / "q4", quantize=Quantization(4, 32))
    quantized = drafter_from_dir(out).bind(target)
    policy = build_policy(target, quantized)
    assert policy.max_width == 5 and "clamped" in policy.notes[0]
    got, rounds = run(target, quantized, policy)
    assert got == want and max(r.drafted for r in rounds) == 4


# ------------------------------------------------------------------------------------------------
# Sampling with the selector's q.

TRIALS = 3000


def selector_walks(temperature, n=2, trials=TRIALS):
    """`trials` independent walks of a random selector over n rows with fixed hidden rows and logits:
    the candidate sets are tokens 0..5 and two of 200..209."""
    config = parse_config(tiny_config())
    selector = randomize(init_drafter(config, seed=4)).candidate_selector
    hidden = mx.random.normal((1, n, config.hidden_size), key=mx.random.key(5))
    logits = mx.random.normal((1, n, VOCAB), key=mx.random.key(6)) * 0.3
    logits = logits + 3.0 * (mx.arange(VOCAB) < 6) + 2.0 * ((mx.arange(VOCAB) >= 200) & (mx.arange(VOCAB) < 210))
    mx.random.seed(7)
    walk = selector(mx.broadcast_to(hidden, (trials, n, config.hidden_size)),
                    mx.broadcast_to(logits, (trials, n, VOCAB)), mx.full((trials,), 9), temperature)
    mx.eval(walk.tokens, walk.probs)
    return walk


def target_rows():
    """Target logits over tokens 0..3 and 6..11 (so some candidates have p = 0 and some of p's support
    lies outside every candidate set)."""
    support = (mx.arange(VOCAB) < 4) | ((mx.arange(VOCAB) >= 6) & (mx.arange(VOCAB) < 12))
    logits = mx.random.normal((3, VOCAB), key=mx.random.key(8)) * 1.5
    return mx.where(support, logits, -mx.inf)


def test_walk_samples_follow_its_q():
    walk = selector_walks(0.7)
    tokens, cands, probs = np.array(walk.tokens), np.array(walk.candidates), np.array(walk.probs)
    q0 = np.zeros(VOCAB)
    q0[cands[0, 0]] = probs[0, 0]
    assert sorted(cands[0, 0].tolist())[:6] == list(range(6)) and q0.max() < 0.9
    assert_distributed_as(tokens[:, 0], q0)
    # Row 2's q depends on the token chosen at row 1; among walks that chose the commonest one it is fixed.
    first = np.bincount(tokens[:, 0]).argmax()
    rows = np.flatnonzero(tokens[:, 0] == first)
    q1 = np.zeros(VOCAB)
    q1[cands[rows[0], 1]] = probs[rows[0], 1]
    assert np.allclose(probs[rows, 1], probs[rows[0], 1])
    assert_distributed_as(tokens[rows, 1], q1)
    assert not np.allclose(probs[np.flatnonzero(tokens[:, 0] != first)[0], 1], probs[rows[0], 1])


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.8)], ids=["t1", "t0.7_top_p0.8"])
def test_rejection_with_the_selector_q_emits_the_target_distribution(params):
    walk = selector_walks(params.temperature)
    logits = target_rows()
    p = target_probs(logits, params)
    tokens, cands, probs = np.array(walk.tokens).tolist(), walk.candidates, walk.probs
    first, second, kept = [], [], 0
    for b in range(TRIALS):
        verdict = accept_rows(mx.array([tokens[b]]), logits[None], [params], [len(tokens[b])],
                              (cands[b : b + 1], probs[b : b + 1]))
        accepted, token = (v[0].item() for v in verdict)
        first.append(tokens[b][0] if accepted else token)
        if accepted:
            kept += 1
            second.append(tokens[b][1] if accepted == 2 else token)
    assert_distributed_as(first, p[0])
    assert_distributed_as(second, p[1])
    # P(first draft kept) = sum_x min(p(x), q(x)): the overlap of p with the selector's q, not with a point mass.
    q0 = mx.zeros(VOCAB).at[cands[0, 0]].add(probs[0, 0])
    rate = mx.minimum(p[0], q0).sum().item()
    assert 0.05 < rate < 0.95
    assert abs(kept / TRIALS - rate) < 4 * np.sqrt(rate * (1 - rate) / TRIALS)


@pytest.mark.slow
def test_sampled_decoding_with_a_dflash2_drafter_follows_the_target(glimmer, drafter):
    """End to end through the decoder at T = 0.8, top-k 5: the second token (the first round's first
    draft, or its replacement), among runs whose first token was the commonest, is distributed as the
    target's own next-token distribution after it."""
    target, _ = glimmer
    params, runs = SamplingParams(0.8, top_k=5), 1500
    pairs = []
    for seed in range(runs):
        mx.random.seed(seed)
        tokens, _ = run(target, drafter, make_policy(drafter.block_size, 16), params, max_tokens=6)
        pairs.append(tokens[:2])
    first = np.bincount([a for a, _ in pairs]).argmax()
    second = [b for a, b in pairs if a == first]
    logits, _ = target.forward(mx.array([PROMPT + [int(first)]]), target.make_cache())
    assert len(second) > 300
    assert_distributed_as(second, target_probs(logits[0, -1], params))


# ------------------------------------------------------------------------------------------------
# Conversion and training.

def test_convert_keeps_the_published_names_and_quantizes_the_linear_layers(tmp_path, glimmer, drafter):
    target, _ = glimmer
    cfg = tiny_config()
    src = write_checkpoint(tmp_path / "src", cfg, tiny_checkpoint(cfg, seed=2))
    float_out = convert_drafter(src, tmp_path / "float")
    assert set(mx.load(str(float_out / "model.safetensors"))) == set(REAL_HEADER)
    assert json.loads((float_out / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    a, b = drafter_from_dir(src), drafter_from_dir(float_out)
    assert all(mx.array_equal(a.checkpoint_weights()[k], v) for k, v in b.checkpoint_weights().items())

    result = CliRunner().invoke(main, ["convert", "--drafter", str(src), "--out", str(tmp_path / "q"),
                                       "--quantize", "--q-group-size", "32"])
    assert result.exit_code == 0, result.output
    q_cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    modules = q_cfg["quantization"]["modules"]
    assert "layers.0.attention_conv.kernel_projection" in modules and "candidate_selector.hidden_projection" in modules
    assert not any("codebook" in m for m in modules)
    stored = mx.load(str(tmp_path / "q" / "model.safetensors"))
    assert stored["candidate_selector.predecessor_codebook"].dtype == mx.bfloat16
    assert stored["layers.0.mlp_conv.base_kernel"].dtype == mx.bfloat16
    assert "layers.0.mlp_conv.kernel_projection.scales" in stored
    quantized = drafter_from_dir(tmp_path / "q").bind(target)
    assert isinstance(quantized.layers[0].attention_conv.kernel_projection, nn.QuantizedLinear)
    assert isinstance(quantized.candidate_selector.successor_codebook, nn.Embedding)
    n_linear = sum(isinstance(m, nn.Linear) for _, m in a.named_modules())
    assert len(modules) == n_linear == 1 + 5 * (7 + 2) + 1  # fc; per layer q/k/v/o, 3 MLP, 2 convs; selector


def test_train_dflash2_refuses_to_continue_a_v1_drafter(tmp_path, tiny_pair_dirs):
    """(DFlash 2 training itself: tests/test_train_objectives.py.)"""
    result = CliRunner().invoke(main, ["train", "--arch", "dflash2", "--prompts", "p.txt", "--data", "d.jsonl",
                                       "--out", str(tmp_path / "o"), "--init", str(tiny_pair_dirs[1])])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "holds a DFlash v1 drafter" in result.output
