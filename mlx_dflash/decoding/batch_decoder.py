"""Several requests decoding together: the DFlash round (decoding/decoder.py `speculative_round`, written over
rows) for a batch whose rows come and go.

Each round, one drafter pass drafts a block for every row, one target forward verifies [anchor, drafts]
for every row, and every row keeps its own number of drafts and rolls back alone (models/batch_cache.py:
per-row lengths; hybrid targets rewind each row's recurrent state). A row joins from a request's
`DecodeState` holding its prompt but the last token (read in chunks beside the rounds, or restored from the
prefix cache): that token is its first anchor, and the round's verify forward reads it with the other rows'
blocks and picks the request's first token, so a request joining costs the batch a row, not a forward of its
own (what a verify of one token a row costs: docs/batching.md). A row leaves as a `DecodeState`, at once,
when it finishes or its client goes: nobody waits for the batch to drain.

Every row verifies the same number of rows, the round's width W (a batch forward pads its rows to the
longest, and MLX has no ragged batches: per-row RoPE offsets, not per-token positions), less where a row
has fewer tokens left. The width comes from the policy (policies/width.py `WidthPolicy`): fixed, or chosen
each round from every row's drafter confidence and the cost of a verify of width W for this many rows (D-cut).
Where the policy skips the drafter (drafting off, or D-cut while drafting does not pay), the rows take a run of
plain target steps instead, pipelined as one request's are (decoding/decoder.py `plain_rounds`).
Greedy rows keep the longest matching prefix; sampled rows (each with its own settings and, when seeded,
its own random stream) accept by rejection sampling, as a single request does.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import mlx.core as mx

from ..errors import DFlashError
from ..machine import prefill_step as machine_prefill_step
from ..models.batch_cache import RaggedKVCache, add_row, batched, keep_rows, row_of
from .decoder import DecodeState, Round, Row, SingleProcess, plain_rounds, seeded_keys, speculative_round
from .lookup import PromptLookup
from .prompt_cache import read_chunk, rungs
from .sampling import SamplingParams


# Plain steps a batch runs at most before the scheduler looks at its queue again (a joining request waits
# for them): as many as the auto policy's longest skip of the drafter (policies/width.py `Backoff`). A row that
# meets its stop token ends the run (on a target that can trim; a hybrid one's row leaves after the run).
PLAIN_RUN = 32


class Batch:
    """The rows decoding together, their batch caches, and one round at a time."""

    def __init__(self, target, drafter, policy, ranks: SingleProcess = SingleProcess(), stop_ids=frozenset()):
        self.target, self.drafter, self.policy, self.ranks = target, drafter, policy, ranks
        self.stop_ids = frozenset(stop_ids)  # a plain run ends at a step where a row picks one
        self.cache, self.draft_cache = self.empty_caches()
        self.rows: list[Row] = []
        self.width = 0  # the last round's verify width (1: plain steps)
        self.steps = 0  # target forwards the last round took (a run of plain steps takes several)

    def __len__(self) -> int:
        return len(self.rows)

    def empty_caches(self) -> tuple:
        return batched(self.target.make_cache()), [RaggedKVCache() for _ in self.drafter.make_cache()]

    def join(self, handle, state: DecodeState, anchor: int, sampling: SamplingParams, max_tokens: int,
             first_key: Optional[mx.array] = None, key: Optional[mx.array] = None):
        """A request joins as the last row: `state` holds its prompt but the last token, `anchor`, which the
        next round reads and from whose logits it picks the first token (drawn with `first_key`, when given).
        key: the row's own random stream, for every later draw (decoder.py `seeded_keys`). Its caches move
        into the batch's."""
        self.policy.prepare_context(len(state.tokens) + 1)  # probes a long prompt may need, once, before it decodes
        if self.policy.max_width > 1:  # on the row's own cache, not padded to the batch's longest
            state.hand_context_to(self.drafter)
        add_row(self.cache, state.cache)
        add_row(self.draft_cache, state.draft_cache)
        state.cache = state.draft_cache = None
        self.rows.append(Row(state, anchor, sampling, max_tokens, PromptLookup(state.tokens + [anchor]), handle,
                             key, first=True, first_key=first_key))

    def leave(self, handles: set) -> list:
        """Take these rows out; returns (handle, DecodeState) of each, its caches its own again, for the
        prefix cache to keep."""
        gone = [(b, r) for b, r in enumerate(self.rows) if r.handle in handles]
        for b, r in gone:
            r.state.cache, r.state.draft_cache = row_of(self.cache, b), row_of(self.draft_cache, b)
        stay = [b for b, r in enumerate(self.rows) if r.handle not in handles]
        self.rows = [self.rows[b] for b in stay]
        if self.rows:
            keep_rows(self.cache, stay)
            keep_rows(self.draft_cache, stay)
        else:  # an idle batch holds nothing
            self.cache, self.draft_cache = self.empty_caches()
        return [(r.handle, r.state) for _, r in gone]

    def round(self) -> Iterator[tuple]:
        """One round for every row, or a run of plain steps where the policy skips the drafter: yields (handle,
        Round), each row's in order, a plain step's as soon as it is read. A row with nothing left to emit must
        have left. Read it through: a run of plain steps left midway leaves the rows' caches one token ahead of
        their tokens, which only rows leaving at once may be (a prefix cache trims that token)."""
        fewest = min(1 if r.first else r.remaining for r in self.rows)  # a joining row's round picks one token
        self.policy.at_context(max(len(r.state.tokens) for r in self.rows))  # rows are padded to the longest
        # the policy counts only the steps run; ranks in lockstep take every round together (distributed.py)
        plain = 0 if self.ranks.lockstep else self.policy.plain_steps(min(fewest, PLAIN_RUN))
        if not plain:
            rounds, self.width = speculative_round(self.target, self.drafter, self.cache, self.draft_cache,
                                                   self.rows, self.policy, self.ranks)
            self.steps = 1
            yield from ((r.handle, rnd) for r, rnd in zip(self.rows, rounds))
            return
        tic, self.width, self.steps = time.perf_counter(), 1, 0
        for rounds in plain_rounds(self.target, self.cache, self.rows, plain, self.policy.max_width > 1,
                                   self.stop_ids):
            self.steps += 1
            yield from ((r.handle, rnd) for r, rnd in zip(self.rows, rounds))
        self.policy.observe_plain(self.steps, time.perf_counter() - tic, len(self.rows))


