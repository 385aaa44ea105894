"""`mlx-dflash serve`: an OpenAI- and Anthropic-compatible HTTP server over one target + drafter pair.

A Starlette app on uvicorn. One engine thread owns the models; the `Engine` here runs requests one at a time
in arrival order (`--max-batch 1`, and sharded targets), except that a short request may be served whole
between two chunks of a long prompt's read; the default `BatchEngine` (batching.py) decodes several
together. A bounded queue feeds it and answers 503 when full. Each request is a `Job`: the engine pushes
its text to the request's asyncio queue round by round, and checks the job's cancel flag after every round
and between prefill chunks, so a client that goes away (streamed or not) stops its generation within a
round, or a chunk of its prompt (or, while a short request is served inside its read, once that one ends).

The routes and the uvicorn server are routes.py; the wire formats protocol.py (OpenAI chat and
completions), openai_responses.py (Responses) and anthropic.py (Messages); tool calls in replies tools.py;
what the network may send limits.py; who may send it security.py; the log logs.py. A sharded target
(`--shard`, rank 0's engine and the other ranks' loop) is sharded.py, through the Engine's hooks
(_next_job, _responses, _ended_early, fatal_errors). A thinking model's reasoning is cut from its answer
by thinking.py.
"""

import asyncio
import logging
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from ..decoding.prompt import encode_prompt
from ..decoding.prompt_cache import PromptCache, pair_identity
from ..decoding.responses import GenerationStats
from ..errors import DFlashError
from ..generate import stream_generate
from .protocol import APIError, Defaults, GenerationRequest, Outcome, PromptTooLong, StopMatcher
from .security import allowed_hosts
from .tools import ReplyParser, forced_prefix, generic_tools_messages, tool_support

log = logging.getLogger("mlx_dflash.server")
MARKED_MESSAGES = 4  # chat messages, counted from the end, whose ends are kept for a hybrid target
COMPOSED_CHARACTERS = 4  # a tokenizer's normalizer may compose this many characters into one (NFC: ᾇ)


@dataclass
class ServerConfig:
    """The server's settings (serve's flags): limits.py and security.py say what each limit does."""

    model_name: str  # the id clients send as "model"
    defaults: Defaults = field(default_factory=Defaults)
    api_keys: tuple = ()  # any of them is accepted; several: the prefix cache is kept apart per key
    max_body_bytes: int = 4 << 20
    max_tokens_limit: int = 8192  # a request's max_tokens is cut to this (and to what the context leaves)
    max_connections: int = 128
    max_uploads_per_client: Optional[int] = None  # bodies in flight per client address (None: max_connections // 4)
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    shutdown_grace: float = 10.0
    ping_seconds: float = 10.0  # a quiet stream (queued, prefilling) gets a keep-alive this often
    allowed_hosts: Optional[set] = field(default_factory=lambda: allowed_hosts("127.0.0.1", ()))
    allowed_origins: set = field(default_factory=set)
    generic_tools: bool = True  # tools for a template that renders none go in the generic form (else a 400)


class PromptSurelyTooLong(PromptTooLong):
    """A prompt whose text alone is over the context, refused before it is tokenized (prompt_tokens: at least)."""

    def __init__(self, at_least: int, characters: int, context: int, param: str):
        super().__init__(at_least, context, param)
        self.message = (f"the prompt is at least {at_least} tokens ({characters} characters of text) and this "
                        f"model's context is {context} tokens: shorten the {param}")


class PrefillCancelled(Exception):
    """Raised between prefill chunks when the job's client has left."""


