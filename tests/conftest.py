"""Shared fixtures: the real SmolLM2-135M-Instruct target (from PyPI, converted and cached) and drafters for it."""

import mlx.core as mx
import pytest

from mlx_dflash.drafter import drafter_config_for, init_drafter
from mlx_dflash.models import ensure_smollm2
from mlx_dflash.target import Target

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
        from mlx_dflash.kernels import metal_available

        if not metal_available():
            pytest.skip("needs Metal: mx.metal.is_available() is False on this machine")
    if item.get_closest_marker("emulator"):
        from metal_emulator import unavailable_reason

        reason = unavailable_reason()
        if reason:
            pytest.skip(f"needs the Metal emulator: {reason}")
