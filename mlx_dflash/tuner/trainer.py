"""Training a DFlash drafter for a frozen target (DFlash, arXiv 2602.06036, section 4.2 and App. A.1).

For each training sequence (a prompt and the target's own response, or existing text: text.py) the
target runs once: its chosen layers give the context features and its head its own greedy choice at
every position. Random anchor positions in the response each start a block `[anchor, MASK x (B-1)]`;
every block is one batch row that sees the context strictly before its anchor and its own block
(bidirectionally, or causally in causal layers), never another block. Block row k learns the target's
choice at anchor + k (or, with `labels="text"`, the text's token there) with cross-entropy weighted exp(-(k-1)/gamma) by default; objectives.py
has the others. A DFlash 2 drafter also trains its candidate selector (`selector_loss`). Only the drafter
trains: it borrows the target's embedding and head, which stay outside its parameter tree.
"""

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..models.config import config_to_dict
from ..models.dflash import DRAFT_VOCAB_KEY, DFlashDraftModel
from ..models.loader import drafter_from_dir, init_drafter
from ..errors import DFlashError
from ..utils import staged_dir, write_json
from .objectives import Objective
from .replay import TargetFeatures, decoding_acceptance


# What a block position learns: the target's own greedy choice at its position given the text before it, or
# the text's next token. On the target's greedy answers the two agree.
LABELS = ("target", "text")


@dataclass
class TrainConfig:
    steps: int = 2000
    sequences: int = 4  # training sequences per step
    anchors: int = 64  # blocks per training sequence
    learning_rate: float = 3e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: Optional[float] = None  # default: published value for the block size
    objective: str = "decay"  # objectives.OBJECTIVES
    labels: str = "target"  # LABELS: what each block position learns
    selector_weight: float = 1.0  # DFlash 2: the candidate selector's loss, added to the drafts' loss
    eval_every: int = 200
    checkpoint_every: int = 200
    seed: int = 0


def make_blocks(ids: np.ndarray, response_start: int, n_anchors: int, block_size: int, mask_id: int, rng,
                label_of: Optional[np.ndarray] = None):
    """Anchors sampled from the response, and each block's ids, labels and label validity.

    label_of[p] is the token position p is trained to draft (default ids[p], the text itself; the
    target's own choices with `TargetFeatures.choices`). Returns block_ids [A, B], anchors [A], labels
    [A, B-1], valid [A, B-1] (label inside the sequence).
    """
    last = len(ids) - 2  # an anchor needs at least one token after it
    candidates = np.arange(response_start, last + 1)
    if len(candidates) == 0:
        raise DFlashError("a training sequence has no response tokens to anchor on")
    anchors = np.sort(rng.choice(candidates, size=min(n_anchors, len(candidates)), replace=False))
    offsets = anchors[:, None] + np.arange(1, block_size)[None]
    valid = offsets < len(ids)
    labels = (ids if label_of is None else label_of)[np.minimum(offsets, len(ids) - 1)]
    block_ids = np.full((len(anchors), block_size), mask_id, dtype=np.int32)
    block_ids[:, 0] = ids[anchors]
    return mx.array(block_ids), mx.array(anchors), mx.array(labels), mx.array(valid)


def sample_rows(row_weight: np.ndarray, rng) -> np.ndarray:
    """The block positions whose loss is computed this step: each row with probability its weight (<= 1).

    The sum of their plain cross-entropies is, in expectation, the weighted sum over all rows, and the
    output head (most of a step's work) runs on a fraction of the rows: 0.44 of them for the published
    decay at block 16. Returns 0/1 row weights, shaped as row_weight.
    """
    return (rng.random(row_weight.shape) < row_weight).astype(np.float32)


def cross_entropy_and_grad(logits: np.ndarray, labels: np.ndarray, weight: np.ndarray):
    """sum(weight * cross-entropy) over rows, its gradient w.r.t. the logits, and which rows the argmax
    gets right. In numpy because MLX's CPU exp is scalar: over a 49k vocabulary it would take most of a
    training step, where numpy's exp is vectorized."""
    n = np.arange(len(labels))
    top = logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits - top)
    total = probs.sum(axis=-1, keepdims=True)
    ce = np.log(total[:, 0]) - (logits[n, labels] - top[:, 0])
    probs /= total
    probs[n, labels] -= 1.0
    probs *= weight[:, None]
    return float((ce * weight).sum()), probs, logits.argmax(axis=-1) == labels


