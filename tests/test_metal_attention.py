"""The multi-row (2..16 query rows) block attention kernels, run through the CPU Metal emulator against
mx.fast.scaled_dot_product_attention (float32 oracle, the same causal block mask), with planted bugs, in
the traffic model, and routed through the race gate."""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from metal_emulator import OutOfBoundsError, run_kernel  # noqa: E402

from mlx_dflash.kernels import attention as attn  # noqa: E402
from mlx_dflash.kernels import traffic as traffic  # noqa: E402
from metal_fakes import FixedTimer  # noqa: E402
from mlx_dflash.kernels.race_gate import RaceGate  # noqa: E402

DTYPES = {"f16": mx.float16, "bf16": mx.bfloat16, "f32": mx.float32}
ATOL = {"f32": 2e-5, "f16": 2e-3, "bf16": 1.6e-2}  # output rounding (values ~1) + summation order


def make(rows, hkv, groups, d, keys, alloc, dt, seed=0):
    a, b, c = mx.random.split(mx.random.key(seed * 1009 + rows * 31 + keys), 3)
    dtype = DTYPES[dt]
    q = mx.random.normal((1, hkv * groups, rows, d), key=a).astype(dtype)
    k = mx.random.normal((1, hkv, alloc, d), key=b).astype(dtype)
    v = mx.random.normal((1, hkv, alloc, d), key=c).astype(dtype)
    return q, k, v


def emulate(q, k, v, keys, kernels=None, traffic_=False, lengths=None, threads=None, sees=None):
    (k1, c1), (k2, c2) = attn.attention_calls(q, k, v, q.shape[-1] ** -0.5, keys, lengths, threads, sees)
    k1, k2 = kernels or (k1, k2)
    first = run_kernel(k1, **c1, traffic=traffic_)
    second = run_kernel(k2, **{**c2, "inputs": [*first.outputs, c2["inputs"][2]]}, traffic=traffic_)
    return second.outputs[0].reshape(q.shape), first, second, (c1, c2)


def oracle(q, k, v, keys, lengths=None):
    f = mx.float32
    return attn.reference_attention(q.astype(f), k.astype(f), v.astype(f), q.shape[-1] ** -0.5, keys, lengths)


def check(rows, hkv, groups, d, keys, alloc, dt):
    q, k, v = make(rows, hkv, groups, d, keys, alloc, dt)
    y, first, _, (c1, _) = emulate(q, k, v, keys)
    assert y.dtype == q.dtype
    err = np.abs(np.array(y.astype(mx.float32)) - np.array(oracle(q, k, v, keys)))
    assert np.isfinite(err).all() and err.max() <= ATOL[dt], err.max()
    return first, c1


