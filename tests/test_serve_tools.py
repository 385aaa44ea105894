"""Tool calling through `mlx-dflash serve`, with the official `openai` and `anthropic` clients.

Default tier: a tiny random target with SmolLM2's tokenizer and a Qwen2.5-style tools template
(serve_helpers.py), whose replies are forced, so that each form a model writes a call in (its family's
`<tool_call>` tags, bare JSON, fenced JSON) is checked through both APIs, streamed and not, and the tool
results sent back are seen rendered in the next prompt; SmolLM2's own template, which renders no tools,
with the tools in the generic form (forced replies, and the real decoder's greedy text); forced calls
(`tool_choice` any / required / a named tool) through both, their output the decoder's for the prompt and
the opening the server wrote. Slow tier: the real Qwen2.5-Coder-0.5B-Instruct with a random DFlash drafter
made for it, a full round trip, its answers equal to mlx-lm's greedy ones, and a forced call; the real
SmolLM2 default pair answering a request with tools.
"""

import json
import logging

import anthropic
import pytest
from mlx_lm.tool_parsers import json_tools

from serve_helpers import TOOLS_TEMPLATE, ScriptedEngine, templated_tokenizer, tools_tokenizer
from serving import MODEL, client, raw, running
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import WidthOptions
from mlx_dflash.generate import generate
from mlx_dflash.server.prompts import Prompts
from mlx_dflash.decoding.sampling import SamplingParams
from mlx_dflash.server.protocol import APIError, GenerationRequest
from mlx_dflash.server.tools import (GENERIC_TOOLS_PROMPT, ReplyParser, ToolSupport, forced_prefix,
                                     generic_tools_messages, json_calls, tool_support)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                          "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
                     "input_schema": WEATHER["function"]["parameters"]}
ANTHROPIC_CLOCK = {"name": "get_time", "description": "The time now.", "input_schema": CLOCK["function"]["parameters"]}


@pytest.fixture(scope="module")
def tools_pair(tiny_chat_pair, tmp_path_factory):
    from mlx_dflash.downloads import ensure_smollm2

    target, _, drafter = tiny_chat_pair
    return target, drafter, tools_tokenizer(ensure_smollm2("float32"), tmp_path_factory.mktemp("tools-tokenizer"))


@pytest.fixture(scope="module")
def scripted(tools_pair):
    with running(tools_pair, engine_class=ScriptedEngine) as (url, engine):
        yield url, engine


def anthropic_client(url, key="unused", timeout=60):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=timeout)


# The parser alone.

JSON_SUPPORT = ToolSupport(True, "<tool_call>", "</tool_call>", lambda text, tools: json.loads(text))


def parse_in_pieces(text, support=JSON_SUPPORT, tools=(WEATHER, CLOCK), step=2, parallel=True):
    """(pieces, what went out before the reply ended) with the reply fed `step` characters at a time."""
    parser = ReplyParser(support, list(tools), parallel)
    early = []
    for i in range(0, len(text), step):
        early += parser.feed(text[i:i + step])
    pieces = []
    for kind, value in early + parser.finish():  # adjacent text merged: how it was cut up does not matter
        if kind == "text" and pieces and pieces[-1][0] == "text":
            pieces[-1] = ("text", pieces[-1][1] + value)
        else:
            pieces.append((kind, value if kind == "text" else (value.name, value.arguments)))
    return pieces, early


@pytest.mark.parametrize("reply", [
    f"<tool_call>\n{CALL}\n</tool_call>", CALL, f"  {CALL}\n", f"```json\n{CALL}\n```", f"```\n{CALL}\n```",
    f"[{CALL}]", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '{"type": "function", "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}'])
def test_each_form_a_model_writes_a_call_in_is_a_call_and_nothing_leaks_as_text(reply):
    pieces, early = parse_in_pieces(reply)
    assert pieces == [("call", ("get_weather", {"city": "Paris"}))]
    assert not [p for p in early if p[0] == "text"]  # held back while it could still be a call


