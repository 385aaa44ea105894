"""The engine report: what served a generation (our kernels or MLX's per shape bin, the drafter or plain
steps), in the statistics, in `generate --verbose` and in the server's `dflash` object; every fallback a
note on stderr (once per process) and in the statistics; the pitfalls checked before generating.

Metal is faked on the CPU as in test_metal_kernels.py and test_metal_verify_attention.py: reported
available, our kernels replaced by MLX's own computation, the race gate timed by a fixed timer."""

import itertools
import json
import re

import mlx.core as mx
import mlx.nn as nn
import pytest
from click.testing import CliRunner

from mlx_dflash import machine, pitfalls
from mlx_dflash.decoding import engine_report
from mlx_dflash.cli import main as cli
from mlx_dflash.generate import generate
from mlx_dflash.kernels import attention as attn
from mlx_dflash.kernels import wide_qmm
from metal_fakes import FixedTimer, head_dim_64_pair
from mlx_dflash.kernels.race_gate import RaceGate
from mlx_dflash.models.target import Target
from mlx_dflash.policies.width import WidthPolicy, has_quantized_layers, make_policy
from mlx_dflash.server.protocol import Outcome

PROMPT = [5, 17, 42, 99, 3, 150, 7, 61, 88, 23, 11, 190] * 2  # a prefill of more than 16 rows: MLX's, by design
NOT_QUANTIZED = "MLX's matmul (the target is not quantized)"
NO_METAL_SDPA = "MLX's SDPA (no Metal: our attention kernel runs on Apple GPUs)"


@pytest.fixture(autouse=True)
def fresh_announcements(monkeypatch):
    monkeypatch.setattr(engine_report, "_announced", set())


def fake_metal(monkeypatch, tmp_path, ours_s=1e-3, mlx_s=2e-3, qmm=None):
    """Metal reported available to both kernels, each computed by MLX's own function (or `qmm`), and one
    race gate timing ours at ours_s and MLX's at mlx_s."""
    gate = RaceGate(tmp_path / "verdicts.json", timer=FixedTimer(ours_s, mlx_s))
    for module in (wide_qmm, attn, engine_report):
        monkeypatch.setattr(module, "metal_available", lambda: True)
    monkeypatch.setattr(wide_qmm, "shared_gate", lambda: gate)
    monkeypatch.setattr(attn, "shared_gate", lambda: gate)
    monkeypatch.setattr(wide_qmm, "wide_quantized_matmul", qmm or (
        lambda x, w, s, b, gs, bits, threads=None: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits)))
    monkeypatch.setattr(attn, "multi_row_attention", lambda q, k, v, scale, keys, lengths, threads, sees: (
        attn.reference_attention(q, k, v, scale, keys, lengths, sees)))


def run(target, drafter, tokenizer, **kwargs):
    if not drafter.is_bound:
        drafter.bind(target)
    policy = kwargs.pop("policy", None) or make_policy(
        drafter.block_size, quantized=has_quantized_layers(target.model), wide_kernels=target.wide_kernels)
    return generate(target, drafter, tokenizer, PROMPT, max_tokens=12, policy=policy, **kwargs)


def test_without_metal_every_verify_is_mlxs(tiny_chat_pair):
    target, tokenizer, drafter = tiny_chat_pair
    stats = run(target, drafter, tokenizer).stats
    assert stats.verify_paths == {"matmul": NOT_QUANTIZED, "attention": NO_METAL_SDPA}
    assert stats.routes == [] and stats.notes == []
    assert stats.plain_steps == 0 and stats.rounds - 1 <= stats.drafted_rounds <= stats.rounds
    lines = stats.summary(verbose=True).splitlines()
    assert f"verify matmul: {NOT_QUANTIZED}" in lines and f"verify attention: {NO_METAL_SDPA}" in lines
    assert lines[-3].startswith(f"drafter: drafted in {stats.drafted_rounds} of {stats.rounds} verify rounds; "
                                "plain target steps: 0")
    assert "verify matmul" not in stats.summary()  # the short summary stays as it was


