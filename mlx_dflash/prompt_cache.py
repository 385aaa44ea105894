"""Prefix cache: a request starts from the longest kept prefix of its token ids, for the target and the drafter.

A kept state (`decoder.DecodeState`) is three things, and all three are restored exactly: the target's
cache; a hybrid target's recurrent (GatedDeltaNet) state, which cannot be trimmed; and the drafter's
context (its own KV cache over the target's features, plus the feature rows it has not read). A state
whose caches all trim serves every shorter prefix of its tokens; one with recurrent layers serves only
its own tokens exactly, so a hybrid target's states are kept at reusable boundaries too: the end of each
chat message, every `RUNG_EVERY` tokens of a long prompt, and one token before the prompt's end (a
verbatim resend then reads one token). Every request keeps the state it ended with (prompt + answer),
which the next turn of a conversation extends.

Entries are kept least recently used first out, within `max_entries` and `max_bytes`, and optionally on
disk (one safetensors file per entry, written atomically, naming the pair it belongs to), so a restart
keeps them. mlx-lm's `LRUPromptCache` is not reused: its lookup hands back an exact match with nothing
left to prefill (the decoder needs the last prompt token's logits), it has no hook to delete an evicted
entry's file, and it keeps one dict per token in its trie (26k dicts for one agent context); the lookup
here compares token arrays with numpy, which for 10 entries of 26k tokens takes well under a millisecond.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, load_prompt_cache, save_prompt_cache

from .decoder import DecodeState
from .errors import DFlashError

RUNG_EVERY = 2048  # tokens between a hybrid target's kept states inside a long prompt
FORMAT = "mlx-dflash/prompt-cache/1"


def memory_bytes() -> int:
    """This machine's physical memory (0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def default_max_bytes() -> int:
    """A quarter of the machine's memory (4 GB where it cannot be read)."""
    return memory_bytes() // 4 or 4 << 30


