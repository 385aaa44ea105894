"""Drafters whose drafts the tests know in advance, each a `mlx_dflash.models.base.DraftModel`.

`OracleDrafter` proposes the target's own greedy continuation with wrong tokens planted at chosen
positions, so the acceptance of every round is predictable (`expected_acceptance`); `OracleDFlash2` plants
the same drafts in a real DFlash 2 drafter's logits, for its candidate selector to walk; `Recorder` keeps
every draft a real drafter returns.
"""

from typing import Optional

import mlx.core as mx

from mlx_dflash.models.base import Draft, DraftModel
from mlx_dflash.models.dflash2 import DFlash2DraftModel
from mlx_dflash.policies.width import RoundSeen


def planted(continuation: list, errors: set, vocab: int, start: int, n: int) -> list:
    """The n tokens from generated index `start`: the continuation's, except a wrong one at each index in
    `errors`, and 0 past its end."""
    out = []
    for i in range(start, start + n):
        true = continuation[i] if i < len(continuation) else 0
        out.append((true + 1) % vocab if i in errors else true)
    return out


class OracleDrafter:
    """Drafts `continuation` (the target's greedy tokens after a prompt of `prompt_len` tokens), wrong at
    the generated indices in `errors`. It finds the anchor from the context rows the decoder hands it,
    as a real drafter's context grows: the prompt's rows after the prefill, then each round's anchor and
    kept drafts. `config` is the drafter config of the pair (its target layers are the ones captured);
    `confidence` is what it reports for every draft (below lookup.LOOKUP_BELOW, prompt lookup may replace
    its drafts)."""

    def __init__(self, config, prompt_len: int, continuation: list, errors=(), block_size: Optional[int] = None,
                 confidence: float = 1.0):
        self.config = config
        self._block_size = block_size or config.block_size
        self.prompt_len, self.continuation, self.errors = prompt_len, list(continuation), set(errors)
        self.confidence = confidence
        self._bound, self.seen = False, 0

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def is_bound(self) -> bool:
        return self._bound

    def bind(self, target) -> "OracleDrafter":
        target.check_drafter(self.config)
        target.capture(self.config.target_layer_ids)
        self._bound = True
        return self

    def make_cache(self) -> list:
        self.seen = 0
        return []

    def read_context(self, context, cache: list):
        self.seen += context.shape[1]

    def draft(self, anchors: list, contexts: list, cache: list, block_size: int, width: int, samplings,
              keys=None) -> Draft:
        (context,) = contexts  # one request
        self.seen += 0 if context is None else context.shape[1]
        start = self.seen - self.prompt_len + 1  # generated index of block position 1 (the anchor is one before)
        tokens = planted(self.continuation, self.errors, self.config.vocab_size, start, width - 1)
        return Draft(mx.array([tokens], dtype=mx.int32), mx.full((1, width - 1), self.confidence))


class OracleDFlash2(DFlash2DraftModel):
    """A real DFlash 2 drafter whose draft logits put the planted drafts (`planted`) on top by a wide
    margin; its own candidate selector then walks over them. `plant` sets what it drafts."""

    def plant(self, prompt_len: int, continuation: list, errors=()) -> "OracleDFlash2":
        self.prompt_len, self.continuation, self.errors, self.seen = prompt_len, continuation, set(errors), 0
        return self

    def make_cache(self) -> list:
        self.seen = 0
        return super().make_cache()

    def hidden(self, block, context, cache, block_start=None):
        self.seen += 0 if context is None else context.shape[1]
        return super().hidden(block, context, cache, block_start)

    def read_context(self, context, cache: list):
        self.seen += context.shape[1]
        super().read_context(context, cache)

    def logits(self, hidden):
        real = super().logits(hidden)
        start = self.seen - self.prompt_len + 1
        rows = planted(self.continuation, self.errors, self.config.vocab_size, start, hidden.shape[1])
        return real + 30.0 * (mx.arange(self.config.vocab_size) == mx.array(rows)[:, None])


class Recorder:
    """A drafter that keeps every draft `drafter` returns for one request, in `drafts`."""

    def __init__(self, drafter: DraftModel):
        self.drafter, self.drafts = drafter, []

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    @property
    def is_bound(self) -> bool:
        return self.drafter.is_bound

    def bind(self, target) -> "Recorder":
        self.drafter.bind(target)
        return self

    def make_cache(self) -> list:
        return self.drafter.make_cache()

    def read_context(self, context, cache: list):
        self.drafter.read_context(context, cache)

    def draft(self, *args) -> Draft:
        d = self.drafter.draft(*args)
        self.drafts.append(d.row(0))  # one request's: its one row
        return d


def expected_acceptance(n_tokens: int, width: int, errors: set) -> list:
    """Drafts kept per round (after the prefill's) when drafts are right except at the generated indices
    in `errors`."""
    produced, out = 1, []
    while produced < n_tokens:
        w = min(width, n_tokens - produced)
        anchor = produced - 1
        accepted = 0
        while accepted < w - 1 and anchor + 1 + accepted not in errors:
            accepted += 1
        out.append(accepted)
        produced += accepted + 1
    return out


def cut_one(policy, width: int, confidence: list, looked_up: int = 0) -> int:
    """A policy's cut for one request (a one-row round)."""
    return policy.cut(width, [confidence], [looked_up], [width])


def observe_one(policy, confidence: list, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float,
                looked_up: int = 0, run: int = 1):
    """A policy's observation of a one-row round (confidence [] when the round read none); run: how long the
    copy lookup proposed had run."""
    policy.observe(RoundSeen([confidence] if confidence else None, [drafted], [accepted], drafted + 1, draft_seconds,
                             verify_seconds, [looked_up], runs=[run]))
