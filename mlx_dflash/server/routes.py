"""The HTTP side of `mlx-dflash serve`: the routes, their errors, the middlewares, and the uvicorn server.

Each generation route reads and checks its body (limits.py, then the API's parser), refuses a prompt whose
text alone is over the context, takes a place in the engine's queue, tokenizes the prompt on one of a few
worker threads (never on the event loop: a 4 MB prompt takes seconds; the tokenizers release the GIL, so a
short prompt is tokenized beside long ones; big prompts have threads of their own, so that however many
come, a short one finds a thread free; big ones, count_tokens' included, tokenizing or waiting at once hold
at most twice --max-body of text, so that none waits long; one whose client left before a thread took it is
dropped untokenized), refuses a prompt over the context and cuts max_tokens, all before the engine sees
it; then answers as a stream or a whole response in the API's format. The same reply events feed every API.
"""

import asyncio
import collections
import contextlib
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from importlib import resources

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import DFlashError
from ..models.no_drafter import NoDrafter
from . import anthropic, openai_responses
from .jobs import Job, replies
from .engine import Engine
from .limits import Limits, Uploads, limited_protocol, open_files_for, read_json
from .logs import RequestLog, configure
from .metrics import CONTENT_TYPE, Metrics
from .protocol import APIError, Defaults, completion_body, openai_stream, parse_chat, parse_completion
from .security import Access, Guard, error_response, with_cors
from .thinking import reasoning_splitter
from .tools import ReplyParser, forced_prefix

log = logging.getLogger("mlx_dflash.server")
TOKENIZER_THREADS = 4  # short prompts tokenized at once
BIG_PROMPT_THREADS = 2  # big prompts tokenized at once, on threads of their own
BIG_PROMPT_CHARACTERS = 1 << 16  # a prompt over this is big: tokenizing it takes tens of milliseconds or more
BIG_PROMPTS_BODIES = 2  # big prompts tokenizing or waiting for a thread hold at most this many --max-body together


@dataclass
class ServerConfig:
    """The server's settings (serve's flags): what it takes at most (limits.py `Limits`) and who may call it
    (security.py `Access`)."""

    model_name: str  # the id clients send as "model"
    defaults: Defaults = field(default_factory=Defaults)
    limits: Limits = Limits()
    access: Access = Access()
    ping_seconds: float = 10.0  # a quiet stream (queued, prefilling) gets a keep-alive this often
    generic_tools: bool = True  # tools for a template that renders none go in the generic form (else a 400)
    drafter_name: str = ""  # what / and the live page call the drafter (its directory's name)


def prompt_characters(req, body_bytes: int) -> int:
    """About how many characters tokenizing the request's prompt reads: its body's bytes (tools included), or
    its messages' text where that is more (a kept conversation, previous_response_id's, is not in the body)."""
    if req.kind != "chat":
        return body_bytes
    return max(body_bytes, sum(len(m["content"]) for m in req.prompt if isinstance(m.get("content"), str)))


