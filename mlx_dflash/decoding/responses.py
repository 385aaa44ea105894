"""Rounds in, per-token responses out: what a generation reports, for one request or a batch's rows.

A `ResponseStream` turns the rounds of one request (decoding/decoder.py, decoding/batch_decoder.py) into
mlx-lm's per-token responses: stop tokens, max_tokens, detokenized text, and the running statistics (`GenerationStats`).
"""

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from .decoder import Round


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0  # a stop token counts, as in mlx-lm
    rounds: int = 0  # verify rounds (neither the prefill's first token nor a plain step is one)
    accepted_lengths: Counter = field(default_factory=Counter)  # tokens per verify round, bonus included
    widths: Counter = field(default_factory=Counter)  # verify width (rows) chosen per verify round
    looked_up_rounds: int = 0  # verify rounds that verified prompt lookup's drafts
    drafted_rounds: int = 0  # verify rounds that verified at least one drafted token
    plain_steps: int = 0  # plain target steps, one token each (the policy skipped the drafter), counted apart
    tree_rounds: int = 0  # verify rounds that verified a tree of drafts (decoding/tree.py), not one path
    modes: Counter = field(default_factory=Counter)  # verify rounds and plain steps by what served them (`mode`)
    verify_paths: dict = field(default_factory=dict)  # what serves the verify's matmuls and attention
    routes: list = field(default_factory=list)  # routed verify calls per shape bin (decoding/engine_report.py)
    cached_tokens: int = 0  # prompt tokens a prefix cache held (not read again)
    prefill_seconds_saved: float = 0.0  # what reading them would have cost, at recent prefill speed
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    peak_memory_gb: float = 0.0
    block_size: int = 0
    max_width: int = 0
    notes: list = field(default_factory=list)  # the policy's notes, then every fallback met
    finish_reason: Optional[str] = None

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens per verify round, bonus token included (plain steps left out)."""
        total = sum(n * c for n, c in self.accepted_lengths.items())
        return total / self.rounds if self.rounds else 0.0

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens read per second (those a prefix cache held were not read)."""
        read = self.prompt_tokens - self.cached_tokens
        return read / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        decoded = self.generated_tokens - 1  # the first token belongs to the prefill
        return decoded / self.decode_seconds if self.decode_seconds and decoded > 0 else 0.0

    @property
    def mode(self) -> str:
        """What served most of the verify rounds and plain steps, in one word: "tree" (a tree of drafts), "chain"
        (one path of the drafter's), "lookup" (one path copied from the context), "plain" (target steps); "-"
        before any."""
        return self.modes.most_common(1)[0][0] if self.modes else "-"

    def count(self, rnd: Round):
        """A verify round or plain step seen."""
        self.modes["plain" if rnd.plain else "tree" if rnd.tree else
                   "lookup" if rnd.drafted and rnd.looked_up == rnd.drafted else "chain"] += 1
        if rnd.plain:  # one token, never verified: tau and the histograms are the verify rounds'
            self.plain_steps += 1
            return
        self.rounds += 1
        self.accepted_lengths[len(rnd.tokens)] += 1
        self.widths[rnd.width] += 1
        self.looked_up_rounds += rnd.looked_up > 0
        self.drafted_rounds += rnd.drafted > 0
        self.tree_rounds += rnd.tree

    def summary(self, verbose: bool = False) -> str:
        """The statistics, as the CLI prints them; verbose adds what served the generation
        (decoding/engine_report.py)."""
        from .engine_report import engine_lines

        hist = " ".join(f"{n}:{self.accepted_lengths[n]}" for n in sorted(self.accepted_lengths))
        # once a read rate is known; a tiny model reads in milliseconds: three decimals
        saved = f", ~{self.prefill_seconds_saved:.3f} s saved" if self.prefill_seconds_saved else ""
        cached = f" ({self.cached_tokens} cached{saved})" if self.cached_tokens else ""
        tau = f"{self.tau:.2f}" if self.rounds else "-"  # the first token is the prefill's: no round, no tau
        lines = [
            f"prompt: {self.prompt_tokens} tokens{cached}, {self.prefill_tps:.1f} tokens/s",
            f"generation: {self.generated_tokens} tokens, {self.decode_tps:.1f} tokens/s, "
            f"{self.rounds} verify rounds and {self.plain_steps} plain steps, tau {tau} (block {self.block_size}, "
            f"verify width <= {self.max_width})",
            f"accepted length histogram (tokens per verify round: rounds): {hist or '-'}",
            "verify widths chosen (rows: rounds): " + " ".join(f"{w}:{self.widths[w]}" for w in sorted(self.widths))
            + f"; trees in {self.tree_rounds}; prompt lookup drafted {self.looked_up_rounds} of {self.rounds} rounds",
            f"peak memory: {self.peak_memory_gb:.2f} GB, finish: {self.finish_reason}",
        ]
        return "\n".join(lines + (engine_lines(self) if verbose else []))


