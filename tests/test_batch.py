"""Continuous batching: several requests decoding together give each request's single-request output
(greedy), sampled rows keep the target's distribution beside greedy ones, and D-cut's width is the best
the cost model allows."""

import itertools
import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import PROMPTS, assert_distributed_as, chat_ids, mlx_lm_greedy
from tiny_families import tiny_chat_target
from mlx_dflash.decoding.batch_decoder import Batch, Request, Scheduler, batch_generate
from mlx_dflash.policies.width import DraftControls, WidthOptions, WidthPolicy
from mlx_dflash.policies.dcut import DCutPolicy, batch_cost_rows, build_policy, probe_batch_costs
from mlx_dflash.policies.verify_costs import batch_costs, read_cost_table
from mlx_dflash.decoding.decoder import DecodeState
from mlx_dflash.errors import DFlashError
from mlx_dflash.generate import generate
from mlx_dflash.models.loader import drafter_config_for, init_drafter
from mlx_dflash.decoding.sampling import SamplingParams, target_probs
from mlx_dflash.policies.width import RoundSeen

LIMITS = [20, 7, 15, 3, 12, 9, 18, 5]  # tokens per request: rows leave at different rounds


def bound(target, block_size=8, dflash2=False):
    config = drafter_config_for(target, num_layers=1, block_size=block_size, num_target_features=2)
    if dflash2:
        from mlx_dflash.models.config import parse_config

        raw = dict(config.raw, architectures=["DFlash2DraftModel"])
        raw["dflash_config"] = dict(raw["dflash_config"], conv_kernel_size=3, conv_group_size=16, selector_rank=8,
                                    selector_top_k=8)
        config = parse_config(raw)
    return init_drafter(config, seed=0).bind(target)


@pytest.fixture(scope="module")
def pairs(tiny_chat_pair):
    llama, tokenizer, drafter = tiny_chat_pair
    vocab = llama.vocab_size
    moe, hybrid = tiny_chat_target("qwen3_moe", vocab, seed=4), tiny_chat_target("qwen3_5", vocab, seed=3)
    dsa = tiny_chat_target("glm_moe_dsa", vocab, seed=6)  # MLA with an indexer: a CacheList a layer
    kv8 = tiny_chat_target("llama", vocab, seed=5, num_hidden_layers=4, hidden_size=128,
                           tie_word_embeddings=True)  # head dim 32: one quantization group
    kv8.quantize_kv(8, group_size=32, start=16)  # every chat prompt passes it as it is read
    return {"dense": (llama, drafter, tokenizer), "moe": (moe, bound(moe), tokenizer),
            "hybrid": (hybrid, bound(hybrid), tokenizer), "dflash2": (llama, bound(llama, dflash2=True), tokenizer),
            "kv8": (kv8, bound(kv8), tokenizer), "dsa": (dsa, bound(dsa), tokenizer)}


def prompts(tokenizer, n):
    return [chat_ids(tokenizer, p) for p in (PROMPTS * 2)[:n]]


@pytest.mark.parametrize("name", ["dense", "moe", "hybrid", "dflash2", "kv8", "dsa"])
def test_batched_greedy_output_equals_single_requests(pairs, name):
    target, drafter, tokenizer = pairs[name]
    ids = prompts(tokenizer, len(LIMITS))
    want = [generate(target, drafter, tokenizer, p, max_tokens=n, width=4).tokens for p, n in zip(ids, LIMITS)]
    for max_batch in (1, 3, 8) if name == "dense" else (4,):
        got = batch_generate(target, drafter, tokenizer, ids, max_tokens=LIMITS, max_batch=max_batch, width=4)
        assert got.token_ids == want, (name, max_batch)
        assert max(got.batch.rows) <= max_batch and (max_batch == 1 or max(got.batch.rows) > 2)
    if name == "dense":  # rows of every count 1..8 at once, D-cut choosing the widths
        got = batch_generate(target, drafter, tokenizer, ids, max_tokens=LIMITS, max_batch=8, width="auto")
        assert got.token_ids == want and max(got.batch.rows) >= 4 and len(got.batch.widths) > 1


