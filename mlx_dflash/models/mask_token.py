"""The drafter's MASK token: a reserved, rarely used id that training and every runtime fill the same way.

A drafter reads `[anchor, MASK, ..., MASK]`; the MASK rows are the target's embedding row of
`mask_token_id`. If that id is also an ordinary token (one that text encodes to) or one the chat template
writes, a true token and "not drafted yet" look the same to the drafter, and a runtime that strips or
fills mask tokens touches real text (z-lab/dflash issue #73). Nothing fails: acceptance quietly drops.
A reserved id is an added special token the template never writes (and not BOS/EOS/PAD), or an
embedding row past the tokenizer's vocabulary, which no text can produce.

`mask_token_problem` is the check (training refuses, loading warns, `doctor` reports); `pick_mask_token`
chooses an id that passes it.
"""

from typing import Iterable, Optional

import numpy as np

MASK_FIX = "train the drafter again with a reserved one (`mlx-dflash train` picks one by default)"


def _hf(tokenizer):
    return getattr(tokenizer, "_tokenizer", tokenizer)


def _tokenizer_size(hf) -> Optional[int]:
    try:
        return len(hf)
    except TypeError:
        return None


def _taken(tokenizer) -> dict:
    """Ids with a role no MASK may share: {id: role}."""
    hf = _hf(tokenizer)
    roles = {}
    for role in ("bos", "eos", "pad"):
        token_id = getattr(hf, f"{role}_token_id", None)
        if token_id is not None:
            roles.setdefault(int(token_id), role.upper())
    for token_id in getattr(tokenizer, "eos_token_ids", ()) or ():
        roles.setdefault(int(token_id), "a stop")
    return roles


def mask_token_problem(tokenizer, mask_id: int, vocab_size: Optional[int] = None) -> Optional[str]:
    """Why `mask_id` is not a reserved MASK token for this tokenizer (one line, naming the token), or None.

    tokenizer: an mlx-lm TokenizerWrapper or a Hugging Face tokenizer. vocab_size: the target's embedding
    rows (ids past the tokenizer's vocabulary but inside the table are reserved)."""
    hf = _hf(tokenizer)
    if vocab_size is not None and not 0 <= mask_id < vocab_size:
        return f"mask token {mask_id} is outside the target's embedding table (0..{vocab_size - 1})"
    role = _taken(tokenizer).get(mask_id)
    if role is not None:
        return f"mask token {mask_id} is the tokenizer's {role} token"
    added = getattr(hf, "added_tokens_decoder", None) or {}
    if mask_id in added:
        content = added[mask_id].content
        template = getattr(tokenizer, "chat_template", None) or getattr(hf, "chat_template", None) or ""
        if content in template:
            return f"mask token {mask_id} ({content}) is written by the tokenizer's chat template"
        return None
    size = _tokenizer_size(hf)
    if size is not None and mask_id >= size:
        return None  # an embedding row no text encodes to
    piece = hf.convert_ids_to_tokens(mask_id) if hasattr(hf, "convert_ids_to_tokens") else None
    shown = f" ({piece!r})" if piece is not None else ""
    return f"mask token {mask_id}{shown} is an ordinary token of the tokenizer: text encodes to it"


def mask_token_in_data(sequences: Iterable, mask_id: int) -> Optional[str]:
    """A one-line problem if any (ids, response start) sequence contains `mask_id`, else None."""
    hits = [int(np.count_nonzero(np.asarray(ids) == mask_id)) for ids, _ in sequences]
    if not any(hits):
        return None
    return (f"the training data contains the mask token {mask_id} ({sum(hits)} times in "
            f"{sum(1 for h in hits if h)} of {len(hits)} sequences)")


def pick_mask_token(tokenizer, vocab_size: int, avoid: Iterable[int] = ()) -> int:
    """A reserved MASK id: the last added special token that is not BOS/EOS/PAD/a stop token and not in
    the chat template (NeMo's advice: never pad or eos), else the last embedding row past the tokenizer's
    vocabulary, else the last row. `avoid`: ids to pass over (e.g. those the training data contains)."""
    hf = _hf(tokenizer)
    avoid = set(avoid) | set(_taken(tokenizer))
    for token_id, token in sorted((getattr(hf, "added_tokens_decoder", None) or {}).items(), reverse=True):
        if token_id < vocab_size and token_id not in avoid and mask_token_problem(tokenizer, token_id) is None:
            return token_id
    size = _tokenizer_size(hf)
    if size is not None:
        for token_id in range(vocab_size - 1, size - 1, -1):
            if token_id not in avoid:
                return token_id
    return vocab_size - 1


def warn_mask_token(tokenizer, drafter, vocab_size: int) -> None:
    """One line on stderr when a drafter's mask token is not reserved for this target's tokenizer."""
    import sys

    if drafter.mask_token_id is None:  # no drafter (models/no_drafter.py)
        return
    problem = mask_token_problem(tokenizer, drafter.mask_token_id, vocab_size)
    if problem:
        where = f" {drafter.source}" if getattr(drafter, "source", None) else ""
        print(f"mlx-dflash: warning: drafter{where}: {problem}, so drafts lose acceptance; {MASK_FIX}",
              file=sys.stderr, flush=True)
