"""The target adapter across mlx-lm families: capture, rollback and lossless greedy decoding.

Tiny random instances of mlx-lm's own model classes (float32): dense, MoE, MLA (DeepSeek-V3, Kimi K2.5,
GLM-5 DSA), sliding windows with KV sharing (Gemma 3 and 4, Muse Glimmer), attention sinks (gpt-oss), and the hybrid
GatedDeltaNet targets (Qwen3.5/3.6, Qwen3-Next) whose recurrent state is rewound after each round.
Weights are random; what is tested is the plumbing: layer list, caches, windows, heads, rollback.
Sliding-window layers use ring buffers in mlx-lm; the adapter swaps in plain caches, so sequences run
past the window to show the output is equal.
"""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache

from conftest import mlx_lm_greedy
from oracles import OracleDrafter, expected_acceptance
from tiny_families import DENSE, FAMILIES, HYBRIDS, PROMPT, bound_pair, tiny_model
from mlx_dflash.decoding.batch_decoder import speculative_rounds
from mlx_dflash.policies.width import make_policy
from mlx_dflash.decoding.sampling import SamplingParams

WIDTHS = [1, 2, 3, 5, 8, 16]


def emitted(target, drafter, prompt, block_size, max_tokens):
    policy = make_policy(drafter.block_size, block_size)
    rounds = list(speculative_rounds(target, drafter, mx.array(prompt), policy, SamplingParams(), max_tokens))
    return [t for r in rounds for t in r.tokens], rounds


def untrained_run(family, block_size):
    model = tiny_model(family)
    target, drafter = bound_pair(model, block_size=8)
    want = mlx_lm_greedy(model, PROMPT, 24)  # 12 + 24 positions: past the 8-token windows
    assert len(set(want)) > 3, "degenerate reference: make the random model livelier"
    assert emitted(target, drafter, PROMPT, block_size, 24)[0] == want


@pytest.mark.parametrize("family", DENSE)
@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_untrained_drafter_is_lossless_on_every_family(family, block_size):
    untrained_run(family, block_size)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in DENSE])
@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_untrained_drafter_is_lossless_on_every_new_family(family, block_size):
    untrained_run(family, block_size)


ERRORS = {2, 3, 9, 15, 16, 17, 26}  # generated indices where the oracle drafts a wrong token
N_TOKENS = 34


def oracle_run(family, width):
    model = tiny_model(family)
    target, real = bound_pair(model)
    want = mlx_lm_greedy(model, PROMPT, N_TOKENS)
    oracle = OracleDrafter(real.config, len(PROMPT), want, ERRORS).bind(target)
    got, rounds = emitted(target, oracle, PROMPT, width, N_TOKENS)
    assert got == want, f"{family} at width {width}"
    assert [r.accepted for r in rounds[1:]] == expected_acceptance(N_TOKENS, width, ERRORS)
    if width >= 8:
        assert {r.drafted for r in rounds[1:]} >= {width - 1}  # full-width rounds ran
        assert any(r.accepted == r.drafted > 0 for r in rounds) and any(r.accepted == 0 < r.drafted for r in rounds)


# Default tier: Qwen3.5 at every width, the other hybrids at two, the other new families at one (the dense ones
# are covered by test_lossless.py on a real model); `slow`: the whole grid.
FAST_GRID = ([("qwen3_5", w) for w in WIDTHS] + [(f, w) for f in HYBRIDS[1:] for w in (3, 16)]
             + [(f, 8) for f in FAMILIES if f not in HYBRIDS + DENSE])
SLOW_GRID = [(f, w) for f in FAMILIES for w in WIDTHS if (f, w) not in FAST_GRID]


@pytest.mark.parametrize("family,width", FAST_GRID)
def test_oracle_drafter_greedy_equals_mlx_lm_at_every_width(family, width):
    oracle_run(family, width)


@pytest.mark.slow
@pytest.mark.parametrize("family,width", SLOW_GRID)
def test_oracle_drafter_greedy_equals_mlx_lm_full_grid(family, width):
    oracle_run(family, width)


def cache_arrays(cache) -> list:
    """Every array a cache list holds for the context so far (KV rows up to the offset, recurrent states)."""
    out = []
    for c in cache:
        if hasattr(c, "caches"):  # CacheList (MLA with an indexer)
            out += cache_arrays(c.caches)
        elif isinstance(c, ArraysCache):
            out += list(c.cache)
        else:
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    mx.eval(out)
    return out


def assert_arrays_close(got, want, what):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"{what}: array {i} has shape {a.shape}, plain decoding {b.shape}"
        err, scale = mx.abs(a - b).max().item(), mx.abs(b).max().item()
        assert err <= 1e-4 * max(1.0, scale), f"{what}: array {i} (max {scale:.3g}) differs from plain decoding by {err:.2g}"


# (rows verified, rows kept): kept == rows is full acceptance, 1 keeps only the anchor (no draft kept).
SCHEDULE = [(2, 1), (3, 3), (5, 2), (16, 16), (8, 1), (16, 5), (1, 1), (3, 1)]


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in DENSE[:-1] else f for f in FAMILIES])
def test_each_round_leaves_the_state_of_plain_decoding(family):
    """Logits and features of every verified row, and every cache array after each round's rollback,
    equal those of plain one-token-at-a-time decoding (within float32 rounding)."""
    model = tiny_model(family)
    target, _ = bound_pair(model)
    mx.random.seed(7)
    tokens = mx.random.randint(0, target.vocab_size, (sum(w for w, _ in SCHEDULE),)).tolist()

    plain_cache, plain = target.make_cache(), []
    target.prefill(mx.array(PROMPT), plain_cache)
    for t in tokens[: sum(k for _, k in SCHEDULE)]:
        logits, features = target.forward(mx.array([[t]]), plain_cache)
        target.trim(plain_cache, 0)
        plain.append((logits[0, 0], features[0, 0], cache_arrays(plain_cache)))

    cache, pos, rewound = target.make_cache(), 0, False
    target.prefill(mx.array(PROMPT), cache)
    for width, keep in SCHEDULE:
        logits, features = target.forward(mx.array([tokens[pos : pos + width]]), cache)
        for i in range(keep):  # rows past `keep` saw tokens plain decoding never fed
            assert_arrays_close([logits[0, i], features[0, i]], plain[pos + i][:2], f"{family} row {pos + i}")
        if keep < width and family in HYBRIDS:  # the rollback really has to change the recurrent state
            before = [a for c in cache if isinstance(c, ArraysCache) for a in c.cache]
            rewound = rewound or mx.abs(before[1] - plain[pos + keep - 1][2][1]).max().item() > 1e-2
        target.trim(cache, width - keep)
        pos += keep
        assert_arrays_close(cache_arrays(cache), plain[pos - 1][2], f"{family} cache after {pos} tokens")
    assert family not in HYBRIDS or rewound