def test_a_seeded_batch_draws_each_prompt_as_it_would_alone(pairs):
    """batch_generate's seed seeds every prompt's sample: each draws the tokens generate draws alone with it."""
    target, drafter, tokenizer = pairs["dense"]
    ids, limits = prompts(tokenizer, 3), [9, 4, 7]
    sampled = dict(temp=0.8, top_p=0.95, seed=11)
    want = [generate(target, drafter, tokenizer, p, max_tokens=n, **sampled).tokens for p, n in zip(ids, limits)]
    got = batch_generate(target, drafter, tokenizer, ids, max_tokens=limits, max_batch=2, **sampled)
    assert got.token_ids == want and len({tuple(t[:3]) for t in want}) > 1


class Alternating(WidthPolicy):
    """Width 4, with runs of up to 3 plain steps between rounds, in turn (as an auto policy that skips the
    drafter while it does not pay)."""

    turn = False

    def plain_steps(self, remaining: int) -> int:
        self.turn = not self.turn
        return min(3, remaining) if self.turn else 0


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_a_batch_takes_pipelined_plain_steps_where_its_policy_skips_the_drafter(pairs, name):
    """Plain steps (drafting off, or between rounds) give every row its single-request output; a joining
    row's first step picks its first token only, and rows come and go between runs."""
    target, drafter, tokenizer = pairs[name]
    ids = prompts(tokenizer, len(LIMITS))
    want = [generate(target, drafter, tokenizer, p, max_tokens=n, width=1).tokens for p, n in zip(ids, LIMITS)]
    off = batch_generate(target, drafter, tokenizer, ids, max_tokens=LIMITS, max_batch=3, width=1)
    assert off.token_ids == want and set(off.batch.widths) == {1} and max(off.batch.rows) == 3
    mixed = batch_generate(target, drafter, tokenizer, ids, max_tokens=LIMITS, max_batch=3,
                           policy=Alternating(drafter.block_size, 4, controls=DraftControls(prompt_lookup=False)))
    assert mixed.token_ids == want and {1, 4} <= set(mixed.batch.widths) and max(mixed.batch.rows) == 3


def test_a_run_of_plain_steps_comes_one_step_at_a_time(pairs):
    """One request streams a plain step's token as soon as it is read, not after the run: the run's rounds are
    yielded step by step (stream_generate's text is never held back for up to PLAIN_RUN tokens)."""
    target, drafter, tokenizer = pairs["dense"]
    (ids,) = prompts(tokenizer, 1)

    class Plain(WidthPolicy):  # drafting off: runs of plain steps, as long as the scheduler allows
        def plain_steps(self, remaining: int) -> int:
            return remaining

    scheduler = Scheduler(target, drafter, Plain(drafter.block_size, 4), 1)
    rounds = scheduler.alone(Request(0, ids, 12, SamplingParams()))
    first, second = next(rounds), next(rounds)  # the first token's step, then the first step of a run of 11
    assert first.plain and second.plain and scheduler.batch.steps == 1
    rest = list(rounds)
    assert scheduler.batch.steps == 11 and len(rest) == 10
    assert [t for r in [first, second] + rest for t in r.tokens] == mlx_lm_greedy(target.model, ids, 12)


def test_a_row_that_picks_its_stop_token_ends_the_plain_run_and_the_others_go_on_as_alone(pairs):
    """Drafting off: the rows take runs of plain steps. A row whose step picks a stop token ends the run (the
    step under way rolled back) and leaves in that scheduler step, not after the run; the other row, a seeded
    sample, then goes on exactly as it does alone (its random stream put back too)."""
    target, drafter, tokenizer = pairs["dense"]
    a, b = prompts(tokenizer, 2)
    policy = lambda: build_policy(target, drafter, WidthOptions(1), 2)  # noqa: E731
    greedy = generate(target, drafter, tokenizer, a, max_tokens=12, width=1).tokens
    stop = set(tokenizer.eos_token_ids) | {greedy[4]}
    sampled = SamplingParams(0.8, top_k=20)

    def run(requests):
        scheduler = Scheduler(target, drafter, policy(), 2, stop)
        for r in requests:
            scheduler.submit(r)
        steps, out = [], {r.handle: [] for r in requests}
        while scheduler.busy:
            events = scheduler.step()
            steps.append(events)
            for h, kind, v in events:
                out[h] += v.tokens if kind == "round" else []
        return steps, out

    alone = run([Request("b", b, 20, sampled, seed=3)])[1]["b"]
    assert greedy[4] not in alone  # b never stops on a's stop token itself
    steps, out = run([Request("a", a, 12), Request("b", b, 20, sampled, seed=3)])
    assert out["a"] == greedy[: greedy.index(greedy[4]) + 1] and out["b"] == alone
    ended = next(events for events in steps if ("a", "done", None) in events)
    a_rounds = [v.tokens for h, kind, v in ended if h == "a" and kind == "round"]
    assert a_rounds and a_rounds[-1] == [greedy[4]]  # its stop token's step ended the run; it left at once


