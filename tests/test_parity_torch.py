"""Our MLX drafter against z-lab's PyTorch DFlashDraftModel (PyPI dflash==0.1.0), same weights.

The reference module is extracted from the published wheel (sha256-checked) and imported from that
file (the `reference` fixture in conftest.py); the package itself is not installed (its exact pins would fight ours, and it installs a
`dflash` command of its own).
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dflash.models.config import parse_config
from mlx_dflash.models.dflash import Borrowed
from mlx_dflash.models.loader import init_drafter
from conftest import TORCH_MISSING

torch = pytest.importorskip("torch", reason=TORCH_MISSING)

# float32 end to end; differences come from summation order only.
TOLERANCE = dict(rtol=1e-4, atol=1e-4)
H, VOCAB = 64, 97


def tiny_config(**overrides):
    cfg = dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=H, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
        num_target_layers=8, attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False,
        dflash_config=dict(block_size=8, mask_token_id=VOCAB - 1, target_layer_ids=[1, 3, 5]),
    )
    cfg.update(overrides)
    return cfg


def build_pair(reference, cfg, seed=0):
    """Our drafter with random weights and the PyTorch reference holding the same weights."""
    ours = init_drafter(parse_config(cfg), seed=seed)
    # Non-trivial norm weights, so a norm applied in the wrong place shows.
    rng = np.random.default_rng(seed)
    norms = [(k, mx.array(1 + 0.1 * rng.standard_normal(v.shape), dtype=mx.float32))
             for k, v in tree_flatten(ours.parameters()) if k.endswith("norm.weight")]
    ours.load_weights(norms, strict=False)
    config = reference.Qwen3Config(**cfg)
    config._attn_implementation = "sdpa"
    theirs = reference.DFlashDraftModel(config).eval()
    state = {k: torch.from_numpy(np.array(v)) for k, v in tree_flatten(ours.parameters())}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)

    embed = mx.random.normal((VOCAB, H), key=mx.random.key(seed + 1))
    head = mx.random.normal((VOCAB, H), key=mx.random.key(seed + 2)) * 0.2
    ours._borrowed = Borrowed(embed=lambda ids: embed[ids], head=lambda h: h @ head.T, embed_scale=1.0)
    return ours, theirs, embed, head


def torch_logits(theirs, embed, head, block_ids, context, start):
    """Reference draft logits (rows 1..L-1) with the whole context given at once."""
    L = block_ids.shape[1]
    noise = torch.from_numpy(np.array(embed[block_ids]))
    ctx = torch.from_numpy(np.array(context))
    positions = torch.arange(start + L)[None]
    with torch.no_grad():
        hidden = theirs(position_ids=positions, noise_embedding=noise, target_hidden=ctx)
        out = theirs.compute_logits(hidden[:, 1:], lambda h: h @ torch.from_numpy(np.array(head)).T)
    return out.numpy()


CONFIGS = {
    "full_attention": {},
    # use_sliding_window: transformers' Qwen3Config ignores sliding_window without it.
    "sliding_causal": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                           use_sliding_window=True),
    "sliding_noncausal": dict(layer_types=["sliding_attention", "sliding_attention"], sliding_window=5,
                              use_sliding_window=True, is_causal=False),
    "causal_full": dict(is_causal=True),
    "logit_transforms": dict(dflash_config=dict(block_size=8, mask_token_id=VOCAB - 1, target_layer_ids=[2, 6],
                                                output_multiplier=0.5, final_logit_softcapping=3.0)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_draft_logits_match_reference(reference, name):
    cfg = tiny_config(**CONFIGS[name])
    ours, theirs, embed, head = build_pair(reference, cfg)
    n_feat = len(cfg["dflash_config"]["target_layer_ids"]) * H
    S, L = 11, 8
    context = mx.random.normal((1, S, n_feat), key=mx.random.key(7))
    block = mx.array([[5] + [VOCAB - 1] * (L - 1)])

    got = ours(block, context, ours.make_cache())
    want = torch_logits(theirs, embed, head, block, context, start=S)
    assert got.shape == (1, L - 1, VOCAB)
    np.testing.assert_allclose(np.array(got), want, **TOLERANCE)


@pytest.mark.parametrize("name", ["full_attention", "sliding_causal"])
def test_incremental_context_matches_reference(reference, name):
    """Context given across three calls through our cache == the reference given it all at once."""
    cfg = tiny_config(**CONFIGS[name])
    ours, theirs, embed, head = build_pair(reference, cfg, seed=3)
    n_feat = len(cfg["dflash_config"]["target_layer_ids"]) * H
    context = mx.random.normal((1, 13, n_feat), key=mx.random.key(11))
    L, cache = 8, ours.make_cache()
    for end in (6, 9, 13):
        begin = cache[0].offset
        block = mx.array([[end % VOCAB] + [VOCAB - 1] * (L - 1)])
        got = ours(block, context[:, begin:end], cache)
        want = torch_logits(theirs, embed, head, block, context[:, :end], start=end)
        np.testing.assert_allclose(np.array(got), want, **TOLERANCE)
