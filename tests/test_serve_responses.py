"""OpenAI's Responses API of `mlx-dflash serve`, through the official `openai` client, openai-agents and raw HTTP.

On a tiny random pair with SmolLM2's tokenizer: text equal to the decoder's for the same chat (instructions and
input items included), the `response.*` event sequence with its pings, every event and response checked
against the `openai` package's types. On the scripted engine with a tools template (serve_helpers.py):
function and freeform tools round trips, tools that run on OpenAI's servers left out, a body shaped as
Codex CLI sends it, previous_response_id, and an openai-agents agent with a function tool.
"""

import json
import logging
import threading

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from serve_helpers import ScriptedEngine, pair_with_context, tools_tokenizer
from serving import MODEL, client, raw, running, sse_events
from mlx_dflash.generate import generate
from mlx_dflash.server.openai_responses import KeptBytes, ResponseStore, parse_responses
from mlx_dflash.server.protocol import APIError, Defaults

SYSTEM = "You answer briefly."
QUESTION = "Tell me about the sea."
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": True}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edits files with a patch.",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def pair(tiny_chat_pair):
    return pair_with_context(tiny_chat_pair[1], 2048)


@pytest.fixture(scope="module")
def served(pair):
    # one at a time: a request waits (pinged) while another runs
    with running(pair, ping_seconds=0.3, engine_options=dict(max_batch=1)) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def scripted(tiny_chat_pair, tmp_path_factory):
    from mlx_dflash.downloads import ensure_smollm2

    target, _, drafter = tiny_chat_pair
    tokenizer = tools_tokenizer(ensure_smollm2("float32"), tmp_path_factory.mktemp("tools-tokenizer"))
    with running((target, drafter, tokenizer), engine_class=ScriptedEngine) as (url, engine):
        yield url, engine


def decoded(pair, messages, max_tokens):
    target, drafter, tokenizer = pair
    return generate(target, drafter, tokenizer, tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                    max_tokens=max_tokens)


def streamed(url, body, headers=None):
    """The events of a streamed POST /v1/responses, each checked against the openai package's event types
    (named as its type, numbered in order); pings as (":", "ping")."""
    events = sse_events(url, "/v1/responses", {**body, "stream": True}, headers)
    data = [d for n, d in events if n != ":"]
    assert all(n == d["type"] for n, d in events if n != ":")
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    for d in data:
        STREAM_EVENT.validate_python(d)
    Response.model_validate(data[-1]["response"])
    return events


