"""`mlx-dflash serve`: an OpenAI-compatible HTTP server over one target + drafter pair.

A Starlette app on uvicorn. One engine thread owns the models and runs requests one at a time in arrival
order (the decoder's batch size is 1); a bounded queue feeds it and answers 503 when full. Each request is
a `Job`: the engine pushes its text to the request's asyncio queue round by round, and checks the job's
cancel flag after every round, so a client that goes away stops its generation at the next round.

The wire format (parsing, stop strings, response bodies) is in protocol.py; a sharded target
(`--shard`, rank 0's engine and the other ranks' loop) in sharded.py, through the Engine's hooks
(_next_job, _responses, _ended_early, fatal_errors).
"""

import asyncio
import hmac
import json
import logging
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from ..generate import encode_prompt, stream_generate
from ..responses import GenerationStats
from ..prompt_cache import PromptCache, pair_identity
from ..errors import DFlashError
from .protocol import (APIError, Defaults, GenerationRequest, Outcome, StopMatcher, chunk_body,
                             completion_body, parse_chat, parse_completion, usage_chunk_body)

log = logging.getLogger("mlx_dflash.server")
MARKED_MESSAGES = 4  # chat messages, counted from the end, whose ends are kept for a hybrid target


@dataclass
class ServerConfig:
    model_name: str  # the id clients send as "model"
    defaults: Defaults = field(default_factory=Defaults)
    api_key: Optional[str] = None
    max_body_bytes: int = 4 << 20


class Job:
    """One request on its way through the engine. The engine thread talks to it through emit()."""

    def __init__(self, request: GenerationRequest, prompt_ids: list, boundaries=()):
        self.request, self.prompt_ids = request, prompt_ids
        self.boundaries = boundaries  # prompt positions where chat messages end (for the prefix cache)
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.finished = asyncio.Event()
        self.outcome: Optional[Outcome] = None
        self.cancelled = threading.Event()
        self.started = False
        self.lock = threading.Lock()
        self.submitted = time.perf_counter()

    def emit(self, kind: str, payload=None):
        """From the engine thread: ("text", str), then ("done", Outcome) or ("error", APIError)."""
        def put():
            self.events.put_nowait((kind, payload))
            if kind != "text":
                self.outcome = payload if kind == "done" else self.outcome
                self.finished.set()
        try:
            self.loop.call_soon_threadsafe(put)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    async def cancel(self):
        """The client left: stop the generation, and wait (at most a round) until the engine let go of it."""
        with self.lock:
            self.cancelled.set()
            running = self.started
        if running and not self.finished.is_set():
            import anyio

            with anyio.CancelScope(shield=True):  # we may be running inside a cancelled task
                await self.finished.wait()


