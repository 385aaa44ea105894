"""The width benchmark: the cliff rule, the cost table, and quick real runs on a tiny quantized model."""

import json
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama

from mlx_dflash.machine import quantized_matmul_routing
from mlx_dflash.policies.cliff import cliff_width, find_jumps
from mlx_dflash.bench_widths import model_shapes, run_widths_bench
from mlx_dflash.policies.verify_costs import filled_cache, load_cost_table
from mlx_dflash.errors import DFlashError
from mlx_dflash.kernels.wide_qmm import metal_available
from mlx_dflash.plot import bar_chart_figure, widths_figure
from mlx_dflash.models.target import Target

W = list(range(1, 17))


# The cliff rule on synthetic curves.

def test_linear_curve_has_no_cliff():
    assert cliff_width(W, [0.02 + 0.1 * w for w in W]) is None
    assert cliff_width(W, [0.5 + 1e-4 * w for w in W]) is None  # nearly flat: the floor keeps it quiet


def test_step_at_6_is_the_cliff():
    assert cliff_width(W, [0.01 + 0.001 * w + (0.01 if w >= 6 else 0) for w in W]) == 6


def test_metal_like_staircase_and_sdpa_step():
    # qmv_wide: one weight pass per 5 rows -> steps at 6, 11, 16 (the last width has nothing to confirm it).
    assert find_jumps(W, [1.0 * (1 + (w - 1) // 5) for w in W]) == [6, 11]
    assert find_jumps(W + [17], [1.0 * (1 + (w - 1) // 5) for w in W + [17]]) == [6, 11, 16]
    # qmv_wide 1 pass up to 5, 2 passes 6..8, then the padded attention tile from 9.
    assert find_jumps(W, [1.0 if w < 6 else 1.6 if w < 9 else 2.5 for w in W]) == [6, 9]


def test_noisy_linear_has_no_cliff():
    rng = np.random.default_rng(1)
    for _ in range(50):
        t = [0.02 + 0.1 * w + rng.uniform(-0.01, 0.01) for w in W]  # +-10% of the per-row cost
        assert cliff_width(W, t) is None


def test_single_spike_is_not_a_cliff():
    t = [0.1 * w for w in W]
    t[-1] += 1.0  # the last width cannot be confirmed
    assert cliff_width(W, t) is None
    t[-1] -= 1.0
    t[7] += 1.0  # width 8 hit by contention once
    assert cliff_width(W, t) is None
    t[8] += 1.0  # ... and width 9: two in a row, but back on the line at 10
    assert cliff_width(W, t) is None


def test_curve_errors():
    with pytest.raises(ValueError):
        cliff_width([1, 2, 3], [1.0, 2.0])
    with pytest.raises(ValueError):
        cliff_width([1, 3, 2], [1.0, 2.0, 3.0])


# The cost table.

def test_cost_table_round_trip(tmp_path):
    path = tmp_path / "cost_table.json"
    path.write_text(json.dumps({"widths": [1, 2, 3], "verify_seconds": [0.01, 0.02, 0.035],
                                "source": "test", "machine": {"chip": "x"}}))
    assert load_cost_table(path) == {1: 0.01, 2: 0.02, 3: 0.035}


@pytest.mark.parametrize("content, words", [
    (None, "no such file"),
    ("{not json", "not a readable JSON"),
    ("[1, 2]", "'widths' and 'verify_seconds'"),
    ('{"widths": [1, 2], "verify_seconds": [0.1]}', "equal length"),
    ('{"widths": [1, 1], "verify_seconds": [0.1, 0.2]}', "distinct integers"),
    ('{"widths": [0, 1], "verify_seconds": [0.1, 0.2]}', "distinct integers"),
    ('{"widths": [1.5, 2], "verify_seconds": [0.1, 0.2]}', "distinct integers"),
    ('{"widths": [1, 2], "verify_seconds": [0.1, -0.2]}', "positive finite"),
    ('{"widths": [1, 2], "verify_seconds": [0.1, "fast"]}', "positive finite"),
])
def test_cost_table_bad_files(tmp_path, content, words):
    path = tmp_path / "cost_table.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DFlashError, match=words):
        load_cost_table(path)


# Real runs on a tiny quantized model.

@pytest.fixture(scope="module")
def tiny_model():
    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                           tie_word_embeddings=True)
    model = llama.Model(args)
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


def check_png(path):
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 300
    assert len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 3  # something was drawn


def test_quick_run_writes_all_files(tiny_model, tmp_path):
    res = run_widths_bench(tiny_model, tmp_path, widths=range(1, 9), short_cache=16, long_cache=4096,
                           log=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cost_table.json", "widths.json", "widths.png"]
    data = json.loads((tmp_path / "widths.json").read_text())
    assert {"schema", "date", "machine", "versions", "settings", "cliff_rule", "series", "cliff",
            "cost_table"} <= data.keys()
    assert data["machine"]["chip"] and data["versions"]["mlx"] == mx.__version__ and data["versions"]["mlx_lm"]
    kinds = {s["kind"] for s in data["series"]}
    assert kinds == {"matmul", "matmul_total", "verify"}
    for s in data["series"]:
        assert s["widths"] == list(range(1, 9)) and len(s["median_seconds"]) == 8
        if s["kind"] != "matmul_total":  # every repeat kept, both clocks
            assert all(len(r) == 3 and min(r) > 0 for r in s["wall_seconds"] + s["cpu_seconds"])
        assert s["clock"] == ("wall" if metal_available() else "cpu")
        assert data["cliff"][s["name"]] == s["cliff_width"]
    shapes = {(s["K"], s["N"]) for s in data["series"] if s["kind"] == "matmul"}
    assert shapes == {(128, 128), (128, 64), (128, 256), (256, 128)}
    table = json.loads((tmp_path / "cost_table.json").read_text())
    assert {"widths", "verify_seconds", "source", "machine"} <= table.keys()
    assert load_cost_table(tmp_path / "cost_table.json") == dict(zip(range(1, 9), table["verify_seconds"]))
    assert table["cache_length"] == 16
    impls = {s["impl"] for s in data["series"]}
    assert impls == ({"mlx", "dflash"} if metal_available() else {"mlx"})
    check_png(tmp_path / "widths.png")
    assert res["cost_table"] == table


def test_model_shapes_count_layers_and_tied_head(tiny_model):
    shapes = {(s["K"], s["N"]): s["count"] for s in model_shapes(tiny_model)}
    # q/o: 128->128 (x2 layers), k/v: 128->64, gate/up: 128->256, down: 256->128, tied head: 128->256 vocab.
    assert shapes == {(128, 128): 4, (128, 64): 4, (128, 256): 5, (256, 128): 2}


def test_long_cache_is_really_long(tiny_model, tmp_path):
    cache = filled_cache(Target(tiny_model), 4096)
    assert all(c.offset == 4096 and c.keys.shape[2] >= 4096 for c in cache)
    res = run_widths_bench(tiny_model, tmp_path, widths=[1, 2, 3, 4], short_cache=32, long_cache=4096,
                           repeats=2, warmup=1, log=None)
    verify = {s["cache_length"]: s for s in res["series"] if s["kind"] == "verify"}
    assert sorted(verify) == [32, 4096]
    assert verify[4096]["cache_offsets"] == [4096] and verify[32]["cache_offsets"] == [32]
    assert res["cost_table"]["by_cache_length"]["4096"] == verify[4096]["median_seconds"]


@pytest.mark.slow  # real timings: a loaded machine can bend the line
@pytest.mark.skipif(metal_available(), reason="the CPU has no cliff; on Metal there is one to find")
def test_cpu_matmul_is_linear_without_cliff(tmp_path):
    res = run_widths_bench(None, tmp_path, shapes=["1024x1024"], repeats=5, log=None)
    (s,) = [s for s in res["series"] if s["kind"] == "matmul"]
    assert s["cliff_width"] is None and s["verdict"].startswith("no cliff: linear"), s["verdict"]
    assert s["linear_fit"]["r2"] > 0.95 and s["linear_fit"]["seconds_per_row"] > 0
    assert res["cost_table"]["cliff_width"] is None
    check_png(tmp_path / "widths.png")


def test_widths_chart_has_axes_legend_and_cliff():
    widths = list(range(1, 11))
    stepped = [0.010 + 0.001 * w + (0.02 if w >= 6 else 0.0) for w in widths]
    series = [{"name": "verify cache=128 mlx", "kind": "verify", "widths": widths, "median_seconds": stepped,
               "cliff_width": cliff_width(widths, stepped)},
              {"name": "matmul total mlx", "kind": "matmul_total", "widths": widths, "cliff_width": None,
               "median_seconds": [0.002 * w for w in widths]}]
    results = {"series": series, "settings": {"widths": widths, "clock": "cpu"},
               "machine": {"chip": "Apple M3 Max", "device": "Device(gpu, 0)"}, "versions": {"mlx": "0.32.4"}}
    ax = widths_figure(results).axes[0]
    assert "width" in ax.get_xlabel() and "ms" in ax.get_ylabel() and "Apple M3 Max" in ax.get_title()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["verify forward, cache=128 mlx (cliff at 6)", "quantized matmuls, summed mlx (no cliff)"]
    assert [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == ":"] == [5.5]  # the cliff


def test_bar_chart_labels_values_and_reference():
    ax = bar_chart_figure(["width 2", "width auto"], {"float": [1.25, 0.9], "4-bit": [None, 1.1]},
                          title="ratio", reference=1.0).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["width 2", "width auto"]
    values = sorted(t.get_text() for t in ax.texts if t.get_text())
    assert values == ["0.90", "1.10", "1.25"]  # a missing value draws no bar and no label
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["1 (reference)", "4-bit", "float"]


def test_line_chart_draws_each_curve_with_its_label():
    from mlx_dflash.plot import line_chart_figure

    ax = line_chart_figure({"text": ([0, 0.1, 0.2], [1.7, 1.8, 1.9]), "answers": ([0.05, 0.2], [1.7, 1.75])},
                           "CPU-hours", "held-out tau").axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("CPU-hours", "held-out tau")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["text", "answers"]
    assert [list(line.get_ydata()) for line in ax.lines] == [[1.7, 1.8, 1.9], [1.7, 1.75]]


def test_without_matplotlib_the_json_is_still_written(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    run_widths_bench(tiny_model, tmp_path, widths=[1, 2, 3], short_cache=8, repeats=1, warmup=0, log=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cost_table.json", "widths.json"]


@pytest.mark.parametrize("arch, words", [
    (None, "CPU: every row costs the same"), ("applegpu_g14g", "M1/M2: no affine qmv_wide"),
    ("applegpu_g13s", "from 10 rows"), ("applegpu_g15s", "once per up to 5 rows"), ("applegpu_g16g", "13-15 rows"),
    ("applegpu_g14d", "18 rows (Ultra)"), ("applegpu_g17s", "25 rows (M5)")])
def test_quantized_matmul_routing_per_chip(arch, words):
    assert words in quantized_matmul_routing(arch)


@pytest.mark.parametrize("kwargs, words", [
    (dict(model_path=None), "give a model or a list of shapes"),
    (dict(model_path=None, shapes=["64by64"]), "bad shape"),
    (dict(model_path=None, shapes=["64x64"], clock="gpu"), "clock must be"),
    (dict(model_path=None, shapes=["64x64"], widths=[0, 1]), "widths must be"),
    (dict(model_path=None, shapes=["64x64"], dtype="int8"), "dtype must be"),
])
def test_bad_arguments(tmp_path, kwargs, words):
    with pytest.raises(DFlashError, match=words):
        run_widths_bench(out_dir=tmp_path, log=None, **kwargs)


def test_our_kernels_are_measured_where_they_run(tiny_model, tmp_path, monkeypatch):
    """The Metal path (ours against MLX's), with a CPU stand-in for the wide kernel."""
    import mlx_dflash.bench_widths as bench
    import mlx_dflash.kernels.wide_qmm as kernels

    rows = []

    def stand_in(x, w, scales, biases, group_size, bits, threads=None):
        rows.append(x.size // x.shape[-1])
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)

    for mod in (bench, kernels):
        monkeypatch.setattr(mod, "metal_available", lambda: True)
        monkeypatch.setattr(mod, "wide_quantized_matmul", stand_in)
    res = run_widths_bench(tiny_model, tmp_path, widths=range(4, 8), short_cache=16, long_cache=64, repeats=2,
                           warmup=0, log=None)
    names = {s["name"] for s in res["series"]}
    assert {"matmul total dflash", "verify cache=16 dflash", "verify cache=64 mlx"} <= names
    assert sorted(set(rows)) == [6, 7]  # only 6..16 rows go to our kernel
    table = res["cost_table"]
    assert table["impl"] == "dflash" and table["clock"] == "wall" and table["cache_length"] == 16
    assert not any(isinstance(m, kernels.WideQuantizedLinear) for _, m in tiny_model.named_modules())


def test_default_run_is_short_and_shows_what_it_measures(tiny_model, tmp_path, capsys):
    res = run_widths_bench(tiny_model, tmp_path, widths=[1, 2, 3], short_cache=8, log=lambda *_: None)
    settings = res["settings"]
    assert (settings["full"], settings["repeats"], settings["warmup"]) == (False, 3, 1)
    assert sorted({s["cache_length"] for s in res["series"] if s["kind"] == "verify"}) == [8]  # no long cache
    bars = capsys.readouterr().err  # tqdm, one bar per phase, naming it
    assert "quantized matmul, 4 shapes x widths 1..3" in bars and "verify forward, cache 8" in bars
    assert res["machine"]["chip"] and res["machine"]["quantized_matmul_routing"]
    assert res["cost_table"]["machine"]["chip"] == res["machine"]["chip"]


# What a cost table records, and the warning when it does not fit the target.

def test_the_cost_table_records_the_dtype_quantization_and_chip_it_was_measured_with(tiny_model, tmp_path):
    from mlx_dflash.machine import machine_info

    table = run_widths_bench(tiny_model, tmp_path, widths=[1, 2], short_cache=8, repeats=1, warmup=0,
                             log=None)["cost_table"]
    assert (table["dtype"], table["quantization"]) == ("float32", {"bits": 4, "group_size": 64})
    assert table["machine"]["chip"] == machine_info()["chip"]
    synthetic = run_widths_bench(None, tmp_path, shapes=["64x64"], widths=[1, 2], repeats=1, warmup=0,
                                 quantize_bits=8, group_size=32, dtype="bfloat16", log=None)["cost_table"]
    assert (synthetic["dtype"], synthetic["quantization"]) == ("bfloat16", {"bits": 8, "group_size": 32})


@pytest.mark.parametrize("bits, quantization", [(None, None), (8, {"bits": 8, "group_size": 64})])
def test_bench_widths_measures_the_model_as_stored_unless_bits_are_given(tiny_pair_dirs, tmp_path, bits,
                                                                         quantization):
    from click.testing import CliRunner

    from mlx_dflash.cli import main

    target, _ = tiny_pair_dirs
    result = CliRunner().invoke(main, ["bench", "widths", "--model", str(target), "--max-width", "2", "--short-cache",
                                       "8", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]
                                + (["--bits", str(bits)] if bits else []))
    assert result.exit_code == 0, result.output
    table = json.loads((tmp_path / "cost_table.json").read_text())
    assert (table["dtype"], table["quantization"]) == ("float32", quantization)
    settings = json.loads((tmp_path / "widths.json").read_text())["settings"]
    assert settings.get("quantized_in_memory", False) == bool(bits)
    weights = "float weights" if bits is None else "8-bit weights (group 64)"
    assert f"cost table: float32 activations, {weights}, chip {table['machine']['chip']}" in result.stdout


def write_table(path, **fields):
    from mlx_dflash.machine import machine_info

    table = {"widths": [1, 2, 4], "verify_seconds": [0.01, 0.012, 0.016], "dtype": "float32", "quantization": None,
             "machine": {"chip": machine_info()["chip"]}, **fields}
    path.write_text(json.dumps({k: v for k, v in table.items() if v != "absent"}))
    return path


def auto_notes(pair, table) -> list:
    from mlx_dflash.policies.dcut import build_policy
    from mlx_dflash.policies.width import WidthOptions

    target, _, drafter = pair
    return [n for n in build_policy(target, drafter, WidthOptions("auto", cost_table=table)).notes if "cost table" in n]


def test_a_cost_table_that_fits_the_target_says_only_where_costs_come_from(tiny_chat_pair, tmp_path):
    table = write_table(tmp_path / "fits.json")
    assert auto_notes(tiny_chat_pair, table) == [f"width auto: verify costs from cost table {table}, refined as rounds run"]


def test_a_cost_table_for_another_precision_or_chip_is_warned_of_naming_each_difference(tiny_chat_pair, tmp_path):
    from mlx_dflash.machine import machine_info

    table = write_table(tmp_path / "other.json", dtype="float16", quantization={"bits": 4, "group_size": 64},
                        machine={"chip": "Apple M9 Max"})
    warning, said = auto_notes(tiny_chat_pair, table)
    assert warning == (f"warning: cost table {table} was measured with float16 activations (this target: float32); "
                       "4-bit weights (group 64) (this target: float weights); chip Apple M9 Max (this machine: "
                       f"{machine_info()['chip']}); re-run `mlx-dflash bench widths --model` with this model on this "
                       "machine and pass that table")
    assert said.startswith("width auto: verify costs from cost table")
    only_bits = write_table(tmp_path / "bits.json", quantization={"bits": 8, "group_size": 32})
    (warning, _) = auto_notes(tiny_chat_pair, only_bits)
    assert "8-bit weights (group 32) (this target: float weights); re-run" in warning
    assert "activations" not in warning and "chip" not in warning


def test_an_old_cost_table_is_said_not_to_record_what_it_was_measured_with(tiny_chat_pair, tmp_path):
    table = write_table(tmp_path / "old.json", dtype="absent", quantization="absent")
    warning, _ = auto_notes(tiny_chat_pair, table)
    assert warning.startswith(f"warning: cost table {table} does not record the dtype, quantization and chip it was "
                              "measured with")
    assert warning.endswith("re-run `mlx-dflash bench widths --model` with this model on this machine and pass that table")


def test_generate_prints_the_cost_table_warning(tiny_pair_dirs, tmp_path):
    from click.testing import CliRunner

    from mlx_dflash.cli import main

    target, drafter = tiny_pair_dirs
    table = write_table(tmp_path / "q4.json", quantization={"bits": 4, "group_size": 64})
    result = CliRunner().invoke(main, ["generate", "--model", str(target), "--drafter", str(drafter), "--prompt", "hi",
                                       "--max-tokens", "3", "--width", "auto", "--cost-table", str(table)])
    assert result.exit_code == 0, result.output
    assert f"warning: cost table {table} was measured with 4-bit weights (group 64) (this target: float weights)" in result.stderr


def test_bench_widths_batch_writes_one_table_that_one_request_and_a_batch_both_read(tiny_pair_dirs, tmp_path):
    """One cost-table format: `--batch` adds rows x width to cost_table.json, whose one-row costs stay as they are."""
    from click.testing import CliRunner

    from mlx_dflash.policies.width import WidthOptions

    from mlx_dflash.cli import main
    from mlx_dflash.pair import load
    from mlx_dflash.policies.dcut import build_policy
    from mlx_dflash.policies.verify_costs import batch_costs, load_cost_table, read_cost_table

    target_dir, drafter_dir = tiny_pair_dirs
    result = CliRunner().invoke(main, ["bench", "widths", "--model", str(target_dir), "--max-width", "3", "--short-cache",
                                       "8", "--repeats", "1", "--warmup", "0", "--batch", "1,2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    path = tmp_path / "cost_table.json"
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["cost_table.json", "widths.json"]
    table = json.loads(path.read_text())
    assert sorted(table["batch_verify_seconds"]) == ["1", "2"] and table["widths"] == [1, 2, 3]
    rows = batch_costs(read_cost_table(path))
    assert sorted(rows) == [1, 2] and sorted(rows[2]) == [1, 2, 3] and sorted(load_cost_table(path)) == [1, 2, 3]
    target, drafter, _ = load(str(target_dir), str(drafter_dir))
    assert build_policy(target, drafter, WidthOptions("auto"), 2, rows).guessed[2][3] == rows[2][3]


def test_bench_widths_context_axis_gives_the_policy_its_costs_by_context(tiny_pair_dirs, tmp_path):
    """`bench widths --context` measures each length, says where the best width goes, draws it beside the cost
    curves, and its table costs --width auto by context with no probe."""
    from click.testing import CliRunner

    from mlx_dflash.cli import main
    from mlx_dflash.policies.dcut import build_policy
    from mlx_dflash.policies.width import WidthOptions
    from mlx_dflash.pair import load

    target_dir, drafter_dir = tiny_pair_dirs
    result = CliRunner().invoke(main, ["bench", "widths", "--model", str(target_dir), "--max-width", "4", "--context",
                                       "512,16,128", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    table = json.loads((tmp_path / "cost_table.json").read_text())
    assert sorted(map(int, table["by_cache_length"])) == [16, 128, 512] and table["cache_length"] == 16
    best = json.loads((tmp_path / "widths.json").read_text())["best_width_by_context"]
    assert set(best) == {"0.5", "0.7", "0.9"} and all(sorted(map(int, row)) == [16, 128, 512] for row in best.values())
    assert "best width at acceptance 0.9:" in result.output
    check_png(tmp_path / "widths.png")
    target, drafter, _ = load(str(target_dir), str(drafter_dir))
    policy = build_policy(target, drafter, WidthOptions("auto", cost_table=tmp_path / "cost_table.json"))
    assert policy.context_costs.prober is None and sorted(policy.context_costs.by_context) == [16, 128, 512]
    policy.at_context(512)
    measured = dict(zip(table["widths"], table["by_cache_length"]["512"]))
    short = dict(zip(table["widths"], table["by_cache_length"]["16"]))
    assert policy.growth[4] == pytest.approx(max(1.0, measured[4] / short[4]))


@pytest.mark.parametrize("flags, message", [(["--context", "256,abc"], "give context lengths as numbers"),
                                            (["--context", "16,64", "--long-cache", "99"], "replaces --long-cache"),
                                            (["--context", "0,64"], "lengths >= 1")])
def test_bench_widths_refuses_a_bad_context_list(flags, message):
    from click.testing import CliRunner

    from mlx_dflash.cli import main

    result = CliRunner().invoke(main, ["bench", "widths", "--shape", "64x64"] + flags)
    assert result.exit_code != 0 and message in result.output, result.output


def test_a_cost_table_with_bad_context_rows_is_refused(tmp_path):
    from mlx_dflash.policies.verify_costs import read_cost_table

    path = write_table(tmp_path / "t.json", by_cache_length={"256": [0.01, 0.02]})
    with pytest.raises(DFlashError, match="by_cache_length"):
        read_cost_table(path)
    assert read_cost_table(write_table(tmp_path / "u.json", by_cache_length={"256": [0.01, 0.02, 0.03]}))
