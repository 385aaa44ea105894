"""`mlx-dflash serve --shard tensor|pipeline` under mlx.launch: only rank 0 listens; the others follow it.

Rank 0 runs the usual server (routes.py) with a `ShardedEngine`: the engine (engine.py) over a scheduler that
tells the other ranks what it was told. Every rank runs the same scheduler over the same rows, kept in step
by distributed.py's `Ranks` exchanges inside each step (rank 0's drafts, verdicts and clock-made choices);
what is added here is the traffic between steps:

- before each step rank 0 sends a `Header` (STEP) counting the requests that joined the queue and those
  that end (a stop string matched, a client left, shut down) since the step before; then for each new
  request its header (decoding parameters, prompt length) and prompt token ids (the chat template was
  applied on rank 0), then the ending requests' numbers. The others submit and cancel the same, then step;
- while no request waits, rank 0 sends a beat every second: the others' round heartbeat (`--rank-timeout`)
  stays fresh, and a rank that died is noticed within a second even when nobody is asking;
- when the server stops (Ctrl-C, SIGTERM), rank 0 sends a shutdown and every rank exits 0.

Every message is an `all_sum` of rank 0's values with zeros from the others, as in distributed.py.
A lost rank stops the server: rank 0 answers the running requests 500 and the waiting ones 503, then
exits 1 with the same one-line error as `generate --shard`; the other ranks exit 1 likewise.
"""

import logging
import queue
import struct
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import numpy as np

from ..decoding.batch_decoder import Request, Scheduler
from ..decoding.sampling import SamplingParams
from ..distributed import RankLost, Ranks, lost_rank_errors
from ..errors import DFlashError
from .jobs import Job
from .engine import Engine

log = logging.getLogger("mlx_dflash.server")

BEAT, REQUEST, SHUTDOWN, STEP = 0, 1, 2, 3
BEAT_SECONDS = 1.0
# kind, max_tokens, prompt tokens, top_k, has seed, seed, temperature, top_p, min_p, requests, ending: exact
# values, int32 words
_LAYOUT = struct.Struct("<qqqqqQdddqq")
HEADER_WORDS = _LAYOUT.size // 4


class RanksOutOfStep(DFlashError):
    """Rank 0 failed in the middle of a generation (a bug): the other ranks cannot be told where it stopped."""


@dataclass(frozen=True)
class Header:
    """What rank 0 tells the others before each step (STEP: how many requests join and end), for each
    request that joins (REQUEST), or instead of a step (a beat, the shutdown)."""

    kind: int
    max_tokens: int = 0
    prompt_tokens: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: Optional[int] = None
    requests: int = 0
    ending: int = 0

    def encode(self) -> mx.array:
        s = self.sampling
        packed = _LAYOUT.pack(self.kind, self.max_tokens, self.prompt_tokens, s.top_k, self.seed is not None,
                              self.seed or 0, s.temperature, s.top_p, s.min_p, self.requests, self.ending)
        return mx.array(np.frombuffer(packed, dtype=np.int32))

    @classmethod
    def decode(cls, words: mx.array) -> "Header":
        values = _LAYOUT.unpack(np.array(words, dtype=np.int32).tobytes())
        kind, max_tokens, prompt_tokens, top_k, has_seed, seed, temperature, top_p, min_p, requests, ending = values
        if kind not in (BEAT, REQUEST, SHUTDOWN, STEP) or (kind == REQUEST and (max_tokens < 1 or prompt_tokens < 1)) \
                or min(requests, ending) < 0:
            raise RanksOutOfStep(f"a malformed header from rank 0 ({values}): the ranks are out of step")
        return cls(kind, max_tokens, prompt_tokens, SamplingParams(temperature, top_p, top_k, min_p),
                   seed if has_seed else None, requests, ending)