class Engine:
    """The model pair and the one thread that runs it.

    load() returns (target, drafter, tokenizer, policy) and runs on that thread too: MLX's default streams
    are per thread, so the models are loaded and run where they live (as mlx_lm.server does). Its errors
    (a DFlashError for a bad pair) are raised here, before anything is served.
    """

    fatal_errors: tuple = ()  # errors after which the engine stops (none for one process)

    def __init__(self, load, max_queue: int = 16, prompt_cache: Optional[dict] = None):
        self.max_queue = max_queue
        self.prompt_cache_settings = prompt_cache  # PromptCache keywords (max_entries, ...); None: no cache
        self.prompt_cache: Optional[PromptCache] = None
        self.failure: Optional[Exception] = None  # why the engine stopped, if it did
        self.on_failure = None  # called (from the engine thread) when it does
        self.waiting = 0  # submitted, not yet started
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

    def submit(self, job: Job):
        with self._lock:
            if self.failure is not None:
                raise APIError(503, f"the server is stopping: {self.failure}")
            if self.waiting >= self.max_queue:
                raise APIError(503, f"the server is busy: {self.waiting} requests are waiting already "
                               f"(--max-queue {self.max_queue}); retry later", code="queue_full",
                               headers={"Retry-After": str(self._retry_after())})
            self.waiting += 1
        self._jobs.put(job)

    def _retry_after(self) -> int:
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, min(600, math.ceil(mean * (self.waiting + 1))))

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
        if self.prompt_cache_settings is not None:
            self.prompt_cache = PromptCache(pair_identity(self.target, self.drafter), self.target.trimmable,
                                            **self.prompt_cache_settings)

    def _next_job(self) -> Optional[Job]:
        return self._jobs.get()

    def _serve(self):
        while (job := self._next_job()) is not None:
            with self._lock:
                self.waiting -= 1
            with job.lock:
                skip = job.cancelled.is_set()
                job.started = not skip
            if skip:  # its client left while it waited
                self.cancelled += 1
                continue
            tic = time.perf_counter()
            try:
                outcome = self._generate(job)
                self.completed += outcome.finish_reason != "cancelled"
                self.cancelled += outcome.finish_reason == "cancelled"
                job.emit("done", outcome)
            except self.fatal_errors as e:
                job.emit("error", APIError(500, str(e)))
                self._fail(e)
                return
            except DFlashError as e:
                job.emit("error", APIError(400, str(e)))
            except Exception as e:  # a bug: the log gets the traceback, the client one line
                log.exception("generation failed")
                job.emit("error", APIError(500, f"internal error during generation ({type(e).__name__}); "
                                           "see the server log"))
            finally:
                self._durations.append(time.perf_counter() - tic)
                mx.clear_cache()

    def _fail(self, error: Exception):
        """The engine cannot go on (a sharded server lost a rank): refuse what waits and stop the server."""
        with self._lock:
            self.failure = error
            while not self._jobs.empty():
                if (job := self._jobs.get_nowait()) is not None:
                    job.emit("error", APIError(503, f"the server is stopping: {error}"))
            self.waiting = 0
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
        finally:
            responses.close()
        if not stats.finish_reason:  # a stop string or a cancel ended it before the decoder did
            self._ended_early()
        return Outcome(finish, len(job.prompt_ids), tokens, stats, queued, time.perf_counter() - tic)

    def _responses(self, job: Job):
        req = job.request
        return stream_generate(self.target, self.drafter, self.tokenizer, job.prompt_ids, req.max_tokens,
                               seed=req.seed, policy=self.policy, prompt_cache=self.prompt_cache,
                               boundaries=job.boundaries, **req.sampling.keywords())

    def _ended_early(self):
        pass  # one process: closing the generator was all

    def prompt_ids(self, req: GenerationRequest) -> list:
        """The prompt's token ids: chat messages through the tokenizer's chat template, text as it is."""
        tok = self.tokenizer
        if req.kind == "chat":
            if getattr(tok, "chat_template", None) is None:
                raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions")
            try:
                return encode_prompt(tok, req.prompt, chat_template=True)
            except Exception as e:  # the template's own checks (roles, order) raise its own types
                raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
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
        marks = []
        for n in range(max(1, len(req.prompt) - MARKED_MESSAGES), len(req.prompt)):
            try:
                head = encode_prompt(self.tokenizer, req.prompt[:n], chat_template=True)
            except Exception:  # a template that refuses a partial conversation: no mark there
                continue
            marks.append(next((i for i, (a, b) in enumerate(zip(head, ids)) if a != b), min(len(head), len(ids))))
        return marks


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _error_response(e: APIError):
    from starlette.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _log_info(request) -> dict:
    return request.scope.setdefault("dflash.log", {})


def _record(info: dict, req: GenerationRequest, outcome: Optional[Outcome]):
    info["id"] = req.id
    if outcome is not None:
        info["outcome"] = outcome


