"""The server's numbers are measured, not made up: prefill speed within what the request's wall time allows,
time saved by the prefix cache, tau of an answer with no verify round; for the engine that runs one request
at a time and the batching one alike."""

import time

import pytest

from serving import MODEL, raw, running
from mlx_dflash.decoding.engine_report import verify_paths
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import WidthOptions
from mlx_dflash.server.logs import log_line
from mlx_dflash.server.protocol import Outcome
from mlx_dflash.decoding.responses import GenerationStats

PROMPT = "Tell me everything you know about lighthouses, their keepers and the sea. " * 12


@pytest.fixture(scope="module")
def pair(tiny_chat_pair):
    target, tokenizer, drafter = tiny_chat_pair
    return target, drafter, tokenizer


def served(pair, max_batch):
    target, drafter, _ = pair
    return running(pair, policy=build_policy(target, drafter, WidthOptions(4), max_batch),
                   engine_options=dict(max_batch=max_batch, prompt_cache=dict(max_entries=4)))


def ask(url, content):
    tic = time.perf_counter()
    status, _, body = raw(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                                                         "messages": [{"role": "user", "content": content}]})
    assert status == 200, body
    return body, time.perf_counter() - tic


@pytest.mark.parametrize("max_batch", [1, 4], ids=["one-at-a-time", "batched"])
def test_prefill_speed_and_time_saved_are_measured(pair, max_batch):
    with served(pair, max_batch) as (url, _):
        ask(url, "warm up")  # the first request pays for compiling and the width probe
        body, wall = ask(url, PROMPT)
        prompt_tokens, stats = body["usage"]["prompt_tokens"], body["dflash"]
        assert stats["verify"] == verify_paths(pair[0])[0] and stats["verify"]  # the engine report
        # One token generated: the prefill is most of the request's wall time (a twentieth at the least). What it
        # read is the prompt less what the warm-up left in the prefix cache (the chat template's opening).
        read = prompt_tokens - stats["cached_tokens"]
        assert read / wall <= stats["prefill_tokens_per_s"] <= 20 * read / wall, (stats, wall)
        again, _ = ask(url, PROMPT)  # its prompt, all but the last token, comes from the prefix cache
        cached = again["dflash"]["cached_tokens"]
        assert cached >= prompt_tokens - 1
        # About what reading them again would cost (the cache's rate is an average over recent prefills).
        saved = cached / stats["prefill_tokens_per_s"]
        assert saved / 10 <= again["dflash"]["prefill_seconds_saved"] <= 10 * saved, (again["dflash"], saved)


def test_the_log_says_no_tau_without_a_verify_round():
    scope = {"method": "POST", "path": "/v1/chat/completions"}
    one_token = Outcome("stop", 10, 1, GenerationStats(prompt_tokens=10, generated_tokens=1), 0.0, 0.5)
    assert "tau=- " in log_line(scope, 200, {"outcome": one_token}, 0.5)
