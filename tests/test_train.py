"""The trainer (mlx_dflash/tuner/trainer.py) against the published objective (DFlash paper, arXiv 2602.06036,
section 4.2 and appendix A.1).

Fast checks run on a tiny random mlx-lm Llama target or on a drafter bound to a fake embedding/head;
the acceptance check runs on the real SmolLM2-135M-Instruct fixture.
"""

import json
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from conftest import PROMPTS, chat_ids, mlx_lm_greedy
from mlx_dflash.models.config import parse_config
from mlx_dflash.tuner.data import greedy_batch
from mlx_dflash.models.dflash import Attention, Borrowed
from mlx_dflash.models.loader import drafter_config_for, drafter_from_dir, init_drafter
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.target import Target
from mlx_dflash.tuner.replay import TargetFeatures, block_logits, decoding_acceptance, prompt_lookup_drafts, replay_greedy
from mlx_dflash.models.mask_token import pick_mask_token
from mlx_dflash.tuner.objectives import position_weights
from mlx_dflash.tuner.trainer import TrainConfig, draft_loss_and_grads, export, make_blocks, sample_rows, save_checkpoint, train

H, VOCAB = 64, 97
QUIET = dict(eval_every=10**9, checkpoint_every=10**9)


def tiny_config(**overrides):
    cfg = dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=H, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
        num_target_layers=8, dflash_config=dict(block_size=8, mask_token_id=VOCAB - 1, target_layer_ids=[1, 3, 5]),
    )
    cfg.update(overrides)
    return parse_config(cfg)


# The published drafters' layer kinds (z-lab's dflash/model.py): full or sliding window, bidirectional or
# causal inside the block.
LAYER_KINDS = {
    "full_bidirectional": {},
    "full_causal": dict(is_causal=True),
    "sliding_causal": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5),
    "sliding_bidirectional": dict(layer_types=["sliding_attention", "sliding_attention"], sliding_window=5,
                                  is_causal=False),
}


def fake_bound_drafter(config, seed=0):
    """A drafter with random weights bound to a random embedding table and head (no target model)."""
    drafter = init_drafter(config, seed=seed)
    embed = mx.random.normal((VOCAB, H), key=mx.random.key(seed + 1))
    head = mx.random.normal((VOCAB, H), key=mx.random.key(seed + 2)) * 0.2
    drafter._borrowed = Borrowed(embed=lambda ids: embed[ids], head=lambda h: h @ head.T, embed_scale=1.0)
    return drafter


@pytest.fixture(scope="module")
def tiny_target():
    """A tiny random mlx-lm Llama (4 layers, width 64, vocabulary 128) as a stand-in target."""
    mx.random.seed(1234)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                           num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=128, num_key_value_heads=2,
                           tie_word_embeddings=True)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_pair(model, seed=0, block_size=8):
    target = Target(model)
    config = drafter_config_for(target, num_layers=1, block_size=block_size, num_target_features=2)
    return target, init_drafter(config, seed=seed).bind(target)


def tiny_sequence(length=40, response_start=8, seed=0):
    return np.random.default_rng(seed).integers(0, 127, length).tolist(), response_start


# ---------------------------------------------------------------------------------------------------
# Loss weights and blocks.


def test_position_weights_follow_the_published_decay():
    k = np.arange(1, 16)
    np.testing.assert_allclose(np.array(position_weights(16)), np.exp(-(k - 1) / 7.0), rtol=1e-6)
    np.testing.assert_allclose(np.array(position_weights(10)), np.exp(-(np.arange(1, 10) - 1) / 5.0), rtol=1e-6)
    np.testing.assert_allclose(np.array(position_weights(8)), np.exp(-(np.arange(1, 8) - 1) / 4.0), rtol=1e-6)
    np.testing.assert_allclose(np.array(position_weights(16, gamma=2.0)), np.exp(-(k - 1) / 2.0), rtol=1e-6)


