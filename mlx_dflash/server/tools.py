"""Tool calls in a model's reply: found as the reply streams, in the forms models write them.

The model's own syntax first: mlx-lm chooses a tool parser for the tokenizer (its `tool_parser_type`, or
one inferred from the chat template: json_tools for `<tool_call>` JSON, qwen3_coder, mistral, pythonic,
...), as `mlx_lm.server` does, and mlx-lm's `TextStateMachine` cuts the text between the parser's start
and end markers out of the reply. Small models do not always write their family's markers: asked with
tools, Qwen2.5-Coder-0.5B answers with a bare `{"name": ..., "arguments": {...}}` or a fenced json block.
A reply that is nothing but such JSON, calling tools of the request, is a tool call too (as Ollama and
LM Studio read it); any other reply stays text. So that such a reply is not streamed as text first, text
that could still become one (it starts with `{`, `[` or a code fence) is held back until it is decided.
"""

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

from mlx_lm.generate import TextStateMachine

log = logging.getLogger("mlx_dflash.server")
DUMMY_TOOL = {"type": "function", "function": {"name": "probe", "description": "probe", "parameters": {
    "type": "object", "properties": {}}}}
_FENCE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])


@dataclass
class ToolSupport:
    """What the tokenizer offers: whether its chat template renders tools, and its tool-call syntax."""

    renders_tools: bool
    start: Optional[str] = None  # the parser's markers and function (text, tools) -> call dict(s)
    end: Optional[str] = None
    parse: object = None


def tool_support(tokenizer) -> ToolSupport:
    """Read once per server: a template renders tools if a request with a tool renders differently."""
    renders = False
    if getattr(tokenizer, "chat_template", None) is not None:
        messages = [{"role": "user", "content": "x"}]
        try:
            plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            renders = plain != tokenizer.apply_chat_template(messages, tools=[DUMMY_TOOL], tokenize=False,
                                                            add_generation_prompt=True)
        except Exception:  # a template that refuses the probe: it does not take tools
            renders = False
    if not getattr(tokenizer, "has_tool_calling", False):
        return ToolSupport(renders)
    return ToolSupport(renders, tokenizer.tool_call_start, tokenizer.tool_call_end or None, tokenizer.tool_parser)


def _as_call(value, names: set) -> Optional[ToolCall]:
    """A JSON value as a call to one of `names`: {"name", "arguments"|"parameters"}, maybe under "function"."""
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("function"), dict) and "name" not in value:
        value = value["function"]
    name, arguments = value.get("name"), value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    other_keys = set(value) - {"name", "arguments", "parameters", "id", "type"}
    if name not in names or not isinstance(arguments, dict) or other_keys:
        return None
    return ToolCall(name, arguments)


def json_calls(text: str, names: set) -> Optional[list]:
    """The calls of a reply that is only JSON calls (bare, a list, or in code fences), else None."""
    text = text.strip()
    fenced = _FENCE.findall(text)
    if fenced and not _FENCE.sub("", text).strip():
        text = "\n".join(fenced)
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
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
        value, _ = json.JSONDecoder().raw_decode(s)
    except ValueError:
        return False
    values = value if isinstance(value, list) else [value]
    return not values or not all(_as_call(v, names) for v in values)


class ReplyParser:
    """Splits a streamed reply into text and tool calls. feed() and finish() return what may go out now:
    a list of ("text", str) and ("call", ToolCall)."""

    def __init__(self, support: ToolSupport, tools: list, parallel: bool = True):
        self.support, self.tools, self.parallel = support, tools, parallel
        self.names = {t["function"]["name"] for t in tools}
        self.state = None  # mlx-lm's text state machine over the parser's markers, if it has them
        if support.start:
            edges = {"normal": [(support.start, "tool")], "tool": [(support.end, "normal")] if support.end else []}
            self.state = TextStateMachine(edges).make_state("normal")
        self.in_tool, self.tool_text = False, ""  # between the markers
        self.holding, self.held = True, ""  # the reply's first text, while it may be JSON calls
        self.calls = 0

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
        calls = [_parsed_call(p) for p in (parsed if isinstance(parsed, list) else [parsed])]
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


def _parsed_call(p) -> Optional[ToolCall]:
    """A call dict from an mlx-lm tool parser ({"name", "arguments", maybe "id"}) as a ToolCall."""
    if not (isinstance(p, dict) and isinstance(p.get("name"), str)):
        return None
    arguments = p.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(p["name"], arguments, **({"id": p["id"]} if isinstance(p.get("id"), str) else {}))
