"""`mlx-dflash convert`: drafters and targets into MLX directories, optionally pre-quantized.

Drafters: any published DFlash v1 or DFlash 2 layout (config.json + safetensors) becomes one normalized
config.json plus safetensors under the published tensor names; with `quantize`, the linear layers are
stored quantized and config.json lists them, so `drafter_from_dir` rebuilds exactly those modules (z-lab
instead quantizes in memory at every load, reference 4.3). For DFlash 2 that includes the convolutions'
`kernel_projection` and the selector's `hidden_projection` (matmuls over the hidden size, run for every
block row); the two selector codebooks stay float: they are only gathered (the previous token's row and
the k candidates' rows per draft position), so quantizing them saves memory (about 150 MB of the real
checkpoint's 5.5 GB at 4 bits) but no time per round, while its error would land directly on the pairwise
scores that choose among the candidates. The convolutions' `base_kernel` and the norms also stay float. Targets: a Hugging Face directory or repo goes through
`mlx_lm.convert`; a `.gguf` file through our GGUF converter, then optionally mlx-lm's quantizer.

Every conversion is written into a temporary directory beside `out_dir` and renamed into place only
when complete; converting twice gives byte-identical files (sorted tensors, fixed metadata).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import __version__
from .config import config_to_dict, load_config
from .drafter import BORROWED_KEYS, _quantize_like_checkpoint, _read_weights, load_strict, new_drafter
from .errors import DFlashError
from .load import _REPO_ID, resolve

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
Q_BITS = (4, 8)
Q_GROUP_SIZES = (32, 64, 128)
MAX_SHARD_BYTES = 5 << 30  # as mlx-lm: 5 GiB per safetensors file
INDEX_FILE = "model.safetensors.index.json"
# Arguments convert_target sets itself; everything else of mlx_lm.convert passes through.
_OWN_ARGS = {"hf_path", "mlx_path", "quantize", "q_group_size", "q_bits", "dtype", "upload_repo"}
_ST_DTYPES = {
    mx.bool_: "BOOL", mx.uint8: "U8", mx.int8: "I8", mx.uint16: "U16", mx.int16: "I16",
    mx.uint32: "U32", mx.int32: "I32", mx.uint64: "U64", mx.int64: "I64",
    mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32",
}


# ------------------------------------------------------------------------------------------------
# Shared pieces: argument checks, atomic output, deterministic safetensors.

def _check_args(quantize: bool, q_bits: int, q_group_size: int, dtype: Optional[str]) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise DFlashError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if quantize and q_bits not in Q_BITS:
        raise DFlashError(f"unsupported quantization bits {q_bits}; choose 4 or 8")
    if quantize and q_group_size not in Q_GROUP_SIZES:
        raise DFlashError(f"unsupported quantization group size {q_group_size}; choose 32, 64 or 128")


@contextlib.contextmanager
def _staged(out_dir, overwrite: bool) -> Iterator[Path]:
    """Yield a not-yet-existing path inside a temporary directory beside `out_dir`; on success it
    is renamed to `out_dir` (replacing it if `overwrite`). On any failure nothing is left behind."""
    out = Path(out_dir).expanduser()
    if out.exists() and not overwrite:
        raise DFlashError(f"output directory {out} already exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        work = staging / out.name
        yield work
        if not work.is_dir():
            raise RuntimeError(f"conversion wrote nothing to {work}")
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


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_safetensors(path: Path, tensors: dict, metadata: Optional[dict] = None) -> None:
    """A safetensors file with tensors in sorted order and a sorted, fixed header (no timestamps)."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        a = tensors[name]
        if a.dtype not in _ST_DTYPES:
            raise DFlashError(f"cannot store tensor {name} of dtype {a.dtype} in safetensors")
        # numpy has no bfloat16: its bits travel as uint16.
        data = np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
        data = np.ascontiguousarray(data, dtype=data.dtype.newbyteorder("<"))
        header[name] = {"dtype": _ST_DTYPES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
        arrays.append(data)
    header["__metadata__"] = dict(metadata or {"format": "mlx"})
    blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for data in arrays:
            f.write(data.tobytes())


def save_weights(out: Path, weights: dict, max_shard_bytes: int = MAX_SHARD_BYTES) -> list:
    """model.safetensors, or model-0000i-of-0000n.safetensors plus an index past `max_shard_bytes`."""
    shards, size = [], 0
    for name in sorted(weights):
        nbytes = weights[name].nbytes
        if not shards or (size + nbytes > max_shard_bytes and shards[-1]):
            shards.append({})
            size = 0
        shards[-1][name] = weights[name]
        size += nbytes
    if len(shards) == 1:
        write_safetensors(out / "model.safetensors", shards[0])
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / name, shard)
        names.append(name)
        weight_map.update({k: name for k in shard})
    total = sum(v.nbytes for v in weights.values())
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return names


