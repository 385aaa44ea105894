"""Verify costs with a context axis: growth between and past measured lengths, lazy probes, and the width
policies (one request and D-cut) choosing by the round's own context."""

import mlx.core as mx
import pytest

from conftest import chat_ids, mlx_lm_greedy
from oracles import cut_one
from mlx_dflash.decoding.batch_decoder import batch_generate
from mlx_dflash.policies.dcut import DCutPolicy
from mlx_dflash.decoding.batch_decoder import speculative_rounds
from mlx_dflash.errors import DFlashError
from mlx_dflash.policies.width import make_policy
from mlx_dflash.decoding.sampling import SamplingParams
from mlx_dflash.policies.verify_costs import ContextCosts, interpolate_costs, table_context_costs
from mlx_dflash.policies.width import RoundSeen

# One row's verify seconds as a CPU shows them: at a long context a wide verify gets much dearer than a narrow one.
MEASURED = {256: {1: 0.05, 16: 0.10}, 4096: {1: 0.10, 16: 0.40}}


def test_growth_is_linear_between_lengths_continues_past_them_and_is_one_below():
    costs = ContextCosts(MEASURED, 16)
    assert costs.growth(100) == costs.growth(256) == {w: 1.0 for w in range(1, 17)}
    mid = 256 + (4096 - 256) // 2
    assert costs.growth(mid)[1] == pytest.approx(1.5) and costs.growth(mid)[16] == pytest.approx(2.5)
    assert costs.growth(4096)[16] == pytest.approx(4.0)
    past = 4096 + (4096 - 256)  # the last slope goes on: the cache read grows linearly
    assert costs.growth(past)[1] == pytest.approx(3.0) and costs.growth(past)[16] == pytest.approx(7.0)
    short8, long8 = 0.05 + 0.05 * 7 / 15, 0.1 + 0.3 * 7 / 15  # widths between the measured ones interpolate
    assert costs.growth(mid)[8] == pytest.approx((short8 + long8) / 2 / short8)
    cheaper = ContextCosts({256: {1: 0.05}, 1024: {1: 0.04}}, 4)
    assert cheaper.growth(1024) == {w: 1.0 for w in range(1, 5)}  # noise never makes a long context cheaper


def probe_log():
    calls = []

    def prober(context):
        calls.append(context)
        return {1: 0.05 * (1 + context / 1024), 16: 0.1 * (1 + context / 256)}

    return calls, prober


def test_lengths_are_probed_once_a_context_reaches_half_of_them_and_never_past_the_model():
    calls, prober = probe_log()
    costs = ContextCosts({256: {1: 0.05, 16: 0.1}}, 16, prober, limit=8192)
    assert costs.cover(300) == [] and costs.growth(500)[16] == 1.0 and calls == []  # short contexts cost nothing
    assert costs.cover(512) == [1024] and costs.growth(600)[16] > 1.0
    assert costs.cover(2047) == [] and costs.cover(2048) == [4096]
    costs.growth(9000)  # growth measures nothing: past the lengths measured it continues their slope
    costs.cover(8000)  # 16384 is past the model's context: never probed
    assert calls == [1024, 4096]
    assert set(costs.by_context) == {256, 1024, 4096}


def test_a_long_prompt_probes_only_the_longest_length_it_reaches_half_of():
    """A verify's cost is linear in the cache it reads: 256 and 4096 draw the line through 1024, which a
    3,000-token prompt would only delay."""
    calls, prober = probe_log()
    costs = ContextCosts({256: {1: 0.05, 16: 0.1}}, 16, prober, limit=8192)
    assert costs.cover(3000) == [4096] and calls == [4096]
    assert costs.growth(1024)[16] == pytest.approx(1 + (1024 - 256) / (4096 - 256) * (17 - 1))  # 1.7 s / 0.1 s at 4096
    assert costs.cover(700) == [1024]  # a shorter prompt later still gets its own length


def test_without_a_short_measurement_the_probe_measures_the_shortest_length_too():
    calls, prober = probe_log()
    costs = ContextCosts({}, 16, prober)
    assert costs.growth(200) == {w: 1.0 for w in range(1, 17)} and calls == []
    assert costs.cover(700) == [256, 1024]


def test_a_cache_the_probe_cannot_fill_leaves_the_costs_flat_and_stops_probing():
    calls = []

    def refusing(context):
        calls.append(context)
        raise DFlashError("cannot pre-fill a SomeCache cache")

    costs = ContextCosts({256: {1: 0.05, 16: 0.1}}, 16, refusing)
    assert costs.cover(5000) == [] and costs.growth(5000) == {w: 1.0 for w in range(1, 17)}
    costs.cover(9000)
    assert calls == [4096]


def test_a_server_measures_every_length_one_at_a_time_then_prompts_find_them_measured():
    calls, prober = probe_log()
    costs = ContextCosts({256: {1: 0.05, 16: 0.1}}, 16, prober, limit=8192)
    assert [costs.probe_next() for _ in range(4)] == [1024, 4096, None, None] and calls == [1024, 4096]
    assert costs.cover(5000) == [] and calls == [1024, 4096]  # a long prompt waits for no probe
    refused = ContextCosts({}, 16, lambda context: (_ for _ in ()).throw(DFlashError("cannot pre-fill")), limit=8192)
    assert refused.probe_next() is None and refused.lengths == []


