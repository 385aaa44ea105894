"""The drafter's context window (`DFlashDraftModel.set_context_window`, `--drafter-window`): the drafter
attends to the last N context positions before its block, on one request and in a batch alike."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash.errors import DFlashError
from mlx_dflash.models.config import parse_config
from mlx_dflash.models.dflash import Borrowed
from mlx_dflash.models.loader import init_drafter

H, VOCAB, FEATURES = 64, 97, 2


def drafter(**dflash):
    config = parse_config(dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=H, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=VOCAB,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096, num_target_layers=8,
        dflash_config=dict(block_size=8, mask_token_id=VOCAB - 1, target_layer_ids=[1, 5]), **dflash))
    model = init_drafter(config, seed=0)
    embed = mx.random.normal((VOCAB, H), key=mx.random.key(1))
    head = mx.random.normal((VOCAB, H), key=mx.random.key(2)) * 0.2
    model._borrowed = Borrowed(embed=lambda ids: embed[ids], head=lambda h: h @ head.T, embed_scale=1.0)
    return model


def context(n, seed=3):
    return mx.random.normal((1, n, FEATURES * H), key=mx.random.key(seed))


def block(anchor, model):
    return mx.array([[anchor] + [model.mask_token_id] * (model.block_size - 1)])


def hidden_in_rounds(model, ctx, rounds):
    """The block's hidden rows after reading ctx in `rounds` pieces (as decoding reads it, a round at a time)."""
    cache, out = model.make_cache(), None
    for piece in np.array_split(np.arange(ctx.shape[1]), rounds):
        out = model.hidden(block(5, model), ctx[:, piece[0] : piece[-1] + 1], cache)
    return out


@pytest.mark.parametrize("layers", [{}, dict(is_causal=True)])
def test_a_window_attends_to_the_last_positions_only(layers):
    model, ctx = drafter(**layers), context(300)
    full = hidden_in_rounds(model, ctx, 1)
    model.set_context_window(1000)  # wider than the context: nothing changes
    assert mx.allclose(hidden_in_rounds(model, ctx, 3), full, atol=1e-5)
    model.set_context_window(64)
    windowed = hidden_in_rounds(model, ctx, 3)
    assert not mx.allclose(windowed, full, atol=1e-3)
    # Only the last 64 rows count: other rows before them change nothing.
    other = mx.concatenate([context(236, seed=9), ctx[:, 236:]], axis=1)
    assert mx.allclose(hidden_in_rounds(model, other, 3), windowed, atol=1e-5)


def test_a_batch_row_sees_what_one_request_sees():
    """Rows of different context lengths, each joining the batch with an empty drafter cache (as a request
    does before its first round), draft what each drafts alone."""
    from mlx_dflash.models.batch_cache import add_row, batched

    model = drafter().set_context_window(40)
    contexts = [context(120, seed=4), context(70, seed=5)]
    alone = [hidden_in_rounds(model, c, 1)[:, 1 : model.block_size] for c in contexts]
    cache = batched(model.make_cache())
    for _ in contexts:
        add_row(cache, model.make_cache())
    together = model.batch_hidden([5, 5], contexts, cache, model.block_size, model.block_size)
    for b in range(2):
        assert mx.allclose(together[b : b + 1], alone[b], atol=1e-4)


def test_a_window_under_one_position_is_refused():
    with pytest.raises(DFlashError, match="1 or more positions, not 0"):
        drafter().set_context_window(0)


def test_the_prompts_features_reach_the_drafter_as_the_prompt_is_read(tiny_chat_pair):
    """The decoder hands the prompt's features to the drafter's cache with the prefill (so no round pays
    for them): the first draft reads the last prompt row only, and the text is the target's own."""
    from conftest import chat_ids, mlx_lm_greedy
    from mlx_dflash.decoding.batch_decoder import speculative_rounds
    from mlx_dflash.policies.width import make_policy
    from mlx_dflash.decoding.sampling import SamplingParams

    target, tokenizer, model = tiny_chat_pair
    ids = chat_ids(tokenizer, "Say hello, then count to five.")
    calls = []

    class Watching:  # the real drafter, each call's new context rows written down
        block_size, is_bound = model.block_size, True

        def make_cache(self):
            return model.make_cache()

        def read_context(self, context, cache):
            calls.append(("read", context.shape[1]))
            model.read_context(context, cache)

        def draft(self, anchors, contexts, *args):
            calls.append(("draft", 0 if contexts[0] is None else contexts[0].shape[1]))
            return model.draft(anchors, contexts, *args)

    rounds = list(speculative_rounds(target, Watching(), mx.array(ids), make_policy(8, 8), SamplingParams(), 12))
    assert calls[:2] == [("read", len(ids) - 1), ("draft", 1)]
    assert [t for r in rounds for t in r.tokens][:12] == mlx_lm_greedy(target.model, ids, 12)


def test_a_drafters_config_sets_its_window_and_a_bad_one_is_refused(tmp_path):
    import json
    import shutil

    from mlx_dflash.downloads import shipped_drafter_dir
    from mlx_dflash.models.loader import drafter_from_dir

    shutil.copytree(shipped_drafter_dir(), tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    for window, want in ((None, None), (300, 300)):
        config.pop("context_window", None)
        if window:
            config["context_window"] = window
        (tmp_path / "d" / "config.json").write_text(json.dumps(config))
        assert {layer.self_attn.context_window for layer in drafter_from_dir(tmp_path / "d").layers} == {want}
    config["context_window"] = "long"
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match="context_window must be a whole number of positions, 1 or more, not 'long'"):
        drafter_from_dir(tmp_path / "d")


def test_generate_takes_the_window_and_refuses_one_under_a_position(monkeypatch, tiny_chat_pair):
    from click.testing import CliRunner

    from mlx_dflash import machine
    from mlx_dflash.cli import main as cli

    target, tokenizer, model = tiny_chat_pair
    monkeypatch.setattr("mlx_dflash.pair.load", lambda model_=None, drafter_=None: (target, model, tokenizer))
    monkeypatch.setattr(machine, "slow_blas_warning", lambda: None)
    seen = []
    monkeypatch.setattr(model, "set_context_window", lambda n: seen.append(n) or model)
    result = CliRunner().invoke(cli, ["generate", "--prompt", "Hi", "--max-tokens", "3", "--drafter-window", "256"])
    assert result.exit_code == 0, result.output
    assert seen == [256]
    result = CliRunner().invoke(cli, ["generate", "--prompt", "Hi", "--max-tokens", "3", "--drafter-window", "0"])
    assert result.exit_code == 0 and seen == [256, None]  # 0: the whole context
    result = CliRunner().invoke(cli, ["generate", "--prompt", "Hi", "--max-tokens", "3"])
    assert result.exit_code == 0 and seen == [256, None]  # without the flag, the drafter keeps its own
    result = CliRunner().invoke(cli, ["generate", "--prompt", "Hi", "--drafter-window", "-1"])
    assert result.exit_code == 2 and "--drafter-window" in result.output and "x>=0" in result.output
