"""Speculation without a drafter (models/no_drafter.py): drafts copied from the context, every one verified by the
target, so the output is the target's own (greedy) or distributed as its own (sampling), on every family, alone
and batched, through the API, `generate` and `serve`."""

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from conftest import PROMPTS, chat_ids, mlx_lm_greedy
from serving import chat_text, client, free_port, running, wait_for_health
from test_sampling import MLX_LM_SETTINGS, SETTING_IDS, assert_first_two_like_mlx_lm, tiny_pair
from tiny_families import DENSE, FAMILIES, PROMPT, tiny_chat_target, tiny_model
from mlx_dflash.cli import main
from mlx_dflash.decoding import engine_report
from mlx_dflash.decoding.batch_decoder import batch_generate
from mlx_dflash.decoding.lookup import PromptLookup
from mlx_dflash.decoding.tree import copy_trees
from mlx_dflash.decoding.batch_decoder import speculative_rounds
from mlx_dflash.decoding.prompt_cache import PromptCache, pair_identity
from mlx_dflash.decoding.sampling import SamplingParams
from mlx_dflash.errors import DFlashError
from mlx_dflash.generate import generate
from mlx_dflash.models.no_drafter import LOOKUP_BLOCK, NoDrafter
from mlx_dflash.models.target import Target
from mlx_dflash.pair import load
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import DraftControls, WidthOptions, make_policy

N_TOKENS = 40
COPY = ("Repeat this sentence exactly, word for word: The quick brown fox jumps over the lazy dog while the "
        "farmer counts seven sheep by the old mill.")


def with_a_copy(model, ids: list) -> list:
    """`ids` grown at the front until the model's greedy first token is one of them: a random model over a large
    vocabulary repeats nothing of its context, so its first round would have nothing to copy."""
    ids = list(ids)
    while (first := mlx_lm_greedy(model, ids, 1)[0]) not in ids:
        ids.insert(0, first)
    return ids


def copies_run(family: str, width: int, tree: bool = False):
    """Greedy rounds of a tiny target of the family with no drafter, against mlx-lm's own tokens."""
    model = tiny_model(family)
    prompt = PROMPT * 2 + PROMPT[::-1]  # a context that repeats: lookup has copies from the first round, branching
    want = mlx_lm_greedy(model, prompt, N_TOKENS)
    policy = make_policy(LOOKUP_BLOCK, width, controls=DraftControls(tree=tree))
    rounds = list(speculative_rounds(Target(model), NoDrafter(), mx.array(prompt), policy, SamplingParams(),
                                     N_TOKENS))
    assert [t for r in rounds for t in r.tokens] == want, f"{family} at width {width}"
    if not tree:
        assert all(r.drafted == r.looked_up and r.drafted < width for r in rounds)  # every draft is a copy
    return rounds


@pytest.mark.parametrize("family", DENSE)
@pytest.mark.parametrize("width", [2, 5, 16])
def test_copies_alone_give_mlx_lms_greedy_tokens(family, width):
    rounds = copies_run(family, width)
    assert sum(r.drafted for r in rounds) > 0


@pytest.mark.parametrize("family", DENSE)
@pytest.mark.parametrize("width", [4, 16])
def test_a_tree_of_copies_gives_mlx_lms_greedy_tokens(family, width):
    rounds = copies_run(family, width, tree=True)
    assert any(r.tree for r in rounds)


def test_copies_follow_the_latest_occurrences_first():
    lookup = PromptLookup([1, 2, 3, 9, 1, 2, 5, 6, 7, 1, 2])
    assert lookup.propose(3) == [5, 6, 7] and lookup.copies(3) == [[5, 6, 7], [3, 9, 1]]
    assert lookup.copies(3, scan=1) == [[5, 6, 7]] and PromptLookup([4, 5]).copies(3) == []


def test_a_copy_tree_is_a_trie_of_the_copies_ranked_by_prior_and_share():
    trees = copy_trees([[[2, 1], [4, 5], [2, 7]], []], 5, [2, 2])
    # the latest copy 2 1 by lookup's prior (0.5, then 0.7 more); 7 under 2 at 0.5 x 0.7 x a half of the copies
    # through 2; 4 at 0.5 x a third; 5 under it (0.5 x 1/3 x 0.7) falls out of 4 nodes
    assert trees.tokens[0].tolist() == [2, 1, 7, 4] and trees.parents[0].tolist() == [-1, 0, 0, -1]
    assert trees.depth[0].tolist() == [1, 2, 2, 1] and trees.copied[0].tolist() == [True, True, False, False]
    assert np.allclose(trees.probs[0], [0.5, 0.7, 1 / 2, 1 / 3]) and trees.alive[0].all()
    assert not trees.alive[1].any()  # nothing to copy
    shallow = copy_trees([[[2, 1, 8]]], 3, [1])  # no deeper than the row's depth
    assert shallow.tokens[0, 0] == 2 and shallow.alive[0].tolist() == [True, False]


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in DENSE])  # MoE, MLA, windows, sinks, hybrids
@pytest.mark.parametrize("width", [3, 16])
def test_copies_alone_give_mlx_lms_greedy_tokens_on_every_family(family, width):
    rounds = copies_run(family, width)
    assert sum(r.drafted for r in rounds) > 0


