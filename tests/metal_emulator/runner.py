"""Run the exact Metal source of an ``mx.fast.metal_kernel`` call on the CPU.

Pipeline: ``mlx_dflash.kernels.source.metal_source`` (MLX prints the source it would compile) -> rewrite for g++
(threadgroup arrays -> poisoned per-threadgroup arena, instantiation line -> launcher) -> compile against
``msl_shim.h`` (cached by hash) -> run every threadgroup with one fiber per GPU thread (see msl_shim.h).
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_dflash.kernels.source import metal_source

HERE = Path(__file__).resolve().parent
SHIM = HERE / "msl_shim.h"
CXX = os.environ.get("CXX", "g++")
CXXFLAGS = ["-std=c++17", "-O1", "-g1", "-fPIC", "-shared", "-fno-strict-aliasing", "-w"]
# Traffic-counting builds: g++'s ThreadSanitizer instrumentation calls __tsan_readN/writeN at every memory
# access; msl_shim.h defines them as byte counters (no TSan runtime is linked).
TRAFFIC_FLAGS = ["-DEMU_TRAFFIC", "-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0"]
GUARD = 256  # poisoned bytes before every buffer (out-of-bounds write detection)
PAGE = mmap.PAGESIZE
POISON = 0xFF

# Status codes of emu_run (msl_shim.h, emu::Status)
_OK, _DIV_BARRIER, _DIV_COLLECTIVE, _DEADLOCK, _CRASH, _TG_MEMORY = 0, 1, 2, 3, 4, 5
_TRAFFIC_OFFSET, _MAX_BUFS = 48 + 2048, 32  # emu::Shared::traffic, emu::MAX_BUFS


class EmulatorError(RuntimeError):
    """Base class of every error the emulator reports."""


class CompileError(EmulatorError):
    pass


class SyncError(EmulatorError):
    """A synchronisation error: the kernel would hang or be undefined on a GPU."""


class DivergentBarrierError(SyncError):
    """A threadgroup_barrier reached by only part of the threadgroup (or at different call sites)."""


class DivergentCollectiveError(SyncError):
    """A SIMD-group collective reached by only part of the SIMD group."""


class DeadlockError(SyncError):
    """No thread can progress, or the launch did not finish in time (spin-wait)."""


class KernelCrashError(EmulatorError):
    """The kernel crashed (e.g. a wild out-of-bounds access)."""


class OutOfBoundsError(EmulatorError):
    """The kernel accessed memory past the end of a buffer (guard page fault) or wrote into the poisoned
    bytes before/after one."""


class ThreadgroupMemoryError(EmulatorError):
    """More threadgroup memory than Metal allows (32 KiB)."""


_ERRORS = {
    _DIV_BARRIER: DivergentBarrierError,
    _DIV_COLLECTIVE: DivergentCollectiveError,
    _DEADLOCK: DeadlockError,
    _CRASH: KernelCrashError,
    _TG_MEMORY: ThreadgroupMemoryError,
}

# mx dtype -> (numpy storage dtype, MSL type)
_DTYPES = {
    mx.float32: (np.float32, "float"),
    mx.float16: (np.float16, "float16_t"),
    mx.bfloat16: (np.uint16, "bfloat16_t"),
    mx.int32: (np.int32, "int32_t"),
    mx.uint32: (np.uint32, "uint32_t"),
    mx.int64: (np.int64, "int64_t"),
    mx.uint64: (np.uint64, "uint64_t"),
    mx.int16: (np.int16, "int16_t"),
    mx.uint16: (np.uint16, "uint16_t"),
    mx.int8: (np.int8, "int8_t"),
    mx.uint8: (np.uint8, "uint8_t"),
    mx.bool_: (np.uint8, "bool"),
}


def cache_dir() -> Path:
    root = os.environ.get("MLX_DFLASH_CACHE")
    base = Path(root) / "emulator" if root else Path.home() / ".cache" / "mlx-dflash" / "emulator"
    base.mkdir(parents=True, exist_ok=True)
    return base


# ---------------------------------------------------------------------------------------------------
# Source parsing and rewriting

_INST_RE = re.compile(
    r"^template \[\[host_name\(\"(?P<host>\w+)\"\)\]\] \[\[kernel\]\] decltype\((?P<inst>[^\n]+?)\) [^\n]*;[ \t]*$",
    re.M,
)
_PARAM_RE = re.compile(r"^\s*(?P<decl>.+?)\s*\b(?P<name>\w+)\s*\[\[(?P<attr>\w+)(?:\((?P<idx>\d+)\))?\]\]\s*$")
_TG_DECL_RE = re.compile(
    r"\bthreadgroup\s+(?P<type>[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?)\s+(?P<name>[A-Za-z_]\w*)\s*"
    r"(?P<dims>(?:\[[^\]]+\]\s*)*);"
)


@dataclass
class Param:
    decl: str  # type text, e.g. "const device float*"
    name: str
    attr: str  # "buffer" or the attribute name
    index: int | None


@dataclass
class ParsedKernel:
    source: str  # as printed by MLX
    kernel_name: str
    instantiation: str  # e.g. "custom_kernel_x<float, 8>"
    params: list[Param] = field(default_factory=list)
    cpp: str = ""  # translation unit for g++


def _strip_comments(text: str) -> str:
    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    return re.sub(r"//[^\n]*|/\*.*?\*/", blank, text, flags=re.S)


def _split_params(text: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([<":
            depth += 1
        elif ch in ")]>":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur))
    return out


_SYNC_RE = re.compile(
    r"(?<![\w.>])(?:metal::)?\b(threadgroup_barrier|simdgroup_barrier|simd_(?:sum|product|max|min|"
    r"broadcast_first|prefix_exclusive_sum|prefix_inclusive_sum|shuffle_down|shuffle_up|shuffle_xor|"
    r"shuffle|broadcast|all|any))\s*\("
)


def _tag_sync_sites(text: str) -> str:
    """`simd_sum(v)` -> `metal::simd_sum(emu::Site(id), v)`, id = line * 1000 + occurrence in the line, so
    meeting points are compared by source call site (not by machine address, which inlining and jump
    threading duplicate)."""
    seen: dict[int, int] = {}

    def repl(m: re.Match) -> str:
        line = text.count("\n", 0, m.start()) + 1
        seen[line] = seen.get(line, 0) + 1
        return f"metal::{m.group(1)}(emu::Site({line * 1000 + seen[line]}), "

    return _SYNC_RE.sub(repl, text)


def _rewrite_threadgroup(text: str) -> str:
    counter = [0]

    def repl(m: re.Match) -> str:
        typ, name, dims = m["type"], m["name"], m["dims"].strip()
        counter[0] += 1
        slot = f"emu_tgslot_{name}_{counter[0]}"
        ptr = f"{typ}(*){dims}" if dims else f"{typ}*"
        return (
            f"static emu::TgSlot {slot}; auto& {name} = *reinterpret_cast<{ptr}>("
            f"emu::tg_alloc({slot}, sizeof({typ}{dims}), alignof({typ})));"
        )

    return _TG_DECL_RE.sub(repl, text)


def parse_source(source: str) -> ParsedKernel:
    """Parse MLX's generated source and build the g++ translation unit with its launcher."""
    inst = _INST_RE.search(source)
    if inst:  # templated kernel: the launcher calls the instantiation directly
        body = source[: inst.start()] + source[inst.end() :]
        instantiation = inst["inst"].strip()
        fname = instantiation.split("<", 1)[0]
    else:
        found = re.search(r"\[\[kernel\]\]\s+void\s+(\w+)\s*\(", source)
        if not found:
            raise CompileError("no [[kernel]] function in the source")
        body, fname = source, found.group(1)
        instantiation = fname
    sig = re.search(r"\[\[kernel\]\]\s+void\s+" + re.escape(fname) + r"\s*\(", body)
    if not sig:
        raise CompileError(f"kernel signature of {fname} not found")
    depth, i = 1, sig.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(body[i], 0)
        i += 1
    params = []
    for raw in _split_params(body[sig.end() : i - 1]):
        m = _PARAM_RE.match(" ".join(raw.split()))
        if not m:
            raise CompileError(f"cannot parse kernel parameter {raw.strip()!r}")
        idx = int(m["idx"]) if m["idx"] is not None else None
        params.append(Param(m["decl"], m["name"], m["attr"], idx))

    code = _strip_comments(body)
    code = re.sub(r"^\s*#\s*include\s*<metal_\w+>.*$", "", code, flags=re.M)
    code = _tag_sync_sites(code)
    code = _rewrite_threadgroup(code)

    args = []
    for p in params:
        if p.attr == "buffer":
            if p.decl.endswith("&"):
                args.append(f"*({p.decl[:-1].strip()}*)bufs[{p.index}]")
            else:
                args.append(f"({p.decl})bufs[{p.index}]")
        else:
            args.append(f"A->{p.attr}")
    launcher = (
        '\nextern "C" void emu_kernel_entry(void* const* bufs, const emu::Attrs* A) {\n  '
        + instantiation
        + "(\n      "
        + ",\n      ".join(args)
        + ");\n}\n"
    )
    cpp = f'#include "{SHIM}"\n#line 1 "{fname}.metal"\n{code}\n#line 1 "launcher.cpp"\n{launcher}'
    return ParsedKernel(source, fname, instantiation, params, cpp)


