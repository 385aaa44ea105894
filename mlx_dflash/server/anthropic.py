"""The Anthropic Messages API for `mlx-dflash serve`: `POST /v1/messages` and `/v1/messages/count_tokens`.

So that clients of Anthropic's API (its SDKs, coding agents run with `ANTHROPIC_BASE_URL`) work against
the local pair. A request becomes the same `GenerationRequest` as an OpenAI chat: the system prompt and
the content blocks become chat-template messages (`tool_use` blocks an assistant message's tool_calls,
`tool_result` blocks `role: "tool"` messages), the tools OpenAI-style function tools. Replies are
Anthropic's: content blocks (a thinking model's reasoning a `thinking` block, with an empty signature),
`stop_reason`, and when streamed its event sequence (`message_start`, `content_block_start` / `_delta` /
`_stop` per block, `ping`s, `message_delta`, `message_stop`).
Errors are Anthropic-shaped (`{"type": "error", "error": {"type", "message"}}`); a prompt over the
context is "prompt is too long: N tokens > M maximum", as Anthropic words it (agents compact on it).

What Claude Code sends is taken as it comes: system messages inside `messages` (system turns where the
chat template renders them there, else joined to the system prompt), its billing-header system block left
out of the prompt (its checksum changes per request), tools with a `type` (server tools) left out, and its
`thinking`, `context_management`, `output_config.effort` and `metadata` accepted. Usage counts the
prefix cache as Anthropic counts its own (`cache_read_input_tokens`, `cache_creation_input_tokens`).
"""

import json
import logging
import uuid

from .fields import (MAX_TOOLS, APIError, Defaults, check_model, checked, max_tokens_field, sampling_fields,
                     stop_strings, text_content)
from .protocol import GenerationRequest, Outcome, PromptTooLong, sse
from .tools import forced_tool

ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}
PATHS = "/v1/messages"  # every path under it answers in this shape
THINKING = {"enabled": True, "disabled": False, "adaptive": None}  # `thinking.type` as enable_thinking
BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's first system block, with a per-request checksum
TEXT_ONLY = ("image", "document")  # content a text model cannot read
log = logging.getLogger("mlx_dflash.server")


def error_body(e: APIError) -> dict:
    message = e.message
    if isinstance(e, PromptTooLong):
        message = (f"prompt is too long: {e.prompt_tokens} tokens > {e.context - 1} maximum (this model's context "
                   f"is {e.context} tokens)")
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "invalid_request_error"),
                                       "message": message}}


def _refuse_media(block, at: str):
    if isinstance(block, dict) and block.get("type") in TEXT_ONLY:
        raise APIError(400, f"{at}: {json.dumps(block['type'])} blocks cannot be read: this model reads text only",
                       param=at)


def _system(content, where: str) -> str:
    """A system prompt's text, without Claude Code's billing-header block: its checksum changes on every
    request, so in the prompt it would make each turn miss the prefix cache."""
    if isinstance(content, list):
        content = [b for b in content if not (isinstance(b, dict) and b.get("type") == "text"
                                              and str(b.get("text", "")).startswith(BILLING_HEADER))]
    return text_content(content, where, sep="\n\n")


def system_turns(tokenizer) -> bool:
    """Whether the chat template renders system messages where they stand in a conversation (after user and
    assistant turns, and last, where Claude Code sends one): read once per server by a probe, as
    tools.tool_support reads tool support. A template that refuses the probe, or drops or moves its system
    messages, does not; the server then merges them into the system prompt, in order."""
    probe = [{"role": role, "content": f"probe-{i}-{role}"}
             for i, role in enumerate(("user", "system", "assistant", "user", "system"))]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    except Exception:  # the template's own checks (roles must alternate, system first) raise its own types
        return False
    at = [text.find(m["content"]) for m in probe]
    return min(at) >= 0 and at == sorted(at)


