"""The Anthropic Messages API of `mlx-dflash serve`, through the official `anthropic` client and raw HTTP.

On the tiny random pair of test_serve.py: text equal to the decoder's for the same chat (system prompt and
content blocks included), Anthropic's streaming event sequence with its pings, count_tokens, stop
sequences, and Anthropic-shaped errors, "prompt is too long" worded as Anthropic words it. Then what Claude
Code sends: system messages inside `messages`, its billing-header system block, the usage of the prefix
cache, server tools, `HEAD /`, and its first request as it sends it.
"""

import logging
import threading

import anthropic
import pytest

from serve_helpers import ScriptedEngine, pair_with_context, templated_tokenizer, tools_tokenizer
from serving import MODEL, raw, running, sse_events
from mlx_dflash.downloads import ensure_smollm2
from mlx_dflash.generate import generate
from mlx_dflash.server.anthropic import system_turns

SYSTEM = "You answer briefly."
QUESTION = "Tell me about the sea."


CONTEXT = 2048


@pytest.fixture(scope="module")
def pair(tiny_chat_pair):
    return pair_with_context(tiny_chat_pair[1], CONTEXT)


@pytest.fixture(scope="module")
def served(pair):
    # one at a time: a request waits (pinged) while another runs
    with running(pair, ping_seconds=0.3, engine_options=dict(max_batch=1)) as (url, engine):
        yield url, engine


def messages_client(url, key="unused"):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


def decoded(pair, messages, max_tokens):
    target, drafter, tokenizer = pair
    return generate(target, drafter, tokenizer, tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                    max_tokens=max_tokens)


def test_text_equals_the_decoder_with_system_and_content_blocks(pair, served):
    url, _ = served
    c = messages_client(url)
    want = decoded(pair, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], 12)
    m = c.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (want.stats.prompt_tokens, 12)

    blocks = [{"type": "text", "text": "Tell me about", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "the sea."}]  # joined by a blank line; cache_control is a hint
    system = [{"type": "text", "text": SYSTEM}]
    m = c.messages.create(model=MODEL, max_tokens=6, system=system, messages=[{"role": "user", "content": blocks}],
                          metadata={"user_id": "u"})
    assert m.content[0].text == decoded(pair, [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": "Tell me about\n\nthe sea."}], 6)

    with c.messages.stream(model=MODEL, max_tokens=12, system=SYSTEM,
                           messages=[{"role": "user", "content": QUESTION}]) as stream:
        assert "".join(stream.text_stream) == want
        assert stream.get_final_message().usage.output_tokens == 12

    # A last assistant turn is continued (Anthropic's prefill), not answered anew.
    target, drafter, tokenizer = pair
    prefix = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The sea"}]
    ids = tokenizer.apply_chat_template(prefix, continue_final_message=True, add_generation_prompt=False)
    m = c.messages.create(model=MODEL, max_tokens=5, messages=prefix)
    assert m.content[0].text == generate(target, drafter, tokenizer, ids, max_tokens=5)


def test_stream_event_sequence_with_pings_while_queued(pair, served):
    url, engine = served
    long = threading.Thread(target=lambda: messages_client(url).messages.create(
        model=MODEL, max_tokens=150, messages=[{"role": "user", "content": QUESTION}]))
    long.start()  # keeps the engine busy: the stream below waits in the queue, pinged every 0.3 s
    while not engine.active:
        pass
    events = sse_events(url, "/v1/messages", {"model": MODEL, "max_tokens": 8, "stream": True,
                              "messages": [{"role": "user", "content": QUESTION}]})
    long.join(timeout=60)
    names = [n for n, _ in events]
    assert all(n == data["type"] for n, data in events)
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    content = [n for n in names if n != "ping"]
    assert content[1] == "content_block_start" and content[-3] == "content_block_stop"
    assert set(content[2:-3]) == {"content_block_delta"}
    assert names.index("content_block_start") > 2  # pings came while it waited
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == decoded(pair, [{"role": "user", "content": QUESTION}], 8)
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 8


def test_stop_sequences_and_count_tokens(pair, served):
    url, _ = served
    c = messages_client(url)
    full = decoded(pair, [{"role": "user", "content": QUESTION}], 16)
    stop = full[8:12]
    m = c.messages.create(model=MODEL, max_tokens=16, stop_sequences=["never there", stop],
                          messages=[{"role": "user", "content": QUESTION}])
    assert m.content[0].text == full[: full.index(stop)]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)

    _, _, tokenizer = pair
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Waves."},
                {"role": "user", "content": "More?"}]
    counted = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    chat = [{"role": "system", "content": SYSTEM}] + messages
    assert counted.input_tokens == len(tokenizer.apply_chat_template(chat, add_generation_prompt=True))


