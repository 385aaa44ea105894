"""`mlx-dflash serve` against what a network sends: clients that leave, oversized and malformed input, slow and
half-sent requests, floods of connections, cross-site requests, and a shutdown in the middle of a stream.

Each test drives a server on a loopback port as clients (and attackers) do: the `openai` client, raw
sockets, plain HTTP; every wait is bounded. The shutdown test runs the real `mlx-dflash serve` process.
"""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

from serve_helpers import pair_with_context
from serving import CHAT, MODEL, chat_text, client, free_port, head, port_of, raw, running, wait_for_health, wait_until
from mlx_dflash.cli import main
from mlx_dflash.server.engine import Engine
from mlx_dflash.server.prompts import Prompts
from mlx_dflash.server.logs import RateLimit
from mlx_dflash.server.protocol import APIError
from mlx_dflash.server.security import allowed_hosts, api_keys

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import hostile  # noqa: E402  (the soak's hostile clients: their loopback addresses)

CONTEXT = 2048
MAX_BODY = 64 << 10
GOOD = {"model": MODEL, "messages": CHAT, "max_tokens": 4}


@pytest.fixture(scope="module")
def pair(tiny_chat_pair):
    return pair_with_context(tiny_chat_pair[1], CONTEXT)


@pytest.fixture(scope="module")
def served(pair):
    with running(pair, body_timeout=1.0, max_connections=12, header_timeout=0.5, max_body_bytes=MAX_BODY) \
            as (url, engine):
        yield url, engine


def send_raw(url, data: bytes, read=True, timeout=10.0) -> bytes:
    """Send bytes on a fresh connection; return what came back until the server closed it."""
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=timeout) as s:
        s.sendall(data)
        if not read:
            return b""
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def log_lines(caplog):
    return [r.message for r in caplog.records if r.name == "mlx_dflash.server"]


# Clients that leave.

def test_a_request_whose_client_leaves_stops_within_a_round_and_is_logged_499(tiny_chat_pair, caplog):
    caplog.set_level(logging.INFO, logger="mlx_dflash.server")
    target, tokenizer, drafter = tiny_chat_pair
    with running((target, drafter, tokenizer)) as (url, engine):
        with pytest.raises(openai.APITimeoutError):  # the client gives up after 1.5 s of a 8192-token answer
            client(url, timeout=1.5).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8192)
        wait_until(lambda: engine.cancelled == 1 and not engine.active, 30)
        # the request's log line is written on the event loop, after the engine thread let go of the job
        wait_until(lambda: any("finish=cancelled" in m for m in log_lines(caplog)), 30)
        line = next(m for m in log_lines(caplog) if "finish=cancelled" in m)
        assert line.startswith("POST /v1/chat/completions 499 ")
        assert int(line.split("completion=")[1].split()[0]) < 8192
        assert chat_text(client(url), max_tokens=3)[1].usage.completion_tokens == 3
        # Streamed: its 200 was sent with the first chunk; the log says 499 (before, 200).
        with client(url).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8192, stream=True) as s:
            next(iter(s))
        wait_until(lambda: engine.cancelled == 2 and not engine.active, 30)
        wait_until(lambda: sum("finish=cancelled" in m for m in log_lines(caplog)) == 2, 30)
        assert [m for m in log_lines(caplog) if "finish=cancelled" in m][1].startswith("POST /v1/chat/completions 499 ")


class SlowPrefill(Engine):
    """The real engine with a prefill of 16-token chunks, each step taking 20 ms more, recording how far the
    prompt being read is."""

    def __init__(self, *args, **kwargs):
        self.progress = []
        super().__init__(*args, prefill_step=16, **kwargs)

    def _step(self):
        events = super()._step()
        self.progress += [(len(p.state.tokens), len(p.request.ids)) for p in self.scheduler.reading]
        time.sleep(0.02)
        return events


def test_a_client_that_leaves_during_the_prefill_stops_it_between_chunks(pair):
    prompt = [5, 17, 42, 99] * 500  # 2000 tokens: 125 chunks, 2.5 s of prefill at least
    with running(pair, engine_class=SlowPrefill) as (url, engine):
        with pytest.raises(openai.APITimeoutError):
            client(url, timeout=0.5).completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        wait_until(lambda: engine.cancelled == 1 and not engine.active, 30)
        processed, total = engine.progress[-1]
        assert total == 2000 and processed < 1500  # stopped long before the prompt's end
        engine.progress.clear()
        stream = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True)
        wait_until(lambda: len(engine.progress) >= 5, 30)
        stream.close()  # the client hangs up while its prompt is read
        wait_until(lambda: engine.cancelled == 2 and not engine.active, 30)
        assert engine.progress[-1][0] < 1500
        assert client(url).completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