def test_make_blocks_labels_and_validity_at_the_sequence_end():
    ids = np.arange(100, 120)  # 20 tokens; the response starts at 12
    mask, B = 7, 6
    block_ids, anchors, labels, valid = make_blocks(ids, 12, 64, B, mask, np.random.default_rng(0))
    anchors, block_ids, labels, valid = (np.array(x) for x in (anchors, block_ids, labels, valid))
    # More anchors asked than there are: every response position with a token after it, in order.
    assert anchors.tolist() == list(range(12, 19))
    assert block_ids.shape == (7, B) and labels.shape == (7, B - 1) and valid.shape == (7, B - 1)
    for row, a in enumerate(anchors):
        assert block_ids[row].tolist() == [ids[a]] + [mask] * (B - 1)
        for k in range(1, B):
            assert bool(valid[row, k - 1]) == (a + k < len(ids)), (a, k)
            if a + k < len(ids):
                assert labels[row, k - 1] == ids[a + k], (a, k)
    # The last anchor (position 18) has exactly one label, the final token.
    assert valid[-1].tolist() == [True] + [False] * (B - 2) and labels[-1, 0] == 119

    # Fewer anchors: distinct, sorted, inside the response.
    _, few, _, _ = make_blocks(ids, 12, 3, B, mask, np.random.default_rng(1))
    few = np.array(few).tolist()
    assert len(few) == 3 and few == sorted(set(few)) and all(12 <= a <= 18 for a in few)

    with pytest.raises(DFlashError):
        make_blocks(ids, 19, 4, B, mask, np.random.default_rng(0))  # no response token with a successor


def reference_loss(drafter, features, block_ids, anchors, labels, row_weight, total):
    """The weighted cross-entropy written plainly in MLX, over every block row."""
    logits = block_logits(drafter, features, block_ids, anchors)
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")
    return (ce * mx.array(row_weight)).sum() / total


def test_draft_loss_and_grads_equal_the_weighted_mean_and_its_gradient():
    drafter = fake_bound_drafter(tiny_config())
    pieces, total = [], 0.0
    rng = np.random.default_rng(0)
    for seed, T in ((2, 14), (3, 20)):
        features = mx.random.normal((1, T, 3 * H), key=mx.random.key(seed))
        ids = np.random.default_rng(seed).integers(0, VOCAB - 1, T)
        block_ids, anchors, labels, valid = make_blocks(ids, 5, 64, 8, VOCAB - 1, rng)
        assert not np.array(valid).all()  # blocks near the end run past the sequence
        row_weight = np.array(position_weights(8))[None] * np.array(valid)
        pieces.append((features, block_ids, anchors, labels, row_weight))
        total += row_weight.sum()
    loss, grads, correct, counted = draft_loss_and_grads(drafter, pieces, total)

    def reference(model):
        return sum(reference_loss(model, *p, total) for p in pieces)

    want_loss, want_grads = nn.value_and_grad(drafter, reference)(drafter)
    np.testing.assert_allclose(loss, want_loss.item(), rtol=1e-5)
    want = dict(tree_flatten(want_grads))
    for k, g in tree_flatten(grads):
        np.testing.assert_allclose(np.array(g), np.array(want[k]), rtol=1e-3, atol=1e-6, err_msg=k)
    # Per-position counts cover exactly the valid rows; hits are the argmax's.
    valid = sum(np.array(p[4] > 0) .sum(0) for p in pieces)
    assert counted.tolist() == valid.tolist()
    hits = sum(((np.array(block_logits(drafter, *p[:3])).argmax(-1) == np.array(p[3])) & (p[4] > 0)).sum(0)
               for p in pieces)
    assert correct.tolist() == hits.tolist()

    # Labels past the end of a sequence never count.
    features, block_ids, anchors, labels, row_weight = pieces[0]
    garbage = mx.where(mx.array(row_weight > 0), labels, (labels + 1) % VOCAB)
    again = draft_loss_and_grads(drafter, [(features, block_ids, anchors, garbage, row_weight), pieces[1]], total)
    assert again[0] == loss


