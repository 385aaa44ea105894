"""The width policy: how many block positions the target verifies each round.

The drafter always drafts its whole block in one pass (drafting cost is nearly flat in length); the
policy only decides how long a prefix of it the target checks. Width counts the tokens verified, anchor included:
width w verifies w - 1 drafted tokens.

The base rule is z-lab's advice for MLX (z-lab/dflash README: "For quantized targets or drafts, use
block_size <= 5"), made real: on a quantized model, MLX's quantized matmul reads the weights once for up
to 5 rows and again for every further 5 (`qmv_wide` in MLX's mlx/backend/metal/quantized.cpp), so
without our wide kernels the verify width is clamped to 5 unless the user forces it.
"""

from dataclasses import dataclass, field, replace
from typing import Optional, Union

import mlx.nn as nn
import numpy as np

from ..errors import DFlashError
from ..models.no_drafter import NoDrafter

QUANTIZED_MAX_WIDTH = 5
# Every entry point's default: a fixed width that is best on short prompts loses most at long contexts and under
# load, where auto keeps up with the target alone (docs/benchmarks.md).
DEFAULT_WIDTH = "auto"
# The chance that a copied token is kept once the ones before it were, by how long its copy has run when it is
# judged (decoding/lookup.py `PromptLookup.run`, plus the copied tokens before it): 1, 2-3, 4-7 and 8 or more
# tokens, rounded from what bench/acceptance.py prints by draft position on held-out GSM8K answers (a copy that
# starts right tends to go on). `--width auto` starts from these and learns the run's own.
ACCEPTANCE_PRIOR = (0.5, 0.7, 0.75, 0.8)  # runs past the last class: 0.8
NO_DRAFTER_NOTE = ("speculation: no drafter, so drafts are copied from the context (prompt lookup) and each is "
                   "verified by the target; --drafter DIR adds a DFlash drafter")
COPY_RUNS = 7  # classes of runs: 1, 2-3, 4-7, 8-15, 16-31, 32-63, 64 or more


def copy_class(run) -> np.ndarray:
    """The class of a copy that has run `run` tokens (0..COPY_RUNS - 1), elementwise."""
    run = np.maximum(np.asarray(run, dtype=np.int64), 1)
    return np.minimum(np.floor(np.log2(run)).astype(int) + 1, COPY_RUNS) - 1


def has_quantized_layers(model: nn.Module) -> bool:
    """True when some matmul of the model runs through MLX's quantized kernels."""
    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return any(isinstance(m, quantized) for _, m in model.named_modules())


@dataclass
class RoundSeen:
    """What a round showed its width policy: each row's drafts' confidence as read (None: none was read), its drafts
    verified (`limits`) and kept (`accepted`), the round's width and times, each row's drafts prompt lookup proposed
    (`looked_up`) and how long its copy had run (`runs`, as `cut` takes them), and for a tree its nodes' verdict
    (decoding/tree.py `TreeVerdict`)."""

    confidence: Optional[list]
    limits: list
    accepted: list
    width: int
    draft_seconds: float
    verify_seconds: float
    looked_up: list
    tree: object = None
    runs: Optional[list] = None

    @property
    def rows(self) -> int:
        return len(self.limits)


@dataclass(frozen=True)
class DraftControls:
    """What a width policy does with each round's drafts besides choosing the width: llama.cpp's draft controls,
    prompt lookup and trees; checked as they are made.

    p_min: cut each row's draft before its first position whose top-1 draft probability is below p_min (each
        position's own probability, not a running product); the round verifies the longest surviving prefix.
    n_min: if fewer than n_min drafted tokens survive the cut in every row, verify none (a plain round).
    prompt_lookup: where the drafter's first draft is unsure, draft from the context (decoding/lookup.py).
    tree: verify draft trees (decoding/tree.py): a fixed width every round, `--width auto` where it expects one to
        pay; None or False: one path (by default: with trees, auto measured below chains only, docs/benchmarks.md).
    """

    p_min: float = 0.0
    n_min: int = 0
    prompt_lookup: bool = True
    tree: Optional[bool] = None

    def __post_init__(self):
        if problem := controls_problem(self.p_min, self.n_min):
            raise DFlashError(problem)


def controls_problem(p_min: float, n_min: int, names=("p_min", "n_min")) -> Optional[str]:
    """What is wrong with these draft controls, in one line naming each as `names` do (None if nothing)."""
    if not 0 <= p_min < 1:
        return f"{names[0]} must be in [0, 1), got {p_min}"
    if n_min < 0:
        return f"{names[1]} must be at least 0 (drafted tokens), got {n_min}"
    return None


