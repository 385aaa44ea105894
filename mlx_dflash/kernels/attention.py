"""Multi-row decode attention for 2..16 query rows (DFlash verification over a long KV cache).

``metal_kernels/mr_attention_partial.metal`` splits the keys over threadgroups (each K/V element read once
per kv head, shared by its GQA query heads), ``mr_attention_combine.metal`` merges the chunks. Causal
within the block: query row i of L sees keys 0 .. S - L + i, where S is the keys of its batch row: the same
for every row of one sequence's cache, each row's own length in a batch cache (``lengths``; the buffer past
a row's length is padding, never read).

* ``attention_calls(q, k, v, scale, keys, lengths)``: the two launches (kernel, call) - shared by Metal and the
  CPU emulator; pass 2's inputs are pass 1's outputs.
* ``multi_row_attention`` runs them (Metal only).
* ``block_attention`` is the routed entry point: ours where Metal runs, the race gate picked it and the
  call fits, else ``mx.fast.scaled_dot_product_attention`` with the same causal block mask.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..machine import chip_name, metal_available
from . import routes
from .source import read_metal_file
from .race_gate import OURS, halvings, shared_gate

MIN_ROWS, MAX_ROWS = 2, 16
HEAD_DIMS = (64, 128)
MIN_SPLIT = 256  # keys per pass-1 threadgroup, at least
# Pass 1 writes (D + 2) float32 partials per query row and key chunk and pass 2 reads them back; fewer
# chunks for many rows keep that under this share of the K/V bytes (at the cost of fewer threadgroups).
MAX_PARTIAL_SHARE = 0.25
MAX_CHUNKS = 1024  # MAX_NC in mr_attention_combine.metal


def _kernel(name: str, file: str, inputs: list[str], outputs: list[str]):
    header, body = read_metal_file(file)
    return mx.fast.metal_kernel(name=name, input_names=inputs, output_names=outputs, source=body, header=header,
                                ensure_row_contiguous=False)


@functools.lru_cache(maxsize=None)
def partial_kernel():
    return _kernel("dflash_mr_attention_partial", "mr_attention_partial.metal", ["q", "k", "v", "scale", "lengths", "SPLIT"],
                   ["o_part", "ml"])


@functools.lru_cache(maxsize=None)
def combine_kernel():
    return _kernel("dflash_mr_attention_combine", "mr_attention_combine.metal", ["o_part", "ml", "NC"], ["out"])


def key_chunks(rows_total: int, kv_heads_total: int, keys: int, d: int, x_bytes: int) -> tuple[int, int]:
    """(chunks, keys per chunk) for pass 1: chunks of >= MIN_SPLIT keys, no more than keep the partials'
    traffic within MAX_PARTIAL_SHARE of the K/V bytes; keys per chunk a multiple of the staged tile."""
    tile = 2048 // d
    kv_bytes = 2 * kv_heads_total * keys * d * x_bytes
    per_chunk = rows_total * (2 * d * 4 + 8)  # o_part written + read, m/l written
    chunks = max(1, min(-(-keys // MIN_SPLIT), int(MAX_PARTIAL_SHARE * kv_bytes // per_chunk), MAX_CHUNKS))
    split = -(-keys // chunks)
    split = -(-split // tile) * tile
    return -(-keys // split), split


def check_supported(q, k, v, keys: int, lengths: list | None = None) -> str | None:
    """Why the kernel cannot take this call (None when it can). lengths: each batch row's keys (default: all
    `keys`)."""
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        return "expected q (B, Hq, L, D), k and v (B, Hkv, S, D)"
    b, hq, rows, d = q.shape
    if not MIN_ROWS <= rows <= MAX_ROWS:
        return f"rows={rows} outside {MIN_ROWS}..{MAX_ROWS}"
    if d not in HEAD_DIMS or k.shape[-1] != d:
        return f"head dim {d} not in {HEAD_DIMS}"
    if k.shape[0] != b or hq % k.shape[1]:
        return "query heads must be a multiple of kv heads (same batch)"
    if not rows <= keys <= k.shape[2]:
        return f"keys={keys} must be in {rows}..{k.shape[2]}"
    if lengths is not None and (len(lengths) != b or not rows <= min(lengths) <= max(lengths) <= keys):
        return f"row lengths {lengths} must be one per batch row, each in {rows}..{keys}"
    if q.dtype not in (mx.float16, mx.bfloat16, mx.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} not supported (q, k, v must share it)"
    return None


def thread_sizes(q, k) -> list[int]:
    """Pass 1's launch sizes to try, largest first: a simdgroup per query row of a kv head up to 16, then halves
    down to one (a pipeline whose registers allow fewer threads refuses the larger ones; the race gate
    retries; fewer simdgroups each take more rows)."""
    return halvings(32 * min(16, (q.shape[1] // k.shape[1]) * q.shape[2]))


def attention_calls(q, k, v, scale: float, keys: int | None = None, lengths: list | None = None,
                    threads: int | None = None) -> list[tuple]:
    """[(kernel, call)] of pass 1 and pass 2 for ``softmax(q k[:keys]^T * scale + block mask) v[:keys]``, batch
    row b over its first lengths[b] keys (default: `keys`, the most any row has); pass 1 at `threads` per
    threadgroup (default: thread_sizes' first)."""
    keys = k.shape[2] if keys is None else keys
    reason = check_supported(q, k, v, keys, lengths)
    if reason is not None:
        raise ValueError(f"multi_row_attention: {reason}")
    b, hq, rows, d = q.shape
    hkv = k.shape[1]
    groups = hq // hkv
    n_rows = b * hq * rows
    chunks, split = key_chunks(n_rows, b * hkv, keys, d, q.dtype.size)
    simdgroups = (threads or thread_sizes(q, k)[0]) // 32
    tile = 2048 // d  # keys per staged tile: K and V tiles of 8 KiB each
    first = dict(
        inputs=[q, k, v, float(scale), mx.array(lengths or [keys] * b, dtype=mx.int32), split],
        template=[("T", q.dtype), ("L", rows), ("G", groups), ("D", d), ("HKV", hkv), ("CH", tile),
                  ("NS", simdgroups)],
        grid=(32 * simdgroups, b * hkv, chunks), threadgroup=(32 * simdgroups, 1, 1),
        output_shapes=[(n_rows, chunks, d), (n_rows, chunks, 2)], output_dtypes=[mx.float32, mx.float32],
    )
    second = dict(
        inputs=[None, None, chunks],  # pass 1's outputs, then NC
        template=[("T", q.dtype), ("D", d)],
        grid=(32, n_rows, 1), threadgroup=(32, 1, 1), output_shapes=[(n_rows, d)], output_dtypes=[q.dtype],
    )
    return [(partial_kernel(), first), (combine_kernel(), second)]


def multi_row_attention(q, k, v, scale: float, keys: int | None = None, lengths: list | None = None,
                        threads: int | None = None):
    """The two-pass kernel on Metal, pass 1 at `threads` per threadgroup; out (B, Hq, L, D) in q's dtype."""
    if not metal_available():
        raise RuntimeError("multi_row_attention needs Metal; use mx.fast.scaled_dot_product_attention")
    (k1, c1), (k2, c2) = attention_calls(q, k, v, scale, keys, lengths, threads)
    o_part, ml = k1(**c1)
    (out,) = k2(**{**c2, "inputs": [o_part, ml, c2["inputs"][2]]})
    return out.reshape(q.shape)


def block_mask(rows: int, keys: int, lengths: list | None = None):
    """Boolean mask of who sees what: row i sees keys 0 .. S - rows + i, with S = keys, (rows, keys); or with
    each batch row's own S = lengths[b], (B, 1, rows, keys)."""
    if lengths is None:
        return mx.arange(keys)[None, :] <= (keys - rows + mx.arange(rows))[:, None]
    last = mx.array(lengths)[:, None, None, None] - rows + mx.arange(rows)[:, None]
    return mx.arange(keys)[None, None, None, :] <= last


def reference_attention(q, k, v, scale: float, keys: int | None = None, lengths: list | None = None):
    keys = k.shape[2] if keys is None else keys
    return mx.fast.scaled_dot_product_attention(q, k[:, :, :keys], v[:, :, :keys], scale=scale,
                                                mask=block_mask(q.shape[2], keys, lengths))


def race_key(q, k, keys: int) -> str:
    """The race gate's key of a call: speed depends on the cache size, so keys fall in power-of-two bins."""
    b, hq, rows, d = q.shape
    bucket = 1 << max(0, (keys - 1).bit_length())
    dtype = str(q.dtype).rsplit(".", 1)[-1]
    return f"{chip_name()}|mr_attention|{dtype}|B{b}|Hq{hq}|Hkv{k.shape[1]}|D{d}|keys<={bucket}|rows{rows}"


def block_attention(q, k, v, scale: float, keys: int | None = None, route: str = "auto", lengths: list | None = None):
    """Causal block attention, routed: ours (Metal, 2..16 rows, head dim 64/128) when ``route`` is
    ``"dflash"`` or the race gate picked it for this (chip, shape, rows, cache size), else MLX's SDPA.
    lengths: each batch row's keys (a batch cache's rows), else `keys` for all. Routed calls are recorded
    (routes.py)."""
    keys = k.shape[2] if keys is None else keys
    if route == "mlx" or not metal_available() or check_supported(q, k, v, keys, lengths) is not None:
        return reference_attention(q, k, v, scale, keys, lengths)
    key = race_key(q, k, keys)
    choice = shared_gate().choose(key, lambda threads: multi_row_attention(q, k, v, scale, keys, lengths, threads),
                                lambda: reference_attention(q, k, v, scale, keys, lengths), q.dtype,
                                thread_sizes(q, k), forced=route == OURS)
    routes.record(key, choice.route, choice.reason, fallback=choice.fallback)
    if choice.route == OURS:
        return multi_row_attention(q, k, v, scale, keys, lengths, choice.size)
    return reference_attention(q, k, v, scale, keys, lengths)
