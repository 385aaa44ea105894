"""`mlx-dflash serve --shard tensor|pipeline` under mlx.launch: only rank 0 listens; the others follow it.

Rank 0 runs the usual server (app.py) with a `ShardedEngine`. Every rank runs the same decoding loop,
kept in step by distributed.py's `Ranks` exchanges; what is added here is the traffic between requests:

- for each request, rank 0 sends a fixed-size `Header` (its decoding parameters and prompt length) and then
  the prompt's token ids (the chat template was applied on rank 0); the others decode the same request;
- a stop string or a client that left ends a generation on rank 0 before the decoder finished: rank 0 then
  sends `Ranks.stop()`, which the others read in place of the next round's drafts, so all stop after the
  same round (a generation the decoder ends itself, by a stop token or max_tokens, ends alike everywhere);
- while no request waits, rank 0 sends a beat every second: the others' round heartbeat (`--rank-timeout`)
  stays fresh, and a rank that died is noticed within a second even when nobody is asking;
- when the server stops (Ctrl-C, SIGTERM), rank 0 sends a shutdown and every rank exits 0.

Every message is an `all_sum` of rank 0's values with zeros from the others, as in distributed.py.
A lost rank stops the server: rank 0 answers the running request 500 and the waiting ones 503, then
exits 1 with the same one-line error as `generate --shard`; the other ranks exit 1 likewise.
"""

import logging
import queue
import struct
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import numpy as np

from ..decoding.sampling import SamplingParams
from ..distributed import GenerationStopped, RankLost, Ranks, lost_rank_errors
from ..errors import DFlashError
from ..generate import stream_generate
from .app import Engine, Job

log = logging.getLogger("mlx_dflash.server")

BEAT, REQUEST, SHUTDOWN = 0, 1, 2
BEAT_SECONDS = 1.0
# kind, max_tokens, prompt tokens, top_k, has seed, seed, temperature, top_p, min_p: exact values, int32 words
_LAYOUT = struct.Struct("<qqqqqQddd")
HEADER_WORDS = _LAYOUT.size // 4


class RanksOutOfStep(DFlashError):
    """Rank 0 failed in the middle of a generation (a bug): the other ranks cannot be told where it stopped."""


@dataclass(frozen=True)
class Header:
    """What rank 0 tells the others before each request (or instead of one: a beat, the shutdown)."""

    kind: int
    max_tokens: int = 0
    prompt_tokens: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: Optional[int] = None

    def encode(self) -> mx.array:
        s = self.sampling
        packed = _LAYOUT.pack(self.kind, self.max_tokens, self.prompt_tokens, s.top_k, self.seed is not None,
                              self.seed or 0, s.temperature, s.top_p, s.min_p)
        return mx.array(np.frombuffer(packed, dtype=np.int32))

    @classmethod
    def decode(cls, words: mx.array) -> "Header":
        values = _LAYOUT.unpack(np.array(words, dtype=np.int32).tobytes())
        kind, max_tokens, prompt_tokens, top_k, has_seed, seed, temperature, top_p, min_p = values
        if kind not in (BEAT, REQUEST, SHUTDOWN) or (kind == REQUEST and (max_tokens < 1 or prompt_tokens < 1)):
            raise RanksOutOfStep(f"a malformed request header from rank 0 ({values}): the ranks are out of step")
        return cls(kind, max_tokens, prompt_tokens, SamplingParams(temperature, top_p, top_k, min_p),
                   seed if has_seed else None)


def send(ranks: Ranks, header: Header, prompt_ids: Optional[list] = None):
    """On rank 0: the header, then (a request) its prompt's token ids."""
    ranks.share(header.encode())
    if header.kind == REQUEST:
        ranks.share(mx.array(prompt_ids, dtype=mx.int32))


def receive(ranks: Ranks) -> Optional[tuple]:
    """On the other ranks: (header, prompt ids) of rank 0's next request, or None at its shutdown."""
    while True:
        header = Header.decode(ranks.share(mx.zeros(HEADER_WORDS, dtype=mx.int32)))
        if header.kind == SHUTDOWN:
            return None
        if header.kind == REQUEST:
            return header, ranks.share(mx.zeros(header.prompt_tokens, dtype=mx.int32)).tolist()


class ShardedEngine(Engine):
    """Rank 0's engine: `load` returns (target, drafter, tokenizer, policy, ranks)."""

    fatal_errors = (RankLost, RanksOutOfStep)

    def _take(self, loaded):
        *pair, self.ranks = loaded
        super()._take(pair)

    def _serve(self):
        try:
            with self.ranks.watch():
                super()._serve()
                if self.failure is None:
                    send(self.ranks, Header(SHUTDOWN))
        except self.fatal_errors as e:  # a beat or the shutdown found a rank gone
            self._fail(e)

    def _next_job(self) -> Optional[Job]:
        while True:
            try:
                return self._jobs.get(timeout=BEAT_SECONDS)
            except queue.Empty:
                send(self.ranks, Header(BEAT))

    def _generate(self, job: Job):
        try:
            with lost_rank_errors(self.ranks.rank):
                return super()._generate(job)
        except DFlashError:  # a lost rank, or an error every rank met alike (they all go on)
            raise
        except Exception as e:
            log.exception("generation failed")
            raise RanksOutOfStep(f"rank 0: generation failed mid-request ({type(e).__name__}, a bug: see the "
                                 "traceback above); the ranks can no longer be kept in step, so the server "
                                 "stops") from e

    def _responses(self, job: Job):
        req = job.request
        send(self.ranks, Header(REQUEST, req.max_tokens, len(job.prompt_ids), req.sampling, req.seed),
             job.prompt_ids)
        # No cancel between prefill chunks: the other ranks could not be told where the prefill stopped.
        return stream_generate(self.target, self.drafter, self.tokenizer, job.prompt_ids, req.max_tokens,
                               seed=req.seed, policy=self.policy, ranks=self.ranks, prefill_step_size=self.prefill_step,
                               **req.sampling.keywords())

    def _ended_early(self):
        self.ranks.stop()


def follow(target, drafter, tokenizer, policy, ranks: Ranks, prefill_step: int = 2048):
    """A rank other than 0: decode each request rank 0 sends, in step with it, until its shutdown.
    prefill_step: rank 0's (every rank is started with the same --prefill-step-size)."""
    with ranks.watch():
        while (request := receive(ranks)) is not None:
            header, prompt_ids = request
            try:
                for _ in stream_generate(target, drafter, tokenizer, prompt_ids, header.max_tokens, seed=header.seed,
                                         policy=policy, ranks=ranks, prefill_step_size=prefill_step,
                                         **header.sampling.keywords()):
                    pass
            except GenerationStopped:  # rank 0 ended it after the round before
                pass
            except DFlashError:  # rank 0 met the same error and answered it
                pass
            finally:
                mx.clear_cache()
