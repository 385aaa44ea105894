"""Multi-row decode attention for 2..16 query rows (DFlash verification over a long KV cache).

``metal_kernels/mr_attention_partial.metal`` splits the keys over threadgroups (each K/V element read once
per kv head, shared by its GQA query heads), ``mr_attention_combine.metal`` merges the chunks. Query row i of
L sees the S - L keys before the block, S being the keys of its batch row (the same for every row of one
sequence's cache, each row's own length in a batch cache: ``lengths``; the buffer past a row's length is
padding, never read), and the block keys its ``sees`` bits name: keys S - L .. S - L + i for a chain (causal,
the default), its ancestors and itself for a node of a draft tree (models/tree_verify.py).

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
    return _kernel("dflash_mr_attention_partial", "mr_attention_partial.metal",
                   ["q", "k", "v", "scale", "lengths", "sees", "SPLIT"], ["o_part", "ml"])


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


def check_supported(q, k, v, keys: int, lengths: list | None = None, sees=None) -> str | None:
    """Why the kernel cannot take this call (None when it can). lengths: each batch row's keys (default: all
    `keys`); sees: (B, rows) bits of the block keys each query row sees (default: causal)."""
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
    if sees is not None and tuple(sees.shape) != (b, rows):
        return f"sees {tuple(sees.shape)} must be (batch, rows) = {(b, rows)}"
    if q.dtype not in (mx.float16, mx.bfloat16, mx.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} not supported (q, k, v must share it)"
    return None


def thread_sizes(q, k) -> list[int]:
    """Pass 1's launch sizes to try, largest first: a simdgroup per query row of a kv head up to 16, then halves
    down to one (a pipeline whose registers allow fewer threads refuses the larger ones; the race gate
    retries; fewer simdgroups each take more rows)."""
    return halvings(32 * min(16, (q.shape[1] // k.shape[1]) * q.shape[2]))


def causal_sees(batch: int, rows: int):
    """A chain's `sees`: query row i sees block keys 0..i."""
    return mx.broadcast_to((mx.array(2, mx.uint32) << mx.arange(rows, dtype=mx.uint32)) - 1, (batch, rows))


def attention_calls(q, k, v, scale: float, keys: int | None = None, lengths: list | None = None,
                    threads: int | None = None, sees=None) -> list[tuple]:
    """[(kernel, call)] of pass 1 and pass 2 for ``softmax(q k[:keys]^T * scale + block mask) v[:keys]``, batch
    row b over its first lengths[b] keys (default: `keys`, the most any row has), each query row seeing the block
    keys its `sees` bits name (default: causal); pass 1 at `threads` per threadgroup (default: thread_sizes'
    first)."""
    keys = k.shape[2] if keys is None else keys
    reason = check_supported(q, k, v, keys, lengths, sees)
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
        inputs=[q, k, v, float(scale), mx.array(lengths or [keys] * b, dtype=mx.int32),
                (causal_sees(b, rows) if sees is None else sees.astype(mx.uint32)).reshape(-1), split],
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
                        threads: int | None = None, sees=None):
    """The two-pass kernel on Metal, pass 1 at `threads` per threadgroup; out (B, Hq, L, D) in q's dtype."""
    if not metal_available():
        raise RuntimeError("multi_row_attention needs Metal; use mx.fast.scaled_dot_product_attention")
    (k1, c1), (k2, c2) = attention_calls(q, k, v, scale, keys, lengths, threads, sees)
    o_part, ml = k1(**c1)
    (out,) = k2(**{**c2, "inputs": [o_part, ml, c2["inputs"][2]]})
    return out.reshape(q.shape)


def block_mask(rows: int, keys: int, lengths: list | None = None, sees=None):
    """Boolean mask of who sees what: row i sees keys 0 .. S - rows + i, with S = keys, (rows, keys); or with
    each batch row's own S = lengths[b], (B, 1, rows, keys); with `sees` (B, rows), row i of batch row b sees the
    S - rows keys before the block and the block keys j whose bit j is set in sees[b, i], (B, 1, rows, keys)."""
    if lengths is None and sees is None:
        return mx.arange(keys)[None, :] <= (keys - rows + mx.arange(rows))[:, None]
    ends = mx.array(lengths or [keys] * (1 if sees is None else sees.shape[0]))[:, None, None, None]
    if sees is None:
        return mx.arange(keys)[None, None, None, :] <= ends - rows + mx.arange(rows)[:, None]
    j = mx.arange(keys)[None, None, None, :] - (ends - rows)  # the block key a column holds, where 0 <= j < rows
    bit = (sees.astype(mx.uint32)[:, None, :, None] >> mx.clip(j, 0, rows - 1).astype(mx.uint32)) & 1
    return (j < 0) | ((j < rows) & (bit == 1))


def reference_attention(q, k, v, scale: float, keys: int | None = None, lengths: list | None = None, sees=None):
    keys = k.shape[2] if keys is None else keys
    return mx.fast.scaled_dot_product_attention(q, k[:, :, :keys], v[:, :, :keys], scale=scale,
                                                mask=block_mask(q.shape[2], keys, lengths, sees))


def race_key(q, k, keys: int, tree: bool = False) -> str:
    """The race gate's key of a call: speed depends on the cache size, so keys fall in power-of-two bins; a tree's
    verify (its mask an array for MLX) races apart from a chain's."""
    b, hq, rows, d = q.shape
    bucket = 1 << max(0, (keys - 1).bit_length())
    dtype = str(q.dtype).rsplit(".", 1)[-1]
    kind = "tree" if tree else "rows"
    return f"{chip_name()}|mr_attention|{dtype}|B{b}|Hq{hq}|Hkv{k.shape[1]}|D{d}|keys<={bucket}|{kind}{rows}"


def block_attention(q, k, v, scale: float, keys: int | None = None, route: str = "auto", lengths: list | None = None,
                    sees=None):
    """Block attention, routed: ours (Metal, 2..16 rows, head dim 64/128) when ``route`` is ``"dflash"`` or the
    race gate picked it for this (chip, shape, rows, cache size, chain or tree), else MLX's SDPA. lengths: each
    batch row's keys (a batch cache's rows), else `keys` for all; sees: the block keys each query row sees (a
    draft tree's ancestors; default: causal). Routed calls are recorded (routes.py)."""
    keys = k.shape[2] if keys is None else keys
    if route == "mlx" or not metal_available() or check_supported(q, k, v, keys, lengths, sees) is not None:
        return reference_attention(q, k, v, scale, keys, lengths, sees)
    key = race_key(q, k, keys, sees is not None)
    choice = shared_gate().choose(key, lambda threads: multi_row_attention(q, k, v, scale, keys, lengths, threads,
                                                                           sees),
                                lambda: reference_attention(q, k, v, scale, keys, lengths, sees), q.dtype,
                                thread_sizes(q, k), forced=route == OURS)
    routes.record(key, choice.route, choice.reason, fallback=choice.fallback)
    if choice.route == OURS:
        return multi_row_attention(q, k, v, scale, keys, lengths, choice.size, sees)
    return reference_attention(q, k, v, scale, keys, lengths, sees)