def test_a_table_with_several_lengths_is_used_as_it_is_and_one_length_leaves_it_to_the_probe():
    calls, prober = probe_log()
    table = {"widths": [1, 16], "verify_seconds": [0.05, 0.1],
             "by_cache_length": {"256": [0.05, 0.1], "4096": [0.1, 0.4]}}
    costs = table_context_costs(table, 16, prober)
    assert costs.growth(4096)[16] == pytest.approx(4.0) and calls == []
    single = dict(table, by_cache_length={"128": [0.05, 0.1]})
    table_context_costs(single, 16, prober).cover(3000)
    assert calls == [256, 4096]


def test_without_context_costs_the_policy_is_unchanged_by_the_context():
    policy = DCutPolicy(16, 16, {1: interpolate_costs(MEASURED[256], 16)})
    policy.draft_seconds = 0.01
    before = cut_one(policy, 16, [0.8] * 15)
    policy.at_context(100_000)
    assert cut_one(policy, 16, [0.8] * 15) == before
    make_policy(16, 4).at_context(100_000)  # fixed widths ignore it


def test_dcut_costs_a_round_at_its_longest_rows_context_and_learns_its_cells_at_the_short_one():
    cells = {1: {w: 0.05 + 0.003 * w for w in range(1, 17)}, 4: {w: 0.08 + 0.005 * w for w in range(1, 17)}}
    policy = DCutPolicy(16, 16, cells, context_costs=ContextCosts(MEASURED, 16))
    policy.draft_seconds = 0.01
    confidence, copied, remaining = [[0.8] * 15] * 4, [0] * 4, [64] * 4
    policy.at_context(200)
    short = max(range(1, 17), key=lambda w: policy.rate(confidence, copied, remaining, w))
    policy.at_context(8000)
    assert policy.cost(4, 16) == pytest.approx(cells[4][16] * policy.growth[16])
    long = max(range(1, 17), key=lambda w: policy.rate(confidence, copied, remaining, w))
    assert long < short
    policy.at_context(4096)
    policy.observe(RoundSeen(confidence, [15] * 4, [0] * 4, 16, 0.01, 0.8, copied))
    assert policy.costs[4][16] == pytest.approx(0.8 / 4.0)


def recording(policy_class):
    """The policy class, keeping the contexts its rounds were costed at."""

    class Recording(policy_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.contexts = []

        def at_context(self, context):
            self.contexts.append(context)
            super().at_context(context)

    return Recording


Recording = recording(DCutPolicy)


def test_the_decoder_gives_each_round_its_context_and_stays_lossless_at_a_long_one(tiny_chat_pair):
    """Every round is costed at the tokens its verify attends to; a long context's costs change the widths, not
    the output (the tiny target's costs as measured at 40 and 400 tokens)."""
    target, tokenizer, drafter = tiny_chat_pair
    ids = chat_ids(tokenizer, "Tell me a story about a cat. " * 12)
    measured = {40: {1: 0.05, 8: 0.08}, 400: {1: 0.06, 8: 0.3}}
    policy = Recording(drafter.block_size, drafter.block_size, {1: interpolate_costs(measured[40], drafter.block_size)},
                       context_costs=ContextCosts(measured, drafter.block_size))
    rounds = list(speculative_rounds(target, drafter, mx.array(ids), policy, SamplingParams(), 40))
    tokens = [t for r in rounds for t in r.tokens][:40]
    assert tokens == mlx_lm_greedy(target.model, ids, 40)
    emitted = [0]
    for r in rounds:
        emitted.append(emitted[-1] + len(r.tokens))
    # the prompt and the emitted tokens before the round's anchor: each verify round's (the first token's too: it
    # reads the prompt's last token), each plain run's first
    drafting = [len(ids) + e - 1 for r, e in zip(rounds, emitted) if not r.plain]
    plain = {len(ids) + e - 1 for r, e in zip(rounds, emitted) if r.plain}
    assert drafting and [c for c in policy.contexts if c not in plain] == drafting
    assert set(policy.contexts) <= plain | set(drafting)


def test_a_generation_measures_its_prompts_costs_before_reading_it_and_never_between_rounds(tiny_chat_pair):
    from mlx_dflash.generate import generate

    target, tokenizer, drafter = tiny_chat_pair
    ids = chat_ids(tokenizer, "Tell me a story about a cat. " * 70)
    assert 512 <= len(ids) < 1024
    calls, prober = probe_log()
    costs = ContextCosts({256: {1: 0.05, 8: 0.08}}, drafter.block_size, prober)
    policy = Recording(drafter.block_size, drafter.block_size, {1: interpolate_costs({1: 0.05, 8: 0.08}, 8)},
                       context_costs=costs)
    out = generate(target, drafter, tokenizer, ids, 24, policy=policy)
    assert out.tokens == mlx_lm_greedy(target.model, ids, 24)
    assert calls == [1024] and any("1024 tokens of context" in n for n in out.stats.notes)
    assert policy.contexts and policy.growth[8] > 1.0  # its rounds were costed at their long context


def test_batched_rounds_are_costed_at_their_longest_row(tiny_chat_pair):
    target, tokenizer, drafter = tiny_chat_pair
    ids = [chat_ids(tokenizer, "Hi."), chat_ids(tokenizer, "Tell me a long story about a dog. " * 6)]
    cells = {1: {w: 0.05 + 0.003 * w for w in range(1, 9)}, 2: {w: 0.06 + 0.004 * w for w in range(1, 9)}}
    policy = Recording(drafter.block_size, drafter.block_size, cells)
    out = batch_generate(target, drafter, tokenizer, ids, max_tokens=[6, 6], max_batch=2, policy=policy)
    assert out.token_ids == [mlx_lm_greedy(target.model, i, 6) for i in ids]
    together = out.batch.rows[2]  # rounds of both rows: costed at the long row's context
    assert together > 0 and sum(c >= len(ids[1]) - 1 for c in policy.contexts) >= together