def test_errors_are_anthropic_shaped(pair, served):
    url, engine = served
    c = messages_client(url)
    ask = [{"role": "user", "content": QUESTION}]
    cases = [(dict(model="claude-sonnet-4-5", max_tokens=8, messages=ask), anthropic.NotFoundError, "not_found_error"),
             (dict(model=MODEL, max_tokens=8, messages=[{"role": "system", "content": "x"}]), anthropic.BadRequestError,
              "invalid_request_error"),
             (dict(model=MODEL, max_tokens=8, messages=ask, extra_body={"temperature": 1.5}),
              anthropic.BadRequestError, "invalid_request_error"),  # Anthropic's range is [0, 1]
             (dict(model=MODEL, max_tokens=8, messages=ask, output_config={"format": {
                 "type": "json_schema", "schema": {"type": "object"}}}), anthropic.BadRequestError,
              "invalid_request_error"),
             (dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]),
              anthropic.BadRequestError, "invalid_request_error")]
    for kwargs, error, kind in cases:
        with pytest.raises(error) as e:
            c.messages.create(**kwargs)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == kind, e.value.body
    many_tools = [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(300)]
    with pytest.raises(anthropic.BadRequestError, match="at most 128"):  # as chat and Responses take
        c.messages.count_tokens(model=MODEL, messages=ask, tools=many_tools)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        c.post("/v1/messages", body={"model": MODEL, "messages": ask}, cast_to=object)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "sea " * 3000}])
    prompt_tokens = c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "sea " * 3000}])
    assert e.value.body["error"]["message"] == (f"prompt is too long: {prompt_tokens.input_tokens} tokens > "
                                                f"{CONTEXT - 1} maximum (this model's context is {CONTEXT} tokens)")
    completed = engine.completed
    with pytest.raises(anthropic.NotFoundError) as e:
        c.get("/v1/nowhere", cast_to=object)
    assert e.value.status_code == 404 and e.value.body["error"]["type"] == "not_found_error"
    assert engine.completed == completed  # nothing was generated for any of these
    with running(pair, api_keys=("s3cret",)) as (keyed, _):
        with pytest.raises(anthropic.AuthenticationError) as e:
            messages_client(keyed, key="wrong").messages.create(model=MODEL, max_tokens=2, messages=ask)
        assert e.value.body["error"]["type"] == "authentication_error"
        m = messages_client(keyed, key="s3cret").messages.create(model=MODEL, max_tokens=2, messages=ask)  # x-api-key
        assert m.usage.output_tokens == 2
    models = c.models.list()  # the same /v1/models serves Anthropic's shape too
    assert [m.id for m in models.data] == [MODEL]


# What Claude Code sends.

AGENTS = "Available agent types for the Agent tool: general-purpose."
# A chat template that takes a system message first only (as Mistral's and Gemma's do).
SYSTEM_FIRST_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == 'system' and not loop.first %}{{ raise_exception('system messages come first') }}{% endif %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def billing(checksum):
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.19.e4f; cc_entrypoint=sdk-cli; "
                                    f"cch={checksum};"}


