"""Tiny random instances of mlx-lm's own model classes, one per target family the adapter supports (float32),
and an untrained drafter bound to each: the pairs of test_families.py and test_hybrid.py.

Sliding-window families get 8-token windows, so sequences of a few dozen tokens run past them.
"""

import mlx.core as mx
from mlx.utils import tree_map_with_path
from mlx_lm.utils import _get_classes

from mlx_dflash.models.loader import drafter_config_for, init_drafter
from mlx_dflash.models.target import Target

COMMON = dict(hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=211)
# The families added for the published drafters run with 4 layers (2 recurrent + 2 attention for hybrids).
HYBRID = dict(num_hidden_layers=4, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2, head_dim=16,
              tie_word_embeddings=False)
MOE = dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MLA = dict(num_hidden_layers=4, num_key_value_heads=4, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4,
           num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
           qk_nope_head_dim=16, n_group=1, topk_group=1, first_k_dense_replace=1, moe_layer_freq=1,
           max_position_embeddings=512, routed_scaling_factor=1.0, topk_method="noaux_tc", scoring_func="sigmoid",
           norm_topk_prob=True, attention_bias=False)
GEMMA4 = dict(num_hidden_layers=4, head_dim=16, global_head_dim=32, num_key_value_heads=1, num_kv_shared_layers=2,
              sliding_window=8, sliding_window_pattern=2, vocab_size_per_layer_input=211, hidden_size_per_layer_input=8)
FAMILIES = {  # test name -> config (model_type is the name unless given)
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=16, max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0),
    "gemma3_text": dict(head_dim=16, sliding_window=8, sliding_window_pattern=3, query_pre_attn_scalar=16),
    "qwen3_5": dict(HYBRID),
    "qwen3_5_moe": dict(HYBRID, **MOE, shared_expert_intermediate_size=64),
    "qwen3_next": dict(HYBRID, **MOE, decoder_sparse_step=1, shared_expert_intermediate_size=64, mlp_only_layers=[],
                       rope_theta=10000.0, partial_rotary_factor=0.25, max_position_embeddings=512),
    "qwen3_moe": dict(MOE, decoder_sparse_step=1, mlp_only_layers=[], head_dim=16, rope_theta=10000.0,
                      tie_word_embeddings=False, max_position_embeddings=512, norm_topk_prob=True),
    "gpt_oss": dict(num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8, rope_theta=10000),
    "gemma4_text": dict(GEMMA4),
    "gemma4_text_moe": dict(GEMMA4, model_type="gemma4_text", enable_moe_block=True, num_experts=4,
                            top_k_experts=2, moe_intermediate_size=32),
    "gemma4": dict(text_config=dict(COMMON, **GEMMA4)),
    "deepseek_v3": dict(MLA),
    "kimi_k25": dict(text_config=dict(COMMON, model_type="deepseek_v3", **MLA)),
    "glm_moe_dsa": dict(MLA, index_head_dim=16, index_n_heads=2, index_topk=64,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}),
    "muse_glimmer": dict(num_hidden_layers=4, head_dim=16, sliding_window=8, max_position_embeddings=512),
    "minimax": dict(num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=0, rotary_dim=8, head_dim=16,
                    rope_theta=10000.0, max_position_embeddings=512),
}
DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
PROMPT = [5, 17, 42, 99, 3, 150, 7, 61, 88, 23, 11, 190]
_models = {}


def tiny_model(family: str):
    """A tiny random float32 instance of the family's mlx-lm class (built once per session)."""
    if family not in _models:
        config = dict(COMMON, model_type=family)
        config.update(FAMILIES[family])
        model_class, args_class = _get_classes(config)
        mx.random.seed(sum(map(ord, family)))
        model = model_class(args_class.from_dict(config))
        # Larger weights than the default init, so the greedy continuation is not one repeated token
        # (Gemma 4's tied, scaled embedding would then dominate, so it keeps its own).
        keep = "embed" if family.startswith("gemma4") else None
        model.update(tree_map_with_path(lambda k, p: p * 3 if p.ndim == 2 and not (keep and keep in k) else p,
                                        model.parameters()))
        mx.eval(model.parameters())
        _models[family] = model
    return _models[family]


def bound_pair(model, block_size=16):
    """A Target and an untrained drafter bound to it (the drafter also sets the captured layers)."""
    target = Target(model)
    drafter = init_drafter(drafter_config_for(target, num_layers=1, block_size=block_size, num_target_features=2),
                           seed=1)
    return target, drafter.bind(target)


def tiny_chat_target(family: str, vocab_size: int, seed: int, **overrides) -> Target:
    """A tiny random target of the family over a real tokenizer's vocabulary (to speak its chat template),
    weights scaled up as in tiny_model."""
    config = dict(COMMON, model_type=family, vocab_size=vocab_size)
    config.update(FAMILIES[family])
    config.update(overrides)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map_with_path(lambda k, p: p * 3 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return Target(model)
