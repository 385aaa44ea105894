"""bench/oracle.py (the oracle-ceiling benchmark) and bench/zlab_peer.py (z-lab's MLX backend as a peer row
in bench/e2e.py): the oracle drafter, z-lab's loop on a tiny random pair, the summary arithmetic; the slow
tier runs both benchmarks end to end at smoke size on the real SmolLM2."""

import json
import math
import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import e2e  # noqa: E402
import oracle  # noqa: E402
import zlab_peer  # noqa: E402
from conftest import tiny_llama  # noqa: E402
from conftest import chat_ids  # noqa: E402
from mlx_dflash.models.loader import drafter_config_for, init_drafter  # noqa: E402
from mlx_dflash.errors import DFlashError  # noqa: E402
from mlx_dflash.models.target import Target  # noqa: E402

PROMPT = "What is 17 times 23? Show your steps."


# The oracle drafter.

def test_oracle_reads_its_position_from_the_context_rows(tiny_chat_pair):
    target, _, drafter = tiny_chat_pair
    orc = oracle.OracleDrafter(drafter.config, block_size=8).bind(target)
    orc.set_continuation(5, list(range(100, 130)))
    orc.make_cache()
    rows = lambda n: mx.zeros((1, n, 4))  # noqa: E731 (only the row count matters)
    assert orc.draft([7], [rows(5)], None, 8, 4, [None]).row(0).tokens == [101, 102, 103]  # anchor = generated token 0
    assert orc.draft([7], [None], None, 8, 2, [None]).row(0).tokens == [101]  # no new context: same position
    assert orc.draft([7], [rows(3)], None, 8, 5, [None]).row(0).tokens == [104, 105, 106, 107]  # 3 rows accepted
    assert orc.draft([7], [rows(27)], None, 8, 3, [None]).row(0).tokens == [0, 0]  # past the continuation
    assert orc.draft_calls == 4 and orc.draft_seconds > 0
    assert orc.is_bound and orc.block_size == 8 and orc.mask_token_id == drafter.mask_token_id
    fresh = Target(target.model)
    oracle.OracleDrafter(drafter.config, block_size=8).bind(fresh)
    assert fresh.layer_ids == tuple(drafter.config.target_layer_ids)  # the features a real pair's verify makes


@pytest.mark.parametrize("width", [1, 3, 8])
def test_oracle_run_is_the_target_alone_with_every_draft_accepted(tiny_chat_pair, width):
    target, tokenizer, drafter = tiny_chat_pair
    ids, n = chat_ids(tokenizer, PROMPT), 17
    want = e2e.run_target_alone(target.model, tokenizer, ids, n)
    continuation = oracle.greedy_continuation(target.model, ids, n + 8)
    assert continuation[: len(want["tokens"])] == want["tokens"]
    orc = oracle.OracleDrafter(drafter.config, block_size=8).bind(target)
    got = oracle.run_oracle(target, orc, tokenizer, ids, continuation, width, n)
    assert got["tokens"] == want["tokens"]
    assert want["finish_reason"] == got["finish_reason"] == "length"
    # every round emits `width` tokens (the last: what is left); at width 1 they are plain steps
    assert got["rounds"] + got["plain_steps"] == math.ceil((n - 1) / width)
    assert got["draft_calls"] == sum(n for w, n in got["widths"].items() if int(w) > 1)  # width 1: no draft
    assert max((int(w) for w in got["widths"]), default=1) == width
    assert got["t_draft"] < 0.01  # a list slice


# z-lab's loop (the published file, from PyPI) on a tiny random pair of its own.