def test_system_messages_inside_messages_are_system_turns(pair, served):
    url, _ = served
    c = messages_client(url)
    _, _, tokenizer = pair
    assert system_turns(tokenizer)  # SmolLM2's template renders a system turn anywhere
    messages = [{"role": "user", "content": QUESTION}, {"role": "system", "content": AGENTS}]
    chat = [{"role": "system", "content": SYSTEM}] + messages
    m = c.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=messages)
    assert m.content[0].text == decoded(pair, chat, 8)
    counted = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    assert counted.input_tokens == m.usage.input_tokens == len(tokenizer.apply_chat_template(
        chat, add_generation_prompt=True))


def test_system_messages_join_the_system_prompt_where_the_template_takes_one_first(pair, tmp_path):
    target, drafter, _ = pair
    tokenizer = templated_tokenizer(ensure_smollm2("float32"), tmp_path, SYSTEM_FIRST_TEMPLATE)
    assert not system_turns(tokenizer)
    messages = [{"role": "user", "content": QUESTION}, {"role": "system", "content": [{"type": "text", "text": AGENTS}]}]
    merged = [{"role": "system", "content": f"{SYSTEM}\n\n{AGENTS}"}, {"role": "user", "content": QUESTION}]
    with running((target, drafter, tokenizer), engine_class=ScriptedEngine) as (url, engine):
        engine.scripts.append("Waves.")
        c = messages_client(url)
        m = c.messages.create(model=MODEL, max_tokens=8, system=[billing("1a2b3"), {"type": "text", "text": SYSTEM}],
                              messages=messages)
        assert m.content[0].text == "Waves."
        assert engine.prompt_texts[-1] == tokenizer.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)
        counted = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages).input_tokens
        assert counted == len(tokenizer.apply_chat_template(merged, add_generation_prompt=True))


def test_the_billing_header_stays_out_of_the_prompt_and_usage_counts_the_prefix_cache(pair, served):
    def ask(c, checksum, messages=({"role": "user", "content": QUESTION},), stream=False):
        system = [billing(checksum), {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
        if not stream:
            return c.messages.create(model=MODEL, max_tokens=8, system=system, messages=list(messages))
        with c.messages.stream(model=MODEL, max_tokens=8, system=system, messages=list(messages)) as s:
            events = list(s)
            return s.get_final_message(), events[0].message.usage

    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    prompt = len(pair[2].apply_chat_template(chat, add_generation_prompt=True))
    c = messages_client(served[0])  # no prefix cache: the whole prompt is input
    assert c.messages.count_tokens(model=MODEL, system=[billing("ffff1")], messages=chat[1:]).input_tokens == \
        c.messages.count_tokens(model=MODEL, messages=chat[1:]).input_tokens  # the header block is not in it
    for m in [ask(c, "0c1d2"), ask(c, "0c1d2", stream=True)[0]]:
        assert (m.usage.input_tokens, m.usage.cache_creation_input_tokens, m.usage.cache_read_input_tokens) == \
            (prompt, 0, 0)
        assert m.content[0].text == decoded(pair, chat, 8)

    with running(pair, engine_options=dict(prompt_cache=dict(max_entries=4))) as (url, _):
        c = messages_client(url)
        first = ask(c, "0c1d2")
        assert (first.usage.input_tokens, first.usage.cache_creation_input_tokens,
                first.usage.cache_read_input_tokens) == (0, prompt, 0)
        again = ask(c, "9e8f7")  # Claude Code's next request: only the checksum differs
        assert again.content[0].text == first.content[0].text
        assert (again.usage.input_tokens, again.usage.cache_creation_input_tokens,
                again.usage.cache_read_input_tokens) == (0, 1, prompt - 1)  # a verbatim resend reads one token
        turn = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.content[0].text},
                {"role": "user", "content": "More?"}]
        final, start = ask(c, "5a5a5", turn, stream=True)
        total = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=turn).input_tokens
        assert (start.input_tokens, start.cache_creation_input_tokens, start.cache_read_input_tokens) == (0, total, 0)
        usage = final.usage
        assert usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens == total
        assert usage.cache_read_input_tokens >= prompt - 1 and usage.input_tokens == 0