# (rows, kv heads, GQA, head dim, keys attended, cache buffer length, dtype): ragged key counts, a cache
# buffer longer than the keys attended, several key chunks.
QUICK = [(16, 1, 4, 128, 37, 64, "f32"), (4, 1, 8, 64, 600, 620, "bf16")]  # 1 and 2 key chunks
GRID = [(rows, 1 if g == 8 else 2, g, d, keys, keys + (rows % 3) * 7, ("f16", "bf16", "f32")[rows % 3])
        for rows in range(2, 17) for g in (1, 4, 8) for d in (64, 128)
        for keys in [rows + 3 * rows * g % 61 if (rows + g + d // 64) % 2 else 517 + rows]]


def test_the_cases_reach_every_supported_shape_and_several_key_chunks():
    """The grid emulates every row count and head dim the kernel accepts; the default tier's cases run
    both one key chunk and several (pass 2's merge)."""
    assert {c[0] for c in GRID} == set(range(attn.MIN_ROWS, attn.MAX_ROWS + 1))
    assert {c[3] for c in GRID} == set(attn.HEAD_DIMS)
    chunks = {attn.attention_calls(*make(*c)[:3], 1.0, c[4])[0][1]["grid"][2] for c in QUICK}
    assert 1 in chunks and max(chunks) > 1


@pytest.mark.emulator
@pytest.mark.parametrize("rows,hkv,groups,d,keys,alloc,dt", QUICK, ids=str)
def test_block_attention_matches_sdpa(rows, hkv, groups, d, keys, alloc, dt):
    first, call = check(rows, hkv, groups, d, keys, alloc, dt)
    chunks = call["grid"][2]
    assert first.stats["threadgroups"] == hkv * chunks


@pytest.mark.slow
@pytest.mark.emulator
@pytest.mark.parametrize("rows,hkv,groups,d,keys,alloc,dt", GRID, ids=str)
def test_block_attention_grid_matches_sdpa(rows, hkv, groups, d, keys, alloc, dt):
    check(rows, hkv, groups, d, keys, alloc, dt)


def batch_of(lengths, rows, hkv, groups, d, dt, padding=9):
    """q, k, v of a batch cache: row b's keys are its first lengths[b] (the rest of the buffer is padding)."""
    a, b, c = mx.random.split(mx.random.key(sum(lengths) + rows), 3)
    dtype, batch, alloc = DTYPES[dt], len(lengths), max(lengths) + padding
    q = mx.random.normal((batch, hkv * groups, rows, d), key=a).astype(dtype)
    k = mx.random.normal((batch, hkv, alloc, d), key=b).astype(dtype)
    v = mx.random.normal((batch, hkv, alloc, d), key=c).astype(dtype)
    return q, k, v


# (row lengths, rows, kv heads, GQA, head dim, dtype): a row shorter than the first key chunk beside longer ones
RAGGED = [([600, 250, 520], 4, 1, 4, 64, "f32"), ([37, 16, 40], 16, 2, 2, 128, "bf16")]


@pytest.mark.emulator
@pytest.mark.parametrize("lengths,rows,hkv,groups,d,dt", RAGGED, ids=str)
def test_each_batch_row_attends_its_own_length(lengths, rows, hkv, groups, d, dt):
    """A batch cache's rows of different lengths: row b's queries are the last of its lengths[b] keys, and
    the keys past them (padding, another row's longer past) are never seen."""
    q, k, v = batch_of(lengths, rows, hkv, groups, d, dt)
    keys = max(lengths)
    y, _, _, (c1, _) = emulate(q, k, v, keys, lengths=lengths)
    want = oracle(q, k, v, keys, lengths)
    err = np.abs(np.array(y.astype(mx.float32)) - np.array(want))
    assert np.isfinite(err).all() and err.max() <= ATOL[dt], err.max()
    if dt == "f32":  # the case with several key chunks, one of which the short row cannot see
        assert min(lengths) <= c1["inputs"][-1] * (c1["grid"][2] - 1)  # its last chunk starts past the short row
    as_if_all_long = oracle(q, k, v, keys)
    assert not np.allclose(np.array(y.astype(mx.float32)), np.array(as_if_all_long), atol=1e-3)


# The worst the router sends: GQA 8 x 16 rows x head dim 128 in float32 (pass 1 at 512 threads, 80 floats live per
# thread), at each launch size the race gate may retry at; and a ragged batch of 8 rows (MLX binds 8 or more
# lengths as `device` memory, fewer as `constant`).
WORST = (16, 1, 8, 128, 70, 80, "f32")
RAGGED_8 = ([70, 64, 50, 33, 16, 69, 41, 20], 4, 1, 4, 64, "f16")


@pytest.mark.emulator
@pytest.mark.parametrize("threads", [512, 128, 32])
def test_the_worst_shape_at_each_launch_size(threads):
    q, k, v = make(*WORST)
    y, _, _, (c1, _) = emulate(q, k, v, WORST[4], threads=threads)
    assert c1["threadgroup"] == (threads, 1, 1) and threads in attn.thread_sizes(q, k)
    err = np.abs(np.array(y) - np.array(oracle(q, k, v, WORST[4])))
    assert np.isfinite(err).all() and err.max() <= ATOL["f32"], err.max()


@pytest.mark.emulator
def test_a_ragged_batch_of_eight_rows():
    from mlx_dflash.kernels.source import metal_source

    lengths, *shape = RAGGED_8
    q, k, v = batch_of(lengths, *shape)
    y, _, _, (c1, _) = emulate(q, k, v, max(lengths), lengths=lengths)
    err = np.abs(np.array(y.astype(mx.float32)) - np.array(oracle(q, k, v, max(lengths), lengths)))
    assert np.isfinite(err).all() and err.max() <= ATOL["f16"], err.max()
    (kernel, call), _ = attn.attention_calls(q, k, v, 0.125, max(lengths), lengths)
    assert "const device int32_t* lengths" in metal_source(kernel, **call)


@pytest.mark.metal
@pytest.mark.parametrize("case", ["worst", "ragged 8"])
def test_the_worst_shapes_on_metal_at_every_size_metal_accepts(case):
    """On a Mac: each launch size of the gate's ladder that Metal accepts computes MLX's result, and at least
    one does; a refused one is refused with the message the gate reads its limit from."""
    if case == "worst":
        (rows, hkv, groups, d, _, _, dt), lengths = WORST, None
        q, k, v = make(rows, hkv, groups, d, 2048, 2048, dt)
    else:
        lengths, *shape = RAGGED_8
        q, k, v = batch_of(lengths, *shape)
    keys = k.shape[2] if lengths is None else max(lengths)
    ran = []
    for threads in attn.thread_sizes(q, k):
        try:
            y = attn.multi_row_attention(q, k, v, q.shape[-1] ** -0.5, keys, lengths, threads)
            mx.eval(y)
        except ValueError as e:
            assert "maximum allowed threads per threadgroup" in str(e)
            continue
        ran.append(threads)
        err = np.abs(np.array(y.astype(mx.float32)) - np.array(oracle(q, k, v, keys, lengths)))
        assert err.max() <= ATOL[RAGGED_8[-1] if lengths else "f32"], (threads, err.max())
    assert ran


@pytest.mark.emulator
def test_planted_one_length_for_every_row_is_caught():
    lengths, rows, hkv, groups, d, dt = RAGGED[0]
    q, k, v = batch_of(lengths, rows, hkv, groups, d, dt)
    planted = _planted("mr_attention_partial.metal", "const int S = lengths[b];", "const int S = lengths[0];")
    y = emulate(q, k, v, max(lengths), kernels=(planted, attn.combine_kernel()), lengths=lengths)[0]
    assert not np.allclose(np.array(y), np.array(oracle(q, k, v, max(lengths), lengths)), atol=1e-3)


def _planted(file, old, new):
    header, body = attn.read_metal_file(file)
    assert body.count(old) == 1, old
    if "partial" in file:
        return mx.fast.metal_kernel(
            name="planted_partial", input_names=["q", "k", "v", "scale", "lengths", "sees", "SPLIT"],
            output_names=["o_part", "ml"],
            source=body.replace(old, new), header=header, ensure_row_contiguous=False)
    return mx.fast.metal_kernel(name="planted_combine", input_names=["o_part", "ml", "NC"], output_names=["out"],
                                source=body.replace(old, new), header=header, ensure_row_contiguous=False)


PLANTED = {
    "no causal mask in the block": ("mr_attention_partial.metal",
                                    "if (key >= before && ((seen >> uint(key - before)) & 1u) == 0u) {",
                                    "if (false) {"),
    "wrong GQA head": ("mr_attention_partial.metal", "(hkv * G + qr / L) * q_strides[1]", "(hkv + qr / L) * q_strides[1]"),
    "missing barrier after staging": ("mr_attention_partial.metal", "    threadgroup_barrier(mem_flags::mem_threadgroup);\n#pragma unroll",
                                      "#pragma unroll"),
    "chunks not rescaled": ("mr_attention_combine.metal", "const float wgt = metal::exp(mls[2 * c] - mx_);",
                            "const float wgt = 1.0f;"),
    "online softmax not rescaled": ("mr_attention_partial.metal", "l[t] = l[t] * corr + p;", "l[t] = l[t] + p;"),
}


QUICK_PLANTED = ("no causal mask in the block", "wrong GQA head", "chunks not rescaled")


@pytest.mark.emulator
@pytest.mark.parametrize("name", [n if n in QUICK_PLANTED else pytest.param(n, marks=pytest.mark.slow)
                                  for n in PLANTED])
def test_planted_bugs_are_caught(name):
    file, old, new = PLANTED[name]
    rows, hkv, groups, d, keys, alloc, dt = 6, 2, 4, 64, 300, 300, "f32"  # 2 key chunks
    q, k, v = make(rows, hkv, groups, d, keys, alloc, dt)
    (k1, _), (k2, _) = attn.attention_calls(q, k, v, d ** -0.5, keys)
    planted = _planted(file, old, new)
    y = emulate(q, k, v, keys, kernels=(planted, k2) if "partial" in file else (k1, planted))[0]
    assert not np.allclose(np.array(y), np.array(oracle(q, k, v, keys)), atol=1e-3)


def random_trees(batch: int, rows: int, seed: int) -> np.ndarray:
    """[B, rows, rows] ancestor-or-self of a random draft tree per batch row: node 0 the anchor, node i's parent one
    of the nodes before it (so a node's siblings may come before it), each row's tree its own."""
    rng = np.random.default_rng(seed)
    ancestors = np.zeros((batch, rows, rows), bool)
    for b in range(batch):
        for i in range(rows):
            ancestors[b, i, i] = True
            if i:
                parent = int(rng.integers(0, i)) if i > 2 else i - 1
                ancestors[b, i] |= ancestors[b, parent]
    return ancestors


def tree_oracle(q, k, v, lengths, ancestors):
    """MLX's SDPA in float32 with an explicit mask, built here from the trees: row b's node i sees the keys before
    its block and the block keys of its ancestors and itself (the block: the last `rows` of its lengths[b] keys)."""
    batch, _, rows, _ = q.shape
    keys = max(lengths)
    mask = np.zeros((batch, 1, rows, keys), bool)
    for b, n in enumerate(lengths):
        mask[b, 0, :, : n - rows] = True
        mask[b, 0, :, n - rows: n] = ancestors[b]
    f = mx.float32
    return mx.fast.scaled_dot_product_attention(q.astype(f), k[:, :, :keys].astype(f), v[:, :, :keys].astype(f),
                                                scale=q.shape[-1] ** -0.5, mask=mx.array(mask))


def sees_of(ancestors) -> mx.array:
    from mlx_dflash.models.tree_verify import ancestor_bits

    return ancestor_bits(mx.array(ancestors))


# (row lengths, nodes, kv heads, GQA, head dim, dtype): several key chunks, a short row, 16 nodes
TREES = [([600, 250, 520], 8, 1, 4, 64, "f32"), ([37, 20, 40], 16, 2, 2, 128, "bf16")]


@pytest.mark.emulator
@pytest.mark.parametrize("lengths,rows,hkv,groups,d,dt", TREES, ids=str)
def test_each_tree_node_sees_its_context_and_ancestors_only(lengths, rows, hkv, groups, d, dt):
    """A batch of draft trees: the kernel's source, given each node's ancestor bits, equals SDPA with the explicit
    mask; a chain's (causal) answer differs, so the bits are what decides."""
    q, k, v = batch_of(lengths, rows, hkv, groups, d, dt)
    ancestors = random_trees(len(lengths), rows, seed=rows)
    y = emulate(q, k, v, max(lengths), lengths=lengths, sees=sees_of(ancestors))[0]
    want = tree_oracle(q, k, v, lengths, ancestors)
    err = np.abs(np.array(y.astype(mx.float32)) - np.array(want))
    assert np.isfinite(err).all() and err.max() <= ATOL[dt], err.max()
    assert not np.allclose(np.array(y.astype(mx.float32)), np.array(oracle(q, k, v, max(lengths), lengths)), atol=1e-3)
    reference = attn.reference_attention(*(a.astype(mx.float32) for a in (q, k, v)), d ** -0.5, max(lengths), lengths,
                                         sees_of(ancestors))  # MLX's path for a tree: the same mask from the bits
    assert np.abs(np.array(reference) - np.array(want)).max() <= 1e-5


PLANTED_TREES = {
    "a sibling visible": ("if (key >= before && ((seen >> uint(key - before)) & 1u) == 0u) {",
                          "if (key >= before && key - before > qr % L) {"),  # causal: the nodes before it, siblings too
    "an ancestor hidden": ("const uint seen = sees[b * L + qr % L];", "const uint seen = sees[b * L + qr % L] & ~1u;"),
    "the wrong row's mask": ("const uint seen = sees[b * L + qr % L];", "const uint seen = sees[qr % L];"),
}


@pytest.mark.emulator
@pytest.mark.parametrize("name", PLANTED_TREES)
def test_planted_tree_mask_bugs_are_caught(name):
    lengths, rows, hkv, groups, d, dt = TREES[0]
    q, k, v = batch_of(lengths, rows, hkv, groups, d, dt)
    ancestors = random_trees(len(lengths), rows, seed=rows)
    planted = _planted("mr_attention_partial.metal", *PLANTED_TREES[name])
    y = emulate(q, k, v, max(lengths), kernels=(planted, attn.combine_kernel()), lengths=lengths,
                sees=sees_of(ancestors))[0]
    assert not np.allclose(np.array(y), np.array(tree_oracle(q, k, v, lengths, ancestors)), atol=1e-3)


@pytest.mark.slow
@pytest.mark.emulator
def test_planted_read_past_the_keys_is_caught():
    q, k, v = make(4, 1, 1, 64, 300, 300, "f32")
    planted = _planted("mr_attention_partial.metal", "const int k_hi = min(S, k_lo + SPLIT);",
                       "const int k_hi = k_lo + SPLIT;")
    with pytest.raises(OutOfBoundsError):
        emulate(q, k, v, 300, kernels=(planted, attn.combine_kernel()))


@pytest.mark.emulator
@pytest.mark.parametrize("shape", [(6, 2, 4, 64, 530, 540, "bf16"),
                                   pytest.param((12, 1, 8, 128, 280, 280, "f32"), marks=pytest.mark.slow)], ids=str)
def test_traffic_model_equals_emulator_counts(shape):
    rows, hkv, groups, d, keys, alloc, dt = shape
    q, k, v = make(*shape)
    _, first, second, _ = emulate(q, k, v, keys, traffic_=True)
    t1, t2 = first.traffic, second.traffic
    x_bytes = q.dtype.size
    model = traffic.attention_ours(1, hkv * groups, hkv, rows, keys, d, x_bytes)
    assert t1["q"]["read"] == model["q"]
    assert (t1["k"]["read"], t1["v"]["read"]) == (model["k"], model["v"])  # each key once per kv head
    assert t1["o_part"]["written"] + t1["ml"]["written"] == model["partials_written"]
    assert t2["o_part"]["read"] + t2["ml"]["read"] == model["partials_read"]
    assert t2["out"]["written"] == model["out"]
    assert first.stats["barriers"] == model["barriers"]
    assert first.stats["threadgroups"] + second.stats["threadgroups"] == model["threadgroups"]


def test_traffic_model_for_the_published_shapes():
    """K/V are read once per kv head, not once per query head; the partials stay within their share."""
    for hq, hkv in ((32, 8), (32, 32), (16, 2)):
        for d in (64, 128):
            for rows in range(2, 17):
                for keys in (512, 4096, 32768):
                    t = traffic.attention_ours(1, hq, hkv, rows, keys, d, 2)
                    base = traffic.attention_unavoidable_bytes(1, hq, hkv, rows, keys, d, 2)
                    assert t["k"] + t["v"] == 2 * hkv * keys * d * 2
                    if t["chunks"] > 1:  # more chunks only while their partials stay within the share
                        assert t["partials_written"] <= attn.MAX_PARTIAL_SHARE * (t["k"] + t["v"]) * 1.01
                    if keys >= 4096 and hkv < hq:  # long caches: K/V dominate, partials are the overhead
                        assert traffic.attention_device_bytes(t) <= 1.4 * base


def test_block_attention_routes_through_the_gate(tmp_path, monkeypatch):
    """Metal forced, a CPU stand-in for our kernel: the gate races once per (shape, rows, cache bin)."""
    timer = FixedTimer(1.0, 2.0)

    ran = []

    def stand_in(q, k, v, scale, keys, lengths=None, threads=None, sees=None):
        ran.append(q.shape[2])
        return attn.reference_attention(q, k, v, scale, keys, lengths, sees)

    gate = RaceGate(tmp_path / "v.json", timer=timer)
    monkeypatch.setattr(attn, "metal_available", lambda: True)
    monkeypatch.setattr(attn, "multi_row_attention", stand_in)
    monkeypatch.setattr(attn, "shared_gate", lambda: gate)
    q, k, v = make(8, 2, 4, 64, 100, 100, "f32")
    ref = attn.reference_attention(q, k, v, 0.125, 100)
    for _ in range(2):
        assert mx.allclose(attn.block_attention(q, k, v, 0.125, 100), ref)
    assert timer.races == 1 and ran == [8, 8, 8]  # race (numerics), then two routed calls
    (key,) = gate.verdicts
    assert key.endswith("|mr_attention|float32|B1|Hq8|Hkv2|D64|keys<=128|rows8")
    assert mx.allclose(attn.block_attention(q[:, :, :1], k, v, 0.125, 100), attn.reference_attention(
        q[:, :, :1], k, v, 0.125, 100))  # one row: MLX's, no race
    assert timer.races == 1
    attn.block_attention(q, k, v, 0.125, 100, route="mlx")
    assert ran == [8, 8, 8]
    sees = sees_of(random_trees(1, 8, seed=3))  # a tree's verify races apart from a chain's
    assert mx.allclose(attn.block_attention(q, k, v, 0.125, 100, sees=sees),
                       attn.reference_attention(q, k, v, 0.125, 100, sees=sees))
    assert timer.races == 2 and ran == [8, 8, 8, 8, 8] and any(key.endswith("|tree8") for key in gate.verdicts)
