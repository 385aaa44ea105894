"""Sampling and acceptance: which drafted tokens the target keeps, and what it adds.

Greedy (temperature 0): keep the longest prefix of drafts equal to the target's argmax, then add the
target's argmax at the first mismatch (the "bonus"). Output is the target's own greedy output.

Sampling (temperature > 0): speculative rejection sampling (reference 3.2). Draft i is kept with
probability min(1, p(d)/q(d)); at the first rejection a token is drawn from normalize(max(p - q, 0));
if all are kept the bonus is drawn from the last target row. Every emitted token is then distributed
exactly as the target's own sampler would draw it (p = target softmax after temperature, top-k, top-p).

Proposal choice: a v1 drafter proposes its argmax at every position, so q is a point mass
(q(d) = 1). Sampling each block position independently from the drafter's marginals is also exact but
gives incoherent blocks and much lower acceptance (z-lab/dflash PR #169); `rejection_accept` accepts
either form of q. DFlash 2 drafters sample their drafts from the candidate selector's walk, and
`candidate_rejection_accept` takes that q, which lives on each row's top-k candidates.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from .errors import DFlashError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise DFlashError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DFlashError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DFlashError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """The distribution the target samples from: softmax(logits / T), then top-k, then top-p."""
    scores = logits.astype(mx.float32) / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = mx.sort(scores, axis=-1)[..., vocab - params.top_k][..., None]
        scores = mx.where(scores >= kth, scores, -mx.inf)
    probs = mx.softmax(scores, axis=-1)
    if params.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p.
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        keep_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) < params.top_p
        keep = mx.put_along_axis(mx.zeros(probs.shape, mx.bool_), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: mx.array) -> int:
    return mx.random.categorical(mx.log(probs)).item()


def pick(logits: mx.array, params: SamplingParams) -> int:
    """One token from one row of target logits, greedy or sampled."""
    if params.greedy:
        return mx.argmax(logits, axis=-1).item()
    return sample(target_probs(logits, params))


def greedy_accept(drafts: list, target_logits: mx.array) -> tuple:
    """(number of drafts kept, bonus token). target_logits [n+1, V]; row i judges drafts[i]."""
    choices = mx.argmax(target_logits, axis=-1).tolist()
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


def accept(drafts: list, target_logits: mx.array, params: SamplingParams, proposal=None) -> tuple:
    """The acceptance rule for this sampling mode. proposal: None for point-mass (argmax) drafts, or
    (candidates, q) for drafts sampled over candidate sets (see candidate_rejection_accept)."""
    if params.greedy:
        return greedy_accept(drafts, target_logits)
    if proposal is not None:
        return candidate_rejection_accept(drafts, target_probs(target_logits, params), *proposal)
    return rejection_accept(drafts, target_probs(target_logits, params))