def _blocks(role: str, content, i: int) -> list:
    """One Anthropic message as chat-template messages: tool results first (role "tool"), then the text."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content blocks", param=where)
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}[{j}]"
        _refuse_media(block, at)
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant" and isinstance(block.get("name"), str):
            arguments = checked(block, "input", lambda v: isinstance(v, dict), "an object", {})
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"], "arguments": arguments}})
        elif kind == "tool_result" and role == "user":
            result = text_content(block.get("content", ""), f"{at}.content", sep="\n\n")
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": "Error: " + result if block.get("is_error") else result})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier turns' thinking: this model's template has no place for it
        else:
            raise APIError(400, f"{at}: {json.dumps(kind)} blocks are not supported here (text, tool_use in "
                           "assistant turns and tool_result in user turns are)", param=at)
    if role == "user":
        return results + ([{"role": "user", "content": "\n\n".join(texts)}] if texts or not results else [])
    message = {"role": "assistant", "content": "\n\n".join(texts)}
    return [{**message, "tool_calls": calls} if calls else message]


def _tools(body: dict, request_id: str) -> tuple:
    """(OpenAI-style function tools or None, parallel calls allowed, GenerationRequest.force_tool) from
    Anthropic's tools and tool_choice. Tools with a `type` (server tools such as web_search_..., Anthropic's
    bash_... and text_editor_..., which have no schema) are left out, with a log line."""
    choice = checked(body, "tool_choice", lambda v: isinstance(v, dict) and isinstance(v.get("type"), str),
                    'an object such as {"type": "auto"}', {"type": "auto"})
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind, tools = choice["type"], body.get("tools")
    if kind not in ("auto", "any", "tool", "none"):
        raise APIError(400, f"tool_choice.type must be \"auto\", \"any\", \"tool\" or \"none\", got "
                       f"{json.dumps(kind)[:100]}", param="tool_choice.type")
    if kind == "tool" and not isinstance(choice.get("name"), str):
        raise APIError(400, 'tool_choice {"type": "tool"} needs the tool\'s "name"', param="tool_choice.name")
    if kind == "none" or (not tools and kind == "auto"):
        return None, parallel, None
    if not tools:
        raise APIError(400, f'tool_choice {{"type": "{kind}"}} needs \'tools\'', param="tool_choice")
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list of {\"name\", \"description\", \"input_schema\"}", param="tools")
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"'tools' holds {len(tools)} tools; at most {MAX_TOOLS}", param="tools")
    out, ignored = [], []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise APIError(400, f"tools[{i}] must be an object {{\"name\", \"input_schema\"}}", param=f"tools[{i}]")
        if tool.get("type", "custom") != "custom":
            ignored.append(f"{tool.get('name')} ({tool.get('type')})")
            continue
        if not (isinstance(tool.get("name"), str) and tool["name"] and isinstance(tool.get("input_schema"), dict)):
            raise APIError(400, f"tools[{i}] must have a 'name' and an 'input_schema' object", param=f"tools[{i}]")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    if ignored:
        log.info(f"{request_id}: tools left out (this server runs only tools with an input_schema): "
                 + ", ".join(ignored)[:300])
    if kind == "auto":
        return out or None, parallel, None
    if kind == "tool":
        return out, parallel, forced_tool(choice["name"], out, "tool_choice.name")
    return out, parallel, forced_tool("", out)


def _thinking(body: dict):
    """`thinking` as enable_thinking: "disabled" off, "enabled" on, "adaptive" the template's default (None)."""
    thinking = checked(body, "thinking", lambda v: isinstance(v, dict) and v.get("type") in THINKING,
                       'an object {"type": "enabled", "budget_tokens": N}, {"type": "disabled"} or '
                       '{"type": "adaptive"}')
    return None if thinking is None else THINKING[thinking["type"]]


