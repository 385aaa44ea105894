"""Training a DFlash drafter for a frozen target (the objective of the DFlash paper, arXiv 2602.06036,
section 4.2 and appendix A.1).

For each training sequence (a prompt and the target's own response) the target runs once and its
chosen layers give the context features. Random anchor positions in the response each start a block
`[anchor, MASK x (B-1)]`; every block is one batch row that sees the context strictly before its anchor
and its own block (bidirectionally, or causally in causal layers), never another block. Block row k
learns the token at anchor + k with cross-entropy weighted exp(-(k-1)/gamma). Only the drafter trains:
it borrows the target's embedding and head, which stay outside its parameter tree.
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
from ..models.dflash import DFlashDraftModel
from ..models.loader import drafter_from_dir
from ..errors import DFlashError
from ..utils import staged_dir, write_json
from .replay import TargetFeatures, decoding_acceptance

# The paper's decay of the per-position loss weight by block size (arXiv 2602.06036, Eq. 4 and appendix A.1).
PUBLISHED_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


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
    eval_every: int = 200
    checkpoint_every: int = 200
    seed: int = 0


def position_weights(block_size: int, gamma: Optional[float] = None) -> mx.array:
    """w_k = exp(-(k-1)/gamma) for block rows k = 1..B-1."""
    gamma = gamma or PUBLISHED_GAMMA.get(block_size, max(1.0, block_size / 2.3))
    return mx.exp(-mx.arange(block_size - 1) / gamma)


def make_blocks(ids: np.ndarray, response_start: int, n_anchors: int, block_size: int, mask_id: int, rng):
    """Anchors sampled from the response, and each block's ids, labels and label validity.

    Returns block_ids [A, B], anchors [A], labels [A, B-1], valid [A, B-1] (label inside the sequence).
    """
    last = len(ids) - 2  # an anchor needs at least one token after it
    candidates = np.arange(response_start, last + 1)
    if len(candidates) == 0:
        raise DFlashError("a training sequence has no response tokens to anchor on")
    anchors = np.sort(rng.choice(candidates, size=min(n_anchors, len(candidates)), replace=False))
    offsets = anchors[:, None] + np.arange(1, block_size)[None]
    valid = offsets < len(ids)
    labels = ids[np.minimum(offsets, len(ids) - 1)]
    block_ids = np.full((len(anchors), block_size), mask_id, dtype=np.int32)
    block_ids[:, 0] = ids[anchors]
    return mx.array(block_ids), mx.array(anchors), mx.array(labels), mx.array(valid)


def sample_rows(valid, weights, rng) -> np.ndarray:
    """The block rows whose loss is computed this step: row k with probability w_k.

    The sum of their plain cross-entropies is, in expectation, the published weighted sum over all
    rows, and the output head (most of a step's work) runs on sum(w) / (B-1) of the rows: 0.44 of
    them for block 16 and gamma 7. Returns 0/1 row weights [A, B-1].
    """
    valid = np.asarray(valid)
    return ((rng.random(valid.shape) < np.asarray(weights)[None]) & valid).astype(np.float32)


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
    """Hidden states [N, H] of the block rows that enter the loss, over all of a step's sequences."""
    out = []
    for features, block_ids, anchors, _, row_weight in pieces:
        hidden = drafter.hidden(block_ids, features, drafter.make_cache(), block_start=anchors)[:, 1:]
        out.append(hidden.reshape(-1, hidden.shape[-1])[mx.array(np.flatnonzero(row_weight))])
    return mx.concatenate(out)


def draft_loss_and_grads(drafter, pieces, total_weight: float):
    """The step's loss, sum over rows of row_weight * cross-entropy / total_weight, and its gradient.

    pieces: one (features [1, T, F], block_ids, anchors, labels [A, B-1], row_weight [A, B-1] numpy)
    per sequence; row_weight w_k * valid gives the published objective (total_weight = its sum),
    sample_rows an unbiased estimate at a fraction of the head's work. The head's cross-entropy runs
    in numpy inside one MLX custom function whose vjp hands its gradient back, so the drafter runs
    forward once and backward once. Returns (loss, grads, correct, counted), the last two per block
    position over the rows used.
    """
    rows = [np.flatnonzero(p[4]) for p in pieces]
    labels = np.concatenate([np.array(p[3]).reshape(-1)[r] for p, r in zip(pieces, rows)])
    weight = np.concatenate([p[4].reshape(-1)[r] for p, r in zip(pieces, rows)]) / total_weight
    found = {}

    @mx.custom_function
    def head_loss(hidden):
        logits = drafter.logits(hidden)
        loss, found["d_logits"], found["hit"] = cross_entropy_and_grad(
            np.array(logits.astype(mx.float32)), labels, weight)
        return mx.array(loss)

    @head_loss.vjp
    def head_loss_vjp(hidden, cotangent, _):  # one argument: MLX passes it as is, not in a tuple
        d_logits = (mx.array(found["d_logits"]) * cotangent).astype(hidden.dtype)
        return tuple(mx.vjp(drafter.logits, [hidden], [d_logits])[1])

    loss, grads = nn.value_and_grad(drafter, lambda model: head_loss(chosen_hidden(model, pieces)))(drafter)
    K = pieces[0][3].shape[1]
    position = np.concatenate([r % K for r in rows])
    correct = np.bincount(position[found["hit"]], minlength=K)
    counted = np.bincount(position, minlength=K)
    return loss.item(), grads, correct, counted


def save_checkpoint(drafter: DFlashDraftModel, out_dir: Path, *, state: Optional[dict], optimizer=None, dtype=None):
    """Write config.json + model.safetensors (+ trainer state, optimizer) to a temporary dir, then swap it in."""
    weights = dict(tree_flatten(drafter.parameters()))
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
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


def train(target, drafter: DFlashDraftModel, sequences: list, held_out: list, out_dir, cfg: TrainConfig,
          resume: bool = False, log=print, progress: bool = True) -> dict:
    """Train `drafter` (bound to `target`) on (ids, response_start) sequences; checkpoints go to out_dir.

    Each step draws `cfg.sequences` sequences and `cfg.anchors` blocks in each. `target` may also be a
    TargetFeatures over it, to share features already computed. Progress is a tqdm bar on stderr (loss,
    per-position accuracy, rows/s, learning rate); evaluations, checkpoints and the last step go to `log`.
    """
    from tqdm import tqdm

    out_dir = Path(out_dir)
    if not sequences:
        raise DFlashError("no training sequences (every sample needs a response of 2+ tokens)")
    B = drafter.block_size
    weights = position_weights(B, cfg.gamma)
    optimizer = optim.AdamW(learning_rate=schedule(cfg), weight_decay=cfg.weight_decay)
    state = {"step": 0, "history": []}
    if resume and (out_dir / "trainer_state.json").exists():
        state = json.loads((out_dir / "trainer_state.json").read_text())
        drafter.load_weights(str(out_dir / "model.safetensors"))
        optimizer.init(drafter.trainable_parameters())
        saved = mx.load(str(out_dir / "optimizer.npz"))
        optimizer.state = tree_unflatten(list(saved.items()))
        log(f"resuming from step {state['step']} in {out_dir}")
    state["train_config"] = asdict(cfg)

    features_of = TargetFeatures.of(target)
    rng = np.random.default_rng(cfg.seed)
    if "rng" in state:  # resume draws the same batches an uninterrupted run would have
        rng.bit_generator.state = state["rng"]
    ema, tic, rows = None, time.perf_counter(), 0
    hits, counts = np.zeros(B - 1), np.zeros(B - 1)
    bar = tqdm(total=cfg.steps, initial=state["step"], desc="training drafter", unit="step", disable=not progress)
    for step in range(state["step"], cfg.steps):
        pieces, total_weight = [], 0.0
        for index in rng.choice(len(sequences), size=min(cfg.sequences, len(sequences)), replace=False):
            ids, start = sequences[index]
            ids = np.array(ids)
            block_ids, anchors, labels, valid = make_blocks(ids, start, cfg.anchors, B, drafter.mask_token_id, rng)
            pieces.append((features_of(ids), block_ids, anchors, labels, sample_rows(valid, weights, rng)))
            total_weight += float((weights[None] * valid).sum())
        loss, grads, correct, counted = draft_loss_and_grads(drafter, pieces, total_weight)
        grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
        optimizer.update(drafter, grads)
        mx.eval(drafter.parameters(), optimizer.state)

        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        hits += correct
        counts += counted
        rows += int(counted.sum())
        done = step + 1
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
            state["history"].append({"step": done, "loss": ema, "tau": tau, "per_position": reach})
            log(f"step {done}: held-out tau {tau:.2f} (block {B}), P(draft k kept) "
                + " ".join(f"{p:.2f}" for p in reach[:8]))
            tic = time.perf_counter()
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            state["step"], state["rng"] = done, rng.bit_generator.state
            save_checkpoint(drafter, out_dir, state=state, optimizer=optimizer)
            log(f"step {done}: checkpoint in {out_dir}")
    bar.close()
    return state


def export(checkpoint_dir, out_dir, dtype=mx.bfloat16):
    """The published checkpoint layout (config.json + model.safetensors) without trainer files."""
    save_checkpoint(drafter_from_dir(checkpoint_dir), Path(out_dir), state=None, dtype=dtype)
    return Path(out_dir)


def pick_mask_token(tokenizer, vocab_size: int) -> int:
    """A reserved, rarely seen token for the MASK slots: the last added special token that is not
    BOS/EOS/PAD and not used by the chat template (NeMo's advice: never pad or eos), else the last id."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    taken = set(getattr(tokenizer, "eos_token_ids", ())) | {hf.bos_token_id, hf.pad_token_id, hf.eos_token_id}
    template = getattr(tokenizer, "chat_template", None) or ""
    for token_id, token in sorted(getattr(hf, "added_tokens_decoder", {}).items(), reverse=True):
        if token_id not in taken and token.content not in template and token_id < vocab_size:
            return token_id
    return vocab_size - 1
