"""What machine this is, as the benchmarks and bug reports record it: platform, chip, Metal or not, the
versions of MLX, mlx-lm and this package, and what MLX's quantized matmul does with many rows on the chip."""

from __future__ import annotations

import os
import platform
import re

import mlx.core as mx

from .kernels.metal import metal_available


def machine_info() -> dict:
    """Platform, device and chip (Metal: mx.device_info(); CPU: /proc/cpuinfo model name)."""
    info = {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "device": str(mx.default_device()), "metal": metal_available()}
    try:
        dev = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        info["device_info"] = {k: v for k, v in dev.items() if isinstance(v, (str, int, float, bool))}
        info["chip"] = dev.get("device_name") or dev.get("architecture")
    except Exception:  # pragma: no cover - an MLX without device_info for this backend
        pass
    if not info["metal"] and os.path.exists("/proc/cpuinfo"):
        names = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
        info["chip"] = names[0] if names else info.get("chip")
    info["chip"] = info.get("chip") or platform.processor() or platform.machine()
    info["quantized_matmul_routing"] = quantized_matmul_routing(
        (info.get("device_info") or {}).get("architecture") if info["metal"] else None)
    return info


def quantized_matmul_routing(architecture: str | None) -> str:
    """What MLX 0.32's quantized matmul does with M rows on this chip (`QuantizedMatmul::eval_gpu` and
    `get_qmv_batch_limit` in MLX's mlx/backend/metal/quantized.cpp), from
    the Metal architecture string (applegpu_g<generation><tier>: 13 M1, 14 M2, 15 M3, 16 M4, 17 M5;
    tier d = Ultra); None for the CPU."""
    if architecture is None:
        return "CPU: every row costs the same (linear in rows, no weight-reuse path and no cliff)"
    m = re.search(r"g(\d+)([a-z])$", architecture)
    if not m:
        return f"unknown Metal architecture {architecture!r}: routing not known"
    gen, tier = int(m.group(1)), m.group(2)
    if gen < 15:
        path = "M1/M2: no affine qmv_wide, so every row is one more full pass over the weights"
    else:
        path = "M3 and newer: qmv_wide reads the weights once per up to 5 rows (6..10 rows: twice)"
    limit = {True: "18 rows (Ultra)", False: "25 rows (M5)" if gen >= 17 else
             ("10 rows, 6 for a 4096->14336 layer" if gen < 15 else "about 13-15 rows")}[tier == "d"]
    return f"{path}; from {limit} (4096-wide 4-bit layers) MLX switches to its tiled qmm"


def versions() -> dict:
    import importlib.metadata

    import mlx_lm

    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "python": platform.python_version(),
            "mlx_dflash": importlib.metadata.version("mlx-dflash")}
