"""The DFlash decoding loop (reference 3.1) and the generation API around it.

`speculative_rounds` is the whole algorithm: prefill, then rounds of draft, verify, accept, roll back.
`stream_generate` adds tokenization, stop handling, streaming text and statistics.
"""

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional

import mlx.core as mx

from .costs import load_cost_table, probe_verify_costs
from .distributed import SingleProcess
from .drafter import DFlashDraftModel
from .errors import DFlashError
from .lookup import PromptLookup, looked_up_count, with_lookup
from .policy import CostAwarePolicy, WidthPolicy, has_quantized_layers, make_policy
from .sampling import SamplingParams, accept, choose, pick
from .target import Target


@dataclass
class Round:
    tokens: list  # tokens this round emits (accepted drafts, then the target's own token)
    drafted: int  # drafted tokens the target verified
    accepted: int  # of those, how many it kept
    looked_up: int = 0  # of those, how many prompt lookup proposed (lookup.py)


def speculative_rounds(
    target: Target,
    drafter: DFlashDraftModel,
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


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0  # verify rounds (the prefill's first token is not one)
    accepted_lengths: Counter = field(default_factory=Counter)  # tokens per round, bonus included
    widths: Counter = field(default_factory=Counter)  # verify width (rows) chosen per round
    looked_up_rounds: int = 0  # rounds that verified prompt lookup's drafts
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    peak_memory_gb: float = 0.0
    block_size: int = 0
    max_width: int = 0
    notes: list = field(default_factory=list)
    finish_reason: Optional[str] = None

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens per verify round, bonus token included."""
        total = sum(n * c for n, c in self.accepted_lengths.items())
        return total / self.rounds if self.rounds else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        decoded = self.generated_tokens - 1  # the first token belongs to the prefill
        return decoded / self.decode_seconds if self.decode_seconds and decoded > 0 else 0.0

    def summary(self) -> str:
        hist = " ".join(f"{n}:{self.accepted_lengths[n]}" for n in sorted(self.accepted_lengths))
        lines = [
            f"prompt: {self.prompt_tokens} tokens, {self.prefill_tps:.1f} tokens/s",
            f"generation: {self.generated_tokens} tokens, {self.decode_tps:.1f} tokens/s, "
            f"{self.rounds} rounds, tau {self.tau:.2f} (block {self.block_size}, verify width <= {self.max_width})",
            f"accepted length histogram (tokens per round: rounds): {hist or '-'}",
            "verify widths chosen (rows: rounds): " + " ".join(f"{w}:{self.widths[w]}" for w in sorted(self.widths))
            + f"; prompt lookup drafted {self.looked_up_rounds} of {self.rounds} rounds",
            f"peak memory: {self.peak_memory_gb:.2f} GB, finish: {self.finish_reason}",
        ]
        return "\n".join(lines)


@dataclass
class GenerationResponse:
    text: str  # new text since the previous response
    tokens: list  # tokens emitted this round (after stop handling)
    round: Round
    stats: GenerationStats  # running totals; final once finish_reason is set


def build_policy(target, drafter, block_size=None, force_width=False, p_min=0.0, n_min=0, auto=False,
                 cost_table=None, prompt_lookup=True) -> WidthPolicy:
    """The width policy for this pair: fixed widths with the quantized rule and the draft controls, or
    (auto) the cost-aware policy over the same allowed widths, costed by a table or a start-up probe.
    prompt_lookup: where the drafter is unsure, draft what followed the context's last tokens before."""
    policy = make_policy(
        drafter.block_size,
        block_size,
        quantized=has_quantized_layers(target.model) or has_quantized_layers(drafter),
        wide_kernels=target.wide_kernels,
        force_width=force_width,
        p_min=p_min,
        n_min=n_min,
        prompt_lookup=prompt_lookup,
    )
    if not auto:
        return policy
    if cost_table:
        costs, source = load_cost_table(cost_table), f"cost table {cost_table}"
    else:
        costs, source = probe_verify_costs(target, policy.max_width), "a start-up probe"
    notes = policy.notes + [f"width auto: verify costs from {source}, refined as rounds run"]
    return CostAwarePolicy(policy.block_size, policy.max_width, costs, notes, p_min, n_min, prompt_lookup)


def encode_prompt(tokenizer, prompt: str, chat_template: Optional[bool] = None) -> list:
    """Token ids of the prompt, through the tokenizer's chat template when it has one (or when asked)."""
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if chat_template is None:
        chat_template = has_template
    if chat_template:
        if not has_template:
            raise DFlashError("the target's tokenizer has no chat template; use --no-chat-template")
        messages = [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(prompt))


def stream_generate(
    target: Target,
    drafter: DFlashDraftModel,
    tokenizer,
    prompt,
    *,
    max_tokens: int = 256,
    sampling: SamplingParams = SamplingParams(),
    block_size: Optional[int] = None,
    policy: Optional[WidthPolicy] = None,
    force_width: bool = False,
    seed: Optional[int] = None,
    chat_template: Optional[bool] = None,
    ranks: SingleProcess = SingleProcess(),
) -> Iterator[GenerationResponse]:
    """Stream text as the target accepts it. `prompt` is a string or a list of token ids."""
    if max_tokens < 1:
        raise DFlashError(f"max_tokens must be at least 1, got {max_tokens}")
    if not drafter.is_bound:
        drafter.bind(target)
    if policy is None:
        policy = build_policy(target, drafter, block_size, force_width)
    ids = encode_prompt(tokenizer, prompt, chat_template) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise DFlashError("the prompt is empty")
    if seed is not None:
        mx.random.seed(seed)

    stop_ids = set(tokenizer.eos_token_ids)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    stats = GenerationStats(
        prompt_tokens=len(ids), block_size=policy.block_size, max_width=policy.max_width, notes=list(policy.notes)
    )
    mx.reset_peak_memory()
    tic = time.perf_counter()
    rounds = speculative_rounds(target, drafter, mx.array(ids), policy, sampling, max_tokens, ranks=ranks)
    for i, rnd in enumerate(rounds):
        if i == 0:
            stats.prefill_seconds = time.perf_counter() - tic
            tic = time.perf_counter()
        else:
            stats.rounds += 1
            stats.accepted_lengths[len(rnd.tokens)] += 1
            stats.widths[rnd.drafted + 1] += 1
            stats.looked_up_rounds += rnd.looked_up > 0
            stats.decode_seconds = time.perf_counter() - tic

        # Stop at the first stop token (not emitted) or at max_tokens; nothing past either.
        tokens = rnd.tokens[: max_tokens - stats.generated_tokens]
        stop_at = next((j for j, t in enumerate(tokens) if t in stop_ids), None)
        if stop_at is not None:
            stats.generated_tokens += stop_at + 1
            tokens, stats.finish_reason = tokens[:stop_at], "stop"
        else:
            stats.generated_tokens += len(tokens)
            if stats.generated_tokens >= max_tokens:
                stats.finish_reason = "length"

        for t in tokens:
            detokenizer.add_token(t)
        if stats.finish_reason:
            detokenizer.finalize()
            stats.peak_memory_gb = mx.get_peak_memory() / 1e9
            rounds.close()
        yield GenerationResponse(detokenizer.last_segment, tokens, rnd, stats)
        if stats.finish_reason:
            return


def generate(target, drafter, tokenizer, prompt, **kwargs):
    """Generate in one call. Returns (text, token ids, stats)."""
    text, tokens, stats = [], [], None
    for response in stream_generate(target, drafter, tokenizer, prompt, **kwargs):
        text.append(response.text)
        tokens.extend(response.tokens)
        stats = response.stats
    return "".join(text), tokens, stats

