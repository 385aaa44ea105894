"""The race gate (ours against MLX's on first use, verdict cached on disk) with injected timings, and the
routing of WideQuantizedLinear through it (Metal forced, a CPU stand-in for our kernel)."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

from conftest import tiny_quantized_llama
from mlx_dflash.kernels import wide_qmm as kernels
from mlx_dflash.errors import DFlashError
from metal_fakes import FixedTimer
from mlx_dflash.kernels.race_gate import RaceGate, cache_path, call_times


def Timer(dflash, mlx):
    return FixedTimer(dflash, mlx)


def _pair(noise=0.0):
    x = mx.random.normal((8, 64), key=mx.random.key(1))
    return (lambda threads: x * 2 + noise), (lambda: x * 2)


def route(gate, key, ours, theirs, dtype, forced=False):
    return gate.choose(key, ours, theirs, dtype, [256], forced).route


@pytest.mark.parametrize("ours_s, mlx_s, expected", [(1e-4, 3e-4, "dflash"), (5e-4, 2e-4, "mlx")])
def test_verdict_follows_the_timings_and_is_cached(tmp_path, ours_s, mlx_s, expected):
    path = tmp_path / "verdicts.json"
    timer = Timer(dflash=ours_s, mlx=mlx_s)
    gate = RaceGate(path, timer=timer)
    ours, theirs = _pair()
    assert route(gate, "chip|wide_qmm|rows8", ours, theirs, mx.float32) == expected
    assert route(gate, "chip|wide_qmm|rows8", ours, theirs, mx.float32) == expected
    assert timer.races == 1 and timer.soaks == (expected == "dflash")  # raced once (a winner soaked), then the verdict
    saved = json.loads(path.read_text())["chip|wide_qmm|rows8"]
    assert saved["route"] == expected and saved["numerics_ok"] is True
    assert (saved["dflash_s"], saved["mlx_s"]) == (ours_s, mlx_s)
    again = Timer(dflash=mlx_s, mlx=ours_s)  # a new process reads the verdict from disk, no new race
    assert route(RaceGate(path, timer=again), "chip|wide_qmm|rows8", ours, theirs, mx.float32) == expected
    assert again.races == 0
    assert route(RaceGate(path, timer=again), "chip|wide_qmm|rows9", ours, theirs, mx.float32) != expected
    assert again.races == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["verdicts.json"]  # no temporary files left


def test_wrong_numerics_route_to_mlx_without_a_race(tmp_path, capsys):
    timer = Timer(dflash=1e-6, mlx=1.0)  # ours would win the race, but its result is wrong
    gate = RaceGate(tmp_path / "v.json", timer=timer)
    ours, theirs = _pair(noise=0.5)
    assert route(gate, "c|wide_qmm|k", ours, theirs, mx.float32) == "mlx"
    assert timer.races == 0
    assert "disagrees with MLX's" in capsys.readouterr().err
    nan = mx.array([float("nan")])
    gate = RaceGate(tmp_path / "w.json", timer=timer)
    assert route(gate, "c|wide_qmm|k", lambda t: nan, lambda: mx.ones(1), mx.float16) == "mlx"


@pytest.mark.parametrize("garbage", [b"{not json", b"[1, 2]", b'{"k": {"route": "fastest"}}', b"\xff\xfe"])
def test_corrupt_cache_is_ignored_and_rewritten(tmp_path, capsys, garbage):
    path = tmp_path / "v.json"
    path.write_bytes(garbage)
    gate = RaceGate(path, timer=Timer(dflash=1.0, mlx=2.0))
    assert "ignoring the unreadable race-verdict cache" in capsys.readouterr().err
    assert gate.verdicts == {}
    ours, theirs = _pair()
    assert route(gate, "c|wide_qmm|k", ours, theirs, mx.float32) == "dflash"
    assert json.loads(path.read_text())["c|wide_qmm|k"]["route"] == "dflash"


def test_cache_location_and_real_timer(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DFLASH_CACHE", str(tmp_path))
    assert cache_path() == tmp_path / "race_verdicts.json"
    x = mx.ones((4, 4))
    times = call_times({"dflash": lambda: x + 1, "mlx": lambda: x @ x}, repeats=3)
    assert set(times) == {"dflash", "mlx"} and all(len(t) == 3 and min(t) > 0 for t in times.values())


def _wide_layer(route, monkeypatch, tmp_path, timer):
    calls = []

    def stand_in(x, w, scales, biases, group_size, bits, threads=None):
        calls.append(x.size // x.shape[-1])
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)

    monkeypatch.setattr(kernels, "metal_available", lambda: True)
    monkeypatch.setattr(kernels, "wide_quantized_matmul", stand_in)
    monkeypatch.setattr(kernels, "shared_gate", lambda: gate)
    gate = RaceGate(tmp_path / "v.json", timer=timer)
    mx.random.seed(4)
    ql = nn.QuantizedLinear(64, 32, bias=True, group_size=32, bits=4)
    return kernels.WideQuantizedLinear(ql, route=route), ql, calls, gate


@pytest.mark.parametrize("ours_s, mlx_s, wide", [(1.0, 2.0, True), (2.0, 1.0, False)])
def test_layer_routes_by_the_verdict(tmp_path, monkeypatch, ours_s, mlx_s, wide):
    timer = Timer(dflash=ours_s, mlx=mlx_s)
    wl, ql, calls, gate = _wide_layer("auto", monkeypatch, tmp_path, timer)
    x = mx.random.normal((1, 8, 64))
    for _ in range(3):
        assert mx.allclose(wl(x), ql(x), atol=1e-5)
    assert timer.races == 1
    # The race itself calls ours once (numerics) ; afterwards the verdict decides every call.
    assert calls == [8] * (1 + (3 if wide else 0))
    (key,) = gate.verdicts
    assert key.endswith("|wide_qmm|float32|K64xN32|gs32|b4|rows8")
    wl(mx.random.normal((1, 4, 64)))  # 4 rows: MLX's path, no race
    assert timer.races == 1


@pytest.mark.parametrize("route, wide", [("dflash", True), ("mlx", False)])
def test_forced_routes_skip_the_race(tmp_path, monkeypatch, route, wide):
    timer = Timer(dflash=2.0, mlx=1.0)
    wl, ql, calls, _ = _wide_layer(route, monkeypatch, tmp_path, timer)
    wl(mx.random.normal((10, 64)))
    assert timer.races == 0 and calls == ([10, 10] if wide else [])  # forced: run once alone, then in the call


def test_route_from_environment(monkeypatch):
    from mlx_dflash.models.target import Target

    monkeypatch.setattr(kernels, "metal_available", lambda: True)
    monkeypatch.setenv(kernels.ROUTE_ENV, "mlx")
    assert kernels.default_route() == "mlx"
    target = Target(tiny_quantized_llama())
    assert target.install_wide_kernels() == 0 and target.wide_kernels is False  # the <= 5 rule stays
    monkeypatch.setenv(kernels.ROUTE_ENV, "dflash")
    assert target.install_wide_kernels() == 15 and target.wide_kernels is True
    assert {m.route for m in target.model.modules() if isinstance(m, kernels.WideQuantizedLinear)} == {"dflash"}
    monkeypatch.setenv(kernels.ROUTE_ENV, "fastest")
    with pytest.raises(DFlashError, match="MLX_DFLASH_WIDE_KERNEL='fastest': use one of auto, dflash, mlx"):
        kernels.default_route()
    with pytest.raises(DFlashError, match="route 'x'"):
        kernels.WideQuantizedLinear(nn.QuantizedLinear(64, 32, group_size=32, bits=4), route="x")
