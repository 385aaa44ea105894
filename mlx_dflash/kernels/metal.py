"""What both Metal kernels share: their sources, what a verdict about them holds for, the process-wide race gate."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.resources
import platform
import re

import mlx.core as mx

from .race_gate import RaceGate

# Each kernel's Metal files (a verdict about a kernel holds for these sources only).
SOURCES = {"wide_qmm": ("wide_qmm.metal",),
           "mr_attention": ("mr_attention_partial.metal", "mr_attention_combine.metal")}

_gate: list[RaceGate] = []


def race_gate() -> RaceGate:
    """The process-wide gate (its verdict cache is read once)."""
    if not _gate:
        _gate.append(RaceGate())
    return _gate[0]


def metal_text(name: str) -> str:
    return importlib.resources.files("mlx_dflash.metal_kernels").joinpath(name).read_text(encoding="ascii")


def read_metal_file(name: str) -> tuple[str, str]:
    """Return (header, body) of ``metal_kernels/<name>``, split at the ``//@@`` markers."""
    parts = re.split(r"^//@@ (header|body)[^\n]*\n", metal_text(name), flags=re.M)
    sections = dict(zip(parts[1::2], parts[2::2]))
    if "body" not in sections:
        raise ValueError(f"{name}: missing '//@@ body' marker")
    return sections.get("header", ""), sections["body"]


@functools.lru_cache(maxsize=None)
def kernel_stamp(kernel: str) -> dict:
    """What a race verdict about `kernel` holds for: the MLX and mlx-dflash versions, the OS release (macOS
    ships the Metal compiler) and a hash of the kernel's sources; a verdict under another stamp is raced again."""
    sources = "".join(metal_text(name) for name in SOURCES[kernel])
    return {"mlx": mx.__version__, "mlx_dflash": importlib.metadata.version("mlx-dflash"),
            "os": platform.mac_ver()[0] or f"{platform.system()} {platform.release()}",
            "source": hashlib.sha256(sources.encode()).hexdigest()[:16]}