def _check_index(path: Path) -> None:
    """A sharded checkpoint whose index names a file that is not there is incomplete."""
    index = path / INDEX_FILE
    if not index.is_file():
        return
    try:
        files = set(json.loads(index.read_text()).get("weight_map", {}).values())
    except (json.JSONDecodeError, AttributeError) as e:
        raise DFlashError(f"{index} is not a valid safetensors index ({e})") from None
    missing = sorted(f for f in files if not (path / f).is_file())
    if missing:
        raise DFlashError(f"{path} is incomplete: weight file {missing[0]} listed in {INDEX_FILE} is missing")


def _hub_revision(src: str, path: Path) -> Optional[str]:
    """The commit of a hub snapshot (its directory name), or None for a local directory."""
    if Path(src).expanduser().is_dir():
        return None
    return path.name if path.parent.name == "snapshots" else None


def _provenance(source: str, revision: Optional[str], converted: str) -> dict:
    return {"source": source, "revision": revision, "tool_version": __version__, "converted": converted}


# ------------------------------------------------------------------------------------------------
# Drafters.

def _drafter_weights(path: Path) -> dict:
    _check_index(path)
    weights = _read_weights(path)  # refuses *.bin/*.pt-only directories
    # Some third-party copies prefix every key with "model."; z-lab's files do not (reference 2.2).
    if weights and all(k.startswith("model.") for k in weights):
        weights = {k[len("model."):]: v for k, v in weights.items()}
    for key in BORROWED_KEYS:
        weights.pop(key, None)
    return weights


def _check_group_size(model: nn.Module, group_size: int) -> None:
    bad = sorted((name, m.weight.shape[-1]) for name, m in model.named_modules()
                 if isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size)
    if bad:
        (name, size), more = bad[0], f" (and {len(bad) - 1} more layers)" if len(bad) > 1 else ""
        raise DFlashError(f"quantization group size {group_size} does not divide the input size {size} "
                          f"of drafter layer {name}{more}; choose another --q-group-size")


def _quantized_modules(model: nn.Module) -> list:
    return sorted(name for name, m in model.named_modules() if isinstance(m, nn.QuantizedLinear))


