"""Exact rollback of recurrent (GatedDeltaNet) state in hybrid targets: Qwen3.5/3.6, Qwen3-Next.

Their linear-attention layers keep a conv state (the last K-1 inputs of a depthwise conv) and a
recurrent state S [B, Hv, Dv, Dk] in an `ArraysCache`; neither can be trimmed, and the recurrence
cannot be run backwards stably (it would divide by the decay and by 1 - beta). After a verify of L
rows of which the target keeps `keep`, each such layer must hold what plain decoding of those `keep`
tokens would leave.

Design: record during the verify, recompute the accepted prefix's state in closed form at the trim.
- `Target.forward` swaps each linear-attention module's child modules (projections, depthwise conv,
  gated norm, output projection) for recorders, for the length of that one call. The module's own
  code runs unchanged; the recorders keep what its children were given and returned: arrays the
  verify computes anyway. The cache before the call is kept by reference (MLX arrays are immutable,
  so this snapshot costs nothing).
- `Target.trim(cache, n)` leaves each layer as plain decoding of the first `keep = L - n` rows would:
  the conv state is rows keep..keep+K-2 of the conv's recorded input (snapshot rows, then new rows);
  the recurrent state is the snapshot advanced over the kept steps by `delta_rule_state`, from the
  recorded conv output (k, v) and projections (the gates a, b).
- `delta_rule_state` is the gated delta rule S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T
  summed in closed form over the kept steps (the chunked "WY" form used by chunked GDN kernels): one
  T x T unit-triangular solve per head (by doubling: log2 T small products) and two matmuls that each
  read S once, instead of T sequential passes over S (what replaying `gated_delta_update` on the prefix
  costs). Decays enter only as ratios exp(L_t - L_j) <= 1, so strong decay cannot overflow.
- `python bench/rollback.py` measures each rewind against the verify at every width (the longest,
  keep w - 1, is the dearest).
- Full acceptance needs nothing (the records are dropped); dropping a whole forward (keep 0, as the
  width probe does) restores the snapshot.
- A draft tree (models/tree_verify.py): a recurrent layer reads one sequence in order, so the tape runs the
  module over every path from the anchor to a leaf, each path a batch row of its own from the row's state
  (`LeafPaths`; a node on several paths runs once for each), and gives each node the output of a path holding
  it. Once the walk has ended, `keep_path` keeps the records of a path through the node it ended at, and the
  rewind reads them as a chain's.
- Nothing is patched: only attributes of this model instance are swapped, and put back at once.
  What this module knows of mlx-lm's layer: the conv output splits into q, k, v as [key_dim,
  key_dim, value_dim]; k is normalised by `normalize_qk`; the gates come from the a/b projections
  (qwen3_next interleaves them, undone by the module's own `fix_query_key_value_ordering`);
  log g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b). tests/test_families.py checks every
  array against plain decoding, so a change upstream fails loudly rather than silently.
- Memory: the records hold one round's arrays (L rows per child, one state per layer) and are freed
  by the trim (or the next forward). They never grow with the context. A tree round holds, until
  `keep_path`, rows x paths x (depth + 1) steps per child and one state per path.

The designs not taken: re-running the whole target on the accepted prefix (a second forward); re-running
each layer's recurrence with `gated_delta_update` from the snapshot (z-lab's dflash/model_mlx.py in
dflash 0.1.0, ARahim3/mlx-dspark: simple, but a sequential pass per kept step); an innovation tape written
by a custom verify kernel and replayed (bstnxbt/dflash-mlx 0.1.8, `recurrent_rollback_cache.py` and the
`tape_replay` kernel: fast, but a kernel per mlx-lm code path and patched classes).
"""

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import normalize_qk

from ..errors import DFlashError


def _gates_qwen3_5(module, outputs):
    return outputs["in_proj_a"], outputs["in_proj_b"]


def _gates_qwen3_next(module, outputs):
    *_, b, a = module.fix_query_key_value_ordering(outputs["in_proj_qkvz"], outputs["in_proj_ba"])
    return a, b


# The recurrent layer types whose rollback is tested, by mlx-lm module and class: where their gates come from.
SUPPORTED = {
    ("mlx_lm.models.qwen3_5", "GatedDeltaNet"): _gates_qwen3_5,  # qwen3_5, qwen3_5_moe (Qwen3.5, Qwen3.6)
    ("mlx_lm.models.qwen3_next", "Qwen3NextGatedDeltaNet"): _gates_qwen3_next,  # Qwen3-Next, Qwen3-Coder-Next
}


def _kind(module) -> tuple:
    return type(module).__module__, type(module).__name__


def _child_modules(module: nn.Module) -> dict:
    return {name: child for name, child in module.items() if isinstance(child, nn.Module)}


