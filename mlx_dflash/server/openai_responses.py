"""OpenAI's Responses API for `mlx-dflash serve`: `POST /v1/responses` and `GET /v1/responses/{id}`.

So that clients that speak only this API (Codex CLI, openai-agents' default model) work against the local
pair. A request becomes the same chat `GenerationRequest` as a chat completion: `instructions` a system
message first, the input items chat-template messages (`function_call` items an assistant message's
tool_calls, `function_call_output` items `role: "tool"` messages, earlier `reasoning` items dropped), the
flat function tools the template's OpenAI function tools. Freeform (`custom`) tools are offered as a
function of one string parameter `input` and answered as `custom_tool_call` items; tools that run on
OpenAI's servers (`web_search`, `file_search`, ...) are left out, with one log line. Replies are response
objects: output items (`reasoning`, `message`, `function_call`, `custom_tool_call`), `status`, `usage`;
streamed, the `response.*` event sequence, every event numbered. A response is kept (unless `store` is
false) for `previous_response_id` and `GET /v1/responses/{id}`, in a bounded store of the latest ones.
"""

import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from .fields import (MAX_TOOLS, APIError, Defaults, check_model, checked, effort_thinking, max_tokens_field,
                     refuse_unhonoured, sampling_fields, text_content, tool_arguments)
from .protocol import GenerationRequest, Outcome, sse, tool_call_json
from .tools import forced_tool

log = logging.getLogger("mlx_dflash.server")
KEPT_RESPONSES = 64  # responses kept for previous_response_id and GET /v1/responses/{id}, per API key
KEPT_BYTES = 64 << 20  # their JSON bytes per API key (serve --max-kept-bytes); 4x that across keys
TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
# Known fields this server cannot honour: the values that ask for nothing, and what to do instead.
NEUTRAL = {"background": (False,), "conversation": (), "prompt": (), "top_logprobs": (0,)}
HINTS = {"background": "this server answers while the client waits",
         "conversation": "send the whole conversation in 'input'",
         "prompt": "send the prompt's text in 'instructions' and 'input'"}


@dataclass
class ResponsesRequest(GenerationRequest):
    """A Responses API request: the chat request, and what its response repeats and keeps."""

    conversation: list = field(default_factory=list)  # the prompt's messages after the instructions
    custom_tools: frozenset = frozenset()  # names of freeform tools (offered as functions of one `input`)
    echo: dict = field(default_factory=dict)  # the request's settings, as the response object repeats them
    keep: bool = True  # store: kept for previous_response_id and GET /v1/responses/{id}


class KeptBytes:
    """The bytes every API key's store keeps, together: past `limit`, the least recently used response of any
    key is dropped first."""

    def __init__(self, limit: int = 4 * KEPT_BYTES):
        self.limit, self.used, self.order = limit, 0, OrderedDict()  # (store, id) -> bytes

    def add(self, store: "ResponseStore", response_id: str, size: int):
        self.order[(store, response_id)] = size
        self.used += size
        while self.used > self.limit:
            owner, oldest = next(iter(self.order))
            owner.drop(oldest)

    def touch(self, store: "ResponseStore", response_id: str):
        self.order.move_to_end((store, response_id))

    def remove(self, store: "ResponseStore", response_id: str):
        self.used -= self.order.pop((store, response_id))


