"""Tiny DFlash 2 drafters and a tiny Muse-Glimmer target for the tests.

`fixtures/dflash2-config.json` and `fixtures/dflash2-safetensors-header.json` are verbatim copies of z-lab's
test fixtures (z-lab/dflash commits 0a7587c0 and 0698f537: the config and safetensors header of the real
Muse-Glimmer DFlash 2 checkpoint). Tiny configs keep every field of the real one and shrink only sizes;
tiny checkpoints keep every tensor name and dtype of the real header, with each size mapped to its small
counterpart.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import _get_classes

FIXTURES = Path(__file__).parent / "fixtures"
REAL_CONFIG = json.loads((FIXTURES / "dflash2-config.json").read_text())
REAL_HEADER = json.loads((FIXTURES / "dflash2-safetensors-header.json").read_text())
_ST_DTYPES = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}

H, VOCAB, RANK, INTER, HEAD_DIM, HEADS, KV_HEADS = 64, 211, 16, 96, 16, 4, 2
TARGET_LAYERS = 8


def tiny_config(**dflash_overrides) -> dict:
    """The real config with small sizes: hidden 64, vocabulary 211, rank 16, 4 heads; 5 sliding
    non-causal layers (window 6 so it matters in short tests) tapping a tiny 8-layer target."""
    real = REAL_CONFIG
    cfg = json.loads(json.dumps(real))
    cfg.update(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
               head_dim=HEAD_DIM, vocab_size=VOCAB, num_target_layers=TARGET_LAYERS, sliding_window=6,
               max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    cfg["dflash_config"].update(mask_token_id=VOCAB - 1, selector_rank=RANK, selector_top_k=8,
                                target_layer_ids=[1, 2, 4, 5, 6])
    cfg["dflash_config"].update(dflash_overrides)
    return cfg


def tiny_shape(real_shape, cfg) -> list:
    """A real tensor shape with each real size replaced by the tiny config's."""
    real, d = REAL_CONFIG, cfg["dflash_config"]
    groups = lambda c: c["hidden_size"] // c["dflash_config"]["conv_group_size"]  # noqa: E731
    sizes = {
        real["hidden_size"]: cfg["hidden_size"],
        real["vocab_size"]: cfg["vocab_size"],
        real["dflash_config"]["selector_rank"]: d["selector_rank"],
        real["intermediate_size"]: cfg["intermediate_size"],
        real["head_dim"]: cfg["head_dim"],
        real["num_attention_heads"] * real["head_dim"]: cfg["num_attention_heads"] * cfg["head_dim"],
        real["num_key_value_heads"] * real["head_dim"]: cfg["num_key_value_heads"] * cfg["head_dim"],
        5 * real["hidden_size"]: len(d["target_layer_ids"]) * cfg["hidden_size"],
        2 * 2 * groups(real): 2 * d["conv_kernel_size"] * groups(cfg),
        2: 2,
    }
    return [sizes[n] for n in real_shape]


def tiny_checkpoint(cfg, seed=0) -> dict:
    """Random tensors under every name of the real header, its dtypes, tiny shapes."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, info in sorted(REAL_HEADER.items()):
        shape = tiny_shape(info["shape"], cfg)
        if name.endswith("norm.weight"):
            value = 1 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("base_kernel"):
            value = 0.5 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = mx.array(value.astype(np.float32)).astype(_ST_DTYPES[info["dtype"]])
    return out


def randomize(drafter, seed=0):
    """Non-trivial norms and convolution base taps (both start as identities), so a misplaced one shows."""
    rng = np.random.default_rng(seed)
    updates = []
    for name, value in tree_flatten(drafter.parameters()):
        if name.endswith("norm.weight"):
            updates.append((name, mx.array(1 + 0.1 * rng.standard_normal(value.shape), dtype=value.dtype)))
        elif name.endswith("base_kernel"):
            updates.append((name, mx.array(0.5 * rng.standard_normal(value.shape), dtype=value.dtype)))
        elif name.endswith("codebook.weight"):  # livelier pairwise scores than the default init
            updates.append((name, value * 3))
    drafter.load_weights(updates, strict=False)
    mx.eval(drafter.parameters())
    return drafter


def tiny_glimmer(seed=0):
    """A random 8-layer mlx-lm Muse-Glimmer ([local x3, global] layers, window 8, gated attention)."""
    config = dict(model_type="muse_glimmer", hidden_size=H, num_hidden_layers=TARGET_LAYERS, intermediate_size=128,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB,
                  sliding_window=8, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Larger weights than the default init, so the greedy continuation is not one repeated token.
    model.update(tree_map(lambda p: p * 3 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model
