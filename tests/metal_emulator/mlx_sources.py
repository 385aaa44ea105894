"""Cut MLX's own kernel helpers (unmodified) out of the installed wheel's Metal headers.

Used to run MLX's real `qmv_fast_impl` / `qmv_wide_impl` through the emulator as an independent check of
the emulator itself.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx

KERNELS_DIR = Path(mx.__file__).resolve().parent / "include" / "mlx" / "backend" / "metal" / "kernels"


def _function_text(text: str, name: str) -> str:
    m = re.search(r"template\s*<[^{;]*?>\s*(?:inline|METAL_FUNC)\b[^{;]*?\b" + re.escape(name) + r"\s*\(", text)
    if not m:
        raise LookupError(f"{name} not found in quantized.h")
    i = text.index("{", m.end())
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[m.start() : j + 1]
    raise LookupError(f"unbalanced braces in {name}")


def quantized_header(functions: list[str]) -> str:
    """The prologue of quantized.h (constants, `using namespace metal`) plus the named functions, in
    file order, each copied verbatim."""
    text = (KERNELS_DIR / "quantized.h").read_text()
    prologue = text[: text.index("template")]
    found = sorted(((text.index(_function_text(text, f)), _function_text(text, f)) for f in functions))
    return prologue + "\n\n".join(body for _, body in found) + "\n"
