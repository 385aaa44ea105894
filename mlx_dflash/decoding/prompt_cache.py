"""Prefix cache: a request starts from the longest kept prefix of its token ids, for the target and the drafter.

A kept state (`decoder.DecodeState`) is three things, and all three are restored exactly: the target's
KV caches, which trim to any shorter prefix; a hybrid target's recurrent (GatedDeltaNet) state, which
cannot be trimmed, so it is checkpointed at reusable positions (the end of each of the last chat messages,
every `RUNG_EVERY` tokens of a long prompt, one token before the prompt's end so that a verbatim resend
reads one token, and where the request ended); and the drafter's context (its own KV cache over the
target's features, plus the feature vectors it has not read), which trims like a KV cache. A state then
serves every prefix of its tokens (a hybrid target's: every checkpoint in it). A checkpoint holds the
recurrent layers only: one KV copy per conversation, however many checkpoints it has.

Every request keeps the state it ended with (prompt + answer), which the next turn of a conversation
extends; a kept state whose tokens start a newer one is folded into it (its checkpoints move over).
Each entry belongs to a scope (a server keeps one per API key, so that one client's hits never tell
what another sent; "" otherwise): a request starts only from its own scope's entries. Entries go least
recently used first, within `max_entries` and `max_bytes` (all scopes together), and are optionally kept on
disk (one safetensors file per entry in mlx-lm's prompt-cache format, written atomically, naming the
pair it belongs to), so a restart keeps them.

mlx-lm's `LRUPromptCache` is not reused: its lookup hands back an exact match with nothing left to
prefill (the decoder needs the last prompt token's logits), it has no notion of checkpoints in a state
that cannot trim, no hook to delete an evicted entry's file, and one dict per token in its trie (26k
dicts for one agent context); the lookup here compares token arrays with numpy.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, load_prompt_cache, save_prompt_cache

from ..errors import DFlashError
from ..models.no_drafter import NoDrafter
from .decoder import DecodeState, SingleProcess

RUNG_EVERY = 2048  # tokens between a hybrid target's checkpoints inside a long prompt
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


def pair_identity(target, drafter) -> str:
    """A short hash naming the pair a kept state belongs to: both configs, the drafter's weights, the
    target's weight files (names and sizes) and the KV cache settings, read from the directories they were
    loaded from (a pair built in memory gets a name of its own, never found on disk). A state is never
    used for another pair."""
    no_drafter = isinstance(drafter, NoDrafter)
    if target.source is None or (drafter.source is None and not no_drafter):
        return f"in-memory-{id(target):x}-{id(drafter):x}"
    h = hashlib.sha256(b"no drafter" if no_drafter else b"")
    drafter_dirs = [] if no_drafter else [Path(drafter.source)]
    for directory in [Path(target.source), *drafter_dirs]:
        for f in sorted(directory.glob("*.json")):
            h.update(f.name.encode() + f.read_bytes())
        for f in sorted(directory.glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    for f in sorted(f for d in drafter_dirs for f in d.glob("*.safetensors")):  # the drafter's weights
        h.update(f.read_bytes())
    h.update(json.dumps(target.kv_quantization).encode())
    return h.hexdigest()[:16]


def _nbytes(arrays) -> int:
    return sum(a.nbytes for a in arrays if a is not None)


def _drafter_arrays(c: KVCache) -> list:
    return [None, None] if c.keys is None else [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]


def recurrent_layers(cache: list) -> list:
    """Indices of the layers whose state cannot be trimmed."""
    return [i for i, c in enumerate(cache) if not c.is_trimmable()]


def checkpoint(cache: list) -> dict:
    """The recurrent layers' arrays as they are now ({layer: [arrays]}). The model rebinds those arrays
    rather than writing into them, so holding the references is a snapshot."""
    return {i: list(cache[i].cache) for i in recurrent_layers(cache)}


@dataclass
class Entry:
    """A kept state (its caches belong to the entry alone) and, for a target that cannot trim, the
    positions it can be restored to, each with its recurrent layers' arrays."""

    tokens: np.ndarray
    state: DecodeState
    checkpoints: Optional[dict] = None  # {position: checkpoint}; None: every position (a trimmable target)
    prefill_rate: Optional[float] = None  # read from its file: the rate its cache had seen (what a hit saves)
    scope: str = ""
    nbytes: int = field(default=0, init=False)

    def __post_init__(self):
        state = self.state
        self.nbytes = (sum(c.nbytes for c in state.cache) + _nbytes([state.context])
                       + sum(_nbytes(_drafter_arrays(c)) for c in state.draft_cache)
                       + sum(_nbytes(a) for point in (self.checkpoints or {}).values() for a in point.values()))

    def usable(self, query: np.ndarray) -> int:
        """How many leading tokens of `query` this entry restores, leaving at least one to read."""
        n = min(len(self.tokens), len(query))
        mismatch = np.flatnonzero(self.tokens[:n] != query[:n])
        limit = min(int(mismatch[0]) if mismatch.size else n, len(query) - 1)
        if self.checkpoints is None:
            return limit
        return max((p for p in self.checkpoints if p <= limit), default=0)

    def restore(self, length: int) -> DecodeState:
        """A copy of the state holding its first `length` tokens."""
        state = copy.deepcopy(self.state)
        cut = len(state.tokens) - length
        for c in state.cache:
            if c.is_trimmable() and cut:
                c.trim(cut)
        for i, arrays in (self.checkpoints or {}).get(length, {}).items():
            state.cache[i] = ArraysCache(len(arrays))
            state.cache[i].cache = list(arrays)
        state.tokens = state.tokens[:length]
        rows = 0 if state.context is None else state.context.shape[1]
        if cut < rows:
            state.context = state.context[:, : rows - cut] if cut else state.context
        else:  # the context goes; the rest comes off the drafter's own cache
            state.context = None
            for c in state.draft_cache:
                c.trim(cut - rows)
        return state

    def checkpoints_to(self, length: int) -> dict:
        """This entry's checkpoints at or before `length` (for the state restored from it to keep)."""
        return {p: point for p, point in (self.checkpoints or {}).items() if p <= length}


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
        self._entries: OrderedDict[tuple, Entry] = OrderedDict()  # (scope, *tokens): least recently used first
        self._lock = threading.Lock()  # /health reads the counters from another thread
        self._counts = {}  # scope -> [hits, misses, cached tokens]: a scope's counters are its own
        self.prefill_rate = None  # prompt tokens per second of recent cold prefills
        if self.directory is not None:
            self._load_directory()

    # Lookup and insertion.
    def best(self, tokens: list, scope: str = "") -> tuple:
        """(key, usable length) of the scope's entry restoring the longest prefix of `tokens` (at least one
        token is left for the prefill to read: its logits pick the first new token); (None, 0) if none does."""
        query = np.array(tokens, dtype=np.int32)
        best, best_length = None, 0
        for key, entry in self._entries.items():  # most recently used last: it wins ties
            if entry.scope != scope:
                continue
            usable = entry.usable(query)
            if usable >= best_length and usable > 0:
                best, best_length = key, usable
        return best, best_length

    def fetch(self, tokens: list, scope: str = "") -> tuple:
        """(a restored copy of the state holding the longest usable prefix of `tokens`, the checkpoints it
        keeps), or (None, {}) if no entry of the scope holds one."""
        best, best_length = self.best(tokens, scope)
        with self._lock:
            counts = self._counts.setdefault(scope, [0, 0, 0])
            if best is None:
                counts[1] += 1
                return None, {}
            counts[0] += 1
            counts[2] += best_length
            self._entries.move_to_end(best)
        entry = self._entries[best]
        return entry.restore(best_length), entry.checkpoints_to(best_length)

    def insert(self, state: DecodeState, checkpoints: Optional[dict] = None, scope: str = "") -> bool:
        """Keep `state` in the scope; the caller no longer uses it. checkpoints: for a target that cannot trim, the
        positions (and recurrent arrays) it may be restored to; its end is added when its caches agree with
        its tokens. A state that dropped its features (drafting off) is not kept. Returns whether kept."""
        if state.dropped_features or not state.tokens:
            return False
        ahead = max((c.offset for c in state.cache if c.is_trimmable()), default=len(state.tokens))
        ahead -= len(state.tokens)  # mid plain steps, the target's cache holds one token more
        for c in state.cache if ahead else ():
            if c.is_trimmable():
                c.trim(ahead)
        if not self.trimmable:
            checkpoints = dict(checkpoints or {})
            if not ahead:
                checkpoints[len(state.tokens)] = checkpoint(state.cache)
            if not checkpoints:
                return False
        mx.eval([c.state for c in state.cache], state.context, [_drafter_arrays(c) for c in state.draft_cache])
        key = (scope, *state.tokens)
        entry = Entry(np.array(key[1:], dtype=np.int32), state, None if self.trimmable else checkpoints,
                      scope=scope)
        with self._lock:
            self._entries.pop(key, None)
            for older in [k for k in self._entries if len(k) < len(key) and key[: len(k)] == k]:
                folded = self._entries[older].checkpoints
                if folded is not None:  # its checkpoints stay good for the newer state, which holds them all
                    entry = Entry(entry.tokens, state, {**folded, **entry.checkpoints}, scope=scope)
                self._forget(older)
            self._entries[key] = entry
            self._evict()
            kept = key in self._entries
        if kept and self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_entry(self._file(entry), entry, self.identity, self.prefill_rate)
        return kept

    def _evict(self):
        while self._entries and (len(self._entries) > self.max_entries or self.nbytes > self.max_bytes):
            self._forget(next(iter(self._entries)))

    def _forget(self, key: tuple):
        entry = self._entries.pop(key)
        if self.directory is not None:
            self._file(entry).unlink(missing_ok=True)

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

    def stats(self, scope: Optional[str] = None) -> dict:
        """Entries, bytes and lookups (hits, misses, prompt tokens restored): one scope's (a server's caller sees
        its own API key's only), or every scope's together (None)."""
        with self._lock:
            entries = [e for e in self._entries.values() if scope is None or e.scope == scope]
            counts = [self._counts.get(scope, [0, 0, 0])] if scope is not None else list(self._counts.values())
            hits, misses, cached = (sum(c[i] for c in counts) for i in range(3))
            return {"entries": len(entries), "bytes": sum(e.nbytes for e in entries), "max_entries": self.max_entries,
                    "max_bytes": self.max_bytes, "hits": hits, "misses": misses, "cached_tokens": cached}

    # Persistence: one file per entry in `directory`, or one file for `generate --prompt-cache-file`.
    def _file(self, entry: Entry) -> Path:
        digest = hashlib.sha256(self.identity.encode() + entry.scope.encode() + entry.tokens.tobytes()).hexdigest()[:24]
        return self.directory / f"{digest}.safetensors"

    def _load_directory(self):
        """Entries of this pair from the directory, oldest first (so the newest are kept); files of another
        pair or format are left alone, unreadable ones skipped."""
        if not self.directory.is_dir():
            return
        for f in sorted(self.directory.glob("*.safetensors"), key=lambda f: f.stat().st_mtime):
            entry = None if f.name.startswith(".") else read_entry(f, self.identity)
            if entry is not None:
                self._entries[(entry.scope, *entry.state.tokens)] = entry
                self.prefill_rate = entry.prefill_rate or self.prefill_rate
        self._evict()

    def save_file(self, path, tokens: list) -> bool:
        """Write the entry a later prompt starting like `tokens` would start from to `path` (atomically),
        as `generate --prompt-cache-file` keeps it between runs. Returns whether there was one."""
        key, _ = self.best(list(tokens) + [-1])  # as if one more token followed: all of `tokens` counts
        if key is None:
            return False
        write_entry(Path(path), self._entries[key], self.identity, self.prefill_rate)
        return True

    def load_file(self, path) -> bool:
        """Take the entry in `path` (written by save_file) if it belongs to this pair. Returns whether it did."""
        entry = read_entry(Path(path), self.identity) if Path(path).is_file() else None
        if entry is not None:
            self._entries[(entry.scope, *entry.state.tokens)] = entry
            self.prefill_rate = self.prefill_rate or entry.prefill_rate
            self._evict()
        return entry is not None


