"""The lossless promise in the default tier: on a tiny random model with SmolLM2's tokenizer, the public
API's text, tokens and stop handling equal mlx-lm's own greedy generation (the same checks on the real
SmolLM2 run in the slow tier: test_lossless.py)."""

import pytest

from conftest import chat_ids, mlx_lm_greedy
from mlx_dflash.generate import generate


@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_generate_equals_mlx_lm_greedy_on_a_tiny_chat_model(tiny_chat_pair, block_size):
    from mlx_lm import stream_generate as mlx_lm_stream

    target, tokenizer, drafter = tiny_chat_pair
    prompt = "Say hello."
    ids = chat_ids(tokenizer, prompt)
    want = mlx_lm_greedy(target.model, ids, 40)
    stop = next((i for i, t in enumerate(want) if t in tokenizer.eos_token_ids), len(want))
    assert len(set(want[:stop])) > 3, "degenerate reference: make the random model livelier"
    want_text = "".join(r.text for r in mlx_lm_stream(target.model, tokenizer, ids, max_tokens=40))
    out = generate(target, drafter, tokenizer, ids, max_tokens=40, width=block_size)
    text, tokens, stats = out, out.tokens, out.stats
    assert tokens == want[:stop] and text == want_text
    assert stats.finish_reason == ("stop" if stop < len(want) else "length") and stats.rounds + stats.plain_steps > 0
