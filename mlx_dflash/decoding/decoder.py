"""The DFlash decoding loop (DFlash paper, arXiv 2602.06036, section 3): prefill, then rounds of draft,
verify, accept, roll back. `speculative_rounds` is the whole algorithm; `generate.py` wraps it in the
tokenizer, stop handling, streaming text and statistics.

Host round trips: the loop reads the device back through `read` only, once per round where it can.
- Every round: the drafts, the number kept, the next token and prompt lookup's count come back
  together after the verify (greedy and sampled rounds alike: acceptance runs on the device).
- `--width auto` and `--p-min` (policies that read the drafter's confidence) add one before the verify:
  the width to verify depends on the confidence, and the verify's shape on the width.
- A plain target step reads its token once, overlapped with the next step's forward (as mlx-lm's
  generate_step), and the prefill reads its first token once.
Under a sharded target every rank also exchanges rank 0's choices (distributed.py), a round trip each.
"""

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import mlx.core as mx

from ..models.base import DraftModel
from ..models.target import Target
from ..policies.width import WidthPolicy
from .lookup import PromptLookup, with_lookup
from .sampling import SamplingParams, accept_rows, next_token


class SingleProcess:
    """The decoding loop's view of one process: nothing to agree on."""

    rank = 0
    comm_seconds = 0.0
    lockstep = False  # ranks must take every round together (no pipelined plain steps)

    def agree(self, drafts: mx.array, confidence: list) -> tuple:
        return drafts, confidence

    def settle(self, accepted: int, token: int) -> tuple:
        return accepted, token

    def whole_features(self, rows: mx.array) -> mx.array:
        return rows

    def watch(self):
        return nullcontext(self)


@dataclass
class Round:
    tokens: list  # tokens this round emits (accepted drafts, then the target's own token)
    drafted: int  # drafted tokens the target verified
    accepted: int  # of those, how many it kept
    looked_up: int = 0  # of those, how many prompt lookup proposed (decoding/lookup.py)
    logprobs: Optional[mx.array] = None  # [len(tokens), V] the target's log-probabilities, lazy
    plain: bool = False  # a plain target step: the policy skipped the drafter

    @property
    def width(self) -> int:
        """Rows the target verified (anchor included); 1 for the prefill and plain steps."""
        return self.drafted + 1


@dataclass
class DecodeState:
    """What decoding has built: the target's cache over `tokens`, the drafter's cache, and the feature rows
    of `tokens` the drafter has not read yet (`context`). The drafter's cache and the context together hold
    the features of every token in `tokens` (unless `dropped_features`: drafting off keeps none); the
    target's cache holds `tokens`, or during a run of plain steps one more (the next step's forward is
    already under way). A prefix cache keeps states and starts later requests from them (decoding/prompt_cache.py)."""

    cache: list
    draft_cache: list
    tokens: list = field(default_factory=list)
    context: Optional[mx.array] = None
    dropped_features: bool = False

    @classmethod
    def fresh(cls, target: Target, drafter: DraftModel) -> "DecodeState":
        return cls(target.make_cache(), drafter.make_cache())

    def hand_context_to(self, drafter: DraftModel):
        """The drafter's cache takes the unread feature rows now (a prompt's, as part of reading it), so that
        no round pays for them: at a long context the first draft would cost several target steps. The
        last row stays for the first draft, which always reads at least one new row."""
        if self.context is not None and self.context.shape[1] > 1:
            drafter.read_context(self.context[:, :-1], self.draft_cache)
            self.context = self.context[:, -1:]

    def extend(self, tokens: list, features: Optional[mx.array]):
        """`tokens` entered the target's cache; `features` are their rows (None: not kept)."""
        self.tokens.extend(tokens)
        if features is None:
            self.dropped_features = self.dropped_features or bool(tokens)
        else:
            self.context = features if self.context is None else mx.concatenate([self.context, features], axis=1)


def read(*arrays: mx.array) -> list:
    """The arrays' values on the host, in one round trip (one evaluation, then copies)."""
    mx.eval(*arrays)
    return [a.tolist() for a in arrays]


