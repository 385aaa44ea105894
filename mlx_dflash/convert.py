"""`mlx-dflash convert`: drafters and targets into MLX directories, optionally pre-quantized.

Drafters: any published DFlash v1 or DFlash 2 layout (config.json + safetensors) becomes one normalized
config.json plus safetensors under the published tensor names; with `quantize`, the linear layers are
stored quantized and config.json lists them, so `drafter_from_dir` rebuilds exactly those modules (z-lab
instead quantizes at each load: `--draft-bits` in dflash/benchmark.py). For DFlash 2 that includes the convolutions'
`kernel_projection` and the selector's `hidden_projection` (matmuls over the hidden size, run for every
block position); the two selector codebooks stay float: they are only gathered (the previous token's row and
the k candidates' rows per draft position), so quantizing them saves memory (about 150 MB of the real
checkpoint's 5.5 GB at 4 bits) but no time per round, while its error would land directly on the pairwise
scores that choose among the candidates. The convolutions' `base_kernel` and the norms also stay float. Targets: a Hugging Face directory or repo goes through
`mlx_lm.convert`; a `.gguf` file through our GGUF converter, then optionally mlx-lm's quantizer.

Every conversion is written into a temporary directory beside `out_dir` and renamed into place only
when complete; converting twice gives byte-identical files (sorted tensors, fixed metadata). Weights are
written by `mx.save_safetensors`, sharded like mlx-lm (`mlx_lm.utils.make_shards`).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import click
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import MAX_FILE_SIZE_GB, make_shards

from . import __version__
from .errors import DFlashError
from .options import grouped
from .machine import fast_float_dtype, half_precision_warning, metal_available
from .models.config import config_to_dict, load_config
from .models.dflash import BORROWED_KEYS
from .models.loader import load_strict, new_drafter, pop_draft_vocab, quantize_like_checkpoint, read_weights
from .pair import resolve
from .tuner.draft_vocab import response_token_counts, select_draft_vocab
from .utils import DTYPES, safetensors_files, staged_dir, write_json

Q_BITS = (4, 8)
Q_GROUP_SIZES = (32, 64, 128)
INDEX_FILE = "model.safetensors.index.json"
# Arguments convert_target sets itself; everything else of mlx_lm.convert passes through.
_OWN_ARGS = {"hf_path", "mlx_path", "quantize", "q_group_size", "q_bits", "dtype", "upload_repo"}


# ------------------------------------------------------------------------------------------------
# Shared pieces: argument checks, atomic output, deterministic safetensors.

@dataclass(frozen=True)
class Quantization:
    """Linear layers stored affine-quantized to `bits` in groups of `group_size` (--q-bits, --q-group-size),
    checked as it is made."""

    bits: int = 4
    group_size: int = 64

    def __post_init__(self):
        if self.bits not in Q_BITS:
            raise DFlashError(f"unsupported quantization bits {self.bits}; choose 4 or 8")
        if self.group_size not in Q_GROUP_SIZES:
            raise DFlashError(f"unsupported quantization group size {self.group_size}; choose 32, 64 or 128")


def _check_dtype(dtype: Optional[str]) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise DFlashError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")


def save_weights(out: Path, weights: dict, max_shard_gb: int = MAX_FILE_SIZE_GB) -> list:
    """model.safetensors, or past `max_shard_gb` mlx-lm's model-0000i-of-0000n.safetensors plus an index.

    Split by mlx-lm's `make_shards`, written by `mx.save_safetensors`. Tensors go in sorted order, which
    fixes MLX's layout of the file: the same weights give the same bytes."""
    shards = make_shards({k: weights[k] for k in sorted(weights)}, max_shard_gb)
    if len(shards) == 1:
        mx.save_safetensors(str(out / "model.safetensors"), shards[0], metadata={"format": "mlx"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
        names.append(name)
        weight_map.update({k: name for k in shard})
    total = sum(v.nbytes for v in weights.values())
    write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map}, sort_keys=True)
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
    weights = read_weights(path)  # refuses *.bin/*.pt-only directories
    # Some third-party copies prefix every key with "model."; z-lab's files do not.
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


