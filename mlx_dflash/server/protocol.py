"""The OpenAI wire format for `mlx-dflash serve`: request bodies in, response bodies and errors out.

Pure functions over JSON-shaped Python values: no model, no web framework. `parse_chat` and
`parse_completion` check a body field by field and raise `APIError` (an OpenAI-shaped error with its
HTTP status) on the first problem, naming the field and what it must be.
"""

import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from ..errors import DFlashError
from ..sampling import SamplingParams

MAX_STOP_STRINGS = 16  # OpenAI allows 4; more only costs a scan per token


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with a status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                503: "server_overloaded", 500: "server_error"}.get(self.status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Defaults:
    """What a request gets for the fields it leaves out (the server's command-line flags)."""

    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class GenerationRequest:
    """One parsed request: what to generate and how to answer."""

    kind: str  # "chat" or "text"
    model: str
    prompt: object  # chat: the message list; text: the prompt string or token ids
    max_tokens: int
    sampling: SamplingParams
    seed: Optional[int] = None
    stop: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    id: str = ""
    created: int = 0

    def __post_init__(self):
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.created = self.created or int(time.time())


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _field(body: dict, name: str, check, what: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise APIError(400, f"'{name}' must be {what}, got {value!r}"[:300], param=name)
    return value


def _common(body, defaults: Defaults, served_model: str) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = _field(body, "model", lambda v: isinstance(v, str), "a string", served_model)
    if model != served_model:
        raise APIError(404, f"model '{model}' is not served here; this server serves '{served_model}' "
                       "(GET /v1/models)", param="model", code="model_not_found")
    max_tokens = _field(body, "max_completion_tokens", _is_int, "an integer", None)
    max_tokens = _field(body, "max_tokens", _is_int, "an integer", max_tokens)
    if max_tokens is None:
        max_tokens = defaults.max_tokens
    if max_tokens < 1:
        raise APIError(400, f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens")
    temperature = _field(body, "temperature", _is_number, "a number", defaults.sampling.temperature)
    top_p = _field(body, "top_p", _is_number, "a number", defaults.sampling.top_p)
    top_k = _field(body, "top_k", _is_int, "an integer (0 disables it)", defaults.sampling.top_k)
    min_p = _field(body, "min_p", _is_number, "a number (0 disables it)", defaults.sampling.min_p)
    try:
        sampling = SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=top_k,
                                  min_p=float(min_p))
    except DFlashError as e:
        raise APIError(400, str(e), param=str(e).split()[0]) from None
    n = _field(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise APIError(400, f"'n' must be 1: this server generates one choice per request, got {n}", param="n")
    if body.get("logprobs") not in (None, False, 0):
        raise APIError(400, "'logprobs' is not supported by this server", param="logprobs")
    seed = _field(body, "seed", lambda v: _is_int(v) and 0 <= v < 2**64, "an integer from 0 to 2**64 - 1")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise APIError(400, "'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"'stop' holds {len(stop)} strings; at most {MAX_STOP_STRINGS}", param="stop")
    stream = _field(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    options = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = _field(options, "include_usage", lambda v: isinstance(v, bool), "true or false", False)
    return dict(model=model, max_tokens=max_tokens, sampling=sampling, seed=seed, stop=stop, stream=stream,
                include_usage=include_usage)


def _message_text(content, i: int) -> str:
    """A message's content as text: a string, or a list of text parts (other part types are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise APIError(400, f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                               "are supported", param=f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content")


def parse_chat(body, defaults: Defaults, served_model: str) -> GenerationRequest:
    common = _common(body, defaults, served_model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects",
                       param="messages")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
        content = m.get("content")
        if content is None and m["role"] != "assistant":
            raise APIError(400, f"messages[{i}] has no 'content'", param=f"messages[{i}].content")
        chat.append({"role": m["role"], "content": _message_text(content or "", i)})
    return GenerationRequest(kind="chat", prompt=chat, **common)


def parse_completion(body, defaults: Defaults, served_model: str) -> GenerationRequest:
    common = _common(body, defaults, served_model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    token_ids = isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not token_ids:
        raise APIError(400, "'prompt' must be a non-empty string, a list of one string, or a list of token ids "
                       "(one prompt per request)", param="prompt")
    return GenerationRequest(kind="text", prompt=prompt, **common)


class StopMatcher:
    """Cuts streamed text exactly before the first occurrence of any stop string.

    feed() returns the text that is safe to emit: it holds back the longest tail that could still be
    the start of a stop string, so a stop split across tokens is never half-sent.
    """

    def __init__(self, stops: list):
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(self.pending) + 1))
                    if self.pending.endswith(s[:k])), default=0)
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


@dataclass
class Outcome:
    """How a generation ended: the OpenAI counts plus the decoder's speculative statistics."""

    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    stats: object = None  # decoder.GenerationStats
    queue_seconds: float = 0.0
    seconds: float = 0.0

    def usage(self) -> dict:
        cached = self.stats.cached_tokens if self.stats is not None else 0
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def speculative(self) -> dict:
        s = self.stats
        return {
            "rounds": s.rounds,
            "tau": round(s.tau, 4),
            "accepted_lengths": {str(n): s.accepted_lengths[n] for n in sorted(s.accepted_lengths)},
            "widths": {str(w): s.widths[w] for w in sorted(s.widths)},
            "block_size": s.block_size,
            "max_width": s.max_width,
            "prefill_tokens_per_s": round(s.prefill_tps, 2),
            "cached_tokens": s.cached_tokens,
            "prefill_seconds_saved": round(s.prefill_seconds_saved, 3),
            "decode_tokens_per_s": round(s.decode_tps, 2),
            "queue_seconds": round(self.queue_seconds, 4),
            "seconds": round(self.seconds, 4),
            # What served it (engine_report.py): the drafter or plain steps, the verify's paths, every fallback.
            "drafted_rounds": s.drafted_rounds,
            "plain_steps": s.plain_steps,
            "looked_up_rounds": s.looked_up_rounds,
            "verify": dict(s.verify_paths),
            "routes": [dict(r) for r in s.routes],
            "notes": list(s.notes),
        }


def _choice(req: GenerationRequest, text: Optional[str], finish_reason: Optional[str], delta: bool,
            first: bool = False) -> dict:
    choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if req.kind == "text":
        choice["text"] = text or ""
    elif delta:
        choice["delta"] = {} if text is None else {"content": text}
        if first:
            choice["delta"]["role"] = "assistant"
    else:
        choice["message"] = {"role": "assistant", "content": text}
    return choice


def _envelope(req: GenerationRequest, chunk: bool) -> dict:
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    return {"id": req.id, "object": obj + (".chunk" if chunk and req.kind == "chat" else ""),
            "created": req.created, "model": req.model}


def completion_body(req: GenerationRequest, text: str, outcome: Outcome) -> dict:
    """The whole (non-streaming) response."""
    return {**_envelope(req, False), "choices": [_choice(req, text, outcome.finish_reason, False)],
            "usage": outcome.usage(), "dflash": outcome.speculative()}


def chunk_body(req: GenerationRequest, text: Optional[str], finish_reason: Optional[str] = None,
               first: bool = False) -> dict:
    """One streamed chunk; text None with a finish_reason is the closing chunk; the first names the role."""
    body = {**_envelope(req, True), "choices": [_choice(req, text, finish_reason, True, first)]}
    if req.include_usage:
        body["usage"] = None  # OpenAI: null on every chunk but the last
    return body


def usage_chunk_body(req: GenerationRequest, outcome: Outcome) -> dict:
    """The last chunk of a stream with include_usage: no choices, the usage and our statistics."""
    return {**_envelope(req, True), "choices": [], "usage": outcome.usage(), "dflash": outcome.speculative()}
