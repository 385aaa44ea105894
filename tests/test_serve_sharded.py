"""`mlx-dflash serve --shard tensor|pipeline`: rank 0 listens, the other ranks follow its requests.

Default tier: the request header's encoding, the refusals, and when rank 0 tells the others that a
generation ended early. Slow tier: 2-rank servers over the ring backend on loopback (the ranks started by
hand, as mlx.launch does, so that a test holds each one's exit status), driven with the `openai` client and
compared with a single-process server on the same pair.
"""

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import openai
import pytest
from click.testing import CliRunner
from mlx_lm import load

from mlx_dflash.cli import main
from mlx_dflash.generate import generate
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.models.loader import drafter_from_dir
from mlx_dflash.decoding.sampling import SamplingParams
from mlx_dflash.decoding.batch_decoder import Request, Scheduler
from mlx_dflash.distributed import Ranks
from mlx_dflash.policies.width import WidthOptions
from mlx_dflash.server.protocol import Defaults, parse_completion
from mlx_dflash.server.sharded import BEAT, HEADER_WORDS, REQUEST, SHUTDOWN, STEP, Header, Leader, RanksOutOfStep, follow
from mlx_dflash.models.target import Target
from metal_fakes import failing_kernels_env
from sharded_models import CLI, save_random_drafter, save_tiny_target, start_ranks
from serving import client, raw, running

PROMPT = [5, 17, 42, 99, 3, 150, 7, 61, 88, 23, 11, 190]
CHAT = [{"role": "user", "content": "Tell me about the sea."}]


# Default tier.

def test_header_round_trips_exact_values():
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05)  # not exact in float32
    for header in (Header(REQUEST, 256, 31, sampling, 2**64 - 1), Header(REQUEST, 1, 1, SamplingParams(), 0),
                   Header(REQUEST, 5, 2), Header(BEAT), Header(SHUTDOWN), Header(STEP, requests=3, ending=2)):
        words = header.encode()
        assert words.dtype == mx.int32 and words.shape == (HEADER_WORDS,)
        assert Header.decode(words) == header
    assert Header.decode(Header(REQUEST, 5, 2).encode()).seed is None  # no seed is not seed 0
    summed = Header(REQUEST, 9, 4, sampling, 3).encode() + mx.zeros(HEADER_WORDS, dtype=mx.int32)
    assert Header.decode(summed) == Header(REQUEST, 9, 4, sampling, 3)  # what the others' zeros leave


def test_a_malformed_header_is_an_out_of_step_error():
    with pytest.raises(RanksOutOfStep, match="malformed header from rank 0"):
        Header.decode(mx.full(HEADER_WORDS, 7, dtype=mx.int32))
    with pytest.raises(RanksOutOfStep, match="the ranks are out of step"):
        Header.decode(Header(REQUEST, 0, 3).encode())


def test_serve_shard_without_a_launch_is_one_line_before_listening(tmp_path):
    args = ["serve", "--model", str(tmp_path), "--shard", "tensor", "--port", "1"]  # port 1: never bound
    result = CliRunner().invoke(main, args)
    assert (result.exit_code, result.output.strip()) == (1, (
        "error: --shard needs several ranks: start the command with mlx.launch, e.g. "
        "`mlx.launch --backend ring -n 2 -- mlx-dflash serve ... --shard tensor`"))
    result = CliRunner().invoke(main, [*args, "--rank-timeout", "-1"])
    assert (result.exit_code, result.output.strip()) == (1, "error: --rank-timeout must be positive seconds, got -1.0")


class Taped(Ranks):
    """A rank of two whose collective is a tape: rank 0 records what it sends, rank 1 replays it afterwards
    (what rank 0's values summed with zeros would give), checking that it asks for the same shape each time."""

    class Group:
        def __init__(self, rank):
            self._rank = rank

        def rank(self):
            return self._rank

        def size(self):
            return 2

    def __init__(self, rank, tape, block_size, max_rows):
        super().__init__(self.Group(rank), block_size, partial_features=False, max_rows=max_rows)
        self.tape = tape

    def _sum(self, array):
        if self.rank == 0:
            mx.eval(array)
            self.tape.append(array)
            return array
        sent = self.tape.pop(0)
        assert (sent.shape, sent.dtype) == (array.shape, array.dtype)
        return sent