@dataclass
class WidthPolicy:
    """Fixed widths, with the draft controls on top (`DraftControls`); the protocol every width policy keeps, for
    one request (one row) or a batch of them (decoding/decoder.py `speculative_round`)."""

    block_size: int  # rows the drafter drafts (anchor included)
    max_width: int  # rows the target verifies at most
    notes: list = field(default_factory=list)  # said once at start, kept in the stats
    controls: DraftControls = DraftControls()

    def cut_tree(self, width: int, trees, confidence: list, looked_up: list, remaining: list, runs=None) -> tuple:
        """(rows to verify, anchor included; whether they are the ranked `trees`' best nodes (tree.py `Trees`) or a
        chain), where the round may verify a tree; the arguments after `trees` as `cut` takes them."""
        return self.cut(width, confidence, looked_up, remaining), True

    @property
    def uses_confidence(self) -> bool:
        """Whether `cut` reads the drafter's confidence (which costs a round trip before the verify)."""
        return self.controls.p_min > 0

    def width(self, rows: int, most_remaining: int) -> int:
        """Positions to draft for (and rows to verify at most) this round of `rows` requests, the one with the
        most left able to emit `most_remaining` more tokens."""
        return max(1, min(self.max_width, self.block_size, most_remaining))

    @property
    def drafting_loses(self) -> bool:
        """Drafting has lately paid less than plain target steps (an auto policy that measures both)."""
        return False

    def plain_steps(self, remaining: int) -> int:
        """How many plain target steps (no drafter, pipelined: decoding/decoder.py `plain_rounds`) the rows take
        now instead of a round, the one with the fewest left able to emit `remaining` more; 0: a round.
        Drafting off (width 1) is plain steps all the way."""
        return remaining if self.max_width == 1 else 0

    def observe_plain(self, steps: int, seconds: float, rows: int = 1):
        """What a run of `steps` plain steps of `rows` rows cost."""

    def prepare_context(self, context: int):
        """A prompt of `context` tokens is about to decode: an adaptive policy measures what costs it lacks
        for it now, before any clock of the generation starts, never between rounds."""

    def probe_ahead(self) -> bool:
        """One measurement a policy may want before prompts need it (a server makes them all at start-up);
        False once none is left (the fixed policies want none)."""
        return False

    def at_context(self, context: int):
        """The next round's longest row attends to `context` tokens (adaptive policies cost widths by it)."""

    def cut(self, width: int, confidence: list, looked_up: list, remaining: list, runs=None) -> int:
        """The width after the confidence controls. confidence[b][k] is the top-1 probability of row b's draft
        k+1 (1 for its first looked_up[b] drafts, which prompt lookup proposed); remaining[b]: the tokens row b
        may still emit; runs[b]: how long row b's copy has run (decoding/lookup.py `PromptLookup.run`)."""
        drafts = 0
        for conf, lookup in zip(confidence, looked_up):
            cut = width - 1
            if self.controls.p_min > 0:
                cut = next((k for k, c in enumerate(conf[: width - 1]) if k >= lookup and c < self.controls.p_min),
                           cut)
            drafts = max(drafts, cut)
        return 1 if drafts < self.controls.n_min else drafts + 1

    def observe(self, seen: RoundSeen):
        """What a round showed (`RoundSeen`). Fixed widths ignore it."""


def make_policy(trained_block_size: int, width: Optional[int] = None, *, quantized: bool = False,
                wide_kernels: bool = False, force_width: bool = False,
                controls: DraftControls = DraftControls()) -> WidthPolicy:
    """The fixed-width policy for a drafter and target, with the quantized-verification rule applied.

    width: the verify width asked for (1..trained_block_size); default: the drafter's trained size.
    quantized: the target or drafter has quantized linear layers.
    wide_kernels: our 6..16-row kernels are installed (Metal only), which lifts the rule.
    force_width: verify past 5 rows on a quantized model anyway.
    controls: the policy's draft controls, prompt lookup and trees.
    """
    if controls.n_min >= trained_block_size:
        raise DFlashError(f"n_min must be in 0..{trained_block_size - 1} (drafted tokens), got {controls.n_min}")
    if width is None:
        width = trained_block_size
    if not 1 <= width <= trained_block_size:
        raise DFlashError(
            f"verify width {width} is out of range: this drafter was trained with blocks of "
            f"{trained_block_size}, so use 1..{trained_block_size}"
        )
    policy = WidthPolicy(trained_block_size, width, controls=controls)
    if quantized and width > QUANTIZED_MAX_WIDTH and not wide_kernels:
        if force_width:
            policy.notes.append(
                f"warning: verifying {width} rows on a quantized model without wide kernels: MLX's "
                f"quantized matmul reads the weights about {-(-width // QUANTIZED_MAX_WIDTH)}x per "
                "verify (or switches to its 32-row tiled kernel), which usually costs more than it gains"
            )
        else:
            policy.max_width = QUANTIZED_MAX_WIDTH
            policy.notes.append(
                f"quantized model without wide kernels: verify width clamped from {width} to "
                f"{QUANTIZED_MAX_WIDTH} (pass --force-width to override)"
            )
    return policy


