"""`mlx-dflash serve` through the official `openai` client, on a loopback port the test picks.

A tiny random target (SmolLM2's real tokenizer, 4 small llama layers) and a random drafter keep the default
tier fast; the slow test runs the shipped pair through the real CLI and compares with `mlx-dflash generate`
and with mlx-lm's own greedy output. Every server a test starts, the test stops.
"""

import logging
import socket
import subprocess
import sys
import threading
import time

import mlx.core as mx
import openai
import pytest
from click.testing import CliRunner

from conftest import chat_ids
from serving import CHAT, MODEL, chat_text, client, free_port, raw, running, wait_for_health, wait_until
from mlx_dflash.cli import main
from mlx_dflash.generate import generate
from mlx_dflash.errors import DFlashError
from mlx_dflash.server.engine import Engine
from mlx_dflash.server.protocol import StopMatcher

@pytest.fixture(scope="module")
def tiny_pair(tiny_chat_pair):
    """conftest's random llama with SmolLM2's tokenizer and its untrained drafter, as (target, drafter, tokenizer)."""
    target, tokenizer, drafter = tiny_chat_pair
    return target, drafter, tokenizer


@pytest.fixture(scope="module")
def served(tiny_pair):
    with running(tiny_pair, max_body_bytes=8192) as (url, engine):
        yield url, engine