class Job:
    """One request on its way through the engine. The engine thread talks to it through emit()."""

    def __init__(self, request: GenerationRequest, prompt_ids: list, parser: Optional[ReplyParser] = None,
                 boundaries=(), thinking=None, cache_scope: str = ""):
        self.request, self.prompt_ids, self.parser = request, prompt_ids, parser
        self.thinking = thinking  # a thinking.ReasoningSplitter, for a thinking model's chat reply
        self.boundaries = boundaries  # prompt positions where chat messages end (for the prefix cache)
        self.cache_scope = cache_scope  # the prefix cache's part for the request's API key (security.py)
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.finished = asyncio.Event()
        self.outcome: Optional[Outcome] = None
        self.error: Optional[APIError] = None
        self.cancelled = threading.Event()
        self.abort: Optional[APIError] = None  # the server ended it (shutting down): answered with this error
        self.started = False
        self.lock = threading.Lock()
        self.submitted = time.perf_counter()

    def emit(self, kind: str, payload=None):
        """From the engine thread: ("text", str), then ("done", Outcome) or ("error", APIError)."""
        try:
            self.loop.call_soon_threadsafe(self._put, kind, payload)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    def _put(self, kind: str, payload):
        if self.finished.is_set():  # settled already (cancelled before it ran)
            return
        self.events.put_nowait((kind, payload))
        if kind != "text":
            self.outcome = payload if kind == "done" else None
            self.error = payload if kind == "error" else None
            self.finished.set()

    def check_cancelled(self, processed: int, total: int):
        """stream_generate's prompt_progress_callback: stops the prefill between chunks once cancelled."""
        if self.cancelled.is_set():
            raise PrefillCancelled

    async def cancel(self):
        """The client left: stop the generation, and wait (at most a round, or a short request served inside
        its prompt's read) until the engine let go of it;
        one that has not started is settled here (the engine skips it)."""
        with self.lock:
            self.cancelled.set()
            running = self.started
        if not running:
            self._put("done", Outcome("cancelled", len(self.prompt_ids), 0))
        elif not self.finished.is_set():
            import anyio

            with anyio.CancelScope(shield=True):  # we may be running inside a cancelled task
                await self.finished.wait()


