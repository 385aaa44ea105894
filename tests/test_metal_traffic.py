"""The traffic and occupancy model (mlx_dflash/kernels/traffic.py) against the emulator's counts, and the bounds.

The emulator's traffic build counts the bytes of every load and store the compiled kernel makes, per
buffer (and for threadgroup memory); the model's formulas must give exactly those numbers, for our kernel
and for MLX's own qmv_fast / qmv_wide (cut unmodified from the wheel). The bounds of the wide kernel: at
every M in 6..16, device bytes <= 1.15x the unavoidable bytes and weight bytes <= 1/ceil(M/5) of MLX's.
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from metal_emulator import run_kernel  # noqa: E402
from metal_emulator.mlx_sources import quantized_header  # noqa: E402

from mlx_dflash.kernels import wide_qmm as kernels
from mlx_dflash.kernels import traffic as traffic  # noqa: E402

DTYPES = {"f16": mx.float16, "bf16": mx.bfloat16, "f32": mx.float32}
BYTES = {"f16": 2, "bf16": 2, "f32": 4}
MLX_HELPERS = ["get_pack_factor", "get_bytes_per_pack", "load_vector", "qdot", "dequantize", "qmv_fast_impl",
               "qmv_wide_impl"]
MAX_OVER_UNAVOIDABLE = 1.15


def _case(m, k, n, gs, bits, dt, seed=0):
    kw, kx = mx.random.split(mx.random.key(seed + 7 * m + n))
    wq, s, b = mx.quantize(mx.random.normal((n, k), key=kw), gs, bits)
    dtype = DTYPES[dt]
    return mx.random.normal((m, k), key=kx).astype(dtype), wq, s.astype(dtype), b.astype(dtype)


def measured(launch, call) -> dict:
    """The emulator's counts in the model's terms."""
    t = launch.traffic
    assert all(v["written"] == 0 for name, v in t.items() if name != "y")  # inputs are only read
    assert t["y"]["read"] == 0
    return dict(
        threadgroups=launch.stats["threadgroups"], threads_per_threadgroup=call["threadgroup"][0]
        * call["threadgroup"][1], threadgroup_bytes=launch.stats["tg_bytes"], barriers=launch.stats["barriers"],
        w=t["w"]["read"], scales=t["scales"]["read"], biases=t["biases"]["read"], x=t["x"]["read"],
        y=t["y"]["written"],
    )


def run_ours(m, k, n, gs, bits, dt, body_edit=None, rows_per_tg=None):
    x, wq, s, b = _case(m, k, n, gs, bits, dt)
    kernel, call = kernels.wide_qmm_call(x, wq, s, b, gs, bits)
    if body_edit is not None:  # a planted variant of the real kernel
        header, body = kernels.read_metal_file("wide_qmm.metal")
        assert body.count(body_edit[0]) == 1
        kernel = mx.fast.metal_kernel(name="planted_traffic", input_names=["x", "w", "scales", "biases", "K", "N"],
                                      output_names=["y"], source=body.replace(*body_edit), header=header)
    if rows_per_tg is not None:
        call["grid"] = (call["grid"][0], -(-m // rows_per_tg), 1)
    launch = run_kernel(kernel, **call, traffic=True)
    ref = mx.quantized_matmul(x.astype(mx.float32), wq, s.astype(mx.float32), b.astype(mx.float32),
                              transpose=True, group_size=gs, bits=bits)
    err = mx.abs(launch.outputs[0].astype(mx.float32) - ref).max().item()
    assert err <= 2.0**-7 * mx.abs(ref).max().item()  # the counted run also computed the right thing
    return measured(launch, call)


def run_mlx(kind, m, k, n, gs, bits, dt):
    x, wq, s, b = _case(m, k, n, gs, bits, dt)
    dtype = DTYPES[dt]
    if kind == "qmv_wide":
        tiles = -(-m // 5)
        kernel = mx.fast.metal_kernel(
            name="mlx_qmv_wide", input_names=["w", "scales", "biases", "x", "K", "N", "M"], output_names=["y"],
            header=quantized_header(MLX_HELPERS),
            source="qmv_wide_impl<T, GS, BITS, NV, 8>(w, scales, biases, x, y, K, N, M, "
                   "threadgroup_position_in_grid, simdgroup_index_in_threadgroup, thread_index_in_simdgroup);")
        call = dict(inputs=[wq, s, b, x, k, n, m],
                    template=[("T", dtype), ("GS", gs), ("BITS", bits), ("NV", -(-m // tiles))],
                    grid=(32 * tiles, 2 * -(-n // 8), 1), threadgroup=(32, 2, 1))
    else:
        kernel = mx.fast.metal_kernel(
            name="mlx_qmv_fast", input_names=["w", "scales", "biases", "x", "K", "N"], output_names=["y"],
            header=quantized_header(MLX_HELPERS),
            source="qmv_fast_impl<T, GS, BITS>(w, scales, biases, x, y, K, N, threadgroup_position_in_grid, "
                   "simdgroup_index_in_threadgroup, thread_index_in_simdgroup);")
        call = dict(inputs=[wq, s, b, x, k, n], template=[("T", dtype), ("GS", gs), ("BITS", bits)],
                    grid=(32 * m, 2 * (n // 8), 1), threadgroup=(32, 2, 1))
    call |= dict(output_shapes=[(m, n)], output_dtypes=[dtype])
    return measured(run_kernel(kernel, **call, traffic=True), call)


def model_of(fn, m, k, n, gs, bits, dt):
    out = fn(m, k, n, gs, bits, BYTES[dt], BYTES[dt])
    return {key: out[key] for key in ("threadgroups", "threads_per_threadgroup", "threadgroup_bytes", "barriers",
                                      "w", "scales", "biases", "x", "y")}


def check_bounds(t: dict, m, k, n, gs, bits, dt) -> float:
    """Both bounds of the wide kernel for counts ``t``; returns device bytes / unavoidable bytes."""
    base = traffic.unavoidable_bytes(m, k, n, gs, bits, BYTES[dt], BYTES[dt])
    ratio = traffic.device_bytes(t) / base
    assert ratio <= MAX_OVER_UNAVOIDABLE, f"device bytes {ratio:.3f}x the unavoidable bytes"
    theirs = traffic.mlx_qmv_wide(m, k, n, gs, bits, BYTES[dt], BYTES[dt])
    assert traffic.weight_bytes(t) * -(-m // 5) <= traffic.weight_bytes(theirs), "weights read more than once"
    return ratio


# ---------------------------------------------------------------------------------------------------
# Hand-computed counts


@pytest.mark.emulator
def test_counts_by_hand_small_bf16():
    """M=6, K=256, N=40, group 64, 4 bits, bfloat16: one threadgroup of 256 threads (512 features)."""
    counts = run_ours(6, 256, 40, 64, 4, "bf16")
    assert counts == model_of(traffic.ours, 6, 256, 40, 64, 4, "bf16")
    assert counts == dict(
        threadgroups=1, threads_per_threadgroup=256,
        threadgroup_bytes=6 * 512 * 4,  # one 6 x 512 float tile
        barriers=2,  # one tile, staged and released
        w=40 * 256 // 2,  # 5120: each 4-bit weight once
        scales=40 * 4 * 2, biases=40 * 4 * 2,  # 320 each: 4 groups per row, once
        x=6 * 256 * 2,  # 3072: once (one threadgroup)
        y=6 * 40 * 2,  # 480
    )


@pytest.mark.emulator
def test_counts_by_hand_ragged_f16_three_threadgroups():
    """M=11, K=320 (a full and a partial 256-wide tile), N=1100 (3 threadgroups, the last partial),
    group 32, 8 bits, float16."""
    counts = run_ours(11, 320, 1100, 32, 8, "f16")
    assert counts == model_of(traffic.ours, 11, 320, 1100, 32, 8, "f16")
    assert counts == dict(
        threadgroups=3, threads_per_threadgroup=256, threadgroup_bytes=11 * 256 * 4,
        barriers=3 * 2 * 2,
        w=1100 * 320,  # 352000: one byte per 8-bit weight, once
        scales=1100 * 10 * 2, biases=1100 * 10 * 2,  # 22000 each
        x=3 * 11 * 320 * 2,  # 21120: once per threadgroup
        y=11 * 1100 * 2,  # 24200
    )


@pytest.mark.emulator
def test_mlx_counts_by_hand():
    """MLX's own kernels, M=7 rows, K=512, N=40, group 64, 4 bits, bfloat16."""
    wide = run_mlx("qmv_wide", 7, 512, 40, 64, 4, "bf16")  # 2 row tiles of 4 (row 7 re-read in tile 2)
    assert wide == model_of(traffic.mlx_qmv_wide, 7, 512, 40, 64, 4, "bf16")
    assert (wide["w"], wide["scales"], wide["x"], wide["y"]) == (2 * 40 * 256, 2 * 40 * 8 * 2, 40 * 2 * 4 * 512 * 2,
                                                                 7 * 40 * 2)
    fast = run_mlx("qmv_fast", 7, 512, 40, 64, 4, "bf16")  # 7 weight passes, x per 4-feature simdgroup
    assert fast == model_of(traffic.mlx_qmv_fast, 7, 512, 40, 64, 4, "bf16")
    assert (fast["w"], fast["scales"], fast["x"]) == (7 * 40 * 256, 7 * 40 * 32 * 2, 7 * 10 * 512 * 2)