# Oversized prompts and outputs, refused or cut before any work.

def test_a_prompt_over_the_context_is_refused_at_once_even_behind_a_long_request(pair):
    with running(pair) as (url, engine):
        c = client(url, timeout=10)
        long = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1900, stream=True)
        next(iter(long))
        wait_until(lambda: len(engine.active) == 1)
        too_long = [{"role": "user", "content": "sea " * 3000}]
        with pytest.raises(openai.BadRequestError) as e:  # answered while the long one still runs
            c.chat.completions.create(model=MODEL, messages=too_long)
        err = e.value.body
        prompt_tokens = len(pair[2].apply_chat_template(too_long, add_generation_prompt=True))
        assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")
        assert err["message"].startswith(f"the prompt is {prompt_tokens} tokens and this model's context is {CONTEXT} ")
        assert len(engine.active) == 1 and engine.waiting == 0
        long.close()


def test_max_tokens_is_cut_to_the_limit_and_the_context(pair):
    with running(pair, max_tokens_limit=5) as (url, _):
        c = client(url)
        for huge in (10**9, 10**30):
            r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=huge)
            assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    target, drafter, tokenizer = pair
    with running(pair) as (url, engine):
        prompt = [7] * (CONTEXT - 3)  # room for 3 tokens
        r = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=100)
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


class RecordingPrompts(Prompts):
    """Records whether prompt_ids ran where an event loop runs."""

    on_loop = None

    def prompt_ids(self, req):
        import asyncio

        try:
            asyncio.get_running_loop()
            self.on_loop = True
        except RuntimeError:
            self.on_loop = False
        return super().prompt_ids(req)


class RecordingTokenizerThread(Engine):
    prompts_class = RecordingPrompts


def test_prompts_are_tokenized_off_the_event_loop(pair):
    with running(pair, engine_class=RecordingTokenizerThread) as (url, engine):
        assert raw(url, "/v1/completions", {"model": MODEL, "prompt": "sea " * 1000, "max_tokens": 2})[0] == 200
        assert engine.prompts.on_loop is False


class SlowPrompts(Prompts):
    """Tokenizing takes TOKENIZE_SECONDS (as a few MB does); records which prompts were tokenized."""

    def prompt_ids(self, req):
        self.tokenized = getattr(self, "tokenized", []) + [req.prompt[-1]["content"][:1]]
        time.sleep(TOKENIZE_SECONDS)
        return super().prompt_ids(req)[:8]


class SlowTokenizer(Engine):
    prompts_class = SlowPrompts


TOKENIZE_SECONDS = 0.5


def big_body(letter: str, count_only: bool) -> dict:
    """A body whose prompt is big (over routes.BIG_PROMPT_CHARACTERS, 2x in bytes), starting with `letter`."""
    from mlx_dflash.server.routes import BIG_PROMPT_CHARACTERS

    body = {"model": MODEL, "messages": [{"role": "user", "content": f"{letter} " * BIG_PROMPT_CHARACTERS}]}
    return body if count_only else {**body, "max_tokens": 1}


@pytest.fixture(scope="module")
def wide_pair(tiny_chat_pair):
    return pair_with_context(tiny_chat_pair[1], 1 << 22)  # a big prompt passes the check before tokenizing


