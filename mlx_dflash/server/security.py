"""Who may talk to the server: the size of a request's head, the Host and Origin it names, its content
type, its API key.

- Head: at most MAX_HEAD_BYTES of request line and headers, and MAX_HEADERS headers (431). h11 bounds
  only a head still arriving (16 KB); a whole one that comes in one read is parsed whatever its size.
- Host: a server bound to a loopback address answers only requests naming a loopback host (`localhost`,
  `127.0.0.1`, `[::1]`, any port), so a web page whose DNS name is rebound to 127.0.0.1 cannot reach it;
  `--allowed-hosts` adds names. One bound to another address (`--host 0.0.0.0`) answers any Host unless
  `--allowed-hosts` lists them.
- Origin: browsers name the page that sends a request. Requests from pages are refused (403) unless
  `--allowed-origins` lists the page's origin; those get CORS headers (Starlette's CORSMiddleware).
- API keys: with `--api-key` (one or more), every path but /health needs `Authorization: Bearer KEY` (the
  scheme in any case, RFC 7235) or `x-api-key: KEY` (as Anthropic's clients send it); a 401 names the
  scheme in `WWW-Authenticate`. Keys are compared in constant time. The request's scope says whether it
  sent a valid key ("dflash.authorized": /health shows its counters only then) and, with several keys,
  which ("dflash.cache_scope", a hash of it: the prefix cache serves a request only what requests with
  the same key left there, so that a client cannot learn from cache hits what another sent).
- Content type: request bodies must be `application/json` (415): a cross-site form or `text/plain` POST,
  which a browser sends without asking the server first, never reaches the model.
Errors are in the shape of the API the path belongs to (OpenAI's, or Anthropic's under /v1/messages).
"""

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass, field
from typing import Optional

from .anthropic import PATHS as ANTHROPIC_PATHS, error_body as anthropic_error_body
from .protocol import APIError

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
MAX_HEAD_BYTES = 16 << 10
MAX_HEADERS = 100


def error_response(e: APIError, path: str):
    from starlette.responses import JSONResponse

    body = anthropic_error_body(e) if path.startswith(ANTHROPIC_PATHS) else e.body()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def allowed_hosts(bound: str, extra: tuple) -> Optional[set]:
    """The Host names the server answers (lower case, no port), or None for any."""
    if "*" in extra:
        return None
    if not is_loopback(bound) and not extra:
        return None
    return LOOPBACK_NAMES | ({bound.lower()} if not is_loopback(bound) else set()) | {h.lower() for h in extra}


def api_keys(given: tuple) -> tuple:
    """The keys from --api-key's values (repeated, or comma-separated), each checked: a key no client can
    send is refused before anything loads (a DFlashError, one line)."""
    from ..errors import DFlashError

    keys = tuple(k for value in given for k in value.split(","))
    if any(not k for k in keys):
        raise DFlashError("--api-key is empty (or MLX_DFLASH_API_KEY is, or holds an empty key between commas): "
                          "give a key, or leave it out to serve without one")
    if not all(k.isascii() and k.isprintable() and " " not in k for k in keys):
        raise DFlashError("--api-key must be printable ASCII without spaces (letters, digits, punctuation): HTTP "
                          "clients cannot all send other characters in a header")
    return tuple(dict.fromkeys(keys))


@dataclass(frozen=True)
class Access:
    """Who may call the server: its API keys (any of them is accepted; several: the prefix cache is kept apart
    per key), the Host names it answers (None: any) and the web origins whose pages may call it."""

    api_keys: tuple = ()
    allowed_hosts: Optional[frozenset] = frozenset(LOOPBACK_NAMES)
    allowed_origins: frozenset = field(default_factory=frozenset)

    @classmethod
    def from_flags(cls, host: str, api_key: tuple, hosts: str, origins: str) -> "Access":
        """--api-key (checked: `api_keys`), and --allowed-hosts and --allowed-origins (comma-separated) for a
        server bound to `host`."""
        names = allowed_hosts(host, _names(hosts))
        return cls(api_keys(api_key), None if names is None else frozenset(names), frozenset(_names(origins)))


