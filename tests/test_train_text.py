"""Training on text that exists (mlx_dflash/tuner/text.py) with the target's own choices as labels
(`TargetFeatures.choices`, `TrainConfig.labels`), and the train command's data flags."""

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

from conftest import PROMPTS, mlx_lm_greedy, tiny_llama
from mlx_dflash.cli import main
from mlx_dflash.downloads import ensure_smollm2
from mlx_dflash.errors import DFlashError
from mlx_dflash.decoding.prompt import encode_prompt
from mlx_dflash.models.loader import drafter_config_for, init_drafter
from mlx_dflash.models.target import Target
from mlx_dflash.tuner.replay import TargetFeatures
from mlx_dflash.tuner.text import text_sequences
from mlx_dflash.tuner.trainer import TrainConfig, make_blocks, train

QUIET = dict(eval_every=10**9, checkpoint_every=10**9)


@pytest.fixture(scope="module")
def tiny_pair():
    target = Target(tiny_llama(99, vocab_size=128))
    drafter = init_drafter(drafter_config_for(target, num_layers=1, block_size=8, num_target_features=2), seed=0)
    return target, drafter.bind(target)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(ensure_smollm2("float32"))  # the tokenizer files only: fast


def put(path, data: bytes):
    path.write_bytes(data)
    return path


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_records_become_prompt_then_answer_sequences(smollm2_tokenizer, tmp_path):
    tok = smollm2_tokenizer
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"question": "What is 2+2?", "answer": "2+2 = <<2+2=4>>4\n#### 4"},  # GSM8K
        {"prompt": "def add(a, b):", "canonical_solution": "    return a + b\n"},  # HumanEval
        {"conversations": [{"from": "human", "value": "Who are you?"}, {"from": "gpt", "value": "An assistant."}]},
        {"question": "no answer here"},  # skipped: nothing to learn
    ])
    sequences = text_sequences(tok, path)
    assert len(sequences) == 3
    for (ids, start), (prompt, answer) in zip(sequences, [("What is 2+2?", "2+2 = <<2+2=4>>4\n#### 4"),
                                                          ("def add(a, b):", "    return a + b\n"),
                                                          ("Who are you?", "An assistant.")]):
        prompt_ids = encode_prompt(tok, prompt, chat_template=None)  # through the chat template
        assert start == len(prompt_ids) and ids[:start] == prompt_ids
        assert tok.decode(ids[start:]) == answer


def test_plain_text_and_directories_are_chunked(smollm2_tokenizer, tmp_path):
    tok = smollm2_tokenizer
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("def f(x):\n    return x * 2\n" * 20)
    (tmp_path / "src" / "skip.bin").write_text("not text")
    whole = tok.encode((tmp_path / "src" / "a.py").read_text(), add_special_tokens=False)
    sequences = text_sequences(tok, tmp_path / "src", chunk_tokens=50)
    assert [len(ids) for ids, _ in sequences[:-1]] == [50] * (len(sequences) - 1)
    assert all(start == 0 for _, start in sequences)  # no prompt: supervised throughout
    assert [t for ids, _ in sequences for t in ids] == list(whole)


@pytest.mark.parametrize("make, words", [
    (lambda p: p / "missing.jsonl", "no such file or directory"),
    (lambda p: write_jsonl(p / "q.jsonl", [{"question": "only a question"}]), "holds no record with both"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "holds no .py/.txt/.md/.rst files"),
    (lambda p: write_jsonl(p / "c.jsonl", [{"conversations": ["hi", {"from": "human", "value": ["a", "list"]}]}]),
     "holds no record with both"),
    (lambda p: put(p / "t.jsonl", b"\xff\xfe{}"), "cannot read .* as UTF-8 text"),
    (lambda p: put(p / "t.jsonl.gz", b"x"), "not a file kind it reads"),
])
def test_unusable_text_is_refused_naming_it(smollm2_tokenizer, tmp_path, make, words):
    with pytest.raises(DFlashError, match=words):
        text_sequences(smollm2_tokenizer, make(tmp_path))


def test_choices_are_the_targets_argmax_from_the_same_forward(tiny_pair):
    target, _ = tiny_pair
    ids = np.random.default_rng(0).integers(0, 127, 30)
    logits, features = target.forward(mx.array(ids)[None], None)
    expected = np.array(mx.argmax(logits[0], axis=-1))
    features_of = TargetFeatures(target)
    choices = features_of.choices(ids)
    assert choices[0] == ids[0] and (choices[1:] == expected[:-1]).all()  # position p: the choice after p-1
    assert (choices[1:] != ids[1:]).any(), "random text must differ from the target's choices somewhere"
    np.testing.assert_array_equal(np.array(features_of(ids)), np.array(features))
    # Kept features are bounded: a store for one sequence keeps only the newest.
    small = TargetFeatures(target, keep_bytes=features.nbytes)
    small.choices(ids)
    small(ids[:20])
    assert len(small._memo) == 1 and ids[:20].astype(np.int32).tobytes() in small._memo