# ---------------------------------------------------------------------------------------------------
# The model's formulas = the emulator's counts


MODEL_CASES = [(16, 512, 1061, 128, 4, "bf16"), (8, 1024, 1100, 64, 8, "f32")]
MODEL_CASES_SLOW = [(m, (32, 64, 128)[m % 3] * (3 + m % 2), 1024 * (1 + m % 2) + 45, (32, 64, 128)[m % 3],
                     (4, 8)[m % 2], ("f16", "bf16", "f32")[m % 3]) for m in range(6, 17)]


def _check_model(m, k, n, gs, bits, dt):
    t = run_ours(m, k, n, gs, bits, dt)
    assert t == model_of(traffic.ours, m, k, n, gs, bits, dt)
    check_bounds(t, m, k, n, gs, bits, dt)


@pytest.mark.slow
@pytest.mark.emulator
@pytest.mark.parametrize("m,k,n,gs,bits,dt", MODEL_CASES + MODEL_CASES_SLOW, ids=str)
def test_model_equals_emulator_counts_every_m(m, k, n, gs, bits, dt):
    _check_model(m, k, n, gs, bits, dt)


@pytest.mark.slow
@pytest.mark.emulator
@pytest.mark.parametrize("kind,shape", [("qmv_wide", (12, 256, 44, 32, 8, "f16")),
                                        ("qmv_fast", (6, 1024, 16, 128, 8, "bf16"))])
