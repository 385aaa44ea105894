"""The DFlash 2 drafter in MLX (z-lab's `DFlash2DraftModel`: dflash/model_mlx.py and dflash/model.py of
dflash 0.1.0).

Everything of v1 stays (KV injection of the target features, the anchor + MASK block, the context-only
cache, the borrowed embedding and head). Two things are added:

* per layer, two grouped dynamic causal convolutions (`attention_conv`, `mlp_conv`) around attention
  and MLP. They run over the block positions only (the context is never convolved), causally, zero before
  block position 0: y_t[c] = sum_o (base_kernel[s, o, c] + dynamic_t[s, o, c // G]) * x_{t-o}[c], where the
  dynamic taps come from `kernel_projection` of the normed sub-block input; set s = 0 shapes the
  sub-block's input ("prepare"), s = 1 its output ("finish").
* the candidate selector: the top-k tokens of each draft row's logits, rescored with a low-rank
  pairwise term between the previous token and each candidate,
  score(c) = logit(c) + sum_r predecessor_codebook[prev, r] * hidden_projection(h_t)[r] * successor_codebook[c, r],
  in a left-to-right walk from the anchor. Greedy decoding takes the walk's argmax at each step; sampling
  draws each step from softmax(score / T) over the k candidates, and that distribution is the proposal q
  of rejection sampling (zero outside the candidates).

The two codebooks are stored without a `.weight` suffix in published checkpoints; `sanitize` and
`checkpoint_weights` translate between those names and this module tree's `nn.Embedding` names.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import DFlashError
from .base import Draft
from .config import DFlashConfig
from .dflash import DecoderLayer, DFlashDraftModel

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
CONVS = ("attention_conv", "mlp_conv")


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        # Identity at initialisation (tap 0 = 1): an untrained DFlash 2 layer starts as a v1 layer.
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size)).at[:, 0].add(1.0)
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, x: mx.array) -> tuple:
        """(x convolved with tap set 0, the dynamic taps of set 1 for `finish`). x: [B, L, H], normed."""
        taps = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, -1)  # [B, L, 2, K, groups]
        return self._convolve(x, taps[..., 0, :, :], self.base_kernel[0]), taps[..., 1, :, :]

    def finish(self, y: mx.array, taps: mx.array) -> mx.array:
        return self._convolve(y, taps, self.base_kernel[1])

    def _convolve(self, x: mx.array, dynamic: mx.array, base: mx.array) -> mx.array:
        # Per-channel taps per row: the static ones plus the row's dynamic tap of the channel's group.
        kernel = base.astype(x.dtype) + mx.repeat(dynamic, self.group_size, axis=-1)  # [B, L, K, H]
        out = kernel[:, :, 0] * x
        for o in range(1, self.kernel_size):
            earlier = mx.pad(x[:, :-o], [(0, 0), (o, 0), (0, 0)])  # x_{t-o}, zero before block position 0
            out = out + kernel[:, :, o] * earlier
        return out


class DFlash2DecoderLayer(DecoderLayer):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        H, K, G = config.hidden_size, config.conv_kernel_size, config.conv_group_size
        self.attention_conv = GroupedDynamicCausalConv(H, K, G)
        self.mlp_conv = GroupedDynamicCausalConv(H, K, G)

    def __call__(self, h, h_ctx, rope, cache, block_start=None):
        x, taps = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(x, h_ctx, rope, cache, block_start), taps)
        x, taps = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), taps)


@dataclass
class Walk:
    """The selector's path over n draft positions (batch B)."""

    tokens: mx.array  # [B, n] the chosen token per row
    candidates: mx.array  # [B, n, k] the row's top-k tokens (no particular order)
    scores: mx.array  # [B, n, k] unary + pairwise score of each candidate, given the path before it
    probs: mx.array  # [B, n, k] the distribution each step chose from: softmax(scores / T), T = 1 when greedy
    chosen: mx.array  # [B, n] index of the chosen candidate