# ---------------------------------------------------------------------------------------------------
# Build (cached)

_libs: dict[str, ctypes.CDLL] = {}


def _build_key(cpp: str, flags: list[str]) -> str:
    h = hashlib.sha256()
    for part in (cpp, SHIM.read_text(), " ".join([CXX, *flags]), _compiler_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


_compiler_version_cache: list[str] = []


def _compiler_version() -> str:
    if not _compiler_version_cache:
        out = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout
        _compiler_version_cache.append(out.splitlines()[0] if out else CXX)
    return _compiler_version_cache[0]


def unavailable_reason() -> str | None:
    """Why the emulator cannot run here (None when it can): it needs Linux (ucontext fibers, mmap guard
    pages, fork) and a g++ >= 12 (`_Float16`)."""
    if not sys.platform.startswith("linux"):
        return f"it runs on Linux only (this is {sys.platform})"
    if shutil.which(CXX) is None:
        return f"compiler {CXX!r} not found (set CXX or install g++ >= 12)"
    try:
        version = subprocess.run([CXX, "-dumpversion"], capture_output=True, text=True, check=True).stdout
        major = int(version.strip().split(".")[0])
    except (OSError, subprocess.CalledProcessError, ValueError):
        return f"cannot read the version of {CXX!r}"
    if "clang" in _compiler_version().lower() or major < 12:
        return f"{_compiler_version()} is not g++ >= 12"
    return None


def build(parsed: ParsedKernel, traffic: bool = False) -> Path:
    """Compile (or reuse) the shared object of one kernel variant; key = hash(source + shim + flags).
    ``traffic``: the instrumented build that counts memory traffic (compiled, then linked without TSan)."""
    if shutil.which(CXX) is None:
        raise CompileError(f"{CXX} not found")
    flags = CXXFLAGS + (TRAFFIC_FLAGS if traffic else [])
    out = cache_dir() / f"{_build_key(parsed.cpp, flags)}.so"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "kernel.cpp"
        src.write_text(parsed.cpp)
        lib = Path(tmp) / "kernel.so"
        if traffic:
            obj = Path(tmp) / "kernel.o"
            steps = [[CXX, *[f for f in flags if f != "-shared"], "-c", str(src), "-o", str(obj)],
                     [CXX, "-shared", str(obj), "-o", str(lib)]]
        else:
            steps = [[CXX, *flags, str(src), "-o", str(lib)]]
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise CompileError(f"g++ failed for {parsed.kernel_name}:\n{proc.stderr[-6000:]}")
        os.replace(lib, out)
    return out


def build_many(sources: list[str], jobs: int = 2, traffic: bool = False) -> list[Path]:
    """Compile several variants in parallel (g++ processes)."""
    parsed = [parse_source(s) for s in sources]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda p: build(p, traffic), parsed))