@pytest.fixture(scope="module")
def zlab_tiny(tiny_chat_pair, tmp_path_factory):
    """z-lab's module, its drafter loaded from a saved tiny drafter directory (with a borrowed head tensor
    it has no name for), and a tiny target of its own."""
    from mlx_dflash.tuner.trainer import save_checkpoint

    _, tokenizer, _ = tiny_chat_pair
    model = tiny_llama(11)
    drafter = init_drafter(drafter_config_for(Target(model), num_layers=1, block_size=8, num_target_features=2),
                           seed=3)
    folder = tmp_path_factory.mktemp("tiny-drafter") / "drafter"
    save_checkpoint(drafter, folder, state=None)
    weights = mx.load(str(folder / "model.safetensors"))
    weights["lm_head.weight"] = mx.zeros((4, 64))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    module = zlab_peer.import_model_mlx()
    draft, dropped = zlab_peer.load_zlab_drafter(module, folder)
    return module, model, draft, tokenizer, dropped


def test_zlab_drafter_loads_from_a_local_directory_only(zlab_tiny):
    module, _, draft, _, dropped = zlab_tiny
    assert dropped == ["lm_head.weight"]
    assert draft.config.block_size == 8 and len(draft.layers) == 1
    with pytest.raises(DFlashError, match="only local drafter directories"):
        module.load_draft("z-lab/Qwen3-8B-DFlash-b16")
    assert "zlab_dflash_model_mlx" not in sys.modules and "dflash" not in sys.modules


@pytest.mark.parametrize("width", [2, 8])
def test_zlab_loop_matches_the_target_alone(zlab_tiny, width):
    module, model, draft, tokenizer, _ = zlab_tiny
    ids, n = chat_ids(tokenizer, PROMPT), 17
    want = e2e.run_target_alone(model, tokenizer, ids, n)
    got = zlab_peer.run_zlab(module, model, draft, tokenizer, ids, n, width)
    assert got["tokens"] == want["tokens"]
    assert got["generated_tokens"] == want["generated_tokens"]
    assert got["rounds"] == sum(got["widths"].values()) == sum(got["accepted_lengths"].values())
    assert max(int(w) for w in got["widths"]) <= width
    # tau: tokens per verify round, all tokens but the prefill's
    assert got["tau"] == pytest.approx((got["generated_tokens"] - 1) / got["rounds"])
    assert got["decode_tps"] > 0


def test_zlab_loop_on_a_quantized_target_matches_it_alone(zlab_tiny):
    import mlx.nn as nn

    module, _, draft, tokenizer, _ = zlab_tiny
    model = tiny_llama(11)
    nn.quantize(model, group_size=64, bits=4)  # before z-lab's first call, as load_zlab_target does
    ids, n = chat_ids(tokenizer, PROMPT), 12
    want = e2e.run_target_alone(model, tokenizer, ids, n)
    got = zlab_peer.run_zlab(module, model, draft, tokenizer, ids, n, 4)
    assert got["tokens"] == want["tokens"]
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)


# The summaries.

def test_oracle_summary_arithmetic():
    runs = []
    for prompt, (t1, tv2, tps2, td) in enumerate([(0.10, 0.12, 12.0, 0.001), (0.20, 0.24, 6.0, 0.002)]):
        runs += [{"kind": "target", "prompt": prompt, "width": None, "t1": t1, "decode_tps": 1 / t1},
                 {"kind": "oracle", "prompt": prompt, "width": 2, "decode_tps": tps2, "t_draft": td},
                 {"kind": "verify", "prompt": prompt, "width": 2, "seconds": tv2}]
    runs.append({"kind": "verify", "prompt": 0, "width": 2, "seconds": 0.5, "repeat": 1})  # a repeat: median
    (row,) = oracle.summarize(runs, [2])
    # prompt 0: verify median(0.12, 0.5) = 0.31; ideal 2 / 0.311; prompt 1: ideal 2 / 0.242
    eff = sorted([12.0 / (2 / 0.311), 6.0 / (2 / 0.242)])
    assert row["efficiency"] == pytest.approx(sum(eff) / 2)
    assert row["ideal_speedup"] == pytest.approx((2 * 0.10 / 0.31 + 2 * 0.20 / 0.24) / 2)
    assert row["measured_speedup"] == pytest.approx((12.0 / 10.0 + 6.0 / 5.0) / 2)
    assert row["prompts"] == 2 and row["t_draft"] == pytest.approx(0.0015)
    assert "| 2 |" in oracle.markdown_table([row])


