"""`mlx-dflash serve` under a hostile client's load: a burst of requests beyond --max-queue gets exactly the
`queue_full`s past the running and waiting ones; a short prompt is tokenized while more megabyte prompts than
tokenizer threads are, and a text surely over the context is refused before tokenizing; a tokenizer.json's
truncation and padding are cleared at load (the tokenizer threads share the tokenizer); bad strings and
tools are 400s naming the field, and leave a kept-alive connection serving; half-sent and trickling bodies
from one address leave room for valid requests from it. Each test drives a server on a loopback port,
every wait bounded."""

import contextlib
import http.client
import json
import select
import socket
import threading
import time

import pytest

from serve_helpers import pair_with_context
from serving import CHAT, MODEL, head, port_of, raw, running, wait_until
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import WidthOptions
from mlx_dflash.server.engine import Engine
from mlx_dflash.server.routes import TOKENIZER_THREADS

CONTEXT = 2048
GOOD = {"model": MODEL, "messages": CHAT, "max_tokens": 4}


@pytest.fixture(scope="module")
def pair(tiny_chat_pair):
    return pair_with_context(tiny_chat_pair[1], CONTEXT)


@pytest.fixture(scope="module")
def served(pair):
    with running(pair) as (url, engine):
        yield url, engine


# A burst of requests.

def burst(url, n: int, body: dict, path="/v1/chat/completions") -> list:
    """n requests sent at once, each on its own connection: the status each got (streams are closed once every
    request has its answer, which cancels them: none ends before the last is admitted or refused)."""
    host, port = "127.0.0.1", port_of(url)
    gate, answered, statuses = threading.Barrier(n), threading.Barrier(n), []

    def ask():
        conn = http.client.HTTPConnection(host, port, timeout=30)
        gate.wait()
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        statuses.append(r.status if r.status == 200 else json.loads(r.read())["error"].get("code") or r.status)
        answered.wait(timeout=30)
        conn.close()

    threads = [threading.Thread(target=ask) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return statuses


@pytest.mark.parametrize("batch, max_queue", [(1, 0), (1, 3), (4, 0), (4, 3)])
def test_a_burst_gets_queue_full_beyond_the_running_and_max_queue(pair, batch, max_queue):
    target, drafter, _ = pair
    with running(pair, max_queue=max_queue, engine_options=dict(max_batch=batch),
                 policy=build_policy(target, drafter, WidthOptions(4), batch)) as (url, served):
        statuses = burst(url, 12, {**GOOD, "max_tokens": 1500, "stream": True})
        assert sorted(statuses, key=str) == [200] * (batch + max_queue) + ["queue_full"] * (12 - batch - max_queue)
        wait_until(lambda: served.waiting == 0 and served.cancelled == batch + max_queue, 60)
        assert raw(url, "/v1/chat/completions", GOOD)[0] == 200


# Prompts of megabytes.

@pytest.mark.slow  # megabytes of prompts (seconds); test_serve_limits.py's big prompts keep the threads' rule
def test_a_small_request_is_answered_while_more_big_prompts_than_tokenizer_threads_tokenize(pair):
    big = {"model": MODEL, "max_tokens": 4, "messages": [  # an assistant turn's text: tokenized, then refused
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "sea " * (1 << 19)},
        {"role": "user", "content": "Go on."}]}
    n = TOKENIZER_THREADS + 1
    with running(pair, max_body_bytes=8 << 20) as (url, engine):
        tic = time.monotonic()
        assert raw(url, "/v1/chat/completions", GOOD)[0] == 200
        alone = time.monotonic() - tic
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(raw(url, "/v1/chat/completions", big)))
                   for _ in range(n)]
        for t in threads:
            t.start()
        wait_until(lambda: engine.waiting == n)  # admitted: read, and being tokenized or waiting for a thread
        tic = time.monotonic()
        assert raw(url, "/v1/chat/completions", GOOD)[0] == 200
        beside = time.monotonic() - tic
        still_tokenizing = engine.waiting
        for t in threads:
            t.join(timeout=120)
    assert beside < 5 * alone + 1.0, (beside, alone)
    assert still_tokenizing == n  # it overtook them all
    assert [a[2]["error"]["code"] for a in answers] == ["context_length_exceeded"] * n


def test_a_text_surely_over_the_context_is_refused_before_tokenizing(pair):
    huge = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "sea " * (1 << 20)}]}
    with running(pair, max_body_bytes=8 << 20) as (url, engine):
        tic = time.monotonic()
        status, _, answer = raw(url, "/v1/chat/completions", huge)
        assert time.monotonic() - tic < 1.5  # tokenizing 4 MB takes seconds
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert answer["error"]["message"].startswith("the prompt is at least ")
        status, _, answer = raw(url, "/v1/messages", huge)
        assert status == 400 and answer["error"]["message"].startswith("prompt is too long: "), answer
        status, _, answer = raw(url, "/v1/completions", {**huge, "messages": None, "prompt": [7] * CONTEXT})
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert engine.waiting == 0 and raw(url, "/v1/chat/completions", GOOD)[0] == 200


