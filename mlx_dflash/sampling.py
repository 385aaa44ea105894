"""Sampling and acceptance: which drafted tokens the target keeps, and what it adds.

Greedy (temperature 0): keep the longest prefix of drafts equal to the target's argmax, then add the
target's argmax at the first mismatch (the "bonus"). Output is the target's own greedy output.

Sampling (temperature > 0): speculative rejection sampling (reference 3.2). Draft i is kept with
probability min(1, p(d)/q(d)); at the first rejection a token is drawn from normalize(max(p - q, 0));
if all are kept the bonus is drawn from the last target row. Every emitted token is then distributed
exactly as `mlx_lm.generate` would draw it with the same flags: p is built with mlx-lm's own sampling
functions, in `make_sampler`'s order (top-p, min-p, top-k on the log-probabilities, then temperature).

Proposal choice: a v1 drafter proposes its argmax at every position, so q is a point mass
(q(d) = 1). Sampling each block position independently from the drafter's marginals is also exact but
gives incoherent blocks and much lower acceptance (z-lab/dflash PR #169); `rejection_accept` accepts
either form of q. DFlash 2 drafters sample their drafts from the candidate selector's walk, and
`candidate_rejection_accept` takes that q, which lives on each row's top-k candidates.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, categorical_sampling

from .errors import DFlashError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self):
        if self.temperature < 0:
            raise DFlashError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DFlashError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DFlashError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise DFlashError(f"min_p must be in [0, 1) (0 disables it), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Log-probabilities after mlx-lm's filters, exactly as `mlx_lm.generate` computes them: log-softmax
    of the logits, then `make_sampler`'s chain (top-p, then min-p, then top-k; -inf where filtered)."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logprobs.shape[-1]:  # top_k >= vocabulary keeps everything
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs


def target_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """The distribution the target samples from: softmax(filtered log-probabilities / temperature),
    what mlx-lm's `categorical_sampling` draws from."""
    return mx.softmax(filtered_logprobs(logits, params).astype(mx.float32) * (1.0 / params.temperature), axis=-1)


def sample(probs: mx.array) -> int:
    return mx.random.categorical(mx.log(probs)).item()


def pick(logits: mx.array, params: SamplingParams) -> int:
    """One token from one row of target logits: greedy, or mlx-lm's own draw."""
    return choose(logits, params).item()


def choose(logits: mx.array, params: SamplingParams) -> mx.array:
    """`pick`, unevaluated: the token as a lazy array (for steps that overlap the host, as mlx-lm's)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return categorical_sampling(filtered_logprobs(logits, params), params.temperature)


def greedy_accept(drafts: list, target_logits: mx.array) -> tuple:
    """(number of drafts kept, bonus token). target_logits [n+1, V]; row i judges drafts[i]."""
    return _kept_prefix(drafts, mx.argmax(target_logits, axis=-1).tolist())


def _kept_prefix(drafts: list, choices: list) -> tuple:
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
        accepted += 1
    return accepted, choices[accepted]


def rejection_accept(drafts: list, p: mx.array, q: Optional[mx.array] = None) -> tuple:
    """(number of drafts kept, next token) by speculative rejection sampling.

    p: target probabilities [n+1, V] (row i is the distribution of the token drafts[i] stands for);
    q: draft probabilities [n, V], or None when each draft is a point mass (argmax proposals).
    """
    n = len(drafts)
    if n:
        rows, d = mx.arange(n), mx.array(drafts)
        p_d = p[rows, d]
        q_d = mx.ones_like(p_d) if q is None else q[rows, d]
        keep = (mx.random.uniform(shape=(n,)) * q_d < p_d).tolist()
        accepted = keep.index(False) if False in keep else n
    else:
        accepted = 0
    if accepted == n:
        return n, sample(p[n])
    drafted = drafts[accepted]
    if q is None:
        residual = p[accepted].at[drafted].add(-1.0)
    else:
        residual = p[accepted] - q[accepted]
    residual = mx.maximum(residual, 0.0)
    total = residual.sum()
    # If p is (numerically) no wider than q the residual vanishes; p itself is then the exact answer.
    residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p[accepted])
    return accepted, sample(residual)


def candidate_rejection_accept(drafts: list, p: mx.array, candidates: mx.array, q: mx.array) -> tuple:
    """Rejection sampling when draft i was drawn from q[i] over the tokens candidates[i] (k distinct
    tokens per row; q is zero outside them), as DFlash 2's candidate selector proposes.

    Each q[i] may depend on the drafts before it (the selector's walk): rejection sampling stays exact,
    since draft i is only judged once drafts 0..i-1, the tokens it was conditioned on, were kept.
    """
    n = len(drafts)
    if n == 0:
        return 0, sample(p[0])
    rows, d = mx.arange(n), mx.array(drafts)
    q_d = (q[:n] * (candidates[:n] == d[:, None])).sum(axis=-1)
    keep = (mx.random.uniform(shape=(n,)) * q_d < p[rows, d]).tolist()
    accepted = keep.index(False) if False in keep else n
    if accepted == n:
        return n, sample(p[n])
    residual = mx.maximum(p[accepted].at[candidates[accepted]].add(-q[accepted]), 0.0)
    total = residual.sum()
    residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p[accepted])
    return accepted, sample(residual)


def accept(drafts: mx.array, target_logits: mx.array, params: SamplingParams, proposal=None) -> tuple:
    """(drafts as a list, number kept, next token) by this sampling mode's rule. drafts [n] may still be
    unevaluated: greedy evaluates them and the target's choices together, and brings both back at once.
    proposal: None for point-mass (argmax) drafts, or (candidates, q) for drafts sampled over candidate
    sets (see candidate_rejection_accept)."""
    n = drafts.size
    if params.greedy:
        both = mx.concatenate([drafts, mx.argmax(target_logits, axis=-1).astype(drafts.dtype)]).tolist()
        return (both[:n], *_kept_prefix(both[:n], both[n:]))
    drafts, p = drafts.tolist(), target_probs(target_logits, params)
    if proposal is not None:
        return (drafts, *candidate_rejection_accept(drafts, p, *proposal))
    return (drafts, *rejection_accept(drafts, p))
