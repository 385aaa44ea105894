"""`GET /metrics`: what the server has done, in Prometheus' text format (prometheus_client), for the tools
servers are watched with.

Counted as each request ends (`RequestLog` calls `Metrics.observe`): requests by the route that answered
and their status; for each generation that ran, its prompt and generated tokens, time to first token and
per output token, decode speed, its rounds by what served them (as a response's `mode` counts them), the
tokens each round emitted (their mean is tau, as the responses report
it) and the rows each verified. Read at each scrape: the requests waiting and decoding, the batch's rounds
by the requests each decoded, the routed kernel calls by route (fallbacks marked), MLX's memory, and the
prefix cache's entries, lookups and tokens reused of the caller's API key only (as `/health` shows them:
another key's hits would tell what its requests held). With several keys every other figure is the whole
server's: counts and times, never what a request held.
"""

from __future__ import annotations

import mlx.core as mx
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..kernels import routes

PREFIX = "mlx_dflash_"
SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_SECONDS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)
TOKENS_PER_SECOND = (1, 2, 5, 10, 20, 50, 100, 200, 500)
ROUND_TOKENS = tuple(range(1, 17))
ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The server's metrics: one registry per app (tests run several servers in one process)."""

    def __init__(self, engine):
        self.engine = engine
        self.registry = r = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "Requests answered, by the route that answered and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of the generations that ran", registry=r)
        self.generated_tokens = Counter(PREFIX + "generated_tokens", "Tokens generated", registry=r)
        self.first_token = Histogram(PREFIX + "time_to_first_token_seconds", "From a generation's arrival at the "
                                     "engine to its first token: queued, then its prompt read", buckets=SECONDS,
                                     registry=r)
        self.per_token = Histogram(PREFIX + "time_per_output_token_seconds",
                                   "A generation's decoding time per token after its first", buckets=TOKEN_SECONDS,
                                   registry=r)
        self.speed = Histogram(PREFIX + "decode_tokens_per_second", "A generation's tokens per second of decoding",
                               buckets=TOKENS_PER_SECOND, registry=r)
        self.rounds = Counter(PREFIX + "rounds", "Verify rounds and plain steps of the generations that ran, by "
                              "what served them: chain (one path of the drafter's drafts), tree (a tree of drafts), "
                              "lookup (one path copied from the context), plain (a target step without drafts)",
                              ["kind"], registry=r)
        self.round_tokens = Histogram(PREFIX + "tokens_per_round", "Tokens a verify round emitted (accepted drafts "
                                      "and the bonus): the mean is tau", buckets=ROUND_TOKENS, registry=r)
        self.widths = Histogram(PREFIX + "round_rows", "Rows a verify round verified for one request",
                                buckets=ROWS, registry=r)
        ProcessCollector(registry=r)  # process_resident_memory_bytes and the like, where the system tells them
        r.register(EngineFigures(engine))

    def observe(self, route: str, status: int, info: dict):
        """One request answered by `route` (the request log's `info`: its generation's outcome, if one ran)."""
        self.requests.labels(route, str(status)).inc()
        outcome = info.get("outcome")
        if outcome is None or outcome.stats is None:
            return
        s = outcome.stats
        self.prompt_tokens.inc(outcome.prompt_tokens)
        self.generated_tokens.inc(outcome.completion_tokens)
        if outcome.completion_tokens:
            self.first_token.observe(outcome.queue_seconds + s.prefill_seconds)
        if outcome.completion_tokens > 1 and s.decode_seconds > 0:
            self.per_token.observe(s.decode_seconds / (outcome.completion_tokens - 1))
            self.speed.observe(s.decode_tps)
        for kind, n in s.modes.items():
            self.rounds.labels(kind).inc(n)
        for histogram, counts in ((self.round_tokens, s.accepted_lengths), (self.widths, s.widths)):
            for value, times in counts.items():
                for _ in range(times):
                    histogram.observe(value)

    def render(self, cache_scope: str) -> bytes:
        """The scrape's text: the server's figures, then the prefix cache's of `cache_scope` (the caller's key)."""
        own = CollectorRegistry()
        own.register(CacheFigures(self.engine, cache_scope))
        return generate_latest(self.registry) + generate_latest(own)


class EngineFigures:
    """What the engine is doing, read at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        yield GaugeMetricFamily(PREFIX + "requests_waiting", "Requests admitted and not yet decoding (their "
                                "prompts tokenizing, or queued)", value=e.waiting)
        yield GaugeMetricFamily(PREFIX + "requests_decoding", "Requests in the batch (each one row)",
                                value=len(e.active))
        batch = CounterMetricFamily(PREFIX + "batch_rounds", "The batch's rounds, by the requests each decoded",
                                    labels=["requests"])
        for n, rounds in sorted(dict(e.batch_stats.rows).items()):  # copied at once: the engine thread adds
            batch.add_metric([str(n)], rounds)
        yield batch
        calls = CounterMetricFamily(PREFIX + "kernel_calls", "Routed verify calls (matmul: wide_qmm, attention: "
                                    "mr_attention) by the path that served them (dflash: ours, mlx: MLX's) and "
                                    "whether MLX's served in place of ours (fallback)",
                                    labels=["kernel", "route", "fallback"])
        for (kernel, route, fallback), n in sorted(routes.totals().items()):
            calls.add_metric([kernel, route, str(fallback).lower()], n)
        yield calls
        memory = GaugeMetricFamily(PREFIX + "mlx_memory_bytes", "MLX's memory: active (in arrays), cache (kept for "
                                   "reuse), peak (the most active since start)", labels=["kind"])
        for kind, read in (("active", mx.get_active_memory), ("cache", mx.get_cache_memory),
                           ("peak", mx.get_peak_memory)):
            memory.add_metric([kind], read())
        yield memory


class CacheFigures:
    """The prefix cache's entries and lookups for one API key's scope."""

    def __init__(self, engine, scope: str):
        self.engine, self.scope = engine, scope

    def collect(self):
        cache = self.engine.prompt_cache
        if cache is None:
            return
        s = cache.stats(self.scope)
        yield GaugeMetricFamily(PREFIX + "prompt_cache_entries", "Kept prompt states (this API key's)",
                                value=s["entries"])
        yield GaugeMetricFamily(PREFIX + "prompt_cache_bytes", "Their bytes", value=s["bytes"])
        lookups = CounterMetricFamily(PREFIX + "prompt_cache_lookups", "Prompts looked up in the cache (this API "
                                      "key's), by whether a kept state served them", labels=["result"])
        lookups.add_metric(["hit"], s["hits"])
        lookups.add_metric(["miss"], s["misses"])
        yield lookups
        yield CounterMetricFamily(PREFIX + "prompt_cache_tokens_reused", "Prompt tokens kept states held, not read "
                                  "again (this API key's)", value=s["cached_tokens"])