def test_a_tokenizer_json_s_truncation_and_padding_are_cleared_at_load(pair, tmp_path):
    from mlx_lm.utils import load_tokenizer

    from mlx_dflash.downloads import ensure_smollm2

    target, drafter, _ = pair
    files = ensure_smollm2("float32")
    tokenizer = json.loads((files / "tokenizer.json").read_text())
    tokenizer["truncation"] = {"direction": "Right", "max_length": 16, "strategy": "LongestFirst", "stride": 0}
    tokenizer["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None,
                            "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp_path / "tokenizer_config.json").write_bytes((files / "tokenizer_config.json").read_bytes())
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.backend_tokenizer.truncation is not None  # as the file says, until something clears it
    engine = Engine(lambda: (target, drafter, tokenizer, build_policy(target, drafter)))
    engine.close()
    backend = engine.tokenizer.backend_tokenizer
    assert (backend.truncation, backend.padding) == (None, None)


# Bad strings and tools, one connection.

BAD_STRINGS = [  # (path, body, the field the 400 names): a bad tool, or a lone surrogate in a value or a key
    ("/v1/chat/completions", {**GOOD, "tools": ["x"]}, "tools[0]"),
    ("/v1/chat/completions", {**GOOD, "tools": [1]}, "tools[0]"),
    ("/v1/chat/completions", {**GOOD, "model": "\ud800"}, "model"),
    ("/v1/messages", {**GOOD, "model": "\ud800"}, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "sea \ud800", "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": "a\udfffb"}]}, "messages[0].content"),
    ("/v1/messages", {**GOOD, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {**GOOD, "\udc00": 1}, "a key"),
]


@pytest.mark.parametrize("path, body, field", BAD_STRINGS)
def test_bad_tools_and_lone_surrogates_are_400s_naming_the_field(served, caplog, path, body, field):
    url, _ = served
    status, _, answer = raw(url, path, json.dumps(body).encode())  # json.dumps writes a lone surrogate as \ud800
    message = answer["error"]["message"]
    assert status == 400 and field in message, answer
    if "tools" not in field:
        assert message.startswith(f"'{field}' is not valid UTF-8 text") or field == "a key", message
    assert not any(r.exc_info for r in caplog.records)


def test_a_kept_alive_connection_survives_50_bad_requests(served):
    url, _ = served
    conn = http.client.HTTPConnection("127.0.0.1", port_of(url), timeout=30)
    for i in range(50):
        path, body, _ = BAD_STRINGS[i % len(BAD_STRINGS)]
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert (r.status, r.getheader("connection")) == (400, None), r.read()
        r.read()
    conn.request("POST", "/v1/chat/completions", json.dumps(GOOD), {"Content-Type": "application/json"})
    assert conn.getresponse().status == 200
    conn.close()


# Half-sent bodies.

def statuses_of(socks) -> list:
    """The status each connection was answered with (b"held": none within half a second); each then closed."""
    answers = []
    for s in socks:
        s.settimeout(0.5)
        try:
            answers.append(s.recv(65536).split(b" ", 2)[1])
        except TimeoutError:
            answers.append(b"held")
        s.close()
    return answers


@pytest.mark.slow  # seconds of half-sent bodies; those from many addresses stay in the default tier
def test_half_sent_bodies_from_one_address_leave_room_for_health_and_valid_requests(pair):
    with running(pair, max_connections=16, body_timeout=20) as (url, _):  # 4 bodies per address in flight
        socks = [socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) for _ in range(16)]
        for s in socks:
            s.sendall(head(length=1000) + b"{")
        time.sleep(1.2)  # the held bodies are older than a whole body takes to arrive
        tic = time.monotonic()
        assert raw(url, "/health")[0] == 200
        assert raw(url, "/v1/chat/completions", GOOD)[0] == 200  # takes the place of the oldest held body
        assert time.monotonic() - tic < 5
        answers = statuses_of(socks)
    assert sorted(answers) == [b"408"] + [b"429"] * 12 + [b"held"] * 3, answers


@pytest.mark.slow  # seconds of trickling bodies; half-sent ones from one address stay in the default tier
def test_bodies_trickling_from_one_address_give_way_to_valid_requests(pair):
    with running(pair, max_connections=16, body_timeout=20) as (url, _):  # 4 bodies per address in flight
        socks = [socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) for _ in range(4)]
        for s in socks:
            s.sendall(head(length=1000) + b"{")
        stop = threading.Event()

        def trickle():  # a byte to each body every 0.2 s, until its answer comes
            while not stop.wait(0.2):
                answered, _, _ = select.select(socks, [], [], 0)
                for s in set(socks) - set(answered):
                    with contextlib.suppress(OSError):
                        s.sendall(b" ")

        trickling = threading.Thread(target=trickle)
        trickling.start()
        try:
            time.sleep(1.2)  # longer than a whole body takes to arrive
            tic = time.monotonic()
            statuses = [raw(url, "/v1/chat/completions", GOOD)[0] for _ in range(3)]
            took = time.monotonic() - tic
        finally:
            stop.set()
            trickling.join()
        answers = statuses_of(socks)
    assert statuses == [200] * 3 and took < 5, (statuses, took)
    assert sorted(answers) == [b"408"] + [b"held"] * 3, answers  # the first took the place of the oldest
