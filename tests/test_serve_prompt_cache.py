"""The server's prefix cache as clients see it: a conversation's later turns report their cached prompt
tokens (OpenAI's usage.prompt_tokens_details.cached_tokens) and answer as a server without the cache does;
/health reports the cache; a hybrid target's tool conversation (tools in its template or in the generic form)
is kept at its message ends; concurrent clients leave it consistent; with several API keys, each key's
clients see only their own entries, and /health's counters only with a key."""

import json
import threading
import urllib.request

import pytest

from serve_helpers import tools_tokenizer
from serving import MODEL, client, raw, running
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import WidthOptions
from tiny_families import tiny_chat_target
from mlx_dflash.models.loader import drafter_config_for, init_drafter
from mlx_dflash.server.tools import generic_tools_messages

SYSTEM = "You answer in short sentences. " * 8
QUESTIONS = ["What is the sea?", "Why is it salty?", "How deep is it?"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def agent(city, sent=True):
    """An agent's conversation: a question, the model's call for the weather in `city`, the tool's result. sent:
    the call's arguments a JSON string (as clients send them), else an object (as templates take them)."""
    arguments = json.dumps({"city": city}) if sent else {"city": city}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": f"Sunny in {city}."}]


@pytest.fixture(scope="module")
def pair(tiny_chat_pair):
    target, tokenizer, drafter = tiny_chat_pair
    return target, drafter, tokenizer


def chat(c, messages, **kw):
    return c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **kw)


def converse(c, questions=QUESTIONS, stream=False):
    """A multi-turn chat: each turn sends the whole conversation so far. Returns [(text, cached tokens)]."""
    messages, out = [{"role": "system", "content": SYSTEM}], []
    for q in questions:
        messages.append({"role": "user", "content": q})
        if stream:
            chunks = list(chat(c, messages, stream=True, stream_options={"include_usage": True}))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
        else:
            r = chat(c, messages)
            text, cached = r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens
        messages.append({"role": "assistant", "content": text})
        out.append((text, cached))
    return out


def health(url):
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def hybrid(pair):
    """(target, drafter): a tiny hybrid GatedDeltaNet qwen3_5 target over SmolLM2's vocabulary."""
    target = tiny_chat_target("qwen3_5", pair[0].vocab_size, seed=3)
    config = drafter_config_for(target, num_layers=1, block_size=8, num_target_features=2)
    return target, init_drafter(config, seed=0).bind(target)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_later_turns_are_cached_and_answer_as_a_server_without_the_cache(pair, hybrid, kind):
    if kind == "hybrid":
        pair = (*hybrid, pair[2])
    with running(pair) as (url, _):
        cold = converse(client(url))
    with running(pair, engine_options=dict(prompt_cache=dict(max_entries=8))) as (url, engine):
        warm = converse(client(url))
        streamed = converse(client(url), stream=True)  # the same conversation again: longer hits still
        stats = health(url)["prompt_cache"]
    assert [t for t, _ in warm] == [t for t, _ in cold] == [t for t, _ in streamed]
    assert warm[0][1] == 0 and all(cached > 50 for _, cached in warm[1:])  # the system prompt and more
    assert all(s[1] >= w[1] for s, w in zip(streamed, warm))
    assert 0 < stats["entries"] <= 8 and stats["bytes"] > 0 and stats["hits"] >= 2 * len(QUESTIONS) - 1