class ResponseStore:
    """One API key's latest kept responses: each one's object and its whole conversation, kept as the JSON
    bytes they are served and read back from (a reply's Python objects can weigh many times their text), at
    most `size` of them and `max_bytes` in all (and `shared`'s bound across keys), the least recently used
    dropped first. A response bigger than `max_bytes` is answered but not kept, said in the log."""

    def __init__(self, size: int = KEPT_RESPONSES, max_bytes: int = KEPT_BYTES, shared: Optional[KeptBytes] = None):
        self.size, self.max_bytes, self.used, self.entries = size, max_bytes, 0, OrderedDict()
        self.shared = shared or KeptBytes(max_bytes)

    def keep(self, response: dict, conversation: list):
        rid = response["id"]
        entry = (json.dumps(response).encode(), json.dumps(conversation).encode())
        size = len(entry[0]) + len(entry[1])
        self.drop(rid)
        if size > self.max_bytes:
            log.info(f"{rid}: {size / 2**20:.3g} MiB is more than the {self.max_bytes / 2**20:.3g} MiB a key keeps "
                     "(--max-kept-bytes): answered, not kept")
            return
        self.entries[rid] = entry
        self.used += size
        while len(self.entries) > self.size or self.used > self.max_bytes:
            self.drop(next(iter(self.entries)))
        self.shared.add(self, rid, size)

    def drop(self, response_id: str):
        if response_id in self.entries:
            response, conversation = self.entries.pop(response_id)
            self.used -= len(response) + len(conversation)
            self.shared.remove(self, response_id)

    def _entry(self, response_id: str, status: int, param: Optional[str]) -> tuple:
        if response_id not in self.entries:
            raise APIError(status, f"response '{response_id}' is not kept by this server (it keeps the last "
                           f"{self.size} responses not sent with store: false, within "
                           f"{self.max_bytes / 2**20:.3g} MiB); send the whole conversation",
                           param=param, code="previous_response_not_found" if param else "not_found")
        self.entries.move_to_end(response_id)
        self.shared.touch(self, response_id)
        return self.entries[response_id]

    def conversation(self, response_id: str) -> list:
        return json.loads(self._entry(response_id, 400, "previous_response_id")[1])

    def response(self, response_id: str) -> bytes:
        """The kept response object as JSON bytes, served as they are."""
        return self._entry(response_id, 404, None)[0]


def _text_parts(content, where: str) -> str:
    """A message's content, or a tool's output: a string, or text parts (joined by blank lines)."""
    return text_content(content, where, TEXT_PARTS, "\n\n")


def _string(item: dict, name: str, where: str) -> str:
    if not isinstance(item.get(name), str):
        raise APIError(400, f"{where}.{name} must be a string", param=f"{where}.{name}")
    return item[name]


def _call(item: dict, where: str) -> dict:
    """A function_call or custom_tool_call item as a chat-template tool call (arguments an object)."""
    name = _string(item, "name", where)
    if item["type"] == "custom_tool_call":
        arguments = {"input": _string(item, "input", where)}
    else:
        arguments = tool_arguments(_string(item, "arguments", where), f"{where}.arguments")
    return {"id": str(item.get("call_id") or ""), "type": "function", "function": {"name": name, "arguments": arguments}}


