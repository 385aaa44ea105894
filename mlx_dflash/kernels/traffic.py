"""Modelled device-memory traffic of one quantized matmul of M rows: our wide kernel against MLX's path.

A model, not a measurement: it counts the bytes every load and store of a kernel moves to or from device
memory, as if there were no cache (so a value two threadgroups both load counts twice), for the launch each
path makes. The formulas below are exact for the kernels' source: ``tests/test_metal_traffic.py`` checks them
against the counts of the CPU emulator (``tests/metal_emulator``, ``traffic=True``), which instruments every
access of the real Metal source. What the model cannot see (caches, latency hiding, register pressure,
occupancy) is in ``metal_kernels/README.md``.

MLX's launches for ``M`` rows (``QuantizedMatmul::eval_gpu``, MLX 0.32, below its tiled-matmul row limit):
* M3 and newer (``"m3+"``): ``qmv_wide`` with ``ceil(M/5)`` row tiles of ``ceil(M / ceil(M/5))`` rows, one
  full weight pass per tile;
* M1/M2 (``"m1/m2"``): ``qmv_fast`` with one threadgroup row per input row, one weight pass per row.
"""

from __future__ import annotations

QMV_WIDE_MAX_ROWS = 5  # rows per qmv_wide tile (MLX)
CHIPS = ("m3+", "m1/m2")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def unavoidable_bytes(m: int, k: int, n: int, group_size: int, bits: int, x_bytes: int, s_bytes: int) -> int:
    """Weights, scales and biases once, the activations once and the output once."""
    return n * k * bits // 8 + 2 * n * (k // group_size) * s_bytes + m * k * x_bytes + m * n * x_bytes


def weight_bytes(t: dict) -> int:
    """Bytes read from the quantized weights, scales and biases (the part MLX re-reads)."""
    return t["w"] + t["scales"] + t["biases"]


def device_bytes(t: dict) -> int:
    return t["w"] + t["scales"] + t["biases"] + t["x"] + t["y"]


def ours(m: int, k: int, n: int, group_size: int, bits: int, x_bytes: int, s_bytes: int) -> dict:
    """One launch of ``metal_kernels/wide_qmm.metal`` (threads per threadgroup as ``kernels.wide_threads``)."""
    threads = 512 if x_bytes == 4 else 256
    tgs = _ceil(n, 2 * threads)
    bk = 512 if m <= 8 else 256
    return dict(
        launches=1, threadgroups=tgs, threads_per_threadgroup=threads, threadgroup_bytes=m * bk * 4,
        barriers=tgs * 2 * _ceil(k, bk),
        w=n * k * bits // 8, scales=n * (k // group_size) * s_bytes, biases=n * (k // group_size) * s_bytes,
        x=tgs * m * k * x_bytes, y=m * n * x_bytes,
    )


