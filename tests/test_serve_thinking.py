"""A thinking model's reasoning through `mlx-dflash serve`, with the official `openai` and `anthropic` clients
(chat, Responses and Messages).

A tiny random target with SmolLM2's tokenizer, two of its special tokens renamed `<think>` and `</think>`
and a Qwen3-style template whose generation prompt opens the thinking section (serve_helpers.py): forced
replies check how the reasoning goes out in each API, streamed and not; the real decoder checks that the
reasoning and the answer, with the markers between them, are its greedy output, and that turning thinking
off changes the prompt.
"""

import asyncio
import json

import anthropic
import pytest

from serve_helpers import ScriptedEngine, thinking_tokenizer
from serving import MODEL, client, raw, running
from mlx_dflash.generate import generate
from mlx_dflash.decoding.responses import GenerationStats
from mlx_dflash.decoding.sampling import SamplingParams
from mlx_dflash.server import anthropic as anthropic_api
from mlx_dflash.server.protocol import GenerationRequest, Outcome, openai_stream
from mlx_dflash.server.thinking import ReasoningSplitter, reasoning_splitter

ASK = [{"role": "user", "content": "Say hello."}]
REPLY = "The user greets me; I greet back.</think>\n\nHello!"  # after the prompt's <think>
REASONING, ANSWER = "The user greets me; I greet back.", "\n\nHello!"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def thinking_pair(tiny_chat_pair, tmp_path_factory):
    from mlx_dflash.downloads import ensure_smollm2

    target, _, drafter = tiny_chat_pair
    return target, drafter, thinking_tokenizer(ensure_smollm2("float32"), tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def scripted(thinking_pair):
    with running(thinking_pair, engine_class=ScriptedEngine) as (url, engine):
        yield url, engine


def anthropic_client(url):
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)


def split_in_pieces(text, opened, step=2, splitter=None):
    """(reasoning, text) of `text` fed `step` characters at a time (to `splitter`, or one for Qwen3's markers)."""
    splitter, pieces = splitter or ReasoningSplitter("<think>", "</think>", opened), []
    for i in range(0, len(text), step):
        pieces += splitter.feed(text[i:i + step])
    pieces += splitter.finish()
    return tuple("".join(t for k, t in pieces if k == kind) for kind in ("reasoning", "text"))


def test_the_splitter_cuts_reasoning_out_where_the_markers_are_and_keeps_a_cut_marker():
    assert split_in_pieces("<think>a plan</think>The answer.", opened=False) == ("a plan", "The answer.")
    assert split_in_pieces(REPLY, opened=True) == (REASONING, ANSWER)
    assert split_in_pieces("No thoughts.", opened=False) == ("", "No thoughts.")
    assert split_in_pieces("cut by max_tokens </thi", opened=True) == ("cut by max_tokens </thi", "")


def test_the_section_is_open_when_the_prompt_opened_it(thinking_pair, tiny_chat_pair):
    tokenizer = thinking_pair[2]
    opened = tokenizer.apply_chat_template(ASK, add_generation_prompt=True)
    closed = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, enable_thinking=False)
    assert tokenizer.decode(opened).endswith("<think>\n") and tokenizer.decode(closed).endswith("</think>\n\n")
    assert split_in_pieces(REPLY, None, splitter=reasoning_splitter(tokenizer, opened)) == (REASONING, ANSWER)
    assert split_in_pieces(ANSWER, None, splitter=reasoning_splitter(tokenizer, closed)) == ("", ANSWER)
    assert reasoning_splitter(tiny_chat_pair[1], opened) is None  # SmolLM2's own tokenizer has no thinking


def test_openai_reasoning_content_streamed_and_not(scripted):
    url, engine = scripted
    c = client(url)
    engine.scripts += [REPLY, REPLY]
    message = c.chat.completions.create(model=MODEL, messages=ASK).choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == (ANSWER, REASONING)
    chunks = list(c.chat.completions.create(model=MODEL, messages=ASK, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks]
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == REASONING
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_anthropic_thinking_blocks_streamed_and_not(scripted):
    url, engine = scripted
    c = anthropic_client(url)
    engine.scripts += [REPLY, REPLY]
    m = c.messages.create(model=MODEL, max_tokens=64, messages=ASK)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.stop_reason == "end_turn"
    assert (m.content[0].thinking, m.content[0].signature, m.content[1].text) == (REASONING, "", ANSWER)
    with c.messages.stream(model=MODEL, max_tokens=64, messages=ASK) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and deltas.index("signature_delta") == deltas.index("text_delta") - 1
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[0].signature, final.content[1].text) == (REASONING, "", ANSWER)
    # A reply that is all reasoning is a thinking block alone, streamed or not (before, whole: and an empty text).
    engine.scripts += [REASONING + "</think>"] * 2
    assert [b.type for b in c.messages.create(model=MODEL, max_tokens=64, messages=ASK).content] == ["thinking"]
    with c.messages.stream(model=MODEL, max_tokens=64, messages=ASK) as stream:
        assert [b.type for b in stream.get_final_message().content] == ["thinking"]
    # An earlier turn's thinking goes back as clients send it, and is dropped (the template has no place for it).
    engine.scripts.append("Fine.")
    c.messages.create(model=MODEL, max_tokens=64, messages=ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in final.content]}, {"role": "user", "content": "And?"}])
    assert REASONING not in engine.prompt_texts[-1]