def test_blocks_take_labels_from_the_targets_choices():
    ids, label_of = np.arange(100, 130), np.arange(500, 530)
    block_ids, anchors, labels, valid = make_blocks(ids, 5, 8, 4, 0, np.random.default_rng(0), label_of)
    a = np.array(anchors)
    np.testing.assert_array_equal(np.array(block_ids)[:, 0], ids[a])  # the anchor is the text's token
    offsets = np.minimum(a[:, None] + np.arange(1, 4), len(ids) - 1)
    np.testing.assert_array_equal(np.array(labels), label_of[offsets])


def trained(target, drafter_seed, sequences, labels, out):
    drafter = init_drafter(drafter_config_for(target, num_layers=1, block_size=8, num_target_features=2),
                           seed=drafter_seed).bind(target)
    train(target, drafter, sequences, [], out, TrainConfig(steps=3, anchors=16, labels=labels, **QUIET),
          log=lambda _: None, progress=False)
    return {k: np.array(v) for k, v in tree_flatten(drafter.parameters())}


def test_target_labels_equal_text_labels_exactly_on_the_targets_own_answer(tiny_pair, tmp_path):
    """On the target's greedy continuation the target's choices are the text, so both label kinds train
    the same drafter; on random text they do not."""
    target, _ = tiny_pair
    prompt = [5, 17, 3, 88, 41, 9]
    answer = mlx_lm_greedy(target.model, prompt, 24)
    greedy = [(prompt + answer, len(prompt))]
    a = trained(target, 3, greedy, "target", tmp_path / "a")
    b = trained(target, 3, greedy, "text", tmp_path / "b")
    assert all(np.array_equal(a[k], b[k]) for k in a)
    noise = [(np.random.default_rng(1).integers(0, 127, 30).tolist(), 6)]
    c = trained(target, 3, noise, "target", tmp_path / "c")
    d = trained(target, 3, noise, "text", tmp_path / "d")
    assert any(not np.array_equal(c[k], d[k]) for k in c)


def test_resume_keeps_the_labels(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    sequences = [(list(range(10, 40)), 4)]
    cfg = dict(steps=1, anchors=4, eval_every=1, checkpoint_every=1)
    train(target, drafter, sequences, [], tmp_path / "ck", TrainConfig(labels="text", **cfg), log=lambda _: None,
          progress=False)
    with pytest.raises(DFlashError, match="trains with --labels text, not target"):
        train(target, drafter, sequences, [], tmp_path / "ck", TrainConfig(labels="target", **dict(cfg, steps=2)),
              resume=True, log=lambda _: None, progress=False)


@pytest.mark.parametrize("args, words", [
    ([], "nothing to train on: pass --prompts"),
    (["--prompts", "p.txt"], "--prompts needs --data"),
    (["--data", "d.jsonl", "--text", "t.jsonl"], "--data needs --prompts"),
    (["--text", "t.jsonl", "--eval-prompts", "p.txt"], "--eval-prompts needs --eval-data"),
    (["--prompts", "p.txt", "--data", "d.jsonl", "--eval-prompts", "q.txt", "--eval-data", "./d.jsonl"],
     "--data and --eval-data are one file"),
    (["--text", "t.jsonl", "--text-chunk", "1"], "--text-chunk"),
])
def test_data_flags_that_cannot_make_a_run_are_refused(tmp_path, args, words):
    result = CliRunner().invoke(main, ["train", "--out", str(tmp_path / "ck"), *args])
    assert result.exit_code != 0 and words in result.output, result.output
    assert not (tmp_path / "ck").exists()


def test_train_command_on_text_with_held_out_answers(smollm2_path, tmp_path):
    """`mlx-dflash train --text` on the real target: the text trains, the target answers the held-out
    prompts, tau is measured on those answers."""
    text = write_jsonl(tmp_path / "text.jsonl", [{"question": "What is 3 times 4?", "answer": "3 * 4 = 12.\n#### 12"},
                                                 {"question": "Name a colour.", "answer": "Blue is a colour."}])
    held_out = tmp_path / "held-out.txt"
    held_out.write_text("\n".join(PROMPTS[:2]) + "\n")
    args = ["train", "--model", str(smollm2_path), "--text", str(text), "--eval-prompts", str(held_out),
            "--eval-data", str(tmp_path / "answers.jsonl"), "--max-response-tokens", "8", "--block-size", "4",
            "--sequences", "2", "--anchors", "4", "--eval-every", "2", "--steps", "2", "--out", str(tmp_path / "ck")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "2 text sequences" in result.output and "labels: target" in result.output
    assert "training on 2 sequences, 2 held out" in result.output and "held-out tau" in result.output
    assert len((tmp_path / "answers.jsonl").read_text().splitlines()) == 2
