"""mlx-dflash: DFlash block-diffusion speculative decoding on MLX."""

__version__ = "0.1.0"