def test_prompt_lookup_drafts_and_their_replay():
    ids = [5, 1, 2, 3, 9, 1, 2, 7, 2, 3]
    drafts = prompt_lookup_drafts(ids, start=5, k=3)
    assert drafts.tolist() == [
        [2, 3, 9],  # s=5, tail "9 1" unseen, "1" last at 1: what followed it
        [3, 9, 1],  # s=6, tail "1 2" at 1
        [-1, -1, -1],  # s=7, "7" never seen
        [7, 2, -1],  # s=8, "2" last at 6; only tokens known at s are copied
    ]
    result = replay_greedy(lambda i, s: prompt_lookup_drafts(i, s, 3), [(ids, 5)], widths=(4,))[4]
    # Rounds: at 5 keeps "2" (then 3 != 7), at 7 keeps nothing, at 8 nothing is left to draft.
    assert result == {"tau": 4 / 3, "rounds": 3, "reach": [1 / 3, 0.0, 0.0]}


def test_sampled_rows_follow_the_position_weights():
    w = np.array(position_weights(16))
    valid = np.ones((20000, 15), dtype=bool)
    valid[:, -3:] = False  # rows past the sequence end are never drawn
    chosen = sample_rows(w[None] * valid, np.random.default_rng(0))
    assert set(np.unique(chosen)) <= {0.0, 1.0}
    freq = chosen.mean(0)
    np.testing.assert_allclose(freq[:12], w[:12], atol=0.015)
    assert (freq[12:] == 0).all()


# ---------------------------------------------------------------------------------------------------
# The block attention mask.


def spec_mask(anchors, L, ctx_len, causal, window):
    """Reference 5 / 1.5, with loops: [A, 1, L, ctx_len + L] visibility for blocks at `anchors`."""
    out = np.zeros((len(anchors), 1, L, ctx_len + L), dtype=bool)
    for r, a in enumerate(anchors):
        for i in range(L):
            q = a + i
            for j in range(ctx_len):  # context: strictly before the anchor (and inside the window)
                out[r, 0, i, j] = j < a and (window is None or q - j < window)
            for m in range(L):  # own block: all of it, or the rows up to the query in causal layers
                k = a + m
                out[r, 0, i, ctx_len + m] = (not causal or k <= q) and (window is None or abs(q - k) < window)
    return out


@pytest.mark.parametrize("kind", sorted(LAYER_KINDS))
def test_block_mask_matches_the_specification(kind):
    config = tiny_config(**LAYER_KINDS[kind])
    attn = Attention(config, 0)
    causal, window = config.layer_is_causal(0), config.layer_window(0)
    assert causal == kind.endswith("_causal") and (window is not None) == kind.startswith("sliding")
    L, ctx_len = 6, 20
    anchors = [1, 2, 5, 9, 14, 19]
    got = np.array(attn._mask(L, ctx_len, mx.array(anchors)))
    assert got.shape == (len(anchors), 1, L, ctx_len + L) and got.dtype == np.bool_
    np.testing.assert_array_equal(got, spec_mask(anchors, L, ctx_len, causal, window))

    # Inference: the block follows the whole context (an int start); None means "all visible".
    inf = attn._mask(L, ctx_len, ctx_len)
    want = spec_mask([ctx_len], L, ctx_len, causal, window)[0, 0]
    if inf is None:
        assert want.all()
    else:
        np.testing.assert_array_equal(np.broadcast_to(np.array(inf), want.shape), want)


@pytest.mark.parametrize("kind", sorted(LAYER_KINDS))
def test_training_forward_equals_inference_forward(kind):
    """block_logits for many anchors at once == the decoder's call with only the context before each."""
    drafter = fake_bound_drafter(tiny_config(**LAYER_KINDS[kind]), seed=5)
    T, B = 24, 8
    features = mx.random.normal((1, T, 3 * H), key=mx.random.key(9))
    anchors = [1, 3, 4, 8, 13, 20, 23]
    first = np.random.default_rng(4).integers(0, VOCAB - 1, len(anchors))
    block_ids = np.full((len(anchors), B), VOCAB - 1, dtype=np.int32)
    block_ids[:, 0] = first
    block_ids = mx.array(block_ids)
    train_logits = np.array(block_logits(drafter, features, block_ids, mx.array(anchors)))
    assert train_logits.shape == (len(anchors), B - 1, VOCAB)
    for row, a in enumerate(anchors):
        infer = np.array(drafter(block_ids[row : row + 1], features[:, :a], drafter.make_cache()))[0]
        np.testing.assert_allclose(train_logits[row], infer, rtol=1e-4, atol=1e-4, err_msg=f"anchor {a}")


