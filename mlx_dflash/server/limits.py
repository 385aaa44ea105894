"""What the server takes from a network before the models see anything: connections, headers, bodies, JSON.

- Connections: at most `--max-connections` open at once; one more is answered 503 and closed (within
  half a second, so that the client can read the answer), so a flood of idle or half-sent requests
  cannot use up the process's file descriptors (the limit on open files is raised to fit, where the
  system allows).
- Headers: a connection that has not sent a whole request head within `--header-timeout` seconds (after
  it opened, or after its previous response) is closed; heads over h11's 16 KB are a 400 (uvicorn's).
- Bodies: at most `--max-body` bytes (413), arriving within `--body-timeout` seconds (408); both answers
  close the connection. A body up to 4 times the limit is read to its end (and dropped) before its 413,
  so that a client that sends all of it before reading gets the answer rather than a broken pipe. A
  client that leaves mid-upload is one log line (status 499), not a traceback. One client address has
  at most `--max-uploads-per-client` bodies in flight, and all of them together half of
  `--max-connections` (`Uploads`), so that half-sent bodies cannot hold every connection or keep valid
  ones out.
- JSON: `application/json` (security.py), valid UTF-8 JSON, numbers finite (NaN and Infinity are not
  JSON, 1e999 is refused rather than read as infinity), nested at most MAX_DEPTH deep, every string (keys
  too) text: JSON's `\\ud800` escape without its pair is no character, and would fail later, where the
  string is encoded (the tokenizer, an error message naming it).
"""

import collections
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Optional

import anyio
import anyio.to_thread

from ..errors import DFlashError
from .protocol import APIError

log = logging.getLogger("mlx_dflash.server")
MAX_DEPTH = 64
FILES_BESIDES_CONNECTIONS = 128  # model files, logs, pipes, the event loop's own
DRAIN_FACTOR = 4  # a body up to this many times --max-body is read (and dropped) before its 413
LINGER_SECONDS = 0.5  # a refused connection waits this long for its client to read the 503
UPLOAD_GRACE_SECONDS = 1.0  # a body in flight this long gives way to a new one from its address (one arrives in ms)


@dataclass(frozen=True)
class Limits:
    """What the server takes at most (serve's flags of the same names), checked as they are made."""

    max_body_bytes: int = 4 << 20  # --max-body
    max_kept_bytes: int = 64 << 20  # kept Responses per API key (4x that across keys), as JSON bytes
    max_tokens_limit: int = 8192  # a request's max_tokens is cut to this (and to what the context leaves)
    max_connections: int = 128
    max_uploads_per_client: Optional[int] = None  # bodies in flight per client address (None: max_connections // 4)
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    shutdown_grace: float = 10.0  # seconds the running requests may go on after Ctrl-C or SIGTERM

    def __post_init__(self):
        at_least_one = {"--max-body": self.max_body_bytes, "--max-tokens-limit": self.max_tokens_limit,
                        "--max-connections": self.max_connections,
                        "--max-uploads-per-client": self.max_uploads_per_client}
        for flag, value in at_least_one.items():
            if value is not None and value < 1:
                raise DFlashError(f"{flag} must be at least 1, got {value}")
        if self.max_kept_bytes < 0:
            raise DFlashError(f"--max-kept-bytes must be at least 0, got {self.max_kept_bytes}")
        for flag, value in {"--header-timeout": self.header_timeout, "--body-timeout": self.body_timeout}.items():
            if not value > 0:
                raise DFlashError(f"{flag} must be positive seconds, got {value}")
        if not self.shutdown_grace >= 0:
            raise DFlashError(f"--shutdown-grace must be at least 0 seconds, got {self.shutdown_grace}")

    @property
    def uploads_per_client(self) -> int:
        return self.max_uploads_per_client or max(1, self.max_connections // 4)
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a surrogate's way into JSON (raw, it is not UTF-8)
SURROGATE = re.compile("[\ud800-\udfff]")  # left after parsing only without its pair


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]} is out of range")
    return value


