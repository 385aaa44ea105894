"""Known pitfalls of a pair, checked before generating: one-line warnings that name the fix.

* Float16 activations of a quantized drafter or target on an M1/M2 GPU: reported against another DFlash
  runtime as acceptance falling to 0% (0.44x the target alone). Those chips have no bfloat16 hardware,
  so float16 is the tempting choice there; bfloat16 (emulated, slower per op) or float32 keep the drafts.
* A quantized or half-precision pair on MLX's CPU backend, which runs them several times slower than
  float32 where they are meant to be faster (docs/doctor.md has the measured rates).
* A mask token that is not reserved: the drafter fills its block with the mask token, so a token the
  target reads in ordinary text (or BOS/EOS/PAD, or one the chat template writes) means the drafter was
  made for another tokenizer's layout. Reserved, as `mlx-dflash train` picks it
  (tuner/trainer.py pick_mask_token): an added special token that is not BOS/EOS/PAD and that the chat
  template does not use, else the embedding's last row; any row past the tokenizer's own tokens too.

A cost table made on another chip, dtype or bit width is the width policy's own check (policies/width.py).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .machine import chip_name, m1_or_m2
from .policies.width import has_quantized_layers


def _float_dtypes(module) -> set:
    return {v.dtype for _, v in tree_flatten(module.parameters()) if mx.issubdtype(v.dtype, mx.floating)}


def float16_warning(target, drafter) -> Optional[str]:
    """The M1/M2 float16 pitfall: a quantized target or drafter whose activations are float16."""
    if not m1_or_m2():
        return None
    target_fp16 = target.activation_dtype == mx.float16
    # The drafter's activations start from the target's embedding and meet its own (scale) dtypes.
    drafter_fp16 = _float_dtypes(drafter) | {target.activation_dtype} == {mx.float16}
    which = [name for name, quantized, fp16 in (("target", has_quantized_layers(target.model), target_fp16),
                                               ("drafter", has_quantized_layers(drafter), drafter_fp16))
             if quantized and fp16]
    if not which:
        return None
    return (f"warning: the quantized {' and '.join(which)} run{'' if len(which) > 1 else 's'} in float16 on "
            f"this M1/M2 GPU ({chip_name()}), where DFlash acceptance has been seen to collapse: convert "
            f"{'them' if len(which) > 1 else 'it'} with `mlx-dflash convert --dtype bfloat16` (or float32)")


def cpu_dtype_warning(target, drafter) -> Optional[str]:
    """The CPU pitfall: quantized layers or float16/bfloat16 activations where MLX computes on the CPU."""
    if mx.default_device() != mx.cpu:
        return None
    slow = []
    for name, model, dtype in (("target", target.model, target.activation_dtype), ("drafter", drafter, None)):
        if has_quantized_layers(model):
            slow.append(f"the {name} is quantized")
        elif dtype is not None and dtype in (mx.float16, mx.bfloat16):  # (a Dtype cannot be compared with None)
            slow.append(f"the {name} runs in {str(dtype).rsplit('.', 1)[-1]}")
    if not slow:
        return None
    return (f"warning: {' and '.join(slow)}, which MLX's CPU backend runs several times slower than float32: on the "
            "CPU use an unquantized float32 copy (`mlx-dflash convert --model SRC --out DIR --dtype float32`)")


def mask_token_problem(mask_id: int, tokenizer, vocab_size: int) -> Optional[str]:
    """What is wrong with `mask_id` as the mask token of a target with this tokenizer and `vocab_size`
    embedding rows (None when it is reserved)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if mask_id >= len(hf):
        return None  # an embedding row no token of the tokenizer maps to
    special = {name: getattr(hf, f"{name.lower()}_token_id", None) for name in ("BOS", "EOS", "PAD")}
    named = next((name for name, i in special.items() if i == mask_id), None)
    if named is None and mask_id in set(getattr(tokenizer, "eos_token_ids", ()) or ()):
        named = "EOS"
    if named:
        return f"is the target's {named} token"
    added = getattr(hf, "added_tokens_decoder", {})
    if mask_id == vocab_size - 1 and mask_id not in added:
        return None  # pick_mask_token's choice when no special token is free
    if mask_id not in added:
        return f"({hf.convert_ids_to_tokens(mask_id)!r}) is an ordinary token of the target's vocabulary"
    if added[mask_id].content in (getattr(tokenizer, "chat_template", None) or ""):
        return f"({added[mask_id].content!r}) is a token the target's chat template writes"
    return None


def mask_token_warning(drafter, tokenizer, vocab_size: int) -> Optional[str]:
    mask_id = getattr(drafter, "mask_token_id", None)
    problem = None if mask_id is None else mask_token_problem(mask_id, tokenizer, vocab_size)
    if problem is None:
        return None
    return (f"warning: the drafter's mask token {mask_id} {problem}, not a reserved one: the drafter was "
            "likely made for another tokenizer; use the drafter made for this target (or train one: "
            "`mlx-dflash train` picks a reserved token)")


def pair_warnings(target, drafter, tokenizer) -> list[str]:
    """Every pitfall warning of this pair (empty when none applies)."""
    found = (float16_warning(target, drafter), cpu_dtype_warning(target, drafter),
             mask_token_warning(drafter, tokenizer, target.vocab_size))
    return [w for w in found if w]