def test_chat_and_completions_equal_the_decoder_streamed_or_not(tiny_pair, served):
    target, drafter, tokenizer = tiny_pair
    url, _ = served
    c = client(url)
    prompt_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    want = generate(target, drafter, tokenizer, prompt_ids, max_tokens=16)
    text, r = chat_text(c)
    assert text == want and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(prompt_ids), 16, len(prompt_ids) + 16)
    stats = r.model_extra["dflash"]
    # verify rounds and plain steps (which D-cut's clock picks) together, every token after the first
    assert stats["rounds"] + stats["plain_steps"] == want.stats.rounds + want.stats.plain_steps == 15
    assert stats["rounds"] == sum(stats["accepted_lengths"].values())
    assert stats["block_size"] == drafter.block_size

    streamed, chunks = chat_text(c, stream=True, stream_options={"include_usage": True})
    assert streamed == want and len(chunks) > 3
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
    report = chunks[-1].model_extra["dflash"]
    assert chunks[-1].usage.completion_tokens == 16 and report["rounds"] + report["plain_steps"] == 15
    assert all(ch.usage is None for ch in chunks[:-1])
    assert chat_text(c, stream=True)[1][-1].choices[0].finish_reason == "length"  # no usage chunk unasked

    ids = tokenizer.encode("Once upon a time")
    want = generate(target, drafter, tokenizer, ids, max_tokens=8)
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert r.choices[0].text == want and r.usage.prompt_tokens == len(ids)
    chunks = list(c.completions.create(model=MODEL, prompt=ids, max_tokens=8, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want


def test_stop_strings_cut_exactly_where_the_text_would(tiny_pair, served):
    target, drafter, tokenizer = tiny_pair
    c = client(served[0])
    full, _ = chat_text(c, max_tokens=20)
    tokens = generate(target, drafter, tokenizer, chat_ids(tokenizer, CHAT[0]["content"]), max_tokens=20).tokens
    stop = full[13:17]  # crosses token boundaries in general
    cut = full[: full.index(stop)]
    text, r = chat_text(c, max_tokens=20, stop=[stop, "never appears"])
    assert text == cut and r.choices[0].finish_reason == "stop"
    n = r.usage.completion_tokens  # up to the token that completed the stop string
    assert stop in tokenizer.decode(tokens[:n]) and stop not in tokenizer.decode(tokens[: n - 1])
    assert chat_text(c, stream=True, max_tokens=20, stop=stop)[0] == cut


def test_stop_matcher_holds_back_a_split_stop_and_flushes_a_false_start():
    m = StopMatcher(["END", "xy"])
    assert [m.feed(t) for t in ["ab", "cE", "N", "x"]] == ["ab", "c", "", "EN"]
    assert m.feed("zED") == "xzED" and not m.stopped
    assert m.feed("E") == "" and m.feed("ND tail") == "" and m.stopped and m.feed("more") == m.flush() == ""
    m = StopMatcher(["END"])
    assert m.feed("aEN") == "a" and m.flush() == "EN"
    assert StopMatcher([]).feed("E") == "E"


def test_per_request_sampling_seed_top_k_and_temperature(tiny_pair, served):
    c = client(served[0])
    # Few tokens: sampling sorts the 49152-token vocabulary on every row.
    greedy, _ = chat_text(c, max_tokens=6)
    sampled = [chat_text(c, max_tokens=6, temperature=1.0, seed=s)[0] for s in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2] and sampled[0] != greedy
    assert chat_text(c, max_tokens=6, temperature=1.0, seed=3, extra_body={"top_k": 1})[0] == greedy
    target, drafter, tokenizer = tiny_pair
    ids = chat_ids(tokenizer, CHAT[0]["content"])
    want = generate(target, drafter, tokenizer, ids, max_tokens=6, temp=0.7, top_p=0.9, seed=5)
    assert chat_text(c, max_tokens=6, temperature=0.7, top_p=0.9, seed=5)[0] == want
    want = generate(target, drafter, tokenizer, ids, max_tokens=6, temp=1.0, min_p=0.2, seed=6)
    assert chat_text(c, max_tokens=6, temperature=1.0, seed=6, extra_body={"min_p": 0.2})[0] == want


GOOD = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
BAD_INPUT = [
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    ("/v1/chat/completions", b"\xff\xfe not utf-8", 400, None),
    ("/v1/chat/completions", [1, 2], 400, None),
    ("/v1/chat/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/chat/completions", {**GOOD, "max_tokens": True}, 400, "max_tokens"),
    ("/v1/chat/completions", {**GOOD, "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {**GOOD, "top_k": -1}, 400, "top_k"),
    ("/v1/chat/completions", {**GOOD, "min_p": 1.5}, 400, "min_p"),
    ("/v1/chat/completions", {**GOOD, "min_p": "low"}, 400, "min_p"),
    ("/v1/chat/completions", {**GOOD, "seed": 1.5}, 400, "seed"),
    ("/v1/chat/completions", {**GOOD, "stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", {**GOOD, "stop": 3}, 400, "stop"),
    ("/v1/chat/completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {**GOOD, "stream_options": {"include_usage": 1}}, 400, "include_usage"),
    ("/v1/chat/completions", {**GOOD, "n": 2}, 400, "n"),
    ("/v1/chat/completions", {**GOOD, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**GOOD, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {**GOOD, "messages": [{"content": "hi"}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]"),
    ("/v1/chat/completions", {**GOOD, "model": "gpt-4o"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 10 ** 9]}, 400, "prompt"),
    ("/v1/embeddings", {"model": MODEL, "input": "x"}, 404, None),
    ("/v1/models/gpt-4o", None, 404, None),
    ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": "x" * 9000}]}, 413, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD_INPUT)
def test_bad_input_gets_an_openai_error_and_the_server_carries_on(served, path, body, status, param):
    url, _ = served
    got, _, answer = raw(url, path, body)
    assert got == status, answer
    err = answer["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["param"] == param and "Traceback" not in err["message"]
    got, _, answer = raw(url, "/v1/chat/completions", GOOD)
    assert got == 200 and answer["choices"][0]["message"]["content"]


def test_wrong_method_models_and_health(served):
    url, _ = served
    status, _, answer = raw(url, "/v1/chat/completions", method="GET")
    assert status == 405 and "GET" in answer["error"]["message"]
    assert [m.id for m in client(url).models.list()] == [MODEL]
    assert raw(url, f"/v1/models/{MODEL}")[2]["id"] == MODEL
    status, _, health = raw(url, "/health")
    assert (status, health["status"], health["model"], health["waiting"]) == (200, "ok", MODEL, 0)
    assert health["batch"]["max_batch"] == 8 and health["batch"]["rounds"] == sum(health["batch"]["rows"].values())


def test_a_bug_during_generation_is_a_500_in_one_line_and_the_server_carries_on(served, monkeypatch, caplog):
    from mlx_dflash.decoding.batch_decoder import Batch

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    url, _ = served
    with monkeypatch.context() as m:
        m.setattr(Batch, "round", broken)
        status, _, answer = raw(url, "/v1/chat/completions", GOOD)
        with pytest.raises(openai.APIError) as e:  # mid-stream: an error event, then the stream ends
            chat_text(client(url), stream=True)
    assert status == 500 and answer["error"]["type"] == "server_error"
    assert "RuntimeError" in answer["error"]["message"] and "boom" not in answer["error"]["message"]
    assert "RuntimeError" in str(e.value)
    assert any("boom" in (r.exc_text or "") for r in caplog.records)  # the traceback went to the log
    assert raw(url, "/v1/chat/completions", GOOD)[0] == 200


def test_api_key_is_required_everywhere_but_health(tiny_pair):
    with running(tiny_pair, api_keys=("s3cret",)) as (url, _):
        with pytest.raises(openai.AuthenticationError) as e:
            client(url, key="wrong").models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        status, _, answer = raw(url, "/v1/chat/completions", GOOD)  # no Authorization header at all
        assert status == 401 and "Bearer" in answer["error"]["message"]
        assert raw(url, "/health")[0] == 200
        assert chat_text(client(url, key="s3cret"), max_tokens=3)[1].usage.completion_tokens == 3


def test_disconnect_stops_generation_and_a_full_queue_answers_503(tiny_pair, caplog):
    caplog.set_level(logging.INFO, logger="mlx_dflash.server")
    with running(tiny_pair, max_queue=2, engine_options=dict(max_batch=1)) as (url, engine):
        c = client(url)
        long = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20000, stream=True)
        next(iter(long)), next(iter(long))  # generating now
        results = []
        waiter = threading.Thread(target=lambda: results.append(chat_text(c, max_tokens=5)[0]))
        waiter.start()
        wait_until(lambda: engine.taken() == 2)  # read beside the running one, waiting for its row
        queued = client(url).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, stream=True)
        wait_until(lambda: engine.waiting == 1)
        with pytest.raises(openai.APIStatusError) as e:
            chat_text(c, max_tokens=5)
        assert e.value.status_code == 503 and int(e.value.response.headers["Retry-After"]) >= 1
        assert e.value.body["code"] == "queue_full"
        queued.close()  # its client leaves while it waits: it must never run
        long.close()  # this one's client goes away mid-stream
        waiter.join(timeout=30)
        assert results and results[0] == chat_text(c, max_tokens=5)[0]  # the waiting one ran, then this
        assert engine.cancelled == 2 and engine.waiting == 0
    cancelled = [r.message for r in caplog.records if "finish=cancelled" in r.message]
    completions = sorted(int(line.split("completion=")[1].split()[0]) for line in cancelled)
    assert len(completions) == 2 and completions[0] == 0  # the one that never ran
    assert 0 < completions[1] < 2000  # stopped within rounds of the disconnect, far from max_tokens


def test_one_log_line_per_request(served, caplog):
    caplog.set_level(logging.INFO, logger="mlx_dflash.server")
    url, _ = served
    answer = raw(url, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_completion_tokens": 6})[2]
    raw(url, "/v1/chat/completions", {**GOOD, "temperature": -1})
    raw(url, "/health")

    def lines():  # a line is written just after its response is sent
        return [rec.message for rec in caplog.records if rec.name == "mlx_dflash.server"]
    wait_until(lambda: len(lines()) >= 3)
    time.sleep(0.2)
    lines = lines()
    assert len(lines) == 3
    assert lines[0].startswith("POST /v1/chat/completions 200 ") and f"id={answer['id']}" in lines[0]
    for field in ("prompt=", "completion=6", "tok/s=", "tau=", "finish=length"):
        assert field in lines[0]
    assert lines[1].startswith("POST /v1/chat/completions 400 ") and "temperature" in lines[1]
    assert lines[2].startswith("GET /health 200 ")


def _plan(client_id, i):
    """Request i of client client_id in the load test: its kind, stream flag, cancel flag, and arguments."""
    n = client_id * 4 + i
    kw = dict(max_tokens=6 + n % 3)
    if n % 8 == 0:  # a few sampled (seeded) ones: sampling a 49152-token row is slow on a CPU
        kw.update(temperature=0.8, seed=n)
    if n % 2:
        kw["messages"] = [{"role": "user", "content": f"Question {n}: what is {n} + {n}?"}]
    else:
        kw["prompt"] = f"Item {n}:"
    return kw, n % 4 == 1, n % 8 == 5  # every other chat streams; a quarter of those are cancelled


def _request(c, kw, stream, cancel):
    call = c.chat.completions.create if "messages" in kw else c.completions.create
    if cancel:
        with call(model=MODEL, stream=True, **{**kw, "max_tokens": 20000}) as s:
            next(iter(s)), next(iter(s))
        return None
    if not stream:
        r = call(model=MODEL, **kw)
        return r.choices[0].message.content if "messages" in kw else r.choices[0].text
    parts = [ch.choices[0] for ch in call(model=MODEL, stream=True, **kw) if ch.choices]
    return "".join((p.delta.content or "") if "messages" in kw else p.text for p in parts)


@pytest.mark.parametrize("clients", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_load_clients_x_4_requests_none_lost_outputs_equal_single_runs(tiny_pair, clients):
    with running(tiny_pair) as (url, engine):
        c = client(url)
        plans = {(k, i): _plan(k, i) for k in range(clients) for i in range(4)}
        alone = {key: _request(c, kw, False, False) for key, (kw, _, cancel) in plans.items() if not cancel}
        mx.clear_cache()
        idle = mx.get_active_memory()
        done_before = engine.completed
        got, errors = {}, []

        def run_client(k):
            ck = client(url)
            try:
                for i in range(4):
                    got[k, i] = _request(ck, *plans[k, i])
            except Exception as e:  # reported below, with the client that saw it
                errors.append((k, repr(e)))

        threads = [threading.Thread(target=run_client, args=(k,)) for k in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and not any(t.is_alive() for t in threads)
        assert {key: got[key] for key in alone} == alone
        n_cancelled = sum(cancel for _, _, cancel in plans.values())
        assert n_cancelled == clients // 2 and engine.completed - done_before == len(alone)
        wait_until(lambda: engine.cancelled == n_cancelled and engine.waiting == 0)
        assert raw(url, "/health")[0] == 200 and chat_text(c, max_tokens=3)[1].usage.completion_tokens == 3
        mx.clear_cache()
        # every request's caches were freed (one request's are tens of KB; the idle engine's own few small
        # arrays vary by some hundred bytes)
        assert mx.get_active_memory() <= idle + 4096


def test_a_load_error_is_raised_where_the_engine_is_made():
    def load():
        raise DFlashError("drafter vocab_size 10 != target vocabulary 20")

    with pytest.raises(DFlashError, match="vocab_size 10"):
        Engine(load)


def test_serve_cli_refuses_bad_flags_in_one_line_before_loading():
    runner = CliRunner()
    for args, words in [(["--width", "4", "--cost-table", "t.json"], "leave one of them out"),
                        (["--max-batch", "1", "--cost-table", "t.json"], "t.json: no such file"),
                        (["--n-max", "3", "--cost-table", "t.json"], "add --width auto"),
                        (["--cost-table", "t.json"], "t.json: no such file"), (["--temp", "-1"], "--temp must be"),
                        (["--model", "x"], "no such directory"), (["--max-queue", "-1"], "--max-queue"),
                        (["--n-max", "3", "--width", "2"], "disagree")]:
        r = runner.invoke(main, ["serve", *args])
        assert r.exit_code == 1 and words in r.output and len(r.output.strip().splitlines()) == 1, r.output
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = runner.invoke(main, ["serve", "--port", str(taken.getsockname()[1])])
    assert r.exit_code == 1 and "pass another --port" in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_real_pair_greedy_equals_generate_and_mlx_lm(smollm2):
    """The shipped pair through `mlx-dflash serve`: its greedy text is `mlx-dflash generate`'s and mlx-lm's."""
    from conftest import mlx_lm_greedy

    prompt = "Janet has 3 apples and buys 5 more. She eats 2. How many are left?"
    cli = [sys.executable, "-m", "mlx_dflash.cli"]
    want = subprocess.run([*cli, "generate", "--prompt", prompt, "--max-tokens", "48"], capture_output=True,
                          text=True, check=True).stdout[:-1]  # generate ends with a newline
    target, tokenizer = smollm2
    tokens = mlx_lm_greedy(target.model, chat_ids(tokenizer, prompt), 48)
    stop = next((i for i, t in enumerate(tokens) if t in tokenizer.eos_token_ids), len(tokens))
    assert want == tokenizer.decode(tokens[:stop])

    port = free_port()
    server = subprocess.Popen([*cli, "serve", "--port", str(port), "--max-tokens", "48"],
                              stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(server, url)
        c = client(url, timeout=600)  # a shared 2-core machine can be very slow
        name = c.models.list().data[0].id
        messages = [{"role": "user", "content": prompt}]
        r = c.chat.completions.create(model=name, messages=messages)
        assert r.choices[0].message.content == want and r.usage.completion_tokens == min(stop + 1, 48)
        assert r.model_extra["dflash"]["tau"] > 1  # the trained drafter's drafts are accepted
        chunks = c.chat.completions.create(model=name, messages=messages, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert "POST /v1/chat/completions 200" in server.stderr.read()