@pytest.mark.parametrize("path", ["/v1/messages/count_tokens", "/v1/chat/completions"])
def test_big_prompts_tokenize_a_few_at_once_count_tokens_too(wide_pair, path):
    """Before, every big prompt waited for the two big-prompt threads however many came (count_tokens took
    no place in any queue): 24-32 of 2.6 MB made others wait 49-59 s. Each body here is 128 KiB: four of
    them hold twice --max-body."""
    n = 12
    with running(wide_pair, engine_class=SlowTokenizer, max_queue=n, max_body_bytes=1 << 18) as (url, engine):
        start, statuses = threading.Barrier(n), []

        def send():
            start.wait()
            status, _, answer = raw(url, path, big_body("a", path.endswith("count_tokens")))
            busy = status == 503 and "is tokenizing" in answer["error"]["message"]  # either API's error shape
            statuses.append((status, "busy" if busy else None))

        threads = [threading.Thread(target=send) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert statuses.count((200, None)) == len(engine.prompts.tokenized) >= 3, statuses
        assert statuses.count((503, "busy")) == n - len(engine.prompts.tokenized) >= n // 2, statuses


def test_a_big_prompt_whose_client_left_is_not_tokenized(wide_pair):
    """Before, a prompt was tokenized whether or not its client was still there, and the others waited."""
    from mlx_dflash.server.routes import BIG_PROMPT_THREADS

    with running(wide_pair, engine_class=SlowTokenizer) as (url, engine):
        body = json.dumps(big_body("a", count_only=True)).encode()
        for _ in range(2 * BIG_PROMPT_THREADS):
            send_raw(url, head("/v1/messages/count_tokens", length=len(body)) + body, read=False)  # and leave
        time.sleep(0.2)
        tic = time.monotonic()
        status, _, answer = raw(url, "/v1/messages/count_tokens", big_body("b", count_only=True))
        assert status == 200 and answer["input_tokens"] == 8
        assert engine.prompts.tokenized.count("a") <= BIG_PROMPT_THREADS  # only those a thread had taken already
        assert time.monotonic() - tic < 3 * TOKENIZE_SECONDS


# Malformed numbers and bodies.

@pytest.mark.parametrize("body, param", [
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": Infinity}', None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": -Infinity}', None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 1e999}', None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 2.5}', "temperature"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "min_p": NaN}', None),
    (b"[" * 10000 + b"]" * 10000, None),
    (b'{"a": ' * 100 + b"1" + b"}" * 100, None),
])
def test_non_finite_numbers_and_deep_nesting_are_400s_in_one_line(served, caplog, body, param):
    url, _ = served
    status, _, answer = raw(url, "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert not any(r.exc_info for r in caplog.records)  # no traceback anywhere
    assert raw(url, "/v1/chat/completions", GOOD)[0] == 200


def test_a_client_that_leaves_during_the_upload_is_one_log_line(served, caplog):
    caplog.set_level(logging.INFO, logger="mlx_dflash.server")
    url, _ = served
    send_raw(url, head(length=1000) + b'{"model": "tiny", "mess', read=False)
    wait_until(lambda: any(" 499 " in m for m in log_lines(caplog)), 10)
    (line,) = [m for m in log_lines(caplog) if " 499 " in m]
    assert line.startswith("POST /v1/chat/completions 499 ") and "disconnected during the upload" in line
    assert not any(r.exc_info for r in caplog.records)


def test_a_body_over_the_limit_sent_whole_before_reading_gets_its_413(served):
    url, _ = served
    body = json.dumps({"model": MODEL, "prompt": "x" * (2 * MAX_BODY)}).encode()
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) as s:
        s.sendall(head("/v1/completions", length=len(body)))
        for i in range(0, len(body), 8192):  # as a client writes a large upload: in pieces, then it reads
            s.sendall(body[i:i + 8192])
            time.sleep(0.01)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 ") and b"--max-body" in answer
    assert raw(url, "/v1/chat/completions", GOOD)[0] == 200


# Slow and half-sent requests, floods of connections.

def test_a_slow_head_is_closed_and_a_slow_body_is_a_408(served):
    url, _ = served
    tic = time.monotonic()
    assert send_raw(url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n") == b""  # closed, no answer
    assert time.monotonic() - tic < 5
    answer = send_raw(url, head(length=100) + b'{"model":')
    assert answer.startswith(b"HTTP/1.1 408 ") and b"--body-timeout" in answer
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) as s:  # after a kept-alive answer too
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = b""
        while not answer.endswith(b"}"):  # the whole answer: head, then the JSON body
            answer += s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 ")
        s.sendall(b"GET /health HTTP/1.1\r\n")
        assert s.recv(65536) == b""


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


