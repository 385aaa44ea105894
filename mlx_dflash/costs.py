"""What a verify of each width costs, for `--width auto`: a measured table (`mlx-dflash bench widths`
writes cost_table.json) or a quick start-up probe, which the policy then refines from observed rounds."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache

from .errors import DFlashError


def load_cost_table(path) -> dict[int, float]:
    """{width: verify seconds} from a cost_table.json; DFlashError naming the problem otherwise."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DFlashError(f"cost table {path}: no such file (make one with `mlx-dflash bench widths`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DFlashError(f"cost table {path} is not a readable JSON file ({e})") from None
    if not isinstance(data, dict) or "widths" not in data or "verify_seconds" not in data:
        raise DFlashError(f"cost table {path} needs an object with 'widths' and 'verify_seconds' lists")
    widths, seconds = data["widths"], data["verify_seconds"]
    if not isinstance(widths, list) or not isinstance(seconds, list) or len(widths) != len(seconds) or not widths:
        raise DFlashError(f"cost table {path}: 'widths' and 'verify_seconds' must be non-empty lists of equal length")
    if any(type(w) is not int or w < 1 for w in widths) or len(set(widths)) != len(widths):
        raise DFlashError(f"cost table {path}: 'widths' must be distinct integers >= 1, got {widths}")
    if any(type(s) not in (int, float) or not math.isfinite(s) or s <= 0 for s in seconds):
        raise DFlashError(f"cost table {path}: 'verify_seconds' must be positive finite numbers, got {seconds}")
    return {w: float(s) for w, s in sorted(zip(widths, seconds))}


def filled_cache(target, length: int, seed: int = 0) -> list:
    """target.make_cache() holding `length` positions of random keys/values (the model's head shapes
    and dtype, found by a one-token probe)."""
    cache = target.make_cache()
    if length <= 0:
        return cache
    probe = target.make_cache()
    mx.eval(target.forward(mx.array([[0]]), probe)[0])
    key = mx.random.key(seed)
    for c, p in zip(cache, probe):
        if isinstance(c, ArraysCache):  # a recurrent layer: its state and its cost do not grow with the context
            continue
        if getattr(p, "keys", None) is None or not hasattr(c, "update_and_fetch"):
            raise DFlashError(f"cannot pre-fill a {type(c).__name__} cache for the long-context benchmark")
        key, k1, k2 = mx.random.split(key, 3)
        kshape, vshape = p.keys.shape, p.values.shape
        c.update_and_fetch(mx.random.normal((1, kshape[1], length, kshape[3]), key=k1).astype(p.keys.dtype),
                           mx.random.normal((1, vshape[1], length, vshape[3]), key=k2).astype(p.values.dtype))
    mx.eval([c.state for c in cache])
    return cache


def probe_verify_costs(target, max_width: int, context: int = 256, widths=(1, 2, 3, 4, 6, 8, 12, 16),
                       repeats: int = 3) -> dict:
    """A quick start-up estimate of {width: verify seconds}, for `--width auto` when no cost table was
    measured; the decoder refines it from observed rounds.

    The widths are timed in turns (after one warm-up turn), so a slow moment of a shared machine
    spreads over all of them, and each width keeps its median; then the costs are made non-decreasing
    in width (more rows never cost less). Timed back to back, on this 2-core VM, width 4 came out
    dearer than width 8, and auto shunned widths it never tried."""
    cache = filled_cache(target, context)
    chosen = sorted({min(w, max_width) for w in widths})
    times = {w: [] for w in chosen}
    for turn in range(repeats + 1):
        for w in chosen:
            seconds = timed(lambda: target.forward(mx.zeros((1, w), dtype=mx.int32), cache)[0])[0]
            target.trim(cache, w)
            if turn:
                times[w].append(seconds)
    return non_decreasing({w: float(np.median(t)) for w, t in times.items()})


def non_decreasing(costs: dict) -> dict:
    """The closest non-decreasing costs (least squares, pool-adjacent-violators), in width order."""
    blocks = []  # [sum, count] of pooled neighbours
    for w in sorted(costs):
        blocks.append([costs[w], 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    values = [total / count for total, count in blocks for _ in range(count)]
    return dict(zip(sorted(costs), values))


def timed(fn) -> tuple[float, float]:
    """(wall, process CPU) seconds of evaluating fn()."""
    t0, c0 = time.perf_counter(), time.process_time()
    mx.eval(fn())
    return time.perf_counter() - t0, time.process_time() - c0