def test_responses_reasoning_item_streamed_and_not(scripted):
    url, engine = scripted
    c = client(url)
    engine.scripts += [REPLY, REPLY]
    r = c.responses.create(model=MODEL, input="Say hello.")
    assert [item.type for item in r.output] == ["reasoning", "message"] and r.output_text == ANSWER
    assert r.output[0].content[0].text == REASONING
    with c.responses.stream(model=MODEL, input="Say hello.") as stream:
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
    assert final.output[0].content[0].text == REASONING


def test_reasoning_then_a_call_on_generic_tools(scripted):
    url, engine = scripted
    engine.scripts.append('The weather needs a tool.</think>\n\n<tool_call>\n'
                          '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    r = client(url).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == "The weather needs a tool."
    assert message.tool_calls[0].function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"


def test_reasoning_and_answer_are_the_decoders_greedy_output_and_thinking_off_changes_the_prompt(thinking_pair):
    target, drafter, tokenizer = thinking_pair
    on = tokenizer.apply_chat_template(ASK, add_generation_prompt=True)
    off = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, enable_thinking=False)
    want_on, want_off = (generate(target, drafter, tokenizer, ids, max_tokens=16) for ids in (on, off))
    with running(thinking_pair) as (url, _):
        c = client(url)
        r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16)
        reasoning, content = r.choices[0].message.model_extra["reasoning_content"], r.choices[0].message.content
        closed = "</think>" in want_on  # the reply began inside the section the prompt opened
        assert reasoning and reasoning + ("</think>" if closed else "") + content == want_on
        assert r.usage.prompt_tokens == len(on)
        for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
            r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, extra_body=extra)
            assert r.choices[0].message.content == want_off and r.usage.prompt_tokens == len(off) != len(on)
            assert "reasoning_content" not in r.choices[0].message.model_extra
        r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, reasoning_effort="high")
        assert r.usage.prompt_tokens == len(on)

        a = anthropic_client(url)
        m = a.messages.create(model=MODEL, max_tokens=16, messages=ASK, thinking={"type": "disabled"})
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == want_off
        m = a.messages.create(model=MODEL, max_tokens=16, messages=ASK,
                              thinking={"type": "enabled", "budget_tokens": 1024})
        assert m.content[0].type == "thinking" and m.content[0].thinking == reasoning
        counts = [a.messages.count_tokens(model=MODEL, messages=ASK, thinking=t).input_tokens
                  for t in ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024})]
        assert counts == [len(off), len(on)]


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": "no"}},
     "chat_template_kwargs.enable_thinking"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"tools_in_user_message": True}},
     "chat_template_kwargs.tools_in_user_message"),
    ("/v1/chat/completions", {"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"reasoning_effort": "max"}, "reasoning_effort"),
    ("/v1/messages", {"thinking": {"type": "sometimes"}}, "thinking"),
])
def test_bad_thinking_fields_are_a_400_naming_the_field(scripted, path, extra, param):
    url, _ = scripted
    status, _, answer = raw(url, path, {"model": MODEL, "max_tokens": 8, "messages": ASK, **extra})
    message = answer["error"]["message"]
    assert status == 400 and (answer["error"].get("param") == param or param in message), answer


def test_no_renderer_stops_at_a_kind_it_does_not_know():
    async def events():
        for event in [("mystery", object()), ("text", "hi"), ("reasoning", "hm"),
                      ("done", Outcome("stop", 3, 2, GenerationStats()))]:
            yield event

    async def rendered(stream):
        return "".join([chunk async for chunk in stream])

    req = GenerationRequest(kind="chat", model=MODEL, prompt=ASK, max_tokens=8, sampling=SamplingParams())
    openai_text = asyncio.run(rendered(openai_stream(req, 3, events())))
    anthropic_text = asyncio.run(rendered(anthropic_api.message_stream(req, 3, events())))
    assert openai_text.endswith("data: [DONE]\n\n") and '"reasoning_content": "hm"' in openai_text
    assert anthropic_text.endswith("event: message_stop\ndata: {\"type\": \"message_stop\"}\n\n")
    assert json.dumps({"type": "thinking_delta", "thinking": "hm"}) in anthropic_text