@pytest.mark.parametrize("reply", [
    "The weather is sunny.", '{"name": "delete_files", "arguments": {}}', '{"a": 1} is JSON.',
    '{"name": "get_weather", "arguments": {"city": "Paris"}, "note": "extra"}',
    f"Sure: {CALL}", "```python\nprint(1)\n```", f"```json\n{CALL}\n``` and then some", '{"name": "get_wea'])
def test_anything_else_stays_text_exactly(reply):
    pieces, _ = parse_in_pieces(reply)
    assert "".join(v for k, v in pieces if k == "text") == reply and all(k == "text" for k, _ in pieces)


def test_text_around_tagged_calls_several_calls_and_parallel_off():
    reply = f'Let me check.<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": {{}}}}\n</tool_call>'
    pieces, early = parse_in_pieces(reply, step=3)
    assert pieces == [("text", "Let me check."), ("call", ("get_weather", {"city": "Paris"})), ("text", "\n"),
                      ("call", ("get_time", {}))]
    assert early[0] == ("text", "Let")  # text before a call streams as it comes
    assert parse_in_pieces(reply, parallel=False)[0] == pieces[:3]
    truncated = f"<tool_call>\n{CALL[:20]}"  # cut by max_tokens: what the model wrote, markers included
    assert parse_in_pieces(truncated)[0] == [("text", truncated)]
    assert json_calls(f"{CALL}\n{CALL}", {"get_weather"}) is not None


def test_tool_support_is_read_from_the_tokenizer(tools_pair, tiny_chat_pair):
    support = tool_support(tools_pair[2])
    assert support.renders_tools and (support.start, support.end) == ("<tool_call>", "</tool_call>")
    assert support.parse(CALL, None) == json.loads(CALL)  # mlx-lm's json_tools parser, as mlx_lm.server picks it
    # SmolLM2's own template has no tools: the generic form's <tool_call> JSON, read by json_tools
    assert tool_support(tiny_chat_pair[1]) == ToolSupport(False, "<tool_call>", "</tool_call>",
                                                          json_tools.parse_tool_call)


# Through the server.

def test_openai_tool_round_trip_with_tagged_calls(scripted):
    url, engine = scripted
    c = client(url)
    engine.scripts += [f"<tool_call>\n{CALL}\n</tool_call>", "It is 18 degrees in Paris."]
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert '"name": "get_weather"' in engine.prompt_texts[-1] and "The current weather in a city." in engine.prompt_texts[-1]

    messages = ASK + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    r = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK])
    assert r.choices[0].message.content == "It is 18 degrees in Paris." and r.choices[0].finish_reason == "stop"
    prompt = engine.prompt_texts[-1]  # the call and its result, rendered back by the template
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temperature": 18}\n</tool_response>' in prompt


@pytest.mark.parametrize("reply", [f"Checking.<tool_call>\n{CALL}\n</tool_call>", CALL, f"```json\n{CALL}\n```"])
def test_openai_streamed_tool_calls(scripted, reply):
    url, engine = scripted
    engine.scripts.append(reply)
    chunks = list(client(url).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True,
                                                      max_tokens=8000))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
    assert text == ("Checking." if reply.startswith("Checking") else "")
    (call,) = deltas
    assert (call.index, call.type, call.function.name) == (0, "function", "get_weather") and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_reply_that_is_not_a_call_is_text_and_length_is_not_tool_calls(scripted):
    url, engine = scripted
    c = client(url)
    engine.scripts += ['{"name": "delete_files", "arguments": {}}', f"<tool_call>\n{CALL}\n</tool_call>"]
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    assert r.choices[0].message.content == '{"name": "delete_files", "arguments": {}}'
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=5)  # cut mid-call
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("<tool_call>")