def _names(flag: str) -> tuple:
    return tuple(n.strip() for n in flag.split(",") if n.strip())


def cache_scope(key: bytes) -> str:
    """The prefix cache's name for one key's entries (a hash: the key itself is not kept, nor written)."""
    return hashlib.sha256(b"mlx-dflash prompt cache " + key).hexdigest()[:16]


def _host_name(header: str) -> str:
    host = header.strip().lower()
    if host.startswith("["):  # [::1]:8080
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Guard:
    """ASGI middleware: the head, Host, Origin, API-key and content-type checks above, in that order."""

    def __init__(self, app, access: Access):
        self.app, self.hosts, self.origins = app, access.allowed_hosts, access.allowed_origins
        self.keys = [k.encode() for k in access.api_keys]

    def refusal(self, scope) -> Optional[APIError]:
        target = len(scope.get("raw_path") or scope["path"].encode()) + len(scope["query_string"])
        head_bytes = len(scope["method"]) + target + sum(len(n) + len(v) + 4 for n, v in scope["headers"])  # ": ", CRLF
        if head_bytes > MAX_HEAD_BYTES or len(scope["headers"]) > MAX_HEADERS:
            return APIError(431, f"the request head is {head_bytes} bytes in {len(scope['headers'])} headers: at most "
                            f"{MAX_HEAD_BYTES} bytes (request line and headers) and {MAX_HEADERS} headers",
                            code="request_head_too_large", headers={"Connection": "close"})
        headers = {}
        for name, value in scope["headers"]:  # a repeated header counts by its first value
            headers.setdefault(name, value.decode("latin-1"))
        host = _host_name(headers.get(b"host", ""))
        if self.hosts is not None and host not in self.hosts:
            return APIError(403, f"the Host header names '{host[:100]}', which this server does not answer to: "
                            "start it with --allowed-hosts NAME to add it", code="host_not_allowed")
        origin = headers.get(b"origin")
        if origin is not None and "*" not in self.origins and origin not in self.origins:
            return APIError(403, f"requests from web pages at {origin[:100]} are not allowed: start the server with "
                            "--allowed-origins ORIGIN to allow them", code="origin_not_allowed")
        key = self.key_sent(headers)
        scope["dflash.authorized"] = key is not None or not self.keys
        scope["dflash.cache_scope"] = cache_scope(key) if key is not None and len(self.keys) > 1 else ""
        if self.keys and scope["path"] != "/health" and key is None:
            return APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: "
                            "<key>')", code="invalid_api_key",
                            headers={"WWW-Authenticate": 'Bearer realm="mlx-dflash"'})
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return APIError(415, f"the request body must be JSON, sent with 'Content-Type: application/json' "
                                f"(got {kind[:60] or 'none'})", code="unsupported_media_type")
        return None

    def key_sent(self, headers: dict) -> Optional[bytes]:
        """The valid key the request sent, or None (every key compared, each in constant time)."""
        scheme, _, given = headers.get(b"authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer":
            given = headers.get(b"x-api-key", "")
        given = given.strip().encode("latin-1")
        matches = [key for key in self.keys if hmac.compare_digest(given, key)]
        return matches[0] if matches else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (e := self.refusal(scope)) is not None:
            scope.setdefault("dflash.log", {})["error"] = e.message
            return await error_response(e, scope["path"])(scope, receive, send)
        await self.app(scope, receive, send)


def with_cors(app, origins: set):
    """CORS headers and preflight answers for the allowed origins (none: no CORS, browsers keep out)."""
    if not origins:
        return app
    from starlette.middleware.cors import CORSMiddleware

    return CORSMiddleware(app, allow_origins=sorted(origins), allow_methods=["GET", "POST"], allow_headers=["*"],
                          max_age=600)
