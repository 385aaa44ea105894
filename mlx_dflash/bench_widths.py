"""The width benchmark: what a verify of `width` rows costs, and where that cost jumps (the "cliff").

On Metal, MLX's quantized matmul streams the weights once for <= 5 rows and 2-4 times (or through a
32-row tile) for 6..16, and its attention switches to a padded tile kernel at q_len 9
(MLX's mlx/backend/metal/quantized.cpp, `QuantizedMatmul::eval_gpu`, and
mlx/backend/metal/scaled_dot_product_attention.cpp). On the CPU both are linear in rows
(mlx/backend/cpu/quantized.cpp runs one pass per row; this benchmark shows it).

`run_widths_bench` measures, at widths 1..16 (median of repeated, warmed runs, interleaved in a random
order so drift and contention spread over all widths; wall and process CPU time are both recorded):
* `mx.quantized_matmul` on every distinct (K, N) of the model's quantized (or to-be-quantized) linear
  layers, or on a synthetic shape list; plus their layer-count weighted sum per width (derived);
* the full target verify, `Target.forward` of `width` tokens on a cache already holding a prefix of
  `short_cache` and `long_cache` positions (random keys/values of the model's shapes and dtype: the
  cost does not depend on their values; the offset is checked before every timed call);
* MLX's kernels ("mlx") and, where they can run (Metal), ours ("dflash": `install_wide_kernels`, and in
  the verify the multi-row attention kernel, `Target.install_attention_kernel`).
It writes `widths.json`, `cost_table.json` (for the decoder, see `load_cost_table`) and `widths.png`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import random
from pathlib import Path
from typing import Sequence

import click
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from .errors import DFlashError
from .options import Numbers, grouped
from .kernels import routes
from .kernels.race_gate import OURS
from .kernels.traffic import format_widths_model, widths_model
from .kernels.wide_qmm import (MAX_ROWS, MIN_ROWS, SUPPORTED_BITS, SUPPORTED_DTYPES, SUPPORTED_GROUP_SIZES,
                               WideQuantizedLinear, choose, install_wide_kernels, metal_available,
                               wide_quantized_matmul)
from .machine import machine_info, versions
from .plot import charts_available, widths_chart_png
from .policies.cliff import CLIFF_RULE, verdict
from .policies.verify_costs import filled_cache, precision, timed, weights_text
from .utils import DTYPES, portable_path, write_atomic

WIDTHS = tuple(range(1, 17))
SCHEMA = "mlx-dflash/bench-widths/1"
WIDE_OK = {("affine", b, g, d) for b in SUPPORTED_BITS for g in SUPPORTED_GROUP_SIZES for d in SUPPORTED_DTYPES}


# ---------------------------------------------------------------------------------------------------
# What is measured.

def model_shapes(model: nn.Module, group_size: int = 64, bits: int = 4) -> list[dict]:
    """Distinct (K, N) of the model's quantized or to-be-quantized linear layers (a tied output head
    counts as a layer of its embedding), with their counts and group_size/bits/mode."""
    found: dict[tuple, dict] = {}

    def add(name, k, n, gs, b, mode):
        entry = found.setdefault((k, n, gs, b, mode), {"K": k, "N": n, "group_size": gs, "bits": b,
                                                       "mode": mode, "count": 0, "layers": []})
        entry["count"] += 1
        entry["layers"].append(name)

    tied = all(getattr(m, "lm_head", None) is None for m in (model, getattr(model, "language_model", None)))
    for name, m in model.named_modules():
        head = tied and name.endswith("embed_tokens")
        label = name + (".as_linear" if head else "")
        if isinstance(m, (nn.QuantizedLinear, WideQuantizedLinear)) or (head and isinstance(m, nn.QuantizedEmbedding)):
            add(label, m["weight"].shape[1] * 32 // m.bits, m["weight"].shape[0], m.group_size, m.bits, m.mode)
        elif isinstance(m, nn.Linear) or (head and isinstance(m, nn.Embedding)):
            add(label, m.weight.shape[1], m.weight.shape[0], group_size, bits, "affine")
    return sorted(found.values(), key=lambda e: (e["K"] * e["N"], e["K"]))


def _set_wide(model, on: bool, state: dict) -> None:
    """Install (or take out again) our wide kernels on this model instance."""
    if state.get("on", False) == on:
        return
    if on:
        install_wide_kernels(model, route="dflash")  # measure ours, not the race gate's pick
    else:
        swaps = [(n, m.unwrap()) for n, m in model.named_modules() if isinstance(m, WideQuantizedLinear)]
        if swaps:
            model.update_modules(tree_unflatten(swaps))
    state["on"] = on


def _qmm_case(shape: dict, dtype, wide: bool, widths, seed: int):
    k, n, gs, bits, mode = shape["K"], shape["N"], shape["group_size"], shape["bits"], shape["mode"]
    rng = mx.random.key(seed)
    q = mx.quantize((0.02 * mx.random.normal((n, k), key=rng)).astype(dtype), group_size=gs, bits=bits, mode=mode)
    wq, s, b = q[0], q[1], (q[2] if len(q) > 2 else None)
    xs = {w: mx.random.normal((w, k), key=mx.random.split(rng, w + 1)[w]).astype(dtype) for w in widths}
    mx.eval(wq, s, b, list(xs.values()))

    def measure(w):
        x = xs[w]
        if wide and MIN_ROWS <= w <= MAX_ROWS:
            choice = choose(x, wq, s, b, gs, bits, OURS)  # ours, or MLX's where ours fails here (a fallback)
            if choice.route == OURS:
                return timed(lambda: wide_quantized_matmul(x, wq, s, b, gs, bits, choice.size))
        return timed(lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=gs, bits=bits, mode=mode))
    return measure


def _verify_case(target, cache, length: int, wide: bool, state: dict, widths, offsets: set, seed: int):
    rng = np.random.default_rng(seed)
    ids = {w: mx.array(rng.integers(0, target.vocab_size, size=(1, w)), dtype=mx.int32) for w in widths}

    def measure(w):
        _set_wide(target.model, wide, state)
        target.install_attention_kernel("dflash" if wide else "mlx")  # ours forced, not the race gate's pick
        offset = next(c.offset for c in cache if hasattr(c, "offset"))  # hybrids: cache[0] is recurrent
        offsets.add(offset)
        if offset != length:
            raise RuntimeError(f"cache holds {offset} positions, expected {length}")
        seconds = timed(lambda: target.forward(ids[w], cache)[0])
        target.trim(cache, w)
        return seconds
    return measure


def sweep(cases: dict, widths, repeats: int, warmup: int, seed: int = 0, what: str = "", progress: bool = True) -> dict:
    """{case: {width: [(wall, cpu) seconds per repeat]}}: `warmup` untimed rounds, then `repeats`
    rounds, each over every (case, width) pair in a fresh random order. A progress bar (stderr) says
    `what` is measured and how far it is."""
    from tqdm import tqdm

    order = [(c, w) for c in cases for w in widths]
    rng = random.Random(seed)
    times = {c: {w: [] for w in widths} for c in cases}
    with tqdm(total=(warmup + repeats) * len(order), desc=what, unit="call", disable=not progress,
              leave=True) as bar:
        for r in range(warmup + repeats):
            bar.set_postfix_str(f"warm-up {r + 1}/{warmup}" if r < warmup else f"repeat {r - warmup + 1}/{repeats}")
            if r >= warmup:
                rng.shuffle(order)
            for c, w in order:
                seconds = cases[c](w)
                if r >= warmup:
                    times[c][w].append(seconds)
                bar.update()
    return times


def _series(name: str, widths, per_width: dict, clock: str, **extra) -> dict:
    """One curve: all repeats of both clocks, and median/min/verdict of the chosen one."""
    wall = [[r[0] for r in per_width[w]] for w in widths]
    cpu = [[r[1] for r in per_width[w]] for w in widths]
    chosen = wall if clock == "wall" else cpu
    med = [float(np.median(s)) for s in chosen]
    return {"name": name, **extra, "clock": clock, "widths": list(widths), "median_seconds": med,
            "min_seconds": [min(s) for s in chosen], "wall_seconds": wall, "cpu_seconds": cpu, **verdict(widths, med)}


def _parse_shape(s) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in (s.lower().split("x") if isinstance(s, str) else s))
    except (ValueError, TypeError):
        raise DFlashError(f"bad shape {s!r}: write KxN, e.g. 4096x14336") from None
    return k, n


@dataclasses.dataclass
class WidthsSettings:
    """What `run_widths_bench` measures and how (recorded in widths.json's "settings").

    full: the exhaustive sweep: 5 repeats, 2 warm-up rounds and a second, long cache (`long_cache`, default
    4096); without it 3 repeats, 1 warm-up round and only the short cache (unless given), a few minutes on
    a CPU. quantize_bits: quantize a float model in memory (mlx.nn.quantize, group_size) before measuring;
    None measures it as stored (synthetic shapes: 4-bit). dtype: the activations of the synthetic matmuls
    (default: the model's; without one, float16 on Metal, float32 on the CPU).
    clock: which time the medians, cliffs and cost table use: "wall", or "cpu" (process CPU time: on a
    shared CPU machine it leaves out other processes' time slices, which make wall-clock medians of long
    calls jump); "auto" = wall on Metal (the GPU's work is not CPU time), cpu on the CPU backend. Both are
    always recorded."""

    full: bool = False
    widths: Sequence[int] = WIDTHS
    short_cache: int = 128
    long_cache: int | None = None
    contexts: Sequence[int] = ()  # cache lengths to measure instead of the short (and long) cache
    repeats: int | None = None
    warmup: int | None = None
    quantize_bits: int | None = None
    group_size: int = 64
    dtype: str | None = None
    clock: str = "auto"
    seed: int = 0
    note: str = ""

    def __post_init__(self):
        if self.contexts:
            if self.long_cache is not None:
                raise DFlashError("--context replaces --long-cache (give one of them)")
            self.short_cache = min(self.contexts)  # the batch table's context
        self.repeats = self.repeats or (5 if self.full else 3)
        self.warmup = self.warmup if self.warmup is not None else (2 if self.full else 1)
        if self.long_cache is None and self.full:
            self.long_cache = 4096
        self.widths = sorted({int(w) for w in self.widths})
        if not self.widths or self.widths[0] < 1:
            raise DFlashError("widths must be integers >= 1")
        self.clock = self.clock if self.clock != "auto" else ("wall" if metal_available() else "cpu")
        if self.clock not in ("wall", "cpu"):
            raise DFlashError(f"clock must be auto, wall or cpu, not {self.clock!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise DFlashError(f"dtype must be float16, bfloat16 or float32, not {self.dtype!r}")

    @property
    def caches(self) -> list[int]:
        if self.contexts:
            return sorted({int(c) for c in self.contexts})
        return sorted({self.short_cache} | ({self.long_cache} if self.long_cache else set()))


def run_widths_bench(model_path: str | nn.Module | None, out_dir, shapes=None, *, log=print,
                     progress: bool | None = None, settings: WidthsSettings | None = None, **fields) -> dict:
    """Run the sweep, write widths.json, cost_table.json and widths.png into out_dir, return the results.

    model_path: mlx-lm directory or repo id, or a model instance (None: synthetic `shapes` only, no
    verify forward). shapes: [(K, N) or "KxN"] to time instead of the model's own layer shapes.
    settings: a `WidthsSettings`, or its fields as keywords. progress: tqdm bars on stderr (default: when `log` is
    given).
    """
    s = settings or WidthsSettings(**fields)
    if model_path is None and not shapes:
        raise DFlashError("give a model or a list of shapes (KxN) to measure")
    progress = log is not None if progress is None else progress
    log = log or (lambda *_: None)
    mx.random.seed(s.seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"model": (None if model_path is None else type(model_path).__module__ if
                        isinstance(model_path, nn.Module) else portable_path(model_path)), **dataclasses.asdict(s)}
    target = None if model_path is None else _prepare_target(model_path, s, record)
    act = DTYPES[s.dtype] if s.dtype else (DTYPES[record["model_precision"]["dtype"]] if target else
                                           (mx.float16 if metal_available() else mx.float32))
    record["dtype"] = str(act).replace("mlx.core.", "")
    bits = s.quantize_bits or 4  # the synthetic or to-be-quantized shapes' bits
    if shapes:
        shape_list = [{"K": k, "N": n, "group_size": s.group_size, "bits": bits, "mode": "affine",
                       "count": 1, "layers": []} for k, n in map(_parse_shape, shapes)]
    else:
        shape_list = model_shapes(target.model, s.group_size, bits)
    impls = ["mlx", "dflash"] if metal_available() else ["mlx"]
    log(f"quantized matmul: {len(shape_list)} shapes x {impls}, widths {s.widths[0]}..{s.widths[-1]}, "
        f"{s.repeats} repeats, {record['dtype']}")
    before = routes.snapshot()
    series = measure_matmuls(shape_list, impls, act, s, progress)
    if target is not None:
        series += measure_verify(target, "dflash" in impls and record["model_quantized"], s, progress)
    fallbacks = routes.fallback_notes(routes.since(before))  # ours forced, MLX's measured where ours failed
    for note in fallbacks:
        log(note)
    results = {"schema": SCHEMA, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": machine_info(), "versions": versions(), "settings": record, "cliff_rule": CLIFF_RULE,
               "series": series, "cliff": {x["name"]: x["cliff_width"] for x in series}, "fallbacks": fallbacks}
    results["cost_table"] = cost_table(results)
    results["best_width_by_context"] = best_widths(results["cost_table"])
    results["traffic_model"] = traffic_model(shape_list, s.widths, act)
    written = write_outputs(results, out_dir)
    log(format_table(results))
    log(format_widths_model(results["traffic_model"]))
    log(f"wrote {', '.join(written)} in {out_dir}" + ("" if "widths.png" in written else
        " (no chart: pip install 'mlx-dflash[bench]' for matplotlib)"))
    return results


def _prepare_target(model_path, s: WidthsSettings, record: dict):
    """The target to measure, quantized in memory first when `s.quantize_bits` asks for it (a model stored
    quantized is measured as stored); its precision goes into `record`."""
    from .models.target import Target
    from .pair import load_target
    from .policies.width import has_quantized_layers

    target = Target(model_path) if isinstance(model_path, nn.Module) else load_target(str(model_path))[0]
    if s.quantize_bits and not has_quantized_layers(target.model):
        nn.quantize(target.model, group_size=s.group_size, bits=s.quantize_bits)
        record["quantized_in_memory"] = True
    record["model_quantized"] = has_quantized_layers(target.model)
    record["model_precision"] = precision(target)
    return target


def measure_matmuls(shape_list: list[dict], impls: list[str], act, s: WidthsSettings, progress: bool) -> list[dict]:
    """One series per (shape, kernel) of `mx.quantized_matmul` (ours where it runs), plus each kernel's
    layer-count weighted sum per width."""
    cases, meta = {}, {}
    for i, sh in enumerate(shape_list):
        for impl in impls:
            if impl == "dflash" and (sh["mode"], sh["bits"], sh["group_size"], act) not in WIDE_OK:
                continue
            name = f"matmul K={sh['K']} N={sh['N']} {impl}"
            cases[name] = _qmm_case(sh, act, impl == "dflash", s.widths, s.seed + i)
            meta[name] = {"kind": "matmul", "impl": impl, **sh}
    times = sweep(cases, s.widths, s.repeats, s.warmup, s.seed, f"quantized matmul, {len(shape_list)} shapes x "
                  f"widths {s.widths[0]}..{s.widths[-1]}", progress)
    series = [_series(n, s.widths, times[n], s.clock, **meta[n]) for n in cases]
    for impl in impls:
        mine = [x for x in series if x["kind"] == "matmul" and x["impl"] == impl]
        if mine:
            per = {w: [(sum(x["count"] * x["median_seconds"][i] for x in mine),) * 2] for i, w in enumerate(s.widths)}
            series.append(_series(f"matmul total {impl}", s.widths, per, s.clock, kind="matmul_total", impl=impl,
                                  derived="sum over shapes of count x median seconds (no repeats of its own)"))
    return series


def measure_verify(target, wide_ok: bool, s: WidthsSettings, progress: bool) -> list[dict]:
    """One series per (cache length, kernels) of the full verify forward."""
    state = {"on": False}
    cases, meta = {}, {}
    for length in s.caches:
        cache, offsets = filled_cache(target, length, s.seed), set()
        for impl in (["mlx", "dflash"] if wide_ok else ["mlx"]):
            name = f"verify cache={length} {impl}"
            cases[name] = _verify_case(target, cache, length, impl == "dflash", state, s.widths, offsets, s.seed)
            meta[name] = {"kind": "verify", "impl": impl, "cache_length": length, "cache_offsets": offsets}
    times = sweep(cases, s.widths, s.repeats, s.warmup, s.seed, f"verify forward, cache {', '.join(map(str, s.caches))}",
                  progress)
    _set_wide(target.model, False, state)
    for n in cases:
        meta[n]["cache_offsets"] = sorted(meta[n]["cache_offsets"])
    return [_series(n, s.widths, times[n], s.clock, **meta[n]) for n in cases]


def traffic_model(shape_list: list[dict], widths, act) -> dict:
    """The modelled traffic (kernels/traffic.py) of the shapes our kernel takes, beside the timings."""
    wide = [sh for sh in shape_list if (sh["mode"], sh["bits"], sh["group_size"], act) in WIDE_OK]
    return widths_model(wide, widths, act.size)


def cost_table(results: dict) -> dict:
    """The decoder's table: verify seconds per width on the short cache with the best kernels here
    (ours where they run); without a model, the summed quantized matmuls stand in."""
    s = results["series"]
    pick = lambda kind: [x for x in s if x["kind"] == kind]  # noqa: E731
    rows = pick("verify") or pick("matmul_total")
    best = [x for x in rows if x["impl"] == "dflash"] or rows
    short = min(x.get("cache_length", 0) for x in best)
    main = next(x for x in best if x.get("cache_length", 0) == short)
    m, settings = results["machine"], results["settings"]
    if main["kind"] == "verify":  # the model as measured
        measured = settings["model_precision"]
    else:  # synthetic shapes, at the bits and activations they were timed with
        measured = {"dtype": settings["dtype"],
                    "quantization": {"bits": settings["quantize_bits"] or 4, "group_size": settings["group_size"]}}
    return {"widths": main["widths"], "verify_seconds": main["median_seconds"], **measured,
            "source": (f"mlx-dflash bench widths: {main['name']} of {settings['model'] or 'synthetic shapes'}"
                       f", median {main['clock']} time of {settings['repeats']}, {results['date']}"),
            "machine": {"chip": m.get("chip"), "platform": m["platform"], "mlx": results["versions"]["mlx"]},
            "impl": main["impl"], "clock": main["clock"], "cache_length": main.get("cache_length"),
            "cliff_width": main["cliff_width"],
            "by_cache_length": {str(x["cache_length"]): x["median_seconds"] for x in best if "cache_length" in x}}


ACCEPTANCES = (0.5, 0.7, 0.9)  # per-draft acceptance rates the best-width summary is shown for


def best_widths(table: dict) -> dict:
    """{acceptance: {context: width}}: the verify width with the most tokens per second of verify at each
    measured context, for a drafter whose every draft is kept with that chance once the ones before it
    were (1 + a + ... + a^(w-1) tokens in cost(w)); drafting time left out. How the cost curve's shape,
    not the drafter, moves the best width with the context."""
    widths = table["widths"]
    out = {}
    for a in ACCEPTANCES if table.get("by_cache_length") else ():
        out[str(a)] = {c: widths[max(range(len(widths)), key=lambda i: (1 - a ** widths[i]) / (1 - a) / row[i])]
                       for c, row in sorted(table["by_cache_length"].items(), key=lambda kv: int(kv[0]))}
    return out


# ---------------------------------------------------------------------------------------------------
# Output: JSON, table, chart (plot.py, with matplotlib).

def write_outputs(results: dict, out_dir: Path) -> list[str]:
    """widths.json, cost_table.json and (with matplotlib) widths.png; the names written."""
    write_atomic(out_dir / "widths.json", (json.dumps(results, indent=1) + "\n").encode())
    write_atomic(out_dir / "cost_table.json", (json.dumps(results["cost_table"], indent=1) + "\n").encode())
    if not charts_available():
        return ["widths.json", "cost_table.json"]
    write_atomic(out_dir / "widths.png", widths_chart_png(results))
    return ["widths.json", "cost_table.json", "widths.png"]


def format_table(results: dict) -> str:
    cols = [s for s in results["series"] if s["kind"] in ("verify", "matmul_total")]
    widths = results["settings"]["widths"]
    head = ["width"] + [s["name"].replace("matmul total", "qmm sum").replace("verify ", "") + " ms" for s in cols]
    rows = [[str(w)] + [f"{s['median_seconds'][i] * 1e3:.2f}" for s in cols] for i, w in enumerate(widths)]
    size = [max(len(r[j]) for r in [head] + rows) for j in range(len(head))]
    lines = ["  ".join(c.rjust(size[j]) for j, c in enumerate(r)) for r in [head] + rows]
    m = results["machine"]
    lines.insert(0, f"{m.get('chip')} ({m['device']}), mlx {results['versions']['mlx']}, "
                    f"median {results['settings']['clock']} time of {results['settings']['repeats']} runs")
    if m.get("quantized_matmul_routing"):
        lines.insert(1, f"MLX quantized matmul here: {m['quantized_matmul_routing']}")
    lines += [f"{s['name']}: {s['verdict']}" for s in cols]
    for a, by_context in results.get("best_width_by_context", {}).items():
        lines.append(f"best width at acceptance {a}: " + ", ".join(f"{w} at {c} tokens" for c, w in by_context.items()))
    table = results["cost_table"]
    lines.append(f"cost table: {table['dtype']} activations, {weights_text(table['quantization'])}, chip "
                 f"{table['machine']['chip']} (`generate --width auto --cost-table` warns when its target differs)")
    return "\n".join(lines)


settings_options = grouped(
    "settings", WidthsSettings,
    click.option("--full", is_flag=True,
                 help="The exhaustive sweep: 5 repeats, 2 warm-up rounds, and a long cache (--long-cache) besides the "
                      "short one. Default: 3 repeats, 1 warm-up, short cache (minutes on a CPU)."),
    click.option("--repeats", default=None, type=int),
    click.option("--warmup", default=None, type=int),
    click.option("--max-width", "widths", default=16, show_default=True, type=click.IntRange(min=1),
                 callback=lambda ctx, param, most: range(1, most + 1), help="Time widths 1..N."),
    click.option("--short-cache", default=128, show_default=True, type=int),
    click.option("--long-cache", default=None, type=int,
                 help="Also measure on a cache this long (default with --full: 4096)."),
    click.option("--context", "contexts", default=(), type=Numbers("context lengths", "256,1024,4096"),
                 help="Measure the verify at these context lengths instead, e.g. 256,1024,4096: the cost table then "
                      "gives --width auto and D-cut a context axis (no probe at start-up or on long prompts)."),
    click.option("--bits", "quantize_bits", default=None, type=int, help="Quantize a float model in memory to this "
                 "many bits first (default: measure the model as stored; --shape matmuls: 4)."),
    click.option("--group-size", default="64", show_default=True, type=click.Choice(["32", "64", "128"]),
                 callback=lambda ctx, param, size: int(size)),
    click.option("--dtype", type=click.Choice(list(DTYPES)), default=None,
                 help="Activations of the timed matmuls (default: the model's; --shape alone: float16 on Metal, "
                      "float32 on the CPU)."),
    click.option("--clock", type=click.Choice(["auto", "wall", "cpu"]), default="auto", show_default=True,
                 help="auto: wall time on Metal, process CPU time on a (shared) CPU."),
)


@click.command("widths")
@click.option("--model", "model_path", help="Model whose layer shapes and verify forward are timed "
              "(default: SmolLM2-135M-Instruct, unless --shape is given).")
@click.option("--shape", "shapes", multiple=True, help="A KxN quantized matmul to time instead (repeatable).")
@click.option("--out", "out_dir", default="bench-widths", show_default=True, type=click.Path(file_okay=False))
@settings_options
@click.option("--batch", "batches", default=None, type=Numbers("batch sizes", "1,2,4,8"),
              help="Also time verifies of several rows at once, e.g. 1,2,4,8 (rows x width, for a batching `serve "
                   "--cost-table`): added to cost_table.json as its rows per batch size.")
def main(model_path, shapes, out_dir, settings, batches):
    """Verify cost per width 1..16 (the quantized "verify-width cliff"): JSON, a table, a PNG, a cost table."""
    from .downloads import default_target

    if not model_path and not shapes:
        model_path = default_target()
    if batches and (not model_path or settings.quantize_bits):
        raise DFlashError("--batch times the model as stored: give a model (not --shape) and no --bits")
    run_widths_bench(model_path, out_dir, shapes=list(shapes) or None, settings=settings, log=click.echo)
    if batches:
        from .pair import load_target
        from .policies.dcut import batch_cost_rows, probe_batch_costs
        from .utils import write_json

        target, _ = load_target(model_path)
        costs = probe_batch_costs(target, batches, settings.widths[-1], context=settings.short_cache,
                                  repeats=settings.repeats)
        table = Path(out_dir) / "cost_table.json"  # one table: its rows per batch size beside the one-row costs
        click.echo(f"wrote {write_json(table, {**json.loads(table.read_text()), **batch_cost_rows(costs)})}")