def test_anthropic_tool_round_trip_streamed_and_not(scripted):
    url, engine = scripted
    c = anthropic_client(url)
    engine.scripts += [f"I will look.<tool_call>\n{CALL}\n</tool_call>", "Sunny, 18 degrees."]
    m = c.messages.create(model=MODEL, max_tokens=64, tools=[ANTHROPIC_WEATHER],
                          messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["text", "tool_use"]
    text, use = m.content
    assert text.text == "I will look." and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id.startswith("toolu_") and '"name": "get_weather"' in engine.prompt_texts[-1]
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": [b.model_dump() for b in m.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": [{"type": "text", "text": "sunny, 18 C"}]}]}]
    with c.messages.stream(model=MODEL, max_tokens=64, tools=[ANTHROPIC_WEATHER], messages=messages) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and final.content[0].text == "Sunny, 18 degrees."
    prompt = engine.prompt_texts[-1]
    assert "I will look.<tool_call>" in prompt and "<tool_response>\nsunny, 18 C\n</tool_response>" in prompt

    engine.scripts.append(f"```json\n{CALL}\n```")  # a fenced call, streamed
    with c.messages.stream(model=MODEL, max_tokens=64, tools=[ANTHROPIC_WEATHER],
                           messages=messages[:1]) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    assert final.content[0].input == {"city": "Paris"} and "text" not in events


# Forced calls: the reply starts with the opening of a call, which the model completes.

OPENING = '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments":'


def test_forced_prefixes():
    assert forced_prefix(JSON_SUPPORT, "") == "<tool_call>"  # a parser whose syntax is not known here: any tool
    with pytest.raises(APIError, match="named tool"):
        forced_prefix(JSON_SUPPORT, "get_weather")
    with pytest.raises(APIError, match="no tool-call syntax"):
        forced_prefix(ToolSupport(True), "")
    json_support = ToolSupport(True, "<tool_call>", "</tool_call>", json_tools.parse_tool_call)
    assert forced_prefix(json_support, 'say "hi"') == '<tool_call>\n{"name": "say \\"hi\\"", "arguments":'
    parser = ReplyParser(json_support, [WEATHER], forced=forced_prefix(json_support, "get_weather"))
    assert parser.feed(' {"city": "Paris"}}\n</tool_call>')[0][1].arguments == {"city": "Paris"}


def test_forced_calls_through_both_apis(scripted):
    url, engine = scripted
    c, ac = client(url), anthropic_client(url)
    named = ' {"city": "Paris"}}\n</tool_call>'  # the model's part: after the opening the server wrote
    engine.scripts += [named, named]
    m = ac.messages.create(model=MODEL, max_tokens=64, tools=[ANTHROPIC_WEATHER, ANTHROPIC_CLOCK], messages=ASK,
                           tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in m.content] == [
        ("tool_use", "get_weather", {"city": "Paris"})]
    assert engine.prompt_texts[-1].endswith(OPENING)
    with ac.messages.stream(model=MODEL, max_tokens=64, tools=[ANTHROPIC_WEATHER], messages=ASK,
                            tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.input) for b in final.content] == [("tool_use", {"city": "Paris"})]

    engine.scripts += ['get_time", "arguments": {}}\n</tool_call>'] * 2  # any tool: the model names it
    m = ac.messages.create(model=MODEL, max_tokens=64, tools=[ANTHROPIC_WEATHER, ANTHROPIC_CLOCK], messages=ASK,
                           tool_choice={"type": "any"})
    assert [(b.type, b.name) for b in m.content] == [("tool_use", "get_time")]
    assert engine.prompt_texts[-1].endswith('<|im_start|>assistant\n<tool_call>\n{"name": "')
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == "get_time"

    engine.scripts += [named, named]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert engine.prompt_texts[-1].endswith(OPENING) and r.choices[0].message.content is None
    chunks = list(c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                            stream=True))
    (delta,) = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
    assert delta.function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"

    engine.scripts.append("fine")  # tool_choice none: no tools in the prompt, text back
    m = ac.messages.create(model=MODEL, max_tokens=8, tools=[ANTHROPIC_WEATHER], messages=ASK,
                           tool_choice={"type": "none"})
    assert m.content[0].text == "fine" and '"get_weather"' not in engine.prompt_texts[-1]


