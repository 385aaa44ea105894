"""The DFlash drafter (v1) in MLX: a few Qwen3-style layers fed by the target's hidden states.

Module and parameter names mirror the published checkpoints exactly (z-lab/dflash `dflash/model.py`,
`DFlashDraftModel`), so a z-lab drafter directory loads strictly. The drafter owns no embedding table and
no output head: `bind` borrows the target's. Its input is a block `[anchor, MASK, ..., MASK]`; the target
features of the committed context enter every layer as extra keys and values ("KV injection", DFlash paper,
arXiv 2602.06036, section 3.2), and only those context keys/values are cached, so a rejected draft needs
no rollback here.

`draft` is what the decoder calls (`base.DraftModel`): one pass over the block, returning the drafted
tokens, the drafter's confidence in each, and (when the drafts were sampled) the proposal distribution
that rejection sampling needs. DFlash 2 (`dflash2.py`) extends this class.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import DFlashError
from .base import TREE_CANDIDATES, Draft
from .batch_cache import is_ragged
from .config import DFlashConfig

# Keys some early uploads carried; the drafter uses the target's embedding and head instead.
BORROWED_KEYS = ("embed_tokens.weight", "lm_head.weight")
# An optional draft vocabulary (tuner/draft_vocab.py): the token ids the drafter may propose, stored
# beside the weights; config.json's `draft_vocab` gives its size.
DRAFT_VOCAB_KEY = "draft_vocab_ids"


@dataclass
class Borrowed:
    embed: Callable  # token ids -> embeddings (the target's table, mask row included)
    head: Callable  # hidden -> logits (the target's head, tied or not, quantized or not)
    embed_scale: float
    head_rows: Optional[Callable] = None  # token ids -> a head computing only those ids' logits
    draft_head: Optional[Callable] = None  # head_rows(the draft vocabulary), when there is one


class Attention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        dim, hd = config.hidden_size, config.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.scale = hd**-0.5
        self.is_causal = config.layer_is_causal(layer_idx)
        self.window = config.layer_window(layer_idx)
        self.context_window: Optional[int] = None  # a run-time choice (DFlashDraftModel.set_context_window)
        bias = config.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)

    def _heads(self, x, n, norm=None):
        B, L, _ = x.shape
        x = x.reshape(B, L, n, -1)
        if norm is not None:
            x = norm(x)
        return x.transpose(0, 2, 1, 3)

    def __call__(self, x, h_ctx, rope, cache: KVCache, block_start=None):
        """x: normed block [B, L, H]; h_ctx: new context vectors [1 or B, S, H] at positions cache.offset..

        block_start: absolute position of block position 0, by default right after the context. Training
        passes an array [B], one anchor per batch row, and the whole context at once; each block then
        sees only the context strictly before its anchor.
        """
        B, L, _ = x.shape
        S = h_ctx.shape[1]
        q = self._heads(self.q_proj(x), self.n_heads, self.q_norm)
        k_blk = self._heads(self.k_proj(x), self.n_kv_heads, self.k_norm)
        v_blk = self._heads(self.v_proj(x), self.n_kv_heads)

        # Absolute positions: context vectors continue the cache, the block follows the context.
        if block_start is None:
            block_start = cache.offset + S
        q = rope(q, offset=block_start)
        k_blk = rope(k_blk, offset=block_start)
        k_ctx, v_ctx = self.read_context(h_ctx, rope, cache)
        ctx_start = 0
        if self.context_window and not isinstance(block_start, mx.array):  # one block: drop what it cannot see
            ctx_start = max(0, k_ctx.shape[2] - self.context_window)
            k_ctx, v_ctx = k_ctx[:, :, ctx_start:], v_ctx[:, :, ctx_start:]
        if k_ctx.shape[0] != B:
            k_ctx = mx.broadcast_to(k_ctx, (B, *k_ctx.shape[1:]))
            v_ctx = mx.broadcast_to(v_ctx, (B, *v_ctx.shape[1:]))
        keys = mx.concatenate([k_ctx, k_blk], axis=2)
        values = mx.concatenate([v_ctx, v_blk], axis=2)

        mask = self._mask(L, k_ctx.shape[2], block_start, ctx_start)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def read_context(self, h_ctx, rope, cache: KVCache) -> tuple:
        """Context rows [1 or B, S, H] into the cache (only context is ever cached); returns every cached
        context key and value."""
        k_ctx = rope(self._heads(self.k_proj(h_ctx), self.n_kv_heads, self.k_norm), offset=cache.offset)
        return cache.update_and_fetch(k_ctx, self._heads(self.v_proj(h_ctx), self.n_kv_heads))

    def _mask(self, L: int, ctx_len: int, block_start, ctx_start: int = 0):
        """Who each block position sees, from absolute positions (the masks of `_attention_mask` in z-lab's
        dflash/model.py, dflash 0.1.0).

        Context (positions ctx_start..): rows before the block start, within the window if any, and
        within the last `context_window` positions before the block if that is set. Block: every row of
        its own block, or only earlier ones in causal layers.
        """
        per_row_start = isinstance(block_start, mx.array)
        if not (self.is_causal or self.window or per_row_start):
            return None  # inference, full attention: everything is visible
        start = block_start.reshape(-1, 1, 1, 1) if per_row_start else mx.array(block_start)
        query = start + mx.arange(L)[:, None]  # [.., L, 1]
        ctx_pos = ctx_start + mx.arange(ctx_len)[None]
        blk_pos = start + mx.arange(L)[None]  # [.., 1, L]
        ctx_visible = ctx_pos < start
        if self.context_window:
            ctx_visible = ctx_visible & (ctx_pos >= start - self.context_window)
        blk_visible = mx.ones((L, L), dtype=mx.bool_)
        if self.is_causal:
            blk_visible = blk_pos <= query
        if self.window:
            ctx_visible = ctx_visible & (query - ctx_pos < self.window)
            blk_visible = blk_visible & (mx.abs(query - blk_pos) < self.window)
        shape = (*query.shape[:-1], ctx_len)
        ctx_visible = mx.broadcast_to(ctx_visible, shape)
        blk_visible = mx.broadcast_to(blk_visible, (*query.shape[:-1], L))
        return mx.concatenate([ctx_visible, blk_visible], axis=-1)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, h, h_ctx, rope, cache, block_start=None):
        h = h + self.self_attn(self.input_layernorm(h), h_ctx, rope, cache, block_start)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    layer_class = DecoderLayer

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [self.layer_class(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Its own RoPE, from its own config (not the target's), NeoX layout.
        self._rope = initialize_rope(
            config.head_dim,
            base=config.rope_theta,
            traditional=False,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )
        # Borrowed from the target by bind(). A plain object, so the target's modules never join the
        # drafter's module tree (saving, quantizing or training the drafter leaves them alone).
        self._borrowed: Optional[Borrowed] = None
        self._draft_vocab: Optional[mx.array] = None  # token ids the drafts come from (None: all)
        self.source = None  # the checkpoint directory, when loaded from one

    @property
    def draft_vocab(self) -> Optional[mx.array]:
        return self._draft_vocab

    def set_draft_vocab(self, ids, where: str = "the draft vocabulary"):
        """Draft only over these token ids (None: the whole vocabulary). The target still verifies against
        its full vocabulary, so this changes speed and acceptance, never the output."""
        if ids is not None:
            ids = check_draft_vocab(ids, self.config.vocab_size, where)
        self._draft_vocab = ids
        if self._borrowed is not None:
            self._borrowed.draft_head = None if ids is None else self._head_rows(ids)

    def _head_rows(self, ids: mx.array) -> Callable:
        rows = self._borrowed.head_rows(ids) if self._borrowed.head_rows is not None else None
        if rows is not None:
            return rows
        head = self._borrowed.head  # a head that cannot be sliced: the whole head, then the columns
        return lambda hidden: mx.take(head(hidden), ids, axis=-1)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def is_bound(self) -> bool:
        return self._borrowed is not None

    def bind(self, target) -> "DFlashDraftModel":
        """Borrow the target's embedding and output head, after checking the pair fits; the target then
        captures the layers this drafter listens to."""
        target.check_drafter(self.config)
        target.capture(self.config.target_layer_ids)
        # The raw table times input_embedding_scale, as z-lab's PyTorch drafter embeds the block
        # (dflash/model.py in dflash 0.1.0: F.embedding(ids, target table) * input_embedding_scale).
        scale = self.config.input_embedding_scale
        self._borrowed = Borrowed(target.embed_tokens, target.output_head, scale, target.output_head_rows)
        self.set_draft_vocab(self._draft_vocab)
        self._widen_to(target.activation_dtype)
        return self

    def _widen_to(self, dtype: mx.Dtype):
        """Float32 activations meeting bfloat16/float16 weights promote those weights on every call; cast
        them once instead (the same numbers, without the per-call conversion). Quantized drafters keep
        their dtypes."""
        if dtype != mx.float32 or any(isinstance(m, nn.QuantizedLinear) for _, m in self.named_modules()):
            return
        if any(v.dtype in (mx.bfloat16, mx.float16) for _, v in tree_flatten(self.parameters())):
            self.set_dtype(mx.float32)
            mx.eval(self.parameters())

    def set_context_window(self, positions: Optional[int]) -> "DFlashDraftModel":
        """Attend to the last `positions` context vectors before each block only (None: to all of them): a
        bound on the drafter's attention over a long context, which it was not trained with."""
        if positions is not None and positions < 1:
            raise DFlashError(f"the drafter's context window must be 1 or more positions, not {positions}")
        for layer in self.layers:
            layer.self_attn.context_window = positions
        return self

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def hidden(self, block_ids: mx.array, context: mx.array, cache: list, block_start=None) -> mx.array:
        """Final-norm hidden states of the block. block_ids [B, L]; context [1 or B, S, n_tgt*H], new feature vectors
        only. block_start: see Attention (training gives one anchor position per batch row)."""
        if self._borrowed is None:
            raise DFlashError("the drafter is not bound to a target: call drafter.bind(target) first")
        h = self._borrowed.embed(block_ids) * self._borrowed.embed_scale
        h_ctx = self.hidden_norm(self.fc(context))  # once per call, shared by every layer
        for layer, c in zip(self.layers, cache):
            h = layer(h, h_ctx, self._rope, c, block_start)
        return self.norm(h)

    def read_context(self, context: mx.array, cache: list):
        """Take target feature vectors [1, S, F] into the cache without drafting (a prompt's, as it is read)."""
        h_ctx = self.hidden_norm(self.fc(context))
        for layer, c in zip(self.layers, cache):
            layer.self_attn.read_context(h_ctx, self._rope, c)
        mx.eval([c.state for c in cache])

    def logits(self, hidden: mx.array) -> mx.array:
        return self._transform(self._borrowed.head(hidden))

    def draft_logits(self, hidden: mx.array) -> mx.array:
        """Logits over the draft vocabulary (column i is token draft_vocab[i]); the whole vocabulary
        without one. Only the rows of the target's head that can be drafted are read."""
        if self._borrowed.draft_head is None:
            return self.logits(hidden)
        return self._transform(self._borrowed.draft_head(hidden))

    def draft_tokens(self, draft_logits: mx.array) -> mx.array:
        """The argmax token ids of draft logits."""
        best = mx.argmax(draft_logits, axis=-1)
        return best if self._draft_vocab is None else self._draft_vocab[best]

    def _transform(self, out: mx.array) -> mx.array:
        out = out * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            out = mx.tanh(out / cap) * cap
        return out

    def __call__(self, block_ids: mx.array, context: mx.array, cache: list) -> mx.array:
        """Draft logits for block positions 1..L-1 (row j proposes the token at block position j)."""
        return self.logits(self.hidden(block_ids, context, cache)[:, 1:])

    def batch_hidden(self, anchors: list, contexts: list, cache: list, block_size: int, width: int) -> mx.array:
        """Final-norm hidden states 1..width-1 of B blocks in one pass, one block per batch row: row b drafts
        after anchors[b], reading its new context vectors contexts[b] ([1, c_b, F] or None) into its row of the
        batch cache (RaggedKVCache layers, models/batch_cache.py); the rows are padded to the longest, and the
        padding never enters a row's length."""
        counts = [0 if c is None else c.shape[1] for c in contexts]
        width_f = next(c.shape[-1] for c in contexts if c is not None) if any(counts) else self.fc.weight.shape[1]
        rows = [mx.zeros((1, max(counts), width_f), self.fc.weight.dtype) if c is None else
                mx.pad(c, [(0, 0), (0, max(counts) - c.shape[1]), (0, 0)]) for c in contexts]
        before = list(cache[0].sizes)
        starts = [n + c for n, c in zip(before, counts)]
        block = mx.array([[a] + [self.mask_token_id] * (block_size - 1) for a in anchors])
        # one row is one request: its block start as one number, so no mask is built (as on its own cache)
        start = starts[0] if len(starts) == 1 else mx.array(starts)
        hidden = self.hidden(block, mx.concatenate(rows), cache, block_start=start)
        for c in cache:
            c.shorten(starts)  # each row's own new context, not the padding
        return hidden[:, 1:width]

    def draft(self, anchors: list, contexts: list, cache: list, block_size: int, width: int, samplings,
              keys=None) -> Draft:
        """Drafts of B rows from one pass over [anchor, MASK * (block_size - 1)] each (models/base.py
        `DraftModel.draft`): on one request's cache (B = 1) or a batch's (`batch_hidden`)."""
        if is_ragged(cache):
            hidden = self.batch_hidden(anchors, contexts, cache, block_size, width)
        else:
            block = mx.array([[anchors[0]] + [self.mask_token_id] * (block_size - 1)])
            hidden = self.hidden(block, contexts[0], cache)[:, 1:width]
        return self.drafts(hidden, anchors, samplings, keys)

    def drafts(self, hidden: mx.array, anchors: list, samplings: list, keys=None) -> Draft:
        """The drafts of draft positions `hidden` [B, n, H]. v1 proposes its argmax whatever each row's sampling
        (point masses: see decoding/sampling.py); with a draft vocabulary, confidence is the probability
        within it."""
        logits = self.draft_logits(hidden)
        probs = mx.softmax(logits.astype(mx.float32), axis=-1)
        k = min(TREE_CANDIDATES, probs.shape[-1])
        top = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]
        ids = top if self._draft_vocab is None else self._draft_vocab[top]
        return Draft(self.draft_tokens(logits), probs.max(axis=-1),
                     candidates=(ids.astype(mx.int32), mx.take_along_axis(probs, top, axis=-1)))

    def sanitize(self, weights: dict, where: str) -> dict:
        """Checkpoint tensor names -> this module tree's names."""
        return {k: v for k, v in weights.items() if k not in BORROWED_KEYS}

    def checkpoint_weights(self) -> dict:
        """This drafter's tensors under the names published checkpoints use (and its draft vocabulary)."""
        weights = dict(tree_flatten(self.parameters()))
        if self._draft_vocab is not None:
            weights[DRAFT_VOCAB_KEY] = self._draft_vocab
        return weights


def check_draft_vocab(ids, vocab_size: int, where: str) -> mx.array:
    """Distinct token ids inside the vocabulary, as a 1-D int32 array."""
    ids = mx.array(ids)
    if ids.ndim != 1 or ids.size == 0 or not mx.issubdtype(ids.dtype, mx.integer):
        raise DFlashError(f"{where}: a draft vocabulary is a non-empty 1-D list of token ids, got shape "
                          f"{tuple(ids.shape)} of {ids.dtype}")
    values = ids.tolist()
    bad = [t for t in values if not 0 <= t < vocab_size]
    if bad:
        raise DFlashError(f"{where}: draft vocabulary token {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    if len(set(values)) != len(values):
        raise DFlashError(f"{where}: the draft vocabulary lists some token ids twice")
    return ids.astype(mx.int32)