def test_text_equals_the_decoder_streamed_or_not(pair, served):
    url, _ = served
    c = client(url)
    want = decoded(pair, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], 12)
    r = c.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=12)
    assert r.output_text == want and r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert message.id.startswith("msg_") and [p.type for p in message.content] == ["output_text"]
    prompt_tokens = want.stats.prompt_tokens
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (prompt_tokens, 12, prompt_tokens + 12)
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    report = r.model_extra["dflash"]  # verify rounds and plain steps together: D-cut's clock splits them
    assert report["rounds"] + report["plain_steps"] == want.stats.rounds + want.stats.plain_steps
    assert (r.instructions, r.max_output_tokens, r.tools, r.tool_choice, r.parallel_tool_calls) == (
        SYSTEM, 12, [], "auto", True)

    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": SYSTEM}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Tell me about"},
                                          {"type": "input_text", "text": "the sea."}]}]  # parts: blank line between
    status, _, body = raw(url, "/v1/responses", {"model": MODEL, "input": items, "max_output_tokens": 6,
                                                 "store": False, "truncation": "disabled", "metadata": {"k": "v"}})
    assert status == 200 and Response.model_validate(body).output_text == decoded(
        pair, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about\n\nthe sea."}], 6)
    assert "output_text" not in body and body["store"] is False and body["metadata"] == {"k": "v"}

    with c.responses.stream(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=12) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert [e.type for e in events][:4] == ["response.created", "response.in_progress", "response.output_item.added",
                                           "response.content_part.added"]
    assert [e.type for e in events][-4:] == ["response.output_text.done", "response.content_part.done",
                                            "response.output_item.done", "response.incomplete"]
    final = events[-1].response
    assert final.output_text == want and final.usage.output_tokens == 12 and final.status == "incomplete"
    chunks = list(c.responses.create(model=MODEL, input=QUESTION, instructions=SYSTEM, max_output_tokens=12,
                                     stream=True))
    assert "".join(e.delta for e in chunks if e.type == "response.output_text.delta") == want


def test_stream_is_pinged_while_queued(pair, served):
    url, engine = served
    long = threading.Thread(target=lambda: client(url).responses.create(model=MODEL, input=QUESTION,
                                                                        max_output_tokens=150))
    long.start()  # keeps the engine busy: the stream below waits in the queue, pinged every 0.3 s
    while not engine.active:
        pass
    events = streamed(url, {"model": MODEL, "input": QUESTION, "max_output_tokens": 8})
    long.join(timeout=60)
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"] and ":" in names
    assert names.index(":") < names.index("response.output_item.added")
    assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == decoded(
        pair, [{"role": "user", "content": QUESTION}], 8)


def test_function_tool_round_trip_streamed_and_not(scripted):
    url, engine = scripted
    c = client(url)
    engine.scripts += [CALL, "It is 18 degrees in Paris."]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.responses.create(model=MODEL, input=ask, tools=[WEATHER])
    (call,) = r.output
    assert (call.type, call.name, call.status, r.status) == ("function_call", "get_weather", "completed", "completed")
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and json.loads(call.arguments) == {"city": "Paris"}
    assert "The current weather in a city." in engine.prompt_texts[-1]

    follow = ask + [call.model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 18}'}]
    with c.responses.stream(model=MODEL, input=follow, tools=[WEATHER]) as stream:
        final = stream.get_final_response()
    assert final.output_text == "It is 18 degrees in Paris." and final.status == "completed"
    prompt = engine.prompt_texts[-1]  # the call and its result, rendered back by the template
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temperature": 18}\n</tool_response>' in prompt

    engine.scripts.append("Checking." + CALL)  # text, then a call: two items, streamed
    events = streamed(url, {"model": MODEL, "input": ask, "tools": [WEATHER]})
    names = [n for n, _ in events]
    assert names[names.index("response.output_item.done") + 1:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = events[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Checking."
    added = next(d["item"] for n, d in events if n == "response.output_item.added" and d["output_index"] == 1)
    assert added["id"] == final["output"][1]["id"] and added["arguments"] == ""


def test_forced_calls_are_function_call_items_streamed_and_not(scripted):
    """tool_choice "required" and a named function: the reply starts with the opening the server wrote (after
    the generation prompt) and comes back as a function_call item."""
    url, engine = scripted
    c = client(url)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = ' {"city": "Paris"}}\n</tool_call>'  # the model's part, after the opening
    engine.scripts += [named, named, 'get_weather", "arguments": {"city": "Paris"}}\n</tool_call>']
    choice = {"type": "function", "name": "get_weather"}
    r = c.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice=choice)
    (call,) = r.output
    assert (call.type, call.name, json.loads(call.arguments), r.status) == (
        "function_call", "get_weather", {"city": "Paris"}, "completed")
    assert engine.prompt_texts[-1].endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments":')
    final = streamed(url, {"model": MODEL, "input": ask, "tools": [WEATHER], "tool_choice": choice})[-1][1]
    assert [(i["type"], i["name"]) for i in final["response"]["output"]] == [("function_call", "get_weather")]
    r = c.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required")
    assert [(i.type, i.name) for i in r.output] == [("function_call", "get_weather")]
    assert engine.prompt_texts[-1].endswith('<|im_start|>assistant\n<tool_call>\n{"name": "')


def test_freeform_tool_is_a_function_of_one_input_and_answers_custom_tool_calls(scripted):
    url, engine = scripted
    c = client(url)
    patch = "*** Begin Patch\n*** End Patch"
    engine.scripts += [f'<tool_call>\n{{"name": "apply_patch", "arguments": {{"input": {json.dumps(patch)}}}}}\n'
                       "</tool_call>", "Patched."]
    r = c.responses.create(model=MODEL, input="Fix the bug.", tools=[PATCH])
    (call,) = r.output
    assert (call.type, call.name, call.input) == ("custom_tool_call", "apply_patch", patch)
    assert call.call_id.startswith("call_") and '"input"' in engine.prompt_texts[-1]
    follow = [{"role": "user", "content": "Fix the bug."}, call.model_dump(exclude_none=True),
              {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}]
    assert c.responses.create(model=MODEL, input=follow, tools=[PATCH]).output_text == "Patched."
    assert "<tool_response>\nDone!\n</tool_response>" in engine.prompt_texts[-1]
    assert json.dumps(patch) in engine.prompt_texts[-1]  # the call, rendered back as its one argument

    engine.scripts.append('<tool_call>\n{"name": "apply_patch", "arguments": {"input": "x"}}\n</tool_call>')
    events = streamed(url, {"model": MODEL, "input": "Fix it.", "tools": [PATCH]})
    names = [n for n, _ in events]
    assert "response.custom_tool_call_input.done" in names and "response.function_call_arguments.delta" not in names
    assert events[-1][1]["response"]["output"][0]["input"] == "x"


def test_a_body_shaped_as_codex_sends_it(scripted):
    """Codex CLI's request: instructions, developer and user items, function, freeform, namespace and
    web_search tools, reasoning summaries, store false, streamed; then its next turn with the call's output."""
    url, engine = scripted
    tools = [{"type": "function", "name": "exec_command", "description": "Runs a command in a shell.", "strict": False,
              "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                             "additionalProperties": False}},
             PATCH,
             {"type": "namespace", "name": "mcp__docs", "description": "The docs server's tools.",
              "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}]},
             {"type": "web_search"}]
    ask = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
           {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context/>"}]},
           {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]}]
    body = {"model": MODEL, "instructions": "You are a coding agent.", "input": ask, "tools": tools,
            "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0f6c5a0e", "stream": True,
            "client_metadata": {"originator": "codex_cli_rs"}}
    headers = {"x-codex-turn-metadata": '{"turn_id": "1"}', "x-codex-beta-features": "", "originator": "codex_cli_rs",
               "session_id": "0f6c5a0e", "OpenAI-Beta": "responses=experimental"}
    engine.scripts.append('I will look.<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>')
    events = streamed(url, body, headers)
    assert events[-1][0] == "response.completed"
    final = events[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"] and final["store"] is False
    call = final["output"][1]
    assert (call["name"], json.loads(call["arguments"])) == ("exec_command", {"cmd": "ls"})
    prompt = engine.prompt_texts[-1]
    assert prompt.startswith("<|im_start|>system\nYou are a coding agent.\n\nSandbox: read-only.")
    assert "exec_command" in prompt and "apply_patch" in prompt and "web_search" not in prompt and "lookup" not in prompt
    assert raw(url, f"/v1/responses/{final['id']}")[0] == 404  # store: false

    engine.scripts.append("Two files.")
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAAB"}
    turn = ask + [reasoning, *final["output"], {"type": "function_call_output", "call_id": call["call_id"],
                                                "output": "a.py\nb.py"}]
    events = streamed(url, {**body, "input": turn}, headers)
    assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == "Two files."
    assert "I will look.<tool_call>" in engine.prompt_texts[-1]
    assert "<tool_response>\na.py\nb.py\n</tool_response>" in engine.prompt_texts[-1]


def test_server_run_tools_are_left_out_even_where_no_tools_render(pair, served, caplog):
    url, _ = served  # SmolLM2's own template renders no tools: only server-run ones may come
    with caplog.at_level("INFO", logger="mlx_dflash.server"):
        r = client(url).responses.create(model=MODEL, input=QUESTION, max_output_tokens=4,
                                         tools=[{"type": "web_search"}, {"type": "code_interpreter",
                                                                         "container": {"type": "auto"}}])
    assert r.output_text == decoded(pair, [{"role": "user", "content": QUESTION}], 4)
    assert [m for m in caplog.messages if "code_interpreter, web_search" in m]
    status, _, body = raw(url, "/v1/responses", {"model": MODEL, "input": QUESTION, "tools": [WEATHER],
                                                 "max_output_tokens": 4})
    assert status == 200, body  # a function tool goes in the generic form (test_serve_tools.py)


def test_previous_response_id_kept_and_missing(scripted):
    url, engine = scripted
    c = client(url)
    engine.scripts += ["Hello!", "More.", "Done.", "Unkept."]
    first = c.responses.create(model=MODEL, instructions="Be terse.", input="Hi there.")
    second = c.responses.create(model=MODEL, previous_response_id=first.id, input="And more?")
    prompt = engine.prompt_texts[-1]
    assert "Hi there." in prompt and "Hello!" in prompt and "And more?" in prompt
    assert "Be terse." not in prompt  # instructions are not carried over
    c.responses.create(model=MODEL, previous_response_id=second.id, input="Last.")
    assert all(s in engine.prompt_texts[-1] for s in ("Hi there.", "Hello!", "And more?", "More.", "Last."))
    kept = c.responses.retrieve(first.id)
    assert kept.output_text == "Hello!" and kept.id == first.id and kept.usage.output_tokens == first.usage.output_tokens

    unkept = c.responses.create(model=MODEL, input="Hi.", store=False)
    with pytest.raises(openai.NotFoundError, match="is not kept by this server"):
        c.responses.retrieve(unkept.id)
    with pytest.raises(openai.BadRequestError, match="response 'resp_gone' is not kept by this server .*; send the whole conversation"):
        c.responses.create(model=MODEL, previous_response_id="resp_gone", input="Hi.")


def test_store_keeps_the_latest_responses_only():
    store = ResponseStore(size=2)
    for n in range(3):
        store.keep({"id": f"resp_{n}"}, [{"role": "user", "content": str(n)}])
    store.conversation("resp_1")  # used: kept longer than resp_2
    store.keep({"id": "resp_3"}, [])
    assert list(store.entries) == ["resp_1", "resp_3"]
    with pytest.raises(APIError, match="not kept"):
        store.response("resp_0")


def test_kept_responses_are_bounded_in_bytes_per_key_and_in_all(caplog):
    """Issue 52 N1: a response is kept as its JSON bytes, each key's store within max_bytes, all keys' within the
    shared bound, the least recently used dropped first; one bigger than a key's bound is answered, not kept."""
    shared = KeptBytes(limit=2500)
    a, b = (ResponseStore(max_bytes=2000, shared=shared) for _ in range(2))
    pad = "x" * 700
    for n in range(3):
        a.keep({"id": f"a{n}", "metadata": {"pad": pad}}, [])
    assert list(a.entries) == ["a1", "a2"] and a.used <= 2000  # the third pushed the first out of the key's bound
    assert a.response("a2") == json.dumps({"id": "a2", "metadata": {"pad": pad}}).encode()  # served as kept
    b.keep({"id": "b0", "metadata": {"pad": pad}}, [{"role": "user", "content": pad}])
    assert list(a.entries) == ["a2"] and shared.used <= 2500  # all keys' bound: the oldest of any key went (a1)
    assert a.conversation("a2") == [] and b.conversation("b0") == [{"role": "user", "content": pad}]
    with caplog.at_level(logging.INFO, logger="mlx_dflash.server"):
        a.keep({"id": "huge", "metadata": [{}] * 1000}, [])
    assert "huge" not in a.entries and "answered, not kept" in caplog.text
    with pytest.raises(APIError, match=r"not kept by this server \(it keeps the last 64 responses not sent with "
                                       r"store: false, within 0.00191 MiB\)"):
        a.response("huge")


@pytest.mark.parametrize("items", [9_000, pytest.param(900_000, marks=pytest.mark.slow)], ids=["36KB", "3.6MB"])
def test_a_kept_response_with_megabytes_of_metadata(tmp_path, tiny_chat_pair, items):
    """The hostile case: 3.6 MB of `metadata: [{}, ...]` is kept as its JSON (not as a million dicts) or, past
    --max-kept-bytes, answered and not kept; GET serves the kept bytes. (The default tier: the same at 1/100.)"""
    target, tokenizer, drafter = tiny_chat_pair
    scale = items * 4 / (3.6 * 2**20)  # the limits in proportion: 6 MiB kept holds one copy of 3.6 MB, not two
    with running((target, drafter, tokenizer), max_body_bytes=8 << 20, max_kept_bytes=int(scale * (6 << 20))) as (
            url, _):
        metadata = [{}] * items  # 4 bytes of JSON each
        status, _, first = raw(url, "/v1/responses", {"model": MODEL, "input": "Hi.", "max_output_tokens": 2,
                                                      "metadata": metadata})
        assert status == 200
        status, _, again = raw(url, f"/v1/responses/{first['id']}", method="GET")
        assert status == 200 and again == first
        big = {"model": MODEL, "input": "Hi.", "max_output_tokens": 2, "metadata": metadata + metadata}
        status, _, second = raw(url, "/v1/responses", big)  # twice that, kept, would pass the key's limit
        assert status == 200 and len(second["metadata"]) == 2 * items
        assert raw(url, f"/v1/responses/{second['id']}", method="GET")[0] == 404
        assert raw(url, f"/v1/responses/{first['id']}", method="GET")[0] == 200  # the first is still kept


def test_tool_choice_and_reasoning_set_the_request():
    def parsed(**body):
        return parse_responses({"model": MODEL, "input": "x", **body}, Defaults(), MODEL, ResponseStore())

    assert parsed(tools=[WEATHER]).force_tool is None
    assert parsed(tools=[WEATHER], tool_choice="required").force_tool == ""
    assert parsed(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}).force_tool == "get_weather"
    assert parsed(tools=[WEATHER], tool_choice="none").tools is None
    assert parsed(tools=[WEATHER], parallel_tool_calls=False).parallel_tool_calls is False
    assert [parsed(reasoning={"effort": e}).thinking for e in ("none", "minimal", "low", "high")] == [
        False, False, None, None]
    assert parsed().thinking is None and parsed(reasoning={"summary": "auto"}).thinking is None
    assert parsed(tools=[PATCH]).custom_tools == {"apply_patch"}


BAD = [({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, 400, "text.format"),
       ({"text": {"format": {"type": "json_object"}}}, 400, "text.format"),
       ({"background": True}, 400, "background"),
       ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,"}]}]},
        400, "input[0].content[0]"),
       ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0].call_id"),
       ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]}, 400,
        "input[0].arguments"),
       ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0]"),
       ({"input": [{"role": "tool", "content": "x"}]}, 400, "input[0].role"),
       ({"input": []}, 400, "input"),
       ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
       ({"reasoning": {"effort": "max"}}, 400, "reasoning.effort"),
       ({"tool_choice": "required"}, 400, "tool_choice"),
       ({"tools": [{"type": "function"}]}, 400, "tools[0]"),
       ({"max_output_tokens": 0}, 400, "max_output_tokens"),
       ({"temperature": 3}, 400, "temperature"),
       ({"store": "no"}, 400, "store"),
       ({"model": "gpt-5-codex"}, 404, "model")]


