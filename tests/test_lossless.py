"""The central promise: speculative greedy output is the target's own greedy output, token for token.

Real model (SmolLM2-135M-Instruct, float32), many prompts, every block size. An untrained drafter
exercises rejection at every position; an oracle drafter that proposes the target's own continuation
with planted errors exercises acceptance, with the acceptance lengths predicted exactly.
"""

import mlx.core as mx
import pytest

from conftest import PROMPTS, chat_ids, mlx_lm_greedy
from mlx_dflash.decoder import speculative_rounds
from mlx_dflash.generate import generate
from mlx_dflash.models.dflash import DFlashDraftModel
from mlx_dflash.policy import make_policy
from mlx_dflash.sampling import SamplingParams

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
    policy = make_policy(drafter.block_size, block_size, prompt_lookup=prompt_lookup)
    rounds = list(speculative_rounds(target, drafter, mx.array(ids), policy, SamplingParams(), max_tokens))
    return [t for r in rounds for t in r.tokens], rounds


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_untrained_drafter_output_equals_target_greedy(smollm2, random_drafter, references, block_size):
    target, _ = smollm2
    for prompt, (ids, want) in references.items():
        got, _ = run_rounds(target, random_drafter, ids, block_size, MAX_TOKENS)
        assert got == want, f"block {block_size}, prompt {prompt!r}"


class OracleDrafter:
    """Proposes the target's true greedy continuation, except at planted positions (absolute indices
    into the generated tokens) where it proposes a wrong token. Tracks its position from the context it
    is given, exactly as a real drafter's context grows."""

    def __init__(self, real, prompt_len, continuation, errors):
        self.block_size, self.mask_token_id = real.block_size, real.mask_token_id
        self.is_bound = True
        self.vocab = real.config.vocab_size
        self.prompt_len, self.continuation, self.errors = prompt_len, continuation, set(errors)
        self.seen = 0

    draft = DFlashDraftModel.draft  # the real drafting step, over the oracle's hidden/logits

    def make_cache(self):
        self.seen = 0
        return []

    def hidden(self, block, context, cache):
        self.seen += context.shape[1]
        anchor_index = self.seen - self.prompt_len  # index of the anchor in the generated tokens
        proposals = [block[0, 0].item()]
        for j in range(1, block.shape[1]):
            i = anchor_index + j
            true = self.continuation[i] if i < len(self.continuation) else 0
            proposals.append((true + 1) % self.vocab if i in self.errors else true)
        return mx.array(proposals, dtype=mx.float32)[None, :, None]

    def logits(self, hidden):
        ids = hidden[..., 0].astype(mx.int32)
        return (mx.arange(self.vocab) == ids[..., None]).astype(mx.float32) * 10

    draft_logits = logits  # no draft vocabulary
    draft_tokens = DFlashDraftModel.draft_tokens
    _draft_vocab = None


def expected_acceptance(n_tokens, width, errors):
    """Accepted-draft counts per round when drafts are right except at `errors` (generated indices)."""
    produced, out = 1, []
    while produced < n_tokens:
        w = min(width, n_tokens - produced)
        anchor = produced - 1
        accepted = 0
        while accepted < w - 1 and anchor + 1 + accepted not in errors:
            accepted += 1
        out.append(accepted)
        produced += accepted + 1
    return out


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
    oracle = OracleDrafter(random_drafter, len(ids), want, errors)
    # Without prompt lookup: it would replace the oracle's drafts (confidence 0.31) with its own.
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
    assert stats.generated_tokens <= 64 and stats.rounds > 0