def test_a_quantized_kv_cache_batches_its_rows_quantized_and_they_leave_as_their_own(pairs):
    """--kv-bits in a batch: once a row passes the quantization start its layer of the batch is quantized, every
    row stored as its own QuantizedKVCache stores it (a row leaves as one), and the batch's rounds equal one
    request's; a row short of the start waits in a plain layer until one passes it."""
    from mlx_lm.models.cache import QuantizedKVCache

    from mlx_dflash.models.batch_cache import RaggedKVCache, RaggedQuantizedKVCache

    target, drafter, tokenizer = pairs["kv8"]
    ids = prompts(tokenizer, 2)
    want = [generate(target, drafter, tokenizer, p, max_tokens=6, width=4).tokens for p in ids]
    batch = Batch(target, drafter, build_policy(target, drafter, WidthOptions(4), 2))
    assert all(type(c) is RaggedKVCache for c in batch.cache)
    for i, p in enumerate(ids):
        state = DecodeState.fresh(target, drafter)
        state.extend(p[:-1], target.read(mx.array(p[:-1]), state.cache))
        assert all(isinstance(c, QuantizedKVCache) for c in state.cache)
        batch.join(i, state, p[-1], SamplingParams(), 6)
    assert all(type(c) is RaggedQuantizedKVCache for c in batch.cache)
    got, left = [[], []], {}
    while batch.rows:
        for handle, rnd in batch.round():
            got[handle] += rnd.tokens
        left.update(batch.leave({r.handle for r in batch.rows if r.remaining <= 0}))
    assert got == want
    assert all(isinstance(c, QuantizedKVCache) and c.offset == len(s.tokens) for s in left.values() for c in s.cache)
    short = Batch(target, drafter, build_policy(target, drafter, WidthOptions(4), 1))
    state = DecodeState.fresh(target, drafter)
    state.extend([1, 2, 3], target.read(mx.array([1, 2, 3]), state.cache))
    short.join(0, state, 4, SamplingParams(), 20)
    assert type(short.cache[0]) is RaggedKVCache
    while short.rows[0].remaining > 0 and len(short.rows[0].state.tokens) <= 16:
        list(short.round())
    assert type(short.cache[0]) is RaggedQuantizedKVCache  # the row passed the start


def test_a_cancelled_row_leaves_and_the_others_go_on_unchanged(pairs):
    target, drafter, tokenizer = pairs["dense"]
    ids = prompts(tokenizer, 3)
    want = [generate(target, drafter, tokenizer, p, max_tokens=16, width=4).tokens for p in ids]
    policy = build_policy(target, drafter, WidthOptions(4), 3)
    scheduler = Scheduler(target, drafter, policy, 3, tokenizer.eos_token_ids)
    for i, p in enumerate(ids):
        scheduler.submit(Request(i, p, 16))
    emitted = {i: [] for i in range(3)}
    done = []
    while scheduler.busy:
        for i, kind, value in scheduler.step():
            if kind == "round":
                emitted[i] += value.tokens
                if i == 1 and len(emitted[1]) >= 4:
                    scheduler.cancel(1)
            elif kind == "done":
                done.append(i)
    assert sorted(done) == [0, 1, 2] and done.index(1) == 0  # the cancelled row left first, at once
    for i in (0, 2):
        stop = next((j for j, t in enumerate(emitted[i]) if t in tokenizer.eos_token_ids), None)
        assert emitted[i][: None if stop is None else stop] == want[i]
    assert emitted[1][:4] == want[1][:4] and len(emitted[1]) < 16