def _load(path: Path) -> ctypes.CDLL:
    key = str(path)
    if key not in _libs:
        lib = ctypes.CDLL(key)
        lib.emu_run.restype = ctypes.c_int
        lib.emu_run.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_uint),
            ctypes.POINTER(ctypes.c_uint),
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_double,
            ctypes.c_void_p,
        ]
        if hasattr(lib, "emu_set_regions"):
            lib.emu_set_regions.restype = None
            lib.emu_set_regions.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 5
        _libs[key] = lib
    return _libs[key]


# ---------------------------------------------------------------------------------------------------
# Launch


def _to_numpy(a) -> np.ndarray:
    if not isinstance(a, mx.array):  # Python scalars become 0-d arrays, as in metal_kernel
        a = mx.array(a)
    if a.dtype not in _DTYPES:
        raise EmulatorError(f"dtype {a.dtype} not supported by the emulator")
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    if a.dtype == mx.bool_:
        a = a.astype(mx.uint8)
    return np.ascontiguousarray(np.array(a))


def _from_numpy(a: np.ndarray, dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(a.view(np.uint16)).view(mx.bfloat16)
    if dtype == mx.bool_:
        return mx.array(a.astype(bool))
    return mx.array(a)


@dataclass
class Launch:
    outputs: list
    stats: dict
    source: str
    # With traffic=True: {buffer name: {"space": "device" | "constant", "read": bytes, "written": bytes}}
    # plus stats["tg_read"] / stats["tg_written"] (threadgroup-memory bytes accessed).
    traffic: dict | None = None


def run_source(
    source: str,
    inputs: list,
    output_shapes: list,
    output_dtypes: list,
    grid: tuple,
    threadgroup: tuple,
    init_value: float | None = None,
    reverse: bool = False,
    timeout_s: float = 120.0,
    use_fork: bool = True,
    traffic: bool = False,
) -> Launch:
    """Run already generated Metal source (as printed by MLX) on the given inputs. ``traffic``: count the
    bytes every access moves, per buffer and for threadgroup memory (an instrumented, slower build)."""
    parsed = parse_source(source)
    lib = _load(build(parsed, traffic))

    # Bind buffer parameters: inputs in order, each followed by its optional _shape/_strides/_ndim.
    host = [_to_numpy(a) for a in inputs]
    blobs: dict[int, np.ndarray] = {}
    outputs: list[tuple[int, tuple, object]] = []
    bufs = [p for p in parsed.params if p.attr == "buffer"]
    nin, k = 0, 0
    while k < len(bufs):
        p = bufs[k]
        if nin < len(host):
            arr = host[nin]
            blobs[p.index] = arr
            base = p.name
            k += 1
            while k < len(bufs) and bufs[k].name in (f"{base}_shape", f"{base}_strides", f"{base}_ndim"):
                q = bufs[k]
                if q.name.endswith("_shape"):
                    blobs[q.index] = np.array(arr.shape or (0,), np.int32)
                elif q.name.endswith("_strides"):
                    strides = [s // arr.itemsize for s in arr.strides] or [0]
                    blobs[q.index] = np.array(strides, np.int64)
                else:
                    blobs[q.index] = np.array(arr.ndim, np.int32)
                k += 1
            nin += 1
        else:
            j = len(outputs)
            if j >= len(output_shapes):
                raise EmulatorError(f"more buffer parameters than inputs + outputs ({p.name})")
            outputs.append((p.index, tuple(output_shapes[j]), output_dtypes[j]))
            k += 1
    if nin != len(host) or len(outputs) != len(output_shapes):
        raise EmulatorError("inputs/outputs do not match the kernel signature")

    # One MAP_SHARED region. Each buffer ends where a PROT_NONE page starts (reads or writes past the end
    # fault); the bytes before it (and the tail padding to 16 bytes) are poison and checked for writes.
    out_np = {idx: (tuple(shape), _DTYPES[dtype][0], dtype) for idx, shape, dtype in outputs}
    sizes = {idx: a.nbytes for idx, a in blobs.items()}
    for idx, (shape, npdt, _) in out_np.items():
        sizes[idx] = int(np.prod(shape, dtype=np.int64)) * np.dtype(npdt).itemsize
    layout, fences, offset = {}, [], 0
    for idx in sorted(sizes):
        padded = (max(sizes[idx], 1) + 15) // 16 * 16  # 16-byte aligned start, end at the fence
        span = -(-(padded + GUARD) // PAGE) * PAGE
        layout[idx] = offset + span - padded
        fences.append((offset + span, idx))
        offset += span + PAGE
    region = mmap.mmap(-1, offset)
    view = np.frombuffer(region, dtype=np.uint8)
    view[:] = POISON
    for idx, arr in blobs.items():
        view[layout[idx] : layout[idx] + arr.nbytes] = arr.reshape(-1).view(np.uint8)
    for idx, (shape, npdt, _) in out_np.items():
        if init_value is not None:
            n = int(np.prod(shape, dtype=np.int64))
            fill = np.full(n, init_value, npdt) if npdt is not np.uint16 else _bf16_bits(np.full(n, init_value))
            view[layout[idx] : layout[idx] + sizes[idx]] = fill.view(np.uint8)
    before = view.copy()

    shared = mmap.mmap(-1, 4096)
    base_addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    nbuf = max(layout) + 1
    ptrs = (ctypes.c_void_p * nbuf)(*[base_addr + layout.get(i, 0) for i in range(nbuf)])
    g = (ctypes.c_uint * 3)(*[int(v) for v in (tuple(grid) + (1, 1))[:3]])
    t = (ctypes.c_uint * 3)(*[int(v) for v in (tuple(threadgroup) + (1, 1))[:3]])
    shared_addr = ctypes.addressof(ctypes.c_char.from_buffer(shared))
    counters = None
    if traffic:
        idxs = sorted(sizes)
        lo = (ctypes.c_uint64 * len(idxs))(*[base_addr + layout[i] for i in idxs])
        hi = (ctypes.c_uint64 * len(idxs))(*[base_addr + layout[i] + max(sizes[i], 1) for i in idxs])
        counters = idxs
        off = _TRAFFIC_OFFSET
        lib.emu_set_regions(len(idxs), ctypes.addressof(lo), ctypes.addressof(hi), shared_addr + off,
                            shared_addr + off + 8 * _MAX_BUFS, shared_addr + off + 16 * _MAX_BUFS)
    for fence, _ in fences:
        _mprotect(base_addr + fence, PAGE, 0)
    try:
        status = lib.emu_run(ptrs, g, t, int(reverse), int(use_fork), float(timeout_s), shared_addr)
    finally:
        for fence, _ in fences:
            _mprotect(base_addr + fence, PAGE, 3)

    raw = bytes(shared[:4096])
    msg = raw[48 : 48 + 2048].split(b"\0", 1)[0].decode(errors="replace")
    stats = dict(zip(("threadgroups", "switches", "barriers", "collectives", "tg_bytes"),
                     np.frombuffer(raw[8:48], np.int64).tolist()))
    traffic_out = None
    if counters is not None:
        t = np.frombuffer(raw[_TRAFFIC_OFFSET:_TRAFFIC_OFFSET + 8 * (2 * _MAX_BUFS + 2)], np.int64).tolist()
        by_index = {p.index: p for p in bufs}
        traffic_out = {
            by_index[idx].name: {"space": "constant" if "constant" in by_index[idx].decl.split() else "device",
                                 "read": t[j], "written": t[_MAX_BUFS + j]}
            for j, idx in enumerate(counters)
        }
        stats["tg_read"], stats["tg_written"] = t[2 * _MAX_BUFS], t[2 * _MAX_BUFS + 1]
    if status != _OK:
        error = _ERRORS.get(status, EmulatorError)
        fault = re.search(r"address (0x[0-9a-f]+)", msg)
        if fault:
            addr = int(fault.group(1), 16) - base_addr
            for fence, idx in fences:
                if fence <= addr < fence + PAGE:
                    name = next(p.name for p in bufs if p.index == idx)
                    msg += f" - past the end of buffer {idx} ({name!r}, {sizes[idx]} bytes)"
                    error = OutOfBoundsError
        raise error(f"{parsed.kernel_name}: {msg}")

    # Poison outside the buffers must be intact (out-of-bounds writes), inputs unchanged.
    after = np.frombuffer(region, dtype=np.uint8)
    outside = np.ones(offset, bool)
    for idx in layout:
        outside[layout[idx] : layout[idx] + sizes[idx]] = False
    changed = np.nonzero(outside & (after != before))[0]
    if changed.size:
        pos = int(changed[0])
        idx = min((i for i in layout if layout[i] + sizes[i] > pos - PAGE), key=lambda i: abs(layout[i] - pos))
        where = "before the start" if pos < layout[idx] else "past the end"
        name = next(p.name for p in bufs if p.index == idx)
        raise OutOfBoundsError(
            f"{parsed.kernel_name}: write {where} of buffer {idx} ({name!r}) at byte {pos - layout[idx]}"
        )
    for idx in blobs:
        lo = layout[idx]
        if not np.array_equal(after[lo : lo + sizes[idx]], before[lo : lo + sizes[idx]]):
            raise EmulatorError(f"{parsed.kernel_name}: kernel modified input buffer {idx}")

    results = []
    for idx, (shape, npdt, dtype) in out_np.items():
        lo = layout[idx]
        arr = after[lo : lo + sizes[idx]].copy().view(npdt).reshape(shape)
        results.append(_from_numpy(arr, dtype))
    return Launch(results, stats, source, traffic_out)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _mprotect(addr: int, size: int, prot: int) -> None:
    if _libc.mprotect(addr, size, prot) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    return np.array(mx.array(a.astype(np.float32)).astype(mx.bfloat16).view(mx.uint16))


def run_kernel(kernel, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
               init_value=None, reverse=False, timeout_s=120.0, use_fork=True, traffic=False,
               **_ignored) -> Launch:
    """Emulate ``kernel(inputs=..., ...)`` exactly as MLX would launch it on Metal."""
    call = dict(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes, grid=grid,
                threadgroup=threadgroup)
    if template is not None:
        call["template"] = template
    if init_value is not None:
        call["init_value"] = init_value
    source = metal_source(kernel, **call)
    return run_source(source, inputs, output_shapes, output_dtypes, grid, threadgroup, init_value=init_value,
                      reverse=reverse, timeout_s=timeout_s, use_fork=use_fork, traffic=traffic)
