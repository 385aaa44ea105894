"""The engine: the model pair, the one thread that runs it, and the requests decoding together.

The engine thread takes requests off the queue while the batch has room (the rest wait in the queue,
bounded by --max-queue), steps the scheduler (decoding/batch_decoder.py: a prefill chunk of a prompt in line,
then one round for every row), and hands each row's round to its request: text out once a round, stop
strings cut exactly, a request whose client left, or whose stop string matched, leaving the batch at once.
`--max-batch 1` is its one-row case. Statistics per request are one request's (decoding/responses.py);
/health adds the batch's (rows per round, widths chosen). A sharded target's rank 0 runs it with the hooks
server/sharded.py fills (ranks, _next_job, _step, fatal_errors).
"""

import logging
import math
import queue
import threading
import time
from collections import deque
from typing import Optional

import mlx.core as mx

from ..decoding.batch_decoder import Scheduler
from ..decoding.engine_report import Report, verify_paths
from ..decoding.decoder import SingleProcess
from ..decoding.prompt_cache import PromptCache, pair_identity
from ..decoding.responses import GenerationStats, ResponseStream, admitted_stream
from .jobs import Job
from .prompts import Prompts
from .protocol import APIError, Outcome, StopMatcher
from .tools import tool_support

log = logging.getLogger("mlx_dflash.server")


class JobProgress:
    """One request's rounds on their way to its client: stop strings, text per round, how it ended."""

    def __init__(self, job: Job):
        self.job, self.stops = job, StopMatcher(job.req.stop)
        job.started = True
        self.stream, self.tokens, self.finish = None, 0, None
        self.started = time.perf_counter()  # until its prompt's first chunk is read

    def admitted(self, stream: ResponseStream, report: Report, started: float):
        """Its first chunk is being read: the time before, behind other prompts' reads too, was queued."""
        self.stream, self.report, self.started = stream, report, started

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
        self.report.update()
        if out := "".join(text):
            self.job.emit("text", out)
        return self.finish is not None

    def outcome(self) -> Outcome:
        stats = self.stream.stats if self.stream is not None else GenerationStats(len(self.job.ids))
        queued = self.started - self.job.submitted
        return Outcome(self.finish or "cancelled", len(self.job.ids), self.tokens, stats, queued,
                       time.perf_counter() - self.started, self.stops.matched)


