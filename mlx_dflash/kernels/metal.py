"""What both Metal kernels share: whether Metal runs here, their sources, the process-wide race gate."""

from __future__ import annotations

import importlib.resources
import re

from .race_gate import RaceGate

_gate: list[RaceGate] = []


def race_gate() -> RaceGate:
    """The process-wide gate (its verdict cache is read once)."""
    if not _gate:
        _gate.append(RaceGate())
    return _gate[0]


def read_metal_file(name: str) -> tuple[str, str]:
    """Return (header, body) of ``metal_kernels/<name>``, split at the ``//@@`` markers."""
    text = importlib.resources.files("mlx_dflash.metal_kernels").joinpath(name).read_text()
    parts = re.split(r"^//@@ (header|body)[^\n]*\n", text, flags=re.M)
    sections = dict(zip(parts[1::2], parts[2::2]))
    if "body" not in sections:
        raise ValueError(f"{name}: missing '//@@ body' marker")
    return sections.get("header", ""), sections["body"]
