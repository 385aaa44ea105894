"""Verify depth under load: how many rows a batch of requests verifies each round (batch_decoder.py).

`BatchPolicy` is the fixed width, with llama.cpp's draft controls (p-min, n-min) taken over the batch.
`DCutPolicy` is D-cut (arXiv 2607.14647, vLLM PR 47131), for MLX's padded batches: the drafter drafts its
whole block for every row, and each round verifies the width W that maximises the batch's expected
tokens per second,

    sum over rows r of E_r(W)  /  (draft time + cost(B, W)),

where E_r(W) = 1 + sum_{k < W} prod_{j <= k} a_{r,j} (the survival scores of row r's drafts: calibrated
drafter confidences, or prompt lookup's own acceptance by position, policy.Calibration) and cost(B, W) the
measured seconds of a verify of B rows x W tokens (a start-up probe or a table, refined by every round).
A batched forward pads every row to the longest, so a row verifying fewer drafts would cost the same and
keep fewer: every row verifies W - 1 (fewer only where it has fewer tokens left), and the choice per row
that D-cut's global top-K makes over flat token budgets becomes, here, the choice of W from all the rows'
scores at once. Drafting must pay too: while the rounds' expected rate stays below plain rounds' (B tokens
in cost(B, 1)), the drafter is skipped, re-probed after 7, 15, then every 31 rounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import numpy as np

from .errors import DFlashError
from .models.batch_cache import add_row, batched
from .policy import Calibration
from .verify_costs import filled_cache, non_decreasing, observe_cost, running

PROBE_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)


@dataclass
class BatchPolicy:
    """A fixed verify width for the batch, cut by p-min (each row's first unsure draft; the batch verifies
    the longest row's prefix) and n-min (fewer drafts than that anywhere: a plain round)."""

    block_size: int
    max_width: int
    notes: list = field(default_factory=list)
    p_min: float = 0.0
    n_min: int = 0
    prompt_lookup: bool = True

    @property
    def uses_confidence(self) -> bool:
        return self.p_min > 0

    def width(self, batch: int, most_remaining: int) -> int:
        """Rows to draft for (and verify at most) this round."""
        return max(1, min(self.max_width, self.block_size, most_remaining))

    def cut(self, width: int, confidence: list, copied: list, remaining: list) -> int:
        drafts = 0
        for conf, lookup in zip(confidence, copied):
            cut = width - 1
            if self.p_min > 0:
                cut = next((k for k, c in enumerate(conf[: width - 1]) if k >= lookup and c < self.p_min), cut)
            drafts = max(drafts, cut)
        return 1 if drafts < self.n_min else drafts + 1

    def observe(self, confidence, limits, accepted, batch, width, draft_seconds, verify_seconds, copied):
        """What a round showed (D-cut learns from it; fixed widths ignore it)."""


class DCutPolicy(BatchPolicy):
    SMOOTHING = 0.2
    FIRST_SKIP, MAX_SKIP = 7, 31

    def __init__(self, block_size: int, max_width: int, costs: dict, notes=None, p_min=0.0, n_min=0,
                 prompt_lookup=True):
        super().__init__(block_size, max_width, list(notes or []), p_min, n_min, prompt_lookup)
        self.costs = {b: dict(row) for b, row in costs.items()}  # {rows: {width: seconds}}
        self.calibration = Calibration(block_size)
        self.draft_seconds = 0.0
        self.gain = None  # running ratio of drafting rounds' expected rate to plain rounds'
        self.skip, self.skipping = self.FIRST_SKIP, 0  # plain rounds before the next probe, and still to go

    @property
    def uses_confidence(self) -> bool:
        return True

    def cost(self, batch: int, width: int) -> float:
        """Seconds of a verify of `batch` rows x `width` tokens: measured, or linear between measured batch
        sizes (and on from the last two)."""
        if batch in self.costs:
            return self.costs[batch][width]
        sizes = sorted(self.costs)
        if len(sizes) == 1:
            return self.costs[sizes[0]][width] * batch / sizes[0]
        lo = max([s for s in sizes if s < batch], default=sizes[0])
        hi = min([s for s in sizes if s > batch], default=sizes[-1])
        if lo == hi or batch > sizes[-1]:
            lo, hi = sizes[-2], sizes[-1]
        a, b = self.costs[lo][width], self.costs[hi][width]
        return a + (b - a) * (batch - lo) / (hi - lo)

    def width(self, batch: int, most_remaining: int) -> int:
        widest = super().width(batch, most_remaining)
        if self.gain is None or self.gain >= 1:
            self.skip, self.skipping = self.FIRST_SKIP, 0
            return widest
        if self.skipping:  # drafting has not paid: plain rounds
            self.skipping -= 1
            return 1
        # a probe drafts; the plain rounds after it last longer each time it loses
        self.skipping, self.skip = self.skip, min(2 * self.skip + 1, self.MAX_SKIP)
        return widest

    def expected(self, confidence: list, copied: list, remaining: list, width: int) -> float:
        """The batch's expected tokens from a round verifying `width` rows."""
        return sum(self.calibration.expected_tokens(conf, min(width, left), lookup)
                   for conf, lookup, left in zip(confidence, copied, remaining))

    def rate(self, confidence, copied, remaining, width: int) -> float:
        batch = len(confidence)
        return self.expected(confidence, copied, remaining, width) / (self.draft_seconds + self.cost(batch, width))

    def cut(self, width: int, confidence: list, copied: list, remaining: list) -> int:
        width = super().cut(width, confidence, copied, remaining)  # p-min / n-min first, when given
        return max(range(1, width + 1), key=lambda w: self.rate(confidence, copied, remaining, w))

    def observe(self, confidence, limits, accepted, batch, width, draft_seconds, verify_seconds, copied):
        a = self.SMOOTHING
        if confidence is not None:  # a drafting round: its expected rate against plain rounds', before costs move
            plain = batch / self.cost(batch, 1)
            self.gain = running(self.gain, self.rate(confidence, copied, [n + 1 for n in limits], width) / plain, a)
            self.draft_seconds = running(self.draft_seconds or None, draft_seconds, a)
            for conf, n, kept, lookup in zip(confidence, limits, accepted, copied):
                self.calibration.record(conf, n, kept, min(int(lookup), n))
        if batch in self.costs:
            observe_cost(self.costs[batch], width, verify_seconds, a)


def probe_batch_costs(target, batches: list, max_width: int, context: int = 256, repeats: int = 2) -> dict:
    """{rows: {width: verify seconds}} for a batch of `rows` sequences of `context` tokens each, timed in
    turns (after one warm-up turn; each pair's median), then made non-decreasing in width; widths between
    the probed ones are interpolated, as for one sequence (policy.interpolate_costs)."""
    from .verify_costs import interpolate_costs

    widths = sorted({min(w, max_width) for w in PROBE_WIDTHS})
    times = {(b, w): [] for b in batches for w in widths}
    caches = {}
    for b in batches:
        caches[b] = batched(target.make_cache())
        for _ in range(b):
            add_row(caches[b], filled_cache(target, context))
    for turn in range(repeats + 1):
        for b in batches:
            for w in widths:
                tic = time.perf_counter()
                mx.eval(target.forward(mx.zeros((b, w), dtype=mx.int32), caches[b])[0])
                target.trim_rows(caches[b], [w] * b)
                if turn:
                    times[b, w].append(time.perf_counter() - tic)
    return {b: interpolate_costs(non_decreasing({w: float(np.median(times[b, w])) for w in widths}), max_width)
            for b in batches}


def batch_sizes(max_batch: int) -> list:
    """The batch sizes a probe measures: powers of two up to max_batch, and max_batch."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def build_batch_policy(target, drafter, max_batch: int, width=None, n_max=None, force_width=False, p_min=0.0,
                       n_min=0, costs: Optional[dict] = None, prompt_lookup=True) -> BatchPolicy:
    """The batch policy for this pair: a fixed width (the drafter's trained block by default), or "auto"
    (D-cut), costed by `costs` ({rows: {width: seconds}}) or a start-up probe of batches up to max_batch.
    The quantized-verification rule and the draft controls apply as for one request (policy.make_policy)."""
    if max_batch < 1:
        raise DFlashError(f"--max-batch must be at least 1, got {max_batch}")
    from .policy import build_policy

    single = build_policy(target, drafter, None if width == "auto" else width, n_max, force_width, p_min, n_min,
                          prompt_lookup=prompt_lookup)
    if width != "auto":
        return BatchPolicy(single.block_size, single.max_width, single.notes, p_min, n_min, prompt_lookup)
    source = "the given table"
    if costs is None:
        costs, source = probe_batch_costs(target, batch_sizes(max_batch), single.max_width), "a start-up probe"
    notes = single.notes + [f"width auto (D-cut over batches up to {max_batch}): verify costs from {source}"]
    return DCutPolicy(single.block_size, single.max_width, costs, notes, p_min, n_min, prompt_lookup)



BATCH_SCHEMA = "mlx-dflash/batch-costs/1"


def batch_cost_table(costs: dict, target) -> dict:
    """The file `mlx-dflash bench widths --batch` writes: verify seconds per (rows, width), and what they were
    measured on (the model's dtype and weights, the chip)."""
    from .machine import machine_info
    from .verify_costs import precision

    return {"schema": BATCH_SCHEMA, **precision(target), "machine": {"chip": machine_info().get("chip")},
            "batch_verify_seconds": {str(b): [row[w] for w in sorted(row)] for b, row in sorted(costs.items())}}


def read_batch_costs(path) -> dict:
    """{rows: {width: seconds}} from a table `bench widths --batch` wrote; DFlashError naming the problem."""
    import json
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DFlashError(f"cost table {path}: no such file (make one with `mlx-dflash bench widths --batch`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DFlashError(f"cost table {path} is not a readable JSON file ({e})") from None
    table = data.get("batch_verify_seconds") if isinstance(data, dict) else None
    if not isinstance(table, dict) or not table:
        raise DFlashError(f"cost table {path} has no verify costs per batch size: make one with "
                          "`mlx-dflash bench widths --batch 1,2,4,8` (a --batch server needs them)")
    try:
        costs = {int(b): {w + 1: float(s) for w, s in enumerate(row)} for b, row in table.items()}
    except (TypeError, ValueError):
        raise DFlashError(f"cost table {path}: batch_verify_seconds must map batch sizes to lists of seconds") from None
    if any(b < 1 or not row or any(not s > 0 for s in row.values()) for b, row in costs.items()):
        raise DFlashError(f"cost table {path}: batch sizes must be >= 1 and every cost positive")
    return costs