def counted(monkeypatch, target) -> dict:
    """Calls of the target's forward kinds from now on (this instance only; undone after the test)."""
    calls = {"forward": 0, "read": 0, "prefill": 0}
    for name in calls:
        def call(*args, _f=getattr(target, name), _name=name, **kw):
            calls[_name] += 1
            return _f(*args, **kw)
        monkeypatch.setattr(target, name, call)
    return calls


def test_a_request_joins_and_gets_its_first_token_in_the_step_that_reads_its_prompt(pairs, monkeypatch):
    """Time to first token, and no forward of its own: a request whose prompt fits one chunk is admitted, read
    but its last token, and gets its first token (alone in its first round, as a prefill gives it) from that
    step's one round, whose verify forward reads the last token beside the other rows' blocks."""
    target, drafter, tokenizer = pairs["dense"]
    ids = prompts(tokenizer, 2)
    scheduler = Scheduler(target, drafter, build_policy(target, drafter, WidthOptions(4), 2), 2,
                          tokenizer.eos_token_ids)
    calls = counted(monkeypatch, target)
    scheduler.submit(Request(0, ids[0], 16))
    firsts, forwards = {}, []
    for step in range(40):
        if step == 3:
            scheduler.submit(Request(1, ids[1], 16))
        before = dict(calls)
        for i, kind, value in scheduler.step():
            if kind == "round" and i not in firsts:
                firsts[i] = (step, len(value.tokens), value.drafted)
        forwards.append({k: calls[k] - before[k] for k in calls})
        if len(firsts) == 2:
            break
    assert firsts == {0: (0, 1, 0), 1: (3, 1, 0)}
    assert forwards[0] == forwards[3] == {"forward": 1, "read": 1, "prefill": 0}  # the prompt but its last token
    assert all(f == {"forward": 1, "read": 0, "prefill": 0} for f in forwards[1:3])  # rounds only


