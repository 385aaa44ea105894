"""Bad input is refused with one clear line: configs, drafter directories, model pairs, the CLI."""

import json
import re

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import ArraysCache, KVCache

from mlx_dflash.cli import main
from mlx_dflash.models.config import build_target_layer_ids, parse_config
from mlx_dflash.models.loader import drafter_from_dir, init_drafter
from mlx_dflash.errors import DFlashError
from mlx_dflash.models.target import Target

BASE = dict(
    architectures=["DFlashDraftModel"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=100, rms_norm_eps=1e-6,
    max_position_embeddings=256, num_target_layers=6,
)


def config(**overrides):
    cfg = json.loads(json.dumps(BASE))
    cfg.update(overrides)
    return cfg


# Config layouts.

def test_old_layout_top_level_block_size_and_rope_theta():
    c = parse_config(config(block_size=10, rope_theta=5e5, dflash_config=dict(mask_token_id=99, target_layer_ids=[1, 3])))
    assert (c.block_size, c.rope_theta, c.target_layer_ids, c.mask_token_id) == (10, 5e5, (1, 3), 99)
    assert c.layer_types == ("full_attention", "full_attention") and not c.layer_is_causal(0)


def test_new_layout_nested_block_size_and_rope_parameters():
    c = parse_config(config(
        rope_parameters=dict(rope_theta=1e6, rope_type="default"),
        layer_types=["sliding_attention", "full_attention"], sliding_window=64,
        dflash_config=dict(block_size=8, mask_token_id=7, target_layer_ids=[2, 4], output_multiplier=0.5,
                           final_logit_softcapping=20.0, input_embedding_scale=2.0),
    ))
    assert (c.block_size, c.rope_theta, c.rope_scaling) == (8, 1e6, None)
    assert c.layer_is_causal(0) and not c.layer_is_causal(1)  # sliding layers are causal by default
    assert c.layer_window(0) == 64 and c.layer_window(1) is None
    assert (c.output_multiplier, c.final_logit_softcapping, c.input_embedding_scale) == (0.5, 20.0, 2.0)


def test_is_causal_overrides_and_layer_id_fallback():
    c = parse_config(config(is_causal=False, layer_types=["sliding_attention"] * 2, sliding_window=32,
                            dflash_config=dict(mask_token_id=1)))
    assert not c.layer_is_causal(0)
    assert c.target_layer_ids == tuple(build_target_layer_ids(6, 2)) == (1, 3)
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # the published Qwen3-8B choice


@pytest.mark.parametrize("cfg, words", [
    (config(), "mask_token_id"),
    (config(architectures=["DFlash2DraftModel"], dflash_config=dict(mask_token_id=1)), "DFlash 2"),
    (config(layer_types=["full_attention"], dflash_config=dict(mask_token_id=1)), "layer_types"),
    (config(layer_types=["linear_attention"] * 2, dflash_config=dict(mask_token_id=1)), "unsupported"),
    (config(layer_types=["sliding_attention"] * 2, dflash_config=dict(mask_token_id=1)), "sliding_window"),
    ({k: v for k, v in config(dflash_config=dict(mask_token_id=1)).items() if k != "hidden_size"}, "hidden_size"),
])
def test_bad_configs_are_refused_by_name(cfg, words):
    with pytest.raises(DFlashError, match=words):
        parse_config(cfg)


# Drafter directories.

def write_drafter(path, cfg, weights):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), weights)


def drafter_weights(cfg):
    return dict(tree_flatten(init_drafter(parse_config(cfg), seed=0).parameters()))


GOOD = config(dflash_config=dict(block_size=4, mask_token_id=99, target_layer_ids=[1, 3]))


def test_drafter_loads_strictly_and_drops_borrowed_keys(tmp_path):
    weights = drafter_weights(GOOD)
    assert len(weights) == 3 + 11 * 2  # fc, hidden_norm, norm + 11 per layer: what z-lab's loader loads
    extra = dict(weights, **{"embed_tokens.weight": mx.zeros((100, 64)), "lm_head.weight": mx.zeros((100, 64))})
    write_drafter(tmp_path / "d", GOOD, extra)
    loaded = drafter_from_dir(tmp_path / "d")
    for name, value in tree_flatten(loaded.parameters()):
        assert mx.array_equal(value, weights[name]), name


