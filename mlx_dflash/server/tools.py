"""Tool calls in a model's reply: found as the reply streams, in the forms models write them.

The model's own syntax first: mlx-lm chooses a tool parser for the tokenizer (its `tool_parser_type`, or
one inferred from the chat template: json_tools for `<tool_call>` JSON, qwen3_coder, mistral, pythonic,
...), as `mlx_lm.server` does, and mlx-lm's `TextStateMachine` cuts the text between the parser's start
and end markers out of the reply. Small models do not always write their family's markers: asked with
tools, Qwen2.5-Coder-0.5B answers with a bare `{"name": ..., "arguments": {...}}` or a fenced json block.
A reply that is nothing but such JSON, calling tools of the request, is a tool call too (as Ollama and
LM Studio read it); any other reply stays text. So that such a reply is not streamed as text first, text
that could still become one (it starts with `{`, `[` or a code fence) is held back until it is decided.

A chat template that does not render tools gets them in one generic form, the Hermes/Qwen one
(`generic_tools_messages`): the tools as JSON function schemas in the system prompt with the instruction to
answer a call as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, earlier calls and results as
text in that form; the reply is read with mlx-lm's `json_tools` parser.

A forced call (`tool_choice` "required" / "any" or a named tool) makes the reply start with the opening of
a call in the family's syntax (`forced_prefix`): its ids follow the generation prompt, and the parser reads
that text first, so the reply parses as the call the model goes on to write.
"""

import json
import logging
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

from mlx_lm.generate import TextStateMachine
from mlx_lm.tool_parsers import json_tools

from .fields import APIError

log = logging.getLogger("mlx_dflash.server")
DUMMY_TOOL = {"type": "function", "function": {"name": "probe", "description": "probe", "parameters": {
    "type": "object", "properties": {}}}}
# Qwen2.5's words for tools in a system prompt (Hermes' format), which json_tools reads the answers of.
GENERIC_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
# How a call opens after the start marker, per mlx-lm parser module: (for the named tool, for any tool). Each
# ends where the family's own text goes on with a fresh token (`"arguments":`, not `"arguments": `: the
# space belongs to the next token), so the model continues as it would have written the call itself.
CALL_OPENINGS = {
    "json_tools": (lambda name: '\n{"name": ' + json.dumps(name) + ', "arguments":', '\n{"name": "'),
    "qwen3_coder": (lambda name: f"\n<function={name}>\n", "\n<function="),
    "mistral": (lambda name: f"{name}[ARGS]", ""),
    "pythonic": (lambda name: f"[{name}(", "["),
    "gemma4": (lambda name: f"call:{name}{{", "call:"),
    "function_gemma": (lambda name: f"call:{name}{{", "call:"),
}
_FENCE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])


@dataclass
class ToolSupport:
    """What the tokenizer offers: whether its chat template renders tools, and its tool-call syntax (for a
    template that does not render tools, the generic form's)."""

    renders_tools: bool
    start: Optional[str] = None  # the parser's markers and function (text, tools) -> call dict(s)
    end: Optional[str] = None
    parse: object = None


def tool_support(tokenizer) -> ToolSupport:
    """Read once per server: a template renders tools if a request with a tool renders differently; one that
    does not gets them in the generic form, read with mlx-lm's json_tools parser."""
    renders = False
    if getattr(tokenizer, "chat_template", None) is not None:
        messages = [{"role": "user", "content": "x"}]
        try:
            plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            renders = plain != tokenizer.apply_chat_template(messages, tools=[DUMMY_TOOL], tokenize=False,
                                                            add_generation_prompt=True)
        except Exception:  # a template that refuses the probe: it does not take tools
            renders = False
    if not renders:
        return ToolSupport(False, json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call)
    if not getattr(tokenizer, "has_tool_calling", False):
        return ToolSupport(True)
    return ToolSupport(renders, tokenizer.tool_call_start, tokenizer.tool_call_end or None, tokenizer.tool_parser)


