"""Never slower than MLX, never broken by ours: which path serves each (chip, kernel, dtype, shape, rows) key.

* **First use on this machine** (no verdict for the key, or one recorded under another MLX, mlx-dflash, OS or
  kernel source: ``stamp``): our kernel runs on the call's own inputs and is checked against MLX's path; if
  both agree they race, and a winner (faster by ``MARGIN``) is soaked: a longer burst of both in turn, where
  a stall or a slowdown past the margin sends the shape back to MLX's. The verdict is cached on disk.
* **First use in a process**: ours runs once, alone, on the call's inputs (and is checked against MLX's, for
  a cached "ours" verdict) before it enters a forward; a forced route runs it alone too. MLX builds a lazy
  graph: a Metal compile, launch or run-time error raised inside the forward would surface at the forward's
  evaluation, with the KV cache already holding the failed node. Caught here, any error routes the key to
  MLX's path for the process and in the store; the engine report's fallback note says it.
* **A launch refused for its size** (MLX names the pipeline's limit: it shrinks with the registers a kernel
  needs) is retried at the largest size the kernel offers within that limit (``sizes``, largest first).

The cache is one JSON file (``$MLX_DFLASH_CACHE/race_verdicts.json``, default
``~/.cache/mlx-dflash/race_verdicts.json``) written atomically; an unreadable one is ignored and rewritten.
Each entry keeps the timings, the largest difference seen, the launch size and the stamp it was made under.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx

from ..utils import cache_dir, write_json
from .source import kernel_stamp

OURS, MLX = "dflash", "mlx"
ROUTES = (OURS, MLX)
# Largest |ours - MLX's| / max|MLX's| accepted as the same result: both accumulate in float32 and round
# to the output dtype, so they differ by summation order plus one rounding of the output.
TOLERANCE = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}
RACE_REPEATS = 7
SOAK_REPEATS = 24  # the first use's burst; the doctor soaks longer
MARGIN = 0.97  # ours serves only at <= 97% of MLX's median time: a tie in the noise stays with MLX
STALL = 4.0  # a call of ours slower than 4x MLX's slowest call of the same burst is a stall
_REFUSED = re.compile(r"maximum allowed threads per threadgroup \((\d+)\)")  # MLX's custom_kernel.cpp


def cache_path() -> Path:
    return cache_dir() / "race_verdicts.json"


def kernel_of(key: str) -> str:
    """The kernel a key names ("wide_qmm", "mr_attention"): keys are chip|kernel|dtype|shape...|rows."""
    return key.split("|")[1]


def call_times(calls: dict[str, Callable[[], mx.array]], repeats: int) -> dict[str, list[float]]:
    """Wall seconds of each evaluated call, `repeats` times, interleaved so both see the same machine state."""
    for fn in calls.values():
        mx.eval(fn())  # compile / warm up
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(repeats):
        for name in (list(calls) if i % 2 == 0 else list(calls)[::-1]):
            start = time.perf_counter()
            mx.eval(calls[name]())
            times[name].append(time.perf_counter() - start)
    return times


def halvings(threads: int) -> list[int]:
    """A kernel's launch sizes to try, largest first: `threads`, then halves down to one simdgroup (32)."""
    sizes = [threads]
    while sizes[-1] > 32:
        sizes.append(sizes[-1] // 2)
    return sizes


def median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


@dataclass(frozen=True)
class Choice:
    """Which path serves a key: `route` (OURS or MLX), at launch size `size` (ours), `reason` in a few words;
    `fallback` when MLX's serves although ours was meant to (a failure, a disagreement, a stall)."""

    route: str
    size: int | None
    reason: str
    fallback: bool = False


class RaceGate:
    """Routes each key to ours or MLX's path (see the module's docstring).

    timer: ``({name: fn}, repeats) -> {name: [seconds]}`` (default ``call_times``; tests inject timings);
    stamp: ``kernel -> dict`` of what a verdict holds for (default ``source.kernel_stamp``)."""

    def __init__(self, path: Path | None = None, timer=None, stamp=None, soak_repeats: int = SOAK_REPEATS):
        self.path = Path(path) if path is not None else cache_path()
        self.timer = timer or call_times
        self.stamp = stamp or kernel_stamp
        self.soak_repeats = soak_repeats
        self.verdicts = self._load()
        self._chosen: dict[tuple[str, bool], Choice] = {}  # this process's choices, (key, forced)

    def _load(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or not all(
                isinstance(v, dict) and v.get("route") in ROUTES for v in data.values()
            ):
                raise ValueError("not a map of verdicts")
            return data
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            print(f"mlx-dflash: ignoring the unreadable race-verdict cache {self.path} ({e}); it will be "
                  "rewritten", file=sys.stderr)
            return {}

    def current(self, key: str) -> dict | None:
        """The cached verdict for `key` if it was made under this machine's stamp (versions, OS, source)."""
        found = self.verdicts.get(key)
        return found if found is not None and found.get("stamp") == self.stamp(kernel_of(key)) else None

    def choose(self, key: str, ours: Callable[[int], mx.array], theirs: Callable[[], mx.array], dtype,
               sizes: Sequence[int], forced: bool = False) -> Choice:
        """The path for this call of `key`. ours(size) runs our kernel at a launch size (sizes: largest first),
        theirs() MLX's path. forced: ours whenever it runs (no race), MLX's only when it fails."""
        memo = (key, forced)
        if memo not in self._chosen:
            self._chosen[memo] = (self._forced if forced else self._auto)(key, ours, theirs, dtype, list(sizes))
        return self._chosen[memo]

    def _forced(self, key, ours, theirs, dtype, sizes) -> Choice:
        found = self.current(key)
        if found is not None and found.get("failed"):
            return Choice(MLX, None, f"route 'dflash' forced, but {describe(found)}", True)
        size, result = self._run(key, ours, sizes if found is None else [found.get("size") or sizes[0]])
        if size is None:
            return Choice(MLX, None, f"route 'dflash' forced, but {result}", True)
        return Choice(OURS, size, "route 'dflash' forced")

    def _auto(self, key, ours, theirs, dtype, sizes) -> Choice:
        found = self.current(key)
        if found is None or (found["route"] == OURS and found.get("numerics_ok") is not True):
            return self._race(key, ours, theirs, dtype, sizes)
        if found["route"] == MLX:
            return Choice(MLX, None, describe(found), fallback=is_fallback(found))
        refused, size, _ = self._check(key, ours, theirs, dtype, [found.get("size") or sizes[0]])  # this process
        return refused or Choice(OURS, size, describe(found))

    def _run(self, key, ours, sizes) -> tuple[int | None, mx.array | str]:
        """(size, ours' evaluated result) at the largest size that launches, or (None, why not) when none does;
        a failure is stored as the key's verdict (the engine report's fallback note says it)."""
        allowed, error = float("inf"), "no launch size to try"
        for size in (s for s in sizes if s <= allowed):
            try:
                result = ours(size)
                mx.eval(result)
                return size, result
            except Exception as e:  # a Metal compile, launch or run-time error, whatever MLX raised
                error, refused = first_line(e), _REFUSED.search(str(e))
                if refused is None:
                    break
                allowed = int(refused.group(1))  # smaller sizes may fit the pipeline's limit
        return None, describe(self._record(key, route=MLX, failed=error))

    def _check(self, key, ours, theirs, dtype, sizes) -> tuple[Choice | None, int | None, float | None]:
        """Run ours once and compare it with MLX's: (None, the size it ran at, its relative error) when it runs
        and agrees, else (MLX's choice, stored, None, None)."""
        size, a = self._run(key, ours, sizes)
        if size is None:
            return Choice(MLX, None, a, True), None, None
        b = theirs()
        ref = b.astype(mx.float32)
        scale = max(mx.abs(ref).max().item(), 1e-30)
        err = mx.abs(a.astype(mx.float32) - ref).max().item() / scale
        if a.shape == b.shape and err <= TOLERANCE.get(dtype, 1e-4):  # NaN compares False
            return None, size, err
        found = self._record(key, route=MLX, numerics_ok=False, max_rel_err=err, size=size)
        print(f"mlx-dflash: our kernel disagrees with MLX's for {key} (relative error {err:.3g}); "
              "using MLX's", file=sys.stderr)
        return Choice(MLX, None, describe(found), True), None, None

    def _race(self, key, ours, theirs, dtype, sizes) -> Choice:
        refused, size, err = self._check(key, ours, theirs, dtype, sizes)
        if refused is not None:
            return refused
        calls = {OURS: lambda: ours(size), MLX: theirs}
        try:
            race = self.timer(calls, RACE_REPEATS)
            won = median(race[OURS]) <= MARGIN * median(race[MLX])
            burst = self.timer(calls, self.soak_repeats) if won else race
        except Exception as e:  # an error only a repeated run met
            found = self._record(key, route=MLX, failed=first_line(e), numerics_ok=True, max_rel_err=err, size=size)
            return Choice(MLX, None, describe(found), True)
        stalled = won and max(burst[OURS]) > STALL * max(burst[MLX])
        kept = won and not stalled and median(burst[OURS]) <= MARGIN * median(burst[MLX])
        soak = None if not won else dict(calls=len(burst[OURS]), dflash_s=median(burst[OURS]),
                                         mlx_s=median(burst[MLX]), dflash_worst_s=max(burst[OURS]),
                                         mlx_worst_s=max(burst[MLX]), stalled=stalled)
        found = self._record(key, route=OURS if kept else MLX, numerics_ok=True, max_rel_err=err, size=size,
                             dflash_s=median(race[OURS]), mlx_s=median(race[MLX]), soak=soak)
        return Choice(found["route"], size if kept else None, describe(found), fallback=stalled)

    def _record(self, key: str, **verdict) -> dict:
        found = self.verdicts[key] = dict(verdict, stamp=self.stamp(kernel_of(key)))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, self.verdicts, indent=1, sort_keys=True)
        return found


def is_fallback(found: dict) -> bool:
    """Whether a verdict sends its key to MLX's path for a fault of ours (not for losing the race)."""
    return bool(found.get("failed")) or found.get("numerics_ok") is False or bool((found.get("soak") or {}).get(
        "stalled"))


def describe(found: dict) -> str:
    """A verdict in a few words: both timings, or why ours does not serve (the same words for every shape a
    fault of the same kind hit, so that a generation notes it once)."""
    if found.get("failed"):
        if _REFUSED.search(found["failed"]):  # the sizes in MLX's message differ from shape to shape
            return "ours failed here: every launch size over the pipeline's thread limit"
        return f"ours failed here: {found['failed']}"
    if found.get("numerics_ok") is False:
        return f"race gate: ours disagreed with MLX's (relative error {found.get('max_rel_err', float('nan')):.3g})"
    soak, ms = found.get("soak"), lambda s: f"{s * 1e3:.3g} ms"  # noqa: E731
    if soak and soak["stalled"]:
        return f"soak: ours stalled ({ms(soak['dflash_worst_s'])} against MLX's slowest {ms(soak['mlx_worst_s'])})"
    if soak and found["route"] == MLX:
        return f"soak: ours {ms(soak['dflash_s'])}, MLX's {ms(soak['mlx_s'])} over {soak['calls']} calls"
    ours, theirs = found.get("dflash_s"), found.get("mlx_s")
    if ours is None or theirs is None:
        return f"race gate: {found['route']} (no timings recorded)"
    return f"race gate: ours {ms(ours)}, MLX's {ms(theirs)}"


_shared: list = []  # the process's gate, made on first use


def shared_gate() -> RaceGate:
    """The process-wide gate every Metal kernel routes through (its verdict cache is read once)."""
    if not _shared:
        _shared.append(RaceGate())
    return _shared[0]