def test_a_following_rank_steps_its_scheduler_as_rank0_steps_its_own(tiny_chat_pair, monkeypatch):
    """Rank 0's scheduler (a `Leader`) sends what joins and ends before each step; `follow` on another rank
    submits and cancels the same and steps alike: every round decodes the same rows, whatever the other
    rank's clock would have chosen (its reads of prompt chunks, its widths)."""
    import mlx_dflash.server.sharded as sharded

    target, tokenizer, drafter = tiny_chat_pair
    ids = [PROMPT * 4, PROMPT[:5], PROMPT[3:], PROMPT * 2]
    tape, seen = [], []

    class Recording(Scheduler):  # the following rank's scheduler, its events kept, its clock far from rank 0's
        def step(self):
            self.read_debt = 1e9  # by its own clock it would never read a prompt's chunk while rows decode
            events = super().step()
            seen.extend(events)
            return events

    def policy():
        return build_policy(target, drafter, WidthOptions("auto"), 2)

    rank0 = Taped(0, tape, drafter.block_size, 2)
    leader = Leader(Scheduler(target, drafter, policy(), 2, tokenizer.eos_token_ids, None, 8, rank0), rank0)
    for i, prompt in enumerate(ids[:3]):
        leader.submit(Request(f"r{i}", prompt, 12, SamplingParams(0.8) if i == 2 else SamplingParams()))
    events, steps = [], 0
    while leader.busy:
        events += leader.step()
        steps += 1
        if steps == 3:
            leader.submit(Request("r3", ids[3], 12))
        if steps == 6:
            leader.cancel("r1")
    rank0.share(Header(SHUTDOWN).encode())
    monkeypatch.setattr(sharded, "Scheduler", Recording)
    follow(target, drafter, tokenizer, policy(), Taped(1, tape, drafter.block_size, 2), 2, 8)

    def tokens(events, name):
        return {name(h): sum((v.tokens for h2, k, v in events if h2 == h and k == "round"), [])
                for h, k, _ in events if k == "done"}

    assert not tape
    assert tokens(seen, lambda n: f"r{n}") == tokens(events, str)
    assert [(f"r{h}", k) for h, k, _ in seen] == [(h, k) for h, k, _ in events]
    assert 0 < len(tokens(events, str)["r1"]) < 12  # cancelled midway


def test_seed_outside_64_bits_is_a_400():
    from mlx_dflash.server.protocol import APIError

    for seed in (-1, 2**64):
        with pytest.raises(APIError, match="'seed' must be an integer from 0 to 2\\*\\*64 - 1") as e:
            parse_completion({"prompt": "x", "seed": seed}, Defaults(), "tiny")
        assert e.value.status == 400


# Two ranks over loopback.

@pytest.fixture(scope="module")
def qwen2_pair(tmp_path_factory):
    """(target dir, drafter dir, (Target, drafter, tokenizer) loaded in this process) of a tiny random qwen2."""
    from mlx_dflash.downloads import ensure_smollm2

    root = tmp_path_factory.mktemp("sharded-serve")
    target_dir = save_tiny_target(root / "qwen2", "qwen2", ensure_smollm2("float32"))
    drafter_dir = save_random_drafter(root / "drafter", target_dir)
    model, tokenizer = load(str(target_dir))
    target = Target(model)
    return target_dir, drafter_dir, (target, drafter_from_dir(drafter_dir).bind(target), tokenizer)


class ShardedServer:
    """Both ranks of `mlx-dflash serve --shard MODE`, started by hand; rank 0 listens on a free port."""

    def __init__(self, tmp_path, pair, mode, *extra, env=None):
        from sharded_models import free_port

        target_dir, drafter_dir, _ = pair
        self.port = free_port(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.ranks = start_ranks([*CLI, "serve", "--model", str(target_dir), "--drafter", str(drafter_dir),
                                  "--model-name", "tiny", "--port", str(self.port), "--shard", mode, *extra],
                                 tmp_path / "hostfile.json", env=env)
        self.client = client(self.url, timeout=300)
        deadline = time.monotonic() + 300
        while True:
            assert all(p.poll() is None for p in self.ranks), self.finish(0)
            assert time.monotonic() < deadline, "the sharded server did not start"
            try:
                self.client.models.list()
                return
            except openai.APIConnectionError:
                time.sleep(0.3)

    def finish(self, timeout=60, ranks=(0, 1)):
        """[(exit status, stderr lines, seconds to exit)] of these ranks, once each has stopped."""
        out, tic = [], time.monotonic()
        for p in (self.ranks[r] for r in ranks):
            try:
                _, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - tic)))
            except Exception:
                p.kill()
                _, err = p.communicate()
                out.append((None, err.strip().splitlines(), None))
                continue
            out.append((p.returncode, err.strip().splitlines(), time.monotonic() - tic))
        return out

    def kill(self):
        for p in self.ranks:
            if p.poll() is None:
                p.kill()
                p.wait()