# ---------------------------------------------------------------------------------------------------
# The training loop, checkpoints, export and resume (tiny random Llama target).


def exact_loss(drafter, features, blocks):
    """The published objective (every valid row, weight w_k) on one sequence's blocks."""
    block_ids, anchors, labels, valid = blocks
    row_weight = np.array(position_weights(drafter.block_size))[None] * np.array(valid)
    return draft_loss_and_grads(drafter, [(features, block_ids, anchors, labels, row_weight)], row_weight.sum())[0]


def test_trainer_loss_decreases_on_a_fixed_sequence(tiny_target, tmp_path, capsys):
    target, drafter = tiny_pair(tiny_target)
    ids, start = tiny_sequence()
    _, features = target.forward(mx.array(ids)[None], None)
    # Every anchor of the sequence, so the measured batch is the whole training set.
    blocks = make_blocks(np.array(ids), start, 64, 8, drafter.mask_token_id, np.random.default_rng(0))
    before = exact_loss(drafter, features, blocks)
    target_before = {k: np.array(v) for k, v in tree_flatten(tiny_target.parameters())}

    logs = []
    state = train(target, drafter, [(ids, start)], [], tmp_path / "ck",
                  TrainConfig(steps=30, anchors=64, learning_rate=1e-3, labels="text", **QUIET), log=logs.append)
    after = exact_loss(drafter, features, blocks)
    assert state["step"] == 30 and any(line.startswith("step 30/30: loss") for line in logs)
    bar = capsys.readouterr().err  # tqdm's progress bar
    assert "training drafter" in bar and "30/30" in bar and "rows/s" in bar
    assert after < 0.3 * before, (before, after)
    # Only the drafter trains: the target's embedding and head (borrowed) are untouched.
    for k, v in tree_flatten(tiny_target.parameters()):
        np.testing.assert_array_equal(np.array(v), target_before[k], err_msg=k)

    with pytest.raises(DFlashError, match="no training sequences"):
        train(target, drafter, [], [], tmp_path / "none", TrainConfig(steps=1, **QUIET), log=logs.append)


def test_checkpoint_loads_strictly_and_export_is_bf16(tiny_target, tmp_path):
    target, drafter = tiny_pair(tiny_target, seed=2)
    ids, start = tiny_sequence(seed=1)
    out = tmp_path / "ck"
    state = train(target, drafter, [(ids, start)], [], out,
                  TrainConfig(steps=4, anchors=8, eval_every=10**9, checkpoint_every=2), log=lambda s: None)
    files = sorted(os.listdir(out))
    # Only the weights may be *.safetensors: loaders read every *.safetensors file of a drafter dir.
    assert [f for f in files if f.endswith(".safetensors")] == ["model.safetensors"]
    assert {"config.json", "trainer_state.json"} <= set(files) and len(optimizer_files(out)) == 1
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no .tmp / .old left behind
    assert json.loads((out / "trainer_state.json").read_text())["step"] == state["step"] == 4

    _, features = target.forward(mx.array(ids)[None], None)
    block_ids, anchors, _, _ = make_blocks(np.array(ids), start, 16, 8, drafter.mask_token_id,
                                           np.random.default_rng(0))
    want = np.array(block_logits(drafter, features, block_ids, anchors))
    loaded = drafter_from_dir(out).bind(target)
    np.testing.assert_array_equal(np.array(block_logits(loaded, features, block_ids, anchors)), want)
    ours = dict(tree_flatten(drafter.parameters()))
    for k, v in tree_flatten(loaded.parameters()):
        np.testing.assert_array_equal(np.array(v), np.array(ours[k]), err_msg=k)

    # save_checkpoint writes exactly what drafter_from_dir reads strictly: an extra key is refused.
    extra = tmp_path / "extra"
    save_checkpoint(drafter, extra, state={"step": 0})
    weights = mx.load(str(extra / "model.safetensors"))
    weights["layers.0.self_attn.extra"] = mx.zeros((2,))
    mx.save_safetensors(str(extra / "model.safetensors"), weights)
    with pytest.raises(DFlashError, match="unexpected"):
        drafter_from_dir(extra)

    exported = export(out, tmp_path / "export")
    assert sorted(os.listdir(exported)) == ["config.json", "model.safetensors"]
    assert json.loads((exported / "config.json").read_text()) == json.loads((out / "config.json").read_text())
    small = drafter_from_dir(exported)
    for k, v in tree_flatten(small.parameters()):
        assert v.dtype == mx.bfloat16, k
        np.testing.assert_array_equal(np.array(v.astype(mx.float32)),
                                      np.array(ours[k].astype(mx.bfloat16).astype(mx.float32)), err_msg=k)
    small.bind(target)  # float32 activations: its weights are cast once, to the same values
    for k, v in tree_flatten(small.parameters()):
        assert v.dtype == mx.float32, k
        np.testing.assert_array_equal(np.array(v), np.array(ours[k].astype(mx.bfloat16).astype(mx.float32)), err_msg=k)
    got = np.array(block_logits(small, features, block_ids, anchors).astype(mx.float32))
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9
    np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())