class Engine:
    """The model pair, the one thread that runs it, and the requests decoding together.

    load() returns (target, drafter, tokenizer, policy) and runs on that thread too: MLX's default streams
    are per thread, so the models are loaded and run where they live (as mlx_lm.server does). Its errors
    (a DFlashError for a bad pair) are raised here, before anything is served.

    Up to `max_batch` requests decode together (1: one at a time) and `max_queue` more may wait (from
    admission, before their prompt is tokenized). The thread moves queued requests into the scheduler
    (decoding/batch_decoder.py `Scheduler`) while it has room, steps it (a prefill chunk of a prompt in line,
    then one round for every row), and hands each row's round to its request: text out once a round, stop
    strings cut exactly, a request whose client left, or whose stop string matched, leaving at once.
    """

    fatal_errors: tuple = ()  # errors after which the engine stops (none for one process)
    probes_ahead = True  # the width policy's probes made at start-up (a sharded target's: as prompts need them)
    ranks = SingleProcess()  # a sharded target's (server/sharded.py)
    prompts_class = Prompts  # what makes a request's prompt, on the tokenizer threads (`self.prompts`)

    def __init__(self, load, max_queue: int = 16, prefill_step: Optional[int] = None, prompt_cache: Optional[dict] = None,
                 max_batch: int = 8):
        self.max_queue, self.prefill_step, self.max_batch = max_queue, prefill_step, max_batch
        self.prompt_cache_settings = prompt_cache  # PromptCache keywords (max_entries, ...); None: no cache
        self.prompt_cache: Optional[PromptCache] = None
        self.failure: Optional[Exception] = None  # why the engine stopped, if it did
        self.stopping: Optional[str] = None  # why it takes no more requests (the server is shutting down)
        self.on_failure = None  # called (from the engine thread) when it does
        self.waiting = 0  # admitted, not yet in the scheduler
        self.active: set = set()  # the jobs in the scheduler
        self.batch_stats = None
        self.completed = self.cancelled = 0
        self._durations = deque(maxlen=8)  # recent request seconds, for Retry-After
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._loaded, self._load_error = threading.Event(), None
        self._thread = threading.Thread(target=self._run, args=(load,), name="mlx-dflash-engine", daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            raise self._load_error

    def admit(self):
        """Take a place in the queue (503 when it is full), before any work is done for the request."""
        with self._lock:
            if self.failure is not None or self.stopping is not None:
                raise APIError(503, f"the server is stopping: {self.failure or self.stopping}")
            if self._full():
                raise APIError(503, f"the server is busy: {self.taken()} requests are running or waiting "
                               f"(--max-batch {self.max_batch}, --max-queue {self.max_queue}); retry later",
                               code="queue_full", headers={"Retry-After": str(self._retry_after())})
            self.waiting += 1

    def taken(self) -> int:
        """Admitted requests not yet over: waiting (those being tokenized included) or in the scheduler."""
        return self.waiting + len(self.active)

    def _full(self) -> bool:
        """No room for one more request: the batch's rows and --max-queue more are taken. Every admitted
        request counts, those still being tokenized included (a burst arrives before any joins the batch)."""
        return self.taken() >= self.max_batch + self.max_queue

    def leave(self):
        """An admitted request that will not be queued (its prompt was refused)."""
        with self._lock:
            self.waiting -= 1

    def enqueue(self, job: Job):
        """Queue an admitted job (a stopping engine answers it at once)."""
        with self._lock:
            if self.failure is None and self.stopping is None:
                return self._jobs.put(job)
            self.waiting -= 1
        job.emit("error", APIError(503, f"the server is stopping: {self.failure or self.stopping}"))

    def submit(self, job: Job):
        self.admit()
        self.enqueue(job)

    def _retry_after(self) -> int:
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, min(600, math.ceil(mean * (self.waiting + 1) / self.max_batch)))

    def stop(self, reason: str):
        """Shutting down: no new requests, the waiting ones answered 503 now; the running ones go on."""
        with self._lock:
            self.stopping = reason
        self._refuse_waiting(reason)

    def abort_running(self, reason: str):
        """End every request in the scheduler at the next step, each with a 503 error."""
        for job in list(self.active):
            job.abort = APIError(503, reason)
            job.cancelled.set()

    def close(self):
        self._jobs.put(None)
        self._thread.join(timeout=60)

    def _run(self, load):
        try:
            self._take(load())
        except BaseException as e:  # handed to the constructor, on the caller's thread
            self._load_error = e
            return
        finally:
            self._loaded.set()
        self._serve()

    def _take(self, loaded):
        self.target, self.drafter, self.tokenizer, self.policy = loaded
        self.tools = tool_support(self.tokenizer)
        if self.prompt_cache_settings is not None:
            self.prompt_cache = PromptCache(pair_identity(self.target, self.drafter), self.target.trimmable,
                                            **self.prompt_cache_settings)
        self.prompts = self.prompts_class(self.tokenizer, self.target, self.tools, self.prompt_cache)
        self.verify_paths = verify_paths(self.target)  # the target's paths do not change while it is served
        while self.probes_ahead and self.policy.probe_ahead():
            pass  # every verify-cost probe the width policy may want, before any request can wait for one
        self.scheduler = self._new_scheduler()

    def _new_scheduler(self) -> Scheduler:
        scheduler = Scheduler(self.target, self.drafter, self.policy, self.max_batch, self.tokenizer.eos_token_ids,
                              self.prompt_cache, self.prefill_step, self.ranks)
        self.batch_stats = scheduler.stats
        return scheduler

    def _next_job(self) -> Optional[Job]:
        """The next queued job, waiting for one (the engine is idle)."""
        return self._jobs.get()

    def _step(self) -> list:
        return self.scheduler.step()

    def _serve(self):
        progress: dict = {}  # job -> JobProgress, for the jobs in the scheduler
        self.active = progress.keys()
        while self._take_jobs(progress):
            for job, p in list(progress.items()):
                if job.cancelled.is_set() and p.finish is None:
                    self.scheduler.cancel(job)
            try:
                events = self._step()
            except self.fatal_errors as e:  # a sharded server lost a rank: every request gets the line
                for job in progress:
                    job.emit("error", APIError(500, str(e)))
                return self._fail(e)
            except Exception as e:  # a bug: every request in the batch gets one line; the engine goes on
                log.exception("generation failed")
                for job in progress:
                    job.emit("error", APIError(500, f"internal error during generation ({type(e).__name__}); "
                                               "see the server log"))
                progress.clear()
                self.scheduler = self._new_scheduler()
                mx.clear_cache()
                continue
            for job, kind, value in events:
                self._dispatch(job, kind, value, progress)

    def _take_jobs(self, progress: dict) -> bool:
        """Move queued jobs into the scheduler while it has room (its rows and one more prompt to read); wait
        for one when idle. False: shut down (after the jobs in the scheduler ended)."""
        while len(progress) <= self.max_batch:
            try:
                job = self._next_job() if not self.scheduler.busy else self._jobs.get_nowait()
            except queue.Empty:  # nothing more to take now
                return True
            if job is None:
                for waiting in progress:
                    self.scheduler.cancel(waiting)
                while self.scheduler.busy:
                    for j, kind, value in self._step():
                        self._dispatch(j, kind, value, progress)
                return False
            with self._lock, job.lock:
                self.waiting -= 1
                skip = job.cancelled.is_set()  # its client left while it waited
                if not skip:  # counted as taken (_full) from the moment it is no longer waiting
                    progress[job] = JobProgress(job)
            if skip:
                self.cancelled += 1
                job.emit("done", Outcome("cancelled", len(job.ids), 0))
                continue
            self.scheduler.submit(job)
        return True

    def _dispatch(self, job: Job, kind: str, value, progress: dict):
        p = progress.get(job)
        if p is None:
            return
        if kind == "admitted":
            stream = admitted_stream(self.tokenizer, self.policy, len(job.ids), job.max_tokens, value,
                                     self.prompt_cache)
            # the engine report: the verify's paths, and the routed calls since it began (a batch's: one forward
            # verifies every row)
            p.admitted(stream, Report(self.target, self.policy, stream.stats, paths=self.verify_paths), value[1])
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
            if not progress:  # an idle engine gives back MLX's cached buffers; rows decoding would reallocate them
                mx.clear_cache()

    def batch_report(self) -> dict:
        s = self.batch_stats
        return {"max_batch": self.max_batch, "rounds": s.rounds,
                "rows": {str(k): v for k, v in sorted(s.rows.items())},
                "widths": {str(k): v for k, v in sorted(s.widths.items())}}

    def _refuse_waiting(self, reason):
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:  # close()'s end mark: keep it for the engine thread
                return self._jobs.put(None)
            self.leave()
            job.emit("error", APIError(503, f"the server is stopping: {reason}"))

    def _fail(self, error: Exception):
        """The engine cannot go on (a sharded server lost a rank): refuse what waits and stop the server."""
        with self._lock:
            self.failure = error
        self._refuse_waiting(error)
        if self.on_failure is not None:
            self.on_failure()