def log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def speculative_rounds(
    target: Target,
    drafter: DraftModel,
    prompt: mx.array,
    policy: WidthPolicy,
    sampling: SamplingParams,
    max_tokens: int,
    prefill_step: int = 2048,
    ranks: SingleProcess = SingleProcess(),
    prefill_progress: Optional[Callable[[int, int], None]] = None,
    state: Optional[DecodeState] = None,
) -> Iterator[Round]:
    """Yield the tokens of each round; the first round is the prefill's token (nothing drafted).

    state: where to start (a prefix cache's state holding a prefix of the prompt); it is kept up to date
    as rounds run, for the prefix cache to keep afterwards. ranks: under a sharded target every rank
    verifies rank 0's drafts (`agree`), keeps rank 0's verdict (`settle`) and gets the drafter's context
    features whole (`whole_features`); a single process passes everything through (distributed.py).
    """
    state = state or DecodeState.fresh(target, drafter)
    cache, draft_cache = state.cache, state.draft_cache
    history = PromptLookup(prompt.tolist())  # prompt + emitted tokens, indexed for lookup

    # Prefill: the target reads the prompt (past what the state holds) and picks the first token. The
    # features of every prompt position are context the drafter has not seen yet.
    done = len(state.tokens)
    logits, features = target.prefill(prompt[done:], cache, prefill_step, prefill_progress)
    (anchor,) = read(next_token(logits, sampling))
    _, anchor = ranks.settle(0, anchor)  # every rank takes rank 0's first token
    state.extend(prompt[done:].tolist(), ranks.whole_features(features))
    if policy.max_width > 1:
        state.hand_context_to(drafter)
    yield Round([anchor], drafted=0, accepted=0, logprobs=log_softmax(logits)[None])
    history.extend([anchor])
    produced = 1

    while produced < max_tokens:
        # The policy may skip the drafter for a while: plain target steps, overlapped as mlx-lm's own.
        plain = 0 if ranks.lockstep else policy.plain_steps(remaining=max_tokens - produced)
        if plain:
            tic = time.perf_counter()
            for token, logprobs, features in plain_steps(target, cache, anchor, plain, sampling):
                # the row of the token before entered the cache; drafting off keeps no features
                state.extend([anchor], features if policy.max_width > 1 else None)
                yield Round([token], drafted=0, accepted=0, logprobs=logprobs, plain=True)
                history.extend([token])
                anchor = token
            policy.observe_plain(plain, time.perf_counter() - tic)
            produced += plain
            continue

        policy.at_context(len(state.tokens))  # what the verify attends to: every token before the anchor
        width = policy.width(remaining=max_tokens - produced)

        # Draft: one drafter pass over [anchor, MASK...] proposes block positions 1..width-1; where
        # its first draft is unsure, prompt lookup's copy of the context may replace it. A sampled
        # draft brings its proposal q. Nothing is evaluated here unless the policy cuts on the
        # confidence: otherwise the drafter runs in the same evaluation as the verify below.
        tic = time.perf_counter()
        # (made here, not at import: an MLX array belongs to the stream of the thread that made it)
        drafts, confidence, proposal = mx.zeros((0,), dtype=mx.int32), [], None
        looked_up = mx.array(0, dtype=mx.int32)
        if width > 1:
            draft = drafter.draft(anchor, state.context, draft_cache, policy.block_size, width, sampling)
            if policy.prompt_lookup:
                draft = with_lookup(draft, history.propose(width - 1))
            state.context = None  # the drafter's cache holds it now
            drafts, proposal = draft.ids, draft.proposal
            if draft.looked_up is not None:
                looked_up = draft.looked_up
            if policy.uses_confidence:
                confidence, copied = read(draft.confidence, looked_up)
                drafts = drafts[: policy.cut(width, confidence, copied) - 1]
        drafts, confidence = ranks.agree(drafts, confidence)
        draft_seconds = time.perf_counter() - tic

        # Verify: the target scores [anchor, drafts] in one forward; row i judges drafts[i].
        block = mx.concatenate([mx.array([anchor], dtype=drafts.dtype), drafts])
        logits, features = target.forward(block[None], cache)
        accepted, bonus = accept_rows(drafts[None], logits, [sampling], [drafts.shape[0]],
                                      None if proposal is None else tuple(a[None] for a in proposal))
        drafts, accepted, bonus, looked_up = read(drafts, accepted[0], bonus[0], looked_up)
        accepted, bonus = ranks.settle(accepted, bonus)
        looked_up = min(looked_up, len(drafts))
        policy.observe(confidence, len(drafts), accepted, draft_seconds, time.perf_counter() - tic - draft_seconds,
                       looked_up)

        # Roll back: the cache keeps anchor + accepted drafts; their features join the context.
        target.trim(cache, len(drafts) - accepted)
        state.extend([anchor] + drafts[:accepted], ranks.whole_features(features[:, : accepted + 1]))

        new_tokens = drafts[:accepted] + [bonus]
        produced += len(new_tokens)
        yield Round(new_tokens, len(drafts), accepted, looked_up, log_softmax(logits[0, : accepted + 1]))
        history.extend(new_tokens)
        anchor = bonus  # the next round's anchor; it enters the cache with the next verify


def plain_steps(target: Target, cache: list, anchor: int, n: int, sampling: SamplingParams) -> Iterator[tuple]:
    """n steps of the target alone from `anchor`: yields (token, log-probabilities [1, V], features of the
    row that chose it).

    As mlx-lm's generate_step does, each step's forward is built and started before the host reads the
    token before it, so building the graph overlaps the computation. The last token is not run here: it
    is the next anchor, and enters the cache with the next forward."""

    def step(token: mx.array) -> tuple:
        logits, features = target.forward(token.reshape(1, 1), cache)
        target.trim(cache, 0)  # nothing to roll back: drops a hybrid target's tapes
        chosen = next_token(logits[0, -1], sampling)
        mx.async_eval(chosen, features)
        return chosen, log_softmax(logits[0]), features

    current = step(mx.array([anchor]))
    for i in range(n):
        upcoming = step(current[0]) if i + 1 < n else None
        yield read(current[0])[0], current[1], current[2]
        current = upcoming
