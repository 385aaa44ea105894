"""The drafter that ships in the package for the default target (SmolLM2-135M-Instruct).

It must load strictly from the package, stay small, keep decoding lossless at every block size while
really accepting drafts, and make `mlx-dflash generate --prompt ...` work with no model arguments.
"""

import mlx.core as mx
import pytest
from click.testing import CliRunner

from conftest import PROMPTS, WORD_PROBLEMS, chat_ids, mlx_lm_greedy
from mlx_dflash.cli import main
from mlx_dflash.tuner.data import greedy_batch
from mlx_dflash.decoding.batch_decoder import speculative_rounds
from mlx_dflash.models.loader import drafter_from_dir
from mlx_dflash.downloads import shipped_drafter_dir
from mlx_dflash.policies.width import DraftControls, make_policy
from mlx_dflash.decoding.sampling import SamplingParams
from mlx_dflash.models.target import Target
from mlx_dflash.tuner.replay import decoding_acceptance

@pytest.fixture(scope="module")
def pair(smollm2):
    target = Target(smollm2[0].model)  # own Target: the session fixture's layer choice stays as it is
    return target, drafter_from_dir(shipped_drafter_dir()).bind(target), smollm2[1]


def test_default_drafter_ships_small_in_bf16():
    path = shipped_drafter_dir()
    assert path is not None and (path / "config.json").exists()
    files = sorted(p.name for p in path.iterdir())
    assert files == ["config.json", "model.safetensors"], files
    assert (path / "model.safetensors").stat().st_size < 20 * 2**20
    weights = mx.load(str(path / "model.safetensors"))
    vocab = weights.pop("draft_vocab_ids")  # its draft vocabulary (token ids)
    assert weights and all(v.dtype == mx.bfloat16 for v in weights.values())
    assert vocab.dtype == mx.int32 and len(set(vocab.tolist())) == vocab.size == drafter_from_dir(path).draft_vocab.size


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_default_pair_is_lossless_and_accepts(pair, block_size):
    target, drafter, tokenizer = pair
    # Prompt lookup off: every draft kept is then the drafter's own.
    policy = make_policy(drafter.block_size, block_size, controls=DraftControls(prompt_lookup=False))
    accepted = 0
    for prompt in PROMPTS[:4]:
        ids = chat_ids(tokenizer, prompt)
        want = mlx_lm_greedy(target.model, ids, 24)
        rounds = list(speculative_rounds(target, drafter, mx.array(ids), policy, SamplingParams(), 24))
        assert [t for r in rounds for t in r.tokens] == want, (block_size, prompt)
        assert not any(r.looked_up for r in rounds)
        accepted += sum(r.accepted for r in rounds)
    assert accepted > 0  # the drafter's drafts really are kept, so the partial-acceptance paths run


def test_default_pair_acceptance_on_word_problems(pair):
    """A floor well below the measured tau (README), to catch a broken or mismatched shipped drafter."""
    target, drafter, tokenizer = pair
    prompts = [chat_ids(tokenizer, p) for p in WORD_PROBLEMS]
    responses = greedy_batch(target.model, tokenizer, prompts, 64)
    sequences = [(p + r, len(p)) for p, r in zip(prompts, responses)]
    result = decoding_acceptance(drafter, target, sequences, widths=(16,))[16]
    assert result["tau"] > 1.4, result  # measured 2.03 here; an untrained drafter gives ~1.0


def test_generate_needs_no_model_arguments(smollm2):
    target, tokenizer = smollm2
    prompt = PROMPTS[10]
    result = CliRunner().invoke(main, ["generate", "--prompt", prompt, "--max-tokens", "24"])
    assert result.exit_code == 0, result.output
    want = tokenizer.decode(mlx_lm_greedy(target.model, chat_ids(tokenizer, prompt), 24))
    assert want.strip() and want.strip() in result.output
