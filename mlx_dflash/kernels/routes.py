"""Which path served each routed call: ours or MLX's, per kernel and shape bin (the race gate's key), and why.

The routed call sites (``WideQuantizedLinear`` for 6..16 rows, the verify forward's 2..16-row attention)
record every decision here, in Python, as the graph is built. The log is process-wide and only grows:
``snapshot()`` before a generation and ``since(snapshot)`` after it give that generation's calls (one
generation runs at a time in a process, as the server runs them); ``totals()`` the process's, for
/metrics. A call that falls back to MLX's path for a reason other than the race (an unsupported dtype, a
quantized KV cache, our kernel disagreeing with MLX's) is marked a fallback: the generation turns it into a
note (decoding/engine_report.py).
"""

from __future__ import annotations

from .race_gate import MLX, OURS, kernel_of

_calls: dict[tuple[str, str], int] = {}  # (race key, route) -> calls
_reasons: dict[tuple[str, str], tuple[str, bool]] = {}  # (race key, route) -> (why that route, a fallback)

WHAT = {"wide_qmm": ("verify matmul", "MLX's quantized matmul"), "mr_attention": ("verify attention", "MLX's SDPA")}


def record(key: str, route: str, reason: str, fallback: bool = False):
    """One call of `key` (a race-gate key, chip first) served by `route` ("dflash" or "mlx"), for `reason`.
    fallback: MLX's path although ours was meant to serve."""
    entry = (key, route)
    _calls[entry] = _calls.get(entry, 0) + 1
    _reasons[entry] = (reason, fallback)  # the latest: a forced route or a new gate may have changed it


def shape_bin(key: str) -> str:
    """The race key without the chip: kernel, dtype and shape bin."""
    return key.split("|", 1)[1].replace("|", " ")


def fallback_note(kernel: str, reason: str) -> str:
    what, path = WHAT.get(kernel, (kernel, "MLX's path"))
    return f"note: {what}: {path} instead of ours ({reason}; the shape bins are in the routes)"


def snapshot() -> dict:
    return dict(_calls)


def since(before: dict) -> list[dict]:
    """The calls recorded after `before` (a snapshot): one entry per (shape bin, route), most calls first."""
    out = []
    for (key, route), calls in _calls.items():
        new = calls - before.get((key, route), 0)
        if new > 0:
            reason, fallback = _reasons[(key, route)]
            out.append({"kernel": kernel_of(key), "bin": shape_bin(key), "route": route, "calls": new,
                        "reason": reason, "fallback": fallback})
    return sorted(out, key=lambda e: (e["kernel"], -e["calls"], e["bin"]))


def totals() -> dict[tuple[str, str, bool], int]:
    """Every call so far, per (kernel, route, a fallback): the process's, as /metrics shows them."""
    out: dict[tuple[str, str, bool], int] = {}
    for (key, route), calls in dict(_calls).items():  # copied at once: the engine thread records beside a reader
        entry = (kernel_of(key), route, _reasons.get((key, route), ("", False))[1])  # a call being recorded
        out[entry] = out.get(entry, 0) + calls
    return out


def fallback_notes(entries: list[dict]) -> list[str]:
    """The notes of the fallbacks among `entries` (as `since` returns them), one per kernel and reason."""
    return list(dict.fromkeys(fallback_note(e["kernel"], e["reason"]) for e in entries if e["fallback"]))


def route_line(entry: dict) -> str:
    who = {OURS: "ours", MLX: "MLX's"}[entry["route"]]
    return f"route: {entry['bin']}: {who}, {entry['calls']} calls ({entry['reason']})"