def test_the_real_target_without_a_drafter_gives_its_own_greedy_text(smollm2):
    target, tokenizer = smollm2
    kept = trees = 0
    for prompt in [COPY] + PROMPTS[:2]:
        ids = chat_ids(tokenizer, prompt)
        want = mlx_lm_greedy(target.model, ids, 48)
        want = want[: next((i for i, t in enumerate(want) if t in tokenizer.eos_token_ids), len(want))]
        for width, tree in ((16, False), ("auto", False), (16, True), ("auto", True)):
            got = generate(target, None, tokenizer, ids, max_tokens=48, width=width, tree=tree)
            assert got.tokens == want, (prompt, width, tree)
            kept += sum((n - 1) * c for n, c in got.stats.accepted_lengths.items())
            trees += got.stats.tree_rounds
    assert kept > 10 and trees > 0  # copies of the sentence were kept; trees of copies verified


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])  # a hybrid target rolls its recurrent state back
def test_batched_rows_without_a_drafter_give_each_requests_own_tokens(tiny_chat_pair, family):
    _, tokenizer, _ = tiny_chat_pair
    target = tiny_chat_target(family, 49152, seed=3)
    ids = [with_a_copy(target.model, chat_ids(tokenizer, p)) for p in PROMPTS[:5]]
    limits = [24, 9, 17, 5, 13]
    want = [mlx_lm_greedy(target.model, p, n) for p, n in zip(ids, limits)]
    for width in (8, "auto"):
        got = batch_generate(target, None, tokenizer, ids, max_tokens=limits, max_batch=3, width=width)
        cut = [w[: len(g)] for w, g in zip(want, got.token_ids)]  # a row may stop at an end token
        assert got.token_ids == cut and max(got.batch.rows) == 3, width
        assert width == "auto" or sum(s.looked_up_rounds for s in got.stats) >= len(ids)  # copies verified


def test_batched_copies_on_the_real_target_give_each_requests_own_tokens(smollm2):
    target, tokenizer = smollm2
    ids = [chat_ids(tokenizer, p) for p in [COPY, PROMPTS[0], COPY.replace("fox", "cat"), PROMPTS[1]]]
    limits = [40, 12, 33, 20]
    want = [generate(target, None, tokenizer, p, max_tokens=n, width=1).tokens for p, n in zip(ids, limits)]
    got = batch_generate(target, None, tokenizer, ids, max_tokens=limits, max_batch=3, width="auto")
    assert got.token_ids == want and max(got.batch.rows) == 3
    assert max(got.batch.widths) > 4 and sum(s.looked_up_rounds for s in got.stats) > 4
    trees = batch_generate(target, None, tokenizer, ids, max_tokens=limits, max_batch=3, width=8, tree=True)
    assert trees.token_ids == want and sum(s.tree_rounds for s in trees.stats) > 4


def test_copies_on_a_quantized_kv_cache_give_the_targets_own_tokens(tiny_chat_pair):
    """--kv-bits 8 without a drafter: the same tokens at every width as the target's own steps on that cache."""
    _, tokenizer, _ = tiny_chat_pair
    target = tiny_chat_target("llama", 49152, seed=5, num_hidden_layers=4, hidden_size=128, tie_word_embeddings=True)
    target.quantize_kv(8, group_size=32, start=16)  # every chat prompt passes it as it is read
    ids = [with_a_copy(target.model, chat_ids(tokenizer, p)) for p in PROMPTS[:3]]
    want = [generate(target, None, tokenizer, p, max_tokens=16, width=1).tokens for p in ids]
    for width in (8, "auto"):
        got = [generate(target, None, tokenizer, p, max_tokens=16, width=width) for p in ids]
        assert [g.tokens for g in got] == want
        assert width == "auto" or all(g.stats.looked_up_rounds for g in got)  # copies verified on the quantized cache
    assert batch_generate(target, None, tokenizer, ids, max_tokens=16, max_batch=3, width=8).token_ids == want


def test_a_prefix_cache_keeps_states_without_a_drafter(tiny_chat_pair):
    target, tokenizer, _ = tiny_chat_pair
    drafter = NoDrafter()
    cache = PromptCache(pair_identity(target, drafter), target.trimmable)
    ids = chat_ids(tokenizer, PROMPTS[0])
    first = generate(target, drafter, tokenizer, ids, max_tokens=12, width=8, prompt_cache=cache)
    second = generate(target, drafter, tokenizer, ids + [5, 6], max_tokens=12, width=8, prompt_cache=cache)
    assert second.stats.cached_tokens >= len(ids) and first.tokens == mlx_lm_greedy(target.model, ids, 12)[:len(first.tokens)]
    assert second.tokens == mlx_lm_greedy(target.model, ids + [5, 6], 12)[: len(second.tokens)]


