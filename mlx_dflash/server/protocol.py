"""The OpenAI wire format for `mlx-dflash serve`: request bodies in, response bodies and errors out.

Pure functions over JSON-shaped Python values: no model, no web framework. `parse_chat` and
`parse_completion` check a body field by field and raise `APIError` (an OpenAI-shaped error with its
HTTP status; Anthropic-shaped on the Messages API, anthropic.py) on the first problem, naming the field
and what it must be. A field this server knows but cannot honour is refused unless it asks for nothing
(`presence_penalty: 0`, `response_format: {"type": "text"}`); fields it does not know are ignored.
The helpers the API modules share for their fields are in fields.py.
"""

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from ..decoding.sampling import SamplingParams
from .fields import (MAX_TOOLS, APIError, Defaults, check_model, checked, effort_thinking, is_int, max_tokens_field,
                     refuse_unhonoured, sampling_fields, stop_strings, text_content, tool_arguments)
from .tools import forced_tool

# Known fields that change the output in ways this server cannot: the values that ask for nothing.
NEUTRAL = {"frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
           "logprobs": (False, 0), "top_logprobs": (0,), "n": (1,), "best_of": (1,), "echo": (False,),
           "suffix": ("",), "audio": (), "prediction": (), "functions": (), "function_call": ("none",),
           "modalities": (["text"],)}
HINTS = {"functions": "send 'tools' instead", "function_call": "send 'tool_choice' instead",
         "n": "this server generates one choice per request", "response_format": "ask for JSON in the prompt"}


class PromptTooLong(APIError):
    """A prompt that leaves no room in the target's context: refused before any work."""

    def __init__(self, prompt_tokens: int, context: int, param: str = "messages"):
        super().__init__(400, f"the prompt is {prompt_tokens} tokens and this model's context is {context} tokens: "
                         f"shorten the {param}", param=param, code="context_length_exceeded")
        self.prompt_tokens, self.context = prompt_tokens, context


@dataclass
class GenerationRequest:
    """One parsed request: what to generate and how to answer."""

    kind: str  # "chat" or "text"
    model: str
    prompt: object  # chat: the message list (the chat template's form); text: the prompt string or token ids
    max_tokens: int
    sampling: SamplingParams
    seed: Optional[int] = None
    stop: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    tools: Optional[list] = None  # OpenAI function tools, for the chat template; None: no tools
    parallel_tool_calls: bool = True
    force_tool: Optional[str] = None  # None: the model may answer in text; "": it must call a tool; a name: that tool
    thinking: Optional[bool] = None  # None: the chat template's default; False/True: enable_thinking for templates that take it
    continue_final: bool = False  # continue the last (assistant) message instead of starting a new one
    id: str = ""
    created: int = 0

    def __post_init__(self):
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.created = self.created or int(time.time())


def _common(body, defaults: Defaults, served_model: str) -> dict:
    model = check_model(body, served_model)
    refuse_unhonoured(body, NEUTRAL, HINTS)
    seed = checked(body, "seed", lambda v: is_int(v) and 0 <= v < 2**64, "an integer from 0 to 2**64 - 1")
    stream = checked(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    options = checked(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = checked(options, "include_usage", lambda v: isinstance(v, bool), "true or false", False)
    return dict(model=model, max_tokens=max_tokens_field(body, defaults), sampling=sampling_fields(body, defaults),
                seed=seed, stop=stop_strings(body.get("stop")), stream=stream, include_usage=include_usage)


def _tool_calls(calls, where: str) -> list:
    """An assistant message's tool_calls as chat templates take them: arguments as an object, not a string."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list", param=where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise APIError(400, f"{where}[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                           "\"arguments\"}}", param=f"{where}[{j}]")
        arguments = tool_arguments(fn.get("arguments"), f"{where}[{j}].function.arguments")
        out.append({"id": call.get("id") or "", "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise APIError(400, f"{where} must be an object with a string 'role'", param=where)
    role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for the system role
    content = m.get("content")
    if content is None and not (role == "assistant"):
        raise APIError(400, f"{where} has no 'content'", param=f"{where}.content")
    message = {"role": role, "content": text_content(content or "", f"{where}.content")}
    if role == "assistant" and m.get("tool_calls"):
        message["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    if role == "tool":
        message["tool_call_id"] = checked(m, "tool_call_id", lambda v: isinstance(v, str), "a string", "")
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
    return message


def parse_tools(tools, tool_choice, parallel=True) -> tuple:
    """(tools for the chat template or None, parallel calls allowed) from OpenAI's tools and tool_choice."""
    if tools is None or tool_choice == "none":
        if tool_choice not in (None, "none", "auto"):
            raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        return None, parallel
    if not (isinstance(tools, list) and tools):
        raise APIError(400, "'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}}",
                       param="tools")
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"'tools' holds {len(tools)} tools; at most {MAX_TOOLS}", param="tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"] and isinstance(fn.get("parameters", {}), dict)):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           "\"description\": ..., \"parameters\": {...}}}", param=f"tools[{i}]")
    return tools, parallel


