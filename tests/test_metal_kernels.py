"""The wide (6..16-row) quantized matmul kernel, run through the CPU Metal emulator, and its Python side.

Tolerances (oracle = mx.quantized_matmul in float32 on the same dtype-rounded x/scales/biases): the kernel
accumulates in float32, so the only differences are summation order (atol = 2e-5 * max|ref|) and the final
rounding to the output dtype (rtol: float32 1e-6, float16 2^-11, bfloat16 2^-8: half an ulp).
"""

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))

from metal_emulator import OutOfBoundsError, build_many, run_kernel, run_source, unavailable_reason  # noqa: E402

from conftest import tiny_quantized_llama  # noqa: E402
from mlx_dflash.kernels import wide_qmm as kernels  # noqa: E402
from mlx_dflash.kernels.source import metal_source  # noqa: E402

RTOL = {mx.float32: 1e-6, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}
DTYPES = {"f16": mx.float16, "bf16": mx.bfloat16, "f32": mx.float32}


def make_case(m, k, n, group_size, bits, dtype, scale_dtype=None, seed=0):
    key = mx.random.key(seed * 1000 + m * 31 + n)
    kw, kx = mx.random.split(key)
    w = mx.random.normal((n, k), key=kw)
    wq, s, b = mx.quantize(w, group_size, bits)
    sd = scale_dtype or dtype
    x = mx.random.normal((m, k), key=kx).astype(dtype)
    return x, wq, s.astype(sd), b.astype(sd)


def oracle(x, wq, s, b, group_size, bits):
    f = mx.float32
    return mx.quantized_matmul(x.astype(f), wq, s.astype(f), b.astype(f), transpose=True,
                               group_size=group_size, bits=bits)


def assert_close(y, ref, dtype):
    assert y.dtype == dtype
    y = np.array(y.astype(mx.float32))
    ref = np.array(ref)
    assert y.shape == ref.shape
    assert np.isfinite(y).all(), "non-finite outputs"
    bound = RTOL[dtype] * np.abs(ref) + 2e-5 * np.abs(ref).max()
    err = np.abs(y - ref)
    assert (err <= bound).all(), f"max err {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


def emulate(x, wq, s, b, group_size, bits, threads=None, **kw):
    kernel, call = kernels.wide_qmm_call(x, wq, s, b, group_size, bits, threads)
    return run_kernel(kernel, **call, **kw)


# Every M with one config (ragged N = 37, K = 192: one full and one partial 128-wide x tile) ...
FULL_M = [(m, 192, 37, 64, 4, "bf16") for m in range(kernels.MIN_ROWS, kernels.MAX_ROWS + 1)]
# ... and every bits x group size x dtype for three M, ragged N = 45, K = 3 groups (partial tiles for
# group sizes 32 and 64).
GRID = [
    (m, 3 * gs, 45, gs, bits, dt)
    for m in (6, 11, 16)
    for bits in (4, 8)
    for gs in (32, 64, 128)
    for dt in ("f16", "bf16", "f32")
]
# Edge shapes: N smaller than one threadgroup, N a multiple of the threadgroup width, several tiles.
EDGES = [(9, 64, 5, 32, 8, "f32"), (12, 256, 64, 64, 4, "f16"), (6, 512, 16, 128, 4, "bf16")]
CASES = FULL_M + GRID + EDGES
# The default tier: both ends of the row range and one row count between, every bits, group size and
# dtype at least once, ragged N, partial tiles, the edge shapes. The whole grid is `-m slow`.
QUICK = [FULL_M[0], FULL_M[-1], (11, 96, 45, 32, 8, "f16"), (16, 384, 45, 128, 8, "f32"),
         (13, 192, 45, 64, 4, "f32"), *EDGES]


def _sources(cases):
    sources = []
    for m, k, n, gs, bits, dt in cases:
        x, wq, s, b = make_case(m, k, n, gs, bits, DTYPES[dt])
        kernel, call = kernels.wide_qmm_call(x, wq, s, b, gs, bits)
        sources.append(metal_source(kernel, **call))
    return sorted(set(sources))