def input_messages(items, where: str = "input") -> list:
    """Input items (or a response's output items) as chat-template messages. A call joins the assistant
    message before it, so that parallel calls (and the text before them) are one assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise APIError(400, f"'{where}' must be a string or a list of input items", param=where)
    chat = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{at} must be an object", param=at)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{at}.role must be \"user\", \"assistant\", \"system\" or \"developer\"",
                               param=f"{at}.role")
            role = "system" if role == "developer" else role
            content = _text_parts(item.get("content", ""), f"{at}.content")
            if role == "system" and chat and chat[-1]["role"] == "system":  # one system turn, as templates want
                chat[-1]["content"] += "\n\n" + content
            else:
                chat.append({"role": role, "content": content})
        elif kind in ("function_call", "custom_tool_call"):
            if not (chat and chat[-1]["role"] == "assistant"):
                chat.append({"role": "assistant", "content": ""})
            chat[-1].setdefault("tool_calls", []).append(_call({**item, "type": kind}, at))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            chat.append({"role": "tool", "tool_call_id": _string(item, "call_id", at),
                         "content": _text_parts(item.get("output", ""), f"{at}.output")})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: the chat template has no place for it
        else:
            raise APIError(400, f"{at}: {json.dumps(kind)} items are not supported here (message, function_call, "
                           "function_call_output, custom_tool_call, custom_tool_call_output and reasoning are)",
                           param=at)
    return chat


def _function(tool: dict, where: str) -> dict:
    name = tool.get("name")
    if not (isinstance(name, str) and name):
        raise APIError(400, f"{where} needs a 'name'", param=where)
    function = {"name": name}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    if tool["type"] == "custom":  # freeform: the model writes one string
        function["parameters"] = {"type": "object", "properties": {"input": {
            "type": "string", "description": "the tool's input, as free text"}}, "required": ["input"]}
    else:
        function["parameters"] = checked(tool, "parameters", lambda v: isinstance(v, dict), "an object",
                                         {"type": "object", "properties": {}})
    return {"type": "function", "function": function}


def parse_tools(tools) -> tuple:
    """(OpenAI function tools for the chat template or None, the freeform tools' names) from the flat
    Responses tools; tools that run on OpenAI's servers are left out."""
    if tools is None:
        return None, frozenset()
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list of {\"type\": \"function\", \"name\", \"parameters\"}",
                       param="tools")
    out, custom, ignored = [], set(), []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in ("function", "custom"):
            out.append(_function(tool, f"tools[{i}]"))
            if kind == "custom":
                custom.add(out[-1]["function"]["name"])
        elif isinstance(kind, str):
            ignored.append(kind)
        else:
            raise APIError(400, f"tools[{i}] must be an object with a 'type'", param=f"tools[{i}]")
    if ignored:
        log.info(f"tools that run on OpenAI's servers are left out: {', '.join(sorted(set(ignored)))}")
    if len(out) > MAX_TOOLS:
        raise APIError(400, f"'tools' holds {len(out)} tools; at most {MAX_TOOLS}", param="tools")
    return out or None, frozenset(custom)


def _forced(choice, tools: Optional[list]) -> Optional[str]:
    """GenerationRequest.force_tool from tool_choice: None (auto, none), "" (required) or the tool's name."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return forced_tool("", tools)
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if named and isinstance(choice.get("name"), str):
        return forced_tool(choice["name"], tools)
    raise APIError(400, f"'tool_choice' {json.dumps(choice)[:100]} is not supported here: send \"auto\", \"none\", "
                   "\"required\" or {\"type\": \"function\", \"name\": ...}", param="tool_choice")


def _refuse_unhonoured(body: dict):
    refuse_unhonoured(body, NEUTRAL, HINTS)
    text = checked(body, "text", lambda v: isinstance(v, dict), "an object", {})
    form = checked(text, "format", lambda v: isinstance(v, dict), "an object", {"type": "text"})
    if form.get("type") != "text":
        raise APIError(400, f"'text.format' {json.dumps(form)[:100]} is not supported by this server (structured "
                       "outputs need constrained decoding): ask for JSON in the prompt", param="text.format")


def parse_responses(body, defaults: Defaults, served_model: str, store: ResponseStore) -> ResponsesRequest:
    """A Responses API body as a chat request (`store` holds the responses previous_response_id names)."""
    model = check_model(body, served_model)
    _refuse_unhonoured(body)
    keep = checked(body, "store", lambda v: isinstance(v, bool), "true or false", True)
    checked(body, "truncation", lambda v: v in ("auto", "disabled"), "\"auto\" or \"disabled\"")
    reasoning = checked(body, "reasoning", lambda v: isinstance(v, dict), "an object", {})
    instructions = checked(body, "instructions", lambda v: isinstance(v, str), "a string")
    previous = checked(body, "previous_response_id", lambda v: isinstance(v, str), "a string")
    if body.get("input") in (None, "", []):
        raise APIError(400, "'input' is required: a string or a list of input items", param="input")
    conversation = (store.conversation(previous) if previous else []) + input_messages(body["input"])
    chat = conversation
    if instructions:  # the system turn first, joined with system items that open the input
        head = conversation[:1] if conversation[:1] and conversation[0]["role"] == "system" else []
        system = "\n\n".join([instructions] + [m["content"] for m in head])
        chat = [{"role": "system", "content": system}] + conversation[len(head):]
    tools, custom = parse_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice == "none":
        tools, custom = None, frozenset()
    parallel = checked(body, "parallel_tool_calls", lambda v: isinstance(v, bool), "true or false", True)
    max_tokens = max_tokens_field(body, defaults, ("max_output_tokens",))
    sampling = sampling_fields(body, defaults)
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": parallel, "previous_response_id": previous,
            "prompt_cache_key": body.get("prompt_cache_key"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "service_tier": "default", "store": keep, "temperature": sampling.temperature,
            "text": {"format": {"type": "text"}}, "tool_choice": choice or "auto", "tools": body.get("tools") or [],
            "top_p": sampling.top_p, "truncation": body.get("truncation") or "disabled", "user": body.get("user")}
    return ResponsesRequest(
        kind="chat", model=model, prompt=chat, max_tokens=max_tokens, sampling=sampling,
        stream=checked(body, "stream", lambda v: isinstance(v, bool), "true or false", False),
        tools=tools, parallel_tool_calls=parallel, force_tool=_forced(choice, tools),
        thinking=effort_thinking(reasoning.get("effort"), "reasoning.effort"),
        id=f"resp_{uuid.uuid4().hex}", conversation=conversation, custom_tools=custom, echo=echo, keep=keep)


# Replies.

def _message_item(item_id: str, text: Optional[str], status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _reasoning_item(item_id: str, text: Optional[str], status: str) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _call_item(req: ResponsesRequest, call, status: str, done: bool = True) -> dict:
    """A parsed tool call as a function_call item (or custom_tool_call, for a freeform tool); not done:
    as first announced, before its arguments."""
    wire = tool_call_json(call)
    if call.name in req.custom_tools:
        text = call.arguments.get("input")
        text = text if isinstance(text, str) else wire["function"]["arguments"]
        return {"id": f"ctc_{call.id}", "type": "custom_tool_call", "call_id": wire["id"], "name": call.name,
                "input": text if done else ""}
    return {"id": f"fc_{call.id}", "type": "function_call", "call_id": wire["id"], "name": call.name,
            "arguments": wire["function"]["arguments"] if done else "", "status": status}


def _usage(outcome: Optional[Outcome]) -> Optional[dict]:
    if outcome is None:
        return None
    cached = outcome.stats.cached_tokens if outcome.stats is not None else 0
    # cache_write_tokens counts OpenAI's explicit cache writes: none here (the prefix cache keeps what it keeps).
    return {"input_tokens": outcome.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": outcome.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}


def response_object(req: ResponsesRequest, output: list, outcome: Optional[Outcome] = None,
                    error: Optional[APIError] = None) -> dict:
    """The response object: in progress (no outcome yet), completed or incomplete, or failed."""
    status = "in_progress" if outcome is None else "incomplete" if outcome.finish_reason == "length" else "completed"
    body = {"id": req.id, "object": "response", "created_at": req.created, "status": "failed" if error else status,
            "error": None, "incomplete_details": None, "model": req.model, "output": output, **req.echo,
            "usage": _usage(outcome)}
    if status == "incomplete":
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    if error is not None:
        body["error"] = {"code": "server_error" if error.status >= 500 else "invalid_prompt", "message": error.message}
    if outcome is not None:
        body["completed_at"] = int(time.time())
        if outcome.stats is not None:
            body["dflash"] = outcome.speculative()
    return body


def _finished(store: ResponseStore, req: ResponsesRequest, output: list, outcome: Outcome) -> dict:
    """The final response object, kept (with the conversation it ends) unless the request said store: false."""
    body = response_object(req, output, outcome)
    if req.keep and outcome.finish_reason != "cancelled":
        store.keep(body, req.conversation + input_messages(output, "output"))
    return body


def response_body(req: ResponsesRequest, text: str, outcome: Outcome, calls: list = (), *,
                  store: ResponseStore, reasoning: str = "") -> dict:
    """The whole (non-streamed) response: the reasoning as one item, the text as one message, then the calls;
    reasoning alone is the reasoning item alone (as OpenAI answers a reply cut while reasoning), and a reply
    with none of them one empty message."""
    thought = [_reasoning_item(f"rs_{uuid.uuid4().hex}", reasoning, "completed")] if reasoning else []
    said = text or calls or reasoning
    message = [_message_item(f"msg_{uuid.uuid4().hex}", text, "completed")] if text or not said else []
    return _finished(store, req, thought + message + [_call_item(req, c, "completed") for c in calls], outcome)


class _Events:
    """A streamed response's events in order, each numbered, and its output items as they are made."""

    def __init__(self, req: ResponsesRequest):
        self.req, self.sequence, self.output = req, 0, []
        self.open: Optional[str] = None  # the kind of the item being written: "text" or "reasoning"
        self.text = ""

    def event(self, kind: str, **fields) -> str:
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence - 1, **fields}, kind)

    def _at(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def add(self, item: dict) -> str:
        self.output.append(item)
        return self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)

    def done(self, item: dict) -> str:
        self.output[-1] = item
        return self.event("response.output_item.done", output_index=len(self.output) - 1, item=item)

    def write(self, kind: str, text: str) -> list:
        """Text or reasoning text: opens its item (closing another) on the first piece."""
        out = [] if self.open == kind else self.close() + self.begin(kind)
        self.text += text
        name = "output_text" if kind == "text" else "reasoning_text"
        return out + [self.event(f"response.{name}.delta", **self._at(), content_index=0, delta=text,
                                 **({"logprobs": []} if kind == "text" else {}))]

    def begin(self, kind: str) -> list:
        item_id = f"msg_{uuid.uuid4().hex}" if kind == "text" else f"rs_{uuid.uuid4().hex}"
        make = _message_item if kind == "text" else _reasoning_item
        self.open, self.text = kind, ""
        part = make(item_id, "", "in_progress")["content"][0]
        return [self.add(make(item_id, None, "in_progress")),
                self.event("response.content_part.added", **self._at(), content_index=0, part=part)]

    def close(self) -> list:
        if self.open is None:
            return []
        kind, self.open = self.open, None
        make = _message_item if kind == "text" else _reasoning_item
        item = make(self.output[-1]["id"], self.text, "completed")
        name = "output_text" if kind == "text" else "reasoning_text"
        return [self.event(f"response.{name}.done", **self._at(), content_index=0, text=self.text,
                           **({"logprobs": []} if kind == "text" else {})),
                self.event("response.content_part.done", **self._at(), content_index=0, part=item["content"][0]),
                self.done(item)]

    def call(self, call) -> list:
        item = _call_item(self.req, call, "completed")
        out = self.close() + [self.add(_call_item(self.req, call, "in_progress", done=False))]
        if item["type"] == "custom_tool_call":
            out += [self.event("response.custom_tool_call_input.delta", **self._at(), delta=item["input"]),
                    self.event("response.custom_tool_call_input.done", **self._at(), input=item["input"])]
        else:
            out += [self.event("response.function_call_arguments.delta", **self._at(), delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", **self._at(), name=item["name"],
                               arguments=item["arguments"])]
        return out + [self.done(item)]


async def response_stream(req: ResponsesRequest, prompt_tokens: int, replies, *, store: ResponseStore):
    """The SSE body of a streamed response, from jobs.py's reply events (prompt_tokens: unused, as the
    usage comes with the last event)."""
    events = _Events(req)
    yield events.event("response.created", response=response_object(req, []))
    yield events.event("response.in_progress", response=response_object(req, []))
    async for kind, payload in replies:
        pieces = []
        if kind in ("text", "reasoning"):
            pieces = events.write(kind, payload)
        elif kind == "call":
            pieces = events.call(payload)
        elif kind == "ping":
            pieces = [": ping\n\n"]  # an SSE comment: keeps proxies and client timeouts from closing a quiet stream
        elif kind == "error":
            yield events.event("response.failed", response=response_object(req, events.output, error=payload))
            return
        elif kind == "done":
            if not events.output:  # nothing was said: an empty message, as in the whole response
                pieces = events.begin("text")
            pieces += events.close()
            body = _finished(store, req, events.output, payload)
            status = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
            pieces.append(events.event(status, response=body))
        for piece in pieces:
            yield piece