def thinking_field(body: dict) -> Optional[bool]:
    """enable_thinking from `chat_template_kwargs` (the only key honoured), else `reasoning_effort` ("none" or
    "minimal": off, as the Responses API reads it; another effort: the template's default, None)."""
    kwargs = checked(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object", {})
    for key in kwargs:
        if key != "enable_thinking":
            raise APIError(400, f"'chat_template_kwargs.{key}' is not supported by this server (only "
                           "enable_thinking is)", param=f"chat_template_kwargs.{key}")
    if kwargs.get("enable_thinking") is not None:
        if not isinstance(kwargs["enable_thinking"], bool):
            raise APIError(400, "'chat_template_kwargs.enable_thinking' must be true or false",
                           param="chat_template_kwargs.enable_thinking")
        return kwargs["enable_thinking"]
    return effort_thinking(body.get("reasoning_effort"), "reasoning_effort")


def _forced(tool_choice, tools) -> Optional[str]:
    """GenerationRequest.force_tool from OpenAI's tool_choice: None ("auto", "none" or left out), "" for
    "required" (some call), or the name of {"type": "function", "function": {"name": ...}}."""
    if tool_choice in (None, "auto", "none") or not tools:
        return None
    if tool_choice == "required":
        return forced_tool("", tools)
    named = isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
    fn = tool_choice.get("function") if named else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
        raise APIError(400, f"'tool_choice' must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                       f"\"function\": {{\"name\": ...}}}}, got {json.dumps(tool_choice)[:100]}", param="tool_choice")
    return forced_tool(fn["name"], tools)


def parse_chat(body, defaults: Defaults, served_model: str) -> GenerationRequest:
    common = _common(body, defaults, served_model)
    if checked(body, "response_format", lambda v: isinstance(v, dict), "an object", {}).get("type", "text") != "text":
        raise APIError(400, f"'response_format' {json.dumps(body['response_format'])[:100]} is not supported by "
                       "this server (JSON modes need constrained decoding): ask for JSON in the prompt",
                       param="response_format")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects",
                       param="messages")
    chat = [_message(m, i) for i, m in enumerate(messages)]
    parallel = checked(body, "parallel_tool_calls", lambda v: isinstance(v, bool), "true or false", True)
    tools, parallel = parse_tools(body.get("tools"), body.get("tool_choice"), parallel)
    return GenerationRequest(kind="chat", prompt=chat, tools=tools, parallel_tool_calls=parallel,
                             thinking=thinking_field(body), force_tool=_forced(body.get("tool_choice"), tools),
                             **common)