def make_app(engine: Engine, config: ServerConfig):
    """The ASGI app: routes, OpenAI-shaped errors, the API key check and the one-line request log."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    started = int(time.time())
    model_card = {"id": config.model_name, "object": "model", "created": started, "owned_by": "mlx-dflash"}

    async def health(request):
        body = {"status": "ok", "model": config.model_name, "waiting": engine.waiting}
        if engine.prompt_cache is not None:
            body["prompt_cache"] = engine.prompt_cache.stats()
        return JSONResponse(body)

    async def models(request):
        return JSONResponse({"object": "list", "data": [model_card]})

    async def model(request):
        if request.path_params["model_id"] != config.model_name:
            raise APIError(404, f"model '{request.path_params['model_id']}' is not served here", code="model_not_found")
        return JSONResponse(model_card)

    async def read_json(request):
        limit = config.max_body_bytes
        too_large = APIError(413, f"the request body is larger than {limit} bytes (--max-body)")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_large
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})") from None

    async def generate(request, parse):
        req = parse(await read_json(request), config.defaults, config.model_name)
        ids = engine.prompt_ids(req)
        job = Job(req, ids, engine.message_boundaries(req, ids))
        engine.submit(job)
        info = _log_info(request)
        _record(info, req, None)
        if req.stream:
            return StreamingResponse(_stream(job, info), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(job, request, info)

    async def _collect(job, request, info):
        text = []
        while not (job.finished.is_set() and job.events.empty()):
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    await job.cancel()
                    _record(info, job.request, job.outcome or Outcome("cancelled", len(job.prompt_ids), 0))
                    return JSONResponse({}, status_code=499)  # nobody reads it; the log shows the cancel
                continue
            if kind == "text":
                text.append(payload)
            elif kind == "error":
                raise payload
        _record(info, job.request, job.outcome)
        return JSONResponse(completion_body(job.request, "".join(text), job.outcome))

    async def _stream(job, info):
        req = job.request
        try:
            if req.kind == "chat":
                yield _sse(chunk_body(req, "", first=True))
            while True:
                kind, payload = await job.events.get()
                if kind == "text":
                    yield _sse(chunk_body(req, payload))
                elif kind == "error":
                    info["error"] = payload.message
                    yield _sse(payload.body())
                    break
                else:
                    _record(info, req, payload)
                    yield _sse(chunk_body(req, None, payload.finish_reason))
                    if req.include_usage:
                        yield _sse(usage_chunk_body(req, payload))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not job.finished.is_set():  # the client went away mid-stream
                await job.cancel()
                _record(info, req, job.outcome or Outcome("cancelled", len(job.prompt_ids), 0))

    async def chat(request):
        return await generate(request, parse_chat)

    async def completions(request):
        return await generate(request, parse_completion)

    async def api_error(request, e: APIError):
        _log_info(request)["error"] = e.message
        return _error_response(e)

    async def http_error(request, e: HTTPException):
        messages = {404: f"no such endpoint: {request.method} {request.url.path}",
                    405: f"{request.method} is not allowed on {request.url.path}"}
        return await api_error(request, APIError(e.status_code, messages.get(e.status_code, str(e.detail))))

    async def internal_error(request, e: Exception):
        log.exception("request failed")
        return await api_error(request, APIError(500, f"internal error ({type(e).__name__}); see the server log"))

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/models/{model_id:path}", model),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={APIError: api_error, HTTPException: http_error, Exception: internal_error})
    return RequestLog(ApiKey(app, config.api_key))


class ApiKey:
    """With a key set, every path but /health needs `Authorization: Bearer <key>` (401 otherwise)."""

    def __init__(self, app, key: Optional[str]):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if self.key and scope["type"] == "http" and scope["path"] != "/health":
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.key}".encode()):
                scope.setdefault("dflash.log", {})["error"] = "missing or wrong API key"
                e = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")
                return await _error_response(e)(scope, receive, send)
        await self.app(scope, receive, send)


class RequestLog:
    """One line per request, once its response is sent: status, id, tokens, speed, tau, finish."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        info = scope.setdefault("dflash.log", {})
        status, tic = {}, time.perf_counter()

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            log.info(_log_line(scope, status.get("code", 500), info, time.perf_counter() - tic))


def _log_line(scope, status: int, info: dict, seconds: float) -> str:
    parts = [scope["method"], scope["path"], str(status)]
    if "id" in info:
        parts.append(f"id={info['id']}")
    outcome = info.get("outcome")
    if outcome is not None:
        tps = outcome.completion_tokens / outcome.seconds if outcome.seconds else 0.0
        tau = outcome.stats.tau if outcome.stats is not None else 0.0
        parts += [f"prompt={outcome.prompt_tokens}", f"completion={outcome.completion_tokens}",
                  f"tok/s={tps:.1f}", f"tau={tau:.2f}", f"finish={outcome.finish_reason}",
                  f"queued={outcome.queue_seconds:.2f}s"]
    if "error" in info:
        parts.append(f"error={json.dumps(info['error'][:200])}")
    parts.append(f"{seconds:.2f}s")
    return " ".join(parts)


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


def run_server(engine: Engine, config: ServerConfig, sock):
    """Serve on a bound socket until interrupted (Ctrl-C or SIGTERM: a clean stop, exit status 0)."""
    import signal

    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    server = uvicorn.Server(uvicorn.Config(make_app(engine, config), log_level="warning", access_log=False))
    host, port = sock.getsockname()[:2]
    log.info(f"serving {config.model_name} at http://{host}:{port}/v1"
             + (" (API key required)" if config.api_key else ""))
    engine.on_failure = lambda: setattr(server, "should_exit", True)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again for the handler it found:
    # this one ignores it, so that the engine still closes (a sharded one tells the other ranks to stop).
    stop_signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in stop_signals}
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if engine.failure is not None:
        raise engine.failure