def test_count_tokens_leaves_out_a_forced_calls_opening(scripted):
    """The opening is the reply's start, written by the server: a forced call counts as the same prompt."""
    ac = anthropic_client(scripted[0])
    choices = ({"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"})
    counts = [ac.messages.count_tokens(model=MODEL, messages=ASK, tools=[ANTHROPIC_WEATHER], tool_choice=choice)
              .input_tokens for choice in choices]
    assert counts[0] == counts[1] == counts[2], counts


@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_forced_call_is_the_decoders_greedy_continuation_of_the_opening(tools_pair, max_batch):
    """On the tiny random target the completion is no valid call: it comes back as text, the opening the
    server wrote included, equal to the decoder's output for the prompt and the opening."""
    target, drafter, tokenizer = tools_pair
    opening = forced_prefix(tool_support(tokenizer), "get_weather")
    batch = dict(engine_options=dict(max_batch=max_batch), policy=build_policy(target, drafter, WidthOptions(4),
                                                                              max_batch))

    def decoded(tools):
        text = tokenizer.apply_chat_template(ASK, tools=tools, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text + opening, add_special_tokens=False)
        return opening + generate(target, drafter, tokenizer, ids, max_tokens=12, width=4)

    function = {"name": "get_weather", "parameters": ANTHROPIC_WEATHER["input_schema"],
                "description": ANTHROPIC_WEATHER["description"]}  # the Anthropic tool, in the order it is rendered
    with running(tools_pair, **batch) as (url, _):
        m = anthropic_client(url).messages.create(model=MODEL, max_tokens=12, tools=[ANTHROPIC_WEATHER],
                                                  messages=ASK, tool_choice={"type": "tool", "name": "get_weather"})
        r = client(url).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=12,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert m.content[0].text == decoded([{"type": "function", "function": function}])
    assert r.choices[0].message.content == decoded([WEATHER])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 12


class WordStartTokenizer:
    """A tokenizer over another that starts every encoding with a word-start token, as a SentencePiece one
    does (its "▁"), its chat template tokenizing as transformers' does: the text, no special tokens added."""

    WORD_START = 0

    def __init__(self, tokenizer):
        self.tokenizer, self.chat_template = tokenizer, tokenizer.chat_template

    def encode(self, text, add_special_tokens=True):
        return [self.WORD_START] + self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages, tokenize=True, **options):
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, **options)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def forced_prompt_ids(tokenizer, support, force_tool):
    """Prompts.prompt_ids for ASK with the weather tool, a call forced (force_tool), on `tokenizer`."""
    req = GenerationRequest(kind="chat", model=MODEL, prompt=ASK, max_tokens=8, sampling=SamplingParams(),
                            tools=[WEATHER], force_tool=force_tool)
    return Prompts(tokenizer, None, support).prompt_ids(req)  # its tokenizing alone: no model, no engine