def parse_completion(body, defaults: Defaults, served_model: str) -> GenerationRequest:
    common = _common(body, defaults, served_model)
    for name in ("tools", "tool_choice", "response_format", "chat_template_kwargs", "reasoning_effort"):
        if body.get(name) is not None:
            raise APIError(400, f"'{name}' is for /v1/chat/completions, not /v1/completions", param=name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    token_ids = isinstance(prompt, list) and prompt and all(is_int(t) and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not token_ids:
        raise APIError(400, "'prompt' must be a non-empty string, a list of one string, or a list of token ids "
                       "(one prompt per request)", param="prompt")
    return GenerationRequest(kind="text", prompt=prompt, **common)


class StopMatcher:
    """Cuts streamed text exactly before the first occurrence of any stop string.

    feed() returns the text that is safe to emit: it holds back the longest tail that could still be
    the start of a stop string, so a stop split across tokens is never half-sent. `matched` is the stop
    string found (the first in the text), once one is.
    """

    def __init__(self, stops: list):
        self.stops = stops
        self.pending = ""
        self.matched: Optional[str] = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, text: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        self.pending += text
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            out, self.pending = self.pending[:at], ""
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
    stats: object = None  # decoding/responses.py GenerationStats
    queue_seconds: float = 0.0
    seconds: float = 0.0
    stop_sequence: Optional[str] = None  # the stop string that ended it, if one did

    def usage(self) -> dict:
        cached = self.stats.cached_tokens if self.stats is not None else 0
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def speculative(self) -> dict:
        s = self.stats
        return {
            "mode": s.mode,  # what served most rounds: tree, chain, lookup or plain
            "width": s.widths.most_common(1)[0][0] if s.widths else 0,  # the rows most rounds verified
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
            # What served it (decoding/engine_report.py): the drafter or plain steps, the verify's paths,
            # every fallback.
            "drafted_rounds": s.drafted_rounds,
            "plain_steps": s.plain_steps,
            "looked_up_rounds": s.looked_up_rounds,
            "verify": dict(s.verify_paths),
            "routes": [dict(r) for r in s.routes],
            "notes": list(s.notes),
        }


def finish_reason(outcome: Outcome, calls: list) -> str:
    """OpenAI's finish_reason: "tool_calls" when the reply ended (not cut) with tool calls."""
    return "tool_calls" if calls and outcome.finish_reason == "stop" else outcome.finish_reason


def tool_call_json(call, index: Optional[int] = None) -> dict:
    """One parsed tool call (tools.ToolCall) as OpenAI sends it; streamed ones carry their index."""
    out = {"id": f"call_{call.id}", "type": "function",
           "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
    return out if index is None else {"index": index, **out}


def _choice(req: GenerationRequest, text: Optional[str], finish: Optional[str], delta: bool,
            first: bool = False, calls: tuple = (), reasoning: str = "") -> dict:
    choice = {"index": 0, "finish_reason": finish, "logprobs": None}
    if req.kind == "text":
        choice["text"] = text or ""
        return choice
    if delta:
        choice["delta"] = message = {} if text is None else {"content": text}
        if first:
            message["role"] = "assistant"
        if calls:
            message["tool_calls"] = list(calls)
    else:
        choice["message"] = message = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = [tool_call_json(c) for c in calls]
    if reasoning:
        message["reasoning_content"] = reasoning  # the field DeepSeek's API and vLLM name a model's reasoning
    return choice


def _envelope(req: GenerationRequest, chunk: bool) -> dict:
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    return {"id": req.id, "object": obj + (".chunk" if chunk and req.kind == "chat" else ""),
            "created": req.created, "model": req.model}


def completion_body(req: GenerationRequest, text: str, outcome: Outcome, calls: list = (), reasoning: str = "") -> dict:
    """The whole (non-streaming) response."""
    choice = _choice(req, text, finish_reason(outcome, calls), False, calls=calls, reasoning=reasoning)
    return {**_envelope(req, False), "choices": [choice], "usage": outcome.usage(), "dflash": outcome.speculative()}


def chunk_body(req: GenerationRequest, text: Optional[str], finish: Optional[str] = None, first: bool = False,
               calls: tuple = (), reasoning: str = "") -> dict:
    """One streamed chunk; text None with a finish_reason is the closing chunk; the first names the role;
    `calls` are streamed tool calls (tool_call_json with their index), `reasoning` a thinking model's."""
    body = {**_envelope(req, True), "choices": [_choice(req, text, finish, True, first, calls, reasoning)]}
    if req.include_usage:
        body["usage"] = None  # OpenAI: null on every chunk but the last
    return body


def usage_chunk_body(req: GenerationRequest, outcome: Outcome) -> dict:
    """The last chunk of a stream with include_usage: no choices, the usage and our statistics."""
    return {**_envelope(req, True), "choices": [], "usage": outcome.usage(), "dflash": outcome.speculative()}


def sse(body: dict, event: Optional[str] = None) -> str:
    """One server-sent event; Anthropic's streams name each event's type."""
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def openai_stream(req: GenerationRequest, prompt_tokens: int, replies):
    """The SSE body of a streamed OpenAI response, from jobs.py's reply events (prompt_tokens: unused, as
    OpenAI's first chunk has no usage)."""
    calls = 0
    if req.kind == "chat":
        yield sse(chunk_body(req, "", first=True))
    async for kind, payload in replies:
        if kind == "text":
            yield sse(chunk_body(req, payload))
        elif kind == "reasoning":
            yield sse(chunk_body(req, None, reasoning=payload))
        elif kind == "call":
            yield sse(chunk_body(req, None, calls=(tool_call_json(payload, calls),)))
            calls += 1
        elif kind == "ping":
            yield ": ping\n\n"  # an SSE comment: keeps proxies and client timeouts from closing a quiet stream
        elif kind == "error":
            yield sse(payload.body())
            break
        elif kind == "done":
            yield sse(chunk_body(req, None, finish_reason(payload, [None] * calls)))
            if req.include_usage:
                yield sse(usage_chunk_body(req, payload))
    yield "data: [DONE]\n\n"
