"""The central promise: speculative greedy output is the target's own greedy output, token for token.

Real model (SmolLM2-135M-Instruct, float32), many prompts, every block size. An untrained drafter
exercises rejection at every position; an oracle drafter that proposes the target's own continuation
with planted errors exercises acceptance, with the acceptance lengths predicted exactly.
"""

import mlx.core as mx
import pytest

from conftest import PROMPTS, chat_ids, mlx_lm_greedy
from oracles import OracleDrafter, expected_acceptance
from mlx_dflash.decoding.batch_decoder import speculative_rounds
from mlx_dflash.generate import generate
from mlx_dflash.policies.width import DraftControls, make_policy
from mlx_dflash.decoding.sampling import SamplingParams

BLOCK_SIZES = [1, 2, 4, 5, 8, 16]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def references(smollm2):
    target, tokenizer = smollm2
    out = {}
    for prompt in PROMPTS[:10]:
        ids = chat_ids(tokenizer, prompt)
        out[prompt] = (ids, mlx_lm_greedy(target.model, ids, MAX_TOKENS))
    return out


def run_rounds(target, drafter, ids, block_size, max_tokens, prompt_lookup=True):
    policy = make_policy(drafter.block_size, block_size, controls=DraftControls(prompt_lookup=prompt_lookup))
    rounds = list(speculative_rounds(target, drafter, mx.array(ids), policy, SamplingParams(), max_tokens))
    return [t for r in rounds for t in r.tokens], rounds


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_untrained_drafter_output_equals_target_greedy(smollm2, random_drafter, references, block_size):
    target, _ = smollm2
    for prompt, (ids, want) in references.items():
        got, _ = run_rounds(target, random_drafter, ids, block_size, MAX_TOKENS)
        assert got == want, f"block {block_size}, prompt {prompt!r}"


@pytest.fixture(scope="module")
def oracle_case(smollm2):
    target, tokenizer = smollm2
    ids = chat_ids(tokenizer, PROMPTS[10])
    return ids, mlx_lm_greedy(target.model, ids, 40)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_oracle_drafter_acceptance_lengths_are_exact(smollm2, random_drafter, oracle_case, block_size):
    target, _ = smollm2
    ids, want = oracle_case
    n = len(want)
    errors = {3, 4, 11, 19, 20, 21, 33}
    oracle = OracleDrafter(random_drafter.config, len(ids), want, errors).bind(target)
    # Prompt lookup off: the acceptance asserted is the oracle's own.
    got, rounds = run_rounds(target, oracle, ids, block_size, n, prompt_lookup=False)
    assert got == want
    assert [r.accepted for r in rounds[1:]] == expected_acceptance(n, block_size, errors)
    if block_size > 4:
        assert max(r.accepted for r in rounds) >= 4  # long runs were really accepted


def test_stream_generate_stops_like_mlx_lm(smollm2, random_drafter):
    """Text and stop handling of the public API equal mlx-lm's stream_generate."""
    from mlx_lm import stream_generate as mlx_lm_stream

    target, tokenizer = smollm2
    prompt = "Say hello."
    ids = chat_ids(tokenizer, prompt)
    want_text = "".join(r.text for r in mlx_lm_stream(target.model, tokenizer, ids, max_tokens=64))
    out = generate(target, random_drafter, tokenizer, ids, max_tokens=64, width=4)
    text, tokens, stats = out, out.tokens, out.stats
    assert text == want_text
    assert stats.finish_reason in ("stop", "length")
    assert not set(tokens) & set(tokenizer.eos_token_ids)
    assert stats.generated_tokens <= 64 and stats.rounds + stats.plain_steps > 0


@pytest.mark.parametrize("block_size", [4, 16])
def test_a_prompt_read_in_small_chunks_gives_the_greedy_tokens_of_one_read_whole(smollm2, random_drafter,
                                                                                 block_size):
    """A CPU reads prompts in 128-token chunks (`machine.prefill_step`), mlx-lm's generate_step in 2048: a
    ~550-token prompt read in five chunks gives mlx-lm's greedy tokens."""
    target, tokenizer = smollm2
    document = "\n".join(f"{i + 1}. {p}" for i, p in enumerate(PROMPTS * 4)) + "\nAnswer the last question."
    ids = chat_ids(tokenizer, document)
    assert 512 < len(ids) < 2048
    want = mlx_lm_greedy(target.model, ids, MAX_TOKENS)
    policy = make_policy(random_drafter.block_size, block_size)
    rounds = speculative_rounds(target, random_drafter, mx.array(ids), policy, SamplingParams(), MAX_TOKENS,
                                prefill_step=128)
    assert [t for r in rounds for t in r.tokens] == want