@pytest.mark.slow  # seconds of half-sent requests; those from many addresses stay in the default tier
def test_a_flood_of_half_sent_requests_is_capped_and_drained(served):
    url, _ = served
    before = open_fds()

    def flood(n):
        """n connections at once, each a head and a sliver of its body: the status each got (or how it ended)."""
        socks = [socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) for _ in range(n)]
        for s in socks:
            s.sendall(head(length=1000) + b"{")
        answers = []
        for s in socks:
            out = b""
            try:
                while chunk := s.recv(65536):
                    out += chunk
            except ConnectionResetError:  # refused beyond what may linger: closed without reading
                out = b"reset"
            answers.append(out.split(b" ", 2)[1] if out.startswith(b"HTTP/") else out)
            s.close()
        return answers

    answers = flood(20)  # --max-connections 12: 3 bodies held until --body-timeout (408: a quarter of them, per
    # address), the other 9 connections' bodies refused (429), the rest of the connections refused (503)
    assert answers.count(b"503") >= 8 and answers.count(b"408") == 3 and set(answers) == {b"503", b"408", b"429"}, \
        answers
    answers = flood(60)  # beyond the refused ones that may linger too: those are reset
    assert answers.count(b"503") >= 12 and set(answers) <= {b"503", b"408", b"429", b"reset"}, answers
    assert raw(url, "/v1/chat/completions", GOOD)[0] == 200 and raw(url, "/health")[0] == 200
    time.sleep(1.0)
    assert open_fds() <= before + 2  # every connection's descriptor was given back


class Scope:
    """A body's cancel scope, as Uploads sees it."""
    cancelled = False

    def cancel(self):
        self.cancelled = True


def test_uploads_are_bounded_per_address_and_in_all_the_oldest_giving_way():
    from mlx_dflash.server.limits import Uploads

    now = [0.0]
    uploads = Uploads(per_client=2, total=4, clock=lambda: now[0])
    valid, held = Scope(), [Scope() for _ in range(3)]
    uploads.start("127.0.0.1", valid)  # a valid upload, the oldest in flight
    for scope, address in zip(held, ["127.0.0.2", "127.0.0.2", "127.0.0.3"]):  # one client, more addresses
        uploads.start(address, scope)
    uploads.start("127.0.0.4", Scope())  # the total is reached: the oldest of the address sending most gives way
    assert held[0].cancelled and not valid.cancelled and len(uploads.in_flight) == 4
    uploads.end(held[0])  # its read ends after it was cancelled: nothing counted twice
    assert dict(uploads.per_address) == {"127.0.0.1": 1, "127.0.0.2": 1, "127.0.0.3": 1, "127.0.0.4": 1}
    uploads.start("127.0.0.5", Scope())  # all send one: the oldest of all, at once
    assert valid.cancelled
    fresh = [Scope(), Scope()]
    for scope in fresh:
        uploads.start("127.0.0.6", scope)
    with pytest.raises(APIError, match="--max-uploads-per-client 2") as refused:
        uploads.start("127.0.0.6", Scope())  # the address sends 2 young bodies: refused, none cut
    assert refused.value.status == 429 and not fresh[0].cancelled
    now[0] += 1.5
    uploads.start("127.0.0.6", Scope())  # its oldest is 1.5 s old: it gives way
    assert fresh[0].cancelled
    for scope in list(uploads.in_flight):
        uploads.end(scope)
    assert not uploads.in_flight and not uploads.per_address


def test_half_sent_bodies_from_many_addresses_hold_half_the_connections_at_most(pair):
    """One client from four loopback addresses, each within --max-uploads-per-client: before, their held
    bodies took every connection and /health was 503 until --body-timeout."""
    with running(pair, body_timeout=3.0, max_connections=12, max_uploads_per_client=3, header_timeout=2.0) \
            as (url, _):
        socks = []
        for address in hostile.loopback_addresses(4):  # 127.0.0.2-.5, where the system answers them
            for _ in range(3):
                s = socket.create_connection(("127.0.0.1", port_of(url)), timeout=10, source_address=(address, 0))
                s.sendall(head(length=1000) + b"{")
                socks.append(s)
        time.sleep(0.3)
        assert raw(url, "/health")[0] == 200
        assert raw(url, "/v1/chat/completions", GOOD)[0] == 200  # in the place of the oldest held body
        answers = []
        for s in socks:
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            answers.append(out.split(b" ", 2)[1])
            s.close()
        assert answers == [b"408"] * 12, answers  # half of --max-connections held; the others cut to make room


def test_the_same_failure_is_logged_a_few_times_a_second():
    now = [100.0]
    limit = RateLimit(per_second=5, clock=lambda: now[0])

    def record(message="refused a connection", **extra):
        r = logging.LogRecord("mlx_dflash.server", logging.WARNING, __file__, 1, message, None, None)
        r.__dict__.update(extra)
        return r

    passed = [limit.filter(record()) for _ in range(1000)]
    assert sum(passed) == 5
    assert limit.filter(record("another failure")) and limit.filter(record(rate_key=("/v1/x", 400)))
    now[0] += 1
    line = record()
    assert limit.filter(line) and line.getMessage() == "refused a connection (995 more like it not logged)"
    info = logging.LogRecord("mlx_dflash.server", logging.INFO, __file__, 1, "GET /health 200", None, None)
    assert all(limit.filter(info) for _ in range(100))  # answered requests are never dropped