class Calibration:
    """The chance that a draft is kept once the drafts before it were, learned as rounds run: for the
    drafter's own drafts, the acceptance rate seen so far of drafts whose top-1 probability fell in the
    same tenth of [0, 1] (starting from the raw probability); for drafts prompt lookup proposed, the rate
    seen so far of copied tokens whose copy had run as long when they were judged (`copy_class`: a copy that has
    run r tokens proposes its draft k+1 having run r + k). A run class not judged yet starts from the shorter
    runs' estimate once that has been judged (a copy that goes on is at least as likely to go on), else from
    ACCEPTANCE_PRIOR: a width never verified yet is still chosen where it would pay."""

    BINS = 10
    PRIOR = 4.0  # pseudo-observations of the prior in each bin

    def __init__(self, block_size: int):
        self.hits, self.trials = np.zeros(self.BINS), np.zeros(self.BINS)
        self.lookup_hits, self.lookup_trials = np.zeros(COPY_RUNS), np.zeros(COPY_RUNS)  # by run class
        self._lookup = None  # the run classes' acceptance, until the next record

    def calibrated(self, confidence: float) -> float:
        b = min(int(confidence * self.BINS), self.BINS - 1)
        return (self.hits[b] + self.PRIOR * confidence) / (self.trials[b] + self.PRIOR)

    def copied_acceptance(self, runs) -> np.ndarray:
        """The observed chance that a copied token whose copy has run `runs` tokens is kept (elementwise)."""
        if self._lookup is None:
            table, judged = np.empty(COPY_RUNS), False
            for c in range(COPY_RUNS):
                prior = table[c - 1] if judged else ACCEPTANCE_PRIOR[min(c, len(ACCEPTANCE_PRIOR) - 1)]
                table[c] = (self.lookup_hits[c] + self.PRIOR * prior) / (self.lookup_trials[c] + self.PRIOR)
                judged = judged or self.lookup_trials[c] > 0
            self._lookup = table
        return self._lookup[copy_class(runs)]

    def expected_tokens(self, confidence: list, width: int, looked_up: int = 0, run: int = 1) -> float:
        """Tokens a round verifying `width` rows emits in expectation: 1 + sum_k prod_{j<=k} a_j (the first
        `looked_up` drafts copied by a copy that has run `run` tokens)."""
        expected, survive = 1.0, 1.0
        copied = self.copied_acceptance(run + np.arange(looked_up)) if looked_up else ()
        for k, c in enumerate(confidence[: width - 1]):
            survive *= copied[k] if k < looked_up else self.calibrated(c)
            expected += survive
        return expected

    def node_acceptance(self, probs: np.ndarray, depth: np.ndarray, copied: np.ndarray, runs=None) -> np.ndarray:
        """The chance that each tree node [B, N] is kept once its parent was: by its drafter probability, as
        `calibrated`; for a node prompt lookup's copy proposed (`copied`), lookup's by how long its copy has run
        there (its row's run, runs[b], None: 1, plus its depth - 1)."""
        b = np.minimum((probs * self.BINS).astype(int), self.BINS - 1)
        drafted = (self.hits[b] + self.PRIOR * probs) / (self.trials[b] + self.PRIOR)
        return np.where(copied, self.copied_acceptance(self._runs(runs, depth)), drafted)

    def record_nodes(self, verdict, runs=None):
        """A tree round's verdict (decoding/tree.py `TreeVerdict`): every node judged, kept or not; runs as
        `node_acceptance` takes them."""
        judged, kept, copied = verdict.judged, verdict.reached, verdict.copied
        b = np.minimum((verdict.probs * self.BINS).astype(int), self.BINS - 1)
        np.add.at(self.trials, b[judged & ~copied], 1)
        np.add.at(self.hits, b[judged & kept & ~copied], 1)
        c = copy_class(self._runs(runs, verdict.depth))
        np.add.at(self.lookup_trials, c[judged & copied], 1)
        np.add.at(self.lookup_hits, c[judged & kept & copied], 1)
        self._lookup = None

    @staticmethod
    def _runs(runs, depth: np.ndarray) -> np.ndarray:
        """How long each tree node's copy has run at it, [B, N]."""
        runs = np.ones(depth.shape[0], dtype=int) if runs is None else np.asarray(runs)
        return runs[:, None] + np.maximum(depth - 1, 0)

    def record(self, confidence: list, drafted: int, accepted: int, looked_up: int = 0, run: int = 1):
        """A round's verdict. Drafts up to the first rejection were judged; later ones say nothing."""
        for k in range(min(accepted + 1, drafted)):
            if k < looked_up:
                c = int(copy_class(run + k))
                self.lookup_trials[c] += 1
                self.lookup_hits[c] += k < accepted
                self._lookup = None
            else:
                b = min(int(confidence[k] * self.BINS), self.BINS - 1)
                self.trials[b] += 1
                self.hits[b] += k < accepted