@dataclass(eq=False)  # each request is itself, whatever it asks (a handle, a key of the server's tables)
class Request:
    """A request for the scheduler: its prompt's token ids and how to answer."""

    handle: object
    ids: list
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: Optional[int] = None
    boundaries: tuple = ()  # chat message ends, for a hybrid target's prefix-cache checkpoints
    cache_scope: str = ""  # the part of the prefix cache it uses (a server's per API key)
    progress: Optional[Callable[[int, int], None]] = None  # called (prompt tokens read, all) after each chunk


@dataclass
class Prefill:
    """A request being read into its own single-row state, a chunk at each of its turns."""

    request: Request
    state: DecodeState
    checkpoints: dict
    marks: list  # prompt positions to checkpoint at (a hybrid target with a prefix cache), in order
    cached: int  # prompt tokens the prefix cache gave it
    started: Optional[float] = None  # perf_counter() at its first turn
    seconds: float = 0.0  # spent reading it, its turns only


class Scheduler:
    """Continuous batching: requests wait, are read a chunk at a time (so a long prompt never stalls the
    rows decoding), join the batch once all but their last token is read (the round that step reads that
    token and picks their first), and leave it at once when done.

    Several prompts are read at once, as many as the batch has rows free for and one more, in turn: a step
    reads one chunk of the next in line, which then goes to the back; a prompt just admitted goes ahead of
    those that have had a turn. A prompt read while every row is taken waits, read, for the first row to
    leave (so at one row, a short request arriving during a long read decodes while that read goes on). A
    short prompt arriving during a long one's read waits for the chunk being read, not for the whole read.
    While rows decode, reading and rounds share the engine by time: after a chunk the rows get rounds for as
    long as it took before the next chunk of a prompt already being read (a chunk of a long prompt can take
    many rounds' time), so a request decoding during a long read keeps at least half the engine and is
    answered long before that read ends, and the read itself takes at most about twice as long.

    step() returns events (handle, kind, value): ("admitted", (cached prompt tokens, perf_counter() when
    its prefill started)) at a request's first turn to be read, ("round", Round) for each of its rounds (the
    first: its first token alone, drafted 0), ("done", None) when it has left the batch. A request ends at a
    stop token, at max_tokens, or by cancel()."""

    def __init__(self, target, drafter, policy, max_batch: int, stop_ids=(), prompt_cache=None,
                 prefill_step: Optional[int] = None, ranks: SingleProcess = SingleProcess()):
        self.target, self.drafter, self.ranks = target, drafter, ranks
        self.batch = Batch(target, drafter, policy, ranks, stop_ids)
        self.max_batch, self.stop_ids, self.prompt_cache = max_batch, set(stop_ids), prompt_cache
        self.prefill_step = prefill_step or machine_prefill_step(serving=True)
        self.read_debt = 0.0  # seconds of reading the decoding rows are owed rounds for
        self.waiting: deque = deque()
        self.reading: deque = deque()  # Prefills, the next to read first
        self.ready: deque = deque()  # Prefills read, waiting for a row
        self.checkpoints: dict = {}  # handle -> (cache scope, its prefill's checkpoints), for its state when it leaves
        self.handles: set = set()  # the requests submitted and not done
        self.ending: set = set()
        self.stats = BatchStats()

    def submit(self, request: Request):
        self.handles.add(request.handle)
        self.waiting.append(request)

    def cancel(self, handle):
        """End a request: a waiting one is dropped, one being read stops, a row leaves at the next step (one
        that is done already: nothing)."""
        if handle in self.handles:
            self.ending.add(handle)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.reading or self.ready or self.batch.rows)

    def step(self) -> list:
        """One step's events (`events`, read through)."""
        return list(self.events())

    def events(self) -> Iterator[tuple]:
        """One step: rows done leave, prompts read join, one chunk of a prompt is read, one round runs for the
        rows; yields its events as they happen (a run of plain steps' rounds one step at a time)."""
        yield from self._retire()
        self._join_ready()
        # each prompt being read holds its own cache and, once read, a row: as many as there are rows free,
        # and one more, which joins when a row leaves
        while self.waiting and len(self.batch) + len(self.reading) + len(self.ready) <= self.max_batch:
            fresh = sum(p.started is None for p in self.reading)  # those not read yet are at the front
            self.reading.insert(fresh, self._start(self.waiting.popleft()))
        if not self.batch.rows or not self.reading:
            self.read_debt = 0.0  # owed to rows while a read goes on; no debt outlives its rows or its reads
        # a prompt not read yet goes first whatever the debt: it waits for the chunk being read, no more (a
        # choice made by the clock: under a sharded target, rank 0's)
        if self.reading and self.ranks.decide(self.read_debt <= 0 or self.reading[0].started is None):
            decoding, tic = bool(self.batch.rows), time.perf_counter()
            yield from self._read_turn()
            self._join_ready()
            if decoding:  # the rows waited for this chunk: they get as much time before the next
                self.read_debt += time.perf_counter() - tic
        if self.batch.rows:
            rows, tic = len(self.batch), time.perf_counter()
            for handle, rnd in self.batch.round():
                yield handle, "round", rnd
                if any(t in self.stop_ids for t in rnd.tokens):
                    self.ending.add(handle)
            self.read_debt = max(0.0, self.read_debt - (time.perf_counter() - tic))
            self.stats.count(rows, self.batch.width, self.batch.steps)
        yield from self._retire()

    def alone(self, request: Request, admitted: Optional[Callable[[int, float], None]] = None) -> Iterator[Round]:
        """One request, as the one-row case of this (idle) scheduler: yield its rounds as they come, the first
        its first token alone (nothing drafted). admitted(prompt tokens a prefix cache held, perf_counter() when
        its read began) is called once, as its read starts. It ends at max_tokens or a stop token, or when the
        caller stops reading: the row then leaves at once (its state to the prefix cache)."""
        self.submit(request)
        try:
            while self.busy:
                events = self.events()
                for _, kind, value in events:
                    if kind == "round":
                        yield value
                    elif kind == "admitted" and admitted is not None:
                        admitted(*value)
        except GeneratorExit:
            events.close()
            self.cancel(request.handle)
            self.step()
            raise

    def _retire(self) -> list:
        """Rows that are done leave the batch (their states to the prefix cache); cancelled waiters and
        prompts being read go."""
        done = {r.handle for r in self.batch.rows if r.remaining <= 0 or r.handle in self.ending}
        events = []
        for handle, state in self.batch.leave(done) if done else []:
            scope, checkpoints = self.checkpoints.pop(handle, ("", {}))
            if self.prompt_cache is not None:
                self.prompt_cache.insert(state, checkpoints, scope)
            events.append((handle, "done", None))
        for request in [r for r in self.waiting if r.handle in self.ending]:
            self.waiting.remove(request)
            events.append((request.handle, "done", None))
        for prefills in (self.reading, self.ready):
            for p in [p for p in prefills if p.request.handle in self.ending]:
                prefills.remove(p)
                events.append((p.request.handle, "done", None))
        gone = {e[0] for e in events}
        self.ending -= gone
        self.handles -= gone
        return events

    def _start(self, request: Request) -> Prefill:
        state, checkpoints = None, {}
        if self.prompt_cache is not None:
            state, checkpoints = self.prompt_cache.fetch(request.ids, request.cache_scope)
        state = state or DecodeState.fresh(self.target, self.drafter)
        marks = []
        if self.prompt_cache is not None and not self.target.trimmable:
            marks = [m for m in rungs(len(request.ids), request.boundaries) if m > len(state.tokens)]
        return Prefill(request, state, checkpoints, marks, len(state.tokens))

    def _read_turn(self) -> list:
        """One chunk of the next prompt in line, which goes to the back; once all but its last token is
        read, it is ready to join the batch. Its first turn admits it."""
        p = self.reading.popleft()
        events = []
        if p.started is None:
            # the time goes with it: this step reads its first chunk (maybe its first token) before returning
            p.started = time.perf_counter()
            events.append((p.request.handle, "admitted", (p.cached, p.started)))
        ids, state, tic = p.request.ids, p.state, time.perf_counter()
        end = read_chunk(self.target, state, ids, len(ids) - 1, p.marks, p.checkpoints, self.prefill_step,
                         self.ranks)
        p.seconds += time.perf_counter() - tic
        if p.request.progress is not None:
            p.request.progress(end, len(ids))
        if end < len(ids) - 1:
            self.reading.append(p)
            return events
        self.ready.append(p)
        if self.prompt_cache is not None:  # the read rate, which tells what a prefix cache's hit saves
            self.prompt_cache.observe_prefill(end - p.cached, p.seconds)
        return events

    def _join_ready(self):
        """Prompts read join the batch, in the order their reads ended, while it has rows free."""
        while self.ready and len(self.batch) < self.max_batch:
            p = self.ready.popleft()
            request = p.request
            self.checkpoints[request.handle] = (request.cache_scope, p.checkpoints)
            self.batch.join(request.handle, p.state, request.ids[-1], request.sampling, request.max_tokens,
                            *seeded_keys(request.seed))


