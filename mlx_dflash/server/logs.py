"""The server's log: one line per request, and no flood of the same failure.

`RequestLog` writes one line per request once its response is sent: method, path, status, id, prompt and
completion tokens, speed, tau, finish reason, seconds queued and in total, the error if there was one.
`RateLimit` keeps any one failure to a few lines a second (a flood of bad requests, refused connections,
or the event loop's own errors): the rest are counted and the count is written with the next line let
through. Failures are keyed by what failed (the route that answered, or none, and the status; a message's
template), never by what a client chose: a flood of distinct paths is one kind of failure. A path is
written up to PATH_CHARACTERS.
"""

import json
import logging
import threading
import time

log = logging.getLogger("mlx_dflash.server")
LINES_PER_SECOND = 5  # per kind of failure
PATH_CHARACTERS = 200


class RateLimit(logging.Filter):
    """At most `per_second` warnings and errors (and error request lines) of one kind per second."""

    def __init__(self, per_second: int = LINES_PER_SECOND, clock=time.monotonic):
        super().__init__()
        self.per_second, self.clock = per_second, clock
        self.windows = {}  # key -> [second, lines in it, suppressed since the last line let through]
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = getattr(record, "rate_key", None)
        if key is None:
            if record.levelno < logging.WARNING:
                return True
            key = (record.name, str(record.msg)[:80])
        second = int(self.clock())
        with self.lock:
            window = self.windows.setdefault(key, [second, 0, 0])
            if window[0] != second:
                window[0], window[1] = second, 0
            if window[1] >= self.per_second:
                window[2] += 1
                return False
            window[1] += 1
            suppressed, window[2] = window[2], 0
            if len(self.windows) > 1000:  # keys are few; this only bounds a pathological mix
                self.windows = {key: window}
        if suppressed:
            record.msg = f"{record.getMessage()} ({suppressed} more like it not logged)"
            record.args = None
        return True


def configure() -> None:
    """Log to stderr, every logger (uvicorn's and asyncio's too) through the rate limit."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RateLimit) for f in handler.filters):
            handler.addFilter(RateLimit())


class RequestLog:
    """ASGI middleware: the one line per request, and the request counted in the metrics (metrics.py)."""

    def __init__(self, app, metrics=None):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        info = scope.setdefault("dflash.log", {})
        status, tic = {}, time.perf_counter()

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            code = info.get("status", status.get("code", 500))
            route = getattr(scope.get("endpoint"), "__name__", "none")  # the router's match; none: refused before
            extra = {"rate_key": (route, code)} if code >= 400 else {}
            log.info(log_line(scope, code, info, time.perf_counter() - tic), extra=extra)
            if self.metrics is not None:
                self.metrics.observe(route, code, info)


def log_line(scope, status: int, info: dict, seconds: float) -> str:
    path = scope["path"]
    if len(path) > PATH_CHARACTERS:
        path = f"{path[:PATH_CHARACTERS]}...({len(path)} characters)"
    parts = [scope["method"], path, str(status)]
    if "id" in info:
        parts.append(f"id={info['id']}")
    outcome = info.get("outcome")
    if outcome is not None:
        tps = outcome.completion_tokens / outcome.seconds if outcome.seconds else 0.0
        stats = outcome.stats
        tau = f"{stats.tau:.2f}" if stats is not None and stats.rounds else "-"  # no verify round: no tau
        parts += [f"prompt={outcome.prompt_tokens}", f"completion={outcome.completion_tokens}",
                  f"tok/s={tps:.1f}", f"tau={tau}", f"mode={stats.mode if stats is not None else '-'}",
                  f"finish={outcome.finish_reason}",
                  f"queued={outcome.queue_seconds:.2f}s"]
    if "error" in info:
        parts.append(f"error={json.dumps(info['error'][:200])}")
    parts.append(f"{seconds:.2f}s")
    return " ".join(parts)