def convert_drafter(src, out_dir, *, quantize: bool = False, q_bits: int = 4, q_group_size: int = 64,
                    dtype: Optional[str] = None, overwrite: bool = False,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Convert a DFlash drafter (local directory or hub repo id) into an MLX drafter directory.

    dtype: float16 | bfloat16 | float32 (default: each tensor keeps its source dtype). With
    `quantize`, every linear layer is stored `q_bits`-bit affine-quantized (groups of
    `q_group_size`); norms, DFlash 2 convolution base taps and selector codebooks stay float (see the
    module docstring). Returns the output path.
    """
    _check_args(quantize, q_bits, q_group_size, dtype)
    path = resolve(str(src), "drafter")
    revision = _hub_revision(str(src), path)
    source = str(path.resolve()) if revision is None else str(src)
    config = load_config(path)
    source_quant = config.raw.get("quantization")
    if quantize and source_quant:
        raise DFlashError(
            f"drafter {src} is already quantized ({source_quant.get('bits')}-bit); convert the float "
            "checkpoint, or convert this one without --quantize"
        )
    weights = _drafter_weights(path)
    if dtype is not None:
        weights = {k: v.astype(DTYPES[dtype]) if mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in weights.items()}

    model = new_drafter(config)
    weights = model.sanitize(weights, where=str(path))
    if source_quant:
        _quantize_like_checkpoint(model, source_quant, weights)
    load_strict(model, weights, where=str(path))  # names any missing or unexpected tensor
    if quantize:
        _check_group_size(model, q_group_size)
        nn.quantize(model, group_size=q_group_size, bits=q_bits, mode="affine",
                    class_predicate=lambda _, m: isinstance(m, nn.Linear))
    out_weights = model.checkpoint_weights()  # the published names (DFlash 2 codebooks without .weight)
    mx.eval(out_weights)

    cfg = config_to_dict(config)
    for key in ("quantization", "quantization_config", "mlx_dflash"):
        cfg.pop(key, None)
    modules = _quantized_modules(model)
    if modules:
        q = source_quant or {"bits": q_bits, "group_size": q_group_size, "mode": "affine"}
        cfg["quantization"] = {"bits": int(q["bits"]), "group_size": int(q["group_size"]),
                               "mode": q.get("mode", "affine"), "modules": modules}
    float_dtypes = {v.dtype for k, v in out_weights.items() if mx.issubdtype(v.dtype, mx.floating)}
    if len(float_dtypes) == 1:  # what transformers (torch_dtype, or v5's dtype) would report
        name = str(float_dtypes.pop()).split(".")[-1]
        cfg["torch_dtype"] = name
        if "dtype" in cfg:
            cfg["dtype"] = name
    cfg["mlx_dflash"] = _provenance(source, revision, "drafter")

    with _staged(out_dir, overwrite) as work:
        work.mkdir()
        save_weights(work, out_weights, max_shard_bytes)
        _write_json(work / "config.json", cfg)
    return Path(out_dir).expanduser()


# ------------------------------------------------------------------------------------------------
# Targets.

def _mlx_lm_convert(hf_path: Path, mlx_path: Path, src: str, **kwargs) -> None:
    from mlx_lm.convert import convert

    try:
        convert(str(hf_path), str(mlx_path), **kwargs)
    except (ValueError, FileNotFoundError, KeyError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DFlashError(f"mlx-lm cannot convert target model {src}: {first}") from None


def _target_source(src: str, revision: Optional[str]) -> tuple:
    """(local directory, hub revision or None) of a target given as a directory or repo id."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path, None
    if path.exists():
        raise DFlashError(f"target model {src} is a file; give a directory, a hub repo id or a .gguf file")
    if not _REPO_ID.match(src):
        raise DFlashError(f"target model {src}: no such directory (and not a Hugging Face repo id)")
    try:
        from huggingface_hub import snapshot_download
        from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

        # Code shipped beside a checkpoint is never fetched.
        patterns = [p for p in DEFAULT_ALLOW_PATTERNS if not p.endswith(".py")]
        local = Path(snapshot_download(src, revision=revision, allow_patterns=patterns))
    except Exception as e:  # network, auth, gated or missing repo: one line, with the cause
        raise DFlashError(f"target model {src}: not a local directory or .gguf file, and downloading it "
                          f"from the Hugging Face hub failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return local, local.name


def _check_target_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise DFlashError(f"target model {path} has no config.json: is it a Hugging Face model directory?")
    _check_index(path)
    if not list(path.glob("*.safetensors")):
        if list(path.glob("*.bin")) or list(path.glob("*.pt")):
            raise DFlashError(f"{path} holds only pickle weights (*.bin/*.pt), which are never loaded "
                              "because they can run code; convert them to safetensors first")
        raise DFlashError(f"no *.safetensors weights in {path}")


def _stamp(out: Path, source: str, revision: Optional[str]) -> None:
    """Record provenance in config.json (keeping what the GGUF converter recorded)."""
    file = out / "config.json"
    cfg = json.loads(file.read_text())
    prov = dict(cfg.get("mlx_dflash") or {})
    prov.update(_provenance(source, revision, "target"))
    cfg["mlx_dflash"] = prov
    file.write_text(json.dumps(cfg, indent=4, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_target(src, out_dir, *, quantize: bool = False, q_bits: int = 4, q_group_size: int = 64,
                   dtype: Optional[str] = None, overwrite: bool = False, **mlx_lm_options) -> Path:
    """Convert a target (HF directory, hub repo id or .gguf file) into an mlx-lm model directory.

    HF sources go through `mlx_lm.convert` (dtype default: the checkpoint's torch_dtype); extra
    keyword arguments of `mlx_lm.convert` (e.g. quant_predicate, q_mode, trust_remote_code,
    revision) pass through. GGUF sources are dequantized by `mlx_dflash.gguf.convert_gguf` (dtype
    default float16) and then, with `quantize` or mlx-lm options, run through `mlx_lm.convert`.
    """
    from mlx_lm.convert import convert as mlx_lm_convert

    _check_args(quantize, q_bits, q_group_size, dtype)
    allowed = set(inspect.signature(mlx_lm_convert).parameters) - _OWN_ARGS
    unknown = sorted(set(mlx_lm_options) - allowed)
    if unknown:
        raise DFlashError(f"unsupported mlx-lm conversion option(s) {', '.join(unknown)}; "
                          f"supported: {', '.join(sorted(allowed))}")
    revision = mlx_lm_options.pop("revision", None)
    q_args = dict(quantize=quantize, q_bits=q_bits if quantize else None,
                  q_group_size=q_group_size if quantize else None)
    src_str = str(src)

    if src_str.lower().endswith(".gguf"):
        from .gguf import convert_gguf  # needs the optional `gguf` package

        gguf_path = Path(src_str).expanduser()
        source = str(gguf_path.resolve())
        with _staged(out_dir, overwrite) as work:
            if not (quantize or mlx_lm_options):
                convert_gguf(gguf_path, work, dtype or "float16", source=source)
            else:
                plain = work.parent / "dequantized"
                convert_gguf(gguf_path, plain, dtype or "float16", source=source)
                _mlx_lm_convert(plain, work, src_str, dtype=None, **q_args, **mlx_lm_options)
            _stamp(work, source, None)
        return Path(out_dir).expanduser()

    path, revision = _target_source(src_str, revision)
    _check_target_dir(path)
    source = str(path.resolve()) if revision is None else src_str
    with _staged(out_dir, overwrite) as work:
        _mlx_lm_convert(path, work, src_str, dtype=dtype, **q_args, **mlx_lm_options)
        _stamp(work, source, revision)
    return Path(out_dir).expanduser()