def test_mlx_model_equals_emulator_counts(kind, shape):
    fn = traffic.mlx_qmv_wide if kind == "qmv_wide" else traffic.mlx_qmv_fast
    assert run_mlx(kind, *shape) == model_of(fn, *shape)


# ---------------------------------------------------------------------------------------------------
# The bounds


SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (2048, 2048), (1024, 5120), (4096, 151936)]


def test_bounds_over_the_full_grid():
    """Every M in 6..16 x bits x group size x dtype x layer shapes of the published targets (q/o, k/v,
    MLP up/down, the LM head); the model is the emulator's count (tests above)."""
    worst = 0.0
    for k, n in SHAPES:
        for m in range(6, 17):
            for bits in (4, 8):
                for gs in (32, 64, 128):
                    for dt in DTYPES:
                        t = model_of(traffic.ours, m, k, n, gs, bits, dt)
                        worst = max(worst, check_bounds(t, m, k, n, gs, bits, dt))
                        assert traffic.weight_bytes(t) * m <= traffic.weight_bytes(
                            traffic.mlx_qmv_fast(m, k, n, gs, bits, BYTES[dt], BYTES[dt]))
    assert 1.0 < worst <= MAX_OVER_UNAVOIDABLE


@pytest.mark.emulator
@pytest.mark.parametrize("rows", [1, pytest.param(5, marks=pytest.mark.slow)])
def test_planted_weight_rereads_are_caught(rows):
    """The real kernel with fewer rows per threadgroup (1: a weight pass per row, as qmv_fast; 5: as
    MLX's qmv_wide tiles) computes the right answer and fails the bound."""
    m, k, n, gs, bits, dt = 8, 256, 600, 64, 4, "bf16"
    t = run_ours(m, k, n, gs, bits, dt, body_edit=("constexpr int RB = R;", f"constexpr int RB = {rows};"),
                 rows_per_tg=rows)
    assert t["w"] == -(-m // rows) * n * k // 2
    with pytest.raises(AssertionError, match="the unavoidable bytes|more than once"):
        check_bounds(t, m, k, n, gs, bits, dt)


def test_compare_reports_the_ratios():
    c = traffic.compare(16, 4096, 4096, 64, 4, 2)
    assert c["mlx_m3+_weight_passes"] == 4 and c["mlx_m1/m2_weight_passes"] == 16
    # qmv_fast also re-loads a scale and bias per lane and 512-value block: below 1/16 on M1/M2.
    assert c["ours_over_mlx_m3+_weights"] == 0.25 and c["ours_over_mlx_m1/m2_weights"] < 1 / 16
    assert 1.0 < c["ours_over_unavoidable"] <= MAX_OVER_UNAVOIDABLE and c["ours_threadgroups"] == 8
    with pytest.raises(ValueError, match="chip"):
        traffic.mlx_path("m9", 6, 64, 8, 32, 4, 2, 2)


def test_bench_widths_prints_the_model_beside_the_timings(tmp_path):
    from mlx_dflash.bench_widths import run_widths_bench

    lines = []
    res = run_widths_bench(None, tmp_path, shapes=["256x512", "512x256"], widths=range(4, 9), repeats=1, warmup=0,
                           log=lines.append)
    model = res["traffic_model"]
    assert model["kind"] == "model" and [r["width"] for r in model["rows"]] == [6, 7, 8]
    expected = traffic.widths_model([{"K": 256, "N": 512, "group_size": 64, "bits": 4},
                                     {"K": 512, "N": 256, "group_size": 64, "bits": 4}], [6, 7, 8], 4)
    assert model["rows"] == expected["rows"]
    assert all(r["ours_over_mlx_m3+_weights"] == 0.5 and r["mlx_m1/m2_weight_passes"] == r["width"]
               for r in model["rows"])
    text = next(line for line in lines if line.startswith("traffic MODEL"))
    assert text.startswith("traffic MODEL (modelled device bytes") and "not a measurement" in text
    assert len(text.splitlines()) == 2 + 3
    assert json.loads((tmp_path / "widths.json").read_text())["traffic_model"] == model
