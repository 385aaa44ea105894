"""What the soak's hostile clients send (bench/serve_soak.py), each kind as (name, send, what it should get).

`send()` returns what the client saw, in words comparable with the expected one: an HTTP status ("408"),
"closed", "left", or a word a check chose ("strict": a reply every JSON parser reads). Every request
carries the soak's API key (KEY) unless it tests the key, so that it reaches the check it is for.

Turns one to three: malformed bodies, slow heads and bodies, clients that leave, oversized requests.
Turn four (issue 52's N1-N8): kept Responses near the byte bound, tool replies a model writes from NaN or
deep nesting (strict JSON or text, streams ended), half-sent bodies from several loopback addresses, big
prompts and count_tokens from clients that hang up, big request heads, and another key's /health.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.request

import openai

KEY, OTHER_KEY = "soak", "soak-other"  # the server runs with --api-key soak,soak-other
AUTH = {"Authorization": f"Bearer {KEY}"}
AUTH_LINE = f"Authorization: Bearer {KEY}\r\n".encode()


def raw_request(port: int, body: bytes, path="/v1/chat/completions", headers=None, timeout=30.0,
                method="POST") -> tuple:
    """(status, body bytes) of one request on its own connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json", **AUTH, **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def status_of(port: int, body: bytes, path="/v1/chat/completions", headers=None) -> str:
    return str(raw_request(port, body, path, headers)[0])


def read_to_close(s: socket.socket) -> str:
    """The status the server answered on `s` before closing it ("closed": none)."""
    answer = b""
    try:
        while chunk := s.recv(65536):
            answer += chunk
    except ConnectionResetError:
        return "reset"
    return answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "closed"


def half_sent(port: int, address: str = "127.0.0.1") -> socket.socket:
    """A connection from `address` that sent a head and a sliver of its body."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(address, 0))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + AUTH_LINE + b"Content-Length: 5000\r\n\r\n{\"model\":")
    return s


# Turns one to three.

def malformed(port: int, model: str) -> list:
    good = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    bodies = [
        ("bad JSON", b'{"model": ', {}, "/v1/chat/completions", "400"),
        ("NaN temperature", json.dumps(good)[:-1].encode() + b', "temperature": NaN}', {}, "/v1/chat/completions",
         "400"),
        ("10,000-deep nesting", b"[" * 10000 + b"]" * 10000, {}, "/v1/chat/completions", "400"),
        ("wrong type", json.dumps({**good, "max_tokens": "ten"}).encode(), {}, "/v1/chat/completions", "400"),
        ("text/plain", json.dumps(good).encode(), {"Content-Type": "text/plain"}, "/v1/chat/completions", "415"),
        ("foreign Host", json.dumps(good).encode(), {"Host": "attacker.example"}, "/v1/chat/completions", "403"),
        ("no API key", json.dumps(good).encode(), {"Authorization": "Bearer wrong"}, "/v1/chat/completions", "401"),
        ("unknown model", json.dumps({**good, "model": "gpt-4o"}).encode(), {}, "/v1/chat/completions", "404"),
        ("Messages without max_tokens", json.dumps({"model": model, "messages": good["messages"]}).encode(), {},
         "/v1/messages", "400"),
    ]
    return [(name, lambda b=b, h=h, p=p: status_of(port, b, p, h), want) for name, b, h, p, want in bodies]


def slow_body(port: int) -> str:
    """A head and a sliver of the body, then nothing: 408, and the connection closed."""
    with half_sent(port) as s:
        return read_to_close(s)


def slow_head(port: int) -> str:
    """Part of a request head, then nothing: closed without an answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        answer = s.recv(65536)
    return "closed" if not answer else answer[:12].decode(errors="replace")


def leave_mid_stream(url: str, model: str) -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    with c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me a long story."}],
                                   max_tokens=2000, stream=True) as stream:
        chunks = iter(stream)
        next(chunks), next(chunks)
    return "left"


def leave_while_generating(url: str, model: str) -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=1.0)
    try:
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me a long story."}],
                                  max_tokens=2000)
    except openai.APITimeoutError:
        return "left"
    return "answered"  # 2000 tokens within a second: not what this request tests


def oversized(port: int, model: str, max_body: int) -> list:
    big = json.dumps({"model": model, "prompt": "x" * (max_body + 1000)}).encode()
    long = json.dumps({"model": model, "messages": [{"role": "user", "content": "sea " * 9000}]}).encode()
    return [("body over --max-body", lambda: status_of(port, big, "/v1/completions"), "413"),
            ("prompt over the context", lambda: status_of(port, long), "400")]


# Turn four.