def speculative_rounds(target, drafter, prompt, policy, sampling: SamplingParams, max_tokens: int,
                       prefill_step: Optional[int] = None) -> Iterator[Round]:
    """One request's rounds (`Scheduler.alone`, at its plainest): prompt token ids (a list or an array)."""
    ids = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    scheduler = Scheduler(target, drafter, policy, 1, prefill_step=prefill_step or machine_prefill_step())
    return scheduler.alone(Request(0, ids, max_tokens, sampling))


def batch_generate(target, drafter, tokenizer, prompts: list, max_tokens=128, verbose: bool = False, *,
                   max_batch: Optional[int] = None, **options):
    """Answer several prompts decoding together, as `mlx_lm.batch_generate` does: prompts are token-id lists
    (or strings, used as given); max_tokens one for all or one per prompt; max_batch: rows decoded together (default:
    every prompt). options: as `stream_generate` takes them (decoding/generation_options.py `GenerationOptions`;
    a seed seeds each prompt's sample as it would alone). Returns a `BatchResponse`: the texts, each prompt's token
    ids and statistics, and the batch's (rows per round, widths chosen). drafter: a DFlash drafter, or None for
    drafts copied from the context alone (models/no_drafter.py)."""
    from .generation_options import GenerationOptions
    from .prompt import check_context, encode_prompt
    from .responses import admitted_stream

    options = GenerationOptions.of(options)
    ids = [encode_prompt(tokenizer, p) if isinstance(p, str) else list(p) for p in prompts]
    limits = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(ids)
    if len(limits) != len(ids) or any(n < 1 for n in limits) or any(not i for i in ids):
        raise DFlashError("batch_generate needs non-empty prompts and, per prompt, max_tokens >= 1")
    limits = [check_context(target, len(i), n) for i, n in zip(ids, limits)]
    max_batch = max_batch or len(ids)
    drafter, policy = options.drafter_and_policy(target, drafter, max_batch)
    prompt_cache = options.prompt_cache
    scheduler = Scheduler(target, drafter, policy, max_batch, tokenizer.eos_token_ids, prompt_cache,
                          options.prefill_step_size)
    streams, texts, tokens = {}, [[] for _ in ids], [[] for _ in ids]
    for i, (prompt, limit) in enumerate(zip(ids, limits)):
        scheduler.submit(Request(i, prompt, limit, options.sampling, options.seed))
    while scheduler.busy:
        for i, kind, value in scheduler.step():
            if kind == "admitted":
                streams[i] = admitted_stream(tokenizer, policy, len(ids[i]), limits[i], value, prompt_cache)
            elif kind == "round" and not streams[i].finished:
                for response in streams[i].feed(value):
                    texts[i].append(response.text)
                    tokens[i].append(response.token)
                    if verbose:
                        print(f"[{i}] {response.text}", end="", flush=True)
                if streams[i].finished:
                    scheduler.cancel(i)  # the stream ended it (a stop token); the row leaves now
    for i, s in streams.items():
        if s.stats.finish_reason == "stop":
            tokens[i].pop()  # the stop token is counted, not returned
    return BatchResponse(["".join(t) for t in texts], tokens, [streams[i].stats for i in range(len(ids))],
                         scheduler.stats)


@dataclass
class BatchStats:
    """What the batch did: rows per round and the widths it verified (a plain step: a round of width 1)."""

    rounds: int = 0
    rows: Counter = field(default_factory=Counter)  # rows verified together: rounds
    widths: Counter = field(default_factory=Counter)  # verify width: rounds

    def count(self, rows: int, width: int, times: int = 1):
        self.rounds += times
        self.rows[rows] += times
        self.widths[width] += times


@dataclass
class BatchResponse:
    texts: list
    token_ids: list
    stats: list  # each prompt's GenerationStats
    batch: BatchStats
