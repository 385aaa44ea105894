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


def test_the_mode_is_what_served_most_rounds_in_one_word():
    from mlx_dflash.decoding.decoder import Round

    stats = GenerationStats()
    assert stats.mode == "-"
    rounds = [Round([1], 0, 0, plain=True)] * 2 + [Round([1, 2], 3, 1, looked_up=3)] * 3 + \
        [Round([1, 2, 3], 4, 2, tree=True)] * 4 + [Round([1], 3, 0, looked_up=1)] * 1
    for rnd in rounds:
        stats.count(rnd)
    assert dict(stats.modes) == {"plain": 2, "lookup": 3, "tree": 4, "chain": 1} and stats.mode == "tree"
    outcome = Outcome("stop", 10, 20, stats, 0.0, 1.0)
    assert outcome.speculative()["mode"] == "tree" and outcome.speculative()["width"] == 4
    assert " mode=tree " in log_line({"method": "POST", "path": "/v1/chat/completions"}, 200, {"outcome": outcome}, 1.0)


def test_a_response_says_its_mode_and_width(pair):
    with served(pair, 1) as (url, _):  # width 4 fixed: rounds of 3 drafts, fewer near max_tokens
        body = raw(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 24,
                                                  "messages": [{"role": "user", "content": "Hello"}]})[2]
    report = body["dflash"]
    assert report["mode"] == "chain"  # an untrained drafter still drafts: every round but the last verifies
    assert str(report["width"]) == max(report["widths"], key=report["widths"].get) == "4"


def test_a_server_makes_at_start_up_the_context_probes_a_long_prompt_would_wait_for(tiny_chat_pair):
    """Before, the first prompt reaching half of a probe length paid that probe inside its request."""
    from serve_helpers import pair_with_context

    target, drafter, tokenizer = pair_with_context(tiny_chat_pair[1], 4096)
    policy = build_policy(target, drafter, WidthOptions("auto"), 1)
    assert sorted(policy.context_costs.by_context) == [256]  # the start-up probe's length only
    probes, prober = [], policy.context_costs.prober
    policy.context_costs.prober = lambda context: probes.append(context) or prober(context)
    with running((target, drafter, tokenizer), policy=policy) as (url, engine):
        assert probes == [1024, 4096]  # every length the model's context allows, before the first request
        long_prompt = "sea " * 2200  # past half of 4096 tokens
        status, _, body = raw(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                             "messages": [{"role": "user", "content": long_prompt}]})
    assert status == 200 and body["usage"]["prompt_tokens"] > 2048
    assert probes == [1024, 4096]  # none inside the request