def is_prompt_cache_file(path: Path) -> bool:
    """Whether `path` is a file write_entry wrote (of any pair): its safetensors header's metadata (mlx-lm
    keeps ours under "0.") names FORMAT. Only the header is read."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size < 1 << 24:
                return False
            metadata = json.loads(f.read(size)).get("__metadata__") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return FORMAT in metadata.values()


def check_prompt_cache_file(path) -> None:
    """Refuse, before any work, a `--prompt-cache-file` that cannot be kept: its folder does not exist or
    cannot be written, or it is an existing file that is not a prompt cache (it would be replaced)."""
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise DFlashError(f"--prompt-cache-file {path}: no folder {folder}: create it, or name a file in an "
                          "existing folder")
    if not os.access(folder, os.W_OK):
        raise DFlashError(f"--prompt-cache-file {path}: the folder {folder} is not writable: name a file elsewhere")
    if path.is_file() and path.stat().st_size and not is_prompt_cache_file(path):
        raise DFlashError(f"--prompt-cache-file {path} is a file that is not an mlx-dflash prompt cache, and it "
                          "would be replaced: name a new file (or delete this one)")


def write_entry(path: Path, entry: Entry, identity: str, prefill_rate: Optional[float] = None):
    """One kept state as a safetensors file (mlx-lm's prompt-cache format): the target's cache layers, one
    ArraysCache per drafter layer (keys, values), one per checkpoint (its recurrent arrays, layer by layer),
    and last one holding (tokens, unread feature vectors); the metadata names the pair and keeps the cache's
    prefill rate, so a later process can say what a hit saves."""
    state, points = entry.state, sorted((entry.checkpoints or {}).items())
    holders = []
    for c in state.draft_cache:
        holders.append(ArraysCache(2))
        holders[-1].cache = _drafter_arrays(c)
    for _, point in points:
        holders.append(ArraysCache(0))
        holders[-1].cache = [a for layer in sorted(point) for a in point[layer]]
    holders.append(ArraysCache(2))
    holders[-1].cache = [mx.array(entry.tokens), state.context]
    metadata = {"format": FORMAT, "identity": identity, "scope": entry.scope,
                "target_layers": str(len(state.cache)),
                "drafter_layers": str(len(state.draft_cache)),
                "checkpoints": json.dumps(None if entry.checkpoints is None else
                                          [[p, {str(i): len(a) for i, a in point.items()}] for p, point in points]),
                "prefill_rate": json.dumps(prefill_rate)}
    partial = path.with_name(f".{path.stem}.partial.safetensors")
    try:
        save_prompt_cache(str(partial), list(state.cache) + holders, metadata)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def read_entry(path: Path, identity: str) -> Optional[Entry]:
    """The kept state in `path`, or None if it is unreadable, of another format or of another pair."""
    try:
        layers, metadata = load_prompt_cache(str(path), return_metadata=True)
        if metadata.get("format") != FORMAT or metadata.get("identity") != identity:
            return None
        n, d = int(metadata["target_layers"]), int(metadata["drafter_layers"])
        layout = json.loads(metadata["checkpoints"])
        rate = json.loads(metadata.get("prefill_rate", "null"))
    except Exception:  # a torn or foreign file: never fatal
        return None
    draft_cache = []
    for holder in layers[n : n + d]:
        c = KVCache()
        keys, values = holder.cache
        if keys is not None:
            c.update_and_fetch(keys, values)
        draft_cache.append(c)
    checkpoints = None
    if layout is not None:
        checkpoints = {}
        for (position, counts), holder in zip(layout, layers[n + d : -1]):
            arrays, point = list(holder.cache), {}
            for layer, count in counts.items():
                point[int(layer)], arrays = arrays[:count], arrays[count:]
            checkpoints[position] = point
    tokens, context = layers[-1].cache
    return Entry(np.array(tokens, dtype=np.int32), DecodeState(layers[:n], draft_cache, tokens.tolist(), context),
                 checkpoints, rate if isinstance(rate, (int, float)) and rate > 0 else None,
                 metadata.get("scope", ""))


def rungs(prompt_tokens: int, boundaries=()) -> list:
    """Where a hybrid target's state is checkpointed inside a prompt: the given boundaries (chat message
    ends), every RUNG_EVERY tokens, and one token before the end."""
    marks = set(boundaries) | set(range(RUNG_EVERY, prompt_tokens, RUNG_EVERY)) | {prompt_tokens - 1}
    return sorted(b for b in marks if 0 < b < prompt_tokens)


def read_chunk(target, state: DecodeState, ids: list, stop: int, marks: list, checkpoints: dict,
               step: int, ranks: SingleProcess = SingleProcess()) -> int:
    """Read the prompt `ids` into `state` from where it holds on, to the first of: `step` tokens on, `stop`,
    the next of `marks` (rungs) past it, where the recurrent layers are checkpointed (into `checkpoints`).
    Returns the prompt position read to. The scheduler reads one chunk of a prompt per step, in turn with the
    others (decoding/batch_decoder.py).
    ranks: a sharded target's, whose features a pipeline stage fills only in part (distributed.py)."""
    done = len(state.tokens)
    end = min([done + step, stop] + [m for m in marks if m > done])
    if end > done:
        state.extend(ids[done:end], ranks.whole_features(target.read(mx.array(ids[done:end]), state.cache, step)))
        if end in marks:
            checkpoints[end] = checkpoint(state.cache)
    return end

