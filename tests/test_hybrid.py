"""Hybrid GatedDeltaNet targets beyond greedy decoding: sampling, 4-bit quantization, refusals, hygiene.

The per-round state equality and greedy parity at every width are in test_families.py (the same tiny
models: tiny_families.py).
"""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import gated_delta_ops
from mlx_lm.utils import _get_classes

from conftest import assert_distributed_as, mlx_lm_greedy
from oracles import OracleDrafter, expected_acceptance
from tiny_families import COMMON, FAMILIES, PROMPT, bound_pair, tiny_model
from mlx_dflash.decoding.batch_decoder import speculative_rounds
from mlx_dflash.errors import DFlashError
from mlx_dflash.policies.width import DraftControls, has_quantized_layers, make_policy
from mlx_dflash.models.rollback import delta_rule_state
from mlx_dflash.decoding.sampling import SamplingParams, target_probs
from mlx_dflash.models.target import Target


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 8, 15, 16])
def test_closed_form_state_equals_mlx_lm_recurrence(steps):
    """delta_rule_state == mlx-lm's step-by-step gated delta rule, with strong and weak decays, beta near
    0 and near 1, and more value heads than key heads."""
    mx.random.seed(steps)
    B, Hk, Hv, Dk, Dv = 1, 2, 4, 16, 8
    k = mx.random.normal((B, steps, Hk, Dk))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, steps, Hv, Dv))
    log_g = -mx.exp(mx.random.uniform(-4, 3, (B, steps, Hv)))  # g from ~1 down to e^-20
    beta = mx.sigmoid(4 * mx.random.normal((B, steps, Hv)))
    state = mx.random.normal((B, Hv, Dv, Dk))
    _, want = gated_delta_ops(mx.repeat(k, 1, 2), k, v, mx.exp(log_g), beta, state)
    got = delta_rule_state(state, k, v, log_g, beta)
    assert got.shape == want.shape and got.dtype == mx.float32
    assert mx.abs(got - want).max().item() < 1e-5 * max(1.0, mx.abs(want).max().item())


@pytest.mark.slow  # 1500 decodes: about 25 s of CPU
def test_sampled_tokens_follow_the_hybrid_target_distribution():
    """Rejection sampling through rewound recurrent state: the joint law of the first three tokens
    (8 outcomes under top-k 2) equals the target's own, computed exactly by plain forwards."""
    model = tiny_model("qwen3_5")
    target, real = bound_pair(model)
    params = SamplingParams(temperature=1.0, top_k=2)
    prompt = PROMPT[:4]

    def support_probs(prefix):  # the two tokens the target may draw next, and their probabilities
        p = target_probs(model(mx.array([prompt + prefix]))[0, -1], params)
        top = mx.argsort(-p)[:2].tolist()
        return top, [p[t].item() for t in top]

    exact = {}
    first, p_first = support_probs([])
    for a, pa in zip(first, p_first):
        second, p_second = support_probs([a])
        for b, pb in zip(second, p_second):
            third, p_third = support_probs([a, b])
            for c, pc in zip(third, p_third):
                exact[(a, b, c)] = pa * pb * pc
    assert min(exact.values()) > 0.01, "a near-empty outcome would make the test weak"

    greedy = mlx_lm_greedy(model, prompt, 3)  # drafts: the greedy path, often right, often not
    oracle = OracleDrafter(real.config, len(prompt), greedy).bind(target)
    policy = make_policy(real.block_size, 3)
    mx.random.seed(11)
    counts, rewinds, trials = dict.fromkeys(exact, 0), 0, 1500
    for _ in range(trials):
        rounds = list(speculative_rounds(target, oracle, mx.array(prompt), policy, params, 3))
        counts[tuple(t for r in rounds for t in r.tokens)[:3]] += 1
        rewinds += any(r.accepted < r.drafted for r in rounds)
    assert rewinds > trials // 4, "too few partial acceptances to exercise the rollback"
    outcome = {k: i for i, k in enumerate(exact)}  # each 3-token outcome as one category
    draws = [outcome[k] for k, n in counts.items() for _ in range(n)]
    assert_distributed_as(draws, [exact[k] / sum(exact.values()) for k in exact])