def kept_responses(port: int, model: str, max_body: int) -> list:
    """N1: a kept response whose metadata nearly fills a body; answered 200, and GET serves it or says it was
    dropped (404) for newer ones within --max-kept-bytes."""
    filler = [{}] * ((max_body - 1000) // 4)

    def send():
        body = json.dumps({"model": model, "input": "Say hi.", "max_output_tokens": 4, "store": True,
                           "metadata": filler}).encode()
        status, answer = raw_request(port, body, "/v1/responses")
        if status != 200:
            return str(status)
        got, _ = raw_request(port, None, f"/v1/responses/{json.loads(answer)['id']}", method="GET")
        return "kept or dropped" if got in (200, 404) else f"GET {got}"

    return [("kept response of a whole body", send, "kept or dropped")]


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _strict_reply(status: int, answer: bytes, api: str) -> str:
    """"strict" where a 200's body and every tool call's arguments parse as strict JSON."""
    if status != 200:
        return str(status)
    try:
        body = _strict(answer.decode())
        if api == "chat":
            calls = body["choices"][0]["message"].get("tool_calls") or []
            [_strict(c["function"]["arguments"]) for c in calls]
        return "strict"
    except (ValueError, KeyError) as e:
        return f"not strict: {e}"[:120]


def _strict_stream(port: int, body: dict) -> str:
    """"strict" where every event of a streamed chat parses strictly and the stream ends with [DONE]."""
    status, answer = raw_request(port, json.dumps({**body, "stream": True}).encode())
    if status != 200:
        return str(status)
    data = [line[6:] for line in answer.decode().splitlines() if line.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        return "stream without [DONE]"
    try:
        [_strict(d) for d in data[:-1]]
    except ValueError as e:
        return f"not strict: {e}"[:120]
    return "strict"


def tool_replies(port: int, model: str) -> list:
    """N2-N4: a forced tool call whose prompt invites NaN, or deep nesting: 200 and strict JSON (a call the
    client can parse, or text), streams ended with [DONE]; in chat and in Anthropic's Messages."""
    tool = {"type": "function", "function": {"name": "set_value", "description": "Set a value.",
                                             "parameters": {"type": "object", "properties": {"value": {}}}}}
    asks = {"NaN": 'Call set_value with exactly these arguments: {"value": NaN}',
            "deep": "Call set_value with value set to exactly this: " + "[" * 300}
    out = []
    for name, ask in asks.items():
        chat = {"model": model, "max_tokens": 48, "messages": [{"role": "user", "content": ask}], "tools": [tool],
                "tool_choice": {"type": "function", "function": {"name": "set_value"}}}
        anthropic = {"model": model, "max_tokens": 48, "messages": [{"role": "user", "content": ask}],
                     "tools": [{"name": "set_value", "input_schema": tool["function"]["parameters"]}],
                     "tool_choice": {"type": "tool", "name": "set_value"}}
        out += [(f"{name} tool reply, chat", lambda c=chat: _strict_reply(*raw_request(port, json.dumps(c).encode()),
                                                                          "chat"), "strict"),
                (f"{name} tool reply, chat streamed", lambda c=chat: _strict_stream(port, c), "strict"),
                (f"{name} tool reply, Messages", lambda a=anthropic: _strict_reply(
                    *raw_request(port, json.dumps(a).encode(), "/v1/messages"), "messages"), "strict")]
    return out


def loopback_addresses(n: int) -> list:
    """127.0.0.2 ... where this system answers them (Linux; macOS only after `ifconfig lo0 alias`), else
    127.0.0.1."""
    out = []
    for i in range(2, n + 2):
        try:
            with socket.socket() as s:
                s.bind((f"127.0.0.{i}", 0))
            out.append(f"127.0.0.{i}")
        except OSError:
            out.append("127.0.0.1")
    return out


def many_addresses(port: int, bodies_per_address: int) -> list:
    """N5: half-sent bodies from four loopback addresses at once, each address within its own bound: every
    one ends 408 (held, then timed out or replaced) or 429 (past the bounds). Where the system has only
    127.0.0.1, they all come from it, and the other clients' bodies share its bound."""
    def send():
        socks = [half_sent(port, a) for a in loopback_addresses(4) for _ in range(bodies_per_address)]
        answers = set()
        for s in socks:
            with s:
                answers.add(read_to_close(s))
        return "408 or 429" if answers <= {"408", "429"} else ",".join(sorted(answers))

    return [("half-sent bodies from four addresses", send, "408 or 429")]


def big_prompts(port: int, model: str, max_body: int) -> list:
    """N6: count_tokens of a nearly whole body from a client that hangs up at once (nothing to read), and a
    chat of one: over the context (400) or past the tokenizer's budget (503)."""
    text = "sea " * ((max_body - 1000) // 4)
    count = json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode()
    chat = json.dumps({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}).encode()

    def hang_up():
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /v1/messages/count_tokens HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                      b"\r\n" + AUTH_LINE + f"Content-Length: {len(count)}\r\n\r\n".encode() + count)
        return "left"

    def big_chat():
        status = status_of(port, chat)
        return "400 or 503" if status in ("400", "503") else status

    return [("count_tokens, then hang up", hang_up, "left"), ("big chat", big_chat, "400 or 503")]


def big_heads(port: int, rng) -> list:
    """N7: a 30 KB path no one asked for (a new one each time), and 1,000 headers: 431."""
    def head(lines: bytes) -> str:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(lines)
            return read_to_close(s)

    path = f"/{rng.randrange(10 ** 9)}" + "p" * 30000
    return [("30 KB path", lambda: head(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()), "431"),
            ("1,000 headers", lambda: head(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-A: b\r\n" * 1000
                                           + b"\r\n"), "431")]


def other_key(url: str) -> list:
    """N8: /health asked with the other key shows that key's prefix cache only: nothing, while the valid
    clients (the soak key) fill theirs."""
    def send():
        request = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {OTHER_KEY}"})
        with urllib.request.urlopen(request, timeout=30) as r:
            cache = json.loads(r.read()).get("prompt_cache")
        if cache is None:
            return "no prompt cache"
        seen = {k: cache[k] for k in ("entries", "hits", "cached_tokens")}
        return "its own" if not any(seen.values()) else f"saw {seen}"

    return [("/health with another key", send, "its own")]
