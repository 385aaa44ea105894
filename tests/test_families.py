"""The target adapter across mlx-lm families: capture, rollback and lossless greedy decoding.

Tiny random models of each family (weights are random; what is tested is the plumbing: the layer list,
the caches, sliding windows, tied and untied heads). Gemma 3's sliding layers use ring-buffer caches in
mlx-lm; the adapter swaps in plain caches, so sequences run past the window to show the output is equal.
"""

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.utils import _get_classes

from conftest import mlx_lm_greedy
from mlx_dflash.decoder import speculative_rounds
from mlx_dflash.drafter import drafter_config_for, init_drafter
from mlx_dflash.policy import make_policy
from mlx_dflash.sampling import SamplingParams
from mlx_dflash.target import Target

COMMON = dict(hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=211)
FAMILIES = {
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=16, max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0),
    "gemma3_text": dict(head_dim=16, sliding_window=8, sliding_window_pattern=3, query_pre_attn_scalar=16),
}


def tiny_model(family: str):
    config = dict(COMMON, model_type=family, **FAMILIES[family])
    model_class, args_class = _get_classes(config)
    mx.random.seed(sum(map(ord, family)))
    model = model_class(args_class.from_dict(config))
    # Larger weights than the default init, so the greedy continuation is not one repeated token.
    model.update(tree_map(lambda p: p * 3 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_lossless_on_every_family(family, block_size):
    model = tiny_model(family)
    target = Target(model)
    drafter = init_drafter(drafter_config_for(target, num_layers=1, block_size=8, num_target_features=2), seed=1)
    drafter.bind(target)
    prompt = [5, 17, 42, 99, 3, 150, 7, 61, 88, 23, 11, 190]
    want = mlx_lm_greedy(model, prompt, 24)  # 12 + 24 positions: past Gemma's 8-token window
    assert len(set(want)) > 3, "degenerate reference: make the random model livelier"
    policy = make_policy(drafter.block_size, block_size)
    rounds = list(speculative_rounds(target, drafter, mx.array(prompt), policy, SamplingParams(), 24))
    assert [t for r in rounds for t in r.tokens] == want
