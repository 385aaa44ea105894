"""What a verify of each width costs: a measured table (`mlx-dflash bench widths` writes cost_table.json,
recording the dtype, weights and chip it was made with) or a quick start-up probe, which the width
policies (policies/width.py, policies/dcut.py) then refine from the rounds they observe."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache

from ..errors import DFlashError
from ..kernels.wide_qmm import WideQuantizedLinear
from ..machine import machine_info
from ..models.batch_cache import add_row, batched


def running(average: Optional[float], value: float, weight: float) -> float:
    """A running average moved `weight` of the way to `value` (the value itself when there is none yet)."""
    return value if average is None else (1 - weight) * average + weight * value


def interpolate_costs(table: dict, max_width: int) -> dict:
    """Verify seconds for every width 1..max_width, linear between measured widths, extended at the ends."""
    if not table:
        raise DFlashError("the verify cost table is empty")
    widths = sorted(table)
    seconds = [table[w] for w in widths]
    out = {}
    for w in range(1, max_width + 1):
        if len(widths) == 1:
            out[w] = seconds[0]
        elif w <= widths[-1]:
            out[w] = float(np.interp(w, widths, seconds))
        else:  # past the table: continue its last slope
            slope = (seconds[-1] - seconds[-2]) / (widths[-1] - widths[-2])
            out[w] = seconds[-1] + slope * (w - widths[-1])
    return out


def read_cost_table(path) -> dict:
    """A cost_table.json, checked: one row's costs ('widths', 'verify_seconds', and 'by_cache_length' from
    `bench widths --context`), a batch's ('batch_verify_seconds', from `bench widths --batch`), or both. The
    one reader of the file (`batch_costs` and `table_costs` view it); DFlashError naming the problem."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DFlashError(f"cost table {path}: no such file (make one with `mlx-dflash bench widths`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DFlashError(f"cost table {path} is not a readable JSON file ({e})") from None
    if not isinstance(data, dict) or "batch_verify_seconds" not in data and (
            "widths" not in data or "verify_seconds" not in data):
        raise DFlashError(f"cost table {path} needs an object with 'widths' and 'verify_seconds' lists")
    if "batch_verify_seconds" in data:
        _check_batch_rows(data["batch_verify_seconds"], path)
    if "widths" not in data and "verify_seconds" not in data:
        return data
    widths, seconds = data.get("widths"), data.get("verify_seconds")
    if not isinstance(widths, list) or not isinstance(seconds, list) or len(widths) != len(seconds) or not widths:
        raise DFlashError(f"cost table {path}: 'widths' and 'verify_seconds' must be non-empty lists of equal length")
    if any(type(w) is not int or w < 1 for w in widths) or len(set(widths)) != len(widths):
        raise DFlashError(f"cost table {path}: 'widths' must be distinct integers >= 1, got {widths}")
    if any(type(s) not in (int, float) or not math.isfinite(s) or s <= 0 for s in seconds):
        raise DFlashError(f"cost table {path}: 'verify_seconds' must be positive finite numbers, got {seconds}")
    rows = data.get("by_cache_length") or {}
    if not isinstance(rows, dict) or any(not str(c).isdigit() or not isinstance(r, list) or len(r) != len(widths)
                                         or any(type(x) not in (int, float) or not x > 0 for x in r)
                                         for c, r in rows.items()):
        raise DFlashError(f"cost table {path}: 'by_cache_length' must map context lengths to lists of positive "
                          f"seconds, one per width (as `mlx-dflash bench widths --context` writes it)")
    return data


def _check_batch_rows(table, path):
    wrong = f"cost table {path}: batch_verify_seconds must map batch sizes to lists of seconds"
    if not isinstance(table, dict) or not table or any(not isinstance(r, list) or not r for r in table.values()):
        raise DFlashError(wrong)
    try:
        rows = {int(b): [float(s) for s in r] for b, r in table.items()}
    except (TypeError, ValueError):
        raise DFlashError(wrong) from None
    if any(b < 1 or any(not s > 0 for s in r) for b, r in rows.items()):
        raise DFlashError(f"cost table {path}: batch sizes must be >= 1 and every cost positive")


def batch_costs(table: dict) -> dict:
    """{rows: {width: seconds}} of a checked table (`read_cost_table`): its rows per batch size, or its one row's
    costs as the batch of one (D-cut scales them to the other batch sizes and times their cells as rounds run)."""
    if "batch_verify_seconds" not in table:
        return {1: table_costs(table)}
    return {int(b): {w + 1: float(s) for w, s in enumerate(row)} for b, row in table["batch_verify_seconds"].items()}


def load_cost_table(path) -> dict[int, float]:
    """{width: verify seconds} of one row, from a cost_table.json; DFlashError naming the problem otherwise."""
    return batch_costs(read_cost_table(path))[1]


def table_costs(table: dict) -> dict[int, float]:
    return {w: float(s) for w, s in sorted(zip(table["widths"], table["verify_seconds"]))}


def precision(target) -> dict:
    """What a verify costs besides its width and the chip, as cost tables record it: the activation dtype
    (of the input embedding, or of its scales when quantized) and the quantization of the matmuls
    ({"bits", "group_size"}; {"mixed": [[bits, group_size], ...]} for mixed precision; None for a float model)."""
    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding, WideQuantizedLinear)
    found = sorted({(m.bits, m.group_size) for _, m in target.model.named_modules() if isinstance(m, quantized)})
    embedding = target.embed_tokens
    dtype = (embedding["scales"] if "scales" in embedding else embedding.weight).dtype
    quantization = (None if not found else {"bits": found[0][0], "group_size": found[0][1]} if len(found) == 1
                    else {"mixed": [list(f) for f in found]})
    return {"dtype": str(dtype).replace("mlx.core.", ""), "quantization": quantization}