def completion(c, stream=False, **kw):
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, **kw}
    if stream:
        return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw))
    return c.completions.create(**kw).choices[0].text


def chat(c, stream=False, **kw):
    kw = {"model": "tiny", "messages": CHAT, "max_tokens": 16, **kw}
    if stream:
        return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw)
                       if ch.choices)
    return c.chat.completions.create(**kw).choices[0].message.content


def cancel_mid_stream(c, chunks=3):
    """Start a long streamed answer, read a few chunks, and hang up."""
    stream = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=5000, stream=True)
    for i, _ in enumerate(stream):
        if i + 1 == chunks:
            break
    stream.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_two_rank_server_answers_like_one_process(tmp_path, qwen2_pair, mode):
    target, drafter, tokenizer = qwen2_pair[2]
    greedy_ids = generate(target, drafter, tokenizer, PROMPT, max_tokens=24).tokens
    with running(qwen2_pair[2]) as (url, _):  # the single-process server on the same pair
        alone = client(url)
        want = dict(greedy=completion(alone), chat=chat(alone),
                    sampled=completion(alone, temperature=1.0, seed=7, max_tokens=24),
                    top_k=chat(alone, temperature=0.8, extra_body={"top_k": 20}, seed=3))
    assert want["greedy"] == tokenizer.decode(greedy_ids[:16])
    assert want["sampled"] != tokenizer.decode(greedy_ids)  # sampling did sample

    # the reference's fixed width (the drafter's block): under --width auto a seed need not give the same sample
    server = ShardedServer(tmp_path, qwen2_pair, mode, "--width", str(drafter.block_size))
    try:
        c = server.client
        assert completion(c) == want["greedy"]
        assert completion(c, stream=True) == want["greedy"]  # two requests in sequence, streamed or not
        assert chat(c, stream=True) == chat(c) == want["chat"]
        assert completion(c, temperature=1.0, seed=7, max_tokens=24) == want["sampled"]
        assert chat(c, stream=True, temperature=0.8, extra_body={"top_k": 20}, seed=3) == want["top_k"]
        stop = want["greedy"][5:9]  # rank 0 ends this one before the decoder does
        assert completion(c, stop=stop) == want["greedy"][: want["greedy"].index(stop)]
        cancel_mid_stream(c)
        assert completion(c) == want["greedy"]  # the ranks are still in step
        assert chat(c, stream=True) == want["chat"]
        time.sleep(3)  # idle: rank 0's beats keep the others waiting, not timing out
        assert completion(c) == want["greedy"]
        asks = [lambda: completion(c), lambda: chat(c, stream=True),
                lambda: completion(c, temperature=1.0, seed=7, max_tokens=24)]
        with ThreadPoolExecutor(len(asks)) as pool:  # decoded together: the ranks step one batch
            assert list(pool.map(lambda ask: ask(), asks)) == [want["greedy"], want["chat"], want["sampled"]]
        rows = raw(server.url, "/health")[2]["batch"]["rows"]
        assert max(map(int, rows)) >= 2, rows
        for rank in server.ranks:  # Ctrl-C in a terminal: every local rank gets SIGINT
            rank.send_signal(signal.SIGINT)
        (code0, err0, _), (code1, err1, seconds) = server.finish()
    finally:
        server.kill()
    assert (code0, code1) == (0, 0), (err0[-5:], err1[-5:])
    assert seconds < 30
    assert not any(line.startswith("error") or "Traceback" in line for line in err0 + err1), err0 + err1
    cancelled = [line for line in err0 if "finish=cancelled" in line]
    assert len(cancelled) == 1 and int(cancelled[0].split("completion=")[1].split()[0]) < 5000, err0
    assert " 499 id=" in cancelled[0]  # a stream whose client left
    assert sum(" 200 id=" in line for line in err0) == 13 and not any(" 200 id=" in line for line in err1)