@pytest.mark.parametrize("ours_s,mlx_s,route,who", [(1e-3, 2e-3, "dflash", "ours"), (3e-3, 2e-3, "mlx", "MLX's")])
def test_each_shape_bin_as_the_race_decided(monkeypatch, tmp_path, tiny_chat_pair, ours_s, mlx_s, route, who):
    _, tokenizer, _ = tiny_chat_pair
    target, drafter = head_dim_64_pair()
    expected = run(target, drafter, tokenizer)  # no Metal: MLX's path
    fake_metal(monkeypatch, tmp_path, ours_s, mlx_s)
    assert target.install_wide_kernels() > 0 and target.install_attention_kernel() == 4
    text = run(target, drafter, tokenizer)
    assert text == expected and text.tokens == expected.tokens  # the stand-ins compute what MLX does
    stats = text.stats
    assert stats.verify_paths["matmul"].startswith("ours for 6..16 rows in ")
    assert stats.verify_paths["attention"] == ("ours for 2..16 rows in 4 attention modules (where the race gate "
                                               "picks it), MLX's SDPA otherwise")
    assert {e["kernel"] for e in stats.routes} == {"wide_qmm", "mr_attention"}
    reason = f"race gate: ours {ours_s * 1e3:.3g} ms, MLX's {mlx_s * 1e3:.3g} ms"
    assert all(e["route"] == route and e["reason"] == reason and not e["fallback"] for e in stats.routes)
    # Verify widths only: neither the 1-row steps nor the 24-row prefill.
    assert {int(e["bin"].rsplit("rows", 1)[1]) for e in stats.routes} <= set(stats.widths) - {1}
    qmm = next(e for e in stats.routes if e["bin"] == "wide_qmm float32 K128xN256 gs64 b4 rows8")
    assert qmm["calls"] == 4 * stats.widths[8]  # q_proj of each layer, once per 8-row verify
    lines = stats.summary(verbose=True).splitlines()
    assert f"route: wide_qmm float32 K128xN256 gs64 b4 rows8: {who}, {qmm['calls']} calls ({reason})" in lines
    assert any(line.startswith("route: mr_attention float32 B1 Hq4 Hkv1 D64 keys<=32 rows8") for line in lines)
    assert stats.notes == []
    speculative = Outcome("stop", len(PROMPT), stats.generated_tokens, stats).speculative()
    assert speculative["routes"] == stats.routes and speculative["verify"] == stats.verify_paths
    assert speculative["drafted_rounds"] == stats.drafted_rounds and speculative["plain_steps"] == 0
    assert json.loads(json.dumps(speculative)) == speculative


def test_a_kernel_that_disagrees_is_a_fallback_noted_once(monkeypatch, tmp_path, tiny_chat_pair, capsys):
    _, tokenizer, _ = tiny_chat_pair
    target, drafter = head_dim_64_pair()

    def wrong(x, w, s, b, gs, bits, threads=None):
        return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits) + 1.0

    fake_metal(monkeypatch, tmp_path, qmm=wrong)
    target.install_wide_kernels()
    first, second = run(target, drafter, tokenizer).stats, run(target, drafter, tokenizer).stats
    note = next(n for n in first.notes if n.startswith("note: verify matmul: MLX's quantized matmul instead of ours "
                                                       "(race gate: ours disagreed with MLX's (relative error"))
    assert note in second.notes
    assert all(e["route"] == "mlx" and e["fallback"] for e in first.routes if e["kernel"] == "wide_qmm")
    assert capsys.readouterr().err.count(note) == 1  # on stderr once per process, in every generation's stats


def test_attention_our_kernel_cannot_take_is_a_fallback(monkeypatch, tmp_path, tiny_chat_pair):
    target, tokenizer, drafter = tiny_chat_pair  # head dim 16
    fake_metal(monkeypatch, tmp_path)
    routed = Target(target.model, target.layer_ids)
    assert routed.install_attention_kernel() == 4
    stats = run(routed, drafter, tokenizer, policy=make_policy(drafter.block_size)).stats
    assert stats.verify_paths["attention"].startswith("ours for 2..16 rows in 4 attention modules")
    assert stats.routes and all(e["route"] == "mlx" and e["fallback"] for e in stats.routes)
    assert {e["kernel"] for e in stats.routes} == {"mr_attention"}
    assert stats.notes == ["note: verify attention: MLX's SDPA instead of ours (head dim 16 not in (64, 128); the "
                           "shape bins are in the routes)"]


