"""Our Metal kernels checked on this machine, for `mlx-dflash doctor`.

* On a Mac (Metal): each kernel run on a few shapes, the worst the router sends among them, through a race
  gate of its own (the user's verdict cache is left alone) that soaks a winner longer than a first use does:
  the launch size that ran, the verdict, both timings and the soak's; then its result compared with MLX's
  own (quantized matmul, SDPA, in float32) within the tests' tolerances. A kernel that fails to compile,
  launch or run is reported with MLX's error: MLX's path serves that shape.
* Anywhere: the exact Metal source MLX generates for each of those launches (source.py): the sources
  ship with the package, their templates instantiate and this MLX accepts the calls. Compiling and
  running them needs Metal.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx

from . import attention as attn
from . import wide_qmm
from .race_gate import RaceGate, first_line

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
# The tests' tolerances. Wide matmul (tests/test_metal_kernels.py): |ours - MLX's| <= RTOL |MLX's| +
# 2e-5 max|MLX's|: float32 accumulation in both, so summation order plus half an ulp of the output dtype.
QMM_RTOL = {mx.float32: 1e-6, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}
QMM_ATOL_SHARE = 2e-5
# Attention (tests/test_metal_attention.py), outputs of size ~1: output rounding plus summation order.
ATTENTION_ATOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}

# (rows, K, N, group size, bits, dtype): both ends of the row range, 4 and 8 bits, the three dtypes, a
# 7B-class layer and its MLP width; 16 rows in float32 is the launch with the most threads and registers.
QMM_SHAPES = [(6, 4096, 4096, 64, 4, "float16"), (16, 4096, 4096, 64, 4, "float16"),
              (11, 4096, 14336, 64, 4, "bfloat16"), (16, 2048, 2048, 32, 8, "float32"),
              (16, 4096, 4096, 64, 4, "float32")]
# (rows, kv heads, query heads per kv head, head dim, keys, dtype[, each batch row's keys]): GQA 4 and 8,
# both head dims, short and long caches, a batch of rows of their own lengths (a ragged batch cache), and
# the worst the router sends: GQA 8 x 16 rows x head dim 128 in float32 (512 threads, the most registers),
# and a ragged batch of 8 rows (MLX binds 8 or more lengths as `device` memory, fewer as `constant`).
ATTENTION_SHAPES = [(2, 8, 4, 128, 1024, "float16"), (9, 8, 4, 128, 4096, "bfloat16"),
                    (16, 8, 4, 128, 4096, "float16"), (16, 2, 8, 64, 600, "float32"),
                    (4, 8, 4, 128, 2048, "float16", (2048, 1500, 600)), (16, 8, 8, 128, 2048, "float32"),
                    (4, 8, 4, 128, 1024, "float16", (1024, 1000, 900, 800, 700, 600, 500, 64)),
                    (8, 8, 4, 128, 1024, "float16", (1024, 700, 300), "tree")]  # each row a draft tree's nodes


def qmm_inputs(rows, k, n, group_size, bits, dtype, seed: int = 0):
    kw, kx = mx.random.split(mx.random.key(seed))
    wq, scales, biases = mx.quantize(mx.random.normal((n, k), key=kw), group_size, bits)
    dt = DTYPES[dtype]
    return mx.random.normal((rows, k), key=kx).astype(dt), wq, scales.astype(dt), biases.astype(dt)


def attention_inputs(rows, hkv, groups, d, keys, dtype, lengths=None, seed: int = 0):
    a, b, c = mx.random.split(mx.random.key(seed), 3)
    dt, batch = DTYPES[dtype], len(lengths or [keys])
    q = mx.random.normal((batch, hkv * groups, rows, d), key=a).astype(dt)
    k, v = (mx.random.normal((batch, hkv, keys, d), key=key).astype(dt) for key in (b, c))
    return q, k, v


def qmm_label(rows, k, n, group_size, bits, dtype) -> str:
    return f"{dtype} {rows}x{k} @ {k}x{n} {bits}-bit gs{group_size}"


def tree_sees(batch: int, rows: int):
    """`sees` of a draft tree in each batch row, for the checks: node i's parent is node (i - 1) // (b + 2) in
    row b (a binary tree in the first row, wider ones after), each node seeing its ancestors and itself."""
    words = []
    for b in range(batch):
        for i in range(rows):
            word, j = 1 << i, i
            while j:
                j = (j - 1) // (b + 2)
                word |= 1 << j
            words.append(word)
    return mx.array(words, dtype=mx.uint32).reshape(batch, rows)


def attention_case(rows, hkv, groups, d, keys, dtype, lengths=None, tree=None) -> tuple:
    """(q, k, v, lengths, sees) of one of ATTENTION_SHAPES (sees None: causal)."""
    q, k, v = attention_inputs(rows, hkv, groups, d, keys, dtype, lengths)
    return q, k, v, lengths, tree_sees(q.shape[0], rows) if tree else None


def attention_label(rows, hkv, groups, d, keys, dtype, lengths=None, tree=None) -> str:
    batch = f", a batch of {len(lengths)} of {'/'.join(map(str, lengths))} keys" if lengths else ""
    return f"{dtype} {rows} rows, {hkv * groups}/{hkv} heads, D{d}, {keys} keys{batch}{', trees' if tree else ''}"


def _identity(source: str) -> dict:
    """What identifies a generated source in a report: its length and hash (the same on every machine)."""
    return {"lines": len(source.splitlines()), "sha256": hashlib.sha256(source.encode()).hexdigest()[:16]}


def qmm_sources(shapes=None) -> list[dict]:
    """The Metal source MLX generates for each wide-kernel launch (no Metal needed)."""
    from .source import metal_source

    out = []
    for rows, k, n, gs, bits, dtype in shapes or QMM_SHAPES:  # the source depends on shapes and dtypes: zeros do
        dt = DTYPES[dtype]
        x, wq, s = mx.zeros((rows, k), dt), mx.zeros((n, k * bits // 32), mx.uint32), mx.zeros((n, k // gs), dt)
        kernel, call = wide_qmm.wide_qmm_call(x, wq, s, s, gs, bits)
        shape = (rows, k, n, gs, bits, dtype)
        out.append({"shape": qmm_label(*shape), "sources": [_identity(metal_source(kernel, **call))]})
    return out


def attention_sources(shapes=None) -> list[dict]:
    """The Metal sources MLX generates for both passes of each attention launch (no Metal needed)."""
    from .source import metal_source

    out = []
    for shape in shapes or ATTENTION_SHAPES:
        q, k, _, lengths, sees = attention_case(*shape)
        (k1, c1), (k2, c2) = attn.attention_calls(q, k, k, q.shape[-1] ** -0.5, k.shape[2], lengths, sees=sees)
        partials = [mx.zeros(s, dtype=t) for s, t in zip(c1["output_shapes"], c1["output_dtypes"])]
        sources = [metal_source(k1, **c1), metal_source(k2, **{**c2, "inputs": [*partials, c2["inputs"][2]]})]
        out.append({"shape": attention_label(*shape), "sources": [_identity(src) for src in sources]})
    return out


def _checked(label: str, gate: RaceGate, key: str, ours, theirs, dtype, sizes, share) -> dict:
    """One shape through `gate` (ours(size) against theirs(), the launch sizes to try), then share(size): the
    worst error of ours at the size that ran, as a share of the tolerance (ok when <= 1). A kernel that fails
    to compile, launch or run is a failed shape with MLX's error; MLX's path then serves it."""
    ms = lambda seconds: None if seconds is None else seconds * 1e3  # noqa: E731
    try:
        gate.choose(key, ours, theirs, dtype, sizes)
        v = gate.verdicts[key]
        if v.get("failed"):
            return {"shape": label, "ok": False, "error": v["failed"], "failed_to_run": True}
        entry = {"shape": label, "threads": v["size"], "error_share_of_tolerance": share(v["size"])}
    except Exception as e:  # an error only the float32 comparison met
        return {"shape": label, "ok": False, "error": first_line(e), "failed_to_run": True}
    entry["ok"] = entry["error_share_of_tolerance"] <= 1.0  # NaN: not ok
    if entry["ok"]:
        soak = v.get("soak") or {}
        entry.update(route=v["route"], dflash_ms=ms(v.get("dflash_s")), mlx_ms=ms(v.get("mlx_s")),
                     soak_calls=soak.get("calls", 0), soak_dflash_ms=ms(soak.get("dflash_s")),
                     soak_mlx_ms=ms(soak.get("mlx_s")), soak_dflash_worst_ms=ms(soak.get("dflash_worst_s")),
                     stalled=bool(soak.get("stalled")))
    return entry


def check_qmm(gate: RaceGate, shapes=None) -> list[dict]:
    """Per shape: our wide kernel through the race gate (launch size, verdict, timings, soak), then against
    MLX's quantized matmul in float32 (worst error as a share of the tolerance, ok when <= 1)."""

    def run(rows, k, n, gs, bits, dtype):
        x, wq, s, b = qmm_inputs(rows, k, n, gs, bits, dtype)
        ours = lambda threads: wide_qmm.wide_quantized_matmul(x, wq, s, b, gs, bits, threads)  # noqa: E731
        theirs = lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=gs, bits=bits)  # noqa: E731
        f = mx.float32
        ref = mx.quantized_matmul(x.astype(f), wq, s.astype(f), b.astype(f), transpose=True, group_size=gs, bits=bits)
        bound = QMM_RTOL[x.dtype] * mx.abs(ref) + QMM_ATOL_SHARE * mx.abs(ref).max()
        share = lambda threads: (mx.abs(ours(threads).astype(f) - ref) / bound).max().item()  # noqa: E731
        return _checked(qmm_label(rows, k, n, gs, bits, dtype), gate, wide_qmm.race_key(x, wq, gs, bits), ours,
                        theirs, x.dtype, wide_qmm.thread_sizes(x.dtype), share)

    return [run(*shape) for shape in shapes or QMM_SHAPES]


def check_attention(gate: RaceGate, shapes=None) -> list[dict]:
    """Per shape: our multi-row attention through the race gate (launch size, verdict, timings, soak), then
    against MLX's SDPA in float32 (worst absolute error as a share of the tolerance)."""

    def run(*shape):
        q, k, v, lengths, sees = attention_case(*shape)
        scale, keys = q.shape[-1] ** -0.5, k.shape[2]
        ours = lambda threads: attn.multi_row_attention(q, k, v, scale, keys, lengths, threads, sees)  # noqa: E731
        theirs = lambda: attn.reference_attention(q, k, v, scale, keys, lengths, sees)  # noqa: E731
        f = mx.float32
        ref = attn.reference_attention(q.astype(f), k.astype(f), v.astype(f), scale, keys, lengths, sees)
        tolerance = ATTENTION_ATOL[q.dtype]
        share = lambda threads: mx.abs(ours(threads).astype(f) - ref).max().item() / tolerance  # noqa: E731
        return _checked(attention_label(*shape), gate, attn.race_key(q, k, keys, sees is not None), ours, theirs,
                        q.dtype, attn.thread_sizes(q, k), share)

    return [run(*shape) for shape in shapes or ATTENTION_SHAPES]