def mlx_qmv_wide(m: int, k: int, n: int, group_size: int, bits: int, x_bytes: int, s_bytes: int) -> dict:
    """MLX's ``qmv_wide`` launch (8 features per threadgroup, each feature's lanes stream every row's x)."""
    tiles = _ceil(m, QMV_WIDE_MAX_ROWS)
    rows = _ceil(m, tiles)  # vecs_per_tg; rows past M re-read row M - 1
    n_pad = _ceil(n, 8) * 8  # features past N re-read row N - 1
    return dict(
        launches=1, threadgroups=tiles * (n_pad // 8), threads_per_threadgroup=64, threadgroup_bytes=0,
        barriers=0, weight_passes=tiles,
        w=tiles * n_pad * k * bits // 8, scales=tiles * n_pad * (k // group_size) * s_bytes,
        biases=tiles * n_pad * (k // group_size) * s_bytes, x=n_pad * tiles * rows * k * x_bytes,
        y=m * n * x_bytes,
    )


def mlx_qmv_fast(m: int, k: int, n: int, group_size: int, bits: int, x_bytes: int, s_bytes: int) -> dict:
    """MLX's ``qmv_fast`` launch for M rows (grid.x = M): every row is its own weight pass; each lane
    loads one scale and bias per 512-value (4-bit) / 256-value (8-bit) block and row."""
    values_per_thread = (32 // bits) * 2
    n_pad = _ceil(n, 8) * 8
    sb = m * n_pad * (k // values_per_thread) * s_bytes
    return dict(
        launches=1, threadgroups=m * (n_pad // 8), threads_per_threadgroup=64, threadgroup_bytes=0,
        barriers=0, weight_passes=m,
        w=m * n_pad * k * bits // 8, scales=sb, biases=sb, x=m * (n_pad // 4) * k * x_bytes, y=m * n * x_bytes,
    )


def mlx_path(chip: str, m: int, k: int, n: int, group_size: int, bits: int, x_bytes: int, s_bytes: int) -> dict:
    if chip == "m3+":
        return mlx_qmv_wide(m, k, n, group_size, bits, x_bytes, s_bytes)
    if chip == "m1/m2":
        return mlx_qmv_fast(m, k, n, group_size, bits, x_bytes, s_bytes)
    raise ValueError(f"chip must be one of {CHIPS}, got {chip!r}")


def compare(m: int, k: int, n: int, group_size: int = 64, bits: int = 4, x_bytes: int = 2,
            s_bytes: int | None = None) -> dict:
    """The modelled ratios for one shape: ours / unavoidable device bytes, and our weight bytes over MLX's
    on each chip family (MLX's device bytes are listed too; without a cache its x re-reads dominate)."""
    s_bytes = x_bytes if s_bytes is None else s_bytes
    args = (m, k, n, group_size, bits, x_bytes, s_bytes)
    base = unavoidable_bytes(*args)
    mine = ours(*args)
    out = dict(rows=m, unavoidable_bytes=base, ours_bytes=device_bytes(mine),
               ours_over_unavoidable=device_bytes(mine) / base, ours_threadgroups=mine["threadgroups"])
    for chip in CHIPS:
        theirs = mlx_path(chip, *args)
        out[f"mlx_{chip}_weight_passes"] = theirs["weight_passes"]
        out[f"mlx_{chip}_bytes"] = device_bytes(theirs)
        out[f"ours_over_mlx_{chip}_weights"] = weight_bytes(mine) / weight_bytes(theirs)
    return out


def widths_model(shapes: list[dict], widths, x_bytes: int) -> dict:
    """``bench widths``' modelled traffic: for each width our kernel takes (6..16), summed over the layer
    shapes (``{"K", "N", "group_size", "bits", "count"}``), ours / unavoidable device bytes and our weight
    bytes / MLX's on each chip family (no rows where our kernel takes none of the shapes)."""
    rows = []
    for m in widths:
        if not 6 <= m <= 16 or not shapes:
            continue
        total = {"unavoidable": 0, "ours": 0, "ours_w": 0, **{f"mlx_w_{c}": 0 for c in CHIPS}}
        for sh in shapes:
            args = (m, sh["K"], sh["N"], sh["group_size"], sh["bits"], x_bytes, x_bytes)
            mine, count = ours(*args), sh.get("count", 1)
            total["unavoidable"] += count * unavoidable_bytes(*args)
            total["ours"] += count * device_bytes(mine)
            total["ours_w"] += count * weight_bytes(mine)
            for chip in CHIPS:
                total[f"mlx_w_{chip}"] += count * weight_bytes(mlx_path(chip, *args))
        rows.append({"width": m, "ours_over_unavoidable": total["ours"] / total["unavoidable"],
                     **{f"ours_over_mlx_{c}_weights": total["ours_w"] / total[f"mlx_w_{c}"] for c in CHIPS},
                     "mlx_m3+_weight_passes": _ceil(m, QMV_WIDE_MAX_ROWS), "mlx_m1/m2_weight_passes": m})
    return {"kind": "model", "x_bytes": x_bytes, "rows": rows,
            "note": "modelled device bytes (every load counted, no cache), not a measurement"}


def format_widths_model(model: dict) -> str:
    head = ["width", "ours/unavoidable", "MLX M3+ weight passes", "ours/MLX M3+ weights",
            "MLX M1/M2 weight passes", "ours/MLX M1/M2 weights"]
    rows = [[str(r["width"]), f"{r['ours_over_unavoidable']:.3f}", str(r["mlx_m3+_weight_passes"]),
             f"{r['ours_over_mlx_m3+_weights']:.3f}", str(r["mlx_m1/m2_weight_passes"]),
             f"{r['ours_over_mlx_m1/m2_weights']:.3f}"] for r in model["rows"]]
    if not rows:
        return "traffic MODEL: no width in 6..16"
    size = [max(len(r[j]) for r in [head] + rows) for j in range(len(head))]
    lines = ["  ".join(c.rjust(size[j]) for j, c in enumerate(r)) for r in [head] + rows]
    return "\n".join([f"traffic MODEL ({model['note']}), our wide kernel vs MLX's path:"] + lines)


def attention_unavoidable_bytes(b: int, hq: int, hkv: int, rows: int, keys: int, d: int, x_bytes: int) -> int:
    """q and the output once, K and V once per kv head (a GQA group shares them)."""
    return 2 * b * hq * rows * d * x_bytes + 2 * b * hkv * keys * d * x_bytes


def attention_ours(b: int, hq: int, hkv: int, rows: int, keys: int, d: int, x_bytes: int) -> dict:
    """The two launches of the multi-row attention (metal_kernels/mr_attention_*.metal), summed, every batch
    row attending `keys` keys (for a batch's rows of different lengths: an upper bound)."""
    from .attention import key_chunks

    groups = hq // hkv
    n_rows = b * hq * rows
    chunks, split = key_chunks(n_rows, b * hkv, keys, d, x_bytes)
    simdgroups = min(16, groups * rows)
    rows_per_sg = _ceil(groups * rows, simdgroups)
    tile = 2048 // d
    tiles = sum(_ceil(min(keys, (c + 1) * split) - c * split, tile) for c in range(chunks))
    partials = n_rows * chunks * (d + 2) * 4
    return dict(
        launches=2, threadgroups=b * hkv * chunks + n_rows, threads_per_threadgroup=32 * simdgroups,
        threadgroup_bytes=2 * tile * d * 4, barriers=b * hkv * 2 * tiles, chunks=chunks,
        q=b * hkv * chunks * simdgroups * rows_per_sg * d * x_bytes, k=b * hkv * keys * d * x_bytes,
        v=b * hkv * keys * d * x_bytes, partials_written=partials,
        partials_read=partials, out=n_rows * d * x_bytes,
    )


def attention_device_bytes(t: dict) -> int:
    return t["q"] + t["k"] + t["v"] + t["partials_written"] + t["partials_read"] + t["out"]