def test_quantized_layers_our_kernel_does_not_take(monkeypatch, tmp_path, tiny_chat_pair):
    target, _ = head_dim_64_pair(bits=3)
    fake_metal(monkeypatch, tmp_path)
    assert target.install_wide_kernels() == 0
    paths, notes = engine_report.verify_paths(target)
    assert paths["matmul"] == "MLX's quantized matmul (no layer our wide kernel takes)"
    assert notes == ["note: verify matmul: MLX's quantized matmul in 29 of 29 quantized layers: our wide kernel "
                     "takes affine 4/8-bit layers with group size 32/64/128 only"]
    assert paths["attention"].startswith("MLX's SDPA (our attention kernel not installed")


def test_plain_steps_and_a_drafter_that_does_not_pay(tiny_chat_pair, capsys):
    target, tokenizer, drafter = tiny_chat_pair
    calls = itertools.count()

    class Skipping(WidthPolicy):  # as --width auto once drafting paid less than the target alone
        drafting_loses = True

        def plain_steps(self, remaining):  # 3 plain steps, once, the first time 3 tokens are left
            return 3 if remaining >= 3 and next(calls) == 0 else 0

    stats = run(target, drafter, tokenizer, policy=Skipping(block_size=8, max_width=8)).stats
    assert stats.plain_steps == 3 and stats.drafted_rounds >= stats.rounds - 1  # plain steps are no verify rounds
    assert stats.modes["plain"] == 3 and sum(stats.accepted_lengths.values()) == stats.rounds  # verify rounds only
    assert stats.generated_tokens == 1 + stats.plain_steps + sum(n * c for n, c in stats.accepted_lengths.items())
    assert stats.notes == [engine_report.DRAFTING_NOTE]
    assert capsys.readouterr().err.splitlines() == [engine_report.DRAFTING_NOTE]
    assert "plain target steps: 3;" in stats.summary(verbose=True)


def test_generate_verbose_prints_the_engine_report(monkeypatch, tiny_chat_pair):
    target, tokenizer, drafter = tiny_chat_pair
    monkeypatch.setattr("mlx_dflash.pair.load", lambda model=None, drafter_=None: (target, drafter, tokenizer))
    result = CliRunner().invoke(cli, ["generate", "--prompt", "Hi", "--max-tokens", "8", "--verbose"])
    assert result.exit_code == 0, result.output
    err = result.stderr.splitlines()
    assert f"verify matmul: {NOT_QUANTIZED}" in err and f"verify attention: {NO_METAL_SDPA}" in err
    assert any(re.fullmatch(r"drafter: drafted in \d+ of \d+ verify rounds; plain target steps: \d+; verify rounds "
                            r"with no draft: \d+", line) for line in err)
    plain = CliRunner().invoke(cli, ["generate", "--prompt", "Hi", "--max-tokens", "8"])
    assert plain.exit_code == 0 and "verify matmul" not in plain.output


# Pitfalls.

def test_float16_quantized_on_m1_m2_is_warned(monkeypatch, tiny_chat_pair):
    target, drafter = head_dim_64_pair()
    drafter.bind(target)
    assert pitfalls.float16_warning(target, drafter) is None  # not an M1/M2
    monkeypatch.setattr(pitfalls, "m1_or_m2", lambda: True)
    monkeypatch.setattr(pitfalls, "chip_name", lambda: "applegpu_g13s")
    assert pitfalls.float16_warning(target, drafter) is None  # float32 activations
    target.model.set_dtype(mx.float16)
    warning = pitfalls.float16_warning(target, drafter)
    assert warning == ("warning: the quantized target runs in float16 on this M1/M2 GPU (applegpu_g13s), where DFlash "
                       "acceptance has been seen to collapse: convert it with `mlx-dflash convert --dtype bfloat16` "
                       "(or float32)")
    nn.quantize(drafter, group_size=64, bits=4, class_predicate=lambda _, m: isinstance(m, nn.Linear)
                and m.weight.shape[-1] % 64 == 0)
    drafter.set_dtype(mx.float16)
    assert "the quantized target and drafter run in float16" in pitfalls.float16_warning(target, drafter)
    target.model.set_dtype(mx.bfloat16)
    assert pitfalls.float16_warning(target, drafter) is None  # bfloat16 activations meet the drafter's float16