def weights_text(quantization) -> str:
    """A `precision()` quantization in words."""
    if quantization is None:
        return "float weights"
    if "mixed" in quantization:
        return "mixed-precision weights"
    return f"{quantization['bits']}-bit weights (group {quantization['group_size']})"


def cost_table_note(table: dict, path, target) -> Optional[str]:
    """A one-line warning when the table was measured on another dtype, quantization or chip than this
    target's (naming each difference and the fix), or does not record them; None when all three match."""
    fix = "re-run `mlx-dflash bench widths --model` with this model on this machine and pass that table"
    chip = (table.get("machine") or {}).get("chip")
    if "dtype" not in table or "quantization" not in table or chip is None:
        return (f"warning: cost table {path} does not record the dtype, quantization and chip it was measured "
                f"with, so its costs may not be this run's; {fix}")
    here, here_chip = precision(target), machine_info()["chip"]
    differences = []
    if table["dtype"] != here["dtype"]:
        differences.append(f"{table['dtype']} activations (this target: {here['dtype']})")
    if table["quantization"] != here["quantization"]:
        differences.append(f"{weights_text(table['quantization'])} (this target: {weights_text(here['quantization'])})")
    if chip != here_chip:
        differences.append(f"chip {chip} (this machine: {here_chip})")
    if not differences:
        return None
    return f"warning: cost table {path} was measured with {'; '.join(differences)}; {fix}"


PROBE_CONTEXTS = (256, 1024, 4096, 16384, 65536)  # context lengths a verify's cost is measured at, as needed
PROBE_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)  # widths a probe times (the others are interpolated)