@pytest.mark.slow
def test_a_two_rank_server_answers_through_a_failing_kernel(tmp_path, tmp_path_factory):
    """Metal faked in both ranks, our attention kernel failing to compile (tests/failing_kernels): the sharded
    server answers one request and a batch as the single-process server does, and logs the fallback once."""
    from mlx_dflash.downloads import ensure_smollm2

    target_dir = save_tiny_target(tmp_path / "qwen3", "qwen3", ensure_smollm2("float32"), head_dim=64)
    drafter_dir = save_random_drafter(tmp_path / "drafter", target_dir)
    model, tokenizer = load(str(target_dir))
    target = Target(model)
    pair = (target_dir, drafter_dir, (target, drafter_from_dir(drafter_dir).bind(target), tokenizer))
    asks = [lambda c: completion(c), lambda c: chat(c), lambda c: completion(c, prompt=PROMPT[3:], max_tokens=12)]
    with running(pair[2]) as (url, _):
        want = [ask(client(url)) for ask in asks]
    server = ShardedServer(tmp_path, pair, "tensor", "--width", "8",
                           env=failing_kernels_env("compile", tmp_path / "verdicts.json"))
    try:
        c = server.client
        assert completion(c) == want[0]
        with ThreadPoolExecutor(len(asks)) as pool:  # decoded together: ragged rows through the fallback
            assert list(pool.map(lambda ask: ask(c), asks)) == want
        for rank in server.ranks:
            rank.send_signal(signal.SIGINT)
        (code0, err0, _), (code1, err1, _) = server.finish()
    finally:
        server.kill()
    assert (code0, code1) == (0, 0), (err0[-5:], err1[-5:])
    note = ("note: verify attention: MLX's SDPA instead of ours (ours failed here: RuntimeError: [metal::Device] "
            "Unable to build metal library from source; the shape bins are in the routes)")
    assert err0.count(note) == 1, err0


@pytest.mark.slow
@pytest.mark.parametrize("mode,when", [("tensor", "mid-stream"), ("pipeline", "idle")])
def test_killing_rank1_stops_rank0_with_one_line(tmp_path, qwen2_pair, mode, when):
    server = ShardedServer(tmp_path, qwen2_pair, mode)
    try:
        c = server.client
        assert completion(c, max_tokens=4)
        if when == "mid-stream":
            stream = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=100000, stream=True)
            next(iter(stream))
        server.ranks[1].kill()
        if when == "mid-stream":
            with pytest.raises(openai.APIError, match="lost contact with the other ranks"):
                for _ in stream:
                    pass
        ((code0, err0, seconds),) = server.finish(timeout=60, ranks=(0,))
    finally:
        server.kill()
    assert code0 == 1
    assert err0[-1] == ("error: rank 0: lost contact with the other ranks ([ring] connection to a peer was lost); "
                        "another rank has stopped: see its own output"), err0[-5:]
    assert seconds < 30 and "Traceback" not in "\n".join(err0)


@pytest.mark.slow
def test_a_refused_pair_is_one_line_from_rank0_and_both_ranks_exit_1(tmp_path):
    from mlx_dflash.downloads import ensure_smollm2

    target_dir = save_tiny_target(tmp_path / "qwen3", "qwen3", ensure_smollm2("float32"))
    ranks = start_ranks([*CLI, "serve", "--model", str(target_dir), "--drafter", str(tmp_path / "none"),
                         "--shard", "pipeline", "--port", "0"], tmp_path / "hostfile.json")
    results = [(p.wait(timeout=120), p.stderr.read().strip().splitlines()) for p in ranks]
    assert [code for code, _ in results] == [1, 1]
    assert results[0][1] == ["error: --shard pipeline: mlx-lm's 'qwen3' models have no pipeline support; "
                             "try --shard tensor"], results[0][1]
    assert results[1][1] == [], results[1][1]


@pytest.mark.slow
def test_a_hung_rank1_stops_the_idle_rank0_after_the_rank_timeout(tmp_path, qwen2_pair):
    server = ShardedServer(tmp_path, qwen2_pair, "tensor", "--rank-timeout", "5")
    try:
        assert completion(server.client, max_tokens=4)
        server.ranks[1].send_signal(signal.SIGSTOP)  # alive, sockets open, answering nothing
        ((code0, err0, seconds),) = server.finish(timeout=60, ranks=(0,))
    finally:
        server.kill()
    assert code0 == 1
    assert err0[-1] == ("error: rank 0: no round finished in 5 s: another rank has stopped answering "
                        "(see its own output); giving up"), err0[-5:]
    assert seconds < 30