def test_quantized_or_half_precision_on_the_cpu_is_warned(tiny_chat_pair):
    _, _, plain_drafter = tiny_chat_pair
    assert mx.default_device() == mx.cpu
    target, drafter = head_dim_64_pair()
    warning = pitfalls.cpu_dtype_warning(target, drafter)
    assert warning.startswith("warning: the target is quantized, which MLX's CPU backend runs several times slower")
    assert "`mlx-dflash convert --model SRC --out DIR --dtype float32`" in warning and "\n" not in warning
    nn.quantize(drafter, group_size=64, bits=4, class_predicate=lambda _, m: isinstance(m, nn.Linear)
                and m.weight.shape[-1] % 64 == 0)
    assert "the target is quantized and the drafter is quantized" in pitfalls.cpu_dtype_warning(target, drafter)
    half, _ = head_dim_64_pair(bits=None)
    assert pitfalls.cpu_dtype_warning(half, plain_drafter) is None  # float32
    half.model.set_dtype(mx.float16)
    assert "the target runs in float16" in pitfalls.cpu_dtype_warning(half, plain_drafter)


def test_m1_or_m2_from_the_architecture(monkeypatch):
    monkeypatch.setattr(machine, "metal_available", lambda: True)
    for arch, expected in (("applegpu_g13g", True), ("applegpu_g14d", True), ("applegpu_g15s", False),
                           ("applegpu_g17s", False)):
        monkeypatch.setattr(machine, "chip_name", lambda arch=arch: arch)
        assert machine.m1_or_m2() is expected
    monkeypatch.setattr(machine, "metal_available", lambda: False)
    assert machine.m1_or_m2() is False


class TemplateTokenizer:
    """SmolLM2's special token 16, written by this chat template."""

    chat_template = "{{ '<empty_output>' }}"
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 2
    added_tokens_decoder = {16: type("AddedToken", (), {"content": "<empty_output>"})()}

    def __len__(self):
        return 49152


def test_mask_tokens_outside_the_reserved_range(tiny_chat_pair):
    _, tokenizer, _ = tiny_chat_pair  # SmolLM2's: 49152 tokens, specials 0..16
    vocab = 49152
    assert pitfalls.mask_token_problem(16, tokenizer, vocab) is None  # <empty_output>: what `train` picks
    assert pitfalls.mask_token_problem(vocab - 1, tokenizer, vocab) is None  # pick_mask_token's fallback
    assert pitfalls.mask_token_problem(2, tokenizer, vocab) == "is the target's EOS token"
    assert pitfalls.mask_token_problem(1, tokenizer, vocab) == "is the target's BOS token"
    assert "is an ordinary token of the target's vocabulary" in pitfalls.mask_token_problem(500, tokenizer, vocab)
    assert pitfalls.mask_token_problem(16, TemplateTokenizer(), vocab) == ("('<empty_output>') is a token the target's "
                                                                          "chat template writes")

    class Drafter:
        mask_token_id = 500

    warning = pitfalls.mask_token_warning(Drafter(), tokenizer, vocab)
    assert warning.startswith("warning: the drafter's mask token 500 (") and "\n" not in warning
    assert "use the drafter made for this target" in warning and "mlx-dflash train" in warning


def test_generate_prints_the_pitfalls_before_generating(monkeypatch, tiny_chat_pair):
    target, tokenizer, drafter = tiny_chat_pair
    monkeypatch.setattr("mlx_dflash.pair.load", lambda model=None, drafter_=None: (target, drafter, tokenizer))
    monkeypatch.setattr(pitfalls, "mask_token_problem", lambda *a: "is the target's EOS token")
    monkeypatch.setattr(machine, "slow_blas_warning", lambda: None)
    result = CliRunner().invoke(cli, ["generate", "--prompt", "Hi", "--max-tokens", "4"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0].startswith(f"warning: the drafter's mask token {drafter.mask_token_id} is "
                                                    "the target's EOS token")
    assert result.stderr.count("mask token") == 1