def parse_messages(body, defaults: Defaults, served_model: str, count_only: bool = False,
                   system_turns: bool = True) -> GenerationRequest:
    """A Messages API body (count_only: a count_tokens body, which has no max_tokens, and whose count leaves out
    a forced call's opening, written by the server as the reply's start) as a chat request.
    system_turns: system messages inside `messages` stay where they are (else they join the system prompt)."""
    model = check_model(body, served_model)
    if not count_only and body.get("max_tokens") is None:
        raise APIError(400, "max_tokens: Field required", param="max_tokens")
    max_tokens = max_tokens_field(body, defaults, ("max_tokens",))
    output = body.get("output_config")
    if (isinstance(output, dict) and output.get("format")) or body.get("output_format"):
        raise APIError(400, "structured outputs ('output_config.format') are not supported by this server (they need "
                       "constrained decoding): ask for JSON in the prompt", param="output_config.format")
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages):
        raise APIError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    request_id = f"msg_{uuid.uuid4().hex[:24]}"
    system = [_system(body["system"], "system")] if body.get("system") else []
    chat = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")):
            raise APIError(400, f"messages[{i}].role must be \"user\", \"assistant\" or \"system\"",
                           param=f"messages[{i}].role")
        if m["role"] != "system":
            chat += _blocks(m["role"], m.get("content"), i)
        elif system_turns:
            chat.append({"role": "system", "content": _system(m.get("content"), f"messages[{i}].content")})
        else:
            system.append(_system(m.get("content"), f"messages[{i}].content"))
    if all(m["role"] == "system" for m in chat):
        raise APIError(400, "'messages' must hold a user or assistant message, not only system messages",
                       param="messages")
    system = "\n\n".join(t for t in system if t)
    chat = ([{"role": "system", "content": system}] if system else []) + chat
    last = chat[-1]
    continue_final = last["role"] == "assistant" and not last.get("tool_calls") and bool(last["content"])
    tools, parallel, force_tool = _tools(body, request_id)
    if force_tool is not None and continue_final:
        raise APIError(400, "a forced tool call (tool_choice any or tool) cannot continue a final assistant "
                       "message: end the conversation with a user turn", param="tool_choice")
    stream = checked(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    return GenerationRequest(kind="chat", model=model, prompt=chat, max_tokens=max_tokens,
                             sampling=sampling_fields(body, defaults, max_temperature=1.0),
                             stop=stop_strings(body.get("stop_sequences"), "stop_sequences"), stream=stream,
                             tools=tools, parallel_tool_calls=parallel, thinking=_thinking(body),
                             force_tool=None if count_only else force_tool,
                             continue_final=continue_final, id=request_id)


# Reply pieces streamed as the deltas of one block: (the block as it starts, its delta's type, the delta's field).
STREAMED = {"text": ({"type": "text", "text": ""}, "text_delta", "text"),
            "reasoning": ({"type": "thinking", "thinking": "", "signature": ""}, "thinking_delta", "thinking")}


def stop_reason(outcome: Outcome, calls: int) -> str:
    if outcome.finish_reason == "length":
        return "max_tokens"
    if outcome.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if calls else "end_turn"


def _tool_use(call) -> dict:
    return {"type": "tool_use", "id": f"toolu_{call.id}", "name": call.name, "input": call.arguments}


def _usage(prompt_tokens: int, cached: int, output_tokens: int, caching: bool) -> dict:
    """Usage as Anthropic counts it, input_tokens + cache_read_input_tokens + cache_creation_input_tokens being
    the prompt: what the prefix cache held (`cached`) is read, and with a prefix cache every other prompt
    token is counted as written, as each request offers the cache the state it ended with (whether the cache
    kept it, prompt_cache.insert's answer, does not reach the Outcome); without one, they are all
    input_tokens."""
    created = prompt_tokens - cached if caching else 0
    return {"input_tokens": prompt_tokens - cached - created, "output_tokens": output_tokens,
            "cache_creation_input_tokens": created, "cache_read_input_tokens": cached}


def _outcome_usage(outcome: Outcome, caching: bool) -> dict:
    cached = outcome.stats.cached_tokens if outcome.stats is not None else 0
    return _usage(outcome.prompt_tokens, cached, outcome.completion_tokens, caching)


def message_body(req: GenerationRequest, text: str, outcome: Outcome, calls: list = (), reasoning: str = "",
                 caching: bool = False) -> dict:
    """The whole (non-streamed) message; caching: the server keeps a prefix cache."""
    content = ([{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []) + (
        [{"type": "text", "text": text}] if text or not (calls or reasoning) else []) + [_tool_use(c) for c in calls]
    return {"id": req.id, "type": "message", "role": "assistant", "model": req.model, "content": content,
            "stop_reason": stop_reason(outcome, len(calls)), "stop_sequence": outcome.stop_sequence,
            "usage": _outcome_usage(outcome, caching), "dflash": outcome.speculative()}


async def message_stream(req: GenerationRequest, prompt_tokens: int, replies, caching: bool = False):
    """The SSE body of a streamed message, from jobs.py's reply events. message_start's usage counts none of
    the prompt as read from the prefix cache (that is known once the request runs), message_delta's is the
    usage; input_tokens is the same in both (Claude Code keeps message_start's when message_delta's is 0)."""
    start = {"id": req.id, "type": "message", "role": "assistant", "model": req.model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": _usage(prompt_tokens, 0, 0, caching)}
    yield sse({"type": "message_start", "message": start}, "message_start")
    yield sse({"type": "ping"}, "ping")
    index, open_kind, calls = 0, None, 0  # open_kind: the streamed block that is open ("text", "reasoning")

    def block_stop():
        """The open block's end (a thinking block's signature first: empty, as nothing here signs it)."""
        signature = [sse({"type": "content_block_delta", "index": index, "delta": {
            "type": "signature_delta", "signature": ""}}, "content_block_delta")] if open_kind == "reasoning" else []
        return "".join(signature) + sse({"type": "content_block_stop", "index": index}, "content_block_stop")

    async for kind, payload in replies:
        if kind in STREAMED:
            if open_kind not in (None, kind):
                yield block_stop()
                index, open_kind = index + 1, None
            block, delta, field = STREAMED[kind]
            if open_kind is None:
                yield sse({"type": "content_block_start", "index": index, "content_block": block},
                          "content_block_start")
                open_kind = kind
            yield sse({"type": "content_block_delta", "index": index, "delta": {"type": delta, field: payload}},
                      "content_block_delta")
        elif kind == "call":
            if open_kind is not None:
                yield block_stop()
                index, open_kind = index + 1, None
            yield sse({"type": "content_block_start", "index": index,
                       "content_block": {**_tool_use(payload), "input": {}}}, "content_block_start")
            yield sse({"type": "content_block_delta", "index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(payload.arguments, ensure_ascii=False)}},
                "content_block_delta")
            yield block_stop()
            index, calls = index + 1, calls + 1
        elif kind == "ping":
            yield sse({"type": "ping"}, "ping")
        elif kind == "error":
            yield sse(error_body(payload), "error")
            return
        elif kind == "done":
            if open_kind is not None:
                yield block_stop()
            delta = {"stop_reason": stop_reason(payload, calls), "stop_sequence": payload.stop_sequence}
            yield sse({"type": "message_delta", "delta": delta, "usage": _outcome_usage(payload, caching),
                       "dflash": payload.speculative()}, "message_delta")
            yield sse({"type": "message_stop"}, "message_stop")
