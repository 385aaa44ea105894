"""The width policy: how many block rows the target verifies each round.

The drafter always drafts its whole block in one pass (drafting cost is nearly flat in length); the
policy only decides how long a prefix of it the target checks. Width counts rows, anchor included:
width w verifies w - 1 drafted tokens.

The base rule is z-lab's advice for MLX, made real: on a quantized model, MLX's quantized matmul reads
the weights once for up to 5 rows and again for every further 5 (`../shared/research/mlx-kernels.md`
section 2), so without our wide kernels the verify width is clamped to 5 unless the user forces it.
"""

from dataclasses import dataclass, field
from typing import Optional

import mlx.nn as nn

from .errors import DFlashError

QUANTIZED_MAX_WIDTH = 5


def has_quantized_layers(model: nn.Module) -> bool:
    """True when some matmul of the model runs through MLX's quantized kernels."""
    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return any(isinstance(m, quantized) for _, m in model.named_modules())


@dataclass
class WidthPolicy:
    block_size: int  # rows the drafter drafts (anchor included)
    max_width: int  # rows the target verifies at most
    notes: list = field(default_factory=list)  # said once at start, kept in the stats

    def width(self, remaining: int) -> int:
        """Rows to verify this round, when at most `remaining` more tokens may be emitted."""
        return max(1, min(self.max_width, self.block_size, remaining))


def make_policy(
    trained_block_size: int,
    block_size: Optional[int] = None,
    *,
    quantized: bool = False,
    wide_kernels: bool = False,
    force_width: bool = False,
) -> WidthPolicy:
    """The fixed-width policy for a drafter and target, with the quantized-verification rule applied.

    block_size: verify width asked for (1..trained_block_size); default: the drafter's trained size.
    quantized: the target or drafter has quantized linear layers.
    wide_kernels: our 6..16-row kernels are installed (Metal only), which lifts the rule.
    force_width: verify past 5 rows on a quantized model anyway.
    """
    if block_size is None:
        block_size = trained_block_size
    if not 1 <= block_size <= trained_block_size:
        raise DFlashError(
            f"block size {block_size} is out of range: this drafter was trained with blocks of "
            f"{trained_block_size}, so use 1..{trained_block_size}"
        )
    policy = WidthPolicy(block_size=trained_block_size, max_width=block_size)
    if quantized and block_size > QUANTIZED_MAX_WIDTH and not wide_kernels:
        if force_width:
            policy.notes.append(
                f"warning: verifying {block_size} rows on a quantized model without wide kernels: MLX's "
                f"quantized matmul reads the weights about {-(-block_size // QUANTIZED_MAX_WIDTH)}x per "
                "verify (or switches to its 32-row tiled kernel), which usually costs more than it gains"
            )
        else:
            policy.max_width = QUANTIZED_MAX_WIDTH
            policy.notes.append(
                f"quantized model without wide kernels: verify width clamped from {block_size} to "
                f"{QUANTIZED_MAX_WIDTH} (pass --force-width to override)"
            )
    return policy