def delta_rule_state(state, k, v, log_g, beta):
    """S after T steps of S <- g S + beta (v - g S k) k^T, in closed form.

    state [B, Hv, Dv, Dk] float32; k [B, T, Hk, Dk] (normalised); v [B, T, Hv, Dv]; log_g, beta [B, T, Hv].
    With L_t = sum_{s<=t} log g_s and u_t = beta_t (v_t - g_t S_{t-1} k_t), the state is
    S_T = e^{L_T} S_0 + sum_t e^{L_T - L_t} u_t k_t^T, and the u solve (I + N) U = beta (V - e^L K S_0^T)
    with N_tj = beta_t e^{L_t - L_j} (k_t . k_j) for j < t (strictly lower, so (I + N)^-1 =
    (I - N)(I + N^2)(I + N^4)...).
    """
    _, T, Hk, _ = k.shape
    Hv = v.shape[2]
    if Hv != Hk:
        k = mx.repeat(k, Hv // Hk, axis=2)  # value head h reads key head h // (Hv / Hk)
    k = k.astype(mx.float32).transpose(0, 2, 1, 3)  # [B, Hv, T, Dk]
    v = v.astype(mx.float32).transpose(0, 2, 1, 3)  # [B, Hv, T, Dv]
    L = mx.cumsum(log_g.astype(mx.float32).transpose(0, 2, 1), axis=-1)  # [B, Hv, T]
    beta = beta.astype(mx.float32).transpose(0, 2, 1)
    below = mx.tril(mx.ones((T, T), dtype=mx.bool_), k=-1)
    decay = mx.where(below, mx.exp(mx.where(below, L[..., :, None] - L[..., None, :], 0.0)), 0.0)
    n = beta[..., None] * decay * (k @ k.swapaxes(-1, -2))
    u = beta[..., None] * (v - mx.exp(L)[..., None] * (k @ state.swapaxes(-1, -2)))
    u = u - n @ u
    power, span = n @ n, 2
    while span < T:
        u = u + power @ u
        power, span = power @ power, span * 2
    tail = mx.exp(L[..., -1:] - L)[..., None]  # e^{L_T - L_t}
    return mx.exp(L[..., -1])[..., None, None] * state + (u * tail).swapaxes(-1, -2) @ k


class _ChildRecorder:
    """Stands in for one child module during the verify call and keeps (first argument, output)."""

    def __init__(self, child, sink: dict, name: str):
        self._child, self._sink, self._name = child, sink, name

    def __call__(self, x, *args, **kwargs):
        out = self._child(x, *args, **kwargs)
        self._sink[self._name] = (x, out)
        return out

    def __getattr__(self, name):
        return getattr(self._child, name)


class RecurrentTape:
    """What one linear-attention module saw and did in one verify call, and how to rewind its cache."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.cache = self.snapshot = self.mask = None
        self.records = {}
        self.paths = None  # a tree forward's paths (tree_verify.py `LeafPaths`), until `keep_path`
        self.path_cache = None  # the cache the module left after running them, a path a batch row

    def __call__(self, x, mask=None, cache=None):
        if cache is not None:
            self.cache, self.mask = cache, mask
            self.snapshot = (list(cache.cache), cache.left_padding, cache.lengths)
        children = _child_modules(self.module)
        try:
            for name, child in children.items():
                self.module[name] = _ChildRecorder(child, self.records, name)
            return self.module(x, mask, cache) if self.paths is None else self._tree(x, mask, cache)
        finally:
            for name, child in children.items():
                self.module[name] = child

    def _tree(self, x, mask, cache):
        """x [B, N, C]: tree nodes. The module runs each row's paths to its leaves from the row's state; returns
        each node's output. The cache takes the state of the path each row kept at `keep_path` (which a rewind
        requires)."""
        if mask is not None or cache.lengths is not None:
            raise DFlashError("a padded batch of a hybrid target cannot verify draft trees; verify chains (--no-tree)")
        (B, _, C), (_, P, T) = x.shape, self.paths.nodes.shape
        flat = mx.array(self.paths.nodes.reshape(B, P * T))
        rows = mx.take_along_axis(x, flat[..., None], axis=1).reshape(B * P, T, C)
        self.path_cache = ArraysCache(len(cache.cache))
        self.path_cache.cache = [None if c is None else mx.repeat(c, P, axis=0) for c in cache.cache]
        out = self.module(rows, None, self.path_cache)
        at = mx.array(self.paths.path * T + self.paths.step)
        return mx.take_along_axis(out.reshape(B, P * T, -1), at[..., None], axis=1)

    def keep_path(self, ends: list):
        """After a tree forward: row b keeps the path from its anchor to node ends[b]. The records and the cache
        become those of a path through it, which the rewind then reads as a chain's."""
        if self.paths is None:
            return
        P = self.paths.nodes.shape[1]
        rows = mx.array([b * P + int(self.paths.path[b, n]) for b, n in enumerate(ends)])
        self.records = {name: (x[rows], out[rows]) for name, (x, out) in self.records.items()}
        self.cache.cache = [None if c is None else c[rows] for c in self.path_cache.cache]
        self.paths = self.path_cache = None

    def rewind(self, keep) -> list:
        """Leave the cache as plain decoding of the first `keep` rows would: one count for the whole batch,
        or a list of counts, one per batch row (rows of a batch keep different numbers of tokens; steps
        past a row's count then pass through with no decay and no update). Returns the new arrays."""
        cache, module = self.cache, self.module
        if self.paths is not None:
            raise DFlashError("a tree forward's kept paths must be given (keep_paths) before it is rolled back")
        if self.mask is not None or self.snapshot[2] is not None:
            raise DFlashError("rolling back a padded batch of a hybrid target is not supported (batch size 1 only)")
        after = cache.cache[1]  # the forward's own state: rows that keep every step keep it, bit for bit
        (conv, state), cache.left_padding, cache.lengths = self.snapshot
        conv_in, conv_out = self.records.get("conv1d", (None, None))
        keeps = [keep] * conv_in.shape[0] if isinstance(keep, int) and conv_in is not None else keep
        steps = max(keeps) if conv_in is not None else 0
        if steps > 0:
            window = mx.array(keeps, mx.int32)[:, None] + mx.arange(module.conv_kernel_size - 1)  # [B, K-1]
            conv = mx.take_along_axis(conv_in, window[..., None], axis=1)
            a, b = SUPPORTED[_kind(module)](module, {n: out[:, :steps] for n, (_, out) in self.records.items()})
            B, T = a.shape[:2]
            qkv = nn.silu(conv_out[:, :steps])
            q, k, v = mx.split(qkv, [module.key_dim, 2 * module.key_dim], axis=-1)
            q = q.reshape(B, T, module.num_k_heads, module.head_k_dim)
            k = k.reshape(B, T, module.num_k_heads, module.head_k_dim)
            v = v.reshape(B, T, module.num_v_heads, module.head_v_dim)
            _, k = normalize_qk(q, k, inv_scale=module.head_k_dim**-0.5, eps=1e-6)
            if state is None:  # the forward started from an empty cache
                state = mx.zeros((B, module.num_v_heads, module.head_v_dim, module.head_k_dim), mx.float32)
            log_g = -mx.exp(module.A_log.astype(mx.float32)) * nn.softplus(a + module.dt_bias)
            beta = mx.sigmoid(b)
            if min(keeps) < steps:  # a row's steps past its count: g = 1, beta = 0 leave its state alone
                taken = (mx.arange(T)[None] < mx.array(keeps)[:, None])[..., None]
                log_g, beta = mx.where(taken, log_g, 0.0), mx.where(taken, beta, 0.0)
            state = delta_rule_state(state, k, v, log_g, beta).astype(state.dtype)
            rows = conv_in.shape[1] - (module.conv_kernel_size - 1)
            if rows in keeps:
                whole = mx.array([n == rows for n in keeps])[:, None, None, None]
                state = mx.where(whole, after, state)
        cache.cache = [conv, state]
        self.release()
        return cache.cache

    def release(self):
        self.cache = self.snapshot = self.mask = self.paths = self.path_cache = None
        self.records = {}


def find_recurrent(layer, index: int, cache_entry, kind: str):
    """The attribute name of the supported recurrent module in `layer`, or a one-line refusal."""
    children = _child_modules(layer)
    for name, child in children.items():
        if _kind(child) in SUPPORTED:
            return name
    parts = ", ".join(sorted({type(c).__name__ for c in children.values()}))
    supported = " or ".join(sorted(cls for _, cls in SUPPORTED))
    raise DFlashError(
        f"target '{kind}' keeps state that cannot be rolled back (layer {index}, {type(layer).__name__} of {parts}, "
        f"in an {type(cache_entry).__name__}); mlx-dflash rewinds recurrent layers of type {supported} "
        "(qwen3_5, qwen3_5_moe, qwen3_next) and trims KV caches, nothing else"
    )


@contextmanager
def taping(sites: list):
    """Tapes on the recurrent modules at `sites` ([(layer, attribute name)]) for one call; yields them."""
    tapes = [RecurrentTape(layer[name]) for layer, name in sites]
    try:
        for (layer, name), tape in zip(sites, tapes):
            layer[name] = tape
        yield tapes
    finally:
        for (layer, name), tape in zip(sites, tapes):
            layer[name] = tape.module