def chosen_hidden(drafter, pieces) -> mx.array:
    """Hidden states [N, H] of the block positions that enter the loss, over all of a step's sequences."""
    out = []
    for features, block_ids, anchors, _, row_weight in pieces:
        hidden = drafter.hidden(block_ids, features, drafter.make_cache(), block_start=anchors)[:, 1:]
        out.append(hidden.reshape(-1, hidden.shape[-1])[mx.array(np.flatnonzero(row_weight))])
    return mx.concatenate(out)


def previous_tokens(block_ids, labels) -> np.ndarray:
    """The true token before each block position [A, B-1]: the anchor for row 1, the label of row k-1 after."""
    return np.concatenate([np.array(block_ids)[:, :1], np.array(labels)[:, :-1]], axis=1)


def selector_loss(selector, hidden, unary, candidates: np.ndarray, previous: np.ndarray, labels: np.ndarray,
                  weight: np.ndarray) -> mx.array:
    """The DFlash 2 candidate selector's teacher-forced loss: sum over rows of weight * cross-entropy of
    the true token among the row's top-k candidates, scored given the true previous token (as the walk
    scores them given its own choice). Rows whose true token is not a candidate add nothing: the walk
    cannot choose it there, and the drafts' own cross-entropy already pulls it up."""
    is_label = candidates == labels[:, None]
    inside = is_label.any(axis=-1)
    scores = selector.teacher_forced_scores(hidden, unary, mx.array(candidates), mx.array(previous))
    ce = mx.logsumexp(scores, axis=-1) - mx.take_along_axis(scores, mx.array(is_label.argmax(-1))[:, None], -1)[:, 0]
    return (ce * mx.array(np.where(inside, weight, 0.0).astype(np.float32))).sum()


def draft_loss_and_grads(drafter, pieces, total_weight: float, selector_weight: float = 1.0):
    """The step's loss, sum over rows of row_weight * cross-entropy / total_weight, and its gradient.

    pieces: one (features [1, T, F], block_ids, anchors, labels [A, B-1], row_weight [A, B-1] numpy)
    per sequence; row_weight w_k * valid gives the published objective (total_weight = its sum),
    sample_rows an unbiased estimate at a fraction of the head's work. The head's cross-entropy runs
    in numpy inside one MLX custom function whose vjp hands its gradient back, so the drafter runs
    forward once and backward once. A DFlash 2 drafter adds `selector_weight` times its selector's loss
    (`selector_loss`, same row weights), whose candidates and their logits come out of that same
    function. Returns (loss, grads, correct, counted), the last two per block position over the rows used.
    """
    rows = [np.flatnonzero(p[4]) for p in pieces]
    labels = np.concatenate([np.array(p[3]).reshape(-1)[r] for p, r in zip(pieces, rows)])
    weight = np.concatenate([p[4].reshape(-1)[r] for p, r in zip(pieces, rows)]) / total_weight
    selector = getattr(drafter, "candidate_selector", None)
    found = {}

    @mx.custom_function
    def head_loss(hidden):
        logits = np.array(drafter.logits(hidden).astype(mx.float32))
        loss, found["d_logits"], found["hit"] = cross_entropy_and_grad(logits, labels, weight)
        if selector is None:
            return mx.array(loss)
        found["candidates"] = np.argpartition(-logits, selector.top_k - 1, axis=-1)[:, :selector.top_k]
        return mx.array(loss), mx.array(np.take_along_axis(logits, found["candidates"], axis=-1))

    @head_loss.vjp
    def head_loss_vjp(hidden, cotangents, _):  # one argument: MLX passes it as is, not in a tuple
        if selector is None:
            d_logits = mx.array(found["d_logits"]) * cotangents
        else:  # the candidates' logits' cotangent joins the cross-entropy's at their columns
            d_loss, d_unary = cotangents
            d_logits = mx.array(found["d_logits"]) * d_loss
            d_logits = d_logits.at[mx.arange(len(labels))[:, None], mx.array(found["candidates"])].add(d_unary)
        return tuple(mx.vjp(drafter.logits, [hidden], [d_logits.astype(hidden.dtype)])[1])

    def loss_of(model):
        hidden = chosen_hidden(model, pieces)
        if selector is None:
            return head_loss(hidden)
        loss, unary = head_loss(hidden)
        previous = np.concatenate([previous_tokens(p[1], p[3]).reshape(-1)[r] for p, r in zip(pieces, rows)])
        return loss + selector_weight * selector_loss(model.candidate_selector, hidden, unary,
                                                      found["candidates"], previous, labels, weight)

    loss, grads = nn.value_and_grad(drafter, loss_of)(drafter)
    K = pieces[0][3].shape[1]
    position = np.concatenate([r % K for r in rows])
    correct = np.bincount(position[found["hit"]], minlength=K)
    counted = np.bincount(position, minlength=K)
    return loss.item(), grads, correct, counted