@pytest.mark.parametrize("change, words", [
    (lambda w: w.pop("layers.1.mlp.up_proj.weight"), "missing layers.1.mlp.up_proj.weight"),
    (lambda w: w.update({"layers.0.extra.weight": mx.zeros(3)}), "unexpected layers.0.extra.weight"),
    (lambda w: w.update({"fc.weight": mx.zeros((64, 64))}), "fc.weight .* shape"),
])
def test_mismatched_weights_name_the_key(tmp_path, change, words):
    weights = drafter_weights(GOOD)
    change(weights)
    write_drafter(tmp_path / "d", GOOD, weights)
    with pytest.raises(DFlashError, match=words):
        drafter_from_dir(tmp_path / "d")


def test_pickle_weights_and_missing_files_are_refused(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(DFlashError, match="no config.json"):
        drafter_from_dir(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps(GOOD))
    (tmp_path / "d" / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    (tmp_path / "d" / "dflash.py").write_text("raise SystemExit('remote code must never run')")
    with pytest.raises(DFlashError, match="pickle"):
        drafter_from_dir(tmp_path / "d")


# Model pairs.

def tiny_target(layers=6, hidden=64, vocab=100):
    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return Target(model)


@pytest.mark.parametrize("cfg_change, words", [
    (dict(hidden_size=128), "hidden_size 128 != target hidden size 64"),
    (dict(vocab_size=120), "vocab_size 120 != target vocabulary 100"),
    (dict(dflash_config=dict(mask_token_id=100, target_layer_ids=[1, 3])), "mask_token_id 100 is outside"),
    (dict(dflash_config=dict(mask_token_id=5, target_layer_ids=[1, 6])), "reach layer 6, but the target has 6"),
])
def test_mismatched_pair_is_refused_naming_both_values(cfg_change, words):
    cfg = dict(GOOD, **cfg_change)
    if "hidden_size" in cfg_change:
        cfg["head_dim"] = 32
    drafter = init_drafter(parse_config(cfg))
    with pytest.raises(DFlashError, match=words):
        drafter.bind(tiny_target())


def test_target_that_cannot_roll_back_is_refused():
    class Recurrent(llama.Model):
        def make_cache(self):
            return [ArraysCache(size=2)] + [KVCache() for _ in self.layers[1:]]

    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=2, rms_norm_eps=1e-5, vocab_size=50)
    with pytest.raises(DFlashError, match="cannot be rolled back .*ArraysCache"):
        Target(Recurrent(args))


def test_capture_returns_the_chosen_layer_outputs_in_order():
    target = tiny_target()
    target.layer_ids = (4, 1)
    ids = mx.array([[3, 14, 15, 92, 65]])
    _, features = target.forward(ids, None)
    # Recompute layer outputs by hand.
    inner = target.model.model
    h, outs = inner.embed_tokens(ids), []
    for layer in inner.layers:
        h = layer(h, "causal", None)
        outs.append(h)
    want = mx.concatenate([outs[4], outs[1]], axis=-1)
    assert mx.allclose(features, want, atol=1e-5)
    assert all(not hasattr(layer, "_sink") for layer in inner.layers)  # recorders removed again


# CLI.

def test_cli_errors_are_one_line_and_nonzero(tmp_path):
    runner = CliRunner()
    cases = [
        ["generate", "--model", str(tmp_path / "missing"), "--drafter", str(tmp_path), "--prompt", "hi"],
        ["generate", "--model", str(tmp_path), "--prompt", "hi"],
        ["convert", "--out", str(tmp_path / "o")],
        ["train", "--prompts", str(tmp_path / "none.jsonl"), "--data", str(tmp_path / "d.jsonl"),
         "--out", str(tmp_path)],
    ]
    for args in cases:
        result = runner.invoke(main, args)
        assert result.exit_code == 1, (args, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.output)
        assert "Traceback" not in result.output


def one_line_error(args) -> str:
    """The CLI's error line for `args` (exit status 1, nothing else printed)."""
    result = CliRunner().invoke(main, args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), (args, result.output)
    return lines[0]


@pytest.mark.parametrize("prompt", ["", "   \n\t"])
def test_an_empty_prompt_is_refused_before_anything_loads(tmp_path, prompt):
    line = one_line_error(["generate", "--model", str(tmp_path / "not-loaded"), "--prompt", prompt])
    assert line == "error: --prompt is empty: give the text to answer (or - to read it from stdin)"


@pytest.mark.parametrize("seed", ["-5", str(2**64), str(2**70)])
def test_a_seed_mlx_cannot_take_is_refused_naming_the_flag(tmp_path, seed):
    line = one_line_error(["generate", "--model", str(tmp_path / "not-loaded"), "--prompt", "hi", "--seed", seed])
    assert line == f"error: --seed must be an integer from 0 to 2**64 - 1, got {seed}"


def test_the_python_api_refuses_a_bad_seed_naming_the_keyword(tiny_chat_pair):
    from mlx_dflash.generate import generate

    target, tokenizer, drafter = tiny_chat_pair
    with pytest.raises(DFlashError, match=r"^seed must be an integer from 0 to 2\*\*64 - 1, got -1$"):
        generate(target, drafter, tokenizer, [1, 2, 3], max_tokens=2, seed=-1)


@pytest.mark.parametrize("keywords, said", [
    (dict(temp=-1), "temp must be >= 0, got -1"),
    (dict(top_k=-2), "top_k must be >= 0 (0 disables it), got -2"),
    (dict(temperature=0.5), "no generation keyword 'temperature': the keywords are temp, top_p, top_k"),
    (dict(sampler=lambda logits: logits), "sampler= takes a function that draws a token"),
    (dict(width=4, policy=object()), "policy= is a width policy built already"),
    (dict(prefill_step_size=0), "prefill_step_size must be at least 1, got 0"),
])
@pytest.mark.parametrize("call", ["generate", "batch_generate"])
def test_the_python_api_refuses_bad_keywords_in_one_line(tiny_chat_pair, keywords, said, call):
    from mlx_dflash.decoding.batch_decoder import batch_generate
    from mlx_dflash.generate import generate

    target, tokenizer, drafter = tiny_chat_pair
    with pytest.raises(DFlashError) as refused:
        if call == "generate":
            generate(target, drafter, tokenizer, [1, 2, 3], max_tokens=2, **keywords)
        else:
            batch_generate(target, drafter, tokenizer, [[1, 2, 3]], max_tokens=2, **keywords)
    assert str(refused.value).startswith(said), refused.value


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_a_port_out_of_range_is_refused_naming_the_flag(tmp_path, port):
    line = one_line_error(["serve", "--model", str(tmp_path / "not-loaded"), "--port", port])
    assert line == f"error: --port must be from 0 to 65535 (0: any free port), got {port}"


@pytest.mark.parametrize("flags, said", [
    (["--temp", "-1"], "error: --temp must be >= 0, got -1.0"),
    (["--top-p", "0"], "error: --top-p must be in (0, 1], got 0.0"),
    (["--top-k", "-2"], "error: --top-k must be >= 0 (0 disables it), got -2"),
    (["--min-p", "1"], "error: --min-p must be in [0, 1) (0 disables it), got 1.0"),
    (["--max-tokens", "0"], "error: --max-tokens must be at least 1, got 0"),
    (["--p-min", "1"], "error: --p-min must be in [0, 1), got 1.0"),
    (["--n-min", "-1"], "error: --n-min must be at least 0 (drafted tokens), got -1"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_sampling_and_draft_flags_are_named_as_typed(tmp_path, flags, said, command):
    args = ["--prompt", "hi"] if command == "generate" else []
    line = one_line_error([command, "--model", str(tmp_path / "not-loaded"), *args, *flags])
    assert line.startswith(said), line


def test_a_prompt_cache_file_in_a_missing_folder_is_refused_before_any_work(tmp_path):
    path = tmp_path / "no-such-folder" / "cache.safetensors"
    line = one_line_error(["generate", "--model", str(tmp_path / "not-loaded"), "--prompt", "hi",
                           "--prompt-cache-file", str(path)])
    assert line == (f"error: --prompt-cache-file {path}: no folder {path.parent}: create it, or name a file in an "
                    "existing folder")


def test_a_prompt_cache_file_that_is_not_one_is_left_alone(tmp_path, tiny_pair_dirs):
    target, drafter = tiny_pair_dirs
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    line = one_line_error(["generate", "--model", str(target), "--drafter", str(drafter), "--prompt", "hi",
                           "--max-tokens", "2", "--prompt-cache-file", str(notes)])
    assert line.startswith(f"error: --prompt-cache-file {notes} is a file that is not an mlx-dflash prompt cache")
    assert notes.read_text() == "my notes\n"
    kept = tmp_path / "kept.safetensors"  # a cache of ours is taken and written again
    for _ in range(2):
        result = CliRunner().invoke(main, ["generate", "--model", str(target), "--drafter", str(drafter), "--prompt",
                                           "hi", "--max-tokens", "2", "--prompt-cache-file", str(kept)])
        assert result.exit_code == 0 and f"prompt cache: kept in {kept}" in result.stderr, result.output


def test_a_missing_model_path_is_named_before_any_drafter_rule(tmp_path):
    missing = tmp_path / "no-such-model"
    line = one_line_error(["generate", "--model", str(missing), "--prompt", "hi"])
    assert line == f"error: target model {missing}: no such directory (and not a Hugging Face repo id)"


def test_n_max_past_the_drafters_block_is_named_as_given(tiny_pair_dirs):
    target, drafter = tiny_pair_dirs
    line = one_line_error(["generate", "--model", str(target), "--drafter", str(drafter), "--prompt", "hi",
                           "--n-max", "20"])
    assert line.startswith("error: --n-max 20 is out of range: this drafter drafts blocks of 16 rows")
    assert "--n-max 0..15" in line


def test_a_prompt_longer_than_the_context_is_refused_before_any_work(tmp_path, monkeypatch):
    import importlib

    from conftest import save_tiny_pair

    generate = importlib.import_module("mlx_dflash.generate")  # the module (the package exports the function)
    policy = importlib.import_module("mlx_dflash.policies.dcut")

    def no_work(*args, **kwargs):
        raise AssertionError("work began before the prompt was checked against the context")

    monkeypatch.setattr(policy, "probe_batch_costs", no_work)  # --width auto's start-up probe
    monkeypatch.setattr(generate, "Scheduler", no_work)  # the prompt's read
    target, drafter = save_tiny_pair(tmp_path, max_position_embeddings=64)
    line = one_line_error(["generate", "--model", str(target), "--drafter", str(drafter), "--width", "auto",
                           "--prompt", "Tell me about the sea. " * 20])
    assert re.fullmatch(r"error: the prompt is \d+ tokens and the target's context is 64 "
                        r"\(max_position_embeddings\): shorten the prompt", line), line


@pytest.mark.slow
def test_a_quantized_copy_of_the_default_target_runs_with_the_shipped_drafter(smollm2_path, tmp_path):
    """No --drafter: the pair check decides (the shipped drafter fits the copy), not the path."""
    from mlx_lm.convert import convert

    copy = tmp_path / "smollm2-4bit"
    convert(str(smollm2_path), str(copy), quantize=True, q_bits=4, q_group_size=64)
    result = CliRunner().invoke(main, ["generate", "--model", str(copy), "--prompt", "What is 2 + 2?",
                                       "--max-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() and re.search(r"finish: (length|stop)", result.stderr)
    assert "quantized model without wide kernels: verify width clamped from 16 to 5" in result.stderr