def test_the_policy_says_which_speculation_runs_and_refuses_no_lookup(tiny_chat_pair):
    target, _, drafter = tiny_chat_pair
    assert build_policy(target, NoDrafter(), WidthOptions(8)).notes[0].startswith("speculation: no drafter")
    assert not any(n.startswith("speculation") for n in build_policy(target, drafter, WidthOptions(8)).notes)
    with pytest.raises(DFlashError, match="--no-prompt-lookup leaves a target without a drafter nothing"):
        build_policy(target, NoDrafter(), WidthOptions(8, prompt_lookup=False))


def test_load_falls_back_to_no_drafter_where_the_shipped_one_does_not_fit(tiny_pair_dirs):
    target_dir, drafter_dir = tiny_pair_dirs
    _, drafter, _ = load(str(target_dir))
    assert isinstance(drafter, NoDrafter)
    assert isinstance(load(str(target_dir), "none")[1], NoDrafter)
    assert not isinstance(load(str(target_dir), str(drafter_dir))[1], NoDrafter)


def test_generate_without_a_drafter_says_so_in_one_line_and_gives_mlx_lms_text(tiny_pair_dirs, monkeypatch):
    from mlx_lm import load as mlx_lm_load

    target_dir, _ = tiny_pair_dirs
    model, tokenizer = mlx_lm_load(str(target_dir))
    ids = chat_ids(tokenizer, "Tell me about the sea. Tell me about the sea.")
    want = tokenizer.decode(mlx_lm_greedy(model, ids, 16))
    for extra in ([], ["--drafter", "none"]):
        monkeypatch.setattr(engine_report, "_announced", set())  # as a new process: nothing said yet
        r = CliRunner().invoke(main, ["generate", "--model", str(target_dir), *extra, "--max-tokens", "16",
                                      "--width", "8", "--prompt", "Tell me about the sea. Tell me about the sea."])
        assert r.exit_code == 0, r.output
        assert r.stdout.strip() == want.strip()
        assert sum(line.startswith("speculation: no drafter") for line in r.stderr.splitlines()) == 1
    refused = CliRunner().invoke(main, ["generate", "--model", str(target_dir), "--drafter", "none",
                                        "--no-prompt-lookup", "--prompt", "hi"])
    assert refused.exit_code == 1 and len(refused.output.strip().splitlines()) == 1


@pytest.mark.slow  # a real serve in a fresh process (seconds)
def test_serve_starts_on_a_model_without_a_drafter(tiny_pair_dirs):
    """`mlx-dflash serve --model DIR` with no --drafter: one line says what runs, and a chat answers as generate."""
    target_dir, _ = tiny_pair_dirs
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlx_dflash.cli", "serve", "--model", str(target_dir),
                               "--port", str(port), "--max-tokens", "12"], stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(server, url)
        got, _ = chat_text(client(url), model="target", messages=[{"role": "user", "content": "Tell me about the sea."}],
                           max_tokens=12)
    finally:
        server.terminate()
        server.wait(timeout=30)
    log = server.stderr.read()
    assert sum(line.startswith("speculation: no drafter") for line in log.splitlines()) == 1, log
    target, drafter, tokenizer = load(str(target_dir))
    want = generate(target, drafter, tokenizer, chat_ids(tokenizer, "Tell me about the sea."), max_tokens=12)
    assert got == str(want)


def test_a_served_pair_without_a_drafter_answers_batched_clients(tiny_chat_pair):
    target, tokenizer, _ = tiny_chat_pair
    pair = (target, NoDrafter(), tokenizer)
    messages = [{"role": "user", "content": p} for p in PROMPTS[:3]]
    want = [str(generate(target, None, tokenizer, chat_ids(tokenizer, m["content"]), max_tokens=10, width=8))
            for m in messages]
    with running(pair, policy=build_policy(target, pair[1], WidthOptions(8), max_batch=3),
                 engine_options=dict(max_batch=3)) as (url, _):
        c = client(url)
        assert [chat_text(c, messages=[m], max_tokens=10)[0] for m in messages] == want


@pytest.mark.slow
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("setting", MLX_LM_SETTINGS, ids=SETTING_IDS)
def test_copies_sample_like_mlx_lm(setting, tree):
    """The second token, drawn through a round that verifies lookup's copy (every token of the vocabulary is in the
    prompt, twice, so each first token has earlier occurrences to copy after: one draft as a chain, two branches
    as a tree), against mlx-lm's own sampler on the same model: a two-sample chi-square test per position."""
    runs = 1000
    model, target, _ = tiny_pair()
    prompt = list(range(16)) + list(range(15, -1, -1)) + [3]
    params = SamplingParams(*setting[:3], min_p=setting[3])
    policy = make_policy(LOOKUP_BLOCK, 4 if tree else 2, controls=DraftControls(tree=tree))
    mx.random.seed(6)
    ours = []
    for _ in range(runs):
        rounds = speculative_rounds(target, NoDrafter(), mx.array(prompt), policy, params, max_tokens=3)
        first, second = next(rounds), next(rounds)
        assert second.tree == tree and (tree or second.drafted == second.looked_up == 1)
        ours.append((first.tokens[0], second.tokens[0]))
        rounds.close()
    assert_first_two_like_mlx_lm(model, prompt, setting, ours)