def test_a_request_head_over_16_kib_or_100_headers_is_a_431_in_one_read_too(served):
    """h11 bounds a head still arriving; before, a whole one in one read was answered whatever its size."""
    url, _ = served
    padding = b"X-Pad: " + b"a" * 17000 + b"\r\n"
    for head_bytes in (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + padding + b"\r\n",
                       b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-A: b\r\n" * 150 + b"\r\n",
                       b"GET /" + b"p" * 17000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"):
        answer = send_raw(url, head_bytes)
        assert answer.startswith(b"HTTP/1.1 431 ") and b"request_head_too_large" in answer, answer[:200]
    fine = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + b"X-Pad: " + b"a" * 15000 + \
        b"\r\n" + b"X-A: b\r\n" * 90 + b"\r\n"
    assert send_raw(url, fine).startswith(b"HTTP/1.1 200 ")


def test_requests_to_many_distinct_paths_log_a_few_short_lines(pair):
    """Before, the rate limit keyed failures by their path: 300 distinct 30 KB paths were 300 lines of 30 KB."""
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Keep()
    handler.addFilter(RateLimit())
    server_log = logging.getLogger("mlx_dflash.server")
    server_log.addHandler(handler)
    level, server_log.level = server_log.level, logging.INFO
    try:
        with running(pair) as (url, _):
            tic = time.monotonic()
            for i in range(100):
                answer = send_raw(url, f"GET /{i}{'p' * 10000} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                  "Connection: close\r\n\r\n".encode())
                assert answer.startswith(b"HTTP/1.1 404 ") and len(answer) < 1000  # the path is not echoed whole
                assert send_raw(url, f"GET /{i}{'p' * 30000} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                "Connection: close\r\n\r\n".encode()).startswith(b"HTTP/1.1 431 ")
            seconds = time.monotonic() - tic
    finally:
        server_log.removeHandler(handler)
        server_log.level = level
    lines = [m for m in lines if m.startswith("GET /")]
    assert len(lines) <= 2 * 5 * (int(seconds) + 2), (len(lines), seconds)  # 2 kinds, 5 a second each
    assert max(len(m) for m in lines) < 600


# Who may send requests.

def test_only_loopback_host_names_are_answered_unless_allowed(served):
    url, _ = served
    port = port_of(url)
    for host, status in [("evil.example", b"403"), (f"evil.example:{port}", b"403"), (f"localhost:{port}", b"200"),
                         (f"127.0.0.1:{port}", b"200"), (f"[::1]:{port}", b"200")]:
        answer = send_raw(url, f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        assert answer.split(b" ", 2)[1] == status, (host, answer)
    assert b"--allowed-hosts" in send_raw(url, b"GET /health HTTP/1.1\r\nHost: rebound.example\r\nConnection: close\r\n\r\n")
    assert allowed_hosts("127.0.0.1", ()) == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts("0.0.0.0", ()) is None and allowed_hosts("127.0.0.1", ("*",)) is None
    assert allowed_hosts("192.168.1.5", ("Mac.local",)) == {"localhost", "127.0.0.1", "::1", "192.168.1.5", "mac.local"}


def test_cross_site_requests_are_refused_and_allowed_origins_get_cors(pair, served):
    url, _ = served
    body = json.dumps(GOOD).encode()
    for headers, status in [({"Content-Type": "text/plain"}, 415), ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
                            ({"Origin": "https://evil.example"}, 403)]:
        got, _, answer = raw(url, "/v1/chat/completions", body, headers=headers)
        assert got == status, answer
    assert raw(url, "/v1/chat/completions", body, headers={"Content-Type": "application/json; charset=utf-8"})[0] == 200
    with running(pair, allowed_origins={"http://localhost:3000"}) as (cors_url, _):
        preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "content-type,authorization"}
        status, headers, _ = raw(cors_url, "/v1/chat/completions", method="OPTIONS", headers=preflight, body=None,
                                 parse=False)
        assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:3000"
        status, headers, answer = raw(cors_url, "/v1/chat/completions", GOOD, headers={"Origin": "http://localhost:3000"})
        assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:3000"
        status, headers, _ = raw(cors_url, "/v1/chat/completions", GOOD, headers={"Origin": "https://evil.example"})
        assert status == 403 and "access-control-allow-origin" not in headers


def test_api_key_scheme_any_case_www_authenticate_and_refused_keys(pair):
    with running(pair, api_keys=("s3cret",)) as (url, _):
        for header in ("Bearer s3cret", "bearer s3cret", "BEARER  s3cret"):
            assert raw(url, "/v1/chat/completions", GOOD, headers={"Authorization": header})[0] == 200, header
        assert raw(url, "/v1/chat/completions", GOOD, headers={"x-api-key": "s3cret"})[0] == 200
        status, headers, _ = raw(url, "/v1/models", headers={"Authorization": "Bearer nope"})
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
    keys = api_keys(("key-a,key-b", "key-c", "key-a"))  # --api-key key-a,key-b --api-key key-c --api-key key-a
    assert keys == ("key-a", "key-b", "key-c")
    with running(pair, api_keys=keys) as (url, _):
        for key in keys:
            assert raw(url, "/v1/chat/completions", GOOD, headers={"x-api-key": key})[0] == 200, key
        assert raw(url, "/v1/chat/completions", GOOD, headers={"x-api-key": "key-d"})[0] == 401
    runner = CliRunner()
    for args, words in [(["--api-key", ""], "--api-key is empty"), (["--api-key", "a,,b"], "--api-key is empty"),
                        (["--api-key", "ключ"], "printable ASCII"),
                        (["--api-key", "two words"], "printable ASCII"), (["--temp", "nan"], "finite numbers"),
                        (["--body-timeout", "0"], "--body-timeout"), (["--max-connections", "0"], "--max-connections"),
                        (["--prefill-step-size", "0"], "--prefill-step-size"), (["--max-queue", "-1"], "--max-queue"),
                        (["--max-kept-bytes", "-1"], "--max-kept-bytes"),
                        (["--shutdown-grace", "-1"], "--shutdown-grace"),
                        (["--max-batch", "0"], "--max-batch"), (["--prompt-cache-size", "-1"], "--prompt-cache-size"),
                        (["--max-uploads-per-client", "0"], "--max-uploads-per-client"),
                        (["--max-tokens-limit", "0"], "--max-tokens-limit"), (["--port", "70000"], "--port")]:
        r = runner.invoke(main, ["serve", *args])  # refused in one line, before anything loads
        assert r.exit_code == 1 and words in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_max_queue_0_takes_a_request_when_idle_and_refuses_one_more(pair):
    with running(pair, max_queue=0, engine_options=dict(max_batch=1)) as (url, engine):
        assert chat_text(client(url), max_tokens=2)[1].usage.completion_tokens == 2
        long = client(url).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1500, stream=True)
        next(iter(long))
        with pytest.raises(openai.APIStatusError) as e:
            chat_text(client(url), max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
        long.close()


# Shutdown.

@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    from sharded_models import save_random_drafter, save_tiny_target
    from mlx_dflash.downloads import ensure_smollm2

    root = tmp_path_factory.mktemp("shutdown")
    target = save_tiny_target(root / "target", "qwen2", ensure_smollm2("float32"), max_position_embeddings=100000)
    return target, save_random_drafter(root / "drafter", target, block_size=4)


@pytest.mark.slow
def test_sigterm_mid_stream_ends_it_with_an_error_after_the_grace_and_exits_0(pair_dirs):
    target, drafter = pair_dirs
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlx_dflash.cli", "serve", "--model", str(target), "--drafter",
                               str(drafter), "--model-name", MODEL, "--port", str(port), "--shutdown-grace", "1",
                               "--max-batch", "1"],  # one at a time: the second request waits
                              stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(server, url)
        stream = client(url).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10**9, stream=True)
        chunks = iter(stream)
        next(chunks), next(chunks)  # generating (8192 tokens at most: --max-tokens-limit)
        queued = []
        waiter = threading.Thread(target=lambda: queued.append(_error_of(lambda: chat_text(client(url), max_tokens=2))))
        waiter.start()
        time.sleep(0.5)
        tic = time.monotonic()
        server.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in chunks:
                pass
        assert time.monotonic() - tic < 10  # the grace (1 s) and a round, not the 8192 tokens
        assert server.wait(timeout=20) == 0
        waiter.join(timeout=20)
        assert queued and "shutting down" in queued[0]  # the waiting one was answered 503 at once
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    log = server.stderr.read()
    assert "Traceback" not in log, log


def _error_of(call) -> str:
    try:
        call()
    except openai.APIError as e:
        return str(e)
    return "no error"
