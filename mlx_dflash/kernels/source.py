"""The exact Metal source MLX generates for a `mx.fast.metal_kernel` call, also where there is no Metal.

MLX prints the source of a metal_kernel call made while an export is being traced (verbose=True)
instead of raising "No Metal back-end"; this captures that print (file descriptor 1, where MLX's C++
writes) and returns the source. `mlx-dflash doctor` generates our kernels' sources this way where there is
no Metal; the tests' CPU emulator (tests/metal_emulator) compiles and runs them.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import tempfile
import threading

import mlx.core as mx

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
