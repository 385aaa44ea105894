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
from functools import partial
from importlib import resources

from ..models.no_drafter import NoDrafter
from . import anthropic, openai_responses
from .app import Job, ServerConfig, replies
from .engine import Engine
from .limits import Uploads, limited_protocol, open_files_for, read_json
from .logs import RequestLog, configure
from .metrics import CONTENT_TYPE, Metrics
from .protocol import APIError, completion_body, openai_stream, parse_chat, parse_completion
from .security import Guard, error_response, with_cors
from .thinking import reasoning_splitter
from .tools import ReplyParser, forced_prefix

log = logging.getLogger("mlx_dflash.server")
TOKENIZER_THREADS = 4  # short prompts tokenized at once
BIG_PROMPT_THREADS = 2  # big prompts tokenized at once, on threads of their own
BIG_PROMPT_CHARACTERS = 1 << 16  # a prompt over this is big: tokenizing it takes tens of milliseconds or more
BIG_PROMPTS_BODIES = 2  # big prompts tokenizing or waiting for a thread hold at most this many --max-body together


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
    return engine.prompt_ids(waiting[0]) if waiting else None


async def _cancel_on_disconnect(receive, job: Job):
    """For a non-streamed reply: the client leaving (the request's body is read) cancels the job at once."""
    while (await receive())["type"] != "http.disconnect":
        pass
    await job.cancel()


