"""The prefix cache: a conversation's next turn reads only what is new, and every answer equals the one a
cold start gives (greedy and seeded sampling), for dense and hybrid targets, a quantized KV cache and a
DFlash 2 drafter, whichever kind of boundary the cache is hit at."""

import mlx.core as mx
import pytest

from conftest import chat_ids
from tiny_families import tiny_chat_target
from mlx_dflash.decoding.batch_decoder import Request, Scheduler
from mlx_dflash.generate import generate
from mlx_dflash.models.loader import drafter_config_for, init_drafter
from mlx_dflash.models.target import Target
from mlx_dflash.policies.width import make_policy
from mlx_dflash.decoding.prompt_cache import PromptCache, rungs

SYSTEM = "You are a patient tutor. " * 6
TURNS = ["What is 17 times 23?", "And 18 times 23?", "Explain the method in one sentence."]
@pytest.fixture(scope="module")
def pairs(tiny_chat_pair):
    """name -> (target, drafter, tokenizer): a dense llama, a hybrid GatedDeltaNet qwen3_5, the llama with
    an 8-bit KV cache, all speaking SmolLM2's tokenizer."""
    llama, tokenizer, drafter = tiny_chat_pair
    vocab = llama.vocab_size
    hybrid = tiny_chat_target("qwen3_5", vocab, seed=3)
    hybrid_drafter = init_drafter(drafter_config_for(hybrid, num_layers=1, block_size=8, num_target_features=2),
                                  seed=0).bind(hybrid)
    quantized = tiny_chat_target("llama", vocab, seed=5, num_hidden_layers=4, hidden_size=128,
                                 tie_word_embeddings=True)  # head dim 32: one quantization group
    quantized.quantize_kv(8, group_size=32, start=16)
    quantized_drafter = init_drafter(drafter_config_for(quantized, num_layers=1, block_size=8, num_target_features=2),
                                     seed=0).bind(quantized)
    return {"dense": (llama, drafter, tokenizer), "hybrid": (hybrid, hybrid_drafter, tokenizer),
            "kv8": (quantized, quantized_drafter, tokenizer)}


def conversation(tokenizer, turns, answers) -> list:
    """The chat's token ids for the next turn: system, then user/assistant pairs, then the last user turn."""
    messages = [{"role": "system", "content": SYSTEM}]
    for question, answer in zip(turns, answers):
        messages.append({"role": "user", "content": question})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def answer(pair, ids, cache=None, max_tokens=12, **kw):
    target, drafter, tokenizer = pair
    return generate(target, drafter, tokenizer, ids, max_tokens=max_tokens, prompt_cache=cache, width=4, **kw)


def new_cache(target, **kw) -> PromptCache:
    return PromptCache("test", target.trimmable, **kw)


# A quantized KV cache kept from a conversation's earlier turn holds the keys its decode steps wrote, a cold
# read the keys of one prefill: quantized apart, their log-probabilities differ by up to about 0.2 here, so a
# seeded sample may part (greedy output holds).
@pytest.mark.parametrize("name, sampled", [("dense", False), ("hybrid", False), ("kv8", False), ("dense", True),
                                           ("hybrid", True)], ids=["dense-greedy", "hybrid-greedy", "kv8-greedy",
                                                                   "dense-seeded", "hybrid-seeded"])
