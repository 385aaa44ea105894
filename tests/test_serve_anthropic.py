"""The Anthropic Messages API of `mlx-dflash serve`, through the official `anthropic` client and raw HTTP.

On the tiny random pair of test_serve.py: text equal to the decoder's for the same chat (system prompt and
content blocks included), Anthropic's streaming event sequence with its pings, count_tokens, stop
sequences, and Anthropic-shaped errors, "prompt is too long" worded as Anthropic words it.
"""

import threading

import anthropic
import pytest

from serve_helpers import pair_with_context
from serving import MODEL, running, sse_events
from mlx_dflash.generate import generate

SYSTEM = "You answer briefly."
QUESTION = "Tell me about the sea."


CONTEXT = 2048


@pytest.fixture(scope="module")
def pair(tiny_chat_pair):
    return pair_with_context(tiny_chat_pair[1], CONTEXT)


@pytest.fixture(scope="module")
def served(pair):
    with running(pair, ping_seconds=0.3) as (url, engine):
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
    while engine.running is None:
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