def test_versus_zlab_takes_the_best_fixed_widths():
    def row(name, kind, tps, phase="float"):
        return {"name": name, "kind": kind, "phase": phase, "decode_tps_median": tps}

    summary = [row("target alone", "target", 10.0), row("width 2", "dflash", 12.0), row("width 4", "dflash", 13.0),
               row("width auto", "dflash", 14.0), row("z-lab width 2", "zlab", 11.0),
               row("z-lab width 4", "zlab", 10.0), row("width 2", "dflash", 5.0, "q4")]
    got = e2e.versus_zlab(summary)
    assert list(got) == ["float"]  # no z-lab rows on q4
    v = got["float"]
    assert v["zlab_best_fixed"] == "z-lab width 2" and v["best_fixed"] == "width 4"
    assert v["auto_over_zlab_best"] == pytest.approx(14 / 11)
    assert v["best_fixed_over_zlab_best"] == pytest.approx(13 / 11)
    assert e2e.auto_vs_best_fixed(summary)["float"]["best_fixed"] == "width 4"  # z-lab rows are not ours


def test_peer_rows_follow_our_widths_capped_by_the_block():
    names = [r["name"] for r in e2e.configurations(5, peer=True) if r["kind"] == "zlab"]
    assert names == ["z-lab width 2", "z-lab width 4", "z-lab width 5"]
    assert not [r for r in e2e.configurations(16) if r["kind"] == "zlab"]


def test_peer_left_out_with_a_message_unless_asked_for(monkeypatch):
    def unreachable():
        raise DFlashError("pip download dflash==0.1.0 failed: no network")

    monkeypatch.setattr(e2e, "import_model_mlx", unreachable)
    said, pairs = [], {"float": {}}
    info = e2e.add_peer(pairs, "model", "drafter", 0, None, said.append)
    assert not info["used"] and "no network" in info["reason_left_out"] and pairs == {"float": {}}
    assert "z-lab peer left out" in said[0] and "--no-peer" in said[0]
    with pytest.raises(DFlashError, match="no network"):
        e2e.add_peer(pairs, "model", "drafter", 0, True, said.append)
    assert not e2e.add_peer(pairs, "model", "drafter", 0, False, said.append)["used"] and len(said) == 1


# End to end at smoke size on the real pair (slow).

@pytest.mark.slow
def test_e2e_with_the_peer_runs_end_to_end(smollm2_path, tmp_path):
    assert e2e.main(["--num-prompts", "1", "--max-tokens", "8", "--warmup-tokens", "4", "--peer",
                     "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "e2e.json").read_text())
    peer = [s for s in results["summary"] if s["kind"] == "zlab"]
    assert [s["name"] for s in peer] == [f"z-lab width {w}" for w in (2, 4, 5, 8, 16)]
    assert all(s["identical"] == s["checked"] == 1 for s in peer)
    assert results["versus_zlab"]["float"]["auto_over_zlab_best"] > 0
    assert results["settings"]["peer"]["used"] and results["mismatches"] == 0


@pytest.mark.slow
def test_oracle_runs_end_to_end(smollm2_path, tmp_path):
    assert oracle.main(["--num-prompts", "1", "--max-tokens", "9", "--widths", "1", "2", "4",
                        "--verify-repeats", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "oracle.json").read_text())
    assert [r["width"] for r in results["summary"]] == [1, 2, 4]
    assert all(r["efficiency"] > 0 and r["ideal_speedup"] > 0 for r in results["summary"])
    assert all(r["identical"] for r in results["runs"] if r["kind"] == "oracle") and results["mismatches"] == 0
    assert "| 4 |" in (tmp_path / "oracle.md").read_text()
