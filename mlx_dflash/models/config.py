"""Drafter configuration: every published DFlash config layout read into one dataclass.

Two layouts exist: older z-lab configs keep `block_size` and `rope_theta` at the top level; newer ones nest
`block_size` under `dflash_config` and move `rope_theta` into `rope_parameters` (z-lab's loaders in
dflash/model_mlx.py of dflash 0.1.0 read both). Nothing about a model is hard-coded here: every value comes
from the file, with the published defaults. DFlash 2 configs (`architectures ["DFlash2DraftModel"]`, as
z-lab/dflash's tests/fixtures/dflash2-config.json) add four required `dflash_config` fields:
`conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..errors import DFlashError

LAYER_TYPES = ("full_attention", "sliding_attention")
DFLASH1, DFLASH2 = "DFlashDraftModel", "DFlash2DraftModel"
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    target_layer_ids: tuple
    mask_token_id: int
    num_target_layers: Optional[int] = None
    rope_scaling: Optional[dict] = None
    layer_types: tuple = ()
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None
    attention_bias: bool = False
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    input_embedding_scale: float = 1.0
    # DFlash 2 only (None for v1): the grouped dynamic convolutions and the candidate selector.
    conv_kernel_size: Optional[int] = None
    conv_group_size: Optional[int] = None
    selector_rank: Optional[int] = None
    selector_top_k: Optional[int] = None
    # The whole file as read, so a converter can write back the fields it does not interpret.
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_dflash2(self) -> bool:
        return self.conv_kernel_size is not None

    @property
    def architecture(self) -> str:
        """The checkpoint's `architectures` entry: which drafter class it is (models/loader.py)."""
        return DFLASH2 if self.is_dflash2 else DFLASH1

    def layer_is_causal(self, i: int) -> bool:
        """Sliding layers are causal inside the block unless the config says otherwise (z-lab's dflash/model.py:
        `is_causal` defaults to `layer_type == "sliding_attention"`)."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> Optional[int]:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list:
    """The published fallback: evenly spaced from layer 1 to layer N-3 (one draft layer: the middle one)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _require(cfg: dict, key: str, where: str):
    if key not in cfg:
        raise DFlashError(f"drafter config {where} has no '{key}': is this a DFlash drafter config?")
    return cfg[key]


