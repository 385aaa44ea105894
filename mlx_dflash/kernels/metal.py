"""The process-wide race gate both Metal kernels route through."""

from __future__ import annotations

from .race_gate import RaceGate

_gate: list[RaceGate] = []


def race_gate() -> RaceGate:
    """The process-wide gate (its verdict cache is read once)."""
    if not _gate:
        _gate.append(RaceGate())
    return _gate[0]