@pytest.fixture(scope="module")
def prebuilt():
    """Compile the default-tier variants up front, two g++ processes at a time (cached by hash)."""
    if unavailable_reason() is None:
        build_many(_sources(QUICK), jobs=2)


@pytest.fixture(scope="module")
def prebuilt_grid():
    if unavailable_reason() is None:
        build_many(_sources(CASES), jobs=2)


def test_the_cases_reach_every_supported_config():
    """Every row count the kernel accepts is emulated, and every bits, group size and dtype it accepts
    also in the default tier (with both ends of the row range)."""
    assert {c[0] for c in CASES} == set(range(kernels.MIN_ROWS, kernels.MAX_ROWS + 1))
    for cases in (CASES, QUICK):
        assert {c[0] for c in cases} >= {kernels.MIN_ROWS, kernels.MAX_ROWS}
        assert {c[4] for c in cases} == set(kernels.SUPPORTED_BITS)
        assert {c[3] for c in cases} == set(kernels.SUPPORTED_GROUP_SIZES)
        assert {DTYPES[c[5]] for c in cases} == set(kernels.SUPPORTED_DTYPES)


def check_emulated(m, k, n, gs, bits, dt):
    dtype = DTYPES[dt]
    x, wq, s, b = make_case(m, k, n, gs, bits, dtype)
    launch = emulate(x, wq, s, b, gs, bits)
    assert_close(launch.outputs[0], oracle(x, wq, s, b, gs, bits), dtype)
    # Every threadgroup owns 2 * NT features and stages x in K tiles of 512 (<= 8 rows) or 256 values,
    # with 2 barriers per tile.
    nt = kernels.wide_threads(dtype)
    tgs = -(-n // (2 * nt))
    assert launch.stats["threadgroups"] == tgs
    assert launch.stats["barriers"] == tgs * 2 * -(-k // (512 if m <= 8 else 256))


@pytest.mark.emulator
@pytest.mark.parametrize("m,k,n,gs,bits,dt", QUICK, ids=lambda v: str(v))
def test_wide_qmm_matches_quantized_matmul(m, k, n, gs, bits, dt, prebuilt):
    check_emulated(m, k, n, gs, bits, dt)


@pytest.mark.slow
@pytest.mark.emulator
@pytest.mark.parametrize("m,k,n,gs,bits,dt", [c for c in CASES if c not in QUICK], ids=lambda v: str(v))
def test_wide_qmm_grid_matches_quantized_matmul(m, k, n, gs, bits, dt, prebuilt_grid):
    check_emulated(m, k, n, gs, bits, dt)


WORST = (16, 128, 45, 64, 4, "f32")  # 16 rows in float32: the most threads (512) and registers


@pytest.mark.emulator
@pytest.mark.parametrize("threads", [512, 64, 32])
def test_the_worst_shape_at_each_launch_size(threads):
    m, k, n, gs, bits, dt = WORST
    dtype = DTYPES[dt]
    x, wq, s, b = make_case(m, k, n, gs, bits, dtype)
    assert threads in kernels.thread_sizes(dtype)
    assert_close(emulate(x, wq, s, b, gs, bits, threads).outputs[0], oracle(x, wq, s, b, gs, bits), dtype)


@pytest.mark.metal
def test_the_worst_shape_on_metal_at_every_size_metal_accepts():
    """On a Mac: 16 rows of a 4096-wide float32 layer at each size of the gate's ladder Metal accepts; a refused
    one is refused with the message the gate reads its limit from."""
    x, wq, s, b = make_case(16, 4096, 4096, 64, 4, mx.float32)
    ran = []
    for threads in kernels.thread_sizes(mx.float32):
        try:
            y = kernels.wide_quantized_matmul(x, wq, s, b, 64, 4, threads)
            mx.eval(y)
        except ValueError as e:
            assert "maximum allowed threads per threadgroup" in str(e)
            continue
        ran.append(threads)
        assert_close(y, oracle(x, wq, s, b, 64, 4), mx.float32)
    assert ran


@pytest.mark.metal
@pytest.mark.parametrize("m,k,n,gs,bits,dt", CASES, ids=lambda v: str(v))
def test_wide_qmm_on_metal_matches_quantized_matmul(m, k, n, gs, bits, dt):
    """The real kernel on the GPU (compiled by Metal) against MLX's own quantized matmul in float32."""
    dtype = DTYPES[dt]
    x, wq, s, b = make_case(m, k, n, gs, bits, dtype)
    y = kernels.wide_quantized_matmul(x, wq, s, b, gs, bits)
    assert_close(y, oracle(x, wq, s, b, gs, bits), dtype)
    y3 = kernels.wide_quantized_matmul(x.reshape(1, m, k), wq, s, b, gs, bits)
    assert y3.shape == (1, m, n) and mx.array_equal(y3.reshape(m, n), y)


@pytest.mark.emulator
def test_reverse_schedule_and_mixed_scale_dtype():
    """Threads run in the opposite order (other read/write interleavings) and float32 activations
    with bfloat16 scales/biases (their dtype only changes the generated signature)."""
    x, wq, s, b = make_case(11, 256, 40, 64, 4, mx.float32, scale_dtype=mx.bfloat16)
    launch = emulate(x, wq, s, b, 64, 4, reverse=True)
    assert_close(launch.outputs[0], oracle(x, wq, s, b, 64, 4), mx.float32)


@pytest.mark.emulator
def test_planted_missing_barriers_are_caught():
    """The real kernel with either barrier removed gives poison (NaN) or wrong outputs in the emulator."""
    header, body = kernels.read_metal_file("wide_qmm.metal")
    barrier = "threadgroup_barrier(mem_flags::mem_threadgroup);"
    assert body.count(barrier) == 2
    first = body.index(barrier)
    second = body.index(barrier, first + 1)
    no_raw = body[:first] + body[first + len(barrier):]  # read x tile before it is staged
    no_war = body[:second] + body[second + len(barrier):]  # restage while others still read
    x, wq, s, b = make_case(8, 1024, 32, 64, 4, mx.float32)  # two 512-wide x tiles
    ref = np.array(oracle(x, wq, s, b, 64, 4))
    _, call = kernels.wide_qmm_call(x, wq, s, b, 64, 4)
    outs = []
    for i, src in enumerate((no_raw, no_war)):
        k = mx.fast.metal_kernel(name=f"planted_{i}", input_names=["x", "w", "scales", "biases", "K", "N"],
                                 output_names=["y"], source=src, header=header)
        outs.append(np.array(run_kernel(k, **call).outputs[0]))
    assert np.isnan(outs[0]).any()
    assert not np.allclose(outs[1], ref, rtol=1e-3, atol=1e-2)


@pytest.mark.emulator
@pytest.mark.parametrize("old,new", [
    ("const int nf = min(FL, N - f0);", "const int nf = FL;"),  # ragged N: loads/stores past the last row
    ("  for (int j = 0; j < nf; j++) {", "  for (int j = 0; j < FL; j++) {"),  # ragged N: stores past N
    ("const int tile = min(BK, K - k0);", "const int tile = BK;"),  # K tail: weights past the last row
])
def test_planted_bounds_bugs_are_caught(old, new):
    header, body = kernels.read_metal_file("wide_qmm.metal")
    assert body.count(old) == 1
    kernel = mx.fast.metal_kernel(name="planted_bounds", input_names=["x", "w", "scales", "biases", "K", "N"],
                                  output_names=["y"], source=body.replace(old, new), header=header)
    x, wq, s, b = make_case(6, 96, 45, 32, 4, mx.float32)
    _, call = kernels.wide_qmm_call(x, wq, s, b, 32, 4)
    with pytest.raises(OutOfBoundsError):
        run_kernel(kernel, **call)


def test_generated_signature():
    """What MLX generates for the kernel: buffer order, scalar params in `constant` space, attributes,
    and one template instantiation per (T, R, GS, BITS)."""
    x, wq, s, b = make_case(16, 128, 24, 32, 8, mx.float16)
    kernel, call = kernels.wide_qmm_call(x, wq, s, b, 32, 8)
    src = metal_source(kernel, **call)
    for line in ("const device float16_t* x [[buffer(0)]]", "const device uint32_t* w [[buffer(1)]]",
                 "const constant int32_t& K [[buffer(4)]]", "const constant int32_t& N [[buffer(5)]]",
                 "device float16_t* y [[buffer(6)]]", "uint3 threadgroup_position_in_grid"):
        assert line in src
    assert "<float16_t, 16, 32, 8, 256>" in src
    assert call["grid"] == (256, 1, 1) and call["threadgroup"] == (256, 1, 1)


def test_wide_qmm_call_rejects_unsupported():
    x, wq, s, b = make_case(6, 128, 16, 64, 4, mx.float32)
    for bad in (dict(x=x[:5]), dict(x=mx.concatenate([x, x, x])), dict(x=x[None]), dict(biases=None)):
        args = dict(x=x, w=wq, scales=s, biases=b, group_size=64, bits=4) | bad
        with pytest.raises(ValueError):
            kernels.wide_qmm_call(**args)
    with pytest.raises(ValueError):
        kernels.wide_qmm_call(x, wq, s, b, 64, 2)


def test_wide_qmm_without_metal_says_so(monkeypatch):
    monkeypatch.setattr(kernels, "metal_available", lambda: False)
    x, wq, s, b = make_case(6, 128, 16, 64, 4, mx.float32)
    with pytest.raises(RuntimeError, match="needs Metal"):
        kernels.wide_quantized_matmul(x, wq, s, b, 64, 4)


@pytest.mark.emulator
def test_emulator_source_roundtrip_is_exact():
    """run_source on the printed text equals run_kernel (the emulator runs exactly that text)."""
    x, wq, s, b = make_case(6, 64, 16, 32, 8, mx.float32)
    kernel, call = kernels.wide_qmm_call(x, wq, s, b, 32, 8)
    src = metal_source(kernel, **call)
    a = run_source(src, call["inputs"], call["output_shapes"], call["output_dtypes"], call["grid"],
                   call["threadgroup"]).outputs[0]
    assert mx.array_equal(a, run_kernel(kernel, **call).outputs[0])


# ---------------------------------------------------------------------------------------------------
# WideQuantizedLinear / install_wide_kernels


def test_metal_available_follows_mlx(monkeypatch):
    assert kernels.metal_available() is bool(mx.metal.is_available())

    def broken():
        raise RuntimeError("no device")

    monkeypatch.setattr(mx.metal, "is_available", broken)
    assert kernels.metal_available() is False


@pytest.mark.parametrize("bias", [True, False])
def test_wide_linear_equals_quantized_linear_without_metal(bias, monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "metal_available", lambda: False)
    monkeypatch.setattr(kernels, "wide_quantized_matmul", lambda *a, **k: calls.append(a))
    mx.random.seed(3)
    ql = nn.QuantizedLinear(128, 48, bias=bias, group_size=64, bits=4)
    if bias:
        ql.bias = mx.random.normal((48,))
    wl = kernels.WideQuantizedLinear(ql)
    for shape in [(1, 128), (6, 128), (1, 16, 128), (2, 4, 128), (20, 128)]:
        x = mx.random.normal(shape)
        assert mx.array_equal(wl(x), ql(x))
    assert calls == []  # without Metal: always mx.quantized_matmul
    assert wl["weight"] is ql["weight"] and wl["scales"] is ql["scales"] and wl["biases"] is ql["biases"]
    assert tree_flatten(wl.parameters()) == tree_flatten(ql.parameters())
    assert [k for k, _ in tree_flatten(wl.trainable_parameters())] == \
        [k for k, _ in tree_flatten(ql.trainable_parameters())]
    assert wl.unwrap() is ql


def test_wide_linear_routing_with_metal_forced(monkeypatch):
    calls = []

    def fake(x, w, scales, biases, group_size, bits, threads=None):
        calls.append(int(np.prod(x.shape[:-1])))
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)

    monkeypatch.setattr(kernels, "metal_available", lambda: True)
    monkeypatch.setattr(kernels, "wide_quantized_matmul", fake)
    ql = nn.QuantizedLinear(64, 32, bias=True, group_size=32, bits=8)
    wl = kernels.WideQuantizedLinear(ql, route="dflash")
    for m in [1, 5, 6, 8, 16, 17, 32]:
        x = mx.random.normal((1, m, 64))
        assert mx.array_equal(wl(x), ql(x))
    assert calls == [6, 6, 8, 8, 16, 16]  # forced: each new shape run alone once (a failure falls back), then used
    q2 = kernels.WideQuantizedLinear(nn.QuantizedLinear(64, 32, group_size=64, bits=2), route="dflash")
    q2(mx.random.normal((8, 64)))  # 2-bit: not a kernel config, stays on mx.quantized_matmul
    assert calls == [6, 6, 8, 8, 16, 16]


def test_a_batched_verify_routes_on_its_rows_times_its_width(monkeypatch):
    """MLX's quantized matmul and our wide kernel see a batch's rows x width as one matrix: 2 requests verifying
    5 tokens are 10 rows (ours), 4 x 5 are 20 (MLX's), whatever each request's own width."""
    calls = []

    def fake(x, w, scales, biases, group_size, bits, threads=None):
        calls.append(tuple(x.shape[:-1]))
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)

    monkeypatch.setattr(kernels, "metal_available", lambda: True)
    monkeypatch.setattr(kernels, "wide_quantized_matmul", fake)
    ql = nn.QuantizedLinear(64, 32, group_size=32, bits=4)
    wl = kernels.WideQuantizedLinear(ql, route="dflash")
    for shape in [(1, 5), (2, 5), (3, 2), (4, 4), (4, 5), (2, 16)]:
        x = mx.random.normal((*shape, 64))
        assert mx.array_equal(wl(x), ql(x))
    assert calls == [(2, 5)] * 2 + [(3, 2)] * 2 + [(4, 4)] * 2  # run alone once per shape, then used
    model = tiny_quantized_llama()
    kernels.install_wide_kernels(model, route="dflash")
    calls.clear()
    mx.eval(model(mx.zeros((2, 5), mx.int32)))  # two rows verifying 5 tokens each: every linear sees 10 rows
    assert calls and set(calls) == {(2, 5)}


