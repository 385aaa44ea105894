"""Sampling and acceptance: which drafted tokens the target keeps, and what it adds.

Greedy (temperature 0): keep the longest prefix of drafts equal to the target's argmax, then add the
target's argmax at the first mismatch (the "bonus"). Output is the target's own greedy output.

Sampling (temperature > 0): speculative rejection sampling (Leviathan et al., arXiv 2211.17192;
Chen et al., arXiv 2302.01318). Draft i is kept with
probability min(1, p(d)/q(d)); at the first rejection a token is drawn from normalize(max(p - q, 0));
if all are kept the bonus is drawn from the last target row. Every emitted token is then distributed
exactly as `mlx_lm.generate` would draw it with the same flags: p is built with mlx-lm's own sampling
functions, in `make_sampler`'s order (top-p, min-p, top-k on the log-probabilities, then temperature).

Proposal choice: a v1 drafter proposes its argmax at every position, so q is a point mass
(q(d) = 1). Sampling each block position independently from the drafter's marginals is also exact but
gives incoherent blocks and much lower acceptance (z-lab/dflash PR #169); `rejection_accept` accepts
either form of q. DFlash 2 drafters sample their drafts from the candidate selector's walk, and
`rejection_accept` takes that q too, which lives on each row's top-k candidates.
"""

import math
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, categorical_sampling

from ..errors import DFlashError

FIELDS = ("temperature", "top_p", "top_k", "min_p")  # as the Python API and the HTTP APIs name them
FLAGS = ("--temp", "--top-p", "--top-k", "--min-p")  # as the command line does


def sampling_problem(temperature, top_p, top_k, min_p, names=FIELDS) -> Optional[str]:
    """What is wrong with these sampling settings, in one line naming each as `names` do (None if nothing)."""
    t, p, k, m = names
    if not all(math.isfinite(v) for v in (temperature, top_p, min_p)):
        return f"{t}, {p} and {m} must be finite numbers, got {temperature}, {top_p}, {min_p}"
    if temperature < 0:
        return f"{t} must be >= 0, got {temperature}"
    if not 0 < top_p <= 1:
        return f"{p} must be in (0, 1], got {top_p}"
    if top_k < 0:
        return f"{k} must be >= 0 (0 disables it), got {top_k}"
    if not 0 <= min_p < 1:
        return f"{m} must be in [0, 1) (0 disables it), got {min_p}"
    return None


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self):
        if problem := sampling_problem(self.temperature, self.top_p, self.top_k, self.min_p):
            raise DFlashError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def keywords(self) -> dict:
        """These settings as `stream_generate` (and mlx-lm's `make_sampler`) take them."""
        return dict(temp=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p)


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


