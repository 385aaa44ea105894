"""Drafters from checkpoints: one registry keyed on the checkpoint's architecture, strict loading.

`config.json`'s `architectures` names the class (`ARCHITECTURES`); the weights load strictly (a missing
or unexpected tensor is an error naming it), quantized modules are rebuilt exactly where the checkpoint
has quantized weights, and code shipped beside a checkpoint (the `dflash.py` of published repos) is
never imported.
"""

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import DFlashError
from ..utils import safetensors_files
from .config import DFLASH1, DFLASH2, DFlashConfig, build_target_layer_ids, parse_config
from .dflash import DRAFT_VOCAB_KEY, DFlashDraftModel
from .dflash2 import DFlash2DraftModel

ARCHITECTURES = {DFLASH1: DFlashDraftModel, DFLASH2: DFlash2DraftModel}


def read_weights(path: Path) -> dict:
    """Every tensor of a checkpoint directory's safetensors files (pickle files are refused)."""
    weights = {}
    for f in safetensors_files(path):
        weights.update(mx.load(str(f)))
    return weights


def drafter_from_dir(path: Path) -> DFlashDraftModel:
    """Build a drafter from a local directory (config.json + safetensors), strictly.

    Code shipped beside a checkpoint (the `dflash.py` of published repos) is never imported.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise DFlashError(f"{path} has no config.json: it is not a DFlash drafter directory (config.json + *.safetensors)")
    config = parse_config(json.loads(config_file.read_text()), where=str(config_file))
    model = new_drafter(config)
    weights = read_weights(path)
    draft_vocab = pop_draft_vocab(weights, config, where=str(path))
    weights = model.sanitize(weights, where=str(path))
    quantization = config.raw.get("quantization")
    if quantization:
        quantize_like_checkpoint(model, quantization, weights)
    load_strict(model, weights, where=str(path))
    model.set_draft_vocab(draft_vocab, where=str(path))
    model.set_context_window(context_window_of(config, where=str(config_file)))
    model.eval()
    model.source = path  # the directory it came from (what a kept prefix-cache state names)
    return model


def context_window_of(config: DFlashConfig, where: str) -> Optional[int]:
    """config.json's `context_window` (ours, as `draft_vocab`): the context positions the drafter attends to
    by default, set for a drafter that drafts better over a recent window than over a long context."""
    window = config.raw.get("context_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise DFlashError(f"{where}: context_window must be a whole number of positions, 1 or more, not {window!r}")
    return window


def pop_draft_vocab(weights: dict, config: DFlashConfig, where: str) -> Optional[mx.array]:
    """Take the draft vocabulary out of a checkpoint's tensors; config.json's `draft_vocab` must agree."""
    ids = weights.pop(DRAFT_VOCAB_KEY, None)
    size = config.raw.get("draft_vocab")
    if ids is None and size is None:
        return None
    if ids is None:
        raise DFlashError(f"{where}: config.json sets draft_vocab {size} but the weights have no {DRAFT_VOCAB_KEY} "
                          "tensor; drop draft_vocab from config.json or re-run `mlx-dflash convert --draft-vocab`")
    if size is None or size != ids.size:
        raise DFlashError(f"{where}: the {DRAFT_VOCAB_KEY} tensor holds {ids.size} ids but config.json's draft_vocab "
                          f"is {size}: the directory was edited by hand; re-run `mlx-dflash convert --draft-vocab`")
    return ids


def new_drafter(config: DFlashConfig) -> DFlashDraftModel:
    """An (uninitialised) drafter of the config's architecture (`ARCHITECTURES`)."""
    return ARCHITECTURES[config.architecture](config)


def quantize_like_checkpoint(model: nn.Module, quantization: dict, weights: dict):
    """Rebuild quantized modules exactly where the checkpoint has quantized weights."""
    nn.quantize(
        model,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=lambda p, m: f"{p}.scales" in weights,
    )


def load_strict(model: nn.Module, weights: dict, where: str):
    """Load weights; any missing or unexpected key is an error that names it."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {_some(missing)}")
        if unexpected:
            parts.append(f"unexpected {_some(unexpected)}")
        raise DFlashError(f"drafter weights in {where} do not match its config: " + "; ".join(parts))
    for name, value in weights.items():
        if value.shape != expected[name].shape:
            raise DFlashError(
                f"drafter weight {name} in {where} has shape {tuple(value.shape)}, "
                f"the config implies {tuple(expected[name].shape)}"
            )
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())


def _some(keys: list, n: int = 4) -> str:
    shown = ", ".join(keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")


def drafter_config_for(
    target,
    num_layers: int = 1,
    block_size: int = 16,
    num_target_features: Optional[int] = None,
    mask_token_id: Optional[int] = None,
    dflash2: Optional[dict] = None,
) -> DFlashConfig:
    """A drafter config sized for `target` (a Target): its width, heads and vocabulary, its RoPE base.

    num_target_features: how many target layers feed the drafter (default: one per draft layer, as
    published); they are spread evenly by the published rule. mask_token_id defaults to the last row
    of the embedding table. dflash2: the four DFlash 2 sizes (config.DFLASH2_FIELDS) for a DFlash 2
    drafter; None for v1.
    """
    args = target.text_args
    heads = args.num_attention_heads
    taps = num_target_features or num_layers
    cfg = dict(
        architectures=[DFLASH2 if dflash2 else DFLASH1],
        model_type="qwen3",
        hidden_size=target.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(args, "num_key_value_heads", None) or heads,
        head_dim=getattr(args, "head_dim", None) or target.hidden_size // heads,
        intermediate_size=args.intermediate_size,
        vocab_size=target.vocab_size,
        rms_norm_eps=getattr(args, "rms_norm_eps", 1e-6),
        rope_theta=getattr(args, "rope_theta", 10000.0),
        max_position_embeddings=getattr(args, "max_position_embeddings", None) or 32768,
        num_target_layers=target.num_layers,
        dflash_config=dict(
            block_size=block_size,
            target_layer_ids=build_target_layer_ids(target.num_layers, taps),
            mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
            **(dflash2 or {}),
        ),
    )
    return parse_config(cfg, where="drafter_config_for")


def init_drafter(config: DFlashConfig, seed: Optional[int] = None) -> DFlashDraftModel:
    """A freshly initialised drafter (random weights), e.g. as the start of training."""
    if seed is not None:
        mx.random.seed(seed)
    model = new_drafter(config)
    mx.eval(model.parameters())
    return model