def test_install_refuses_without_metal(monkeypatch):
    monkeypatch.setattr(kernels, "metal_available", lambda: False)
    model = tiny_quantized_llama()
    before = [(name, m) for name, m in model.named_modules()]
    assert kernels.install_wide_kernels(model) == 0
    after = [(name, m) for name, m in model.named_modules()]
    assert len(before) == len(after)
    assert all(a[0] == b[0] and a[1] is b[1] for a, b in zip(before, after))


def test_install_replaces_quantized_linears(monkeypatch):
    model = tiny_quantized_llama()
    tokens = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    expected = model(tokens)
    qnames = [n for n, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert len(qnames) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + lm_head
    params_before = tree_flatten(model.parameters())
    trainable_before = [k for k, _ in tree_flatten(model.trainable_parameters())]

    calls = []

    def fake(x, w, scales, biases, group_size, bits, threads=None):
        calls.append(x.shape)
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)

    monkeypatch.setattr(kernels, "metal_available", lambda: True)
    monkeypatch.setattr(kernels, "wide_quantized_matmul", fake)
    assert kernels.install_wide_kernels(model, route="dflash") == len(qnames)
    mods = dict(model.named_modules())
    assert all(type(mods[n]) is kernels.WideQuantizedLinear for n in qnames)
    assert not any(type(m) is nn.QuantizedLinear for m in mods.values())
    assert type(model.model.embed_tokens) is nn.QuantizedEmbedding  # only linears are swapped
    params_after = tree_flatten(model.parameters())
    assert [k for k, _ in params_after] == [k for k, _ in params_before]
    assert all(a is b for (_, a), (_, b) in zip(params_after, params_before))
    assert [k for k, _ in tree_flatten(model.trainable_parameters())] == trainable_before
    reference = tiny_quantized_llama()
    for m in (model, reference):
        m.unfreeze()
    assert [k for k, _ in tree_flatten(model.trainable_parameters())] == \
        [k for k, _ in tree_flatten(reference.trainable_parameters())]
    assert mx.array_equal(model(tokens), expected)
    shapes = {(m.weight.shape, m.group_size, m.bits) for n, m in mods.items() if n in qnames}
    assert len(calls) == len(qnames) + len(shapes)  # 8 rows: every linear went to the wide path (each shape first
    # run alone once)
    assert kernels.install_wide_kernels(model) == 0  # already wrapped
