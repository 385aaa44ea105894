"""Our kernels' Metal sources: the files shipped with the package (``metal_text``, ``read_metal_file``), what a
race verdict about a kernel holds for (``kernel_stamp``), and the exact source MLX generates for a
`mx.fast.metal_kernel` call, also where there is no Metal (``metal_source``).

MLX prints the source of a metal_kernel call made while an export is being traced (verbose=True)
instead of raising "No Metal back-end"; this captures that print (file descriptor 1, where MLX's C++
writes) and returns the source. `mlx-dflash doctor` generates our kernels' sources this way where there is
no Metal; the tests' CPU emulator (tests/metal_emulator) compiles and runs them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import importlib.resources
import os
import platform
import re
import sys
import tempfile
import threading

import mlx.core as mx

# Each kernel's Metal files (a verdict about a kernel holds for these sources only).
SOURCES = {"wide_qmm": ("wide_qmm.metal",),
           "mr_attention": ("mr_attention_partial.metal", "mr_attention_combine.metal")}


def metal_text(name: str) -> str:
    """``metal_kernels/<name>``: ASCII, as MLX hands it to Metal."""
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

_capture_lock = threading.Lock()
_SOURCE_RE = re.compile(r"Generated source code for `[^`]*`:\n```\n(.*?)\n```", re.S)


def metal_source(kernel, **call) -> str:
    """The exact Metal source (header + signature + body + instantiation) MLX generates for
    ``kernel(**call)``; MLX's own utils.h prelude, prepended at compile time, is not part of it."""
    arrays = [a for a in call["inputs"] if isinstance(a, mx.array)]

    def traced(*xs):
        it = iter(xs)
        inputs = [next(it) if isinstance(a, mx.array) else a for a in call["inputs"]]
        return kernel(**{**call, "inputs": inputs, "verbose": True})

    libc = ctypes.CDLL(None)
    with _capture_lock, tempfile.TemporaryFile(mode="w+b") as tmp:
        sys.stdout.flush()
        libc.fflush(None)
        saved = os.dup(1)
        try:
            os.dup2(tmp.fileno(), 1)
            mx.export_function(lambda _: None, traced, *arrays)
            libc.fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode()
    found = _SOURCE_RE.findall(text)
    if not found:
        raise RuntimeError("MLX printed no kernel source (did the metal_kernel API change?)")
    return found[-1]
