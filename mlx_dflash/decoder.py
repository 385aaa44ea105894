"""The DFlash decoding loop (DFlash paper, arXiv 2602.06036, Algorithm 1): prefill, then rounds of draft,
verify, accept, roll back. `speculative_rounds` is the whole algorithm; `generate.py` wraps it in the
tokenizer, stop handling, streaming text and statistics.
"""

import time
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx

from .distributed import SingleProcess
from .lookup import PromptLookup, looked_up_count, with_lookup
from .models.base import DraftModel
from .models.target import Target
from .policy import WidthPolicy
from .sampling import SamplingParams, accept, choose, pick


@dataclass
class Round:
    tokens: list  # tokens this round emits (accepted drafts, then the target's own token)
    drafted: int  # drafted tokens the target verified
    accepted: int  # of those, how many it kept
    looked_up: int = 0  # of those, how many prompt lookup proposed (lookup.py)


def speculative_rounds(
    target: Target,
    drafter: DraftModel,
    prompt: mx.array,
    policy: WidthPolicy,
    sampling: SamplingParams,
    max_tokens: int,
    prefill_step: int = 2048,
    ranks: SingleProcess = SingleProcess(),
) -> Iterator[Round]:
    """Yield the tokens of each round; the first round is the prefill's token (nothing drafted).

    ranks: under a sharded target, every rank takes rank 0's drafts (`agree`) and rank 0's acceptance
    and token with whole features (`settle`); a single process passes through (distributed.py).
    """
    cache, draft_cache = target.make_cache(), drafter.make_cache()
    history = PromptLookup(prompt.tolist())  # prompt + emitted tokens, indexed for lookup

    # Prefill: the target reads the prompt and picks the first token. The features of every prompt
    # position are context the drafter has not seen yet.
    logits, context = target.prefill(prompt, cache, prefill_step)
    anchor = pick(logits, sampling)
    _, anchor, context = ranks.settle(prompt.size - 1, anchor, context)  # as if all prompt rows were accepted
    yield Round([anchor], drafted=0, accepted=0)
    history.extend([anchor])
    produced = 1

    while produced < max_tokens:
        # The policy may skip the drafter for a while: plain target steps, overlapped as mlx-lm's own.
        plain = 0 if ranks.lockstep else policy.plain_steps(remaining=max_tokens - produced)
        if plain:
            tic = time.perf_counter()
            for token, features in plain_steps(target, cache, anchor, plain, sampling):
                if policy.max_width > 1:  # a drafter will read these rows (drafting off: none ever will)
                    context = features if context is None else mx.concatenate([context, features], axis=1)
                yield Round([token], drafted=0, accepted=0)
                history.extend([token])
            policy.observe_plain(plain, time.perf_counter() - tic)
            produced, anchor = produced + plain, token
            continue

        width = policy.width(remaining=max_tokens - produced)

        # Draft: one drafter pass over [anchor, MASK...] proposes block positions 1..width-1; where
        # its first draft is unsure, prompt lookup's copy of the context may replace it. The policy
        # may cut that on the confidence. A sampled draft brings its proposal q. Nothing is evaluated
        # here unless the policy reads the confidence: otherwise the drafter runs in the same
        # evaluation as the verify below, one host round trip per round.
        tic = time.perf_counter()
        # (made here, not at import: an MLX array belongs to the stream of the thread that made it)
        drafts, confidence, proposal, draft = mx.zeros((0,), dtype=mx.int32), [], None, None
        if width > 1:
            draft = drafter.draft(anchor, context, draft_cache, policy.block_size, width, sampling)
            if policy.prompt_lookup:
                draft = with_lookup(draft, history.propose(width - 1))
            context = None  # the drafter's cache holds it now
            drafts, proposal = draft.ids, draft.proposal
            if policy.uses_confidence:
                confidence = draft.confidence.tolist()
                drafts = drafts[: policy.cut(width, confidence, looked_up_count(draft)) - 1]
        drafts, confidence = ranks.agree(drafts, confidence)
        draft_seconds = time.perf_counter() - tic

        # Verify: the target scores [anchor, drafts] in one forward; row i judges drafts[i].
        block = mx.concatenate([mx.array([anchor], dtype=drafts.dtype), drafts])
        logits, features = target.forward(block[None], cache)
        drafts, accepted, bonus = accept(drafts, logits[0], sampling, proposal)
        accepted, bonus, kept = ranks.settle(accepted, bonus, features)
        looked_up = min(looked_up_count(draft), len(drafts))  # already evaluated with the drafts
        policy.observe(confidence, len(drafts), accepted, draft_seconds, time.perf_counter() - tic - draft_seconds,
                       looked_up)

        # Roll back: the cache keeps anchor + accepted drafts; their features join the context.
        target.trim(cache, len(drafts) - accepted)
        context = kept if context is None else mx.concatenate([context, kept], axis=1)

        new_tokens = drafts[:accepted] + [bonus]
        produced += len(new_tokens)
        yield Round(new_tokens, drafted=len(drafts), accepted=accepted, looked_up=looked_up)
        history.extend(new_tokens)
        anchor = bonus  # the next round's anchor; it enters the cache with the next verify


def plain_steps(target: Target, cache: list, anchor: int, n: int, sampling: SamplingParams) -> Iterator[tuple]:
    """n steps of the target alone from `anchor`: yields (token, features of the row that chose it).

    As mlx-lm's generate_step does, each step's forward is built and started before the host reads the
    token before it, so building the graph overlaps the computation. The last token is not run here: it
    is the next anchor, and enters the cache with the next forward."""

    def step(token: mx.array) -> tuple:
        logits, features = target.forward(token.reshape(1, 1), cache)
        target.trim(cache, 0)  # nothing to roll back: drops a hybrid target's tapes
        next_token = choose(logits[0, -1], sampling)
        mx.async_eval(next_token, features)
        return next_token, features

    current = step(mx.array([anchor]))
    for i in range(n):
        upcoming = step(current[0]) if i + 1 < n else None
        yield current[0].item(), current[1]
        current = upcoming
