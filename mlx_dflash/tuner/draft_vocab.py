"""Draft vocabularies (the FR-Spec idea): the drafter proposes only the most frequent tokens of the
target's own outputs.

Most of a small drafter's pass is its output head over the whole vocabulary (SmolLM2: 49,152 rows of
576, read for every drafted row). Frequency-ranked, a few thousand tokens cover almost everything a
target writes, so the drafter's head keeps only those rows. The target still verifies against its full
vocabulary: a token outside the subset can never be drafted, but the output is unchanged (greedy and
sampling alike; a v1 drafter's proposals are point masses, whatever set they come from).

The subset is chosen once, from a responses file of the target (`mlx-dflash train --data` writes one),
and stored with the drafter: `draft_vocab` (its size) in config.json, the ids, most frequent first, as
the tensor `draft_vocab_ids` beside the weights.
"""

from collections import Counter
from pathlib import Path

import numpy as np

from .data import read_samples
from ..errors import DFlashError


def response_token_counts(path) -> Counter:
    """How often each token occurs in the responses of a responses JSONL (prompts are not counted)."""
    path = Path(path)
    if not path.exists():
        raise DFlashError(f"responses file {path} does not exist (make one with `mlx-dflash train --data FILE`)")
    samples = read_samples(path)
    if not samples:
        raise DFlashError(f"{path} holds no responses (JSONL lines with response_ids, as `mlx-dflash train` writes)")
    if any("response_ids" not in s for s in samples):
        raise DFlashError(f"{path}: every line needs response_ids (the target's answer as token ids)")
    counts = Counter()
    for s in samples:
        counts.update(s["response_ids"])
    return counts


def select_draft_vocab(counts: Counter, size: int, vocab_size: int) -> np.ndarray:
    """The `size` most frequent token ids (ties: lower id first); tokens never seen fill the rest in
    id order when fewer than `size` were seen."""
    if not 1 <= size <= vocab_size:
        raise DFlashError(f"--draft-vocab must be in 1..{vocab_size} (the vocabulary), got {size}")
    outside = [t for t in counts if not 0 <= t < vocab_size]
    if outside:
        raise DFlashError(f"the responses contain token {outside[0]}, outside this drafter's vocabulary "
                          f"(0..{vocab_size - 1}): they were written by another target")
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    if len(ranked) < size:
        seen = set(ranked)
        ranked += [t for t in range(vocab_size) if t not in seen][: size - len(ranked)]
    return np.array(ranked, dtype=np.int32)


def coverage(counts: Counter, ids) -> float:
    """Share of the counted tokens that lie inside `ids`."""
    total = sum(counts.values())
    chosen = set(int(t) for t in ids)
    return sum(c for t, c in counts.items() if t in chosen) / total if total else 0.0