def convert_drafter(src, out_dir, *, quantize: Optional[Quantization] = None, dtype: Optional[str] = None,
                    overwrite: bool = False, max_shard_gb: int = MAX_FILE_SIZE_GB, draft_vocab: Optional[int] = None,
                    vocab_data=None) -> Path:
    """Convert a DFlash drafter (local directory or hub repo id) into an MLX drafter directory.

    dtype: float16 | bfloat16 | float32 (default: each tensor keeps its source dtype). With `quantize` (a
    `Quantization`), every linear layer is stored quantized as it says; norms, DFlash 2 convolution base taps and
    selector codebooks stay float (see the module docstring). draft_vocab: store a draft vocabulary of this many
    tokens, the most frequent in the target's responses in `vocab_data` (tuner/draft_vocab.py); 0 drops the
    source's. Returns the output path.
    """
    _check_dtype(dtype)
    if (draft_vocab is None) != (vocab_data is None) and draft_vocab != 0:
        raise DFlashError("--draft-vocab N and --vocab-data FILE go together (the target's responses rank the tokens)")
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
    source_vocab = pop_draft_vocab(weights, config, where=str(path))
    weights = model.sanitize(weights, where=str(path))
    if source_quant:
        quantize_like_checkpoint(model, source_quant, weights)
    load_strict(model, weights, where=str(path))  # names any missing or unexpected tensor
    if draft_vocab:
        counts = response_token_counts(vocab_data)
        model.set_draft_vocab(select_draft_vocab(counts, draft_vocab, config.vocab_size), where=str(vocab_data))
    elif draft_vocab is None:
        model.set_draft_vocab(source_vocab, where=str(path))
    if quantize:
        _check_group_size(model, quantize.group_size)
        nn.quantize(model, group_size=quantize.group_size, bits=quantize.bits, mode="affine",
                    class_predicate=lambda _, m: isinstance(m, nn.Linear))
    out_weights = model.checkpoint_weights()  # the published names (DFlash 2 codebooks without .weight)
    mx.eval(out_weights)

    cfg = config_to_dict(config)
    for key in ("quantization", "quantization_config", "mlx_dflash", "draft_vocab"):
        cfg.pop(key, None)
    if model.draft_vocab is not None:
        cfg["draft_vocab"] = model.draft_vocab.size
    modules = _quantized_modules(model)
    if modules:
        q = source_quant or {"bits": quantize.bits, "group_size": quantize.group_size, "mode": "affine"}
        cfg["quantization"] = {"bits": int(q["bits"]), "group_size": int(q["group_size"]),
                               "mode": q.get("mode", "affine"), "modules": modules}
    float_dtypes = {v.dtype for k, v in out_weights.items() if mx.issubdtype(v.dtype, mx.floating)}
    if len(float_dtypes) == 1:  # what transformers (torch_dtype, or v5's dtype) would report
        name = str(float_dtypes.pop()).split(".")[-1]
        cfg["torch_dtype"] = name
        if "dtype" in cfg:
            cfg["dtype"] = name
    cfg["mlx_dflash"] = _provenance(source, revision, "drafter")

    with staged_dir(out_dir, overwrite) as work:
        work.mkdir()
        save_weights(work, out_weights, max_shard_gb)
        write_json(work / "config.json", cfg, sort_keys=True)
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


def _check_target_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise DFlashError(f"target model {path} has no config.json: is it a Hugging Face model directory?")
    _check_index(path)
    safetensors_files(path)  # refuses pickle-only checkpoints


def _stamp(out: Path, source: str, revision: Optional[str]) -> None:
    """Record provenance in config.json (keeping what the GGUF converter recorded)."""
    file = out / "config.json"
    cfg = json.loads(file.read_text())
    prov = dict(cfg.get("mlx_dflash") or {})
    prov.update(_provenance(source, revision, "target"))
    cfg["mlx_dflash"] = prov
    write_json(file, cfg, indent=4, sort_keys=True)


def convert_target(src, out_dir, *, quantize: Optional[Quantization] = None, dtype: Optional[str] = None,
                   overwrite: bool = False, **mlx_lm_options) -> Path:
    """Convert a target (HF directory, hub repo id or .gguf file) into an mlx-lm model directory.

    HF sources go through `mlx_lm.convert` (dtype default: the checkpoint's torch_dtype); extra
    keyword arguments of `mlx_lm.convert` (e.g. quant_predicate, q_mode, trust_remote_code,
    revision) pass through. GGUF sources are dequantized by `mlx_dflash.gguf.convert_gguf` (dtype
    default: the one fast here, `machine.fast_float_dtype`) and then, with `quantize` or mlx-lm options, run
    through `mlx_lm.convert`.
    """
    from mlx_lm.convert import convert as mlx_lm_convert

    _check_dtype(dtype)
    allowed = set(inspect.signature(mlx_lm_convert).parameters) - _OWN_ARGS
    unknown = sorted(set(mlx_lm_options) - allowed)
    if unknown:
        raise DFlashError(f"unsupported mlx-lm conversion option(s) {', '.join(unknown)}; "
                          f"supported: {', '.join(sorted(allowed))}")
    revision = mlx_lm_options.pop("revision", None)
    q_args = dict(quantize=quantize is not None, q_bits=quantize and quantize.bits,
                  q_group_size=quantize and quantize.group_size)
    src_str = str(src)

    if src_str.lower().endswith(".gguf"):
        from .gguf import convert_gguf

        gguf_path = Path(src_str).expanduser()
        source = str(gguf_path.resolve())
        with staged_dir(out_dir, overwrite) as work:
            if not (quantize or mlx_lm_options):
                convert_gguf(gguf_path, work, dtype, source=source)
            else:
                plain = work.parent / "dequantized"
                convert_gguf(gguf_path, plain, dtype, source=source)
                _mlx_lm_convert(plain, work, src_str, dtype=None, **q_args, **mlx_lm_options)
            _stamp(work, source, None)
        return Path(out_dir).expanduser()

    path = resolve(src_str, "target model", revision)
    revision = _hub_revision(src_str, path)
    _check_target_dir(path)
    source = str(path.resolve()) if revision is None else src_str
    with staged_dir(out_dir, overwrite) as work:
        _mlx_lm_convert(path, work, src_str, dtype=dtype, **q_args, **mlx_lm_options)
        _stamp(work, source, revision)
    return Path(out_dir).expanduser()