def test_a_conversation_with_the_cache_equals_cold_starts(pairs, name, sampled):
    pair = pairs[name]
    kw = dict(temp=0.9, top_k=20, seed=7) if sampled else {}
    cache = new_cache(pair[0])
    answers, previous = [], []
    for i in range(len(TURNS)):
        ids = conversation(pair[2], TURNS[: i + 1], answers + [None])
        warm, cold = answer(pair, ids, cache, **kw), answer(pair, ids, **kw)
        assert warm.tokens == cold.tokens, (name, i)
        # The turn before is cached (all of it but its last token, at least): this turn reads what is new.
        assert warm.stats.cached_tokens >= len(previous) - 1 and (i == 0) == (warm.stats.cached_tokens == 0)
        answers.append(str(cold))
        previous = ids
    assert cache.stats()["hits"] == len(TURNS) - 1


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_every_kind_of_hit_gives_the_cold_answer(pairs, name):
    pair = pairs[name]
    target, tokenizer = pair[0], pair[2]
    cache = new_cache(target)
    first = conversation(tokenizer, TURNS[:1], [None])
    answer(pair, first, cache)
    cases = {
        "whole prompt cached (sent again)": first,
        "a prefix of a message": conversation(tokenizer, ["What is 17 times 24?"], [None]),
        "a prompt shorter than a cached one": first[: len(first) // 2],
        "another conversation": chat_ids(tokenizer, "Name three red fruits."),
        "the first conversation again": first,
    }
    for what, ids in cases.items():
        warm = answer(pair, ids, cache)
        assert warm.tokens == answer(pair, ids).tokens, what
        if what == "whole prompt cached (sent again)":
            assert warm.stats.cached_tokens == len(ids) - 1  # only the last token is read again
    # An evicted entry is simply missed: one entry at most, a second conversation pushes the first out.
    small = new_cache(target, max_entries=1)
    answer(pair, first, small)
    answer(pair, chat_ids(tokenizer, "Name three red fruits."), small)
    warm = answer(pair, first, small)
    assert warm.tokens == answer(pair, first).tokens and len(small) == 1


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_a_stream_broken_off_keeps_what_it_decoded_for_the_next_request(pairs, name):
    """A caller that stops reading stream_generate ends its request there: the row leaves at once and the prefix
    cache keeps the prompt and the tokens decoded so far, so a prompt that goes on from them reads only what is
    new (a hybrid target: from its checkpoints), and answers as a cold start."""
    from mlx_dflash.generate import stream_generate

    target, drafter, tokenizer = pair = pairs[name]
    cache = new_cache(target)
    ids = conversation(tokenizer, TURNS[:1], [None])
    taken = []
    for response in stream_generate(target, drafter, tokenizer, ids, max_tokens=40, prompt_cache=cache, width=4):
        taken.append(response.token)
        if len(taken) == 5:
            break
    assert len(cache) == 1
    warm, cold = answer(pair, ids + taken, cache), answer(pair, ids + taken)
    assert warm.tokens == cold.tokens
    assert warm.stats.cached_tokens >= (len(ids) + len(taken) - 1 if target.trimmable else len(ids) - 1)


def test_a_dflash2_drafter_is_restored_with_its_context(tiny_chat_pair):
    import dflash2_tiny

    llama, tokenizer, _ = tiny_chat_pair
    config = dflash2_tiny.tiny_config(target_layer_ids=[1, 2])
    config.update(vocab_size=llama.vocab_size, num_target_layers=4, num_hidden_layers=1, layer_types=["full_attention"])
    config["dflash_config"].update(mask_token_id=llama.vocab_size - 1)
    from mlx_dflash.models.config import parse_config

    drafter = init_drafter(parse_config(config), seed=0)
    target = Target(llama.model)
    pair = (target, drafter.bind(target), tokenizer)
    cache = new_cache(target)
    answers = []
    for i in range(2):
        ids = conversation(tokenizer, TURNS[: i + 1], answers + [None])
        warm, cold = answer(pair, ids, cache), answer(pair, ids)
        assert warm.tokens == cold.tokens
        answers.append(str(cold))
    assert cache.stats()["hits"] == 1


def test_the_byte_budget_holds_and_memory_returns_after_the_conversations(tiny_chat_pair):
    target, tokenizer, drafter = tiny_chat_pair
    pair = (target, drafter, tokenizer)
    one = new_cache(target)
    answer(pair, chat_ids(tokenizer, "Question 0: what is 0 plus 0?"), one, max_tokens=2)
    budget = int(one.nbytes * 3.5)  # room for three conversations
    cache = new_cache(target, max_bytes=budget, max_entries=100)
    mx.eval(mx.zeros(1))
    before = mx.get_active_memory()
    for i in range(50):
        answer(pair, chat_ids(tokenizer, f"Question {i}: what is {i} plus {i}?"), cache, max_tokens=2)
        assert cache.nbytes <= budget and len(cache) <= 3
    assert cache.stats()["entries"] == len(cache) == 3
    del cache
    mx.clear_cache()
    assert mx.get_active_memory() <= before + budget // 10  # the kept states were all that remained


def test_states_persist_across_restarts_only_for_their_own_pair(tiny_chat_pair, tmp_path):
    target, tokenizer, drafter = tiny_chat_pair
    pair = (target, drafter, tokenizer)
    ids = conversation(tokenizer, TURNS[:1], [None])
    cold = answer(pair, ids)
    answer(pair, ids, PromptCache("pair-a", True, directory=tmp_path))
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    restarted = PromptCache("pair-a", True, directory=tmp_path)
    warm = answer(pair, ids, restarted)
    assert warm.tokens == cold.tokens and warm.stats.cached_tokens == len(ids) - 1
    other = PromptCache("pair-b", True, directory=tmp_path)  # another model or drafter: never used
    assert len(other) == 0 and answer(pair, ids, other).stats.cached_tokens == 0


def test_a_scope_serves_only_its_own_entries_across_restarts(tiny_chat_pair, tmp_path):
    """A server keeps the prefix cache apart per API key: a request (the scheduler's, as the engine makes it)
    names its scope."""
    target, tokenizer, drafter = tiny_chat_pair
    ids = conversation(tokenizer, TURNS[:1], [None])

    def cached(cache, scope=""):  # prompt tokens the cache gave the request
        scheduler = Scheduler(target, drafter, make_policy(drafter.block_size, 4), 1, prompt_cache=cache)
        admitted = []
        list(scheduler.alone(Request(0, ids, 12, cache_scope=scope), lambda *value: admitted.append(value)))
        return admitted[0][0]

    cached(PromptCache("pair-a", True, directory=tmp_path), "key-a")
    restarted = PromptCache("pair-a", True, directory=tmp_path)
    assert cached(restarted, "key-b") == 0
    assert cached(restarted) == 0
    assert cached(restarted, "key-a") == len(ids) - 1
    assert len(restarted) == 3  # one state per scope

def test_a_kv_group_size_that_does_not_divide_the_head_dim_is_refused(tiny_chat_pair):
    from mlx_dflash.errors import DFlashError

    with pytest.raises(DFlashError, match="--kv-group-size 32 does not divide the attention head dim 16"):
        Target(tiny_chat_pair[0].model).quantize_kv(8, group_size=32)


def test_a_hybrid_state_that_a_newer_one_extends_is_folded_into_it(pairs):
    pair = pairs["hybrid"]
    cache = new_cache(pair[0])
    first = conversation(pair[2], TURNS[:1], [None])
    answer(pair, first, cache)
    (kept,) = cache._entries.values()
    older = set(kept.checkpoints)
    assert {len(first) - 1, len(kept.tokens)} <= older  # one token before the prompt's end, and its end
    extended = kept.tokens.tolist() + chat_ids(pair[2], "Go on.")  # exactly what the first state holds, then more
    warm = answer(pair, extended, cache)
    assert warm.stats.cached_tokens == len(kept.tokens) and warm.tokens == answer(pair, extended).tokens
    (entry,) = cache._entries.values()  # one state per conversation: the older one was folded in
    assert older < set(entry.checkpoints)


def test_rungs_mark_message_ends_long_prompts_and_the_last_token():
    assert rungs(10, [3, 7]) == [3, 7, 9]
    assert rungs(5000, [100]) == [100, 2048, 4096, 4999]
    assert rungs(1, []) == []


@pytest.mark.slow
def test_the_shipped_pair_answers_a_chat_alike_with_the_cache(smollm2):
    """The real SmolLM2 target and the shipped drafter: a 3-turn chat with a long system prompt; every turn
    equals a cold start, and the later turns read only what is new."""
    from mlx_dflash.downloads import shipped_drafter_dir
    from mlx_dflash.models.loader import drafter_from_dir

    target, tokenizer = smollm2
    pair = (target, drafter_from_dir(shipped_drafter_dir()).bind(target), tokenizer)
    cache = new_cache(target)
    answers, previous = [], []
    for i in range(len(TURNS)):
        ids = conversation(tokenizer, TURNS[: i + 1], answers + [None])
        warm = generate(*pair, ids, max_tokens=24, prompt_cache=cache)
        cold = generate(*pair, ids, max_tokens=24)
        assert warm.tokens == cold.tokens
        assert warm.stats.cached_tokens >= len(previous) - 1
        answers.append(str(cold))
        previous = ids