def save_checkpoint(drafter: DFlashDraftModel, out_dir: Path, *, state: Optional[dict], optimizer=None, dtype=None):
    """Write config.json + model.safetensors (+ trainer state, optimizer) to a temporary dir, then swap it in.
    The weights go under the published names (`checkpoint_weights`); dtype casts the floating ones."""
    weights = drafter.checkpoint_weights()
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    with staged_dir(out_dir, overwrite=True) as tmp:
        tmp.mkdir()
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        write_json(tmp / "config.json", config_to_dict(drafter.config))
        if state is not None:
            write_json(tmp / "trainer_state.json", state)
        if optimizer is not None:
            # .npz, not .safetensors: loaders read every *.safetensors of a drafter directory as weights.
            mx.savez(str(tmp / "optimizer.npz"), **dict(tree_flatten(optimizer.state)))


def schedule(cfg: TrainConfig):
    warmup = max(1, int(cfg.steps * cfg.warmup_ratio))
    return optim.join_schedules(
        [optim.linear_schedule(1e-7, cfg.learning_rate, warmup),
         optim.cosine_decay(cfg.learning_rate, max(1, cfg.steps - warmup), cfg.learning_rate * 0.05)],
        [warmup],
    )


def restore(drafter, optimizer, out_dir: Path, cfg: TrainConfig) -> dict:
    """The trainer state of the checkpoint in out_dir, with its weights and optimizer state loaded."""
    state = json.loads((out_dir / "trainer_state.json").read_text())
    saved = state.get("train_config", {}).get("objective", "decay")
    if saved != cfg.objective:
        raise DFlashError(f"the checkpoint in {out_dir} trains with --objective {saved}, not {cfg.objective}: "
                          f"resume it with --objective {saved}, or start a new run")
    saved = state.get("train_config", {}).get("labels", "text")  # checkpoints from before --labels learned the text
    if saved != cfg.labels:
        raise DFlashError(f"the checkpoint in {out_dir} trains with --labels {saved}, not {cfg.labels}: "
                          f"resume it with --labels {saved}, or start a new run")
    weights = drafter.sanitize(mx.load(str(out_dir / "model.safetensors")), where=str(out_dir))
    weights.pop(DRAFT_VOCAB_KEY, None)  # not a parameter: the drafter loaded from out_dir already has it
    drafter.load_weights(list(weights.items()))
    optimizer.init(drafter.trainable_parameters())
    optimizer.state = tree_unflatten(list(mx.load(str(out_dir / "optimizer.npz")).items()))
    return state


