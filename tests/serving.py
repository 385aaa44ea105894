"""A test server: `mlx-dflash serve`'s app for a (target, drafter, tokenizer) pair on a free loopback port, in
a thread, as `serve` runs it (ServerConfig's settings, the connection limits), and the clients that talk to
it: the official `openai` client and plain HTTP."""

import contextlib
import dataclasses
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai

from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.server.limits import Limits
from mlx_dflash.server.routes import ServerConfig
from mlx_dflash.server.security import Access
from mlx_dflash.server.engine import Engine
from mlx_dflash.server.routes import uvicorn_server

MODEL = "tiny"  # the model name the test servers answer to
CHAT = [{"role": "user", "content": "Tell me about the sea."}]


@contextlib.contextmanager
def running(pair, max_queue=16, engine_class=Engine, policy=None, engine_options=None, **config):
    """A server for `pair` on a free loopback port: yields (base url, engine); stops both after.
    engine_options: the engine's own keywords (prompt_cache=..., max_batch=...); policy: the width policy
    (default: the pair's fixed default)."""
    target, drafter, tokenizer = pair
    engine = engine_class(lambda: (target, drafter, tokenizer, policy or build_policy(target, drafter)),
                          max_queue=max_queue, **(engine_options or {}))
    server = uvicorn_server(engine, server_config(**config))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        deadline = time.time() + 20
        while not server.started:
            assert thread.is_alive() and time.time() < deadline, "the server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        engine.close()
        sock.close()
        assert not thread.is_alive()


def server_config(**settings) -> ServerConfig:
    """ServerConfig from its settings by name, those of its groups (Limits, Access) among them."""
    groups = {}
    for group in (Limits, Access):
        names = {f.name for f in dataclasses.fields(group)}
        groups[group] = group(**{k: settings.pop(k) for k in list(settings) if k in names})
    return ServerConfig(MODEL, limits=groups[Limits], access=groups[Access], **settings)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_of(url) -> int:
    return int(url.rsplit(":", 1)[1])


def head(path="/v1/chat/completions", length=None, host="127.0.0.1", extra=b"") -> bytes:
    """A POST's request head, as raw bytes (a test then sends the body, or part of it, itself)."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n").encode() + extra + b"\r\n"


def client(url, key="unused", timeout=60):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def raw(url, path, body=None, method=None, headers=None, parse=True):
    """(status, headers, parsed JSON, or bytes unless parse) of one plain HTTP request; body bytes are sent as
    they are."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, json.loads(r.read()) if parse else r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read()) if parse else e.read()


def chat_text(c, stream=False, **kw):
    """(text, response or chunks) of one chat request about CHAT."""
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 16, **kw}
    if not stream:
        r = c.chat.completions.create(**kw)
        return r.choices[0].message.content, r
    chunks = list(c.chat.completions.create(stream=True, **kw))
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks


def wait_until(predicate, seconds=30):
    deadline = time.time() + seconds
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def wait_for_health(server, url, seconds=120):
    """Wait until a server process answers /health (it must not exit first)."""
    deadline = time.time() + seconds
    while True:
        assert server.poll() is None and time.time() < deadline, "the server did not start"
        try:
            if raw(url, "/health")[0] == 200:
                return
        except OSError:
            time.sleep(0.2)


def sse_events(url, path, body, headers=None):
    """(event name, data) of each server-sent event of a streamed POST, read as they come; SSE comments
    (keep-alive pings) as (":", the comment)."""
    import http.client

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    events, name = [], None
    for line in response:
        line = line.decode().rstrip("\n")
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
        elif line.startswith(":"):
            events.append((":", line[1:].strip()))
    conn.close()
    return events
