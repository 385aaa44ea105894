"""`mlx-dflash serve`: an OpenAI- and Anthropic-compatible HTTP server over one target + drafter pair.

A Starlette app on uvicorn. One engine thread owns the models and decodes up to --max-batch requests together
(engine.py); a bounded queue feeds it and answers 503 when full. Each request is a `Job`: the engine pushes
its text to the request's asyncio queue round by round, and checks the job's cancel flag at every step, so a
client that goes away (streamed or not) stops its generation within a round, or a chunk of its prompt.

The routes and the uvicorn server are routes.py; the wire formats protocol.py (OpenAI chat and
completions), openai_responses.py (Responses) and anthropic.py (Messages); tool calls in replies tools.py;
what the network may send limits.py; who may send it security.py; the log logs.py. A sharded target
(`--shard`, rank 0's engine and the other ranks' loop) is sharded.py. A thinking model's reasoning is cut
from its answer by thinking.py.
"""

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from ..decoding.prompt import encode_prompt
from ..errors import DFlashError
from .protocol import APIError, Defaults, GenerationRequest, Outcome, PromptTooLong
from .security import allowed_hosts
from .tools import ReplyParser, forced_prefix, generic_tools_messages

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
    max_kept_bytes: int = 64 << 20  # kept Responses per API key (4x that across keys), as JSON bytes
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
    drafter_name: str = ""  # what / and the live page call the drafter (its directory's name)


class PromptSurelyTooLong(PromptTooLong):
    """A prompt whose text alone is over the context, refused before it is tokenized (prompt_tokens: at least)."""

    def __init__(self, at_least: int, characters: int, context: int, param: str):
        super().__init__(at_least, context, param)
        self.message = (f"the prompt is at least {at_least} tokens ({characters} characters of text) and this "
                        f"model's context is {context} tokens: shorten the {param}")


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

    async def cancel(self):
        """The client left: stop the generation, and wait (at most a step: a round, or a chunk of a prompt's
        read) until the engine let go of it; one that has not started is settled here (the engine skips it)."""
        with self.lock:
            self.cancelled.set()
            running = self.started
        if not running:
            self._put("done", Outcome("cancelled", len(self.prompt_ids), 0))
        elif not self.finished.is_set():
            import anyio

            with anyio.CancelScope(shield=True):  # we may be running inside a cancelled task
                await self.finished.wait()


class Prompts:
    """What the engine does to a request before it queues: its prompt's token ids, and the checks of its
    length against the context. Runs on the tokenizer threads, beside the engine (server/engine.py), and
    reads the engine's tokenizer, target, tools and prefix cache."""

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