@pytest.mark.parametrize("extra,status,param", BAD)
def test_what_cannot_be_honoured_is_a_clear_error_naming_the_field(scripted, extra, status, param):
    url, _ = scripted
    got, _, body = raw(url, "/v1/responses", {"model": MODEL, "input": "x", **extra})
    assert (got, body["error"]["param"]) == (status, param), body
    if param == "input[0].content[0]":
        assert "this model reads text only" in body["error"]["message"]


def test_text_format_refusal_through_the_client(scripted):
    with pytest.raises(openai.BadRequestError, match="text.format") as e:
        client(scripted[0]).responses.create(model=MODEL, input="x", text={"format": {"type": "json_object"}})
    assert e.value.param == "text.format"


def test_openai_agents_default_model_with_a_function_tool(scripted):
    """openai-agents' default model (OpenAIResponsesModel) runs an agent whose tool the model calls."""
    agents = pytest.importorskip("agents")
    url, engine = scripted
    agents.set_tracing_disabled(True)  # its traces would go to OpenAI
    asked = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        asked.append(city)
        return "sunny, 18 C"

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", model=model, tools=[get_weather])
    engine.scripts += [CALL, "It is sunny in Paris."]
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?")
    assert result.final_output == "It is sunny in Paris." and asked == ["Paris"]
    assert "<tool_response>\nsunny, 18 C\n</tool_response>" in engine.prompt_texts[-1]


