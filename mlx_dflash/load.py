"""Finding and loading the two halves of a pair: a local directory or a Hugging Face repo id.

A repo id is downloaded with huggingface-hub on the user's machine (safetensors and JSON only: code
and pickle files shipped with a checkpoint are never fetched). Tests use local directories only.
"""

from __future__ import annotations

import re
from pathlib import Path

from .drafter import DFlashDraftModel, drafter_from_dir
from .errors import DFlashError
from .target import Target

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

    path = resolve(path_or_repo, "target model")
    if not (path / "config.json").exists():
        raise DFlashError(f"target model {path} has no config.json: is it an mlx-lm model directory?")
    try:
        model, tokenizer = mlx_lm_load(str(path))
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise DFlashError(f"mlx-lm cannot load target model {path}: {e}") from None
    return Target(model), tokenizer


def load_drafter(path_or_repo: str) -> DFlashDraftModel:
    return drafter_from_dir(resolve(path_or_repo, "drafter"))


def load_pair(target_path: str, drafter_path: str, wide_kernels: bool = True):
    """(Target, drafter bound to it, tokenizer), with the pair checked for compatibility.

    wide_kernels: on Metal, verify 6..16 rows of a quantized target with our one-pass kernel, and route
    the verify forward's 2..16-row attention to our multi-row kernel (each where the race gate picks it).
    """
    target, tokenizer = load_target(target_path)
    if wide_kernels:
        target.install_wide_kernels()
        target.install_attention_kernel()
    drafter = load_drafter(drafter_path).bind(target)
    return target, drafter, tokenizer