class Leader:
    """Rank 0's scheduler: what it is told (submit, cancel) goes to the other ranks before its next step.
    Every rank numbers the requests in the order they were submitted: the others' handles are the numbers."""

    def __init__(self, scheduler: Scheduler, ranks: Ranks):
        self.scheduler, self.ranks = scheduler, ranks
        self.numbers: dict = {}  # handle -> its number, while it is in the scheduler
        self.count = 0
        self.joining: list = []  # requests submitted since the last step
        self.ending: list = []  # numbers of those cancelled since the last step
        self.told: set = set()  # numbers the others were told to end

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    def submit(self, request: Request):
        self.numbers[request.handle] = self.count
        self.count += 1
        self.joining.append(request)
        self.scheduler.submit(request)

    def cancel(self, handle):
        number = self.numbers.get(handle)
        if number is not None and number not in self.told:  # the engine cancels until the request is done
            self.ending.append(number)
            self.told.add(number)
        self.scheduler.cancel(handle)

    def step(self) -> list:
        ranks = self.ranks
        ranks.share(Header(STEP, requests=len(self.joining), ending=len(self.ending)).encode())
        for r in self.joining:
            ranks.share(Header(REQUEST, r.max_tokens, len(r.ids), r.sampling, r.seed).encode())
            ranks.share(mx.array(r.ids, dtype=mx.int32))
        if self.ending:
            ranks.share(mx.array(self.ending, dtype=mx.int32))
        self.joining, self.ending = [], []
        events = self.scheduler.step()
        for handle, kind, _ in events:
            if kind == "done":
                self.told.discard(self.numbers.pop(handle))
        return events


def receive(ranks: Ranks) -> Optional[tuple]:
    """On the other ranks: ([Request] joining, in rank 0's order, [number] ending) before rank 0's next step,
    or None at its shutdown (beats are read and passed over)."""
    while True:
        header = Header.decode(ranks.share(mx.zeros(HEADER_WORDS, dtype=mx.int32)))
        if header.kind == SHUTDOWN:
            return None
        if header.kind == STEP:
            break
    joining = []
    for _ in range(header.requests):
        r = Header.decode(ranks.share(mx.zeros(HEADER_WORDS, dtype=mx.int32)))
        if r.kind != REQUEST:
            raise RanksOutOfStep(f"rank 0 sent a header of kind {r.kind} for a request: the ranks are out of step")
        ids = ranks.share(mx.zeros(r.prompt_tokens, dtype=mx.int32)).tolist()
        joining.append(Request(None, ids, r.max_tokens, r.sampling, r.seed))
    ending = ranks.share(mx.zeros(header.ending, dtype=mx.int32)).tolist() if header.ending else []
    return joining, ending


class ShardedEngine(Engine):
    """Rank 0's engine: `load` returns (target, drafter, tokenizer, policy, ranks)."""

    fatal_errors = (RankLost, RanksOutOfStep)
    probes_ahead = False  # every rank's forward runs in step: a probe only inside the step protocol, as prompts need it

    def _take(self, loaded):
        *pair, self.ranks = loaded
        super()._take(pair)

    def _new_scheduler(self) -> Leader:
        return Leader(super()._new_scheduler(), self.ranks)

    def _serve(self):
        try:
            with self.ranks.watch():
                super()._serve()
                if self.failure is None:
                    self.ranks.share(Header(SHUTDOWN).encode())
        except self.fatal_errors as e:  # a beat or the shutdown found a rank gone
            self._fail(e)

    def _next_job(self) -> Optional[Job]:
        while True:
            try:
                return self._jobs.get(timeout=BEAT_SECONDS)
            except queue.Empty:
                self.ranks.share(Header(BEAT).encode())

    def _step(self) -> list:
        try:
            with lost_rank_errors(self.ranks.rank):
                return super()._step()
        except self.fatal_errors:
            raise
        except Exception as e:  # the engine would drop the batch and go on; the other ranks could not
            log.exception("generation failed")
            raise RanksOutOfStep(f"rank 0: generation failed mid-step ({type(e).__name__}, a bug: see the "
                                 "traceback above); the ranks can no longer be kept in step, so the server "
                                 "stops") from e


def follow(target, drafter, tokenizer, policy, ranks: Ranks, max_batch: int,
           prefill_step: Optional[int]):
    """A rank other than 0: step a scheduler as rank 0 steps its own, until its shutdown. max_batch and
    prefill_step: rank 0's (every rank is started with the same flags)."""
    scheduler = Scheduler(target, drafter, policy, max_batch, tokenizer.eos_token_ids, None, prefill_step, ranks)
    submitted = 0
    with ranks.watch():
        while (step := receive(ranks)) is not None:
            joining, ending = step
            for r in joining:
                r.handle, submitted = submitted, submitted + 1
                scheduler.submit(r)
            for number in ending:
                scheduler.cancel(number)
            scheduler.step()
            if not scheduler.busy:
                mx.clear_cache()
