"""Draft vocabularies: chosen from the target's responses, stored with the drafter, drafted over, lossless."""

import json
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner

from conftest import chat_ids, mlx_lm_greedy
from mlx_dflash.cli import main
from mlx_dflash.models.config import parse_config
from mlx_dflash.convert import convert_drafter
from mlx_dflash.generate import generate
from mlx_dflash.tuner.draft_vocab import coverage, response_token_counts, select_draft_vocab
from mlx_dflash.models.dflash import DRAFT_VOCAB_KEY
from mlx_dflash.models.loader import drafter_config_for, drafter_from_dir, init_drafter
from mlx_dflash.errors import DFlashError
from mlx_dflash.tuner.replay import block_drafts
from mlx_dflash.decoding.sampling import SamplingParams
from mlx_dflash.models.target import Target
from mlx_dflash.tuner.trainer import save_checkpoint


@pytest.fixture()
def pair(tiny_chat_pair):
    """The tiny target and tokenizer with a drafter of our own (the shared one must keep its full vocabulary)."""
    target, tokenizer, _ = tiny_chat_pair
    drafter = init_drafter(drafter_config_for(target, num_layers=1, block_size=8, num_target_features=2), seed=3)
    return target, tokenizer, drafter.bind(target)


def write_responses(path, responses):
    path.write_text("".join(json.dumps({"index": i, "prompt_ids": [1], "response_ids": r}) + "\n"
                            for i, r in enumerate(responses)))
    return path


def test_select_ranks_by_frequency_ties_by_id_and_fills_unseen():
    counts = Counter({7: 5, 3: 5, 9: 1, 2: 8})
    assert select_draft_vocab(counts, 3, 10).tolist() == [2, 3, 7]
    assert select_draft_vocab(counts, 6, 10).tolist() == [2, 3, 7, 9, 0, 1]  # unseen ids fill in id order
    assert coverage(counts, [2, 3]) == pytest.approx(13 / 19)
    for size in (0, 11):
        with pytest.raises(DFlashError, match="--draft-vocab must be in 1..10"):
            select_draft_vocab(counts, size, 10)
    with pytest.raises(DFlashError, match="token 12, outside"):
        select_draft_vocab(Counter({12: 1}), 2, 10)


def test_responses_file_errors_name_the_problem(tmp_path):
    with pytest.raises(DFlashError, match="does not exist"):
        response_token_counts(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DFlashError, match="holds no responses"):
        response_token_counts(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"index": 0, "text": "hi"}) + "\n")
    with pytest.raises(DFlashError, match="needs response_ids"):
        response_token_counts(tmp_path / "bad.jsonl")
    counts = response_token_counts(write_responses(tmp_path / "r.jsonl", [[4, 4, 5], [5, 4]]))
    assert counts == Counter({4: 3, 5: 2})  # the prompts are not counted


def head_cases():
    mx.random.seed(0)
    linear = nn.Linear(16, 40)
    embedding = nn.Embedding(40, 64)
    qlinear = nn.QuantizedLinear.from_linear(nn.Linear(64, 40, bias=False), group_size=32, bits=4)
    qembedding = nn.QuantizedEmbedding.from_embedding(nn.Embedding(40, 64), group_size=32, bits=4)
    return {"linear+bias": (linear, linear, 16), "tied embedding": (embedding, embedding.as_linear, 64),
            "4-bit linear": (qlinear, qlinear, 64), "4-bit tied embedding": (qembedding, qembedding.as_linear, 64)}


class _Stub(Target):
    """A Target whose output head is `module` (only the head matters here)."""

    def __init__(self, module):
        self._module = module

    def _head_module(self):
        return self._module


@pytest.mark.parametrize("case", list(head_cases()))
def test_head_rows_compute_exactly_those_columns_of_the_full_head(case):
    module, full_head, dims = head_cases()[case]
    ids = mx.array([39, 0, 17, 5, 22], dtype=mx.int32)
    x = mx.random.normal((2, 3, dims))
    got = _Stub(module).output_head_rows(ids)(x)
    np.testing.assert_allclose(np.array(got), np.array(full_head(x))[..., np.array(ids)], rtol=1e-5, atol=1e-5)


def test_head_rows_of_an_unknown_head_is_none_and_the_drafter_falls_back(pair):
    class Odd(nn.Module):
        def __call__(self, x):
            return x

    assert _Stub(Odd()).output_head_rows(mx.array([1])) is None
    _, _, drafter = pair
    drafter._borrowed.head_rows = lambda ids: None  # a target whose head cannot be sliced
    vocab = [49151, 3, 1000, 77]
    drafter.set_draft_vocab(vocab)
    hidden = mx.random.normal((1, 5, drafter.config.hidden_size))
    np.testing.assert_allclose(np.array(drafter.draft_logits(hidden)), np.array(drafter.logits(hidden))[..., vocab],
                               rtol=1e-5, atol=1e-5)