def test_a_forced_opening_is_tokenized_with_the_prompt_text(tools_pair):
    """The opening is encoded together with the rendered prompt, not on its own (which would add a word-start
    token before it); without a forced call the ids are the template's, which are its text's."""
    tokenizer = tools_pair[2]
    support = tool_support(tokenizer)
    for tok in (tokenizer, WordStartTokenizer(tokenizer)):
        text = tok.apply_chat_template(ASK, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
        for name in ("get_weather", ""):
            want = tok.encode(text + forced_prefix(support, name), add_special_tokens=False)
            assert forced_prompt_ids(tok, support, name) == want
        assert forced_prompt_ids(tok, support, None) == tok.encode(text, add_special_tokens=False)
    assert forced_prompt_ids(WordStartTokenizer(tokenizer), support, "").count(WordStartTokenizer.WORD_START) == 1


def test_a_call_cannot_be_forced_without_a_tool_call_syntax(tiny_chat_pair, tmp_path):
    from mlx_dflash.downloads import ensure_smollm2

    target, _, drafter = tiny_chat_pair
    template = TOOLS_TEMPLATE.replace("tool_call", "invoke")  # renders tools; mlx-lm infers no parser for it
    tokenizer = templated_tokenizer(ensure_smollm2("float32"), tmp_path, template)
    assert tool_support(tokenizer) == ToolSupport(True)
    with running((target, drafter, tokenizer), engine_class=ScriptedEngine) as (url, engine):
        status, _, answer = raw(url, "/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": ASK,
                                                      "tools": [ANTHROPIC_WEATHER], "tool_choice": {"type": "any"}})
        assert status == 400 and "cannot be forced" in answer["error"]["message"], answer
        status, _, answer = raw(url, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "tools": [WEATHER],
                                                              "tool_choice": "required"})
        assert (status, answer["error"]["param"]) == (400, "tool_choice") and engine.prompt_texts == []


def test_tools_the_server_cannot_honour_are_a_400_naming_the_field(scripted, tiny_chat_pair):
    url, _ = scripted
    good = {"model": MODEL, "messages": ASK, "tools": [WEATHER]}
    for extra, param in [({"tool_choice": "whichever"}, "tool_choice"),
                         ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"tools": [{"type": "function"}]}, "tools[0]"), ({"tools": "x"}, "tools"),
                         ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"function": {
                             "name": "get_weather", "arguments": "{not json"}}]}]},
                          "messages[1].tool_calls[0].function.arguments"),
                         ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"logit_bias": {"5": 1}}, "logit_bias"),
                         ({"functions": [WEATHER["function"]]}, "functions")]:
        status, _, answer = raw(url, "/v1/chat/completions", {**good, **extra})
        assert (status, answer["error"]["param"]) == (400, param), answer
    assert raw(url, "/v1/completions", {"model": MODEL, "prompt": "x", "tools": [WEATHER]})[0] == 400
    prefill = ASK + [{"role": "assistant", "content": "It is"}]
    for choice, tools, messages in [({"type": "tool", "name": "get_time"}, [ANTHROPIC_WEATHER], ASK),
                                    ({"type": "tool"}, [ANTHROPIC_WEATHER], ASK),
                                    ({"type": "required"}, [ANTHROPIC_WEATHER], ASK), ({"type": "any"}, None, ASK),
                                    ({"type": "any"}, [ANTHROPIC_WEATHER], prefill)]:
        status, _, answer = raw(url, "/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": messages,
                                                      "tool_choice": choice, "tools": tools})
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
        assert "tool_choice" in answer["error"]["message"]
    status, _, answer = raw(url, "/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": ASK,
                                                  "tool_choice": {"type": "any"},
                                                  "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
    assert status == 400 and "input_schema" in answer["error"]["message"]  # the server tool is left out
    neutral = {**good, "frequency_penalty": 0, "presence_penalty": 0, "response_format": {"type": "text"},
               "tool_choice": "auto", "parallel_tool_calls": True, "logit_bias": {}, "user": "u1"}
    _, engine = scripted
    engine.scripts.append("fine")
    assert raw(url, "/v1/chat/completions", neutral)[2]["choices"][0]["message"]["content"] == "fine"

    target, tokenizer, drafter = tiny_chat_pair
    with running((target, drafter, tokenizer), generic_tools=False) as (plain_url, _):  # no generic form
        status, _, answer = raw(plain_url, "/v1/chat/completions", good)
        assert (status, answer["error"]["param"]) == (400, "tools") and "does not render tools" in answer["error"]["message"]
        assert "--no-generic-tools" in answer["error"]["message"]
        status, _, answer = raw(plain_url, "/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": ASK,
                                                            "tools": [ANTHROPIC_WEATHER]})
        assert status == 400 and "does not render tools" in answer["error"]["message"]