def generic_tools_messages(messages: list, tools: list) -> list:
    """Chat messages for a template that does not render tools: the tools in the system prompt (merged into
    the first system message, or one added), each assistant tool call as `<tool_call>` JSON in its message,
    and tool results as `<tool_response>` text in a user turn (with the results and any user message right
    after them, so user and assistant turns still alternate)."""
    prompt = GENERIC_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0]["role"] == "system":
        messages = [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    else:
        messages = [{"role": "system", "content": prompt}, *messages]
    out, joinable = [], False  # joinable: the last turn is a user turn that tool results opened
    for m in messages:
        result = m["role"] == "tool"
        if result:
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = [_tagged(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            m = {"role": "assistant", "content": "\n".join(([m["content"]] if m["content"] else []) + calls)}
        if joinable and m["role"] == "user":
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + m["content"]}
        else:
            out.append(m)
            joinable = result
    return out


def _tagged(name: str, arguments: dict) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{json_tools.tool_call_start}\n{call}\n{json_tools.tool_call_end}"


def forced_prefix(support: ToolSupport, name: str) -> str:
    """The text a forced call makes the reply start with: the start marker and, for a family whose call
    syntax is known here, the opening of a call to `name` ("": to a tool the model picks)."""
    if not support.start:
        raise APIError(400, "a tool call cannot be forced on this model: its chat template has no tool-call syntax "
                       "that mlx-lm reads; let the model choose (tool_choice auto)", param="tool_choice")
    family = getattr(support.parse, "__module__", "").rpartition(".")[2]
    if family not in CALL_OPENINGS:
        if name:
            raise APIError(400, f"a call to a named tool cannot be forced with this model's tool-call syntax "
                           f"({family or 'unknown'}): ask for any tool (OpenAI \"required\", Anthropic "
                           "{\"type\": \"any\"})", param="tool_choice")
        return support.start
    named, any_tool = CALL_OPENINGS[family]
    return support.start + (named(name) if name else any_tool)


def forced_tool(name: str, tools: Optional[list], param: str = "tool_choice") -> str:
    """GenerationRequest.force_tool once an API's tool_choice asked for a call ("": to any tool, else to the
    tool named): refused where the request has no tool to call, or not that one."""
    names = {t["function"]["name"] for t in tools or []}
    if not names:
        raise APIError(400, f"'{param}' asks for a tool call, but the request has no tools this server runs (function "
                       "tools, with their parameters or input_schema): send them in 'tools'", param=param)
    if name and name not in names:
        raise APIError(400, f"'{param}' names the tool {json.dumps(name)[:100]}, which is not among the request's "
                       "tools", param=param)
    return name


# How deep a call's arguments may nest. A reply's call must be strict JSON that every client parses (the agents'
# JavaScript and Rust parsers refuse NaN and Infinity) and that no parser here recurses too deep on: anything else
# a model writes is text, by this one rule in every API.
MAX_DEPTH = 64


def _reject(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _loads(text: str):
    """json.loads, strict: NaN and Infinity refused, and too deep a nesting a ValueError, not a RecursionError."""
    try:
        return json.loads(text, parse_constant=_reject)
    except RecursionError:
        raise ValueError("nested too deep") from None


def _strict(value) -> bool:
    """Whether a parsed value is strict JSON: finite numbers, nested at most MAX_DEPTH deep."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH or (isinstance(v, float) and not math.isfinite(v)):
            return False
        if isinstance(v, dict):
            stack += [(x, depth + 1) for x in v.values()]
        elif isinstance(v, list):
            stack += [(x, depth + 1) for x in v]
    return True


def _call(name, arguments, names: set, **extra) -> Optional[ToolCall]:
    """The one rule for a call a model wrote, in every form and API: a call to one of `names` whose arguments
    (an object, or a string holding one) are strict JSON (`_strict`); None: the reply is text."""
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict) or not _strict(arguments):
        return None
    return ToolCall(name, arguments, **extra)


def _as_call(value, names: set) -> Optional[ToolCall]:
    """A JSON value as a call to one of `names`: {"name", "arguments"|"parameters"}, maybe under "function"."""
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("function"), dict) and "name" not in value:
        value = value["function"]
    if set(value) - {"name", "arguments", "parameters", "id", "type"}:
        return None
    return _call(value.get("name"), value.get("arguments", value.get("parameters", {})), names)


def json_calls(text: str, names: set) -> Optional[list]:
    """The calls of a reply that is only JSON calls (bare, a list, or in code fences), else None."""
    text = text.strip()
    fenced = _FENCE.findall(text)
    if fenced and not _FENCE.sub("", text).strip():
        text = "\n".join(fenced)
    decoder, values, at = json.JSONDecoder(parse_constant=_reject), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        values += value if isinstance(value, list) else [value]
        while at < len(text) and text[at] in " \t\r\n,;":
            at += 1
    calls = [_as_call(v, names) for v in values]
    return calls if calls and all(calls) else None


def _could_be_json_call(text: str) -> bool:
    """Whether text that begins a reply may still turn out to be only JSON calls."""
    s = text.lstrip()
    if not s or s[0] in "{[":
        return True
    if not s.startswith("```"):
        return "```".startswith(s)
    first_line, newline, _ = s[3:].partition("\n")
    tag = first_line.strip().lower()
    return tag in ("", "json") if newline else "json".startswith(tag)


def _not_calls_already(text: str, names: set) -> bool:
    """Held text whose first JSON value (or fenced block) is complete and is not calls: it is text."""
    s = text.lstrip()
    if s.startswith("```"):
        block = _FENCE.match(s)
        return block is not None and json_calls(block.group(0), names) is None
    try:
        value, _ = json.JSONDecoder(parse_constant=_reject).raw_decode(s)
    except RecursionError:  # nested past what a parser takes: never a call
        return True
    except ValueError:  # not complete yet (or NaN: the end of the reply decides)
        return False
    values = value if isinstance(value, list) else [value]
    return not values or not all(_as_call(v, names) for v in values)


class ReplyParser:
    """Splits a streamed reply into text and tool calls. feed() and finish() return what may go out now:
    a list of ("text", str) and ("call", ToolCall). forced: the text the reply was made to start with
    (forced_prefix), read first."""

    def __init__(self, support: ToolSupport, tools: list, parallel: bool = True, forced: str = ""):
        self.support, self.tools, self.parallel = support, tools, parallel
        self.names = {t["function"]["name"] for t in tools}
        self.state = None  # mlx-lm's text state machine over the parser's markers, if it has them
        if support.start:
            edges = {"normal": [(support.start, "tool")], "tool": [(support.end, "normal")] if support.end else []}
            self.state = TextStateMachine(edges).make_state("normal")
        self.in_tool, self.tool_text = False, ""  # between the markers
        self.holding, self.held = True, ""  # the reply's first text, while it may be JSON calls
        self.calls = 0
        if forced:
            self.feed(forced)  # an open call: nothing goes out until the model has written the rest

    def feed(self, text: str) -> list:
        if self.state is None:
            return self._limit(self._normal(text))
        self.state, segments = TextStateMachine.split(self.state, text)
        out = []
        for state, piece in segments:
            if self.in_tool and state != "tool":
                out += self._tagged_end()
            self.in_tool = state == "tool"
            if self.in_tool:
                self.tool_text += piece
            else:
                out += self._normal(piece)
        return self._limit(out)

    def finish(self) -> list:
        out = []
        if self.state is not None:
            self.state, rest, _ = TextStateMachine.flush(self.state)
            if self.in_tool:
                self.tool_text += rest
                out += self._tagged_end(final=True)
            else:
                out += self._normal(rest)
        if self.holding and self.held:
            calls = json_calls(self.held, self.names)
            out += [("call", c) for c in calls] if calls else [("text", self.held)]
            self.held = ""
        return self._limit(out)

    def _normal(self, text: str) -> list:
        if not text:
            return []
        if self.holding:
            self.held += text
            if _could_be_json_call(self.held) and not _not_calls_already(self.held, self.names):
                return []
            self.holding, text, self.held = False, self.held, ""
        return [("text", text)]

    def _tagged_end(self, final: bool = False) -> list:
        """The text between the markers as calls; what the parser cannot read stays text, markers included."""
        text, self.tool_text, self.in_tool = self.tool_text, "", False
        try:
            parsed = self.support.parse(text, self.tools)
        except Exception as e:  # the parsers raise their own types; a truncated call is the usual cause
            log.info(f"a tool call could not be parsed ({type(e).__name__}); it is returned as text")
            parsed = None
        calls = [_parsed_call(p, self.names) for p in (parsed if isinstance(parsed, list) else [parsed])]
        if not calls or not all(calls):
            return self._normal(self.support.start + text + ("" if final else self.support.end or ""))
        out = [("text", self.held)] if self.holding and self.held.strip() else []  # text before the marker
        self.holding, self.held = False, ""
        return out + [("call", c) for c in calls]

    def _limit(self, pieces: list) -> list:
        """With parallel_tool_calls false, only the first call goes out."""
        out = []
        for kind, value in pieces:
            if kind == "call":
                if self.calls and not self.parallel:
                    continue
                self.calls += 1
            out.append((kind, value))
        return out


def _parsed_call(p, names: set) -> Optional[ToolCall]:
    """A call dict from an mlx-lm tool parser ({"name", "arguments", maybe "id"}) as a ToolCall (`_call`'s rule)."""
    if not isinstance(p, dict):
        return None
    extra = {"id": p["id"]} if isinstance(p.get("id"), str) else {}
    return _call(p.get("name"), p.get("arguments", {}), names, **extra)
