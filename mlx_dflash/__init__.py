"""mlx-dflash: DFlash block-diffusion speculative decoding on MLX.

    import mlx_dflash
    target, drafter, tokenizer = mlx_dflash.load()          # the default pair
    text = mlx_dflash.generate(target, drafter, tokenizer, "Hello", max_tokens=64, verbose=True)
"""

__version__ = "0.1.0"

from .decoding.responses import GenerationResponse  # noqa: E402
from .generate import generate, stream_generate  # noqa: E402
from .pair import load  # noqa: E402

__all__ = ["load", "generate", "stream_generate", "GenerationResponse", "__version__"]