def _non_json_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _depth(value) -> int:
    """How deeply a parsed JSON value nests (iterative: the value may be deeper than Python's recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo += [(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return deepest


def _lone_surrogate_at(value) -> Optional[str]:
    """The field (a path such as messages[0].content) whose string holds a lone surrogate, or None."""
    todo = [(value, "", None)]
    while todo:
        v, parent, key = todo.pop()
        at = parent if key is None else f"{parent}[{key}]" if isinstance(key, int) else \
            f"{parent}.{key}" if parent else key
        if isinstance(v, str) and SURROGATE.search(v):
            return at or "the body"
        if isinstance(v, dict):
            if any(SURROGATE.search(k) for k in v):
                return f"a key in {at or 'the body'}"
            todo += [(x, at, k) for k, x in v.items() if isinstance(x, (str, list, dict))]
        elif isinstance(v, list):
            todo += [(x, at, i) for i, x in enumerate(v) if isinstance(x, (str, list, dict))]
    return None


def parse_json(body: bytes):
    try:
        value = json.loads(body, parse_float=_finite, parse_constant=_non_json_constant)
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})"[:300]) from None
    if _depth(value) > MAX_DEPTH:
        raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels")
    if SURROGATE_ESCAPE.search(body) and (at := _lone_surrogate_at(value)) is not None:
        raise APIError(400, f"'{at[:200]}' is not valid UTF-8 text: it holds a lone surrogate (a \\ud800-\\udfff "
                       "escape without its pair)", param=at[:200])
    return value


class Uploads:
    """Request bodies in flight (head read, body not yet): at most `per_client` from one client address and
    `total` from all of them at once.

    What is bounded is bodies, not connections: every client on this machine comes from 127.0.0.1, and
    a bound on its connections would bound all of them together, kept-alive and streaming ones included,
    while a whole request's body arrives in milliseconds; a half-sent body is how one client holds a
    connection until --body-timeout. Past the address's bound, a new body takes the place of that
    address's body in flight longest once that is UPLOAD_GRACE_SECONDS old (it is answered 408), and is
    refused (429) otherwise: every local client is one address, so a burst of valid bodies is refused,
    to be retried, rather than one cut mid-upload. The total bound is there because loopback is a whole
    network (127.0.0.0/8): one client sending from 127.0.0.2, .3, ... has as many addresses as it likes.
    Past it, a new body always takes the place of the one in flight longest from the address sending the
    most: a flood of fresh half-sent bodies cannot keep valid ones out (with a grace, it answered every
    other body 429), and cuts its own bodies before a valid upload from an address sending few (the
    oldest from any address, it cut a 1 MB upload under load). Held bodies hold at most `total`
    connections. The age, not the time since a body last received, decides: a body
    trickling a byte at a time is as held as a silent one, and any minimum rate would leave the client its
    bodies at that rate.
    Only the event loop touches it."""

    def __init__(self, per_client: int, total: int, clock=time.monotonic):
        self.per_client, self.total, self.clock = per_client, total, clock
        self.in_flight: dict = {}  # cancel scope -> (client address, when its body started), oldest first
        self.per_address = collections.Counter()

    def start(self, address: str, scope) -> None:
        if self.per_address[address] >= self.per_client:
            oldest = next(s for s, (a, _) in self.in_flight.items() if a == address)
            if self.clock() - self.in_flight[oldest][1] < UPLOAD_GRACE_SECONDS:
                raise APIError(429, f"this client address is sending {self.per_address[address]} request bodies "
                               f"already (--max-uploads-per-client {self.per_client}); retry when one has arrived",
                               code="too_many_uploads", headers={"Connection": "close", "Retry-After": "1"})
            self._cut(oldest)
        if len(self.in_flight) >= self.total:
            most = max(self.per_address.values())
            self._cut(next(s for s, (a, _) in self.in_flight.items() if self.per_address[a] == most))
        self.in_flight[scope] = (address, self.clock())
        self.per_address[address] += 1

    def _cut(self, scope) -> None:
        self.end(scope)
        scope.cancel()  # its read ends with a 408

    def end(self, scope) -> None:
        entry = self.in_flight.pop(scope, None)
        if entry is None:  # cancelled to make room, and ended since
            return
        self.per_address[entry[0]] -= 1
        if not self.per_address[entry[0]]:
            del self.per_address[entry[0]]


async def read_json(request, max_bytes: int, timeout: float, uploads: Optional[Uploads] = None):
    """(the request's JSON body, its size in bytes), read within the size and time limits (and the uploads'
    bound per client address). A body over the size limit (up to DRAIN_FACTOR times it) is read to its end
    and dropped before the 413: a client that sends its whole body before it reads the answer then gets
    the answer, not a broken pipe."""
    from starlette.requests import ClientDisconnect

    close = {"Connection": "close"}  # the unread rest of a body would otherwise be the next request
    too_large = APIError(413, f"the request body is larger than {max_bytes} bytes (--max-body)", headers=close)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > DRAIN_FACTOR * max_bytes:
        raise too_large
    chunks, size = [], 0
    address = request.client.host if request.client else ""
    scope = anyio.CancelScope(deadline=anyio.current_time() + timeout)
    if uploads is not None:
        uploads.start(address, scope)
    try:
        with scope:
            async for chunk in request.stream():
                size += len(chunk)
                if size <= max_bytes:
                    chunks.append(chunk)
                elif size > DRAIN_FACTOR * max_bytes:
                    break
    except ClientDisconnect:
        raise APIError(499, "the client disconnected during the upload") from None
    finally:
        if uploads is not None:
            uploads.end(scope)
    if size > max_bytes:
        raise too_large
    if scope.cancelled_caught:
        late = anyio.current_time() >= scope.deadline
        raise APIError(408, f"the request body did not arrive within {timeout:g} s (--body-timeout)" if late else
                       f"the request body was still arriving after {UPLOAD_GRACE_SECONDS:g} s and gave its place to "
                       "a newer one (bodies in flight are bounded per client address, --max-uploads-per-client, and "
                       "in all, half of --max-connections)", headers=close)
    return await anyio.to_thread.run_sync(parse_json, b"".join(chunks)), size  # 4 MB of JSON: not on the event loop


def open_files_for(max_connections: int) -> None:
    """Raise the soft limit on open files to fit the connections, or refuse the flag in one line."""
    import resource

    from ..errors import DFlashError

    need = 2 * max_connections + FILES_BESIDES_CONNECTIONS  # the open ones, and as many refused ones lingering
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise DFlashError(f"--max-connections {max_connections} needs {need} open files and this process may "
                              f"open {hard} (ulimit -Hn): lower --max-connections")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def limited_protocol(max_connections: int, header_timeout: float):
    """uvicorn's h11 protocol with the connection cap and the header timeout (uvicorn.Config(http=...))."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    refusal = json.dumps({"error": {"message": f"the server has {max_connections} connections open "
                                    "(--max-connections); retry later", "type": "server_overloaded",
                                    "param": None, "code": "too_many_connections"}}).encode()
    busy = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(refusal)).encode() + b"\r\n\r\n" + refusal)

    lingering = set()  # refused connections waiting for their client to read the 503 and hang up

    class LimitedH11Protocol(H11Protocol):
        header_timer = None
        refused = False

        def connection_made(self, transport):
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                return self._refuse(transport)
            self._expect_head()

        def _refuse(self, transport):
            """Answer 503 and close. Closing at once, with the client's request unread, would reset the
            connection and lose the answer: unless too many linger already, wait a moment for the client."""
            log.warning(f"refused a connection: {max_connections} are open (--max-connections)",
                        extra={"rate_key": "too many connections"})
            self.refused = True
            self.connections.discard(self)
            transport.write(busy)
            if len(lingering) < max_connections and transport.can_write_eof():
                lingering.add(self)
                transport.write_eof()
                self.loop.call_later(LINGER_SECONDS, transport.close)
            else:
                transport.close()

        def data_received(self, data):
            if not self.refused:  # a refused connection's request is read and dropped
                super().data_received(data)

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._expect_head()  # a kept-alive connection's next request head has the same time

        def connection_lost(self, exc):
            lingering.discard(self)
            if self.header_timer is not None:
                self.header_timer.cancel()
            super().connection_lost(exc)

        def _expect_head(self):
            if self.header_timer is not None:
                self.header_timer.cancel()
            self.header_timer = self.loop.call_later(header_timeout, self._head_late)

        def _head_late(self):
            self.header_timer = None
            waiting = self.cycle is None or self.cycle.response_complete  # no request head since
            if waiting and not self.transport.is_closing():
                if self.conn.trailing_data[0]:  # part of a head came: say why it closes
                    log.info(f"closed a connection: no whole request head within {header_timeout:g} s "
                             "(--header-timeout)", extra={"rate_key": "slow head"})
                self.transport.close()

    return LimitedH11Protocol