# Tools on a template that renders none (SmolLM2's own): the generic form.

@pytest.fixture(scope="module")
def generic(tiny_chat_pair):
    target, tokenizer, drafter = tiny_chat_pair
    with running((target, drafter, tokenizer), engine_class=ScriptedEngine) as (url, engine):
        yield url, engine


def test_generic_messages_put_the_tools_in_the_system_prompt_and_turns_in_the_tagged_form():
    schemas = "\n".join(json.dumps(t) for t in (WEATHER, CLOCK))
    added = generic_tools_messages(ASK, [WEATHER, CLOCK])
    assert added == [{"role": "system", "content": GENERIC_TOOLS_PROMPT.format(tools=schemas)}, *ASK]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in added[0]["content"]
    conversation = [{"role": "system", "content": "Be brief."}, *ASK,
                    {"role": "assistant", "content": "Looking.", "tool_calls": [
                        {"id": "1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": {"city": "Paris"}}},
                        {"id": "2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
                    {"role": "tool", "tool_call_id": "1", "content": "sunny"},
                    {"role": "tool", "tool_call_id": "2", "content": "noon"},
                    {"role": "user", "content": "And tomorrow?"}]
    system, ask, call, results = generic_tools_messages(conversation, [WEATHER])
    assert system["content"].startswith("Be brief.\n\n# Tools\n") and ask == ASK[0]
    assert call == {"role": "assistant", "content": f'Looking.\n<tool_call>\n{CALL}\n</tool_call>\n'
                                                    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'}
    assert results == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>\n"
                                                  "<tool_response>\nnoon\n</tool_response>\nAnd tomorrow?"}


def test_generic_tools_round_trip_through_both_clients(generic):
    url, engine = generic
    c = client(url)
    engine.scripts += [f"<tool_call>\n{CALL}\n</tool_call>", "It is 18 degrees in Paris."]
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    prompt = engine.prompt_texts[-1]
    assert json.dumps(WEATHER) in prompt and "within <tool_call></tool_call> XML tags" in prompt
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None

    messages = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    r = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert r.choices[0].message.content == "It is 18 degrees in Paris."
    prompt = engine.prompt_texts[-1]  # the call in the assistant turn, its result in a user turn
    assert f"<|im_start|>assistant\n<tool_call>\n{CALL}\n</tool_call><|im_end|>" in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 18}\n</tool_response><|im_end|>' in prompt

    engine.scripts.append(f"I will look.<tool_call>\n{CALL}\n</tool_call>")
    with anthropic_client(url).messages.stream(model=MODEL, max_tokens=64, tools=[ANTHROPIC_WEATHER],
                                               system="Be brief.", messages=ASK) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"}
    assert engine.prompt_texts[-1].startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")


def test_generic_tools_are_announced_once_at_start_up(tiny_chat_pair, caplog):
    target, tokenizer, drafter = tiny_chat_pair
    caplog.set_level(logging.INFO, logger="mlx_dflash.server")
    for generic_tools in (True, False):
        with running((target, drafter, tokenizer), generic_tools=generic_tools):
            pass
    (line,) = [r.message for r in caplog.records if "generic" in r.message]
    assert "does not render tools" in line and "--no-generic-tools" in line


def test_generic_tools_greedy_text_equals_the_decoder(tiny_chat_pair):
    target, tokenizer, drafter = tiny_chat_pair
    ids = tokenizer.apply_chat_template(generic_tools_messages(ASK, [WEATHER]), add_generation_prompt=True)
    want = generate(target, drafter, tokenizer, ids, max_tokens=16)
    with running((target, drafter, tokenizer)) as (url, _):
        c = client(url)
        r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=16)
        assert r.choices[0].message.content == want and r.choices[0].message.tool_calls is None
        assert r.usage.prompt_tokens == len(ids) and r.choices[0].finish_reason == "length"
        chunks = list(c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=16,
                                                stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want


@pytest.mark.slow
def test_real_smollm2_pair_answers_a_request_with_tools(smollm2, random_drafter):
    """The default pair's target: SmolLM2's template renders no tools, so they go in the generic form; what
    it answers is text equal to the decoder's, or calls read from its <tool_call> JSON."""
    target, tokenizer = smollm2
    random_drafter.bind(target)  # the session's target may listen to another test's drafter's layers
    ids = tokenizer.apply_chat_template(generic_tools_messages(ASK, [WEATHER]), add_generation_prompt=True)
    want = generate(target, random_drafter, tokenizer, ids, max_tokens=48)
    with running((target, random_drafter, tokenizer)) as (url, _):
        status, _, answer = raw(url, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "tools": [WEATHER],
                                                              "max_tokens": 48})
    assert status == 200 and answer["usage"]["prompt_tokens"] == len(ids), answer
    message = answer["choices"][0]["message"]
    if message.get("tool_calls"):
        assert want.strip().startswith("<tool_call>") and message["tool_calls"][0]["function"]["name"] == "get_weather"
    else:
        assert message["content"] == want


