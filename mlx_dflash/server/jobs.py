"""A served request on its way through the engine (`Job`) and the reply events every API renders from it."""

import asyncio
import threading
import time
from typing import Optional

from ..decoding.batch_decoder import Request
from .protocol import APIError, GenerationRequest, Outcome
from .tools import ReplyParser


class Job(Request):
    """A served request once it is tokenized: what the scheduler decodes (a decoding/batch_decoder.py `Request`,
    whose handle is the job itself: the engine knows it by this one name) and the way back to its client, which
    the engine thread talks to through emit(). req: the API request it answers (protocol.py); ids: its prompt's
    token ids, max_tokens fit to the context already (prompts.py `Prompts.fit`); boundaries: prompt positions
    where chat messages end (for the prefix cache); cache_scope: the prefix cache's part for its API key
    (security.py)."""

    def __init__(self, req: GenerationRequest, ids: list, parser: Optional[ReplyParser] = None, boundaries=(),
                 thinking=None, cache_scope: str = ""):
        super().__init__(self, ids, req.max_tokens, req.sampling, req.seed, tuple(boundaries), cache_scope)
        self.req, self.parser = req, parser
        self.thinking = thinking  # a thinking.ReasoningSplitter, for a thinking model's chat reply
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
            self._put("done", Outcome("cancelled", len(self.ids), 0))
        elif not self.finished.is_set():
            import anyio

            with anyio.CancelScope(shield=True):  # we may be running inside a cancelled task
                await self.finished.wait()


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
