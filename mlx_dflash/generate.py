"""Generation in one call or as a stream, as mlx-lm's `generate` and `stream_generate` offer it.

Tokenization, stop tokens, streaming text and statistics around the decoding loop (`decoder.py`).
"""

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional

import mlx.core as mx

from .decoder import Round, speculative_rounds
from .distributed import SingleProcess
from .errors import DFlashError
from .models.base import DraftModel
from .models.target import Target
from .policy import WidthPolicy, build_policy
from .sampling import SamplingParams


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
    drafter: DraftModel,
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
