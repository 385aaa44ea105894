"""The target adapter: an mlx-lm model seen the way the decoder needs it.

It runs the model's own forward and returns every row's logits together with the outputs of the
decoder layers the drafter listens to (DFlash paper, arXiv 2602.06036, appendix A.3), and rolls the
caches back after a partial acceptance: KV caches are trimmed, recurrent layers of hybrid targets are
rewound exactly (rollback.py).
Capturing works by composition: for the length of one forward call, the chosen entries of the model
instance's layer list are wrapped by recorders and then put back; the verify forward's attention modules
are wrapped the same way to reach our multi-row kernel (verify_attention.py). No mlx-lm class is patched.
"""

from contextlib import contextmanager
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from .batch_cache import RaggedKVCache, RaggedQuantizedKVCache, shorten_rows
from .config import DFlashConfig
from ..errors import DFlashError
from ..machine import prefill_step
from .rollback import find_recurrent, taping
from .tree_verify import keep_paths, leaf_paths, rope_sites, tree_forward
from ..kernels.verify_attention import install_sites, routing


class _Recorder:
    """Stands in for one decoder layer during a forward call and keeps its output."""

    def __init__(self, layer, sink: dict, index: int):
        self._layer, self._sink, self._index = layer, sink, index

    def __call__(self, *args, **kwargs):
        out = self._layer(*args, **kwargs)
        self._sink[self._index] = out[0] if isinstance(out, tuple) else out
        return out

    def __getattr__(self, name):  # the model may read layer attributes (e.g. use_sliding)
        return getattr(self._layer, name)


def _find_inner(model):
    """The module holding `embed_tokens` and `layers` (mlx-lm nests it as model.model or language_model)."""
    for candidate in (model, getattr(model, "model", None), getattr(model, "language_model", None)):
        if candidate is None:
            continue
        if hasattr(candidate, "embed_tokens") and hasattr(candidate, "layers"):
            return candidate
        inner = getattr(candidate, "model", None)
        if inner is not None and hasattr(inner, "embed_tokens") and hasattr(inner, "layers"):
            return inner
    raise DFlashError(
        f"cannot find the embedding table and decoder layers of {type(model).__module__}.{type(model).__name__}; "
        "the target must be an mlx-lm language model"
    )


