"""`--width auto`: how many rows the rounds of one request, or of a batch of requests, verify (decoding/decoder.py).

A fixed width is policies/width.py's `WidthPolicy`, whose draft controls (p-min, n-min) take every row into
account; `build_policy` here builds either. `DCutPolicy` is D-cut (arXiv 2607.14647, vLLM PR 47131), for
MLX's padded batches, one request being the batch of one row: each round verifies the width W that maximises
the batch's expected tokens per second,

    sum over rows r of E_r(W)  /  (draft time + cost(B, W)),

where E_r(W) = 1 + sum_{k < W} prod_{j <= k} a_{r,j} (the survival scores of row r's drafts: calibrated
drafter confidences, or prompt lookup's own acceptance by run, policies/width.py Calibration) and cost(B, W) the
seconds of a verify of B rows x W tokens. A batched forward pads every row to the longest, so a row
verifying fewer drafts would cost the same and keep fewer: every row verifies W - 1 (fewer only where it
has fewer tokens left), and the choice per row that D-cut's global top-K makes over flat token budgets
becomes, here, the choice of W from all the rows' scores at once.

Costs start from a probe or a table; every round times its own (B, W) cell, and a cell not timed yet
keeps the probe's value at the scale its batch size's timed cells showed. Cells are not forced to grow
with W: a batched matmul's cost follows the kernel's tiling, not the row count (on a CPU under OpenBLAS
4 rows x 4 tokens can cost less than 4 x 3: docs/batching.md), so one round in 10 verifies the
least-timed width whose expected rate is within 20% of the best, and the chooser learns where such cells
are cheap.
Cells are kept at the probe's short context: a round over longer rows costs cell(B, W) x growth(W) at
its longest row's context (every row is padded to it), with the one-row growth of
verify_costs.ContextCosts, and its timing is divided by that growth before it joins its cell.

Drafting must pay too: while the rounds' expected rate stays below plain steps' (B tokens in cost(B, 1), a
cell the pipelined plain steps time), the drafter is skipped for plain steps (decoding/decoder.py
`plain_rounds`), re-probed after 7, 15, then every 31 steps (policies/width.py `Backoff`). Until the drafter
is first skipped, cost(B, 1) is the probe's one-token verify, dearer than a pipelined plain step: a drafter
that pays a little less than the target alone may go on drafting (no plain steps are taken just to time
them). And the drafter reads out only the positions the chooser has lately wanted (two past the widest width of the last 32 rounds; the whole block
again once a round wants every position it was given): its forward is the same, but each position read
out costs logits and a confidence (docs/batching.md has it measured).
"""

from __future__ import annotations

import weakref
from collections import Counter, deque
from typing import Optional

import numpy as np

from ..errors import DFlashError
from .verify_costs import (PROBE_CONTEXTS, ContextCosts, context_prober, cost_table_note, interpolate_costs,
                           probe_costs, read_cost_table, batch_costs, running, table_context_costs)
from ..models.no_drafter import NoDrafter
from .width import (Backoff, Calibration, DraftControls, RoundSeen, WidthOptions, WidthPolicy, fixed_policy,
                    has_quantized_layers)