def optimizer_files(path):
    return [f for f in os.listdir(path) if f.startswith("optimizer.")]


def load_optimizer_state(path):
    (name,) = optimizer_files(path)
    return mx.load(str(path / name))


def crash_at_checkpoint(step):
    """A log function that raises once the checkpoint of `step` is written (a crash mid-training)."""

    def log(line):
        if line.startswith(f"step {step}: checkpoint"):
            raise KeyboardInterrupt("simulated crash")

    return log


def test_resume_continues_at_the_saved_step_and_matches_an_uninterrupted_run(tiny_target, tmp_path):
    """10 steps in one go == 5 steps, a crash, and a resumed run from the step-5 checkpoint.

    Two sequences, drawn at random each step, and rows drawn at random: the resumed run must restore
    the sampler's state as well as the weights, the AdamW moments, the step counter and the
    learning-rate schedule for the weights to come out bit for bit the same.
    """
    sequences = [tiny_sequence(seed=3), tiny_sequence(length=30, seed=4)]
    cfg = TrainConfig(steps=10, sequences=1, anchors=8, learning_rate=2e-3, warmup_ratio=0.3,
                      eval_every=10**9, checkpoint_every=5)
    quiet = lambda s: None  # noqa: E731

    target, straight = tiny_pair(tiny_target, seed=0)
    train(target, straight, sequences, [], tmp_path / "straight", cfg, log=quiet)

    target, first = tiny_pair(tiny_target, seed=0)
    with pytest.raises(KeyboardInterrupt):
        train(target, first, sequences, [], tmp_path / "resumed", cfg, log=crash_at_checkpoint(5))
    saved = json.loads((tmp_path / "resumed" / "trainer_state.json").read_text())
    assert saved["step"] == 5
    assert load_optimizer_state(tmp_path / "resumed")["step"].item() == 5

    target, second = tiny_pair(tiny_target, seed=1)  # other initial weights: all must come from disk
    logs = []
    state = train(target, second, sequences, [], tmp_path / "resumed", cfg, resume=True, log=logs.append)
    assert any("resuming from step 5" in line for line in logs)
    assert [line for line in logs if "checkpoint" in line] == [f"step 10: checkpoint in {tmp_path / 'resumed'}"]
    assert state["step"] == 10

    a = mx.load(str(tmp_path / "straight" / "model.safetensors"))
    b = mx.load(str(tmp_path / "resumed" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)
    a = load_optimizer_state(tmp_path / "straight")
    b = load_optimizer_state(tmp_path / "resumed")
    assert sorted(a) == sorted(b) and {"step", "learning_rate"} <= set(a)
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)


