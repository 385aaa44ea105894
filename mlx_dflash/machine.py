"""What machine this is, as the benchmarks and bug reports record it: platform, chip, Metal or not, memory,
the versions of MLX, mlx-lm and this package, what MLX's quantized matmul does with many rows on the chip,
the float dtype that runs fast here, and on Linux which BLAS serves MLX's CPU matmuls (the wheel's bundled
reference BLAS is about 10x slower than OpenBLAS)."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
import sys

import mlx.core as mx

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"  # Debian/Ubuntu's libopenblas0-pthread
# Where the distributions put OpenBLAS (the first found is preloaded): Debian/Ubuntu (libopenblas0-pthread,
# by architecture), Fedora (openblas), Arch (openblas).
OPENBLAS_PATHS = (f"/usr/lib/{platform.machine()}-linux-gnu/libopenblas.so.0", "/usr/lib64/libopenblas.so.0",
                  "/usr/lib/libopenblas.so.0")
BLAS_FIX = ("install OpenBLAS (Debian/Ubuntu: apt-get install libopenblas0-pthread; Fedora: dnf install openblas; "
            f"Arch: pacman -S openblas) and mlx-dflash preloads it; or export LD_PRELOAD={OPENBLAS}")
NO_PRELOAD = "MLX_DFLASH_NO_BLAS_PRELOAD"  # set to 1: never re-run a command with OpenBLAS preloaded


def metal_available() -> bool:
    """True only when MLX has a usable Metal device."""
    try:
        return bool(mx.metal.is_available())
    except Exception:  # pragma: no cover - builds without the metal module
        return False



@functools.lru_cache(maxsize=1)
def chip_name() -> str:
    """The GPU this process runs on (architecture string, e.g. ``applegpu_g15s``), or ``cpu``."""
    try:
        if mx.metal.is_available():
            info = mx.device_info()
            return str(info.get("architecture") or info.get("device_name") or "metal")
    except Exception:  # pragma: no cover - builds without device_info
        pass
    return "cpu"


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
    info["memory_gb"] = memory_gb()
    if sys.platform.startswith("linux"):
        info["blas"] = blas_library()
    info["quantized_matmul_routing"] = quantized_matmul_routing(
        (info.get("device_info") or {}).get("architecture") if info["metal"] else None)
    return info


def fast_float_dtype() -> str:
    """The float dtype to store a converted model in here: float16 on Metal; float32 on MLX's CPU backend,
    whose half-precision matmuls run many times slower than its float32 ones."""
    return "float16" if metal_available() else "float32"


def prefill_step(serving: bool = False) -> int:
    """Prompt tokens per prefill chunk here. MLX's CPU attention is the unfused matmul-softmax-matmul: a
    chunk computes its whole block of scores against the cache, the masked half of its own block included,
    so on the CPU small chunks read a long prompt fastest (measured: docs/benchmarks.md, "Reading a prompt in
    chunks"). With Metal: mlx-lm's 2048 for one request, 512 for a server, whose chunks take turns with
    decoding rounds."""
    if metal_available():
        return 512 if serving else 2048
    return 128


def half_precision_warning(dtype: str | None) -> str | None:
    """One line warning that half-precision weights crawl here (MLX on the CPU only), or None."""
    if dtype in ("float16", "bfloat16") and not metal_available():
        return (f"warning: {dtype} weights run many times slower than float32 on MLX's CPU backend (no Metal "
                "here); convert with --dtype float32 to run the model on this machine")
    return None


def quantized_matmul_routing(architecture: str | None) -> str:
    """What MLX 0.32's quantized matmul does with M rows on this chip (`QuantizedMatmul::eval_gpu` and
    `get_qmv_batch_limit` in MLX's mlx/backend/metal/quantized.cpp), from
    the Metal architecture string (applegpu_g<generation><tier>: 13 M1, 14 M2, 15 M3, 16 M4, 17 M5;
    tier d = Ultra); None for the CPU."""
    if architecture is None:
        return "CPU: every row costs the same (linear in rows, no weight-reuse path and no cliff)"
    gen = chip_generation(architecture)
    if gen is None:
        return f"unknown Metal architecture {architecture!r}: routing not known"
    tier = architecture[-1]
    if gen < 15:
        path = "M1/M2: no affine qmv_wide, so every row is one more full pass over the weights"
    else:
        path = "M3 and newer: qmv_wide reads the weights once per up to 5 rows (6..10 rows: twice)"
    limit = {True: "18 rows (Ultra)", False: "25 rows (M5)" if gen >= 17 else
             ("10 rows, 6 for a 4096->14336 layer" if gen < 15 else "about 13-15 rows")}[tier == "d"]
    return f"{path}; from {limit} (4096-wide 4-bit layers) MLX switches to its tiled qmm"


def chip_generation(architecture: str | None) -> int | None:
    """The Apple GPU generation of a Metal architecture string (applegpu_g13s -> 13: M1; 14 M2, 15 M3,
    16 M4, 17 M5); None for the CPU or a string of another form."""
    m = re.search(r"g(\d+)[a-z]$", architecture or "")
    return int(m.group(1)) if m else None


def m1_or_m2() -> bool:
    """True on an M1 or M2 GPU (no bfloat16 in hardware, no affine qmv_wide in MLX's quantized matmul)."""
    gen = chip_generation(chip_name()) if metal_available() else None
    return gen is not None and gen < 15


def memory_gb() -> float | None:
    """Physical memory of the machine, in GB (None where the OS does not say)."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return None


def _mapped_libraries(maps: str) -> list[tuple[int, int, str]]:
    """(start, end, path) of the file-backed mappings in /proc/self/maps text."""
    out = []
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            start, end = (int(a, 16) for a in parts[0].split("-"))
            out.append((start, end, parts[5]))
    return out


def blas_kind(path: str) -> str:
    """"bundled" (the reference BLAS inside MLX's Linux wheel), "reference" (a system reference BLAS),
    "optimized" (OpenBLAS, MKL, BLIS, ...) or "unknown", from the library's path."""
    real = os.path.realpath(path)
    if "mlx_cpu.libs" in path or re.search(r"/libblas-[0-9a-f]{8}\.so", path):
        return "bundled"
    if re.search(r"openblas|mkl|blis|armpl|flexiblas", real, re.I):
        return "optimized"
    if re.search(r"/blas/libblas\.so", real):  # Debian's alternatives: the netlib reference
        return "reference"
    return "unknown"


def blas_library(maps: str | None = None, global_sgemm: int | None = -1) -> dict:
    """Which BLAS serves MLX's CPU matmuls in this process: {"library" (its file, with the folder it is
    in), "kind" (blas_kind), "slow"}.

    libmlx calls cblas_sgemm; the dynamic linker binds it to the first library of the global scope that
    defines it (LD_PRELOAD comes first), else to libmlx's own dependency, the wheel's bundled reference
    BLAS. maps: /proc/self/maps text; global_sgemm: the global scope's cblas_sgemm address, None when it
    has none (both read from this process by default)."""
    if maps is None:
        try:
            maps = open("/proc/self/maps").read()
        except OSError:
            return {"library": None, "kind": "unknown", "slow": False}
    if global_sgemm == -1:
        sgemm = getattr(ctypes.CDLL(None), "cblas_sgemm", None)
        global_sgemm = ctypes.cast(sgemm, ctypes.c_void_p).value if sgemm is not None else None
    libraries = _mapped_libraries(maps)
    if global_sgemm is not None:
        path = next((p for start, end, p in libraries if start <= global_sgemm < end), None)
    else:
        path = next((p for _, _, p in libraries if re.search(r"/lib(cblas|blas)[^/]*\.so", p)), None)
    kind = blas_kind(path) if path else "unknown"
    library = "/".join(path.split("/")[-2:]) if path else None  # no machine's absolute path in records
    return {"library": library, "kind": kind, "slow": kind in ("bundled", "reference")}


def slow_blas_warning(blas: dict | None = None) -> str | None:
    """One line saying how to get the fast BLAS, when MLX computes on the CPU with a reference BLAS."""
    if not sys.platform.startswith("linux") or mx.default_device() != mx.cpu:
        return None
    blas = blas or blas_library()
    if not blas["slow"]:
        return None
    what = "the reference BLAS bundled with MLX's wheel" if blas["kind"] == "bundled" else "a reference BLAS"
    return f"warning: MLX runs its CPU matmuls on {what} ({blas['library']}), about 10x slower: {BLAS_FIX}"


def blas_preload(blas: dict, environ=os.environ, paths=OPENBLAS_PATHS, exists=os.path.exists) -> str | None:
    """The OpenBLAS to re-run this process with (LD_PRELOAD), or None: when MLX computes on a reference BLAS
    (`blas`, blas_library's), the user has not turned it off (NO_PRELOAD) and LD_PRELOAD does not hold that
    library already (a preload that did not take is not tried twice)."""
    if environ.get(NO_PRELOAD, "") not in ("", "0") or not blas["slow"]:
        return None
    found = next((path for path in paths if exists(path)), None)
    if found is None or found in environ.get("LD_PRELOAD", "").replace(":", " ").split():
        return None
    return found


def rerun_with_fast_blas():
    """On Linux with MLX on the CPU and its slow reference BLAS: re-run this command (same interpreter and
    arguments, os.execv) with a system OpenBLAS preloaded, saying so in one line on stderr; else return."""
    if not sys.platform.startswith("linux") or mx.default_device() != mx.cpu:
        return
    path = blas_preload(blas_library())
    if path is None:
        return
    preload = " ".join(filter(None, [path, os.environ.get("LD_PRELOAD", "")]))
    print(f"mlx-dflash: MLX's bundled reference BLAS is about 10x slower than OpenBLAS: running with "
          f"LD_PRELOAD={path} ({NO_PRELOAD}=1 turns this off)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "LD_PRELOAD": preload})


def versions() -> dict:
    import importlib.metadata

    import mlx_lm

    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "python": platform.python_version(),
            "mlx_dflash": importlib.metadata.version("mlx-dflash")}