# The real Qwen2.5-Coder-0.5B-Instruct (its own tools template, mlx-lm's json_tools parser).

@pytest.fixture(scope="module")
def qwen_pair():
    from mlx_lm import load

    from mlx_dflash.downloads import ensure_qwen25_coder_05b
    from mlx_dflash.models.loader import drafter_config_for, init_drafter
    from mlx_dflash.models.target import Target

    model, tokenizer = load(str(ensure_qwen25_coder_05b("float32")))
    target = Target(model)
    config = drafter_config_for(target, num_layers=1, block_size=8, num_target_features=2)
    return target, init_drafter(config, seed=0).bind(target), tokenizer


@pytest.mark.slow
def test_qwen_coder_tool_round_trip_equals_mlx_lm_greedy(qwen_pair):
    """A weather question with a weather tool: Qwen2.5-Coder-0.5B answers with a bare JSON call (no
    `<tool_call>` tags), which is parsed as a call; the result sent back, its next reply is text. Each reply
    is mlx-lm's own greedy continuation of the prompt the template made: the drafter is random, and the
    output is lossless whatever it drafts."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    target, _, tokenizer = qwen_pair

    def greedy(messages, tools, n=48):
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        tokens = []
        for token, _ in generate_step(mx.array(ids), target.model, max_tokens=n):
            if int(token) in tokenizer.eos_token_ids:
                break
            tokens.append(int(token))
        return tokenizer.decode(tokens)

    with running(qwen_pair) as (url, _):
        c = client(url, timeout=900)
        r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=48)
        want = greedy(ASK, [WEATHER])
        (call,) = r.choices[0].message.tool_calls
        assert json_calls(want, {"get_weather"})[0].arguments == json.loads(call.function.arguments), want
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None

        result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18, "sky": "sunny"}'}
        messages = ASK + [r.choices[0].message.model_dump(exclude_none=True), result]
        r = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=48)
        rendered = ASK + [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]}, result]
        answer = greedy(rendered, [WEATHER])
        assert r.choices[0].message.content == answer and r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "stop"

        m = anthropic_client(url, timeout=900).messages.create(model=MODEL, max_tokens=48,
                                                               tools=[ANTHROPIC_WEATHER], messages=ASK)
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
        assert (m.content[0].name, m.content[0].input) == ("get_weather", {"city": "Paris"})


@pytest.mark.slow
def test_qwen_coder_forced_call_is_mlx_lm_greedy_after_the_opening(qwen_pair):
    """Asked about the weather with tool_choice naming the clock, Qwen2.5-Coder-0.5B completes the opening
    the server wrote into a call to the clock; its arguments are mlx-lm's greedy continuation of the prompt
    and the opening."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    target, _, tokenizer = qwen_pair
    opening = forced_prefix(tool_support(tokenizer), "get_time")
    text = tokenizer.apply_chat_template(ASK, tools=[WEATHER, CLOCK], tokenize=False, add_generation_prompt=True)
    assert tokenizer.encode(text, add_special_tokens=False) == tokenizer.apply_chat_template(
        ASK, tools=[WEATHER, CLOCK], add_generation_prompt=True)  # the text's ids are the template's
    ids = tokenizer.encode(text + opening, add_special_tokens=False)
    tokens = []
    for token, _ in generate_step(mx.array(ids), target.model, max_tokens=48):
        if int(token) in tokenizer.eos_token_ids:
            break
        tokens.append(int(token))
    reply = opening + tokenizer.decode(tokens)  # the whole call, as the parser reads it
    want = json_tools.parse_tool_call(reply.removeprefix("<tool_call>").split("</tool_call>")[0])
    with running(qwen_pair) as (url, _):
        r = client(url, timeout=900).chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], max_tokens=48,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", want["arguments"])
    assert r.choices[0].finish_reason == "tool_calls"