def test_drafts_are_the_argmax_inside_the_draft_vocabulary(pair):
    target, tokenizer, drafter = pair
    ids = chat_ids(tokenizer, "Say hello.")
    cache, context = target.make_cache(), None
    _, context = target.prefill(mx.array(ids), cache)
    block = mx.array([[ids[-1]] + [drafter.mask_token_id] * 7])
    full = np.array(drafter.logits(drafter.hidden(block, context, drafter.make_cache())[:, 1:]))[0]
    best = set(full.argmax(-1).tolist())
    vocab = np.array([t for t in range(49151, 0, -3) if t not in best])  # without the full argmaxes
    drafter.set_draft_vocab(vocab)
    draft = drafter.draft([ids[-1]], [context], drafter.make_cache(), 8, 8, [SamplingParams()]).row(0)
    want = vocab[np.argmax(full[:, vocab], axis=-1)]
    assert draft.tokens == want.tolist()
    assert not set(want.tolist()) & best
    confidence = np.array(draft.confidence)
    restricted = np.exp(full[:, vocab] - full[:, vocab].max(-1, keepdims=True))
    np.testing.assert_allclose(confidence, (restricted / restricted.sum(-1, keepdims=True)).max(-1), rtol=1e-4)
    # The replay used for acceptance proposes the same tokens.
    anchors = mx.array([len(ids) - 1])
    got, _ = block_drafts(drafter, context, block, anchors)
    assert np.array(got)[0].tolist() == want.tolist()


@pytest.mark.parametrize("width", [3, 8])
def test_decoding_with_a_draft_vocabulary_is_lossless(pair, width):
    target, tokenizer, drafter = pair
    drafter.set_draft_vocab(np.arange(0, 49152, 7))
    for prompt in ("Say hello.", "Count to ten."):
        ids = chat_ids(tokenizer, prompt)
        want = mlx_lm_greedy(target.model, ids, 30)
        stop = next((i for i, t in enumerate(want) if t in tokenizer.eos_token_ids), len(want))
        out = generate(target, drafter, tokenizer, ids, max_tokens=30, width=width)
        tokens, stats = out.tokens, out.stats
        assert tokens == want[:stop] and stats.rounds + stats.plain_steps > 0


def test_bad_draft_vocabularies_are_refused(pair):
    _, _, drafter = pair
    for bad, match in (([], "non-empty 1-D"), ([[1, 2]], "non-empty 1-D"), ([0.5], "non-empty 1-D"),
                       ([1, 49152], "outside the vocabulary"), ([3, 4, 3], "twice")):
        with pytest.raises(DFlashError, match=match):
            drafter.set_draft_vocab(bad)


def test_convert_stores_the_vocabulary_and_loading_checks_it(pair, tmp_path):
    target, _, drafter = pair
    save_checkpoint(drafter, tmp_path / "src", state=None)
    data = write_responses(tmp_path / "r.jsonl", [[5, 5, 5, 9, 9, 2], [9, 2, 2, 2, 2]])
    out = convert_drafter(tmp_path / "src", tmp_path / "v3", draft_vocab=3, vocab_data=data)
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab"] == 3
    loaded = drafter_from_dir(out)
    assert loaded.draft_vocab.tolist() == [2, 5, 9]
    # Converting again keeps it; --draft-vocab 0 drops it.
    assert drafter_from_dir(convert_drafter(out, tmp_path / "again")).draft_vocab.tolist() == [2, 5, 9]
    dropped = convert_drafter(out, tmp_path / "dropped", draft_vocab=0)
    assert drafter_from_dir(dropped).draft_vocab is None
    assert "draft_vocab" not in json.loads((dropped / "config.json").read_text())
    # A hand-edited directory: config and tensor disagree.
    config["draft_vocab"] = 4
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match="holds 3 ids but config.json's draft_vocab is 4"):
        drafter_from_dir(out)
    config["draft_vocab"] = 3
    (out / "config.json").write_text(json.dumps(config))
    weights = mx.load(str(out / "model.safetensors"))
    weights.pop(DRAFT_VOCAB_KEY)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    with pytest.raises(DFlashError, match="sets draft_vocab 3 but the weights have no draft_vocab_ids"):
        drafter_from_dir(out)
    with pytest.raises(DFlashError, match="go together"):
        convert_drafter(tmp_path / "src", tmp_path / "x", draft_vocab=3)


def test_cli_convert_draft_vocab(pair, tmp_path):
    _, _, drafter = pair
    save_checkpoint(drafter, tmp_path / "src", state=None)
    data = write_responses(tmp_path / "r.jsonl", [[5, 6, 7, 8]])
    run = CliRunner().invoke(main, ["convert", "--drafter", str(tmp_path / "src"), "--out", str(tmp_path / "o"),
                                    "--draft-vocab", "2", "--vocab-data", str(data)])
    assert run.exit_code == 0, run.output
    assert drafter_from_dir(tmp_path / "o").draft_vocab.tolist() == [5, 6]
    run = CliRunner().invoke(main, ["convert", "--model", "x", "--out", str(tmp_path / "m"), "--draft-vocab", "2"])
    assert run.exit_code != 0 and "apply to --drafter conversions only" in run.output


def test_dflash2_drafters_refuse_a_draft_vocabulary():
    from dflash2_tiny import tiny_config

    config = parse_config(tiny_config(), where="test")
    drafter = init_drafter(config, seed=0)
    with pytest.raises(DFlashError, match="DFlash v1 drafters only"):
        drafter.set_draft_vocab([1, 2])