def quantized_hybrid():
    config = dict(COMMON, model_type="qwen3_5", **FAMILIES["qwen3_5"])
    model_class, args_class = _get_classes(config)
    mx.random.seed(5)
    model = model_class(args_class.from_dict(config))
    model.update(tiny_model("qwen3_5").parameters())  # the same weights as the float32 tests
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("asked", [5, 16])
def test_quantized_hybrid_is_lossless_under_the_width_clamp(asked):
    model = quantized_hybrid()
    target, real = bound_pair(model)
    want = mlx_lm_greedy(model, PROMPT, 30)
    errors = {2, 3, 9, 15, 16}
    oracle = OracleDrafter(real.config, len(PROMPT), want, errors).bind(target)
    policy = make_policy(real.block_size, asked, quantized=has_quantized_layers(target.model),
                         controls=DraftControls(prompt_lookup=False))
    assert policy.max_width == 5 and (asked == 5 or "clamped from 16 to 5" in policy.notes[0])
    rounds = list(speculative_rounds(target, oracle, mx.array(PROMPT), policy, SamplingParams(), 30))
    assert [t for r in rounds for t in r.tokens] == want
    assert [r.accepted for r in rounds[1:]] == expected_acceptance(30, 5, errors)


def tiny_recurrent(model_type, **fields):
    config = dict(model_type=model_type, vocab_size=64, hidden_size=32, num_hidden_layers=2, **fields)
    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


@pytest.mark.parametrize("model_type,fields,layer_type", [
    ("mamba", dict(intermediate_size=64, state_size=8, conv_kernel=4, use_bias=False, use_conv_bias=True,
                   time_step_rank=4), "MambaBlock"),
    ("rwkv7", dict(intermediate_size=64, norm_eps=1e-5, head_dim=16, a_low_rank_dim=8, v_low_rank_dim=8,
                   gate_low_rank_dim=8, decay_low_rank_dim=8), "Rwkv7"),
])
def test_unsupported_recurrent_layers_are_refused_in_one_line(model_type, fields, layer_type):
    with pytest.raises(DFlashError) as refused:
        Target(tiny_recurrent(model_type, **fields))
    message = str(refused.value)
    assert "\n" not in message
    assert f"target '{model_type}' keeps state that cannot be rolled back" in message
    assert layer_type in message and "ArraysCache" in message and "GatedDeltaNet" in message


def test_rounds_patch_nothing_and_free_their_tapes():
    model = tiny_model("qwen3_5")
    target, _ = bound_pair(model)
    layer = model.language_model.model.layers[0]
    module, children = layer.linear_attn, dict(layer.linear_attn.children())
    class_call = qwen3_5.GatedDeltaNet.__call__

    cache = target.make_cache()
    target.prefill(mx.array(PROMPT), cache)
    assert target._pending is None  # the prefill keeps no tape
    target.forward(mx.array([[1, 2, 3, 4, 5]]), cache)
    tapes = target._pending[2]
    assert len(tapes) == 2 and all(t.records for t in tapes)
    assert layer.linear_attn is module and dict(module.children()) == children  # put back after the call
    target.trim(cache, 3)
    assert target._pending is None and all(not t.records and t.snapshot is None for t in tapes)
    assert layer.linear_attn is module and dict(module.children()) == children
    assert qwen3_5.GatedDeltaNet.__call__ is class_call
    assert all(type(c) is not ArraysCache or c[1].shape == (1, 4, 16, 16) for c in cache)


def test_width_auto_probe_measures_a_hybrid_target():
    """`--width auto` probes verify costs over a pre-filled context; recurrent layers need no filling."""
    from mlx_dflash.policies.verify_costs import filled_cache, probe_verify_costs

    target, _ = bound_pair(tiny_model("qwen3_5"))
    costs = probe_verify_costs(target, 8, context=40)
    assert sorted(costs) == [1, 2, 3, 4, 6, 8] and all(c > 0 for c in costs.values())
    assert [costs[w] for w in sorted(costs)] == sorted(costs.values())  # more rows never cost less
    cache = filled_cache(target, 40)
    assert [c.offset for c in cache if not isinstance(c, ArraysCache)] == [40, 40]


def test_rollback_from_an_empty_cache():
    """A first forward without a prefill, partly rolled back, leaves the state of its kept rows."""
    target, _ = bound_pair(tiny_model("qwen3_5"))
    cache, plain = target.make_cache(), target.make_cache()
    target.forward(mx.array([PROMPT[:6]]), cache)
    target.trim(cache, 4)
    target.forward(mx.array([PROMPT[:2]]), plain)
    target.trim(plain, 0)
    for c, p in zip(cache, plain):
        if isinstance(c, ArraysCache):
            assert all(mx.allclose(a, b, atol=1e-5).item() for a, b in zip(c.cache, p.cache))


def test_rolling_back_more_than_the_last_forward_is_refused():
    target, _ = bound_pair(tiny_model("qwen3_5"))
    cache = target.make_cache()
    target.prefill(mx.array(PROMPT), cache)
    target.forward(mx.array([[1, 2, 3]]), cache)
    with pytest.raises(DFlashError, match="cannot roll back 4 positions"):
        target.trim(cache, 4)
    target.forward(mx.array([[1, 2, 3]]), cache)
    with pytest.raises(DFlashError, match="cannot roll back 1 positions"):
        target.trim(target.make_cache(), 1)