class ContextCosts:
    """How one row's verify cost grows with the context it attends to (every verify reads the whole KV
    cache): verify seconds per width measured at a few context lengths.

    `growth(context)` is, per width, the cost at `context` over the cost at the shortest length measured:
    linear in the context between measured lengths, continuing the last two's slope past them (the cache
    read grows linearly), 1 at or below the shortest. The width policies scale their per-width costs by
    it, so a cost observed at one context serves at another. With a `prober`, PROBE_CONTEXTS up to the
    target's `limit` are measured as prompts need them (`cover`, called as a prompt is about to be read):
    the longest length a prompt reaches half of, and then the shortest too (a start-up probe passes its own,
    at the shortest, so short contexts cost nothing more). Lengths a prompt skips past stay unmeasured: a
    verify's cost grows linearly with the cache it reads, so two lengths draw the line between them, and
    each probe delays the prompt being read. A server measures them all at start-up (`probe_next`), so
    that its prompts find them measured. A table that measured two lengths or more (`bench widths
    --context`) is used as it is."""

    def __init__(self, by_context: dict, max_width: int, prober=None, limit: Optional[int] = None):
        self.max_width, self.prober = max_width, prober
        self.by_context = {int(c): interpolate_costs(t, max_width) for c, t in by_context.items()}
        self.lengths = [c for c in PROBE_CONTEXTS if prober is not None and (limit is None or c <= limit)]
        self.last = (None, None)  # (context, growth) last asked: rows ask once a round

    def cover(self, context: int) -> list:
        """Measure the lengths a context this long needs (see the class); returns those it measured."""
        reached = [c for c in self.lengths[1:] if context >= c // 2]
        wanted = [c for c in self.lengths[:1] + reached[-1:] if reached and c not in self.by_context]
        return wanted if self.cover_lengths(wanted) else []

    def cover_lengths(self, lengths: list) -> bool:
        """Measure `lengths`; False where the probe cannot (a cache it cannot fill: costs stay as measured,
        and no length is probed again)."""
        for length in lengths:
            try:
                self.by_context[length] = interpolate_costs(self.prober(length), self.max_width)
            except DFlashError:
                self.lengths = []
                return False
        if lengths:
            self.last = (None, None)
        return True

    def probe_next(self) -> Optional[int]:
        """Measure the shortest length not measured yet (a server measures them all at start-up, so that no
        prompt waits for a probe); that length, or None once every length is measured."""
        for length in self.lengths:
            if length not in self.by_context:
                if not self.cover_lengths([length]):
                    return None
                return length
        return None

    def growth(self, context: int) -> dict:
        """{width: the cost at `context` over the cost at the shortest length measured}; it measures nothing
        (`cover` does, before a generation's clock starts), so a context that grows past the lengths measured
        continues their last slope."""
        if self.last[0] == context:
            return self.last[1]
        lengths = sorted(self.by_context)
        out = {w: 1.0 for w in range(1, self.max_width + 1)}
        for w in out if len(lengths) > 1 and context > lengths[0] else ():
            seconds = [self.by_context[c][w] for c in lengths]
            if context <= lengths[-1]:
                at = float(np.interp(context, lengths, seconds))
            else:
                slope = (seconds[-1] - seconds[-2]) / (lengths[-1] - lengths[-2])
                at = seconds[-1] + slope * (context - lengths[-1])
            out[w] = max(1.0, at / seconds[0])  # a longer context never makes a verify cheaper
        self.last = (context, out)
        return out


def table_context_costs(table: dict, max_width: int, prober=None, limit: Optional[int] = None) -> ContextCosts:
    """The context costs of a cost_table.json: its `by_cache_length` rows when it measured two lengths or
    more; otherwise its one length, and the probe for the others."""
    rows = table.get("by_cache_length") or {}
    widths = table["widths"]
    by_context = {int(c): dict(zip(widths, s)) for c, s in rows.items()}
    if len(by_context) >= 2:
        return ContextCosts(by_context, max_width)
    return ContextCosts({}, max_width, prober, limit)  # one length: the probe's lengths, the shortest included


def context_prober(target, max_width: int):
    """A quick probe of one row's verify seconds per width at a given context length, for `ContextCosts`:
    5 widths, one warm-up turn and one timed (at a long context each verify is long enough to time once;
    the rounds then time themselves)."""
    return lambda context: probe_verify_costs(target, max_width, context, widths=(1, 2, 4, 8, 16), repeats=1)


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


def filled_batch(target, rows: int, length: int) -> list:
    """A batch cache (models/batch_cache.py) of `rows` sequences of `length` random positions each."""
    cache = batched(target.make_cache())
    for _ in range(rows):
        add_row(cache, filled_cache(target, length))
    return cache


def probe_costs(target, rows: list, max_width: int, context: int = PROBE_CONTEXTS[0], widths=PROBE_WIDTHS,
                repeats: int = 3) -> dict:
    """The cost probe: {rows: {width: seconds}} of a verify of `width` tokens in each of `rows` sequences of
    `context` tokens, at the widths asked (up to max_width), on a batch cache (what every request decodes on).

    The cells are timed in turns (after one warm-up turn), so a slow moment of a shared machine spreads over
    all of them, and each keeps its median. Timed back to back instead, a slow moment falls on one width,
    which can then look dearer than a wider one, and auto would shun a width it never tries."""
    chosen = sorted({min(w, max_width) for w in widths})
    caches = {b: filled_batch(target, b, context) for b in rows}
    times = {(b, w): [] for b in rows for w in chosen}
    for turn in range(repeats + 1):
        for b in rows:
            for w in chosen:
                seconds = timed(lambda: target.forward(mx.zeros((b, w), dtype=mx.int32), caches[b])[0])[0]
                target.trim_rows(caches[b], [w] * b)
                if turn:
                    times[b, w].append(seconds)
    return {b: {w: float(np.median(times[b, w])) for w in chosen} for b in rows}


def probe_verify_costs(target, max_width: int, context: int = PROBE_CONTEXTS[0], widths=PROBE_WIDTHS,
                       repeats: int = 3) -> dict:
    """One request's {width: verify seconds} (the cost probe at one row), for `--width auto` when no cost table
    was measured, made non-decreasing in width (one row's more rows never cost less); the policy refines it
    from observed rounds."""
    return non_decreasing(probe_costs(target, [1], max_width, context, widths, repeats)[1])


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