def train(target, drafter: DFlashDraftModel, sequences: list, held_out: list, out_dir, cfg: TrainConfig,
          resume: bool = False, log=print, progress: bool = True) -> dict:
    """Train `drafter` (bound to `target`) on (ids, response_start) sequences; checkpoints go to out_dir.

    Each step draws `cfg.sequences` sequences and `cfg.anchors` blocks in each, shaped and weighed by
    `cfg.objective` (objectives.py). `target` may also be a TargetFeatures over it, to share features
    already computed. Progress is a tqdm bar on stderr (loss, per-position accuracy, rows/s, learning
    rate); evaluations, checkpoints and the last step go to `log`. The state (trainer_state.json) keeps
    each evaluation's held-out tau with the training's CPU seconds (process time, summed over resumed
    runs) at that step, for curves of tau against compute.
    """
    from tqdm import tqdm

    out_dir = Path(out_dir)
    if not sequences:
        raise DFlashError("no training sequences (every sample needs a response of 2+ tokens)")
    B = drafter.block_size
    objective = Objective(cfg.objective, B, cfg.gamma)
    if objective.name == "verified" and not held_out:
        raise DFlashError("--objective verified weighs rows by the held-out acceptance: keep some sequences "
                          "held out (--eval-sequences)")
    optimizer = optim.AdamW(learning_rate=schedule(cfg), weight_decay=cfg.weight_decay)
    state = {"step": 0, "history": [], "cpu_seconds": 0.0}
    if resume and (out_dir / "trainer_state.json").exists():
        state = restore(drafter, optimizer, out_dir, cfg)
        if state["history"]:
            objective.measured(state["history"][-1]["per_position"])
        log(f"resuming from step {state['step']} in {out_dir}")
    state["train_config"] = asdict(cfg)

    features_of = TargetFeatures.of(target)
    rng = np.random.default_rng(cfg.seed)
    if "rng" in state:  # resume draws the same batches an uninterrupted run would have
        rng.bit_generator.state = state["rng"]
    ema, tic, rows = None, time.perf_counter(), 0
    cpu_start, cpu_before = time.process_time(), state.get("cpu_seconds", 0.0)
    hits, counts = np.zeros(B - 1), np.zeros(B - 1)
    bar = tqdm(total=cfg.steps, initial=state["step"], desc="training drafter", unit="step", disable=not progress)
    for step in range(state["step"], cfg.steps):
        pieces, total_weight = [], 0.0
        for index in rng.choice(len(sequences), size=min(cfg.sequences, len(sequences)), replace=False):
            ids, start = sequences[index]
            ids = np.array(ids)
            label_of = features_of.choices(ids) if cfg.labels == "target" else None
            block_ids, anchors, labels, valid = make_blocks(ids, start, cfg.anchors, B, drafter.mask_token_id, rng,
                                                            label_of)
            block_ids, row_weight = objective.blocks(block_ids, anchors, labels, valid, len(ids), rng)
            pieces.append((features_of(ids), block_ids, anchors, labels, sample_rows(row_weight, rng)))
            total_weight += float(row_weight.sum())
        loss, grads, correct, counted = draft_loss_and_grads(drafter, pieces, total_weight, cfg.selector_weight)
        grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
        optimizer.update(drafter, grads)
        mx.eval(drafter.parameters(), optimizer.state)

        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        hits += correct
        counts += counted
        rows += int(counted.sum())
        done = step + 1
        state["cpu_seconds"] = cpu_before + time.process_time() - cpu_start
        bar.update()
        if done % 10 == 0 or done == cfg.steps:
            rate = rows / (time.perf_counter() - tic)
            acc = " ".join(f"{a:.2f}" for a in (hits / np.maximum(counts, 1))[:4])
            line = f"loss {ema:.3f} acc@1-4 {acc} {rate:.0f} rows/s lr {optimizer.learning_rate.item():.2e}"
            bar.set_postfix_str(line)
            if done == cfg.steps:
                log(f"step {done}/{cfg.steps}: {line}")
            hits[:], counts[:], rows, tic = 0, 0, 0, time.perf_counter()
        if held_out and (done % cfg.eval_every == 0 or done == cfg.steps):
            result = decoding_acceptance(drafter, features_of, held_out, widths=(B,))[B]
            tau, reach = result["tau"], result["reach"]
            objective.measured(reach)
            state["history"].append({"step": done, "loss": ema, "tau": tau, "per_position": reach,
                                     "cpu_seconds": state["cpu_seconds"]})
            log(f"step {done}: held-out tau {tau:.2f} (block {B}), P(draft k kept) "
                + " ".join(f"{p:.2f}" for p in reach[:8]))
            tic = time.perf_counter()
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            state["step"], state["rng"] = done, rng.bit_generator.state
            state["position_weights"] = objective.weights.tolist()  # w_1.. in use (`verified` moves them)
            save_checkpoint(drafter, out_dir, state=state, optimizer=optimizer)
            log(f"step {done}: checkpoint in {out_dir}")
    bar.close()
    return state


def export(checkpoint_dir, out_dir, dtype=mx.bfloat16):
    """The published checkpoint layout (config.json + model.safetensors) without trainer files."""
    save_checkpoint(drafter_from_dir(checkpoint_dir), Path(out_dir), state=None, dtype=dtype)
    return Path(out_dir)


def new_drafter(config, seed: Optional[int] = None) -> DFlashDraftModel:
    """A randomly initialised drafter to train. A DFlash 2 one starts with zero dynamic convolution taps:
    its static taps are the identity, so each layer starts as the v1 layer and the convolutions grow
    from there (nn.Linear's random init gives taps of std 1/sqrt(3) ~ 0.58 beside the identity's 1)."""
    drafter = init_drafter(config, seed=seed)
    if config.is_dflash2:
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.kernel_projection.weight = mx.zeros_like(conv.kernel_projection.weight)
        mx.eval(drafter.parameters())
    return drafter
