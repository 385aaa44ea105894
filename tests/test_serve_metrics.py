"""`GET /metrics`: Prometheus' text format, read with prometheus_client's own parser (as a scraper reads it);
its counters move as requests run and equal what the responses themselves reported; behind the API key,
and the prefix cache's figures the caller's key's only."""

import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import MODEL, client, raw, running
from mlx_dflash.kernels import routes

SYSTEM = "You answer in short sentences. " * 8


@pytest.fixture(scope="module")
def pair(tiny_chat_pair):
    target, tokenizer, drafter = tiny_chat_pair
    return target, drafter, tokenizer


def scrape(url, key=None) -> dict:
    """{(sample name, sorted labels): value} of one scrape."""
    status, headers, body = raw(url, "/metrics", parse=False,
                                headers={"Authorization": f"Bearer {key}"} if key else None)
    assert status == 200 and headers["content-type"].startswith("text/plain; version="), (status, headers)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def moved(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_the_counters_move_as_requests_run_and_equal_what_the_responses_said(pair):
    with running(pair) as (url, engine):
        c = client(url)
        before = scrape(url)
        answers = [c.chat.completions.create(model=MODEL, max_tokens=n, messages=[
            {"role": "user", "content": q}]) for n, q in ((12, "What is the sea?"), (7, "Name a colour."))]
        stream = list(c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=9, stream=True,
                                           stream_options={"include_usage": True}))
        assert raw(url, "/v1/chat/completions", {"model": MODEL, "messages": []})[0] == 400
        routes.record("cpu|wide_qmm|float16|4096x4096|b4|r8", "mlx", "a test's call", fallback=True)
        after = scrape(url)
    reports = [a.model_extra["dflash"] for a in answers] + [stream[-1].model_extra["dflash"]]
    usages = [a.usage for a in answers] + [stream[-1].usage]
    assert moved(before, after, "mlx_dflash_requests_total", route="chat", status="200") == 2
    assert moved(before, after, "mlx_dflash_requests_total", route="completions", status="200") == 1
    assert moved(before, after, "mlx_dflash_requests_total", route="chat", status="400") == 1
    assert all(moved(before, after, "mlx_dflash_rounds_total", kind=r["mode"]) > 0 for r in reports), reports
    assert moved(before, after, "mlx_dflash_generated_tokens_total") == sum(u.completion_tokens for u in usages) == 28
    assert moved(before, after, "mlx_dflash_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    rounds = sum(r["rounds"] for r in reports)
    kinds = ("chain", "tree", "lookup", "plain")
    plain = sum(r["plain_steps"] for r in reports)
    assert sum(moved(before, after, "mlx_dflash_rounds_total", kind=k) for k in kinds) == rounds + plain
    assert moved(before, after, "mlx_dflash_tokens_per_round_count") == rounds
    assert moved(before, after, "mlx_dflash_tokens_per_round_sum") == sum(
        int(n) * k for r in reports for n, k in r["accepted_lengths"].items())
    assert moved(before, after, "mlx_dflash_round_rows_sum") == sum(
        int(w) * k for r in reports for w, k in r["widths"].items())
    assert moved(before, after, "mlx_dflash_time_to_first_token_seconds_count") == 3
    assert moved(before, after, "mlx_dflash_time_per_output_token_seconds_count") == 3
    assert moved(before, after, "mlx_dflash_batch_rounds_total", requests="1") > 0
    assert moved(before, after, "mlx_dflash_kernel_calls_total", kernel="wide_qmm", route="mlx", fallback="true") == 1
    assert after[("mlx_dflash_requests_waiting", ())] == 0 and after[("mlx_dflash_requests_decoding", ())] == 0
    assert after[("mlx_dflash_mlx_memory_bytes", (("kind", "peak"),))] > 0
    if sys.platform == "linux":  # prometheus_client reads a process's memory from /proc
        assert after[("process_resident_memory_bytes", ())] > 0
    assert moved(before, after, "mlx_dflash_requests_total", route="metrics_text", status="200") == 1  # `before`


def test_metrics_need_the_key_and_show_the_callers_prefix_cache_only(pair):
    options = dict(prompt_cache=dict(max_entries=8))
    with running(pair, api_keys=("key-a", "key-b"), engine_options=options) as (url, _):
        assert raw(url, "/metrics", parse=False)[0] == 401
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the sea?"}]
        for _ in range(2):  # the second reads the first's prompt from the cache
            client(url, key="key-a").chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        a, b = scrape(url, "key-a"), scrape(url, "key-b")
    assert a[("mlx_dflash_prompt_cache_lookups_total", (("result", "hit"),))] == 1
    assert a[("mlx_dflash_prompt_cache_tokens_reused_total", ())] > 50
    assert b[("mlx_dflash_prompt_cache_lookups_total", (("result", "hit"),))] == 0
    assert b[("mlx_dflash_prompt_cache_tokens_reused_total", ())] == 0
    assert b[("mlx_dflash_prompt_cache_entries", ())] == 0
    assert a[("mlx_dflash_generated_tokens_total", ())] == b[("mlx_dflash_generated_tokens_total", ())] == 8
