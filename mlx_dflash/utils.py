"""Files on disk, the same way everywhere: nothing half-written (temporary path, then rename), JSON written
one way, weights read from safetensors only, dtype names, checksums, paths shown without the machine's own.
The ground floor: it imports nothing else of the package but its errors."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import mlx.core as mx

from .errors import DFlashError

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def cache_dir() -> Path:
    """`$MLX_DFLASH_CACHE` if set, else `~/.cache/mlx-dflash`: downloads, converted models, kernel verdicts."""
    env = os.environ.get("MLX_DFLASH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mlx-dflash"


def write_atomic(path: str | Path, data: bytes | str) -> Path:
    """Write `data` to `path` through a temporary file beside it: the file is complete or absent."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the result is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, obj, *, indent: int = 2, sort_keys: bool = False) -> Path:
    """JSON (UTF-8, a final newline), atomically. The same object gives the same bytes."""
    return write_atomic(path, json.dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=False) + "\n")


@contextlib.contextmanager
def staged_dir(out_dir: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a not-yet-existing path inside a temporary directory beside `out_dir`; on success it is
    renamed to `out_dir` (replacing it if `overwrite`). On any failure nothing is left behind."""
    out = Path(out_dir).expanduser()
    if out.exists() and not overwrite:
        raise DFlashError(f"output directory {out} already exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        work = staging / out.name
        yield work
        if not work.is_dir():
            raise RuntimeError(f"nothing was written to {work}")
        os.chmod(work, 0o755)
        if out.exists() or out.is_symlink():
            if not overwrite:  # someone else created it meanwhile
                raise DFlashError(f"output directory {out} already exists; pass --overwrite to replace it")
            old = staging / ".old"
            os.rename(out, old)  # rename cannot replace a non-empty directory: move it aside first
            try:
                os.rename(work, out)
            except OSError:
                os.rename(old, out)
                raise
        else:
            os.rename(work, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def safetensors_files(path: Path) -> list[Path]:
    """The *.safetensors files of a checkpoint directory. Pickle weights are refused: loading them
    can run code."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        if list(Path(path).glob("*.bin")) or list(Path(path).glob("*.pt")):
            raise DFlashError(f"{path} holds only pickle weights (*.bin/*.pt), which are never loaded because "
                              "they can run code; convert them to safetensors first")
        raise DFlashError(f"no *.safetensors weights in {path}")
    return files


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def portable_path(path: str | Path) -> str:
    """A path as benchmark records and the doctor show it: relative to this checkout if inside it, else
    $MLX_DFLASH_CACHE/... in a cache that variable moved, else ~/... under the home directory, so results
    name no machine's absolute paths."""
    p = Path(path).expanduser().absolute()
    moved = [(cache_dir().absolute(), "$MLX_DFLASH_CACHE")] if os.environ.get("MLX_DFLASH_CACHE") else []
    for base, shown in ((Path(__file__).resolve().parents[1], ""), *moved, (Path.home(), "~")):
        try:
            rel = p.relative_to(base)
        except ValueError:
            continue
        return str(Path(shown) / rel) if shown else str(rel)
    return str(path)