class Target:
    """An mlx-lm model with hidden-state capture and cache rollback."""

    def __init__(self, model: nn.Module, layer_ids=()):
        self.model = model
        self._recurrent = self._check_rollback()  # [(layer, attribute)] of recurrent modules to rewind
        self._inner = _find_inner(model)
        self.layer_ids = tuple(layer_ids)
        self.wide_kernels = False  # our 6..16-row quantized matmul is installed (Metal only)
        self._attention = ([], "mlx")  # (sites, route) of the verify forward's attention (verify_attention.py)
        self._rope_sites = None  # the RoPE modules a tree forward wraps (tree_verify.py), found at the first one
        self._pending = None  # (cache, rows, tapes) of the last forward, until its trim
        self.kv_quantization = None  # (bits, group_size, start): see quantize_kv
        self.source = None  # the model directory, when loaded from one

    def quantize_kv(self, bits: int, group_size: int = 64, start: int = 0):
        """Store attention keys and values quantized (mlx-lm's QuantizedKVCache) once a cache holds more than
        `start` positions, as mlx-lm's --kv-bits, --kv-group-size and --quantized-kv-start do. Rollback
        stays exact: a quantized cache trims like a plain one. Recurrent state is never quantized."""
        if bits not in (4, 8):
            raise DFlashError(f"--kv-bits must be 4 or 8, got {bits}")
        if group_size not in (32, 64, 128):
            raise DFlashError(f"--kv-group-size must be 32, 64 or 128, got {group_size}")
        if start < 0:
            raise DFlashError(f"--quantized-kv-start must be >= 0, got {start}")
        args = self.text_args
        head_dim = getattr(args, "head_dim", None) or self.hidden_size // args.num_attention_heads
        if head_dim % group_size:
            raise DFlashError(f"--kv-group-size {group_size} does not divide the attention head dim {head_dim} of "
                              "this target: pick a group size that does (32, 64 or 128)")
        self.kv_quantization = (bits, group_size, start)

    def _quantize_due(self, cache: list):
        if self.kv_quantization is None or cache is None:
            return
        bits, group_size, start = self.kv_quantization
        for i, c in enumerate(cache):
            if isinstance(c, KVCache) and c.offset > start:
                cache[i] = c.to_quantized(group_size=group_size, bits=bits)
            elif type(c) is RaggedKVCache and c.max_length > start:  # a batch: its rows together (batch_cache.py)
                cache[i] = RaggedQuantizedKVCache.of(c, group_size, bits)

    def install_wide_kernels(self) -> int:
        """Route 6..16-row quantized matmuls to our Metal kernel. Returns the layers switched (0 off Metal)."""
        from ..kernels.wide_qmm import install_wide_kernels

        count = install_wide_kernels(self.model)
        self.wide_kernels = self.wide_kernels or count > 0
        return count

    def install_attention_kernel(self, route: str | None = None) -> int:
        """Route the verify forward's attention (2..16 query rows) to our Metal kernel where the race gate
        finds it faster. route: auto / dflash / mlx (default: env MLX_DFLASH_ATTENTION_KERNEL, else auto).
        Returns the attention modules routed (0 off Metal or for "mlx")."""
        self._attention = install_sites(self._inner.layers, route)
        return len(self._attention[0])

    @property
    def attention_routing(self) -> tuple[int, str]:
        """(attention modules the verify forward routes to our kernel, route: auto / dflash / mlx)."""
        return len(self._attention[0]), self._attention[1]

    # What the drafter borrows.
    @property
    def embed_tokens(self):
        return self._inner.embed_tokens

    @property
    def output_head(self):
        head = self._head_module()
        return head.as_linear if head is self._inner.embed_tokens else head

    def output_head_rows(self, ids: mx.array):
        """A head computing only the logits of tokens `ids` (a drafter's draft vocabulary): those rows of
        the output head's weights, copied once, so a call reads len(ids) rows instead of the whole table.
        None when the head is not a plain (quantized) linear or tied embedding."""
        head = self._head_module()
        quantized = isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        if not quantized and type(head) not in (nn.Linear, nn.Embedding):
            return None
        rows = {k: head[k][ids] for k in ("weight", "scales", "biases", "bias") if k in head}
        mx.eval(rows)
        bias = rows.get("bias")

        def head_rows(x):
            if quantized:
                out = mx.quantized_matmul(x, rows["weight"], scales=rows["scales"], biases=rows.get("biases"),
                                          transpose=True, group_size=head.group_size, bits=head.bits, mode=head.mode)
            else:
                out = x @ rows["weight"].T
            return out if bias is None else out + bias

        return head_rows

    def _head_module(self):
        head = getattr(self.model, "lm_head", None)
        if head is None:
            head = getattr(getattr(self.model, "language_model", None), "lm_head", None)
        return head if head is not None else self._inner.embed_tokens

    @property
    def activation_dtype(self) -> mx.Dtype:
        """The dtype of the hidden states (the embedding's output)."""
        return self.embed_tokens(mx.array([0])).dtype

    @property
    def text_args(self):
        """The language model's configuration (multimodal wrappers nest it under language_model)."""
        return getattr(getattr(self.model, "language_model", None), "args", None) or self.model.args

    @property
    def context_length(self) -> Optional[int]:
        """The positions the model was trained for (max_position_embeddings), None when it does not say."""
        args = self.text_args
        return getattr(args, "max_position_embeddings", None) or getattr(args, "max_seq_len", None)

    @property
    def num_layers(self) -> int:
        return len(self._inner.layers)

    @property
    def vocab_size(self) -> int:
        emb = self._inner.embed_tokens
        return getattr(emb, "num_embeddings", None) or emb.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        emb = self._inner.embed_tokens
        return getattr(emb, "dims", None) or emb.weight.shape[1]

    def check_drafter(self, config: DFlashConfig):
        """Refuse a drafter that was not made for this target, naming both values."""
        if config.hidden_size != self.hidden_size:
            raise DFlashError(
                f"drafter hidden_size {config.hidden_size} != target hidden size {self.hidden_size}: "
                "this drafter was trained for a different target model"
            )
        if config.vocab_size != self.vocab_size:
            raise DFlashError(
                f"drafter vocab_size {config.vocab_size} != target vocabulary {self.vocab_size}: "
                "this drafter was trained for a different target model"
            )
        if not 0 <= config.mask_token_id < self.vocab_size:
            raise DFlashError(
                f"drafter mask_token_id {config.mask_token_id} is outside the target embedding table "
                f"(0..{self.vocab_size - 1})"
            )
        bad = [i for i in config.target_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise DFlashError(
                f"drafter target_layer_ids {list(config.target_layer_ids)} reach layer {bad[0]}, but the "
                f"target has {self.num_layers} layers (0..{self.num_layers - 1})"
            )

    def capture(self, layer_ids):
        """From now on, every forward returns these decoder layers' outputs as its features."""
        self.layer_ids = tuple(layer_ids)

    # Caches.
    def make_cache(self) -> list:
        """The model's own cache, with sliding-window rings replaced by plain KV caches.

        A ring buffer cannot give back positions it has overwritten, and mlx-lm passes the window to
        the attention mask for sliding layers, so a plain cache gives the same outputs and stays
        trimmable (at the cost of keeping the whole context).
        """
        cache = make_prompt_cache(self.model)
        return [KVCache() if isinstance(c, RotatingKVCache) else c for c in cache]

    def _check_rollback(self) -> list:
        """Where the recurrent modules are; refuses, in one line, state that cannot be rolled back."""
        kind = getattr(self.model, "model_type", type(self.model).__name__)
        sites = []
        for i, c in enumerate(self.make_cache()):
            if not c.is_trimmable():
                layer = self.model.layers[i]
                sites.append((layer, find_recurrent(layer, i, c, kind)))
        return sites

    @property
    def trimmable(self) -> bool:
        """Whether a cache of this target trims to any shorter prefix (no recurrent layers)."""
        return not self._recurrent

    def trim(self, cache: list, n: int):
        """Forget the last n positions (rejected drafts) of the last forward on this cache."""
        pending, self._pending = self._pending, None
        if n <= 0:
            return
        if not self._recurrent:
            for c in cache:
                c.trim(n)
            return
        if pending is None or pending[0] is not cache or n > pending[1]:
            raise DFlashError(
                f"cannot roll back {n} positions: a hybrid target rewinds only the rows of its last forward"
            )
        _, rows, tapes = pending
        for c in cache:
            if c.is_trimmable():
                c.trim(n)
        mx.eval([tape.rewind(rows - n) for tape in tapes])  # frees the round's tapes now

    def trim_rows(self, cache: list, drop: list):
        """Forget the last drop[b] positions of row b's last forward, in a batch's cache (models/batch_cache.py:
        what every request decodes on; `trim` rolls back one sequence's own cache)."""
        pending, self._pending = self._pending, None
        if not any(drop):  # a plain step's: nothing to roll back
            return
        shorten_rows(cache, drop)
        if self._recurrent:
            if pending is None or pending[0] is not cache:
                raise DFlashError("a hybrid target rewinds only the rows of its last forward")
            _, rows, tapes = pending
            mx.eval([tape.rewind([rows - d for d in drop]) for tape in tapes])

    # Forward passes.
    @contextmanager
    def _recording(self):
        layers = self._inner.layers
        # A pipeline stage holds only some layers (the others are None or cut off): record those it runs.
        held = [i for i in self.layer_ids if i < len(layers) and layers[i] is not None]
        sink, originals = {}, {i: layers[i] for i in held}
        try:
            for i, layer in originals.items():
                layers[i] = _Recorder(layer, sink, i)
            yield sink
        finally:
            for i, layer in originals.items():
                layers[i] = layer

    def forward(self, ids: mx.array, cache: list, tree=None):
        """Run ids [B, L] through the model. Returns (logits [B, L, V], features [B, L, n*H]).

        Features are the captured layer outputs concatenated in `layer_ids` order, the order the
        drafter's `fc` expects (n = 0 where none is captured). On a hybrid target the call is taped, so that
        `trim` / `trim_rows` can rewind it; after `install_attention_kernel`, its attention runs through our
        multi-row kernel where that is faster.
        tree: when ids are draft trees' nodes, their shape (decoding/tree.py `TreeBlock`: depth [B, L], ancestors
        [B, L, L], alive [B, L], on the host): each node at its own position, seeing its ancestors only (through a
        recurrent layer: from its parent's state; tree_verify.py). Afterwards `keep_paths` says which nodes stay.
        """
        sites = self._recurrent if cache is not None else []
        # the tree's RoPE wrappers go in before the attention modules are routed: routing puts a stand-in in
        # each module's place, under which the tree would not find the module's RoPE
        with taping(sites) as tapes, self._tree(cache, tree, tapes) as view, routing(*self._attention):
            logits, features = self._run(ids, view)
        self._pending = (cache, ids.shape[1], tapes) if tapes else None
        self._quantize_due(cache)
        return logits, features

    @contextmanager
    def _tree(self, cache: list, tree, tapes: list):
        if tree is None:
            yield cache
            return
        if self._rope_sites is None:  # found once: a walk over every module costs milliseconds a round
            self._rope_sites = rope_sites(self._inner.layers)
        if tapes:  # a hybrid target's recurrent layers run the trees' paths (rollback.py)
            paths = leaf_paths(tree.depth, tree.ancestors, tree.alive)
            for tape in tapes:
                tape.paths = paths
        with tree_forward(self._rope_sites, cache, mx.array(tree.depth, mx.int32), mx.array(tree.ancestors)) as view:
            yield view

    def keep_paths(self, cache: list, paths: list, nodes: int):
        """After a tree forward of `nodes` nodes a row: row b's path of nodes paths[b] moves to follow its
        context (tree_verify.py); trim_rows then drops the rest."""
        for tape in self._pending[2] if self._pending is not None else ():
            tape.keep_path([p[-1] for p in paths])
        keep_paths(cache, paths, nodes)

    def _run(self, ids: mx.array, cache: list):
        with self._recording() as sink:
            logits = self.model(ids, cache=cache)
        if not self.layer_ids:  # nothing captured (a target without a drafter): zero-width features
            return logits, mx.zeros((*ids.shape, 0), logits.dtype)
        return logits, mx.concatenate([sink[i] for i in self.layer_ids], axis=-1)

    def read(self, ids: mx.array, cache: list, step: Optional[int] = None, progress=None, total: int = 0):
        """Run tokens ids [P] into the cache in chunks of `step` (default: the machine's,
        `machine.prefill_step`), without the output head. Returns their features [1, P, n*H] (None for P = 0).
        Nothing is taped: a prompt is never rolled back. progress(processed, total) is called after each chunk."""
        step = step or prefill_step()
        features = []
        for i in range(0, ids.size, step):
            _, f = self._run(ids[None, i : i + step], cache)
            mx.eval(f, [c.state for c in cache])  # logits stay unevaluated: the head never runs here
            self._quantize_due(cache)
            features.append(f)
            if progress is not None:
                progress(min(i + step, ids.size), total or ids.size)
        return mx.concatenate(features, axis=1) if features and features[0] is not None else None

    def prefill(self, prompt: mx.array, cache: list, step: Optional[int] = None, progress=None):
        """Process the prompt [P] in chunks. Returns (last-row logits [V], features [1, P, n*H]).

        The last token runs on its own, as mlx-lm's generate does: the output head is computed for one
        row only, and the cache holds exactly what plain mlx-lm decoding would hold."""
        head = self.read(prompt[:-1], cache, step, progress, prompt.size)
        logits, last = self._run(prompt[None, -1:], cache)
        self._quantize_due(cache)
        features = last if head is None or last is None else mx.concatenate([head, last], axis=1)
        return logits[0, -1], features