@dataclass
class GenerationResponse:
    """One generated token, with mlx-lm's fields (`mlx_lm.generate.GenerationResponse`) and ours."""

    text: str  # new text since the previous response
    token: int
    logprobs: Optional[mx.array]  # [V] the target's log-probabilities for this token's position
    from_draft: bool  # a drafted token the target kept (else the target's own choice)
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: Optional[str] = None  # "stop" or "length" on the last response
    round: Optional[Round] = None  # the round that emitted this token (its tokens, acceptance, width)
    stats: Optional[GenerationStats] = None  # running totals; final once finish_reason is set



class ResponseStream:
    """One request's rounds as per-token responses, up to its first stop token or max_tokens. The first
    round fed is the prefill's token; `started` is when reading the prompt began (perf_counter)."""

    def __init__(self, tokenizer, stats: GenerationStats, max_tokens: int, started: float):
        self.stats, self.max_tokens = stats, max_tokens
        self.stop_ids = set(tokenizer.eos_token_ids)
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.clock = started
        self.rounds_fed = 0

    @property
    def finished(self) -> bool:
        return self.stats.finish_reason is not None

    def feed(self, rnd: Round) -> list:
        stats = self.stats
        if self.rounds_fed == 0:
            stats.prefill_seconds = time.perf_counter() - self.clock
            self.clock = time.perf_counter()
        else:
            stats.count(rnd)
            stats.decode_seconds = time.perf_counter() - self.clock
        self.rounds_fed += 1
        out = []
        for j, token in enumerate(rnd.tokens):
            # Stop at the first stop token (not part of the text) or at max_tokens; nothing past either.
            stats.generated_tokens += 1
            if token in self.stop_ids:
                stats.finish_reason = "stop"
            else:
                self.detokenizer.add_token(token)
                if stats.generated_tokens == self.max_tokens:
                    stats.finish_reason = "length"
            if stats.finish_reason:
                self.detokenizer.finalize()
                stats.peak_memory_gb = mx.get_peak_memory() / 1e9
            out.append(GenerationResponse(
                text=self.detokenizer.last_segment, token=token,
                logprobs=None if rnd.logprobs is None else rnd.logprobs[j], from_draft=j < rnd.accepted,
                prompt_tokens=stats.prompt_tokens, prompt_tps=stats.prefill_tps,
                generation_tokens=stats.generated_tokens, generation_tps=stats.decode_tps,
                peak_memory=mx.get_peak_memory() / 1e9, finish_reason=stats.finish_reason, round=rnd, stats=stats))
            if stats.finish_reason:
                break
        return out


def admitted_stream(tokenizer, policy, prompt_tokens: int, max_tokens: int, admitted: tuple,
                    prompt_cache=None) -> ResponseStream:
    """A request's response stream from the moment the scheduler admits it (its "admitted" event: the prompt
    tokens a prefix cache held, and perf_counter() when its read began): where every request's statistics
    start, one request's, a batch's rows and a server's alike."""
    cached, started = admitted
    stats = GenerationStats(prompt_tokens=prompt_tokens, block_size=policy.block_size, max_width=policy.max_width,
                            cached_tokens=cached)
    if prompt_cache is not None:
        stats.prefill_seconds_saved = prompt_cache.seconds_saved(cached)
    return ResponseStream(tokenizer, stats, max_tokens, started)