# ---------------------------------------------------------------------------------------------------
# The real target: mask token and acceptance after training.


def test_pick_mask_token_on_smollm2(smollm2):
    target, tokenizer = smollm2
    mask = pick_mask_token(tokenizer, target.vocab_size)
    hf = tokenizer._tokenizer
    added = hf.added_tokens_decoder
    assert mask in added and added[mask].special
    assert mask not in {hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, *tokenizer.eos_token_ids}
    assert added[mask].content not in tokenizer.chat_template
    assert 0 <= mask < target.vocab_size
    # The tokens the chat template uses are never picked.
    used = {tid for tid, tok in added.items() if tok.content in tokenizer.chat_template}
    assert used and mask not in used


def test_pick_mask_token_falls_back_to_the_last_row():
    class Plain:
        bos_token_id = eos_token_id = pad_token_id = 0
        added_tokens_decoder = {}
        chat_template = None

    assert pick_mask_token(Plain(), 500) == 499


def greedy_sequences(smollm2, n_prompts, max_tokens):
    target, tokenizer = smollm2
    out = []
    for prompt in PROMPTS[:n_prompts]:
        ids = list(chat_ids(tokenizer, prompt))
        out.append((ids + mlx_lm_greedy(target.model, ids, max_tokens), len(ids)))
    return out


def trained_vs_untrained(smollm2, tmp_path, sequences, steps, block_size, anchors, learning_rate):
    model, tokenizer = smollm2[0].model, smollm2[1]
    target = Target(model)  # own Target object: the session fixture's layer choice stays as it is
    config = drafter_config_for(target, num_layers=1, block_size=block_size,
                                mask_token_id=pick_mask_token(tokenizer, target.vocab_size))
    drafter = init_drafter(config, seed=0).bind(target)
    cached = TargetFeatures(target)
    tau0 = decoding_acceptance(drafter, cached, sequences, widths=(block_size,))[block_size]["tau"]
    cfg = TrainConfig(steps=steps, sequences=1, anchors=anchors, learning_rate=learning_rate, **QUIET)
    train(cached, drafter, sequences, [], tmp_path / "ck", cfg, log=lambda s: None)
    result = decoding_acceptance(drafter, cached, sequences, widths=(block_size,))[block_size]
    tau1, per_position = result["tau"], result["reach"]
    return tau0, tau1, per_position


def test_trained_drafter_accepts_more_than_untrained_fast(smollm2, tmp_path):
    """Small, fast variant: 2 short greedy responses, block 4, every anchor of a sequence in each step.

    (On SmolLM2 a fresh drafter starts with huge logits (loss ~70); at lr >= 1e-3 it settles on the
    unigram for a long while, at 1e-4 it leaves that plateau within ~30 steps.)
    """
    sequences = greedy_sequences(smollm2, 2, 24)
    tau0, tau1, per_position = trained_vs_untrained(smollm2, tmp_path, sequences, steps=60, block_size=4,
                                                    anchors=32, learning_rate=1e-4)
    assert tau1 > tau0 + 0.3, (tau0, tau1, per_position)


@pytest.mark.slow
def test_trained_drafter_accepts_more_than_untrained(smollm2, tmp_path):
    """6 greedy responses of 48 tokens, a 1-layer block-8 drafter, 16 anchors a step."""
    sequences = greedy_sequences(smollm2, 6, 48)
    tau0, tau1, per_position = trained_vs_untrained(smollm2, tmp_path, sequences, steps=150, block_size=8,
                                                    anchors=16, learning_rate=1e-4)
    assert tau1 > tau0 + 0.3, (tau0, tau1, per_position)


def test_greedy_batch_equals_one_prompt_at_a_time(smollm2):
    """Training data: batched, left-padded greedy responses equal mlx-lm's greedy decoding of each prompt
    alone, and end before the stop token (rows that stop leave the batch, the others go on)."""
    target, tokenizer = smollm2
    check_greedy_batch(target.model, tokenizer, [list(chat_ids(tokenizer, PROMPTS[i])) for i in (3, 4, 5, 8)])


