"""Custom Metal kernels: a one-pass quantized matmul for 6..16 rows (DFlash verification).

MLX's quantized matmul streams the weights once for <= 5 rows, 2-4 times for 6..16 rows (qmv_wide) or
switches to a 32-row tile (qmm_t). ``metal_kernels/wide_qmm.metal`` reads them once for 6..16 rows.

* ``wide_quantized_matmul`` runs that kernel (Metal only).
* ``WideQuantizedLinear`` wraps an ``nn.QuantizedLinear`` (same parameter arrays, same parameter tree)
  and sends 6..16-row inputs to the kernel when Metal is available and the race gate
  (``race_gate.py``: ours against MLX's, once per chip, shape and rows, verdict cached on disk) found it
  faster, or when the route is forced (``route="dflash"``, env ``MLX_DFLASH_WIDE_KERNEL``); everything
  else, and every input on CPU/CUDA, goes through ``mx.quantized_matmul`` exactly as
  ``nn.QuantizedLinear`` does.
* ``install_wide_kernels(model)`` swaps those modules into one model instance.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ..errors import DFlashError
from ..machine import chip_name, metal_available
from . import routes
from .source import read_metal_file
from .race_gate import MLX, OURS, Choice, halvings, shared_gate

MIN_ROWS = 6
MAX_ROWS = 16
SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
SUPPORTED_DTYPES = (mx.float16, mx.bfloat16, mx.float32)

FEATURES_PER_THREAD = 2  # FL in wide_qmm.metal


def wide_threads(dtype) -> int:
    """Threads per threadgroup of the wide kernel (NT): each owns 2 output features, so a threadgroup
    owns 512 features (1024 for float32 activations, whose x tile costs twice the bytes) and the launch
    reads x only ceil(N / features) times (metal_kernels/README.md, traffic model)."""
    return 512 if dtype == mx.float32 else 256


def thread_sizes(dtype) -> list[int]:
    """The launch sizes to try, largest first: wide_threads, then halves down to one simdgroup (a pipeline
    whose registers allow fewer threads refuses the larger ones; the race gate retries)."""
    return halvings(wide_threads(dtype))


MAX_CONSTANT = 8  # MLX binds an input of fewer elements as `constant` memory (metal_kernel.cpp)


ROUTE_ENV = "MLX_DFLASH_WIDE_KERNEL"
ROUTES = ("auto", "dflash", "mlx")  # race gate / always ours / always MLX's


def default_route() -> str:
    route = os.environ.get(ROUTE_ENV, "auto")
    if route not in ROUTES:
        raise DFlashError(f"{ROUTE_ENV}={route!r}: use one of {', '.join(ROUTES)}")
    return route


@functools.lru_cache(maxsize=None)
def wide_qmm_kernel():
    """The ``mx.fast.metal_kernel`` object (one for all variants; MLX JIT-caches each template set)."""
    header, body = read_metal_file("wide_qmm.metal")
    return mx.fast.metal_kernel(
        name="dflash_wide_qmm",
        input_names=["x", "w", "scales", "biases", "K", "N"],
        output_names=["y"],
        source=body,
        header=header,
        ensure_row_contiguous=True,
    )


def check_wide_supported(x_shape, w, scales, biases, group_size: int, bits: int, dtype) -> str | None:
    """Why the wide kernel cannot take this call (None when it can)."""
    if bits not in SUPPORTED_BITS:
        return f"bits={bits} not in {SUPPORTED_BITS}"
    if group_size not in SUPPORTED_GROUP_SIZES:
        return f"group_size={group_size} not in {SUPPORTED_GROUP_SIZES}"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} not supported"
    if biases is None:
        return "only affine quantization (with biases) is supported"
    if len(x_shape) < 1 or w.ndim != 2 or scales.ndim != 2 or w.dtype != mx.uint32:
        return "expected x (..., K), w (N, K*bits/32) uint32, scales/biases (N, K/group_size)"
    if w.size < MAX_CONSTANT:  # the kernel reads w as `device uint4`
        return f"w of {w.size} words: MLX binds it as constant memory, which the kernel cannot read"
    k = x_shape[-1]
    n = w.shape[0]
    if k % group_size or w.shape[1] * 32 != k * bits:
        return f"K={k} does not match w {w.shape} / group_size {group_size}"
    if scales.shape != (n, k // group_size) or biases.shape != scales.shape:
        return "scales/biases shape mismatch"
    if scales.dtype not in SUPPORTED_DTYPES or biases.dtype != scales.dtype:
        return "scales/biases dtype not supported"
    m = 1
    for d in x_shape[:-1]:
        m *= d
    if not MIN_ROWS <= m <= MAX_ROWS:
        return f"rows={m} outside {MIN_ROWS}..{MAX_ROWS}"
    return None


def wide_qmm_call(x, w, scales, biases, group_size: int, bits: int, threads: int | None = None) -> tuple[Any, dict]:
    """The kernel object and the keyword arguments of its call for ``x (M, K)`` at `threads` per threadgroup
    (default wide_threads); shared by the Metal path and the emulator so both run exactly the same launch."""
    reason = check_wide_supported(x.shape, w, scales, biases, group_size, bits, x.dtype)
    if reason is None and x.ndim != 2:
        reason = f"x must be 2-D (M, K), got shape {x.shape}"
    if reason is not None:
        raise ValueError(f"wide_quantized_matmul: {reason}")
    m, k = x.shape[0], x.shape[1]
    n = w.shape[0]
    nt = threads or wide_threads(x.dtype)
    tgs = -(-n // (nt * FEATURES_PER_THREAD))
    call = dict(
        inputs=[x, w, scales, biases, k, n],
        template=[("T", x.dtype), ("R", m), ("GS", group_size), ("BITS", bits), ("NT", nt)],
        grid=(nt * tgs, 1, 1),
        threadgroup=(nt, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[x.dtype],
    )
    return wide_qmm_kernel(), call


def wide_quantized_matmul(x, w, scales, biases, group_size: int, bits: int, threads: int | None = None):
    """``x @ dequantize(w).T`` for 6..16 rows (product of x's leading dims) with one pass over w.

    Metal only; raises RuntimeError elsewhere (use ``mx.quantized_matmul`` there)."""
    if not metal_available():
        raise RuntimeError("wide_quantized_matmul needs Metal; use mx.quantized_matmul")
    lead = x.shape[:-1]
    kernel, call = wide_qmm_call(x.reshape(-1, x.shape[-1]), w, scales, biases, group_size, bits, threads)
    (y,) = kernel(**call)
    return y.reshape(*lead, w.shape[0])


class WideQuantizedLinear(nn.Module):
    """Drop-in for an ``nn.QuantizedLinear``: same parameter arrays (shared, not copied) under the same
    names, same config; 6..16-row inputs use the wide kernel when Metal is available and ``route`` says
    so: ``"auto"`` (the race gate's verdict), ``"dflash"`` (always), ``"mlx"`` (never)."""

    def __init__(self, ql: nn.QuantizedLinear, route: str = "auto"):
        super().__init__()
        if not isinstance(ql, nn.QuantizedLinear):
            raise TypeError(f"expected nn.QuantizedLinear, got {type(ql).__name__}")
        if route not in ROUTES:
            raise DFlashError(f"route {route!r}: use one of {', '.join(ROUTES)}")
        self.route = route
        self.group_size = ql.group_size
        self.bits = ql.bits
        self.mode = ql.mode
        for key, value in ql.items():  # weight, scales, [biases], [bias]: the same mx.array objects
            self[key] = value
        self._no_grad = set(ql._no_grad)  # QuantizedLinear keeps its quantized arrays frozen
        self._training = ql._training
        object.__setattr__(self, "_wrapped", ql)

    def unwrap(self) -> nn.QuantizedLinear:
        """The original module, updated with this module's current parameters."""
        ql = self._wrapped
        ql.update(dict(self.items()))
        return ql

    _extra_repr = nn.QuantizedLinear._extra_repr

    def _choice(self, x) -> Choice:
        """Which path serves this input (every 6..16-row call's choice is recorded: kernels/routes.py)."""
        rows = x.size // x.shape[-1]
        if not MIN_ROWS <= rows <= MAX_ROWS or self.mode != "affine" or not metal_available():
            return MLX_PATH  # decode (1 row) and long prefills: MLX's own path, by design
        return choose(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits, self.route)

    def __call__(self, x):
        choice = self._choice(x)
        if choice.route != OURS:
            return nn.QuantizedLinear.__call__(self, x)
        y = wide_quantized_matmul(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits,
                                  choice.size)
        if "bias" in self:
            y = y + self["bias"]
        return y


MLX_PATH = Choice(MLX, None, "MLX's path by design")


def choose(x, w, scales, biases, group_size: int, bits: int, route: str) -> Choice:
    """The path for a 6..16-row call on Metal, recorded (kernels/routes.py): MLX's where our kernel cannot
    take it; else route "auto" asks the race gate, "dflash" runs ours unless it fails here."""
    key = race_key(x, w, group_size, bits)
    reason = check_wide_supported(x.shape, w, scales, biases, group_size, bits, x.dtype)
    if reason is not None:
        routes.record(key, MLX, reason, fallback=True)
        return MLX_PATH
    if route == MLX:
        routes.record(key, MLX, f"route 'mlx' forced ({ROUTE_ENV} or route=)")
        return MLX_PATH
    choice = shared_gate().choose(
        key, lambda threads: wide_quantized_matmul(x, w, scales, biases, group_size, bits, threads),
        lambda: mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits),
        x.dtype, thread_sizes(x.dtype), forced=route == OURS)
    routes.record(key, choice.route, choice.reason, fallback=choice.fallback)
    return choice


def race_key(x, w, group_size: int, bits: int) -> str:
    """The race gate's key of a wide call (the verdict cache on disk is keyed by it)."""
    rows = x.size // x.shape[-1]
    dtype = str(x.dtype).rsplit(".", 1)[-1]
    return f"{chip_name()}|wide_qmm|{dtype}|K{x.shape[-1]}xN{w.shape[0]}|gs{group_size}|b{bits}|rows{rows}"


def wide_capable(ql: nn.QuantizedLinear) -> bool:
    """Whether our wide kernel takes this layer's quantization (affine, 4/8 bits, group 32/64/128)."""
    return (
        ql.mode == "affine"
        and ql.bits in SUPPORTED_BITS
        and ql.group_size in SUPPORTED_GROUP_SIZES
        and ql.get("biases") is not None
    )


def install_wide_kernels(model: nn.Module, route: str | None = None) -> int:
    """Replace the kernel-capable ``nn.QuantizedLinear`` modules of this model instance by
    ``WideQuantizedLinear`` wrappers; returns how many were replaced (0 without Metal).
    route: ``"auto"`` / ``"dflash"`` / ``"mlx"`` (default: env ``MLX_DFLASH_WIDE_KERNEL``, else auto);
    ``"mlx"`` installs nothing, so the quantized width rule applies again (``--force-width`` lifts it)."""
    route = route or default_route()
    if not metal_available() or route == "mlx":
        return 0
    swaps = [
        (name, WideQuantizedLinear(module, route))
        for name, module in model.named_modules()
        if type(module) is nn.QuantizedLinear and wide_capable(module) and name
    ]
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return len(swaps)


__all__ = [
    "MAX_ROWS",
    "ROUTES",
    "default_route",
    "MIN_ROWS",
    "WideQuantizedLinear",
    "check_wide_supported",
    "install_wide_kernels",
    "metal_available",
    "read_metal_file",
    "wide_qmm_call",
    "wide_qmm_kernel",
    "wide_quantized_matmul",
]