def pair_identity(target_dir, drafter_dir, kv_quantization=None) -> str:
    """A short hash naming the pair a kept state belongs to: both configs, the drafter's weights, the
    target's weight files (names and sizes) and the KV cache settings. A state is never used for another."""
    h = hashlib.sha256()
    for directory in (Path(target_dir), Path(drafter_dir)):
        for f in sorted(directory.glob("*.json")):
            h.update(f.name.encode() + f.read_bytes())
        for f in sorted(directory.glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    for f in sorted(Path(drafter_dir).glob("*.safetensors")):
        h.update(f.read_bytes())
    h.update(json.dumps(kv_quantization).encode())
    return h.hexdigest()[:16]


def _nbytes(x) -> int:
    return 0 if x is None else x.nbytes


def _drafter_arrays(c: KVCache) -> list:
    return [None, None] if c.keys is None else [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]


@dataclass
class Entry:
    """A kept state: its tokens, and the caches that hold them (copies nobody else mutates)."""

    tokens: np.ndarray
    state: DecodeState
    trimmable: bool
    nbytes: int


def entry_of(state: DecodeState, trimmable: bool) -> Entry:
    target_bytes = sum(c.nbytes for c in state.cache)
    draft_bytes = sum(_nbytes(a) for c in state.draft_cache for a in _drafter_arrays(c))
    tokens = np.array(state.tokens, dtype=np.int32)
    return Entry(tokens, state, trimmable, target_bytes + draft_bytes + _nbytes(state.context))


def restore(entry: Entry, length: int) -> DecodeState:
    """A copy of the entry's state holding its first `length` tokens."""
    state = copy.deepcopy(entry.state)
    cut = len(state.tokens) - length
    if cut:
        for c in state.cache:
            c.trim(cut)
        state.tokens = state.tokens[:length]
        rows = 0 if state.context is None else state.context.shape[1]
        if cut < rows:
            state.context = state.context[:, : rows - cut]
        else:  # the context goes; the rest comes off the drafter's own cache
            state.context = None
            for c in state.draft_cache:
                c.trim(cut - rows)
    return state


class PromptCache:
    """Kept decode states of one pair, looked up by the longest usable prefix of a prompt's token ids."""

    def __init__(self, identity: str, trimmable: bool, max_entries: int = 10, max_bytes: Optional[int] = None,
                 directory=None):
        if max_entries < 1:
            raise DFlashError(f"--prompt-cache-size must be at least 1, got {max_entries}")
        self.identity, self.trimmable = identity, trimmable
        self.max_entries = max_entries
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        if self.max_bytes < 1:
            raise DFlashError(f"--prompt-cache-bytes must be at least 1, got {self.max_bytes}")
        self.directory = None if directory is None else Path(directory).expanduser()
        self._entries: OrderedDict[tuple, Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # /health reads the counters from another thread
        self.hits = self.misses = self.cached_tokens = 0
        self.prefill_rate = None  # prompt tokens per second of recent cold prefills
        if self.directory is not None:
            self._load_directory()

    # Lookup and insertion.
    def fetch(self, tokens: list) -> Optional[DecodeState]:
        """A restored state holding the longest usable prefix of `tokens` (at least one token is left for
        the prefill to read), or None."""
        query = np.array(tokens, dtype=np.int32)
        best, best_length = None, 0
        for key, entry in self._entries.items():
            n = min(len(entry.tokens), len(query))
            mismatch = np.flatnonzero(entry.tokens[:n] != query[:n])
            common = int(mismatch[0]) if mismatch.size else n
            if entry.trimmable:
                usable = min(common, len(query) - 1)
            else:  # recurrent state: only its own tokens, all of them
                usable = len(entry.tokens) if common == len(entry.tokens) < len(query) else 0
            if usable >= best_length and usable > 0:
                best, best_length = key, usable
        with self._lock:
            if best is None:
                self.misses += 1
                return None
            self.hits += 1
            self.cached_tokens += best_length
            self._entries.move_to_end(best)
        return restore(self._entries[best], best_length)

    def insert(self, state: DecodeState, copy_state: bool = False) -> bool:
        """Keep `state` (a copy of it if the caller goes on using it). A state whose target cache is a
        token ahead of its features (mid plain steps) is trimmed back where that is exact; one that cannot
        be made consistent, or that dropped its features (drafting off), is not kept. Returns whether kept."""
        if state.dropped_features or not state.tokens:
            return False
        ahead = max((c.offset for c in state.cache if hasattr(c, "offset")), default=len(state.tokens))
        ahead -= len(state.tokens)
        if ahead and not self.trimmable:
            return False
        if copy_state:
            state = copy.deepcopy(state)
        for c in state.cache if ahead else ():
            c.trim(ahead)
        mx.eval([c.state for c in state.cache], state.context, [_drafter_arrays(c) for c in state.draft_cache])
        entry = entry_of(state, self.trimmable)
        key = tuple(state.tokens)
        with self._lock:
            self._entries.pop(key, None)
            if entry.trimmable:  # its prefixes are served by trimming it: they only take space
                for other in [k for k in self._entries if len(k) < len(key) and key[: len(k)] == k]:
                    self._forget(other)
            self._entries[key] = entry
            self._evict()
            kept = key in self._entries
        if kept and self.directory is not None:
            self._save(entry)
        return kept

    def _evict(self):
        while self._entries and (len(self._entries) > self.max_entries or self.nbytes > self.max_bytes):
            self._forget(next(iter(self._entries)))

    def _forget(self, key: tuple):
        entry = self._entries.pop(key)
        if self.directory is not None:
            self._file(entry.tokens).unlink(missing_ok=True)

    # Statistics.
    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def observe_prefill(self, tokens: int, seconds: float):
        """A prefill that read `tokens` uncached tokens: the rate that tells what a hit saves."""
        if tokens >= 32 and seconds > 0:
            rate = tokens / seconds
            self.prefill_rate = rate if self.prefill_rate is None else 0.8 * self.prefill_rate + 0.2 * rate

    def seconds_saved(self, cached_tokens: int) -> float:
        return cached_tokens / self.prefill_rate if self.prefill_rate else 0.0

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.nbytes, "max_entries": self.max_entries,
                    "max_bytes": self.max_bytes, "hits": self.hits, "misses": self.misses,
                    "cached_tokens": self.cached_tokens}

    # Persistence: one safetensors file per entry.
    def _file(self, tokens: np.ndarray) -> Path:
        digest = hashlib.sha256(self.identity.encode() + tokens.tobytes()).hexdigest()[:24]
        return self.directory / f"{digest}.safetensors"

    def _save(self, entry: Entry):
        state = entry.state
        layers = list(state.cache) + [ArraysCache(2) for _ in state.draft_cache] + [ArraysCache(2)]
        for holder, c in zip(layers[len(state.cache):], state.draft_cache):
            holder.cache = _drafter_arrays(c)
        layers[-1].cache = [mx.array(entry.tokens), state.context]
        metadata = {"format": FORMAT, "identity": self.identity, "target_layers": str(len(state.cache)),
                    "trimmable": str(entry.trimmable), "saved": str(time.time())}
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self._file(entry.tokens)
        partial = final.with_name(f".{final.stem}.partial.safetensors")
        try:
            save_prompt_cache(str(partial), layers, metadata)
            os.replace(partial, final)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise

    def _load_directory(self):
        """Entries of this pair from the directory, oldest first (so the newest are kept); files of another
        pair or format are left alone, unreadable ones skipped."""
        if not self.directory.is_dir():
            return
        files = sorted(self.directory.glob("*.safetensors"), key=lambda f: f.stat().st_mtime)
        for f in files:
            if f.name.startswith("."):
                continue
            try:
                layers, metadata = load_prompt_cache(str(f), return_metadata=True)
            except Exception:  # a torn or foreign file: never fatal
                continue
            if metadata.get("format") != FORMAT or metadata.get("identity") != self.identity:
                continue
            n = int(metadata["target_layers"])
            tokens, context = layers[-1].cache
            draft_cache = []
            for holder in layers[n:-1]:
                c = KVCache()
                keys, values = holder.cache
                if keys is not None:
                    c.update_and_fetch(keys, values)
                draft_cache.append(c)
            state = DecodeState(layers[:n], draft_cache, tokens.tolist(), context)
            entry = entry_of(state, metadata.get("trimmable") == "True")
            self._entries[tuple(state.tokens)] = entry
        self._evict()


def rungs(prompt_tokens: int, boundaries=()) -> list:
    """Where a hybrid target's states are kept inside a prompt: the given boundaries (chat message ends),
    every RUNG_EVERY tokens, and one token before the end."""
    marks = set(boundaries) | set(range(RUNG_EVERY, prompt_tokens, RUNG_EVERY)) | {prompt_tokens - 1}
    return sorted(b for b in marks if 0 < b < prompt_tokens)


def read_to_rungs(target, state: DecodeState, ids: list, prompt_cache: PromptCache, boundaries=(),
                  step: int = 2048, progress=None) -> DecodeState:
    """Read the prompt into `state` up to each rung past what it holds, keeping a copy at each, for a target
    whose state cannot be trimmed (the decoder reads the rest)."""
    for mark in rungs(len(ids), boundaries):
        start = len(state.tokens)
        if mark <= start:
            continue
        report = None if progress is None else (lambda done, _, start=start: progress(start + done, len(ids)))
        features = target.read(mx.array(ids[start:mark]), state.cache, step, report)
        state.extend(ids[start:mark], features)
        prompt_cache.insert(state, copy_state=True)
    return state
