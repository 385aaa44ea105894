"""`serve --max-batch`: concurrent clients decoded together answer as one request at a time does, a client
that leaves frees its row at once, and /health reports the batch."""

import logging
import re
import threading
import time

import pytest

from conftest import chat_ids
from serving import MODEL, client, raw, running
from mlx_dflash.server.engine import Engine
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import WidthOptions
from mlx_dflash.generate import generate

CHUNK_SECONDS = 0.25  # a prompt chunk's read, slowed to this in the fairness test
QUESTIONS = [f"Question {i}: tell me about topic {i}." for i in range(6)]


@pytest.fixture(scope="module")
def pair(tiny_chat_pair):
    target, tokenizer, drafter = tiny_chat_pair
    return target, drafter, tokenizer


def batched(pair, max_batch=4, width=4):
    target, drafter, _ = pair
    policy = build_policy(target, drafter, WidthOptions(width), max_batch)
    return running(pair, engine_class=Engine, policy=policy,
                   engine_options=dict(max_batch=max_batch))


def slowed_reads(target, monkeypatch) -> tuple:
    """(reading, gate): the target's reads wait for `gate` (set `reading` as the first begins), then take
    CHUNK_SECONDS each."""
    reading, gate, read = threading.Event(), threading.Event(), target.read

    def slow_read(*args, **kw):
        reading.set()
        assert gate.wait(timeout=20)
        time.sleep(CHUNK_SECONDS)
        return read(*args, **kw)

    monkeypatch.setattr(target, "read", slow_read)
    return reading, gate


def test_concurrent_clients_get_their_single_request_answers(pair):
    target, drafter, tokenizer = pair
    limits = [12, 5, 9, 14, 3, 8]
    want = [str(generate(target, drafter, tokenizer, chat_ids(tokenizer, q), max_tokens=n, width=4))
            for q, n in zip(QUESTIONS, limits)]
    got = [None] * len(QUESTIONS)
    with batched(pair) as (url, engine):
        def ask(i):
            stream = i % 2 == 0
            r = client(url).chat.completions.create(model=MODEL, max_tokens=limits[i], stream=stream,
                                                    messages=[{"role": "user", "content": QUESTIONS[i]}])
            got[i] = "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream else \
                r.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        health = raw(url, "/health")[2]
    assert got == want
    batch = health["batch"]
    assert batch["max_batch"] == 4 and max(int(r) for r in batch["rows"]) > 1  # rows did decode together


def test_a_client_that_leaves_frees_its_row_and_the_others_go_on(pair):
    target, drafter, tokenizer = pair
    want = str(generate(target, drafter, tokenizer, chat_ids(tokenizer, QUESTIONS[1]), max_tokens=10, width=4))
    with batched(pair, max_batch=2) as (url, engine):
        long = client(url).chat.completions.create(model=MODEL, max_tokens=5000, stream=True,
                                                   messages=[{"role": "user", "content": QUESTIONS[0]}])
        chunks = iter(long)
        next(chunks), next(chunks)  # decoding now
        long.close()  # the client leaves
        r = client(url).chat.completions.create(model=MODEL, max_tokens=10,
                                                messages=[{"role": "user", "content": QUESTIONS[1]}])
        assert r.choices[0].message.content == want
    assert engine.cancelled == 1 and engine.completed == 1


def test_short_requests_during_a_long_read_are_read_in_turn_and_queued_counts_the_wait(pair, monkeypatch, caplog):
    """Prompts are read in turn: two short requests sent during a long prompt's read are answered before that
    read ends, and the log's queued counts each one's wait to its first chunk, the second's behind the first's."""
    target, drafter, tokenizer = pair
    caplog.set_level(logging.INFO, logger="mlx_dflash.server")
    reading, gate = slowed_reads(target, monkeypatch)
    long_prompt, shorts = " ".join(QUESTIONS * 2), [QUESTIONS[1], QUESTIONS[1] + " Briefly, please."]
    # the long read is many chunks: more than the short ones' reads and rounds together
    assert -(-len(chat_ids(tokenizer, long_prompt)) // 16) >= 11
    ask = lambda content: client(url).chat.completions.create(  # noqa: E731
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": content}])
    with running(pair, engine_class=Engine, policy=build_policy(target, drafter, WidthOptions(4), 3),
                 engine_options=dict(max_batch=3, prefill_step=16)) as (url, engine):
        long = threading.Thread(target=ask, args=(long_prompt,))
        long.start()
        assert reading.wait(timeout=20)  # the long prompt's first chunk is being read
        threads = [threading.Thread(target=ask, args=(s,)) for s in shorts]
        for t in threads:
            t.start()
        deadline = time.time() + 20
        while engine.waiting < 2:  # both arrived, waiting for the chunk being read
            assert time.time() < deadline
            time.sleep(0.01)
        gate.set()
        for t in threads:
            t.join(timeout=60)
        answered_first = long.is_alive()
        long.join(timeout=60)
    assert answered_first  # both short requests were answered while the long prompt was still being read
    queued = {int(m["prompt"]): float(m["queued"]) for r in caplog.records
              if (m := re.search(r"prompt=(?P<prompt>\d+) .* queued=(?P<queued>[\d.]+)s", r.getMessage()))}
    first, second = sorted(queued[len(chat_ids(tokenizer, s))] for s in shorts)
    assert second - first > CHUNK_SECONDS * 0.75  # the second waited for the first's first chunk


@pytest.mark.slow  # seconds of a long read; test_batch.py checks the rule at the scheduler in the default tier
@pytest.mark.parametrize("seeded", [False, True])
def test_one_at_a_time_a_short_request_is_read_and_answered_during_a_long_read(pair, monkeypatch, seeded):
    """`--max-batch 1`: a short request sent during a long prompt's read is read in turn with it and answered,
    with the text it gets alone, before that read ends; the long request's answer is its own too, a seeded
    sampled one included (a row draws from its own random stream)."""
    target, drafter, tokenizer = pair
    long_prompt, short = " ".join(QUESTIONS * 3), QUESTIONS[1]
    policy = build_policy(target, drafter, WidthOptions(4))
    want = {p: str(generate(target, drafter, tokenizer, chat_ids(tokenizer, p), max_tokens=4, policy=policy,
                            **(dict(temp=0.8, seed=5) if seeded and p == long_prompt else {})))
            for p in (long_prompt, short)}
    reading, gate = slowed_reads(target, monkeypatch)
    got, ended = {}, {}

    def ask(content):
        sampled = dict(temperature=0.8, seed=5) if seeded and content == long_prompt else {}
        got[content] = client(url).chat.completions.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": content}],
            **sampled).choices[0].message.content
        ended[content] = time.perf_counter()

    with running(pair, policy=policy, engine_options=dict(prefill_step=16, max_batch=1)) as (url, engine):
        threads = {p: threading.Thread(target=ask, args=(p,)) for p in (long_prompt, short)}
        threads[long_prompt].start()
        assert reading.wait(timeout=20)  # the long prompt's first chunk is being read
        threads[short].start()
        deadline = time.time() + 20
        while engine.taken() < 2:
            assert time.time() < deadline
            time.sleep(0.01)
        gate.set()
        for t in threads.values():
            t.join(timeout=60)
    assert got == want
    assert ended[short] < ended[long_prompt]
    assert engine.completed == 2 and not engine.active