class CandidateSelector(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.top_k = config.selector_top_k
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)
        self.predecessor_codebook = nn.Embedding(config.vocab_size, config.selector_rank)
        self.successor_codebook = nn.Embedding(config.vocab_size, config.selector_rank)

    def __call__(self, hidden: mx.array, logits: mx.array, anchors: mx.array, temperature=0.0, noise=None) -> Walk:
        """hidden [B, n, H] (final-norm draft positions), logits [B, n, V] (after the output transforms),
        anchors [B]. Walk left to right; each step's choice is the next step's predecessor. A batch whose
        rows sample differently passes `temperature` [B] (0: that row is greedy) and Gumbel `noise`
        [B, n, k] drawn from each row's own random stream: argmax(score / T + noise) samples softmax(score / T)."""
        k = self.top_k
        candidates = mx.argpartition(-logits, k - 1, axis=-1)[..., :k]
        unary = mx.take_along_axis(logits, candidates, axis=-1).astype(mx.float32)
        row_weight = self.hidden_projection(hidden).astype(mx.float32)  # [B, n, R]
        successors = self.successor_codebook(candidates).astype(mx.float32)  # [B, n, k, R]
        previous = anchors
        tokens, scores, probs, chosen = [], [], [], []
        for t in range(hidden.shape[1]):
            query = self.predecessor_codebook(previous).astype(mx.float32) * row_weight[:, t]  # [B, R]
            score = unary[:, t] + (successors[:, t] @ query[..., None])[..., 0]  # [B, k]
            if noise is not None:
                sampled = (temperature > 0)[:, None]
                scaled = score / mx.where(sampled, temperature[:, None], 1.0)
                prob = mx.softmax(scaled, axis=-1)
                index = mx.argmax(mx.where(sampled, scaled + noise[:, t], score), axis=-1)
            elif temperature > 0:
                prob = mx.softmax(score / temperature, axis=-1)
                index = mx.random.categorical(mx.log(prob))
            else:
                prob = mx.softmax(score, axis=-1)
                index = mx.argmax(score, axis=-1)
            previous = mx.take_along_axis(candidates[:, t], index[:, None], axis=-1)[:, 0]
            tokens.append(previous)
            scores.append(score)
            probs.append(prob)
            chosen.append(index)
        return Walk(mx.stack(tokens, 1), candidates, mx.stack(scores, 1), mx.stack(probs, 1), mx.stack(chosen, 1))

    def teacher_forced_scores(self, hidden: mx.array, unary: mx.array, candidates: mx.array, previous: mx.array):
        """The walk's scores [N, k] of candidates [N, k] (logits `unary`) of rows `hidden` [N, H], each
        given a previous token [N] instead of the walk's own choice: what training teaches the selector."""
        query = self.predecessor_codebook(previous).astype(mx.float32) * self.hidden_projection(hidden).astype(mx.float32)
        successors = self.successor_codebook(candidates).astype(mx.float32)
        return unary.astype(mx.float32) + (successors @ query[..., None])[..., 0]


class DFlash2DraftModel(DFlashDraftModel):
    layer_class = DFlash2DecoderLayer

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)

    def set_draft_vocab(self, ids, where: str = "the draft vocabulary"):
        if ids is not None:
            raise DFlashError(f"{where}: draft vocabularies apply to DFlash v1 drafters only (a DFlash 2 "
                              "candidate selector ranks the whole vocabulary)")
        super().set_draft_vocab(None, where)

    def walk(self, hidden: mx.array, anchors: mx.array, temperature: float = 0.0) -> Walk:
        """The selector's walk over draft positions `hidden` [B, n, H]."""
        return self.candidate_selector(hidden, self.logits(hidden), anchors, temperature)

    def drafts(self, hidden: mx.array, anchors: list, samplings: list, keys=None) -> Draft:
        """As v1's, with the selector's walk as the drafts. A sampled row draws its walk with Gumbel noise from
        its own random stream (keys[b], else MLX's global one), and the walk's distributions are its proposal;
        confidence is the probability of the chosen candidate."""
        temps = [0.0 if s.greedy else s.temperature for s in samplings]
        if not any(temps):
            walk = self.walk(hidden, mx.array(anchors), 0.0)
        else:
            shape = (hidden.shape[1], self.candidate_selector.top_k)
            noise = mx.stack([mx.random.gumbel(shape, key=None if keys is None else keys[b])
                              for b in range(len(anchors))])
            walk = self.candidate_selector(hidden, self.logits(hidden), mx.array(anchors), mx.array(temps), noise)
        confidence = mx.take_along_axis(walk.probs, walk.chosen[..., None], axis=-1)[..., 0]
        return Draft(walk.tokens, confidence, None if not any(temps) else (walk.candidates, walk.probs))

    def sanitize(self, weights: dict, where: str) -> dict:
        """Published names -> ours (the codebooks gain `.weight`), checking what would otherwise fail
        deep inside the load with a name the checkpoint never used."""
        weights = super().sanitize(weights, where)
        for name in CODEBOOKS:
            if name in weights:
                weights[f"{name}.weight"] = weights.pop(name)
            elif f"{name}.weight" not in weights:
                raise DFlashError(f"DFlash 2 drafter {where} has no tensor {name} (a candidate selector "
                                  "codebook): the checkpoint is incomplete")
        cfg = self.config
        rows = 2 * cfg.conv_kernel_size * cfg.hidden_size // cfg.conv_group_size
        for i in range(cfg.num_hidden_layers):
            for conv in CONVS:
                name = f"layers.{i}.{conv}.kernel_projection.weight"
                if name in weights and weights[name].shape[0] != rows:
                    raise DFlashError(
                        f"DFlash 2 drafter {where}: {name} has {weights[name].shape[0]} rows, but "
                        f"dflash_config.conv_group_size {cfg.conv_group_size} and conv_kernel_size "
                        f"{cfg.conv_kernel_size} imply 2*K*hidden/G = {rows}: the config does not match the weights")
        return weights

    def checkpoint_weights(self) -> dict:
        weights = super().checkpoint_weights()
        for name in CODEBOOKS:
            weights[name] = weights.pop(f"{name}.weight")
        return weights
