"""The target adapter across mlx-lm families: capture, rollback and lossless greedy decoding.

Tiny random instances of mlx-lm's own model classes (float32): dense, MoE, MLA (DeepSeek-V3, Kimi K2.5,
GLM-5 DSA), sliding windows with KV sharing (Gemma 3 and 4, Muse Glimmer), attention sinks (gpt-oss), and the hybrid
GatedDeltaNet targets (Qwen3.5/3.6, Qwen3-Next) whose recurrent state is rewound after each round.
Weights are random; what is tested is the plumbing: layer list, caches, windows, heads, rollback.
Sliding-window layers use ring buffers in mlx-lm; the adapter swaps in plain caches, so sequences run
past the window to show the output is equal.
"""

import mlx.core as mx
import pytest
from mlx.utils import tree_map_with_path
from mlx_lm.models.cache import ArraysCache
from mlx_lm.utils import _get_classes

from conftest import mlx_lm_greedy
from mlx_dflash.decoder import speculative_rounds
from mlx_dflash.models.loader import drafter_config_for, init_drafter
from mlx_dflash.policy import make_policy
from mlx_dflash.sampling import SamplingParams
from mlx_dflash.models.target import Target
from test_lossless import OracleDrafter, expected_acceptance

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
WIDTHS = [1, 2, 3, 5, 8, 16]
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


def emitted(target, drafter, prompt, block_size, max_tokens):
    policy = make_policy(drafter.block_size, block_size)
    rounds = list(speculative_rounds(target, drafter, mx.array(prompt), policy, SamplingParams(), max_tokens))
    return [t for r in rounds for t in r.tokens], rounds


def untrained_run(family, block_size):
    model = tiny_model(family)
    target, drafter = bound_pair(model, block_size=8)
    want = mlx_lm_greedy(model, PROMPT, 24)  # 12 + 24 positions: past the 8-token windows
    assert len(set(want)) > 3, "degenerate reference: make the random model livelier"
    assert emitted(target, drafter, PROMPT, block_size, 24)[0] == want


@pytest.mark.parametrize("family", DENSE)
@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_untrained_drafter_is_lossless_on_every_family(family, block_size):
    untrained_run(family, block_size)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in DENSE])
@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_untrained_drafter_is_lossless_on_every_new_family(family, block_size):
    untrained_run(family, block_size)


ERRORS = {2, 3, 9, 15, 16, 17, 26}  # generated indices where the oracle drafts a wrong token
N_TOKENS = 34


def oracle_run(family, width):
    model = tiny_model(family)
    target, real = bound_pair(model)
    want = mlx_lm_greedy(model, PROMPT, N_TOKENS)
    oracle = OracleDrafter(real, len(PROMPT), want, ERRORS)
    got, rounds = emitted(target, oracle, PROMPT, width, N_TOKENS)
    assert got == want, f"{family} at width {width}"
    assert [r.accepted for r in rounds[1:]] == expected_acceptance(N_TOKENS, width, ERRORS)
    if width >= 8:
        assert {r.drafted for r in rounds[1:]} >= {width - 1}  # full-width rounds ran
        assert any(r.accepted == r.drafted > 0 for r in rounds) and any(r.accepted == 0 < r.drafted for r in rounds)


# Default tier: Qwen3.5 at every width, the other hybrids at two, the other new families at one (the dense ones
# are covered by test_lossless.py on a real model); `slow`: the whole grid.
FAST_GRID = ([("qwen3_5", w) for w in WIDTHS] + [(f, w) for f in HYBRIDS[1:] for w in (3, 16)]
             + [(f, 8) for f in FAMILIES if f not in HYBRIDS + DENSE])
SLOW_GRID = [(f, w) for f in FAMILIES for w in WIDTHS if (f, w) not in FAST_GRID]


@pytest.mark.parametrize("family,width", FAST_GRID)
def test_oracle_drafter_greedy_equals_mlx_lm_at_every_width(family, width):
    oracle_run(family, width)


@pytest.mark.slow
@pytest.mark.parametrize("family,width", SLOW_GRID)
def test_oracle_drafter_greedy_equals_mlx_lm_full_grid(family, width):
    oracle_run(family, width)


def cache_arrays(cache) -> list:
    """Every array a cache list holds for the context so far (KV rows up to the offset, recurrent states)."""
    out = []
    for c in cache:
        if hasattr(c, "caches"):  # CacheList (MLA with an indexer)
            out += cache_arrays(c.caches)
        elif isinstance(c, ArraysCache):
            out += list(c.cache)
        else:
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    mx.eval(out)
    return out


def assert_arrays_close(got, want, what):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"{what}: array {i} has shape {a.shape}, plain decoding {b.shape}"
        err, scale = mx.abs(a - b).max().item(), mx.abs(b).max().item()
        assert err <= 1e-4 * max(1.0, scale), f"{what}: array {i} (max {scale:.3g}) differs from plain decoding by {err:.2g}"


# (rows verified, rows kept): kept == rows is full acceptance, 1 keeps only the anchor (no draft kept).
SCHEDULE = [(2, 1), (3, 3), (5, 2), (16, 16), (8, 1), (16, 5), (1, 1), (3, 1)]


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in DENSE[:-1] else f for f in FAMILIES])
def test_each_round_leaves_the_state_of_plain_decoding(family):
    """Logits and features of every verified row, and every cache array after each round's rollback,
    equal those of plain one-token-at-a-time decoding (within float32 rounding)."""
    model = tiny_model(family)
    target, _ = bound_pair(model)
    mx.random.seed(7)
    tokens = mx.random.randint(0, target.vocab_size, (sum(w for w, _ in SCHEDULE),)).tolist()

    plain_cache, plain = target.make_cache(), []
    target.prefill(mx.array(PROMPT), plain_cache)
    for t in tokens[: sum(k for _, k in SCHEDULE)]:
        logits, features = target.forward(mx.array([[t]]), plain_cache)
        target.trim(plain_cache, 0)
        plain.append((logits[0, 0], features[0, 0], cache_arrays(plain_cache)))

    cache, pos, rewound = target.make_cache(), 0, False
    target.prefill(mx.array(PROMPT), cache)
    for width, keep in SCHEDULE:
        logits, features = target.forward(mx.array([tokens[pos : pos + width]]), cache)
        for i in range(keep):  # rows past `keep` saw tokens plain decoding never fed
            assert_arrays_close([logits[0, i], features[0, i]], plain[pos + i][:2], f"{family} row {pos + i}")
        if keep < width and family in HYBRIDS:  # the rollback really has to change the recurrent state
            before = [a for c in cache if isinstance(c, ArraysCache) for a in c.cache]
            rewound = rewound or mx.abs(before[1] - plain[pos + keep - 1][2][1]).max().item() > 1e-2
        target.trim(cache, width - keep)
        pos += keep
        assert_arrays_close(cache_arrays(cache), plain[pos - 1][2], f"{family} cache after {pos} tokens")
    assert family not in HYBRIDS or rewound