quantize_options = grouped(
    "quantize", lambda quantize, q_bits, q_group_size: Quantization(q_bits, q_group_size) if quantize else None,
    click.option("--quantize", is_flag=True, help="Store the linear layers quantized (affine)."),
    click.option("--q-bits", default=4, show_default=True, type=int, help="4 or 8."),
    click.option("--q-group-size", default=64, show_default=True, type=int, help="32, 64 or 128."),
)
mlx_lm_options = grouped(  # passed to mlx_lm.convert for targets, only those given
    "mlx_lm", lambda **given: {k: v for k, v in given.items() if v not in (None, False)},
    click.option("--q-mode", default=None, help="Targets: mlx_lm.convert's quantization mode (e.g. affine, mxfp4)."),
    click.option("--quant-predicate", default=None, help="Targets: mlx_lm.convert's mixed-precision recipe."),
    click.option("--revision", default=None, help="Targets: hub revision to convert."),
    click.option("--trust-remote-code", is_flag=True, help="Targets: passed to mlx_lm.convert."),
)


@click.command("convert")
@click.option("--drafter", "drafter_src", help="DFlash drafter to convert: directory or Hugging Face repo id.")
@click.option("--model", "model_src", help="Target to convert: Hugging Face directory, repo id, or .gguf file.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output directory.")
@quantize_options
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=None,
              help="Default: the source's dtype (GGUF: float16 on Metal, float32 on MLX's CPU backend).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@mlx_lm_options
@click.option("--draft-vocab", default=None, type=int,
              help="Drafters: draft only over the N most frequent tokens of --vocab-data (0 drops a stored one).")
@click.option("--vocab-data", default=None, type=click.Path(dir_okay=False),
              help="Drafters: the target's responses (a `train --data` JSONL) that rank the tokens.")
def main(drafter_src, model_src, out_dir, quantize, dtype, overwrite, mlx_lm, draft_vocab, vocab_data):
    """Convert a drafter or a target into an MLX directory, optionally pre-quantized."""
    if bool(drafter_src) == bool(model_src):
        raise DFlashError("give exactly one of --drafter or --model")
    if drafter_src and mlx_lm:
        raise DFlashError(f"--{next(iter(mlx_lm)).replace('_', '-')} applies to --model conversions only")
    if model_src and (draft_vocab is not None or vocab_data):
        raise DFlashError("--draft-vocab and --vocab-data apply to --drafter conversions only")
    if drafter_src:
        out = convert_drafter(drafter_src, out_dir, quantize=quantize, dtype=dtype, overwrite=overwrite,
                              draft_vocab=draft_vocab, vocab_data=vocab_data)
    else:
        if dtype is None and model_src.lower().endswith(".gguf"):
            dtype = fast_float_dtype()
            where = "Metal" if metal_available() else "MLX's CPU backend"
            click.echo(f"storing the weights as {dtype}, the float type that runs fast on {where} "
                       "(--dtype chooses another)", err=True)
        if warning := half_precision_warning(dtype):
            click.echo(warning, err=True)
        out = convert_target(model_src, out_dir, quantize=quantize, dtype=dtype, overwrite=overwrite, **mlx_lm)
        if dtype is None and (warning := half_precision_warning(json.loads((out / "config.json").read_text())
                                                                  .get("torch_dtype"))):
            click.echo(warning, err=True)  # the checkpoint's own dtype, kept
    click.echo(f"wrote {out}")