def test_server_tools_are_left_out_and_media_are_refused(pair, served, caplog):
    url, _ = served
    c = messages_client(url)
    ask = [{"role": "user", "content": QUESTION}]
    caplog.set_level(logging.INFO, logger="mlx_dflash.server")
    m = c.messages.create(model=MODEL, max_tokens=6, messages=ask, tools=[
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        {"type": "bash_20250124", "name": "bash"}, {"type": "some_future_tool", "name": "x"}])
    assert m.content[0].text == decoded(pair, ask, 6)  # as without tools (SmolLM2's template renders none)
    (line,) = [r.getMessage() for r in caplog.records if "tools left out" in r.getMessage()]
    assert m.id in line and "web_search (web_search_20250305)" in line and "bash (bash_20250124)" in line

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    for content, at in [([{"type": "text", "text": "Look:"}, image], "messages[0].content[1]"),
                        ([{"type": "tool_result", "tool_use_id": "t", "content": [document]}],
                         "messages[0].content[0].content[0]")]:
        status, _, answer = raw(url, "/v1/messages", {"model": MODEL, "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": content}]})
        assert status == 400 and answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["message"].startswith(at + ": ") and "this model reads text only" in answer["error"]["message"]


def test_root_answers_head_and_get(served):
    url, _ = served
    assert raw(url, "/", method="HEAD", parse=False)[:1] == (200,)
    status, _, body = raw(url, "/")
    assert status == 200 and body["model"] == MODEL and "/v1/messages" in body["endpoints"]


CLAUDE_CODE_BETAS = ("claude-code-20250219,interleaved-thinking-2025-05-14,thinking-token-count-2026-05-13,"
                     "context-management-2025-06-27,prompt-caching-scope-2026-01-05,"
                     "mid-conversation-system-2026-04-07,effort-2025-11-24")


def claude_code_request(checksum: str) -> dict:
    """Claude Code 2.1's first request (`claude -p "..." --tools "Agent,Read"`), shortened."""
    ephemeral = {"type": "ephemeral"}
    schema = {"type": "object", "properties": {"prompt": {"type": "string"}}, "required": ["prompt"],
              "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}
    return {
        "model": MODEL, "max_tokens": 32000, "stream": True,
        "system": [billing(checksum),
                   {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                    "cache_control": ephemeral},
                   {"type": "text", "text": "You are an interactive agent that helps users with software "
                    "engineering tasks.", "cache_control": ephemeral}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Reply with one word: hello",
                                                   "cache_control": ephemeral}]},
                     {"role": "system", "content": AGENTS}],
        "tools": [{"name": "Agent", "description": "Launch a new agent.", "input_schema": schema},
                  {"name": "Read", "description": "Reads a file.", "input_schema": {
                      **schema, "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "user_0123_account__session_4567"},
    }


def test_claude_codes_first_request_gets_a_whole_event_stream(pair, tmp_path):
    target, drafter, _ = pair
    tokenizer = tools_tokenizer(ensure_smollm2("float32"), tmp_path)  # a template that renders tools
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": CLAUDE_CODE_BETAS, "x-api-key": "dummy",
               "user-agent": "claude-cli/2.1.19 (external, sdk-cli)"}
    with running((target, drafter, tokenizer), max_tokens_limit=16) as (url, _):
        assert raw(url, "/", method="HEAD", headers=headers, parse=False)[0] == 200
        events = sse_events(url, "/v1/messages?beta=true", claude_code_request("a1b2c"), headers)
        for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}):
            body = {**claude_code_request("d3e4f"), "stream": False, "max_tokens": 2, "thinking": thinking}
            assert raw(url, "/v1/messages?beta=true", body, headers=headers)[0] == 200
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    blocks = [n for n in names if n.startswith("content_block")]
    assert blocks and blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    assert blocks.count("content_block_start") == blocks.count("content_block_stop")
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("max_tokens", "end_turn", "tool_use")
    assert delta["usage"]["input_tokens"] == events[0][1]["message"]["usage"]["input_tokens"] > 0
