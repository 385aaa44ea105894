"""`serve --max-batch N`: the engine that decodes up to N requests together (batch_decoder.Scheduler).

The engine thread takes requests off the queue while the batch has room (the rest wait in the queue,
bounded by --max-queue as before), steps the scheduler (a prefill chunk of the next prompt in line, then
one round for every row), and hands each row's round to its request: text out once a round, stop strings cut
exactly, a request whose client left, or whose stop string matched, leaving the batch at once. Statistics
per request are the single-request ones; /health adds the batch's (rows per round, widths chosen).
"""

import logging
import queue
import time

import mlx.core as mx

from ..decoding.batch_decoder import Request, Scheduler
from ..decoding.responses import GenerationStats, ResponseStream
from ..errors import DFlashError
from ..decoding.prompt import check_context
from .app import Engine, Job
from .protocol import APIError, Outcome, StopMatcher

log = logging.getLogger("mlx_dflash.server")


class JobProgress:
    """One request's rounds on their way to its client: stop strings, text per round, how it ended."""

    def __init__(self, job: Job):
        self.job, self.stops = job, StopMatcher(job.request.stop)
        job.started = True
        self.stream, self.tokens, self.finish = None, 0, None
        self.started = time.perf_counter()  # until its prompt's first chunk is read

    def admitted(self, stream: ResponseStream, started: float):
        """Its first chunk is being read: the time before, behind other prompts' reads too, was queued."""
        self.stream, self.started = stream, started

    def take(self, rnd) -> bool:
        """A round of this request's tokens; True once it is over (a stop token or string, max_tokens)."""
        text = []
        for response in self.stream.feed(rnd):
            # Token by token, so a stop string is cut exactly and counted at the token that completed it.
            self.tokens = response.generation_tokens
            text.append(self.stops.feed(response.text))
            if self.stops.stopped:
                self.finish = "stop"
                break
            if response.finish_reason:
                self.finish = response.finish_reason
                text.append(self.stops.flush())
        if out := "".join(text):
            self.job.emit("text", out)
        return self.finish is not None

    def outcome(self) -> Outcome:
        stats = self.stream.stats if self.stream is not None else GenerationStats(len(self.job.prompt_ids))
        queued = self.started - self.job.submitted
        return Outcome(self.finish or "cancelled", len(self.job.prompt_ids), self.tokens, stats, queued,
                       time.perf_counter() - self.started, self.stops.matched)


class BatchEngine(Engine):
    """Rank 0's engine for one process, decoding up to `max_batch` requests together; load() returns
    (target, drafter, tokenizer, batch policy)."""

    def __init__(self, load, max_queue: int = 16, prefill_step: int = 512, prompt_cache=None, max_batch: int = 8):
        self.max_batch = max_batch
        self.batch_stats = None
        self.active: set = set()  # the jobs in the scheduler
        super().__init__(load, max_queue, prefill_step, prompt_cache)

    def _full(self) -> bool:
        """No room for one more request: the batch's rows and --max-queue more are taken. Every admitted
        request counts, those still being tokenized included (a burst arrives before any joins the batch)."""
        return self.taken() >= self.max_batch + self.max_queue

    def taken(self) -> int:
        return self.waiting + len(self.active)

    def abort_running(self, reason: str):
        """End every request in the batch at the next step, each with a 503 error."""
        for job in list(self.active):
            job.abort = APIError(503, reason)
            job.cancelled.set()

    def _take(self, loaded):
        super()._take(loaded)
        self.scheduler = self._new_scheduler()

    def _new_scheduler(self) -> Scheduler:
        scheduler = Scheduler(self.target, self.drafter, self.policy, self.max_batch, self.tokenizer.eos_token_ids,
                              self.prompt_cache, self.prefill_step)
        self.batch_stats = scheduler.stats
        return scheduler

    def _serve(self):
        progress: dict = {}  # job -> JobProgress, for the jobs in the scheduler
        self.active = progress.keys()
        while True:
            taken = self._take_jobs(progress)
            if taken is None:
                return
            for job, p in list(progress.items()):
                if job.cancelled.is_set() and p.finish is None:
                    self.scheduler.cancel(job)
            try:
                events = self.scheduler.step()
            except Exception as e:  # a bug: every request in the batch gets one line; the engine goes on
                log.exception("batched generation failed")
                for job in progress:
                    job.emit("error", APIError(500, f"internal error during generation ({type(e).__name__}); "
                                               "see the server log"))
                progress.clear()
                self.scheduler = self._new_scheduler()
                mx.clear_cache()
                continue
            for job, kind, value in events:
                self._dispatch(job, kind, value, progress)

    def _take_jobs(self, progress: dict):
        """Move queued jobs into the scheduler while the batch has room; wait for one when idle. None: shut
        down (after the jobs in the scheduler ended)."""
        while len(progress) < self.max_batch:
            idle = not self.scheduler.busy
            try:
                job = self._jobs.get(timeout=None) if idle else self._jobs.get_nowait()
            except queue.Empty:  # nothing more to take now
                return True
            if job is None:
                for waiting in progress:
                    self.scheduler.cancel(waiting)
                while self.scheduler.busy:
                    for j, kind, value in self.scheduler.step():
                        self._dispatch(j, kind, value, progress)
                return None
            with self._lock, job.lock:
                self.waiting -= 1
                skip = job.cancelled.is_set()  # its client left while it waited
                if not skip:  # counted as taken (_full) from the moment it is no longer waiting
                    progress[job] = JobProgress(job)
            if skip:
                self.cancelled += 1
                job.emit("done", Outcome("cancelled", len(job.prompt_ids), 0))
                continue
            req = job.request
            try:
                max_tokens = check_context(self.target, len(job.prompt_ids), req.max_tokens)
            except DFlashError as e:
                del progress[job]
                job.emit("error", APIError(400, str(e)))
                continue
            self.scheduler.submit(Request(job, job.prompt_ids, max_tokens, req.sampling, req.seed,
                                          tuple(job.boundaries), job.cache_scope))
        return True

    def _dispatch(self, job: Job, kind: str, value, progress: dict):
        p = progress.get(job)
        if p is None:
            return
        if kind == "admitted":
            cached, started = value
            stats = GenerationStats(prompt_tokens=len(job.prompt_ids), block_size=self.policy.block_size,
                                    max_width=self.policy.max_width, notes=list(self.policy.notes), cached_tokens=cached)
            if self.prompt_cache is not None:
                stats.prefill_seconds_saved = self.prompt_cache.seconds_saved(cached)
            p.admitted(ResponseStream(self.tokenizer, stats, job.request.max_tokens, started, self.prompt_cache),
                       started)
        elif kind == "round" and p.finish is None:
            if p.take(value):
                self.scheduler.cancel(job)  # it is over: its row leaves at the next step
        elif kind == "done":
            outcome = p.outcome()
            self.completed += outcome.finish_reason != "cancelled"
            self.cancelled += outcome.finish_reason == "cancelled"
            self._durations.append(outcome.seconds)
            job.emit(*(("error", job.abort) if job.abort else ("done", outcome)))
            del progress[job]

    def batch_report(self) -> dict:
        s = self.batch_stats
        return {"max_batch": self.max_batch, "rounds": s.rounds,
                "rows": {str(k): v for k, v in sorted(s.rows.items())},
                "widths": {str(k): v for k, v in sorted(s.widths.items())}}