class DCutPolicy(WidthPolicy):
    SMOOTHING = 0.2
    REACH_ROUNDS, REACH_MARGIN = 32, 2  # the drafter reads out the widest width of the last 32 rounds, + 2
    EXPLORE_EVERY, EXPLORE_LOSS = 10, 0.2  # one drafting round in 10 verifies the least-timed width within 20%

    def __init__(self, block_size: int, max_width: int, costs: dict, notes=None,
                 controls: DraftControls = DraftControls(), context_costs: Optional[ContextCosts] = None,
                 max_batch: int = 1, reads_out=True):
        super().__init__(block_size, max_width, list(notes or []), controls)
        self.reads_out = reads_out  # the drafter reads out each position it drafts (no drafter: nothing to read)
        # what the probe or table says for every batch size up to the largest measured or served; each learns
        # on its own
        self.guessed = {b: {w: between(costs, b, w) for w in costs[max(costs)]}
                        for b in range(1, max(max(costs), max_batch) + 1)}
        self.costs = {b: {} for b in self.guessed}  # {rows: {width: seconds}}, as timed
        self.timed = {b: Counter() for b in self.guessed}  # rounds observed per batch size and width
        self.scale = {b: 1.0 for b in self.guessed}  # timed / guessed, over the timed rounds of that batch size
        self.calibration = Calibration(block_size)
        self.draft_seconds = 0.0
        self.gain = None  # running ratio of drafting rounds' expected rate to plain rounds'
        self.backoff, self.skipping = Backoff(), 0  # plain rounds between probes, and still to go
        self.chosen = deque(maxlen=self.REACH_ROUNDS)  # the widths drafting rounds chose lately
        self.drafted = 0  # positions the last width() gave the drafter (anchor included)
        self.cuts = 0
        self.context_costs = context_costs  # None: costs do not change with the context
        self.growth = {w: 1.0 for w in self.guessed[1]}
        self.tree_expected = {}  # the last tree round's expected tokens by its nodes
        self.tree_costs = {}  # {nodes: a tree verify's time over a chain's of as many rows}, as timed

    @property
    def uses_confidence(self) -> bool:
        return True

    @property
    def drafting_loses(self) -> bool:
        return self.gain is not None and self.gain < 1

    def prepare_context(self, context: int):
        if self.context_costs is None:
            return
        measured = self.context_costs.cover(context)
        if measured:
            self.notes.append(f"width auto: verify costs measured at {', '.join(map(str, measured))} tokens of "
                              "context too (a long context makes wide verifies dearer)")

    def probe_ahead(self) -> bool:
        return self.context_costs is not None and self.context_costs.probe_next() is not None

    def at_context(self, context: int):
        if self.context_costs is not None:
            self.growth = self.context_costs.growth(context)

    def cost(self, batch: int, width: int) -> float:
        """Seconds of a verify of `batch` rows x `width` tokens at the round's context: as timed, or the guess
        at the scale the timed widths of that batch size showed (a probe timed on a busy machine is dear all
        over), times the context's growth."""
        return self.short_cost(batch, width) * self.growth[width]

    def short_cost(self, batch: int, width: int) -> float:
        if batch not in self.guessed:
            return between(self.guessed, batch, width) * self.scale[max(self.guessed)]
        timed = self.costs[batch].get(width)
        return timed if timed is not None else self.guessed[batch][width] * self.scale[batch]

    def plain_steps(self, remaining: int) -> int:
        if self.max_width == 1:
            return remaining
        if self.gain is None or self.gain >= 1:
            return 0
        steps = min(self.skipping, remaining)  # drafting has not paid: plain steps
        self.skipping -= steps
        return steps

    def width(self, batch: int, most_remaining: int) -> int:
        widest = min(super().width(batch, most_remaining), self.reach())
        if self.gain is None or self.gain >= 1:
            self.skipping = 0
            self.backoff.reset()
        elif not self.skipping and widest > 1:  # a probe drafts; the plain steps after it last longer each time it loses
            self.skipping = self.backoff.take()
        self.drafted = widest
        return widest

    def reach(self) -> int:
        """Positions worth drafting: a margin past the widest width chosen lately (all, before any; all, always,
        where positions cost nothing to read out: no drafter)."""
        return max(self.chosen) + self.REACH_MARGIN if self.chosen and self.reads_out else self.block_size

    def expected(self, confidence: list, looked_up: list, remaining: list, width: int, runs=None) -> float:
        """The batch's expected tokens from a round verifying `width` rows."""
        return sum(self.calibration.expected_tokens(conf, min(width, left), lookup, run)
                   for conf, lookup, left, run in zip(confidence, looked_up, remaining, runs or [1] * len(looked_up)))

    def rate(self, confidence, looked_up, remaining, width: int, runs=None) -> float:
        batch = len(confidence)
        expected = self.expected(confidence, looked_up, remaining, width, runs)
        return expected / (self.draft_seconds + self.cost(batch, width))

    def cut(self, width: int, confidence: list, looked_up: list, remaining: list, runs=None) -> int:
        width = super().cut(width, confidence, looked_up, remaining)  # p-min / n-min first, when given
        return self.choose({w: self.rate(confidence, looked_up, remaining, w, runs) for w in range(1, width + 1)},
                           len(confidence))

    def cut_tree(self, width: int, trees, confidence: list, looked_up: list, remaining: list, runs=None) -> tuple:
        """As `cut`, choosing between a chain and a tree of each size: a tree of n nodes expects 1 + the sum of
        its n - 1 best nodes' chances of being reached (each the product of its path's calibrated acceptances,
        policies/width.py `Calibration.node_acceptance`) and costs a verify of n rows times `tree_cost(n)` (a tree
        that is one path is then verified as its chain: decoder.verify_trees). Returns (rows, tree or not)."""
        width = WidthPolicy.cut(self, width, confidence, looked_up, remaining)
        accept = self.calibration.node_acceptance(trees.probs, trees.depth, trees.copied, runs) * trees.alive
        reach = np.zeros_like(accept)
        for r in range(accept.shape[1]):  # parents rank before their children
            parent = trees.parents[:, r]
            above = np.where(parent >= 0, reach[np.arange(len(parent)), np.maximum(parent, 0)], 1.0)
            reach[:, r] = accept[:, r] * above
        totals = np.concatenate([[0.0], np.cumsum(reach.sum(axis=0))])  # the batch's, by nodes past the anchor
        batch = len(confidence)
        self.tree_expected = {w: batch + totals[w - 1] for w in range(1, width + 1)}
        rates = {(w, False): self.rate(confidence, looked_up, remaining, w, runs) for w in range(1, width + 1)}
        rates.update({(w, True): self.tree_expected[w] / (self.draft_seconds + self.cost(batch, w) * self.tree_cost(w))
                      for w in range(2, width + 1)})
        best = max(rates, key=rates.get)
        chosen = self.choose({w: rates[w, tree] for w, tree in rates if tree == best[1]}, batch)
        return chosen, best[1] and chosen > 1

    def tree_cost(self, nodes: int) -> float:
        """A tree verify's time over a chain's of as many rows: the running ratio timed at this many nodes, else at
        the most nodes fewer than it (a tree's extra work grows with its nodes: a hybrid target's recurrent layers
        run its paths, models/rollback.py), else 1 (untimed trees are tried)."""
        timed = [n for n in self.tree_costs if n <= nodes]
        return self.tree_costs[max(timed)] if timed else 1.0

    def choose(self, rates: dict, batch: int) -> int:
        """The width of the best rate, or now and then a near-best one timed least so far."""
        best = max(rates, key=rates.get)
        self.cuts += 1
        timed = self.timed.get(batch)
        if self.cuts % self.EXPLORE_EVERY or timed is None:
            return best
        # now and then a near-best width timed least so far: costs are measured, not left at the probe's guess
        near = [w for w in rates if rates[w] >= (1 - self.EXPLORE_LOSS) * rates[best]]
        return min(near, key=lambda w: (timed[w], -rates[w]))

    def observe(self, seen: RoundSeen):
        a, batch, width, verify_seconds, runs = self.SMOOTHING, seen.rows, seen.width, seen.verify_seconds, seen.runs
        if seen.confidence is not None:  # a drafting round: its expected rate against plain rounds', before costs move
            plain = batch / self.cost(batch, 1)
            if seen.tree is not None:
                ratio = self.tree_cost(width) if seen.tree.branched else 1.0  # one path: verified as a chain
                rate = self.tree_expected[width] / (self.draft_seconds + self.cost(batch, width) * ratio)
                self.calibration.record_nodes(seen.tree, runs)
                if seen.tree.branched:
                    self.tree_costs[width] = running(ratio, verify_seconds / self.cost(batch, width), a)
                    verify_seconds /= self.tree_costs[width]  # its cell keeps a chain's time
            else:
                rate = self.rate(seen.confidence, seen.looked_up, [n + 1 for n in seen.limits], width, runs)
                for conf, n, kept, lookup, run in zip(seen.confidence, seen.limits, seen.accepted, seen.looked_up,
                                                      runs or [1] * batch):
                    self.calibration.record(conf, n, kept, min(int(lookup), n), run)
            self.gain = running(self.gain, rate / plain, a)
            self.draft_seconds = running(self.draft_seconds or None, seen.draft_seconds, a)
            if width >= self.drafted:  # it wanted every position it had: the next draft gets them all
                self.chosen.clear()
            else:
                self.chosen.append(width)
        self.time_cell(batch, width, verify_seconds)

    def observe_plain(self, steps: int, seconds: float, rows: int = 1):
        self.time_cell(rows, 1, seconds / steps)  # a plain step is what a round of plain steps costs

    def time_cell(self, batch: int, width: int, seconds: float):
        if batch in self.costs:  # each cell on its own: more rows may cost less (module docstring)
            short = seconds / self.growth[width]  # what it would have cost at the cells' context
            a = self.SMOOTHING
            self.costs[batch][width] = running(self.costs[batch].get(width), short, a)
            self.timed[batch][width] += 1
            self.scale[batch] = running(self.scale[batch], short / self.guessed[batch][width], a)