class Backoff:
    """How long to skip the drafter while drafting does not pay: 7 target steps, then 15, then 31 each time,
    with one drafting round between to re-measure, so a drafter that never pays costs about one round in 32
    (policies/dcut.py `DCutPolicy` keeps one)."""

    FIRST, MOST = 7, 31

    def __init__(self):
        self.next = self.FIRST

    def take(self) -> int:
        """The next skip; the one after it is about twice as long."""
        steps, self.next = self.next, min(2 * self.next + 1, self.MOST)
        return steps

    def reset(self):
        """Drafting pays again: the next skip is short again."""
        self.next = self.FIRST


@dataclass(frozen=True)
class WidthOptions:
    """How to choose the verify width: the flags `generate` and `serve` share (options.py), refused as they
    are made where they contradict each other, before anything loads. width: rows (anchor included), "auto",
    or None for the default (`with_default`); n_max: at most this many drafted tokens (alone, the fixed width
    n_max + 1; with auto, its widest); force_width: past the quantized rule; p_min, n_min: llama.cpp's draft
    controls; cost_table: verify costs for auto; prompt_lookup: where the drafter is unsure, draft what
    followed the context's last tokens before."""

    width: Union[int, str, None] = None
    n_max: Optional[int] = None
    force_width: bool = False
    p_min: float = 0.0
    n_min: int = 0
    cost_table: Optional[str] = None
    prompt_lookup: bool = True
    tree: Optional[bool] = None

    def __post_init__(self):
        width, n_max = self.width, self.n_max
        if problem := controls_problem(self.p_min, self.n_min, ("--p-min", "--n-min")):
            raise DFlashError(problem)
        if n_max is not None and width not in (None, "auto") and width != n_max + 1:
            raise DFlashError(f"--n-max {n_max} and --width {width} disagree (width = n_max + 1); give one of them")
        if self.cost_table and width not in (None, "auto"):
            raise DFlashError(f"--cost-table is used by --width auto, not by --width {width}; leave one of them out")
        if self.cost_table and width is None and n_max is not None:
            raise DFlashError(f"--n-max {n_max} alone verifies the fixed width {n_max + 1}, which uses no "
                              "--cost-table; add --width auto to choose widths up to it from the table")

    @property
    def auto(self) -> bool:
        return self.width == "auto"

    @property
    def controls(self) -> DraftControls:
        return DraftControls(self.p_min, self.n_min, self.prompt_lookup, self.tree)

    def with_default(self, seeded_sample: bool = False) -> "WidthOptions":
        """These options with DEFAULT_WIDTH where no width and no n_max is given, as `generate`, `serve`,
        `stream_generate` and `batch_generate` verify. A seeded sample of one request keeps the fixed trained
        block: auto's widths follow measured costs, and which tokens a seed draws depends on the widths
        verified, so only a fixed width reproduces a seeded sample."""
        if self.width is None and self.n_max is None and not seeded_sample:
            return replace(self, width=DEFAULT_WIDTH)
        return self


def fixed_policy(target, drafter, options: WidthOptions = WidthOptions(), quantized_rule: bool = True) -> WidthPolicy:
    """The fixed width of this pair's options (options.width, n_max + 1, or the drafter's trained block when
    neither is given; with auto, the widest auto may verify), with the draft controls and, unless
    `quantized_rule` is off, the quantized rule (policies/dcut.py `build_policy` builds every policy from it)."""
    n_max, trained = options.n_max, drafter.block_size
    if n_max is not None and not 0 <= n_max < trained:
        raise DFlashError(f"--n-max {n_max} is out of range: this drafter drafts blocks of {trained} rows, so "
                          f"it verifies at most {trained - 1} drafted tokens (--n-max 0..{trained - 1})")
    fixed = (n_max + 1 if n_max is not None else None) if options.auto or options.width is None else options.width
    if isinstance(drafter, NoDrafter) and not options.prompt_lookup:
        raise DFlashError("--no-prompt-lookup leaves a target without a drafter nothing to draft: drop it, or give "
                          "a DFlash drafter with --drafter")
    policy = make_policy(
        trained,
        fixed,
        quantized=quantized_rule and (has_quantized_layers(target.model) or has_quantized_layers(drafter)),
        wide_kernels=target.wide_kernels,
        force_width=options.force_width,
        controls=options.controls,
    )
    if isinstance(drafter, NoDrafter):  # said once at start: no DFlash drafter runs
        policy.notes.insert(0, NO_DRAFTER_NOTE)
    return policy


