"""`mlx-dflash serve` under a hostile client's load: a burst of requests beyond --max-queue, prompts of
megabytes beside a short one, bad strings and tools on one kept-alive connection, half-sent bodies from one
address. Each was a defect a probe of the server found; each test drives a server on a loopback port,
every wait bounded."""

import http.client
import json
import socket
import threading
import time

import pytest

from serve_helpers import pair_with_context
from serving import CHAT, MODEL, head, port_of, raw, running, wait_until
from mlx_dflash.dcut import build_batch_policy
from mlx_dflash.server.batching import BatchEngine

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
    engine = dict(engine_class=BatchEngine, engine_options=dict(max_batch=batch),
                  policy=build_batch_policy(target, drafter, batch, 4)) if batch > 1 else {}
    with running(pair, max_queue=max_queue, **engine) as (url, served):
        statuses = burst(url, 12, {**GOOD, "max_tokens": 1500, "stream": True})
        assert sorted(statuses, key=str) == [200] * (batch + max_queue) + ["queue_full"] * (12 - batch - max_queue)
        wait_until(lambda: served.waiting == 0 and served.cancelled == batch + max_queue, 60)
        assert raw(url, "/v1/chat/completions", GOOD)[0] == 200


# Prompts of megabytes.

def test_a_small_request_is_answered_while_big_prompts_tokenize(pair):
    big = {"model": MODEL, "max_tokens": 4, "messages": [  # an assistant turn's text: tokenized, then refused
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "sea " * (1 << 19)},
        {"role": "user", "content": "Go on."}]}
    with running(pair, max_body_bytes=8 << 20) as (url, engine):
        tic = time.monotonic()
        assert raw(url, "/v1/chat/completions", GOOD)[0] == 200
        alone = time.monotonic() - tic
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(raw(url, "/v1/chat/completions", big)))
                   for _ in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: engine.waiting == 3)  # admitted: read, and being tokenized
        tic = time.monotonic()
        assert raw(url, "/v1/chat/completions", GOOD)[0] == 200
        beside = time.monotonic() - tic
        still_tokenizing = engine.waiting
        for t in threads:
            t.join(timeout=120)
    assert beside < 5 * alone + 1.0, (beside, alone)
    assert still_tokenizing == 3  # it overtook them
    assert [a[2]["error"]["code"] for a in answers] == ["context_length_exceeded"] * 3


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


# Bad strings and tools, one connection.

BAD_STRINGS = [  # (path, body, the field the 400 names): each was a 500 with two tracebacks
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

def test_half_sent_bodies_from_one_address_leave_room_for_health_and_valid_requests(pair):
    with running(pair, max_connections=16, body_timeout=20) as (url, _):  # 4 bodies per address in flight
        socks = [socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) for _ in range(16)]
        for s in socks:
            s.sendall(head(length=1000) + b"{")
        time.sleep(1.2)  # the held bodies stall (nothing more comes)
        tic = time.monotonic()
        assert raw(url, "/health")[0] == 200
        assert raw(url, "/v1/chat/completions", GOOD)[0] == 200  # takes the place of the longest stalled body
        assert time.monotonic() - tic < 5
        answers = []
        for s in socks:
            s.settimeout(0.5)
            try:
                answers.append(s.recv(65536).split(b" ", 2)[1])
            except TimeoutError:
                answers.append(b"held")
            s.close()
    assert sorted(answers) == [b"408"] + [b"429"] * 12 + [b"held"] * 3, answers