def between(costs: dict, batch: int, width: int) -> float:
    """costs[batch][width] ({rows: {width: seconds}}), linear between the batch sizes measured and on past
    them from the last two (in proportion to the rows, from a single one)."""
    if batch in costs:
        return costs[batch][width]
    sizes = sorted(costs)
    if len(sizes) == 1:
        return costs[sizes[0]][width] * batch / sizes[0]
    lo = max([s for s in sizes if s < batch], default=sizes[0])
    hi = min([s for s in sizes if s > batch], default=sizes[-1])
    if lo == hi or batch > sizes[-1]:
        lo, hi = sizes[-2], sizes[-1]
    a, b = costs[lo][width], costs[hi][width]
    return a + (b - a) * (batch - lo) / (hi - lo)


def probe_batch_costs(target, batches: list, max_width: int, context: int = PROBE_CONTEXTS[0], repeats: int = 2) -> dict:
    """{rows: {width: verify seconds}} for batches of `rows` sequences of `context` tokens (the cost probe,
    verify_costs.probe_costs), every width up to max_width interpolated between the probed ones. Cells are
    not made to grow with the width (module docstring)."""
    probed = probe_costs(target, batches, max_width, context, repeats=repeats)
    return {b: interpolate_costs(row, max_width) for b, row in probed.items()}