DEEP = "[" * 3000 + "]" * 3000


@pytest.mark.parametrize("reply", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": NaN}}\n</tool_call>',
    '{"name": "get_weather", "arguments": {"city": Infinity}}',
    '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": -Infinity}"}\n</tool_call>',
    '<tool_call>\n{"name": "rm_rf", "arguments": {"path": "/"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": ' + DEEP + '}}\n</tool_call>',
    '{"name": "get_weather", "arguments": {"city": ' + DEEP + '}}', DEEP])
def test_a_call_that_is_not_strict_json_or_names_a_tool_not_offered_is_text(reply):
    """NaN, Infinity and nesting past MAX_DEPTH (JavaScript and Rust parsers refuse the first two; the third
    recursed past Python's limit) and a tool the request did not offer: text, in the tagged and the bare form."""
    pieces, _ = parse_in_pieces(reply, step=97)
    assert pieces == [("text", reply)]


def test_a_reply_with_nan_arguments_is_text_through_both_apis_never_a_500(scripted):
    url, engine = scripted
    nan = '<tool_call>\n{"name": "get_weather", "arguments": {"city": NaN}}\n</tool_call>'
    engine.scripts += [nan, nan, "<tool_call>" + DEEP]
    r = client(url).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == nan
    m = anthropic_client(url).messages.create(model=MODEL, max_tokens=64, tools=[ANTHROPIC_WEATHER],
                                              messages=[{"role": "user", "content": "What is the weather?"}])
    assert m.stop_reason == "end_turn" and [b.type for b in m.content] == ["text"] and m.content[0].text == nan
    chunks = list(client(url).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True,
                                                      max_tokens=8000))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "<tool_call>" + DEEP and chunks[-1].choices[0].finish_reason == "stop"


def test_a_malformed_tool_or_tool_call_is_named_with_the_shape_it_must_have():
    """The 400's message shows the expected object with balanced braces (an extra "}" was once printed)."""
    from mlx_dflash.server.protocol import _tool_calls, parse_tools

    for refuse in (lambda: parse_tools([{"type": "function"}], None), lambda: _tool_calls([{"id": 1}], "tool_calls")):
        with pytest.raises(APIError) as e:
            refuse()
        message = e.value.message
        shape = message[message.index("{"):]
        assert shape.count("{") == shape.count("}") and shape.endswith("}"), message


def test_a_call_whose_name_is_not_a_string_is_text():
    reply = '{"name": ["get_weather"], "arguments": {}}'
    assert parse_in_pieces(reply)[0] == [("text", reply)]
