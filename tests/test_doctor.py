"""`mlx-dflash doctor` on Linux: the report's fields and its JSON against tests/doctor.schema.json; the Mac
checks with Metal faked (a stand-in kernel that agrees with MLX's, one that does not, one that fails to
compile); the exit status; the BLAS detection and its one-line warning in `generate` and `serve`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import mlx.core as mx
import pytest
from click.testing import CliRunner

from mlx_dflash import doctor, machine
from mlx_dflash.decoding import engine_report
from mlx_dflash.cli import main as cli
from mlx_dflash.kernels import attention as attn
from mlx_dflash.kernels import checks
from mlx_dflash.kernels import wide_qmm
from metal_fakes import FixedTimer
from mlx_dflash.kernels.race_gate import RaceGate

SCHEMA = json.loads((Path(__file__).parent / "doctor.schema.json").read_text())
LINUX = sys.platform.startswith("linux")
QMM = [(6, 128, 96, 64, 4, "float32"), (16, 256, 64, 32, 8, "float32")]
ATTENTION = [(2, 1, 4, 64, 40, "float32"), (16, 2, 2, 128, 300, "float32"), (4, 1, 2, 64, 90, "float32", (90, 50, 7)),
             (8, 1, 2, 64, 60, "float32", (60, 30), "tree")]
BUNDLED = "mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"


def validate(report: dict):
    jsonschema.validate(report, SCHEMA, format_checker=jsonschema.FormatChecker())


@pytest.fixture
def quick(monkeypatch, tiny_chat_pair):
    """The doctor on the tiny pair (as if given with --model) and a small sweep shape: seconds, not a minute."""
    target, tokenizer, drafter = tiny_chat_pair
    monkeypatch.setattr("mlx_dflash.pair.load", lambda model=None, drafter_=None: (target, drafter, tokenizer))
    monkeypatch.setattr(doctor, "SWEEP_SHAPES", {True: "256x256", False: "256x256"})
    monkeypatch.setattr(engine_report, "_announced", set())


def by_name(report: dict) -> dict:
    return {c["name"]: c for c in report["checks"]}


def test_the_report_on_this_machine(quick):
    report = doctor.run_doctor("tiny-target")
    validate(report)
    found = by_name(report)
    assert list(found) == ["blas", "kernel sources", "wide_qmm", "mr_attention", "race verdicts",
                           "verify-width sweep", "pair", "generation"]
    assert report["machine"]["metal"] is False and report["machine"]["memory_gb"] > 0
    assert report["versions"]["mlx"] == mx.__version__
    assert found["kernel sources"]["status"] == "ok"
    assert {d["kernel"] for d in found["kernel sources"]["details"]} == {"wide_qmm", "mr_attention"}
    for name in ("wide_qmm", "mr_attention"):
        assert found[name]["status"] == "skipped" and "needs a Mac" in found[name]["line"]
    sweep = found["verify-width sweep"]["details"]
    assert [s["impl"] for s in sweep] == ["mlx"] and sweep[0]["widths"] == list(range(1, 17))
    assert found["pair"]["status"] == "ok" and "no known pitfall" in found["pair"]["line"]
    run = found["generation"]["details"][0]
    # Every round drafts at the fixed width but a last one with a single token left to emit.
    assert run["tokens"] == 8 and run["plain_steps"] == 0
    assert run["rounds"] - 1 <= run["drafted_rounds"] <= run["rounds"]
    assert run["verify"] == {"matmul": "MLX's matmul (the target is not quantized)",
                             "attention": "MLX's SDPA (no Metal: our attention kernel runs on Apple GPUs)"}
    assert report["failed"] == []


def test_the_json_file_and_the_exit_status(quick, tmp_path):
    out = tmp_path / "doctor.json"
    result = CliRunner().invoke(cli, ["doctor", "--model", "tiny-target", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    validate(report)
    lines = result.output.splitlines()
    assert lines[0].startswith("mlx-dflash doctor: ") and "no Metal" in lines[0]
    assert any(line.startswith("ok       generation: 8 tokens") for line in lines)
    assert "0 failed" in lines[-2] and lines[-1] == f"wrote {out}"
    assert [p.name for p in tmp_path.iterdir()] == ["doctor.json"]  # written atomically: nothing else left
    missing = CliRunner().invoke(cli, ["doctor", "--json", str(tmp_path / "nowhere" / "doctor.json")])
    assert missing.exit_code == 1 and "does not exist" in missing.output


def test_the_doctor_on_a_target_without_a_drafter(quick, monkeypatch, tiny_chat_pair):
    from mlx_dflash.models.no_drafter import NoDrafter

    target, tokenizer, _ = tiny_chat_pair
    monkeypatch.setattr("mlx_dflash.pair.load", lambda model=None, drafter_=None: (target, NoDrafter(), tokenizer))
    found = by_name(doctor.run_doctor("tiny-target"))
    assert found["pair"]["status"] == "ok" and found["pair"]["line"].startswith("tiny-target + no drafter:")
    assert any(n.startswith("speculation: no drafter") for n in found["pair"]["details"][0]["notes"])
    assert found["generation"]["status"] == "ok" and found["generation"]["details"][0]["tokens"] == 8


def test_the_pair_is_skipped_until_the_default_target_is_downloaded(quick, monkeypatch):
    monkeypatch.setattr(doctor, "_default_pair_cached", lambda: False)
    report = doctor.run_doctor()
    validate(report)
    found = by_name(report)
    assert found["pair"]["status"] == "skipped" and "mlx-dflash prepare" in found["pair"]["line"]
    assert found["generation"]["status"] == "skipped"


def fake_metal(monkeypatch, qmm, attention, ours_s=1e-3, mlx_s=2e-3):
    """Metal reported available, our two kernels replaced by `qmm` and `attention`, the races timed by
    a fixed timer (ours_s against mlx_s)."""
    monkeypatch.setattr(doctor, "metal_available", lambda: True)
    monkeypatch.setattr(wide_qmm, "wide_quantized_matmul", qmm)
    monkeypatch.setattr(attn, "multi_row_attention", attention)
    monkeypatch.setattr(checks, "QMM_SHAPES", QMM)
    monkeypatch.setattr(checks, "ATTENTION_SHAPES", ATTENTION)
    monkeypatch.setattr(doctor, "RaceGate", lambda path, **kw: RaceGate(path, timer=FixedTimer(ours_s, mlx_s), **kw))
    monkeypatch.setattr(doctor, "_default_pair_cached", lambda: False)


def mlx_qmm(x, w, s, b, gs, bits, threads=None):
    return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits)


def mlx_attention(q, k, v, scale, keys=None, lengths=None, threads=None, sees=None):
    return attn.reference_attention(q, k, v, scale, keys, lengths, sees)


def test_the_mac_checks_with_kernels_that_agree(quick, monkeypatch):
    fake_metal(monkeypatch, mlx_qmm, mlx_attention)
    report = doctor.run_doctor()
    validate(report)
    found = by_name(report)
    assert "kernel sources" not in found and "blas" in found  # sources: compiled on a Mac instead
    for name, shapes in (("wide_qmm", QMM), ("mr_attention", ATTENTION)):
        check = found[name]
        assert check["status"] == "ok"
        assert f"on {len(shapes)} shapes; the race picked ours on {len(shapes)}" in check["line"]
        assert [d["route"] for d in check["details"]] == ["dflash"] * len(shapes)
        assert all(d["dflash_ms"] == 1.0 and d["mlx_ms"] == 2.0 for d in check["details"])
        assert all(d["error_share_of_tolerance"] <= 1 for d in check["details"])
        assert check["notes"][0].endswith("race: ours 1 ms, MLX's 2 ms; soak of 200: ours 1 ms (slowest 1), MLX's "
                                          "2 ms: ours")
        assert all(d["threads"] in (256, 512) and d["soak_calls"] == 200 and not d["stalled"] for d in check["details"])
    lost = doctor.check_kernel("wide_qmm", checks.check_qmm, "MLX's quantized matmul")
    assert lost.status == "ok"
    monkeypatch.setattr(doctor, "RaceGate", lambda path, **kw: RaceGate(path, timer=FixedTimer(3e-3, 2e-3), **kw))
    lost = doctor.check_kernel("mr_attention", checks.check_attention, "MLX's SDPA")
    assert lost.status == "ok" and "the race picked ours on 0" in lost.line
    assert lost.notes[0].endswith("race: ours 3 ms, MLX's 2 ms: MLX's")  # lost the race: no soak


def test_a_kernel_that_disagrees_fails_the_doctor(quick, monkeypatch):
    fake_metal(monkeypatch, lambda *a: mlx_qmm(*a) + 0.5, mlx_attention)
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 1
    failed = [line for line in result.output.splitlines() if line.startswith("fail")]
    assert failed == [line for line in failed if "wide_qmm: 2 of 2 shapes wrong against MLX's quantized matmul" in line]
    assert len(failed) == 1 and "1 failed" in result.output
    report = doctor.run_doctor()
    validate(report)
    qmm = by_name(report)["wide_qmm"]
    assert report["failed"] == ["wide_qmm"] and all(not d["ok"] and "route" not in d for d in qmm["details"])
    assert by_name(report)["mr_attention"]["status"] == "ok"


def test_an_attention_kernel_that_ignores_a_batchs_row_lengths_fails_on_the_ragged_shape(quick, monkeypatch):
    def unragged(q, k, v, scale, keys=None, lengths=None, threads=None, sees=None):  # every row over all the keys
        return attn.reference_attention(q, k, v, scale, keys, None, sees)

    fake_metal(monkeypatch, mlx_qmm, unragged)
    check = doctor.check_kernel("mr_attention", checks.check_attention, "MLX's SDPA")
    assert check.status == "fail" and f"2 of {len(ATTENTION)} shapes wrong" in check.line
    assert [d["ok"] for d in check.details] == [True, True, False, False] and "batch of 3" in check.details[2]["shape"]


def test_an_attention_kernel_that_ignores_a_trees_ancestors_fails_on_the_tree_shape(quick, monkeypatch):
    def causal(q, k, v, scale, keys=None, lengths=None, threads=None, sees=None):  # a chain's mask for every call
        return attn.reference_attention(q, k, v, scale, keys, lengths)

    fake_metal(monkeypatch, mlx_qmm, causal)
    check = doctor.check_kernel("mr_attention", checks.check_attention, "MLX's SDPA")
    assert check.status == "fail" and f"1 of {len(ATTENTION)} shapes wrong" in check.line
    assert [d["ok"] for d in check.details] == [True, True, True, False] and "trees" in check.details[3]["shape"]


def test_a_kernel_that_does_not_compile_is_a_warning_and_mlx_serves(quick, monkeypatch):
    def broken(*args):
        raise RuntimeError("[metal::Device] Unable to build metal library from source\nerror: use of undeclared")

    fake_metal(monkeypatch, mlx_qmm, broken)
    check = doctor.check_kernel("mr_attention", checks.check_attention, "MLX's SDPA")
    assert check.status == "warn" and check.line.startswith(f"ours failed to run on {len(ATTENTION)} of ")
    assert check.details[0]["error"] == "RuntimeError: [metal::Device] Unable to build metal library from source"
    assert "\n" not in check.line and check.line.endswith("; MLX's path serves it")


def test_cached_verdicts_that_disagreed_are_a_warning(quick, monkeypatch, tmp_path):
    path = tmp_path / "race_verdicts.json"
    path.write_text(json.dumps({
        "applegpu_g15s|wide_qmm|float16|K64xN64|gs64|b4|rows8": {"route": "mlx", "numerics_ok": False,
                                                                "max_rel_err": 0.4, "dflash_s": None, "mlx_s": None},
        "applegpu_g15s|wide_qmm|float16|K64xN64|gs64|b4|rows9": {"route": "dflash", "numerics_ok": True,
                                                                "max_rel_err": 0.0, "dflash_s": 1e-3, "mlx_s": 2e-3}}))
    monkeypatch.setattr(doctor, "shared_gate", lambda: RaceGate(path))
    check = doctor.check_verdict_cache()
    assert check.status == "warn" and check.line.startswith("1 of 2 cached verdicts")
    assert "rows8" in check.line and len(check.details) == 2


# BLAS (Linux): which library serves MLX's matmuls, and the warning.

MAPS = ("7f0000000000-7f0000100000 r-xp 00000000 08:01 1 /venv/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0\n"
        "7f0000200000-7f0000300000 r-xp 00000000 08:01 2 "
        "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so\n"
        "7f0000400000-7f0000500000 rw-p 00000000 00:00 0 [heap]\n")


def test_blas_library_from_the_process_maps():
    bundled = machine.blas_library(MAPS, global_sgemm=None)  # no cblas_sgemm in the global scope
    assert bundled == {"library": BUNDLED, "kind": "bundled", "slow": True}
    preloaded = machine.blas_library(MAPS, global_sgemm=0x7F0000200100)
    assert preloaded == {"library": "openblas-pthread/libopenblasp-r0.3.21.so", "kind": "optimized", "slow": False}
    assert machine.blas_kind("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3.11.0") == "reference"
    assert machine.blas_kind("/opt/intel/lib/libmkl_rt.so.2") == "optimized"
    assert machine.blas_kind("/usr/lib/libsomething.so") == "unknown"


@pytest.mark.skipif(not LINUX, reason="the BLAS check is Linux's")
def test_slow_blas_warning_names_the_fix():
    warning = machine.slow_blas_warning(machine.blas_library(MAPS, global_sgemm=None))
    assert warning.startswith("warning: ") and "\n" not in warning and BUNDLED in warning
    assert "apt-get install libopenblas0-pthread" in warning and f"LD_PRELOAD={machine.OPENBLAS}" in warning
    assert machine.slow_blas_warning(machine.blas_library(MAPS, global_sgemm=0x7F0000200100)) is None


SLOW, FAST = {"library": BUNDLED, "kind": "bundled", "slow": True}, {"library": "x", "kind": "optimized", "slow": False}


def test_blas_preload_decides_when_to_rerun_with_openblas():
    paths, present = ("/a/libopenblas.so.0", "/b/libopenblas.so.0"), {"/b/libopenblas.so.0"}.__contains__
    assert machine.blas_preload(SLOW, {}, paths, present) == "/b/libopenblas.so.0"  # the first that exists
    assert machine.blas_preload(SLOW, {"LD_PRELOAD": "/x/libjemalloc.so"}, paths, present) == "/b/libopenblas.so.0"
    assert machine.blas_preload(SLOW, {}, paths, lambda path: False) is None  # none installed
    assert machine.blas_preload(FAST, {}, paths, present) is None  # MLX runs a fast BLAS already
    assert machine.blas_preload(SLOW, {machine.NO_PRELOAD: "1"}, paths, present) is None  # turned off
    assert machine.blas_preload(SLOW, {machine.NO_PRELOAD: "0"}, paths, present) == "/b/libopenblas.so.0"
    # preloaded already and still slow (the preload did not take): not tried again
    assert machine.blas_preload(SLOW, {"LD_PRELOAD": "/x/y.so:/b/libopenblas.so.0"}, paths, present) is None


@pytest.mark.slow  # a real generate in a fresh process (seconds)
@pytest.mark.skipif(not LINUX or not any(map(os.path.exists, machine.OPENBLAS_PATHS)),
                    reason="needs Linux and a system OpenBLAS")
def test_generate_reruns_itself_with_openblas_preloaded(tiny_pair_dirs):
    target, drafter = tiny_pair_dirs
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", machine.NO_PRELOAD)}
    command = [sys.executable, "-m", "mlx_dflash.cli", "generate", "--model", str(target), "--drafter", str(drafter),
               "--prompt", "hi", "--max-tokens", "4"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "BLAS" in line]
    assert len(said) == 1 and said[0].startswith("mlx-dflash: MLX's bundled reference BLAS") and "LD_PRELOAD=" in said[0]
    assert "generation: 4 tokens" in done.stderr
    off = subprocess.run(command, env={**env, machine.NO_PRELOAD: "1"}, capture_output=True, text=True, timeout=300)
    assert off.returncode == 0 and off.stderr.startswith("warning: MLX runs its CPU matmuls on the reference BLAS")


def _python(code: str, preload: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = preload
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="the BLAS check is Linux's")
def test_the_real_process_without_and_with_openblas():
    """In a fresh process: MLX's wheel alone runs on its bundled BLAS, OpenBLAS preloaded on OpenBLAS, and a
    refused input is one line either way (the slow-BLAS warning comes once a pair has loaded)."""
    code = ("import json, sys; from mlx_dflash.cli import main; from mlx_dflash.machine import blas_library; "
            "print(json.dumps(blas_library())); sys.argv = ['mlx-dflash', 'generate', '--model', '/nonexistent', "
            "'--prompt', 'hi']; main()")
    bare = _python(code, None)
    assert json.loads(bare.stdout.splitlines()[0])["kind"] == "bundled"
    errors = bare.stderr.splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: target model /nonexistent") and bare.returncode == 1
    if Path(machine.OPENBLAS).exists():
        fast = _python(code, machine.OPENBLAS)
        assert json.loads(fast.stdout.splitlines()[0])["kind"] == "optimized"
        assert fast.stderr.splitlines()[0].startswith("error: target model /nonexistent")


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve", "--port", "0"]])
def test_a_refusal_stands_alone_on_a_slow_blas(monkeypatch, command):
    """The slow-BLAS warning is said once the input is taken (the pair loaded), so an error is the only line."""
    monkeypatch.setattr(machine, "slow_blas_warning", lambda: "warning: slow BLAS (fix: preload OpenBLAS)")
    result = CliRunner().invoke(cli, [*command, "--model", "/nonexistent"])
    assert result.output.splitlines()[0].startswith("error: target model /nonexistent") and result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_generate_warns_of_a_slow_blas_once_the_pair_has_loaded(monkeypatch, tiny_pair_dirs):
    target, drafter = tiny_pair_dirs
    monkeypatch.setattr(machine, "slow_blas_warning", lambda: "warning: slow BLAS (fix: preload OpenBLAS)")
    result = CliRunner().invoke(cli, ["generate", "--model", str(target), "--drafter", str(drafter), "--prompt", "hi",
                                      "--max-tokens", "2", "--width", "2"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines().count("warning: slow BLAS (fix: preload OpenBLAS)") == 1


def test_machine_info_reports_memory_and_blas():
    info = machine.machine_info()
    assert info["memory_gb"] > 0
    if LINUX:
        assert info["blas"]["kind"] in ("bundled", "reference", "optimized", "unknown")
        assert info["blas"]["library"] is None or not info["blas"]["library"].startswith("/")
    assert machine.chip_generation("applegpu_g13s") == 13 and machine.chip_generation("applegpu_g17d") == 17
    assert machine.chip_generation("cpu") is None and machine.chip_generation(None) is None


@pytest.mark.slow
def test_the_doctor_command_on_the_default_pair(tmp_path, smollm2_path):
    """As CI runs it after `mlx-dflash prepare`: the real pair, the real sweep, in a fresh process."""
    out = tmp_path / "doctor.json"
    run = subprocess.run([sys.executable, "-m", "mlx_dflash.cli", "doctor", "--json", str(out)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    validate(report)
    found = by_name(report)
    assert found["pair"]["status"] == "ok" and found["generation"]["details"][0]["tau"] > 1


def test_paths_in_a_cache_moved_outside_home_are_written_without_the_machines_folders(tmp_path, monkeypatch):
    from mlx_dflash.utils import portable_path

    monkeypatch.setenv("MLX_DFLASH_CACHE", str(tmp_path / "cache"))
    assert portable_path(tmp_path / "cache" / "kernels" / "verdicts.json") == "$MLX_DFLASH_CACHE/kernels/verdicts.json"
    assert portable_path(Path.home() / "x" / "y.json") == "~/x/y.json"