class Engine:
    """The model pair and the one thread that runs it.

    load() returns (target, drafter, tokenizer, policy) and runs on that thread too: MLX's default streams
    are per thread, so the models are loaded and run where they live (as mlx_lm.server does). Its errors
    (a DFlashError for a bad pair) are raised here, before anything is served. `max_queue` requests may
    wait (from admission, before their prompt is tokenized) while one runs; an idle engine takes one even
    with `max_queue` 0.
    """

    fatal_errors: tuple = ()  # errors after which the engine stops (none for one process)

    def __init__(self, load, max_queue: int = 16, prefill_step: int = 512, prompt_cache: Optional[dict] = None):
        self.max_queue, self.prefill_step = max_queue, prefill_step
        self.prompt_cache_settings = prompt_cache  # PromptCache keywords (max_entries, ...); None: no cache
        self.prompt_cache: Optional[PromptCache] = None
        self.failure: Optional[Exception] = None  # why the engine stopped, if it did
        self.stopping: Optional[str] = None  # why it takes no more requests (the server is shutting down)
        self.on_failure = None  # called (from the engine thread) when it does
        self.waiting = 0  # admitted, not yet started
        self.running: Optional[Job] = None
        self.paused: Optional[Job] = None  # a job whose prompt read waits while a short request runs
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
                               f"(--max-queue {self.max_queue}); retry later", code="queue_full",
                               headers={"Retry-After": str(self._retry_after())})
            self.waiting += 1

    def taken(self) -> int:
        """Admitted requests not yet over: waiting (those being tokenized included) or running."""
        return self.waiting + (self.running is not None) + (self.paused is not None)

    def _full(self) -> bool:
        """No room for one more request: one runs and --max-queue wait (an idle engine takes one even with
        --max-queue 0)."""
        return self.taken() >= 1 + self.max_queue

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
        return max(1, min(600, math.ceil(mean * (self.waiting + 1))))

    def stop(self, reason: str):
        """Shutting down: no new requests, the waiting ones answered 503 now; the running one goes on."""
        with self._lock:
            self.stopping = reason
        self._refuse_waiting(reason)

    def abort_running(self, reason: str):
        """End the running request at its next round, with a 503 error (in a stream: an error event)."""
        with self._lock:
            jobs = [self.running, self.paused]
        for job in filter(None, jobs):
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
        untruncated(self.tokenizer)
        self.chars_per_token = longest_token(self.tokenizer) * COMPOSED_CHARACTERS
        if self.prompt_cache_settings is not None:
            self.prompt_cache = PromptCache(pair_identity(self.target, self.drafter), self.target.trimmable,
                                            **self.prompt_cache_settings)

    def _next_job(self) -> Optional[Job]:
        return self._jobs.get()

    def _serve(self):
        while (job := self._next_job()) is not None:
            if not self._serve_job(job):
                return

    def _serve_job(self, job: Job) -> bool:
        """Run one job to its end and answer it; False when the engine cannot go on."""
        with self._lock, job.lock:
            self.waiting -= 1
            skip = job.cancelled.is_set()  # its client left while it waited
            job.started = not skip
            self.running = None if skip else job
        if skip:
            self.cancelled += 1
            job.emit("done", Outcome("cancelled", len(job.prompt_ids), 0))
            return True
        tic = time.perf_counter()
        try:
            outcome = self._generate(job)
            self.completed += outcome.finish_reason != "cancelled"
            self.cancelled += outcome.finish_reason == "cancelled"
            job.emit(*(("error", job.abort) if job.abort else ("done", outcome)))
        except self.fatal_errors as e:
            job.emit("error", APIError(500, str(e)))
            self._fail(e)
            return False
        except DFlashError as e:
            job.emit("error", APIError(400, str(e)))
        except Exception as e:  # a bug: the log gets the traceback, the client one line
            log.exception("generation failed")
            job.emit("error", APIError(500, f"internal error during generation ({type(e).__name__}); "
                                       "see the server log"))
        finally:
            with self._lock:
                self.running = None
            self._durations.append(time.perf_counter() - tic)
            mx.clear_cache()
        return True

    def _between_chunks(self, job: Job, done: int, total: int):
        """After each chunk of a prompt's read: stop if its client left (PrefillCancelled), and serve one
        request waiting behind it whose work (prompt and max_tokens) is under half of what is left to read,
        so a long read holds a short request up by about one chunk, not by its whole length (shorter work
        first lowers the mean wait). One per chunk, so the long read still advances; never nested; never
        inside a seeded sampled request, whose draws come from the global random state another request
        would move. The long request's clock (its prefill time) includes the short one's."""
        job.check_cancelled(done, total)
        left = total - done
        seeded = job.request.seed is not None and not job.request.sampling.greedy
        if self.paused is not None or seeded or left < self.prefill_step:
            return
        short = self._take_waiting(lambda j: not j.cancelled.is_set()
                                   and 2 * (len(j.prompt_ids) + j.request.max_tokens) < left)
        if short is None:
            return
        log.info("a %d-token request served between chunks of a %d-token read (%d read)",
                 len(short.prompt_ids), total, done)
        with self._lock:
            self.running, self.paused = None, job
        try:
            self._serve_job(short)
        finally:
            with self._lock:
                self.running, self.paused = job, None
        job.check_cancelled(done, total)  # its client may have left meanwhile

    def _take_waiting(self, wanted) -> Optional[Job]:
        """The first waiting job that `wanted` accepts, out of the queue (queue.Queue keeps its items in
        `.queue` under `.mutex`; nothing here uses its task counting)."""
        with self._jobs.mutex:
            for i, waiting in enumerate(self._jobs.queue):
                if waiting is not None and wanted(waiting):
                    del self._jobs.queue[i]
                    return waiting
        return None

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

    def _generate(self, job: Job) -> Outcome:
        req, tic = job.request, time.perf_counter()
        queued = tic - job.submitted
        stops = StopMatcher(req.stop)
        tokens, finish, stats = 0, None, GenerationStats(prompt_tokens=len(job.prompt_ids))
        responses = self._responses(job)
        try:
            text, current, seen = [], None, 0
            for response in responses:
                if response.round is not current:
                    current, seen = response.round, 0
                seen += 1
                # Token by token, so a stop string is cut exactly and counted at the token that completed it.
                tokens, stats = response.generation_tokens, response.stats
                text.append(stops.feed(response.text))
                if stops.stopped:
                    finish = "stop"
                elif response.finish_reason:
                    finish = response.finish_reason
                    text.append(stops.flush())
                if finish or seen == len(current.tokens):  # a round's text goes out as one event
                    if out := "".join(text):
                        job.emit("text", out)
                    text = []
                    if not finish and job.cancelled.is_set():  # checked once per round, before the next runs
                        finish = "cancelled"
                if finish:
                    break
        except PrefillCancelled:  # the client left during the prefill
            finish = "cancelled"
        finally:
            responses.close()
        if not stats.finish_reason:  # a stop string or a cancel ended it before the decoder did
            self._ended_early()
        return Outcome(finish, len(job.prompt_ids), tokens, stats, queued, time.perf_counter() - tic, stops.matched)

    def _responses(self, job: Job):
        req = job.request
        return stream_generate(self.target, self.drafter, self.tokenizer, job.prompt_ids, req.max_tokens,
                               seed=req.seed, policy=self.policy, prefill_step_size=self.prefill_step,
                               prompt_progress_callback=lambda done, total: self._between_chunks(job, done, total),
                               prompt_cache=self.prompt_cache,
                               boundaries=job.boundaries, cache_scope=job.cache_scope, **req.sampling.keywords())

    def _ended_early(self):
        pass  # one process: closing the generator was all

    def chat_input(self, req: GenerationRequest) -> tuple:
        """A chat request's messages and chat template options: its tools as the template takes them, or in the
        generic form of tools.py where it renders none; enable_thinking where the request sets it."""
        messages, options = req.prompt, {}
        if req.tools and self.tools.renders_tools:
            options["tools"] = req.tools
        elif req.tools:
            messages = generic_tools_messages(messages, req.tools)
        if req.thinking is not None:  # a template without a thinking switch ignores it
            options["enable_thinking"] = req.thinking
        return messages, options

    def prompt_ids(self, req: GenerationRequest) -> list:
        """The prompt's token ids: chat messages (and tools; in the generic form of tools.py where the template
        renders none) through the tokenizer's chat template, a forced tool call's opening (tools.forced_prefix)
        after its text; text as it is. Touches no MLX array: it runs on a worker thread, off the event
        loop and beside the engine."""
        tok = self.tokenizer
        if req.kind == "chat":
            if getattr(tok, "chat_template", None) is None:
                raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions")
            turn = (dict(add_generation_prompt=False, continue_final_message=True) if req.continue_final
                    else dict(add_generation_prompt=True))
            messages, options = self.chat_input(req)
            forced = req.force_tool is not None
            try:
                rendered = tok.apply_chat_template(messages, **turn, **options, tokenize=not forced)
            except Exception as e:  # the template's own checks (roles, order) raise its own types
                raise APIError(400, f"the chat template refused these messages: {e}"[:500], param="messages") from None
            if not forced:
                return list(rendered)
            # The opening is encoded with the prompt's text, as the template's own tokenizing encodes it (no
            # special tokens added): alone, a SentencePiece tokenizer would start it with a "▁" token.
            return list(tok.encode(rendered + forced_prefix(self.tools, req.force_tool), add_special_tokens=False))
        if isinstance(req.prompt, str):
            ids = encode_prompt(tok, req.prompt)
        else:
            ids, vocab = req.prompt, self.target.vocab_size
            if max(ids) >= vocab:
                raise APIError(400, f"'prompt' holds token id {max(ids)}; this model's vocabulary has {vocab}",
                               param="prompt")
        if not ids:
            raise APIError(400, "'prompt' encodes to no tokens", param="prompt")
        return ids

    def message_boundaries(self, req: GenerationRequest, ids: list) -> list:
        """Where the last few chat messages end in `ids`, when the prefix cache keeps a hybrid target's state
        only at chosen positions (a trimmable state serves every prefix: nothing to mark)."""
        if req.kind != "chat" or self.prompt_cache is None or self.prompt_cache.trimmable:
            return []
        messages, options = self.chat_input(req)  # as the prompt was rendered: tools and all
        marks = []
        for n in range(max(1, len(messages) - MARKED_MESSAGES), len(messages)):
            try:
                head = list(self.tokenizer.apply_chat_template(messages[:n], add_generation_prompt=True, **options))
            except Exception:  # a template that refuses a partial conversation: no mark there
                continue
            marks.append(next((i for i, (a, b) in enumerate(zip(head, ids)) if a != b), min(len(head), len(ids))))
        return marks

    def refuse_surely_too_long(self, req: GenerationRequest):
        """Refuse, before it is tokenized, a prompt whose length alone puts it over the context: token ids by
        their count; text (a completion's prompt, the chat messages' but the assistant's, which a template
        may leave out) by its characters over the most that one token can stand for. Tokenizing 4 MB of
        text takes seconds of a tokenizer thread that other requests wait for."""
        context = self.target.context_length
        if context is None:
            return
        if req.kind == "text" and not isinstance(req.prompt, str):
            if len(req.prompt) >= context:
                raise PromptTooLong(len(req.prompt), context, "prompt")
            return
        texts = [req.prompt] if req.kind == "text" else [m["content"] for m in req.prompt if m["role"] != "assistant"]
        characters = sum(len(t) for t in texts if isinstance(t, str))
        at_least = -(-characters // self.chars_per_token)
        if at_least >= context:
            raise PromptSurelyTooLong(at_least, characters, context, "messages" if req.kind == "chat" else "prompt")

    def fit(self, req: GenerationRequest, prompt_tokens: int, limit: int):
        """Refuse a prompt that leaves no room in the context; cut max_tokens to `limit` and to what fits."""
        context = self.target.context_length
        if context is not None and prompt_tokens >= context:
            raise PromptTooLong(prompt_tokens, context, "messages" if req.kind == "chat" else "prompt")
        req.max_tokens = min(req.max_tokens, limit, (context - prompt_tokens) if context else limit)


def longest_token(tokenizer) -> int:
    """The most characters one token of the vocabulary is written with (a byte-level vocabulary writes a byte
    as a character, so this bounds the bytes of text a token stands for, and so its characters)."""
    return max(len(piece) for piece in tokenizer.vocab)


def untruncated(tokenizer) -> None:
    """Clear the truncation and padding a tokenizer.json may set on the Rust tokenizer (transformers' fast
    tokenizer, behind mlx-lm's wrapper). transformers clears them on each call that finds them set, and a
    change while another thread tokenizes with it fails ("Already borrowed"): the tokenizer threads share
    one tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is not None:
        backend.no_truncation()
    if backend is not None and backend.padding is not None:
        backend.no_padding()


async def replies(job: Job, ping_seconds: Optional[float]):
    """The job's reply as it comes: ("reasoning", str), ("text", str) and ("call", ToolCall) pieces, ("ping",
    None) when nothing came for ping_seconds, then ("done", Outcome) or ("error", APIError)."""
    while True:
        try:
            kind, payload = await asyncio.wait_for(job.events.get(), timeout=ping_seconds)
        except asyncio.TimeoutError:
            yield "ping", None
            continue
        if kind == "text":
            for piece in _answer(job, job.thinking.feed(payload) if job.thinking else [("text", payload)]):
                yield piece
            continue
        if kind == "done":
            for piece in _answer(job, job.thinking.finish() if job.thinking else [], final=True):
                yield piece
        yield kind, payload
        return


def _answer(job: Job, pieces: list, final: bool = False) -> list:
    """Reasoning as it is; the answer's text through the request's tool-call parser, if it has one (final:
    the reply ended, and the parser gives what it held)."""
    out = []
    for kind, text in pieces:
        out += job.parser.feed(text) if kind == "text" and job.parser else [(kind, text)]
    return out + (job.parser.finish() if final and job.parser else [])


def bind(host: str, port: int):
    """The listening socket, before the models load: a taken port is a one-line error, not a wait then a crash."""
    import socket

    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise DFlashError(f"cannot listen on {host}:{port} ({e.strerror or e}): pass another --port or --host") from None
    return sock
