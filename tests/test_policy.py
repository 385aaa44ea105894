"""The width policy: the quantized `<= 5` rule, its override, and losslessness under the clamp."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from conftest import mlx_lm_greedy
from mlx_dflash.decoding.batch_decoder import speculative_rounds
from mlx_dflash.generate import generate
from mlx_dflash.models.loader import drafter_config_for, init_drafter
from mlx_dflash.errors import DFlashError
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import QUANTIZED_MAX_WIDTH, WidthOptions, has_quantized_layers, make_policy
from mlx_dflash.decoding.sampling import SamplingParams
from mlx_dflash.models.target import Target


def test_float_models_verify_the_asked_width():
    assert make_policy(16).max_width == 16
    assert make_policy(16, 8).max_width == 8
    assert make_policy(16, 8).notes == []


def test_quantized_models_are_clamped_to_five_and_say_so():
    policy = make_policy(16, quantized=True)
    assert policy.max_width == 5
    assert policy.block_size == 16  # the drafter still drafts its whole block
    assert len(policy.notes) == 1 and "clamped from 16 to 5" in policy.notes[0]
    assert make_policy(16, 4, quantized=True).max_width == 4 and make_policy(16, 4, quantized=True).notes == []


def test_force_width_keeps_the_width_with_a_warning_naming_the_cost():
    policy = make_policy(16, 12, quantized=True, force_width=True)
    assert policy.max_width == 12
    assert "warning" in policy.notes[0] and "3x" in policy.notes[0]


def test_wide_kernels_lift_the_clamp():
    policy = make_policy(16, quantized=True, wide_kernels=True)
    assert policy.max_width == 16 and policy.notes == []


@pytest.mark.parametrize("block_size", [0, 17])
def test_block_size_outside_the_trained_range_is_refused(block_size):
    with pytest.raises(DFlashError, match="1..16"):
        make_policy(16, block_size)


def test_width_never_exceeds_what_may_still_be_emitted():
    policy = make_policy(16, 8)
    assert [policy.width(1, r) for r in (1, 3, 8, 100)] == [1, 3, 8, 8]


@pytest.fixture(scope="module")
def quantized_pair(smollm2):
    """A tiny random Llama with SmolLM2's vocabulary, 4-bit quantized, and a random drafter for it."""
    _, tokenizer = smollm2
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                           vocab_size=len(tokenizer.vocab), tie_word_embeddings=True)
    mx.random.seed(3)
    model = llama.Model(args)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    target = Target(model)
    drafter = init_drafter(drafter_config_for(target, num_layers=1, block_size=8, num_target_features=2), seed=4)
    return target, drafter.bind(target), tokenizer


def test_quantized_target_is_clamped_and_lossless(quantized_pair):
    target, drafter, tokenizer = quantized_pair
    assert has_quantized_layers(target.model)
    ids = tokenizer.encode("The quick brown fox")
    want = mlx_lm_greedy(target.model, ids, 12)
    policy = make_policy(drafter.block_size, quantized=True)
    rounds = list(speculative_rounds(target, drafter, mx.array(ids), policy, SamplingParams(), 12))
    assert [t for r in rounds for t in r.tokens] == want
    assert max(r.drafted for r in rounds) == QUANTIZED_MAX_WIDTH - 1  # 5 rows: anchor + 4 drafts


def test_generate_reports_the_clamp_in_its_stats(quantized_pair):
    target, drafter, tokenizer = quantized_pair
    stats = generate(target, drafter, tokenizer, "Hello", max_tokens=4).stats
    assert stats.max_width == 5 and any("clamped" in n for n in stats.notes)
    forced = generate(target, drafter, tokenizer, "Hello", max_tokens=4,
                      policy=build_policy(target, drafter, WidthOptions(force_width=True))).stats
    assert forced.max_width == 8 and any("warning" in n for n in forced.notes)


def test_a_batch_on_a_quantized_model_lets_dcut_cells_decide_and_keeps_the_clamp_for_a_fixed_width(quantized_pair):
    """A batched verify's matmuls see rows x width (2 rows at width 5 are 10 rows): D-cut times those cells, so
    the per-request clamp to 5 does not bound it; a fixed width keeps the clamp."""
    target, drafter, _ = quantized_pair
    dcut = build_policy(target, drafter, WidthOptions("auto"), 2)
    assert dcut.max_width == drafter.block_size == 8
    assert any("rows x width" in n for n in dcut.notes) and not any("clamped" in n for n in dcut.notes)
    assert max(dcut.guessed[2]) == 8  # every width's cost at 2 rows was probed
    fixed = build_policy(target, drafter, WidthOptions(), 2)
    assert fixed.max_width == QUANTIZED_MAX_WIDTH and any("clamped" in n for n in fixed.notes)
    assert build_policy(target, drafter, WidthOptions("auto", n_max=5), 2).max_width == 6


def test_the_python_api_defaults_to_width_auto_and_a_seeded_sample_to_a_fixed_width(tiny_chat_pair, monkeypatch):
    """One default for every entry point (policies/width.py DEFAULT_WIDTH); a seeded sample keeps the fixed
    trained block, since which tokens a seed draws depends on the widths verified."""
    from mlx_dflash.decoding import generation_options
    from mlx_dflash.decoding.batch_decoder import batch_generate

    target, tokenizer, drafter = tiny_chat_pair
    auto = generate(target, drafter, tokenizer, [1, 2, 3], max_tokens=4)
    assert any(n.startswith("width auto:") for n in auto.stats.notes)
    seeded = [generate(target, drafter, tokenizer, [1, 2, 3], max_tokens=6, temp=1.0, seed=4) for _ in range(2)]
    assert not any(n.startswith("width auto") for n in seeded[0].stats.notes)
    assert seeded[0].tokens == seeded[1].tokens
    assert generate(target, drafter, tokenizer, [1, 2, 3], max_tokens=4, width=3).stats.max_width == 3
    asked = []
    build = generation_options.build_policy
    monkeypatch.setattr(generation_options, "build_policy", lambda *a: asked.append(a[2].width) or build(*a))
    batched = batch_generate(target, drafter, tokenizer, [[1, 2, 3], [4, 5]], max_tokens=4)
    assert asked == ["auto"] and batched.token_ids[0] == auto.tokens