async def _disconnected(receive):
    """Returns once the client has gone (its request's body read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _prompt_ids(engine: Engine, waiting: list) -> list:
    """The prompt ids of the request in `waiting`, or None where its client left before a thread took it."""
    return engine.prompts.prompt_ids(waiting[0]) if waiting else None


async def _cancel_on_disconnect(receive, job: Job):
    """For a non-streamed reply: the client leaving (the request's body is read) cancels the job at once."""
    while (await receive())["type"] != "http.disconnect":
        pass
    await job.cancel()


class Service:
    """What the routes share: the engine and the settings, the model card and the live page, the tokenizer threads
    and the budget of big prompts, the bodies being uploaded, the kept Responses of each API key, the metrics."""

    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine, self.config, self.tools = engine, config, engine.tools
        started, name = int(time.time()), config.model_name
        self.model_card = {"id": name, "object": "model", "created": started, "owned_by": "mlx-dflash",
                           "type": "model", "display_name": name,  # the fields Anthropic's clients read
                           "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}
        self.system_turns = anthropic.system_turns(engine.tokenizer)  # else system messages join the system prompt
        self.caching = engine.prompt_cache is not None
        self.metrics = Metrics(engine)
        self.live_page = resources.files(__package__).joinpath("live.html").read_text()  # GET / from a browser
        if not self.tools.renders_tools and config.generic_tools:
            log.info("this model's chat template does not render tools: requests with tools get them in the system "
                     "prompt in the generic <tool_call> JSON form (--no-generic-tools refuses them)")
        self.uploads = Uploads(config.limits.uploads_per_client, total=max(1, config.limits.max_connections // 2))
        self.tokenizer_threads = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="mlx-dflash-tokenizer")
        self.big_prompts = collections.Counter()  # big prompts tokenizing or waiting for a thread, their characters
        self.big_prompt_threads = ThreadPoolExecutor(BIG_PROMPT_THREADS, thread_name_prefix="mlx-dflash-tokenizer-big")
        # For previous_response_id and GET /v1/responses/{id}: one store per API key's scope (security.py), so
        # that with several keys a client reads only the responses made with its own key.
        shared = openai_responses.KeptBytes(4 * config.limits.max_kept_bytes)
        kept_bytes = config.limits.max_kept_bytes
        self.kept = collections.defaultdict(lambda: openai_responses.ResponseStore(max_bytes=kept_bytes, shared=shared))

    def close(self):
        self.tokenizer_threads.shutdown(wait=False)
        self.big_prompt_threads.shutdown(wait=False)

    def forced(self, req) -> str:
        """The text a forced tool call makes the reply start with ("": none is forced)."""
        return "" if req.force_tool is None else forced_prefix(self.tools, req.force_tool)

    def kept_for(self, request) -> openai_responses.ResponseStore:
        return self.kept[request.scope.get("dflash.cache_scope", "")]

    async def tokenized(self, request, parse, admit: bool) -> tuple:
        """(request, prompt ids, the threads that tokenized it): the body read and parsed, then (admitted to the
        queue) tokenized off the loop."""
        engine, config = self.engine, self.config
        body, size = await read_json(request, config.limits.max_body_bytes, config.limits.body_timeout, self.uploads)
        req = parse(body, config.defaults, config.model_name)
        request.scope.setdefault("dflash.log", {})["id"] = req.id
        if req.tools and not self.tools.renders_tools and not config.generic_tools:
            raise APIError(400, "'tools' cannot be honoured: this model's chat template does not render tools "
                           "(the server runs with --no-generic-tools)", param="tools")
        self.forced(req)  # a call that cannot be forced is refused before the queue
        if admit:
            engine.prompts.refuse_surely_too_long(req)
        characters = prompt_characters(req, size)
        big, held = characters > BIG_PROMPT_CHARACTERS, self.big_prompts
        budget = BIG_PROMPTS_BODIES * config.limits.max_body_bytes
        if big and held["prompts"] and held["characters"] + characters > budget:
            raise APIError(503, f"the server is tokenizing {held['prompts']} big prompts already "
                           f"({held['characters']} characters; at most {budget} together, twice --max-body); "
                           "retry in a moment", code="tokenizer_busy", headers={"Retry-After": "1"})
        if admit:
            engine.admit()  # before the work of tokenizing: a full queue costs nothing
        taken = collections.Counter(prompts=1, characters=characters) if big else collections.Counter()
        held.update(taken)
        threads = self.big_prompt_threads if big else self.tokenizer_threads
        try:
            ids = await self.tokenize(request, req, threads)
            if admit:
                engine.prompts.fit(req, len(ids), config.limits.max_tokens_limit)
        except BaseException:
            if admit:
                engine.leave()
            raise
        finally:
            held.subtract(taken)
        return req, ids, threads

    async def tokenize(self, request, req, threads) -> list:
        """The prompt's ids, from a tokenizer thread. A client that leaves first is answered 499 at once (its
        places given back) and its prompt is never tokenized if no thread has taken it yet, nor kept."""
        waiting = [req]
        tokenizing = asyncio.get_running_loop().run_in_executor(threads, _prompt_ids, self.engine, waiting)
        tokenizing.add_done_callback(lambda f: f.cancelled() or f.exception())  # a left client's error is no one's
        watch = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait({tokenizing, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if tokenizing.done():
            return tokenizing.result()
        waiting.clear()
        raise APIError(499, "the client disconnected before its prompt was tokenized")

    async def generate(self, request, parse, stream, body):
        """A generation route: the request read and tokenized, queued as a job, answered as a stream of the API's
        events or as one body (parse, stream and body are the API's)."""
        engine = self.engine
        req, ids, threads = await self.tokenized(request, parse, admit=True)
        loop = asyncio.get_running_loop()
        boundaries = await loop.run_in_executor(threads, engine.prompts.message_boundaries, req, ids)
        calls = ReplyParser(self.tools, req.tools, req.parallel_tool_calls, self.forced(req)) if req.tools else None
        thinking = reasoning_splitter(engine.tokenizer, ids) if req.kind == "chat" else None
        job = Job(req, ids, calls, boundaries, thinking, request.scope.get("dflash.cache_scope", ""))
        engine.enqueue(job)
        info = request.scope["dflash.log"]
        if req.stream:
            chunks = stream(req, len(ids), replies(job, self.config.ping_seconds))
            return StreamingResponse(_stream(job, info, chunks), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watch = asyncio.create_task(_cancel_on_disconnect(request.receive, job))
        pieces = {"text": [], "call": [], "reasoning": []}
        try:
            async for kind, payload in replies(job, None):
                if kind == "error":
                    raise payload
                if kind in pieces:  # ("done", outcome) ends it: the job holds the outcome
                    pieces[kind].append(payload)
        finally:
            watch.cancel()
        info["outcome"] = job.outcome
        if job.outcome.finish_reason == "cancelled":
            return JSONResponse({}, status_code=499)  # nobody reads it; the log shows the cancel
        return JSONResponse(body(req, "".join(pieces["text"]), job.outcome, pieces["call"],
                                 reasoning="".join(pieces["reasoning"])))


async def _stream(job: Job, info: dict, chunks):
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        if not job.finished.is_set():  # the client went away mid-stream
            await job.cancel()
            info["status"] = 499  # the log's status: the 200 it was sent was not the end
        info["outcome"] = job.outcome
        if job.error is not None:
            info["error"] = job.error.message


def service(request) -> Service:
    return request.app.state.service


# ---------------------------------------------------------------------------------------------------------------
# The server itself: its page and description, health, metrics and models.

async def root(request):  # Claude Code's first request is HEAD /; a browser's gets the live page
    svc = service(request)
    if "text/html" in request.headers.get("accept", ""):
        return HTMLResponse(svc.live_page)
    drafter = ("none: drafts from the context (prompt lookup)" if isinstance(svc.engine.drafter, NoDrafter)
               else svc.config.drafter_name or "a DFlash drafter")
    return JSONResponse({"model": svc.config.model_name, "drafter": drafter, "mode": list(svc.engine.policy.notes),
                         "max_batch": svc.engine.max_batch,
                         "endpoints": ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                                       "/v1/messages/count_tokens", "/v1/models", "/health", "/metrics"]})


async def health(request):
    svc = service(request)
    engine = svc.engine
    body = {"status": "ok", "model": svc.config.model_name, "waiting": engine.waiting}
    if not request.scope.get("dflash.authorized", True):  # the counters tell what others' requests did
        return JSONResponse(body)
    if engine.prompt_cache is not None:  # the caller's API key's own entries and lookups
        body["prompt_cache"] = engine.prompt_cache.stats(request.scope.get("dflash.cache_scope", ""))
    body["batch"] = engine.batch_report()
    return JSONResponse(body)


async def metrics_text(request):  # Prometheus' scrape
    text = service(request).metrics.render(request.scope.get("dflash.cache_scope", ""))
    return Response(text, media_type=CONTENT_TYPE)


async def models(request):
    card = service(request).model_card
    return JSONResponse({"object": "list", "data": [card], "has_more": False, "first_id": card["id"],
                         "last_id": card["id"]})


async def model(request):
    card = service(request).model_card
    if request.path_params["model_id"] != card["id"]:
        raise APIError(404, f"model '{request.path_params['model_id']}' is not served here", code="model_not_found")
    return JSONResponse(card)


# ---------------------------------------------------------------------------------------------------------------
# OpenAI: chat completions, completions, Responses (and the kept ones).

async def chat(request):
    return await service(request).generate(request, parse_chat, openai_stream, completion_body)


async def completions(request):
    return await service(request).generate(request, parse_completion, openai_stream, completion_body)


async def responses(request):
    svc = service(request)
    store = svc.kept_for(request)
    return await svc.generate(request, partial(openai_responses.parse_responses, store=store),
                              partial(openai_responses.response_stream, store=store),
                              partial(openai_responses.response_body, store=store))


async def kept_response(request):
    kept_json = service(request).kept_for(request).response(request.path_params["response_id"])
    return Response(kept_json, media_type="application/json")  # kept as the JSON bytes: nothing to encode


# ---------------------------------------------------------------------------------------------------------------
# Anthropic: messages and count_tokens.

async def messages(request):
    svc = service(request)
    return await svc.generate(request, partial(anthropic.parse_messages, system_turns=svc.system_turns),
                              partial(anthropic.message_stream, caching=svc.caching),
                              partial(anthropic.message_body, caching=svc.caching))


async def count_tokens(request):
    svc = service(request)
    parse = partial(anthropic.parse_messages, count_only=True, system_turns=svc.system_turns)
    _, ids, _ = await svc.tokenized(request, parse, admit=False)
    return JSONResponse({"input_tokens": len(ids)})


# ---------------------------------------------------------------------------------------------------------------
# Errors, each in the shape of the API its path belongs to (security.py).

async def api_error(request, e: APIError):
    request.scope.setdefault("dflash.log", {})["error"] = e.message
    return error_response(e, request.url.path)


async def http_error(request, e: HTTPException):
    path = request.url.path[:200]  # a client's path is not echoed whole
    messages = {404: f"no such endpoint: {request.method} {path}",
                405: f"{request.method} is not allowed on {path}"}
    return await api_error(request, APIError(e.status_code, messages.get(e.status_code, str(e.detail))))


async def internal_error(request, e: Exception):
    log.exception("request failed")
    return await api_error(request, APIError(500, f"internal error ({type(e).__name__}); see the server log"))


def make_app(engine: Engine, config: ServerConfig):
    """The ASGI app: routes, errors in each API's shape, the checks of security.py and the request log."""
    svc = Service(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        svc.close()

    routes = [
        Route("/", root),
        Route("/health", health),
        Route("/metrics", metrics_text),
        Route("/v1/models", models),
        Route("/v1/models/{model_id:path}", model),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", kept_response),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: api_error, HTTPException: http_error, Exception: internal_error})
    app.state.service = svc
    guarded = Guard(app, config.access)
    return RequestLog(with_cors(guarded, config.access.allowed_origins), svc.metrics)


def uvicorn_server(engine: Engine, config: ServerConfig):
    """The uvicorn server for the app, with the connection limits, and a shutdown that answers the waiting
    requests 503 at once and gives the running one `config.limits.shutdown_grace` seconds before it ends with an
    error."""
    import uvicorn

    grace = config.limits.shutdown_grace

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            engine.stop("the server is shutting down")
            asyncio.get_running_loop().call_later(grace, engine.abort_running,
                                                  f"the server is shutting down (--shutdown-grace {grace:g} s)")
            await super().shutdown(sockets)

    protocol = limited_protocol(config.limits.max_connections, config.limits.header_timeout)
    return Server(uvicorn.Config(make_app(engine, config), http=protocol, log_config=None, log_level="warning",
                                 access_log=False, timeout_graceful_shutdown=grace + 30))


def run_server(engine: Engine, config: ServerConfig, sock):
    """Serve on a bound socket until interrupted (Ctrl-C or SIGTERM: a clean stop, exit status 0)."""
    import signal

    configure()
    open_files_for(config.limits.max_connections)
    # The engine thread waits for the GIL after every evaluation while the event loop holds it; Python's
    # default 5 ms switch interval would let it wait that long, each time, under load.
    sys.setswitchinterval(0.001)
    server = uvicorn_server(engine, config)
    host, port = sock.getsockname()[:2]
    log.info(f"serving {config.model_name} at http://{host}:{port}/v1"
             + (" (API key required)" if config.access.api_keys else ""))
    engine.on_failure = lambda: setattr(server, "should_exit", True)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again for the handler it found:
    # this one ignores it, so that the engine still closes (a sharded one tells the other ranks to stop).
    stop_signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in stop_signals}
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop("the server has stopped")
        engine.abort_running("the server has stopped")
        engine.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if engine.failure is not None:
        raise engine.failure


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
