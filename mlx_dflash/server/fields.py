"""Request-parsing helpers shared by the API modules (protocol.py, openai_responses.py, anthropic.py, tools.py).

The error they raise, what a request gets for the fields it leaves out, a field checked against what it
must be, the model, sampling, stop and max-tokens fields, the known fields refused unless they ask for
nothing, a message's text content, a tool call's arguments, and a reasoning effort as enable_thinking.
Each API module extracts its own fields (their names and shapes differ) and passes them here.
"""

import json
from dataclasses import dataclass, field
from typing import Optional

from ..decoding.sampling import SamplingParams
from ..errors import DFlashError

MAX_STOP_STRINGS = 16  # OpenAI allows 4; more only costs a scan per token
MAX_TOOLS = 128  # OpenAI's limit
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               408: "timeout_error", 413: "invalid_request_error", 500: "server_error", 503: "server_overloaded"}
TEXT_PARTS = {"text": "text"}  # a part's type: the field that holds its text


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with a status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Defaults:
    """What a request gets for the fields it leaves out (the server's command-line flags)."""

    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def checked(body: dict, name: str, check, what: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise APIError(400, f"'{name}' must be {what}, got {json.dumps(value)[:200]}", param=name)
    return value


def sampling_fields(body: dict, defaults: Defaults, max_temperature: float = MAX_TEMPERATURE) -> SamplingParams:
    """temperature, top_p, top_k and min_p (numbers are finite: the body's JSON refuses NaN and Infinity)."""
    temperature = checked(body, "temperature", lambda v: is_number(v) and 0 <= v <= max_temperature,
                         f"a number from 0 to {max_temperature:g}", defaults.sampling.temperature)
    top_p = checked(body, "top_p", is_number, "a number", defaults.sampling.top_p)
    top_k = checked(body, "top_k", is_int, "an integer (0 disables it)", defaults.sampling.top_k)
    min_p = checked(body, "min_p", is_number, "a number (0 disables it)", defaults.sampling.min_p)
    try:
        return SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=top_k, min_p=float(min_p))
    except DFlashError as e:
        raise APIError(400, str(e), param=str(e).split()[0]) from None


def stop_strings(stop, name: str = "stop") -> list:
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise APIError(400, f"'{name}' must be a non-empty string or a list of non-empty strings", param=name)
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"'{name}' holds {len(stop)} strings; at most {MAX_STOP_STRINGS}", param=name)
    return stop


def max_tokens_field(body: dict, defaults: Defaults, names=("max_completion_tokens", "max_tokens")) -> int:
    max_tokens = None
    for name in names:
        max_tokens = checked(body, name, is_int, "an integer", max_tokens)
    max_tokens = defaults.max_tokens if max_tokens is None else max_tokens
    if max_tokens < 1:
        raise APIError(400, f"'{names[-1]}' must be at least 1, got {max_tokens}", param=names[-1])
    return max_tokens


def check_model(body: dict, served_model: str) -> str:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = checked(body, "model", lambda v: isinstance(v, str), "a string", served_model)
    if model != served_model:
        raise APIError(404, f"model '{model}' is not served here; this server serves '{served_model}' "
                       "(GET /v1/models)", param="model", code="model_not_found")
    return model


def refuse_unhonoured(body: dict, neutral: dict, hints: dict):
    """A 400 for the first known field this server cannot honour whose value is not one of `neutral[name]`
    (the values that ask for nothing); `hints[name]` says what to do instead (else: leave it out)."""
    for name, values in neutral.items():
        if body.get(name) is not None and body[name] not in values:
            raise APIError(400, f"'{name}' is not supported by this server ({hints.get(name, 'leave it out')}), "
                           f"got {json.dumps(body[name])[:100]}", param=name)


def text_content(content, where: str, parts: dict = TEXT_PARTS, sep: str = "") -> str:
    """A message's content as text: a string, or a list of parts whose type is a key of `parts` (its value
    the field holding the text), joined by `sep`. Any other part is refused, naming it."""
    if isinstance(content, str):
        return content
    first = next(iter(parts))
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of {first} parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in parts and isinstance(part.get(parts[kind]), str):
            texts.append(part[parts[kind]])
            continue
        shape = f'{{"type": "{first}", "text": ...}}'
        if isinstance(kind, str):
            raise APIError(400, f"{where}[{j}]: only text parts ({shape}) are supported, not '{kind}': this model "
                           "reads text only", param=f"{where}[{j}]")
        raise APIError(400, f"{where}[{j}] must be a text part ({shape})", param=f"{where}[{j}]")
    return sep.join(texts)


def tool_arguments(arguments, where: str) -> dict:
    """A tool call's arguments sent back in a conversation as chat templates take them: an object (sent as
    one, or as its JSON string; nothing or "" is no arguments)."""
    arguments = arguments or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where} must be a JSON object (as a string)", param=where)
    return arguments


def effort_thinking(effort, param: str) -> Optional[bool]:
    """A reasoning effort as enable_thinking: "none" or "minimal" off (as the Responses API reads them),
    another effort the template's default (None); a value not in REASONING_EFFORTS is a 400."""
    if effort is not None and effort not in REASONING_EFFORTS:
        raise APIError(400, f"'{param}' must be " + " or ".join(f'"{e}"' for e in REASONING_EFFORTS)
                       + f", got {json.dumps(effort)[:100]}", param=param)
    return False if effort in ("none", "minimal") else None