def next_token(logits: mx.array, params: SamplingParams, key: Optional[mx.array] = None) -> mx.array:
    """The token one row of target logits picks, as a lazy array (greedy, or mlx-lm's own draw), so a
    step can be built before the host reads the token before it, as mlx-lm's generate_step does. key: a
    random stream of the caller's own (a batch row's), else MLX's global one."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    if key is None:
        return categorical_sampling(filtered_logprobs(logits, params), params.temperature)
    return mx.random.categorical(filtered_logprobs(logits, params) * (1 / params.temperature), key=key)


def _leading_true(keep: mx.array) -> mx.array:
    """How many leading entries of a boolean vector are True (0-d int32)."""
    if keep.size == 0:
        return mx.array(0, dtype=mx.int32)
    return mx.cumprod(keep.astype(mx.int32)).sum()


def rejection_accept(drafts: mx.array, p: mx.array, q: Optional[mx.array] = None,
                     candidates: Optional[mx.array] = None, key: Optional[mx.array] = None) -> tuple:
    """(number of drafts kept, next token), lazy, by speculative rejection sampling.

    p: target probabilities [n+1, V] (row i is the distribution of the token drafts[i] stands for).
    q: the drafts' proposal: None when each draft is a point mass (argmax proposals); else [n, V], or
    [n, k] over the tokens `candidates` [n, k] (k distinct tokens per row, q zero outside them), as DFlash 2's
    candidate selector proposes. Each q[i] may depend on the drafts before it (the selector's walk):
    rejection sampling stays exact, since draft i is only judged once the drafts it was conditioned on
    were kept. key: a random stream of the caller's own (a batch row's), else MLX's global one.

    Draft i is kept with probability min(1, p(d)/q(d)); at the first rejection the token is drawn from
    normalize(max(p - q, 0)) of that row, and when all are kept from p's last row. Everything stays on
    the device, so the caller reads the count and the token back at once.
    """
    n = drafts.size
    keys = (None, None) if key is None else mx.random.split(key)
    if n == 0:
        return mx.array(0, dtype=mx.int32), mx.random.categorical(mx.log(p[0]), key=keys[1])
    rows = mx.arange(n)
    p_d = p[rows, drafts]
    if q is None:
        q_d = mx.ones_like(p_d)
    elif candidates is None:
        q_d = q[rows, drafts]
    else:
        q_d = (q[:n] * (candidates[:n] == drafts[:, None])).sum(axis=-1)
    accepted = _leading_true(mx.random.uniform(shape=(n,), key=keys[0]) * q_d < p_d)
    row = mx.minimum(accepted, n - 1)  # the rejected draft's row (unused when all were kept)
    p_row = mx.take(p, row, axis=0)
    if q is None:
        residual = p_row.at[mx.take(drafts, row)].add(-1.0)
    elif candidates is None:
        residual = p_row - mx.take(q, row, axis=0)
    else:
        residual = p_row.at[mx.take(candidates, row, axis=0)].add(-mx.take(q, row, axis=0))
    residual = mx.maximum(residual, 0.0)
    total = residual.sum()
    # If p is (numerically) no wider than q the residual vanishes; p itself is then the exact answer.
    residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p_row)
    final = mx.where(accepted == n, p[n], residual)
    return accepted, mx.random.categorical(mx.log(final), key=keys[1])


def accept_rows(drafts: mx.array, logits: mx.array, samplings: list, limits: list, proposal=None,
                keys: Optional[list] = None) -> tuple:
    """(drafts kept per row [B], next token per row [B]) by each row's own sampling rule, both lazy: nothing is
    read back here, so the caller brings the drafts, this verdict and anything else of the round back in one
    host round trip. One request is the batch of one row.

    drafts [B, n]; logits [B, n+1, V], row i of a block judging its drafts[i]; row b judges only its first
    limits[b] drafts. Greedy rows keep the longest prefix equal to the target's argmax and add the argmax
    after it. A sampled row accepts by rejection sampling (`rejection_accept`), its drafts point masses
    (proposal None) or drawn from (candidates, q), each [B, n, k]; it draws from keys[b], its own random
    stream, or MLX's global one (None), and with no drafts to judge draws its token as mlx-lm would."""
    B, n = drafts.shape
    keys = keys or [None] * B
    kept, tokens = [None] * B, [None] * B
    greedy = [b for b, s in enumerate(samplings) if s.greedy]
    if greedy:
        rows = slice(None) if len(greedy) == B else mx.array(greedy)
        choices = mx.argmax(logits[rows], axis=-1).astype(drafts.dtype)
        if n:
            allowed = mx.arange(n)[None] < mx.array([limits[b] for b in greedy])[:, None]
            matches = drafts[rows] == choices[:, :n]
            count = mx.cumprod((matches & allowed).astype(mx.int32), axis=1).sum(axis=1)
        else:
            count = mx.zeros(len(greedy), mx.int32)
        token = mx.take_along_axis(choices, count[:, None], axis=1)[:, 0]
        for i, b in enumerate(greedy):
            kept[b], tokens[b] = count[i], token[i]
    for b, params in enumerate(samplings):
        if params.greedy:
            continue
        m = limits[b]
        if m == 0:
            kept[b], tokens[b] = mx.array(0, mx.int32), next_token(logits[b, 0], params, keys[b])
            continue
        p = target_probs(logits[b, : m + 1], params)
        candidates, q = (None, None) if proposal is None else (proposal[0][b, :m], proposal[1][b, :m])
        kept[b], tokens[b] = rejection_accept(drafts[b, :m], p, q, candidates, keys[b])
    return mx.stack(kept), mx.stack(tokens)