@pytest.mark.parametrize("form", ["template", "generic"])
def test_a_hybrid_targets_tool_conversation_is_kept_at_its_message_ends(pair, hybrid, tmp_path_factory, form):
    """A hybrid target's state is kept only at marked positions: a tool request's marks are its messages' ends
    as the prompt renders them (tools and all), so an agent turn that goes another way after the user's
    message reads the system prompt, its tools and that message from the cache."""
    from mlx_dflash.downloads import ensure_smollm2

    tokenizer = (tools_tokenizer(ensure_smollm2("float32"), tmp_path_factory.mktemp("tools-tokenizer"))
                 if form == "template" else pair[2])

    def rendered(messages, generation_prompt):
        options = dict(tools=[WEATHER]) if form == "template" else {}
        messages = messages if form == "template" else generic_tools_messages(messages, [WEATHER])
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, **options)

    with running((*hybrid, tokenizer)) as (url, _):
        cold = chat(client(url), agent("Lyon"), tools=[WEATHER]).choices[0].message
    with running((*hybrid, tokenizer), engine_options=dict(prompt_cache=dict(max_entries=8))) as (url, engine):
        chat(client(url), agent("Paris"), tools=[WEATHER])
        (entry,) = engine.prompt_cache._entries.values()
        warm = chat(client(url), agent("Lyon"), tools=[WEATHER])  # the same question, another call
    # the marks, then one token before the prompt's end and the state's end (test_prompt_cache.py)
    marks, messages = sorted(entry.checkpoints)[:-2], agent("Paris", sent=False)
    assert len(marks) == len(messages) - 1
    for n, mark in enumerate(marks, start=1):  # past message n's end, within what opens the next one
        assert len(rendered(messages[:n], False)) <= mark <= len(rendered(messages[:n], True)), (n, marks)
    assert warm.usage.prompt_tokens_details.cached_tokens == len(rendered(messages[:2], True))
    assert warm.choices[0].message == cold


def test_concurrent_clients_leave_the_cache_consistent(pair):
    conversations = [[f"Question {i}.{j}: tell me about topic {i}." for j in range(2)] for i in range(4)]
    with running(pair) as (url, _):
        want = [converse(client(url), qs) for qs in conversations]
    got = [None] * len(conversations)
    with running(pair, engine_options=dict(prompt_cache=dict(max_entries=3))) as (url, engine):
        def talk(i):
            got[i] = converse(client(url), conversations[i])

        threads = [threading.Thread(target=talk, args=(i,)) for i in range(len(conversations))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        stats = health(url)["prompt_cache"]
    assert [[t for t, _ in c] for c in got] == [[t for t, _ in c] for c in want]
    assert stats["entries"] <= 3 and stats["hits"] + stats["misses"] == 2 * len(conversations)


@pytest.mark.parametrize("batch", [1, 4])
def test_with_several_keys_a_client_hits_only_its_own_keys_entries(pair, batch):
    target, drafter, _ = pair
    options = dict(prompt_cache=dict(max_entries=8), max_batch=batch)
    with running(pair, api_keys=("key-a", "key-b"), engine_options=options,
                 policy=build_policy(target, drafter, WidthOptions(4), batch)) as (url, _):
        secret = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "My password is sea-salt-42."}]
        assert chat(client(url, key="key-a"), secret).usage.prompt_tokens_details.cached_tokens == 0
        assert chat(client(url, key="key-b"), secret).usage.prompt_tokens_details.cached_tokens == 0
        assert chat(client(url, key="key-a"), secret).usage.prompt_tokens_details.cached_tokens > 50
        anonymous = raw(url, "/health")[2]
        a, b = (raw(url, "/health", headers={"Authorization": f"Bearer key-{k}"})[2] for k in "ab")
    assert anonymous == {"status": "ok", "model": MODEL, "waiting": 0}
    # each key sees its own entries and lookups only: B's never tell that A continued a conversation
    assert (a["prompt_cache"]["hits"], a["prompt_cache"]["misses"]) == (1, 1) and a["prompt_cache"]["cached_tokens"] > 50
    assert (b["prompt_cache"]["hits"], b["prompt_cache"]["misses"], b["prompt_cache"]["cached_tokens"]) == (0, 1, 0)
    assert a["prompt_cache"]["entries"] >= 1 and b["prompt_cache"]["entries"] >= 1 and a["batch"]["max_batch"] == batch


def test_with_several_keys_a_client_reads_only_its_own_keys_kept_responses(pair):
    with running(pair, api_keys=("key-a", "key-b")) as (url, _):
        made = client(url, key="key-a").responses.create(model=MODEL, input="Hello there.", max_output_tokens=4)
        mine = raw(url, f"/v1/responses/{made.id}", headers={"Authorization": "Bearer key-a"})
        theirs = raw(url, f"/v1/responses/{made.id}", headers={"Authorization": "Bearer key-b"})
        follow_up = raw(url, "/v1/responses", {"model": MODEL, "input": "And?", "max_output_tokens": 4,
                                                "previous_response_id": made.id},
                        headers={"Authorization": "Bearer key-b"})
    assert mine[0] == 200 and mine[2]["id"] == made.id
    assert theirs[0] == 404 and follow_up[0] == 400
    assert follow_up[2]["error"]["param"] == "previous_response_id"