def make_app(engine: Engine, config: ServerConfig):
    """The ASGI app: routes, errors in each API's shape, the checks of security.py and the request log."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    started = int(time.time())
    name = config.model_name
    model_card = {"id": name, "object": "model", "created": started, "owned_by": "mlx-dflash",
                  "type": "model", "display_name": name,  # the fields Anthropic's clients read
                  "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}
    tools = engine.tools
    system_turns = anthropic.system_turns(engine.tokenizer)  # else system messages join the system prompt
    caching = engine.prompt_cache is not None
    metrics = Metrics(engine)
    live_page = resources.files(__package__).joinpath("live.html").read_text()  # GET / from a browser
    if not tools.renders_tools and config.generic_tools:
        log.info("this model's chat template does not render tools: requests with tools get them in the system "
                 "prompt in the generic <tool_call> JSON form (--no-generic-tools refuses them)")
    uploads = Uploads(config.max_uploads_per_client or max(1, config.max_connections // 4),
                      total=max(1, config.max_connections // 2))
    tokenizer_threads = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="mlx-dflash-tokenizer")
    big_prompts = collections.Counter()  # big prompts tokenizing or waiting for a thread, and their characters
    big_prompt_threads = ThreadPoolExecutor(BIG_PROMPT_THREADS, thread_name_prefix="mlx-dflash-tokenizer-big")
    # For previous_response_id and GET /v1/responses/{id}: one store per API key's scope (security.py), so
    # that with several keys a client reads only the responses made with its own key.
    shared = openai_responses.KeptBytes(4 * config.max_kept_bytes)
    kept = collections.defaultdict(lambda: openai_responses.ResponseStore(max_bytes=config.max_kept_bytes,
                                                                          shared=shared))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        tokenizer_threads.shutdown(wait=False)
        big_prompt_threads.shutdown(wait=False)

    async def health(request):
        body = {"status": "ok", "model": name, "waiting": engine.waiting}
        if not request.scope.get("dflash.authorized", True):  # the counters tell what others' requests did
            return JSONResponse(body)
        if engine.prompt_cache is not None:  # the caller's API key's own entries and lookups
            body["prompt_cache"] = engine.prompt_cache.stats(request.scope.get("dflash.cache_scope", ""))
        body["batch"] = engine.batch_report()
        return JSONResponse(body)

    async def root(request):  # Claude Code's first request is HEAD /; a browser's gets the live page
        if "text/html" in request.headers.get("accept", ""):
            return HTMLResponse(live_page)
        drafter = ("none: drafts from the context (prompt lookup)" if isinstance(engine.drafter, NoDrafter)
                   else config.drafter_name or "a DFlash drafter")
        return JSONResponse({"model": name, "drafter": drafter, "mode": list(engine.policy.notes),
                             "max_batch": engine.max_batch,
                             "endpoints": ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                                           "/v1/messages/count_tokens", "/v1/models", "/health", "/metrics"]})

    async def metrics_text(request):  # Prometheus' scrape
        return Response(metrics.render(request.scope.get("dflash.cache_scope", "")), media_type=CONTENT_TYPE)

    def forced(req) -> str:
        """The text a forced tool call makes the reply start with ("": none is forced)."""
        return "" if req.force_tool is None else forced_prefix(tools, req.force_tool)

    async def models(request):
        return JSONResponse({"object": "list", "data": [model_card], "has_more": False, "first_id": name,
                             "last_id": name})

    async def model(request):
        if request.path_params["model_id"] != name:
            raise APIError(404, f"model '{request.path_params['model_id']}' is not served here", code="model_not_found")
        return JSONResponse(model_card)

    async def tokenized(request, parse, admit: bool) -> tuple:
        """(request, prompt ids, the threads that tokenized it): the body read and parsed, then (admitted to the
        queue) tokenized off the loop."""
        body, size = await read_json(request, config.max_body_bytes, config.body_timeout, uploads)
        req = parse(body, config.defaults, name)
        request.scope.setdefault("dflash.log", {})["id"] = req.id
        if req.tools and not tools.renders_tools and not config.generic_tools:
            raise APIError(400, "'tools' cannot be honoured: this model's chat template does not render tools "
                           "(the server runs with --no-generic-tools)", param="tools")
        forced(req)  # a call that cannot be forced is refused before the queue
        if admit:
            engine.refuse_surely_too_long(req)
        characters = prompt_characters(req, size)
        big = characters > BIG_PROMPT_CHARACTERS
        budget = BIG_PROMPTS_BODIES * config.max_body_bytes
        if big and big_prompts["prompts"] and big_prompts["characters"] + characters > budget:
            raise APIError(503, f"the server is tokenizing {big_prompts['prompts']} big prompts already "
                           f"({big_prompts['characters']} characters; at most {budget} together, twice --max-body); "
                           "retry in a moment", code="tokenizer_busy", headers={"Retry-After": "1"})
        if admit:
            engine.admit()  # before the work of tokenizing: a full queue costs nothing
        taken = collections.Counter(prompts=1, characters=characters) if big else collections.Counter()
        big_prompts.update(taken)
        threads = big_prompt_threads if big else tokenizer_threads
        try:
            ids = await tokenize(request, req, threads)
            if admit:
                engine.fit(req, len(ids), config.max_tokens_limit)
        except BaseException:
            if admit:
                engine.leave()
            raise
        finally:
            big_prompts.subtract(taken)
        return req, ids, threads

    async def tokenize(request, req, threads) -> list:
        """The prompt's ids, from a tokenizer thread. A client that leaves first is answered 499 at once (its
        places given back) and its prompt is never tokenized if no thread has taken it yet, nor kept."""
        waiting = [req]
        job = asyncio.get_running_loop().run_in_executor(threads, _prompt_ids, engine, waiting)
        job.add_done_callback(lambda f: f.cancelled() or f.exception())  # a left client's error is no one's
        watch = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if job.done():
            return job.result()
        waiting.clear()
        raise APIError(499, "the client disconnected before its prompt was tokenized")

    async def generate(request, parse, stream, body):
        req, ids, threads = await tokenized(request, parse, admit=True)
        boundaries = await asyncio.get_running_loop().run_in_executor(threads, engine.message_boundaries, req, ids)
        job = Job(req, ids, ReplyParser(tools, req.tools, req.parallel_tool_calls, forced(req)) if req.tools else None,
                  boundaries, reasoning_splitter(engine.tokenizer, ids) if req.kind == "chat" else None,
                  request.scope.get("dflash.cache_scope", ""))
        engine.enqueue(job)
        info = request.scope["dflash.log"]
        if req.stream:
            chunks = stream(req, len(ids), replies(job, config.ping_seconds))
            return StreamingResponse(_stream(job, info, chunks), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watch = asyncio.create_task(_cancel_on_disconnect(request.receive, job))
        text, calls, reasoning = [], [], []
        try:
            async for kind, payload in replies(job, None):
                if kind == "text":
                    text.append(payload)
                elif kind == "reasoning":
                    reasoning.append(payload)
                elif kind == "call":
                    calls.append(payload)
                elif kind == "error":
                    raise payload
        finally:
            watch.cancel()
        info["outcome"] = job.outcome
        if job.outcome.finish_reason == "cancelled":
            return JSONResponse({}, status_code=499)  # nobody reads it; the log shows the cancel
        return JSONResponse(body(req, "".join(text), job.outcome, calls, reasoning="".join(reasoning)))

    async def _stream(job, info, chunks):
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

    async def chat(request):
        return await generate(request, parse_chat, openai_stream, completion_body)

    async def completions(request):
        return await generate(request, parse_completion, openai_stream, completion_body)

    async def messages(request):
        return await generate(request, partial(anthropic.parse_messages, system_turns=system_turns),
                              partial(anthropic.message_stream, caching=caching),
                              partial(anthropic.message_body, caching=caching))

    def kept_for(request) -> openai_responses.ResponseStore:
        return kept[request.scope.get("dflash.cache_scope", "")]

    async def responses(request):
        store = kept_for(request)
        return await generate(request, partial(openai_responses.parse_responses, store=store),
                              partial(openai_responses.response_stream, store=store),
                              partial(openai_responses.response_body, store=store))

    async def kept_response(request):
        kept_json = kept_for(request).response(request.path_params["response_id"])
        return Response(kept_json, media_type="application/json")  # kept as the JSON bytes: nothing to encode

    async def count_tokens(request):
        parse = partial(anthropic.parse_messages, count_only=True, system_turns=system_turns)
        _, ids, _ = await tokenized(request, parse, admit=False)
        return JSONResponse({"input_tokens": len(ids)})

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

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: api_error, HTTPException: http_error, Exception: internal_error})
    guarded = Guard(app, config.allowed_hosts, config.allowed_origins, config.api_keys)
    return RequestLog(with_cors(guarded, config.allowed_origins), metrics)


def uvicorn_server(engine: Engine, config: ServerConfig):
    """The uvicorn server for the app, with the connection limits, and a shutdown that answers the waiting
    requests 503 at once and gives the running one `config.shutdown_grace` seconds before it ends with an error."""
    import uvicorn

    grace = config.shutdown_grace

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            engine.stop("the server is shutting down")
            asyncio.get_running_loop().call_later(grace, engine.abort_running,
                                                  f"the server is shutting down (--shutdown-grace {grace:g} s)")
            await super().shutdown(sockets)

    protocol = limited_protocol(config.max_connections, config.header_timeout)
    return Server(uvicorn.Config(make_app(engine, config), http=protocol, log_config=None, log_level="warning",
                                 access_log=False, timeout_graceful_shutdown=grace + 30))


def run_server(engine: Engine, config: ServerConfig, sock):
    """Serve on a bound socket until interrupted (Ctrl-C or SIGTERM: a clean stop, exit status 0)."""
    import signal

    configure()
    open_files_for(config.max_connections)
    # The engine thread waits for the GIL after every evaluation while the event loop holds it; Python's
    # default 5 ms switch interval would let it wait that long, each time, under load.
    sys.setswitchinterval(0.001)
    server = uvicorn_server(engine, config)
    host, port = sock.getsockname()[:2]
    log.info(f"serving {config.model_name} at http://{host}:{port}/v1"
             + (" (API key required)" if config.api_keys else ""))
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