def test_reasoning_errors_and_unknown_reply_kinds_render_as_valid_events():
    """The stream renderer on its own: a thinking model's reasoning is a reasoning item before the message,
    a kind it does not know is skipped, an error ends the stream with response.failed."""
    import asyncio

    from mlx_dflash.server.openai_responses import response_stream
    from mlx_dflash.server.protocol import Outcome

    def events(pieces):
        async def replies():
            for piece in pieces:
                yield piece

        async def run():
            req = parse_responses({"model": MODEL, "input": "x", "stream": True}, Defaults(), MODEL, ResponseStore())
            return [chunk async for chunk in response_stream(req, 3, replies(), store=ResponseStore())]

        out = []
        for chunk in asyncio.run(run()):
            if chunk.startswith(":"):
                out.append(":")
                continue
            data = json.loads(chunk.split("data: ", 1)[1])
            STREAM_EVENT.validate_python(data)
            out.append(data)
        return out

    got = events([("reasoning", "Let me "), ("reasoning", "think."), ("text", "Hi"), ("ping", None),
                  ("mystery", 1), ("done", Outcome("stop", 3, 2))])
    assert ":" in got
    got = [e for e in got if e != ":"]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    final = got[-1]["response"]
    assert got[-1]["type"] == "response.completed" and [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert "".join(e["delta"] for e in got if e["type"] == "response.reasoning_text.delta") == "Let me think."
    assert Response.model_validate(final).output_text == "Hi" and final["usage"]["total_tokens"] == 5

    got = events([("text", "a"), ("error", APIError(503, "the server is stopping"))])
    assert got[-1]["type"] == "response.failed" and got[-1]["response"]["status"] == "failed"
    assert got[-1]["response"]["error"] == {"code": "server_error", "message": "the server is stopping"}
    assert [e["type"] for e in events([("done", Outcome("stop", 3, 1))])][-2:] == [
        "response.output_item.done", "response.completed"]  # nothing said: an empty message


def test_reasoning_alone_is_one_reasoning_item_streamed_or_not():
    """A reply cut while reasoning: the reasoning item and no message, in the stream and the whole response."""
    import asyncio

    from mlx_dflash.server.openai_responses import response_body, response_stream
    from mlx_dflash.server.protocol import Outcome

    req = parse_responses({"model": MODEL, "input": "x"}, Defaults(), MODEL, ResponseStore())
    whole = response_body(req, "", Outcome("length", 3, 4), store=ResponseStore(), reasoning="Let me")

    async def final():
        async def replies():
            yield "reasoning", "Let me"
            yield "done", Outcome("length", 3, 4)

        chunks = [c async for c in response_stream(req, 3, replies(), store=ResponseStore())]
        return json.loads(chunks[-1].split("data: ", 1)[1])["response"]

    streamed_body = asyncio.run(final())
    for body in (whole, streamed_body):
        assert [i["type"] for i in body["output"]] == ["reasoning"] and body["status"] == "incomplete"
        assert Response.model_validate(body).output_text == ""
    empty = response_body(req, "", Outcome("stop", 3, 1), store=ResponseStore())
    assert [i["type"] for i in empty["output"]] == ["message"]