def test_a_short_prompt_is_read_in_turn_with_a_long_one_and_answered_before_its_read_ends(pairs):
    """Prompts are read in turn, a chunk per step: a short one submitted during a long one's read is read
    next and gets its first token while the long one is still being read, and both answers are the
    single-request ones."""
    target, drafter, tokenizer = pairs["dense"]
    long = chat_ids(tokenizer, " ".join(PROMPTS * 3))
    short = prompts(tokenizer, 1)[0]
    want = [generate(target, drafter, tokenizer, p, max_tokens=8, width=4).tokens for p in (long, short)]
    scheduler = Scheduler(target, drafter, build_policy(target, drafter, WidthOptions(4), 2), 2,
                          tokenizer.eos_token_ids, prefill_step=8)
    scheduler.submit(Request("long", long, 8))
    out, admitted, firsts, step = {"long": [], "short": []}, {}, {}, 0
    while scheduler.busy:
        if step == 1:
            scheduler.submit(Request("short", short, 8))
        for h, kind, value in scheduler.step():
            if kind == "admitted":
                admitted[h] = step
            elif kind == "round":
                firsts.setdefault(h, step)
                out[h] += value.tokens
        step += 1
    chunks = -(-(len(long) - 1) // 8)
    assert chunks > 2 * -(-(len(short) - 1) // 8) + 4  # the long read is many chunks, the short one's few
    assert admitted == {"long": 0, "short": 1}  # a prompt just admitted is read next, ahead of the long one
    assert firsts["short"] < firsts["long"] and firsts["long"] > chunks  # the long read took turns with it
    assert [out["long"], out["short"]] == want


def test_while_rows_decode_a_long_read_takes_turns_with_them_by_time(pairs, monkeypatch):
    """A chunk of reading that took as long as 10 rounds is followed by 10 rounds before the next chunk (a
    clock that reading advances by 10 and a round by 1), so a request decoding during a long read keeps half
    the engine; a prompt arriving meanwhile is read at once; the answers are the single-request ones."""
    from types import SimpleNamespace

    from mlx_dflash.decoding import batch_decoder

    target, drafter, tokenizer = pairs["dense"]
    long = chat_ids(tokenizer, " ".join(PROMPTS * 3))
    short, late = prompts(tokenizer, 2)
    limits = {"long": 8, "short": 60, "late": 8}
    want = {h: generate(target, drafter, tokenizer, p, max_tokens=limits[h], width=2).tokens
            for h, p in (("long", long), ("short", short), ("late", late))}
    clock = [0.0]
    monkeypatch.setattr(batch_decoder, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    for name, seconds in (("read", 10.0), ("forward", 1.0)):
        def timed(*args, _f=getattr(target, name), _s=seconds, **kw):
            clock[0] += _s
            return _f(*args, **kw)
        monkeypatch.setattr(target, name, timed)
    scheduler = Scheduler(target, drafter, build_policy(target, drafter, WidthOptions(2), 3), 3,
                          tokenizer.eos_token_ids, prefill_step=8)
    out = {h: [] for h in limits}

    def step() -> bool:
        """One step; whether it read a chunk."""
        before = clock[0]
        for h, kind, value in scheduler.step():
            if kind == "round":
                out[h] += value.tokens
        return clock[0] - before >= 10

    scheduler.submit(Request("short", short, limits["short"]))
    while not out["short"]:
        step()
    scheduler.submit(Request("long", long, limits["long"]))
    # the short request decodes at most 2 tokens a round: 30 rounds at least, the long read goes on meanwhile
    reads = [step() for _ in range(21)]
    assert reads == [i % 10 == 0 for i in range(21)]  # a chunk, then 9 steps of rounds only, and again
    scheduler.submit(Request("late", late, limits["late"]))
    assert step()  # read at once, although the rows are owed rounds
    while scheduler.busy:
        step()
    assert out == want


def test_a_prompt_cancelled_during_its_read_leaves_and_frees_its_place(pairs):
    target, drafter, tokenizer = pairs["dense"]
    long = chat_ids(tokenizer, " ".join(PROMPTS * 3))
    short, third = prompts(tokenizer, 2)
    want = {h: generate(target, drafter, tokenizer, p, max_tokens=6, width=4).tokens
            for h, p in (("short", short), ("third", third))}
    scheduler = Scheduler(target, drafter, build_policy(target, drafter, WidthOptions(4), 1), 1,
                          tokenizer.eos_token_ids, prefill_step=8)
    scheduler.submit(Request("long", long, 8))
    scheduler.submit(Request("short", short, 6))  # read beside it: one prompt beyond the one row
    scheduler.submit(Request("third", third, 6))  # waits
    events = scheduler.step() + scheduler.step()
    assert [e[:2] for e in events] == [("long", "admitted"), ("short", "admitted")] and len(scheduler.waiting) == 1
    scheduler.cancel("long")
    events = scheduler.step()
    # the cancelled read leaves at once and the waiting prompt takes its place in the same step
    assert events[0] == ("long", "done", None) and events[1][:2] == ("third", "admitted")
    out = {"short": [], "third": []}
    while scheduler.busy:
        for h, kind, v in scheduler.step():
            out[h] += v.tokens if kind == "round" else []
    assert out == want and not scheduler.reading and not scheduler.ready
    scheduler.cancel("short")  # done already: nothing to end (a server cancels a request its stop string ended)
    assert not (scheduler.handles or scheduler.ending or scheduler.checkpoints)  # it keeps nothing of them


def test_at_one_row_a_short_prompt_read_beside_a_long_one_decodes_before_that_read_ends(pairs):
    """One prompt beyond the rows is read: at one row (serve --max-batch 1) a short request arriving during a
    long read is read in turn with it, joins the free row and is answered first; the long one then joins."""
    target, drafter, tokenizer = pairs["dense"]
    long = chat_ids(tokenizer, " ".join(PROMPTS * 3))
    (short,) = prompts(tokenizer, 1)
    want = {h: generate(target, drafter, tokenizer, p, max_tokens=6, width=4).tokens
            for h, p in (("long", long), ("short", short))}
    scheduler = Scheduler(target, drafter, build_policy(target, drafter, WidthOptions(4), 1), 1,
                          tokenizer.eos_token_ids, prefill_step=8)
    scheduler.submit(Request("long", long, 6))
    order, out = [], {"long": [], "short": []}
    while scheduler.busy:
        if len(order) == 1:  # the long read has begun
            scheduler.submit(Request("short", short, 6))
        for h, kind, v in scheduler.step():
            order.append((h, kind))
            out[h] += v.tokens if kind == "round" else []
        assert len(scheduler.batch) <= 1
    assert out == want
    assert order.index(("short", "done")) < min(order.index(e) for e in order if e == ("long", "round"))
@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_requests_the_prefix_cache_holds_but_their_last_token_join_with_no_read(pairs, name, monkeypatch):
    """Asked again, each prompt is restored from the prefix cache but its last token and joins at once (no
    prompt read), and the answers stay the single-request ones; a hybrid target restores from the
    checkpoint one token before the end."""
    from mlx_dflash.decoding.prompt_cache import PromptCache

    target, drafter, tokenizer = pairs[name]
    ids = prompts(tokenizer, 4)
    want = [generate(target, drafter, tokenizer, p, max_tokens=n, width=4).tokens for p, n in zip(ids, LIMITS)]
    cache = PromptCache("test", target.trimmable)
    first = batch_generate(target, drafter, tokenizer, ids, max_tokens=LIMITS[:4], max_batch=2, width=4,
                           prompt_cache=cache)
    calls = counted(monkeypatch, target)
    again = batch_generate(target, drafter, tokenizer, ids, max_tokens=LIMITS[:4], max_batch=2, width=4,
                           prompt_cache=cache)
    assert first.token_ids == again.token_ids == want
    assert [s.cached_tokens for s in again.stats] == [len(p) - 1 for p in ids]
    assert calls["read"] == calls["prefill"] == 0 and calls["forward"] == again.batch.rounds


def scheduled(target, drafter, tokenizer, policy, max_batch: int, requests: list) -> dict:
    """Each request's tokens, the requests decoded together through a Scheduler."""
    scheduler = Scheduler(target, drafter, policy, max_batch, tokenizer.eos_token_ids)
    for r in requests:
        scheduler.submit(r)
    out = {r.handle: [] for r in requests}
    while scheduler.busy:
        for h, kind, value in scheduler.step():
            if kind == "round":
                out[h] += value.tokens
    return out


def test_a_seeded_row_samples_the_same_whatever_rows_are_beside_it(pairs):
    """At a fixed width with a v1 drafter (its drafts are argmaxes), a seeded row's own random stream makes
    its answer independent of the rows decoding beside it."""
    target, drafter, tokenizer = pairs["dense"]
    ids = prompts(tokenizer, 3)
    policy = build_policy(target, drafter, WidthOptions(4), 3)

    def run(requests):
        return scheduled(target, drafter, tokenizer, policy, 3, requests)

    sampled = Request("s", ids[0], 12, SamplingParams(0.9, top_k=20), seed=11)
    alone = run([sampled])["s"]
    beside = run([Request("g", ids[1], 12), sampled, Request("t", ids[2], 12, SamplingParams(1.0))])["s"]
    assert alone == beside and alone != run([Request("s", ids[0], 12, SamplingParams(0.9, top_k=20), seed=12)])["s"]


@pytest.mark.slow
def test_sampled_rows_beside_greedy_rows_keep_the_target_distribution(pairs):
    """From fixed states: each row's first round reads its prompt's last token and picks its first token
    (the sampled row's with a fixed key, so the same every trial); in the second round the sampled row's next
    token (its drafts judged by rejection sampling, its own stream seeded per trial) follows the target's
    distribution, and the greedy row beside it is the argmax."""
    import copy

    target, drafter, tokenizer = pairs["dense"]
    params = SamplingParams(1.0, top_k=4)
    ids = prompts(tokenizer, 2)
    states = []
    for p in ids:
        state = DecodeState.fresh(target, drafter)
        state.extend(p[:-1], target.read(mx.array(p[:-1]), state.cache))
        states.append(state)
    firsts, nexts = [], []
    for trial in range(300):
        batch = Batch(target, drafter, WidthPolicy(drafter.block_size, 4, controls=DraftControls(prompt_lookup=False)))
        batch.join("s", copy.deepcopy(states[0]), ids[0][-1], params, 8, mx.random.key(0), mx.random.key(trial))
        batch.join("g", copy.deepcopy(states[1]), ids[1][-1], SamplingParams(), 8)
        firsts.append({h: rnd.tokens for h, rnd in batch.round()})
        nexts.append(dict(batch.round()))
    assert all(f == firsts[0] for f in firsts) and all(len(t) == 1 for t in firsts[0].values())
    firsts = firsts[0]
    p_next = target_probs(target.model(mx.array([ids[0] + firsts["s"]]))[0, -1], params)
    greedy_next = int(mx.argmax(target.model(mx.array([ids[1] + firsts["g"]]))[0, -1]))
    assert all(n["g"].tokens[0] == greedy_next for n in nexts)
    assert_distributed_as([n["s"].tokens[0] for n in nexts], p_next)


def brute_force(policy, confidence, remaining, batch):
    """The best rate over every per-row choice of kept drafts (a padded verify costs its longest row)."""
    best = 0.0
    for keeps in itertools.product(*[range(min(len(c), n - 1) + 1) for c, n in zip(confidence, remaining)]):
        width = max(keeps) + 1
        tokens = sum(policy.calibration.expected_tokens(c, k + 1) for c, k in zip(confidence, keeps))
        best = max(best, tokens / (policy.draft_seconds + policy.cost(batch, width)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_dcut_chooses_the_width_a_brute_force_over_per_row_keeps_finds(seed):
    rng = np.random.default_rng(seed)
    steps = rng.uniform(0.002, 0.02, size=(3, 5)).cumsum(axis=1)  # more rows never cost less
    costs = {b: {w: 0.05 + 0.01 * b + b * steps[b - 1, w - 1] for w in range(1, 6)} for b in (1, 2, 3)}
    policy = DCutPolicy(8, 5, costs)
    policy.draft_seconds = 0.01
    for batch in (1, 2, 3):
        confidence = rng.uniform(0.05, 1.0, size=(batch, 4)).tolist()
        remaining = rng.integers(2, 8, size=batch).tolist()
        width = policy.cut(min(5, max(remaining)), confidence, [0] * batch, remaining)
        assert policy.rate(confidence, [0] * batch, remaining, width) == pytest.approx(
            brute_force(policy, confidence, remaining, batch))


def test_dcut_interpolates_costs_between_measured_batch_sizes_and_learns_each_cell_from_its_rounds():
    policy = DCutPolicy(8, 4, {1: {w: 0.1 * w for w in range(1, 5)}, 4: {w: 0.4 * w for w in range(1, 5)}})
    assert policy.cost(2, 3) == pytest.approx(0.6) and policy.cost(8, 1) == pytest.approx(0.8)
    policy.observe(RoundSeen([[0.9, 0.9, 0.9]], [3], [3], 4, 0.01, 0.2, [0]))
    policy.observe(RoundSeen([[0.9, 0.9, 0.9]] * 2, [3, 3], [3, 3], 4, 0.01, 0.3, [0, 0]))
    assert policy.cost(1, 4) == pytest.approx(0.2) and policy.cost(2, 4) == pytest.approx(0.3)  # as timed
    # a width not timed: the probe's cost at the scale its batch size's rounds showed (0.2 for 0.4 guessed)
    assert policy.cost(1, 3) == pytest.approx(0.3 * (0.8 + 0.2 * 0.5))
    assert policy.calibration.trials.sum() == 9


def test_dcut_learns_that_a_wider_verify_can_cost_less():
    """A batched matmul's cost follows its tiling: here 3 tokens a row cost more than 4, which the probe
    missed. The chooser follows the probe, then moves to 4 once a round of 3 was timed; 5, dear, is tried
    at most once (an exploration round: the probe's costs looked too high once 4 was timed)."""
    policy = DCutPolicy(8, 5, {4: {1: 0.09, 2: 0.095, 3: 0.08, 4: 0.14, 5: 0.20}})
    true_cost = {1: 0.09, 2: 0.095, 3: 0.14, 4: 0.10, 5: 0.20}
    confidence, chosen = [[0.99] * 4] * 4, []
    for _ in range(30):
        width = policy.cut(5, confidence, [0] * 4, [48] * 4)
        chosen.append(width)
        policy.observe(RoundSeen(confidence, [width - 1] * 4, [width - 1] * 4, width, 0.01, true_cost[width],
                                 [0] * 4))
    assert chosen[0] == 3 and chosen.count(5) <= 1 and chosen[1:].count(4) >= 28


def test_dcut_times_a_near_best_width_one_round_in_ten():
    policy = DCutPolicy(8, 5, {4: {1: 0.09, 2: 0.095, 3: 0.105, 4: 0.11, 5: 0.3}})
    confidence, chosen = [[0.9] * 4] * 4, []
    for _ in range(10):  # 4 is best, 3 within 20% of it, 2 and 5 far below
        width = policy.cut(5, confidence, [0] * 4, [48] * 4)
        chosen.append(width)
        # a timing only
        policy.observe(RoundSeen(None, [width - 1] * 4, [0] * 4, width, 0.01, policy.cost(4, width), [0] * 4))
    assert chosen == [4] * 9 + [3]


def test_dcut_drafts_two_positions_past_the_widest_width_chosen_lately():
    policy = DCutPolicy(16, 16, {2: {w: 0.05 + 0.01 * w for w in range(1, 17)}})
    assert policy.width(2, 48) == 16  # nothing chosen yet: the whole block
    policy.observe(RoundSeen([[0.5] * 15] * 2, [2, 2], [1, 1], 3, 0.01, 0.08, [0, 0]))  # a round chose 3
    assert policy.width(2, 48) == 5
    policy.observe(RoundSeen([[0.5] * 4] * 2, [4, 4], [1, 1], 5, 0.01, 0.10, [0, 0]))  # it wanted all 5 it had
    assert policy.width(2, 48) == 16 and policy.width(2, 4) == 4


def test_dcut_skips_the_drafter_while_drafting_does_not_pay_and_probes_ever_more_rarely():
    policy = DCutPolicy(16, 16, {1: {w: 0.05 + 0.01 * w for w in range(1, 17)}})
    policy.gain = 0.5  # drafting rounds expected at half the rate of plain steps

    def rounds(n, remaining=48):  # what a batch takes, round by round: plain steps, or a drafting width
        return [("plain", steps) if (steps := policy.plain_steps(remaining)) else policy.width(1, remaining)
                for _ in range(n)]

    assert rounds(8) == [16, ("plain", 7), 16, ("plain", 15), 16, ("plain", 31), 16, ("plain", 31)]
    assert rounds(2, remaining=5) == [5, ("plain", 5)] and rounds(1, remaining=5) == [("plain", 5)]
    policy.gain = 1.5  # a probe that pays: drafting every round again, and the next skip short again
    assert rounds(2) == [16, 16]
    policy.gain = 0.5
    assert rounds(3) == [16, ("plain", 7), 16]
    policy.observe_plain(7, 0.07, rows=1)  # pipelined plain steps time the one-token cell
    assert policy.costs[1][1] == pytest.approx(0.01) and policy.timed[1][1] == 1


def test_the_cost_probe_covers_every_batch_and_width_and_refusals_name_the_fix(pairs, tmp_path):
    target, drafter, _ = pairs["dense"]
    costs = probe_batch_costs(target, [1, 2], 6, context=16, repeats=1)
    assert sorted(costs) == [1, 2] and all(sorted(row) == list(range(1, 7)) for row in costs.values())
    assert all(0 < s < 60 for row in costs.values() for s in row.values())
    path = tmp_path / "cost_table.json"
    one_row = {"widths": [1, 2, 4], "verify_seconds": [0.1, 0.2, 0.3]}
    path.write_text(json.dumps({**one_row, **batch_cost_rows(costs)}))
    assert batch_costs(read_cost_table(path)) == costs  # the same floats back (JSON keeps them exactly)
    path.write_text(json.dumps(one_row))  # one row's costs: the batch of one
    assert batch_costs(read_cost_table(path)) == {1: {1: 0.1, 2: 0.2, 4: 0.3}}
    policy = build_policy(target, drafter, WidthOptions("auto"), 3, batch_costs(read_cost_table(path)))
    assert sorted(policy.guessed) == [1, 2, 3] and sorted(policy.guessed[3]) == list(range(1, drafter.block_size + 1))
    assert policy.guessed[1][3] == pytest.approx(0.25)  # between the measured widths
    for bad, words in [({"widths": [1]}, "'widths' and 'verify_seconds'"),
                       ({"batch_verify_seconds": {"1": [0.1, -1]}}, "every cost positive")]:
        path.write_text(json.dumps(bad))
        with pytest.raises(DFlashError, match=words):
            batch_costs(read_cost_table(path))
    with pytest.raises(DFlashError, match="--max-batch must be at least 1"):
        build_policy(target, drafter, None, 0)
    with pytest.raises(DFlashError, match="verify width 9 is out of range"):
        build_policy(target, drafter, WidthOptions(9), 2)
