"""CPU emulator for MLX `metal_kernel` sources (test support; see metal_kernels/README.md)."""

from .runner import (
    CompileError,
    DeadlockError,
    DivergentBarrierError,
    DivergentCollectiveError,
    EmulatorError,
    KernelCrashError,
    Launch,
    OutOfBoundsError,
    SyncError,
    ThreadgroupMemoryError,
    build_many,
    cache_dir,
    parse_source,
    run_kernel,
    run_source,
    unavailable_reason,
)

__all__ = [
    "CompileError",
    "DeadlockError",
    "DivergentBarrierError",
    "DivergentCollectiveError",
    "EmulatorError",
    "KernelCrashError",
    "Launch",
    "OutOfBoundsError",
    "SyncError",
    "ThreadgroupMemoryError",
    "build_many",
    "cache_dir",
    "parse_source",
    "run_kernel",
    "run_source",
    "unavailable_reason",
]
