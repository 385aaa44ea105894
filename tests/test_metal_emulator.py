"""The CPU Metal emulator itself: MLX's own kernels as oracles, planted synchronisation bugs, the cache."""

import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from metal_emulator import (  # noqa: E402
    DeadlockError,
    DivergentBarrierError,
    DivergentCollectiveError,
    OutOfBoundsError,
    ThreadgroupMemoryError,
    build_many,
    cache_dir,
    parse_source,
    run_kernel,
    unavailable_reason,
)
from metal_emulator.mlx_sources import quantized_header  # noqa: E402

from mlx_dflash.kernels.source import metal_source  # noqa: E402

pytestmark = pytest.mark.emulator  # every test here runs kernels through the emulator

MLX_HELPERS = ["get_pack_factor", "get_bytes_per_pack", "load_vector", "qdot", "dequantize", "qmv_fast_impl",
               "qmv_wide_impl"]


def _oracle(x, wq, s, b, gs, bits):
    f = mx.float32
    return np.array(mx.quantized_matmul(x.astype(f), wq, s.astype(f), b.astype(f), transpose=True,
                                        group_size=gs, bits=bits))


def _case(m, k, n, gs, bits, dtype, seed):
    kw, kx = mx.random.split(mx.random.key(seed))
    wq, s, b = mx.quantize(mx.random.normal((n, k), key=kw), gs, bits)
    return mx.random.normal((m, k), key=kx).astype(dtype), wq, s.astype(dtype), b.astype(dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_mlx_qmv_fast_runs_unmodified_and_matches(dtype):
    """MLX 0.32's own qmv_fast_impl (cut verbatim from the wheel's quantized.h) through the emulator."""
    kernel = mx.fast.metal_kernel(
        name="mlx_qmv_fast", input_names=["w", "scales", "biases", "x", "K", "N"], output_names=["y"],
        header=quantized_header(MLX_HELPERS),
        source="qmv_fast_impl<T, GS, BITS>(w, scales, biases, x, y, K, N, threadgroup_position_in_grid, "
               "simdgroup_index_in_threadgroup, thread_index_in_simdgroup);")
    m, k, n, gs, bits = 3, 512, 32, 64, 4
    x, wq, s, b = _case(m, k, n, gs, bits, dtype, seed=1)
    launch = run_kernel(kernel, inputs=[wq, s, b, x, k, n], template=[("T", dtype), ("GS", gs), ("BITS", bits)],
                        grid=(32 * m, 2 * (n // 8), 1), threadgroup=(32, 2, 1), output_shapes=[(m, n)],
                        output_dtypes=[dtype])
    ref = _oracle(x, wq, s, b, gs, bits)
    y = np.array(launch.outputs[0].astype(mx.float32))
    rtol = 1e-6 if dtype == mx.float32 else 2.0**-8
    assert (np.abs(y - ref) <= rtol * np.abs(ref) + 2e-5 * np.abs(ref).max()).all()
    assert launch.stats["threadgroups"] == m * n // 8
    assert launch.stats["collectives"] == m * n // 8 * 2 * 4  # one simd_sum per result row


def test_mlx_qmv_wide_runs_unmodified_and_matches():
    """MLX's qmv_wide_impl (shuffle-down ladders, ragged N) - float16, 8-bit, group 32."""
    kernel = mx.fast.metal_kernel(
        name="mlx_qmv_wide", input_names=["w", "scales", "biases", "x", "K", "N", "M"], output_names=["y"],
        header=quantized_header(MLX_HELPERS),
        source="qmv_wide_impl<T, GS, BITS, NV, 8>(w, scales, biases, x, y, K, N, M, "
               "threadgroup_position_in_grid, simdgroup_index_in_threadgroup, thread_index_in_simdgroup);")
    m, k, n, gs, bits, nv = 7, 256, 36, 32, 8, 4
    x, wq, s, b = _case(m, k, n, gs, bits, mx.float16, seed=2)
    launch = run_kernel(kernel, inputs=[wq, s, b, x, k, n, m],
                        template=[("T", mx.float16), ("GS", gs), ("BITS", bits), ("NV", nv)],
                        grid=(32 * -(-m // nv), 2 * -(-n // 8), 1), threadgroup=(32, 2, 1),
                        output_shapes=[(m, n)], output_dtypes=[mx.float16])
    ref = _oracle(x, wq, s, b, gs, bits)
    y = np.array(launch.outputs[0].astype(mx.float32))
    assert (np.abs(y - ref) <= 2.0**-11 * np.abs(ref) + 2e-5 * np.abs(ref).max()).all()


# ---------------------------------------------------------------------------------------------------
# Small kernels: one correct control and planted bugs. 64 threads = 2 SIMD groups per threadgroup.

CONTROL = """
  threadgroup float buf[64];
  uint t = thread_index_in_threadgroup;
  buf[t] = x[thread_position_in_grid.x];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float v = buf[63 - t];
  out[thread_position_in_grid.x] = simd_sum(v) + v;
"""

PLANTED = {
    "missing_barrier": (CONTROL.replace("threadgroup_barrier(mem_flags::mem_threadgroup);", ""), None),
    "barrier_in_divergent_branch": (CONTROL.replace(
        "threadgroup_barrier(mem_flags::mem_threadgroup);",
        "if (t < 32) { threadgroup_barrier(mem_flags::mem_threadgroup); }"), DivergentBarrierError),
    "early_return_before_barrier": (CONTROL.replace(
        "buf[t] = x[thread_position_in_grid.x];",
        "buf[t] = x[thread_position_in_grid.x];\n  if (t == 5) return;"), DivergentBarrierError),
    "barriers_at_different_sites": (CONTROL.replace(
        "threadgroup_barrier(mem_flags::mem_threadgroup);",
        "if (simdgroup_index_in_threadgroup == 0) { threadgroup_barrier(mem_flags::mem_threadgroup); }\n"
        "  else { threadgroup_barrier(mem_flags::mem_threadgroup); }"), DivergentBarrierError),
    "collective_in_part_of_simdgroup": (CONTROL.replace(
        "out[thread_position_in_grid.x] = simd_sum(v) + v;",
        "if (thread_index_in_simdgroup < 16) { v = simd_sum(v); }\n  out[thread_position_in_grid.x] = v;"),
        DivergentCollectiveError),
    "different_collectives_in_simdgroup": (CONTROL.replace(
        "out[thread_position_in_grid.x] = simd_sum(v) + v;",
        "v = (thread_index_in_simdgroup % 2) ? simd_max(v) : simd_sum(v);\n"
        "  out[thread_position_in_grid.x] = v;"), DivergentCollectiveError),
    "spin_wait_deadlock": ("""
  threadgroup int flag[1];
  volatile threadgroup int* f = flag;
  uint t = thread_index_in_threadgroup;
  if (t == 0) { f[0] = 0; }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (t == 0) { while (f[0] == 0) { } }  // waits for lane 1 of its own SIMD group: hangs on a GPU
  if (t == 1) { f[0] = 1; }
  out[thread_position_in_grid.x] = x[thread_position_in_grid.x];
""", DeadlockError),
    "out_of_bounds_write": (CONTROL.replace(
        "out[thread_position_in_grid.x] = simd_sum(v) + v;",
        "out[thread_position_in_grid.x + 1] = simd_sum(v) + v;"), OutOfBoundsError),
    "out_of_bounds_read": (CONTROL.replace(
        "buf[t] = x[thread_position_in_grid.x];", "buf[t] = x[thread_position_in_grid.x + 3];"),
        OutOfBoundsError),
    "too_much_threadgroup_memory": (CONTROL.replace("threadgroup float buf[64];",
                                                    "threadgroup float buf[64];\n  threadgroup float big[8192];\n"
                                                    "  big[thread_index_in_threadgroup] = 0.0f;"), ThreadgroupMemoryError),
}


def _small_kernel(name, body):
    return mx.fast.metal_kernel(name=name, input_names=["x"], output_names=["out"], source=body)


def _small_call(n=128):
    x = mx.arange(n, dtype=mx.float32)
    return x, dict(inputs=[x], grid=(n, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(n,)],
                   output_dtypes=[mx.float32])


def _expected_control(x):
    x = np.array(x).reshape(-1, 64)
    v = x[:, ::-1].reshape(-1, 32)
    return (v + v.sum(axis=1, keepdims=True)).reshape(-1)


@pytest.fixture(scope="module", autouse=True)
def prebuilt():
    if unavailable_reason() is not None:
        return  # the marker skips every test
    x, call = _small_call()
    build_many([metal_source(_small_kernel(k, b), **call) for k, (b, _) in PLANTED.items()]
               + [metal_source(_small_kernel("control", CONTROL), **call)], jobs=2)


@pytest.mark.parametrize("reverse", [False, True])
def test_control_kernel_passes(reverse):
    x, call = _small_call()
    launch = run_kernel(_small_kernel("control", CONTROL), **call, reverse=reverse)
    np.testing.assert_array_equal(np.array(launch.outputs[0]), _expected_control(x))
    assert launch.stats["barriers"] == 2 and launch.stats["collectives"] == 4
    assert launch.stats["tg_bytes"] == 64 * 4


def test_missing_barrier_reads_poison():
    x, call = _small_call()
    out = np.array(run_kernel(_small_kernel("missing_barrier", PLANTED["missing_barrier"][0]), **call).outputs[0])
    assert np.isnan(out).any()


@pytest.mark.parametrize("name", [pytest.param(k, marks=pytest.mark.slow) if k == "spin_wait_deadlock" else k
                                  for k, (_, err) in PLANTED.items() if err is not None])  # a deadlock: seconds
def test_planted_bug_is_reported(name):
    body, err = PLANTED[name]
    x, call = _small_call()
    with pytest.raises(err) as info:
        run_kernel(_small_kernel(name, body), **call, timeout_s=3.0)
    assert str(info.value)


def test_out_of_bounds_messages_name_the_buffer():
    x, call = _small_call()
    with pytest.raises(OutOfBoundsError, match=r"past the end of buffer 0 \('x', 512 bytes\)"):
        run_kernel(_small_kernel("out_of_bounds_read", PLANTED["out_of_bounds_read"][0]), **call)
    x, call = _small_call(126)  # 504 bytes: out[126..127] is padding up to the 16-byte boundary
    with pytest.raises(OutOfBoundsError, match=r"write past the end of buffer 1 \('out'\)"):
        run_kernel(_small_kernel("oob_pad", CONTROL.replace("out[thread_position_in_grid.x] =",
                                                            "out[thread_position_in_grid.x + 1] =")), **call)


def test_divergent_barrier_message_names_the_threads():
    body, _ = PLANTED["barrier_in_divergent_branch"]
    x, call = _small_call()
    with pytest.raises(DivergentBarrierError, match=r"32 of 64 threads wait at a barrier, 32 exited"):
        run_kernel(_small_kernel("barrier_in_divergent_branch", body), **call)


def test_partial_edge_threadgroup_and_attributes():
    """dispatchThreads semantics: grid 100 with threadgroups of 64 -> a 36-thread edge group."""
    body = """
  uint g = thread_position_in_grid.x;
  out[g] = float(threads_per_threadgroup.x * 1000 + threadgroup_position_in_grid.x * 100
                 + simdgroup_index_in_threadgroup * 10) + float(thread_index_in_simdgroup) / 100.0f;
"""
    x = mx.zeros((100,))
    launch = run_kernel(_small_kernel("attrs", body), inputs=[x], grid=(100, 1, 1), threadgroup=(64, 1, 1),
                        output_shapes=[(100,)], output_dtypes=[mx.float32])
    g = np.arange(100)
    tpt = np.where(g < 64, 64, 36)
    expected = tpt * 1000 + (g // 64) * 100 + ((g % 64) // 32) * 10 + (g % 32) / 100.0
    np.testing.assert_allclose(np.array(launch.outputs[0]), expected, rtol=1e-6)


def test_build_cache_is_keyed_by_source(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DFLASH_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path / "emulator"
    x, call = _small_call()
    src = metal_source(_small_kernel("control", CONTROL), **call)
    (first,) = build_many([src])
    assert first.parent == tmp_path / "emulator"
    mtime = first.stat().st_mtime_ns
    (again,) = build_many([src])
    assert again == first and again.stat().st_mtime_ns == mtime  # reused, not rebuilt
    (other,) = build_many([src.replace("simd_sum(v) + v", "simd_sum(v) - v")])
    assert other != first


def test_parse_rewrites_threadgroup_memory_and_launcher():
    x, call = _small_call()
    parsed = parse_source(metal_source(_small_kernel("control", CONTROL), **call))
    assert "emu::tg_alloc" in parsed.cpp and "threadgroup float buf" not in parsed.cpp
    # MLX adds only the attributes the body mentions (simd_sum needs none).
    assert [p.name for p in parsed.params] == ["x", "out", "thread_index_in_threadgroup",
                                               "thread_position_in_grid"]
    assert "metal::simd_sum(emu::Site(" in parsed.cpp
    assert parsed.instantiation.startswith(parsed.kernel_name)
    assert os.path.basename(str(cache_dir())) == "emulator"