def batch_sizes(max_batch: int) -> list:
    """The batch sizes a probe measures: powers of two up to max_batch, and max_batch."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def build_policy(target, drafter, options: Optional[WidthOptions] = None, max_batch: int = 1,
                 costs: Optional[dict] = None) -> WidthPolicy:
    """The width policy for this pair, deciding one request's rounds (max_batch 1) or a batch's of up to
    max_batch rows: a fixed width (policies/width.py `fixed_policy`), or "auto" (D-cut), costed by `costs`
    ({rows: {width: seconds}}), else options.cost_table, else a start-up probe (once per target in a process).
    The draft controls apply to both; the quantized rule to a fixed width and to one request: a batched
    verify's matmuls see rows x width, which MLX's quantized kernels (and ours, 6..16 rows) route on and the
    per-request clamp to 5 does not describe, so a batch's D-cut lets its measured cells choose (docs/models.md)."""
    if max_batch < 1:
        raise DFlashError(f"--max-batch must be at least 1, got {max_batch}")
    options = options or WidthOptions()
    fixed = fixed_policy(target, drafter, options, quantized_rule=not options.auto or max_batch == 1)
    if not options.auto:
        return fixed
    notes, table = list(fixed.notes), None
    if costs is None and options.cost_table:
        table = read_cost_table(options.cost_table)
        costs = batch_costs(table)
        if "widths" in table:  # one row's costs: notes, context vectors
            notes += [note] if (note := cost_table_note(table, options.cost_table, target)) else []
        else:
            table = None
    if costs is not None:  # a table's widths, and one of one row's costs only, cover every width and batch size
        costs = {b: interpolate_costs(row, fixed.max_width) for b, row in costs.items()}
        prober = context_prober(target, fixed.max_width)  # a table's clock may not be the probe's: it measures growth
        context_costs = table_context_costs(table, fixed.max_width, prober, target.context_length) if table \
            else ContextCosts({}, fixed.max_width, prober, target.context_length)
        source = f"cost table {options.cost_table}" if table else "the given table"
    else:
        costs, context_costs = probed_costs(target, max_batch, fixed.max_width)
        source = "a start-up probe"
    over = "" if max_batch == 1 else f" (D-cut over batches up to {max_batch})"
    notes.append(f"width auto{over}: verify costs from {source}, refined as rounds run")
    if max_batch > 1 and (has_quantized_layers(target.model) or has_quantized_layers(drafter)):
        notes.append(f"quantized model: D-cut verifies up to {fixed.max_width} rows a request, each round's width "
                     "chosen from the measured cost of its rows x width (what the quantized kernels route on)")
    return DCutPolicy(fixed.block_size, fixed.max_width, costs, notes, options.controls, context_costs, max_batch,
                      not isinstance(drafter, NoDrafter))


_PROBED = weakref.WeakKeyDictionary()  # target -> {(max_batch, max_width): (costs, context costs)}


def probed_costs(target, max_batch: int, max_width: int) -> tuple:
    """The start-up probe's {rows: {width: seconds}} and the context costs it grows into, measured once per
    target in a process: a program calling stream_generate again and again pays the probe once, and every
    call's policy learns its own copy of the costs from its rounds."""
    probed = _PROBED.setdefault(target, {})
    if (max_batch, max_width) not in probed:
        costs = probe_batch_costs(target, batch_sizes(max_batch), max_width, PROBE_CONTEXTS[0])
        context_costs = ContextCosts({PROBE_CONTEXTS[0]: costs[1]}, max_width, context_prober(target, max_width),
                                     target.context_length)
        probed[max_batch, max_width] = costs, context_costs
    costs, context_costs = probed[max_batch, max_width]
    return {b: dict(row) for b, row in costs.items()}, context_costs


def batch_cost_rows(costs: dict) -> dict:
    """What `mlx-dflash bench widths --batch` adds to its cost_table.json: verify seconds per (rows, width)."""
    return {"batch_verify_seconds": {str(b): [row[w] for w in sorted(row)] for b, row in sorted(costs.items())}}