def test_greedy_batch_equals_one_prompt_at_a_time_on_a_tiny_model(tiny_chat_pair):
    target, tokenizer, _ = tiny_chat_pair
    prompts = [list(chat_ids(tokenizer, p)) for p in ("Hi.", "Name a colour.", "What is 2 + 2? Answer briefly.")]
    check_greedy_batch(target.model, tokenizer, prompts, require_stops=False)


def check_greedy_batch(model, tokenizer, prompts, require_stops=True):
    assert len({len(p) for p in prompts}) > 1  # padding really happens
    responses = greedy_batch(model, tokenizer, prompts, 40)
    stopped = 0
    for prompt, response in zip(prompts, responses):
        alone = mlx_lm_greedy(model, prompt, 40)
        stops = [i for i, t in enumerate(alone) if t in tokenizer.eos_token_ids]
        stopped += bool(stops)
        assert response == alone[: stops[0] if stops else None]
    if require_stops:
        assert 0 < stopped < len(prompts), "the test needs rows that stop and rows that go on"


def test_train_command_end_to_end(smollm2_path, tmp_path):
    """`mlx-dflash train` on the real target: answers prompts, trains, evaluates, checkpoints, exports;
    a second call with --resume and more steps continues from the checkpoint."""
    from click.testing import CliRunner

    from mlx_dflash.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:3]) + "\n")
    args = ["train", "--model", str(smollm2_path), "--prompts", str(prompts), "--data", str(tmp_path / "d.jsonl"),
            "--out", str(tmp_path / "ck"), "--max-response-tokens", "8", "--block-size", "4", "--sequences", "2",
            "--anchors", "4", "--eval-sequences", "1", "--eval-every", "2", "--export", str(tmp_path / "drafter")]
    result = CliRunner().invoke(main, args + ["--steps", "2"])
    assert result.exit_code == 0, result.output
    assert "held-out tau" in result.output and "2/2" in result.output
    assert len((tmp_path / "d.jsonl").read_text().splitlines()) == 3
    assert sorted(os.listdir(tmp_path / "drafter")) == ["config.json", "model.safetensors"]
    assert drafter_from_dir(tmp_path / "drafter").block_size == 4

    result = CliRunner().invoke(main, args + ["--steps", "4", "--resume"])
    assert result.exit_code == 0, result.output
    assert "resuming from step 2" in result.output and "4/4" in result.output
    assert json.loads((tmp_path / "ck" / "trainer_state.json").read_text())["step"] == 4

    # --init: a new run that starts from the exported (bfloat16) drafter's weights and trains in float32.
    init_args, at = list(args), args.index("--block-size")
    del init_args[at:at + 2]
    init_args[init_args.index("--out") + 1] = str(tmp_path / "ck2")
    init_args += ["--init", str(tmp_path / "drafter")]
    result = CliRunner().invoke(main, init_args + ["--steps", "2"])
    assert result.exit_code == 0, result.output
    start = mx.load(str(tmp_path / "drafter" / "model.safetensors"))
    after = mx.load(str(tmp_path / "ck2" / "model.safetensors"))
    assert all(v.dtype == mx.float32 for v in after.values())
    # Two Adam steps move a weight by about 2 x lr (6e-4); a fresh random init differs by ~0.05.
    assert all(mx.allclose(after[k], start[k].astype(mx.float32), rtol=0, atol=3e-3).item() for k in start)
    result = CliRunner().invoke(main, init_args + ["--steps", "2", "--block-size", "8", "--out", str(tmp_path / "c3")])
    assert result.exit_code != 0 and "--block-size 8 conflicts with the drafter" in result.output
    result = CliRunner().invoke(main, args + ["--steps", "2", "--resume", "--init", str(tmp_path / "drafter")])
    assert result.exit_code != 0 and "pass one of them" in result.output
    result = CliRunner().invoke(main, init_args + ["--steps", "2", "--init", str(tmp_path), "--out", str(tmp_path / "c4")])
    assert result.exit_code != 0 and "is not a DFlash drafter directory" in result.output