def parse_config(cfg: dict, where: str = "config.json") -> DFlashConfig:
    """Build a DFlashConfig from a config.json dict, accepting both published layouts."""
    dflash = cfg.get("dflash_config") or {}
    if "mask_token_id" not in dflash and "mask_token_id" not in cfg:
        raise DFlashError(
            f"{where} has no dflash_config.mask_token_id: not a DFlash drafter config "
            "(a drafter config carries dflash_config with mask_token_id and target_layer_ids)"
        )
    num_layers = int(_require(cfg, "num_hidden_layers", where))
    hidden = int(_require(cfg, "hidden_size", where))
    heads = int(_require(cfg, "num_attention_heads", where))

    rope_parameters = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
    rope_scaling = cfg.get("rope_scaling") or rope_parameters or None
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
        rope_scaling = None  # plain RoPE; rope_parameters only carried the theta

    num_target_layers = cfg.get("num_target_layers")
    target_layer_ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
    if target_layer_ids is None:
        if num_target_layers is None:
            raise DFlashError(
                f"{where} has neither dflash_config.target_layer_ids nor num_target_layers; "
                "add target_layer_ids to dflash_config"
            )
        target_layer_ids = build_target_layer_ids(int(num_target_layers), num_layers)

    layer_types = tuple(cfg.get("layer_types") or ("full_attention",) * num_layers)
    if len(layer_types) != num_layers:
        raise DFlashError(
            f"{where}: layer_types has {len(layer_types)} entries but num_hidden_layers is {num_layers}"
        )
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise DFlashError(f"{where}: unsupported layer_types {unknown}; known: {list(LAYER_TYPES)}")
    # transformers' Qwen3Config drops the window when use_sliding_window is false; z-lab's MLX code
    # always applies it. Honour the flag when a config states it, otherwise apply the window.
    sliding_window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if "sliding_attention" in layer_types and not sliding_window and cfg.get("use_sliding_window", True):
        raise DFlashError(f"{where}: sliding_attention layers need a sliding_window value")

    softcap = dflash.get("final_logit_softcapping", cfg.get("final_logit_softcapping"))
    block_size = int(dflash.get("block_size", cfg.get("block_size", 16)))
    if block_size < 1:
        raise DFlashError(f"{where}: block_size must be at least 1, got {block_size}")
    return DFlashConfig(
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(_require(cfg, "intermediate_size", where)),
        vocab_size=int(_require(cfg, "vocab_size", where)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        block_size=block_size,
        target_layer_ids=tuple(int(i) for i in target_layer_ids),
        mask_token_id=int(dflash.get("mask_token_id", cfg.get("mask_token_id"))),
        num_target_layers=None if num_target_layers is None else int(num_target_layers),
        rope_scaling=rope_scaling,
        layer_types=layer_types,
        sliding_window=None if sliding_window is None else int(sliding_window),
        is_causal=cfg.get("is_causal"),
        attention_bias=bool(cfg.get("attention_bias", False)),
        output_multiplier=float(dflash.get("output_multiplier", 1.0)),
        final_logit_softcapping=float(softcap) if softcap else None,
        input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
        **_dflash2_fields(cfg, dflash, hidden, where),
        raw=dict(cfg),
    )


def _dflash2_fields(cfg: dict, dflash: dict, hidden: int, where: str) -> dict:
    """The DFlash 2 sizes, checked; {} for a v1 config."""
    if DFLASH2 not in (cfg.get("architectures") or []):
        return {}
    out = {}
    for name in DFLASH2_FIELDS:
        value = dflash.get(name, cfg.get(name))
        if value is None:
            raise DFlashError(f"{where}: a DFlash 2 config needs dflash_config.{name}")
        if int(value) < 1:
            raise DFlashError(f"{where}: dflash_config.{name} must be at least 1, got {value}")
        out[name] = int(value)
    if hidden % out["conv_group_size"]:
        raise DFlashError(f"{where}: dflash_config.conv_group_size {out['conv_group_size']} does not divide "
                          f"hidden_size {hidden}")
    vocab = int(cfg["vocab_size"])
    if out["selector_top_k"] > vocab:
        raise DFlashError(f"{where}: dflash_config.selector_top_k {out['selector_top_k']} exceeds vocab_size {vocab}")
    return out


def load_config(path: Path) -> DFlashConfig:
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise DFlashError(f"no config.json in {path}: point --drafter at a DFlash drafter directory")
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise DFlashError(f"{file} is not valid JSON ({e})") from None
    return parse_config(cfg, where=str(file))


def config_to_dict(config: DFlashConfig) -> dict[str, Any]:
    """The published (newer) layout, keeping any fields of the original file we do not interpret."""
    out = dict(config.raw)
    out.update(
        architectures=[config.architecture],
        model_type=out.get("model_type", "qwen3"),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings,
        layer_types=list(config.layer_types),
        attention_bias=config.attention_bias,
        tie_word_embeddings=False,
        block_size=config.block_size,
    )
    if config.num_target_layers is not None:
        out["num_target_layers"] = config.num_target_layers
    if config.rope_scaling:
        out["rope_scaling"] = config.rope_scaling
    if config.sliding_window is not None:
        out["sliding_window"] = config.sliding_window
    if config.is_causal is not None:
        out["is_causal"] = config.is_causal
    dflash = dict(out.get("dflash_config") or {})
    dflash.update(
        block_size=config.block_size,
        target_layer_ids=list(config.target_layer_ids),
        mask_token_id=config.mask_token_id,
    )
    if config.output_multiplier != 1.0:
        dflash["output_multiplier"] = config.output_multiplier
    if config.final_logit_softcapping:
        dflash["final_logit_softcapping"] = config.final_logit_softcapping
    if config.input_embedding_scale != 1.0:
        dflash["input_embedding_scale"] = config.input_embedding_scale
    if config.is_dflash2:
        dflash.update({name: getattr(config, name) for name in DFLASH2_FIELDS})
    out["dflash_config"] = dflash
    return out
