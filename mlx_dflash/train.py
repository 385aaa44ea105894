"""`mlx-dflash train`: a DFlash drafter for a frozen target, trained on the target's own answers
(`tuner/`: the data, the objective, the replayed acceptance)."""

import sys
from pathlib import Path

import click

from .errors import DFlashError


_NO_DFLASH2_TRAINING = ("training DFlash 2 drafters is not supported (their candidate selector needs a pairwise "
                        "objective this trainer does not have); train a DFlash v1 drafter (--arch dflash)")


@click.command("train")
@click.option("--model", "model_path", help="Target (default: SmolLM2-135M-Instruct from PyPI).")
@click.option("--prompts", "prompt_file", required=True, type=click.Path(dir_okay=False),
              help="Prompts: .jsonl (prompt/question/turns/conversations field) or text, one per line.")
@click.option("--data", "data_file", required=True, type=click.Path(dir_okay=False),
              help="JSONL of the target's responses; made (and resumed) here, reused when complete.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Checkpoint directory.")
@click.option("--num-prompts", default=None, type=int, help="Use only the first N prompts.")
@click.option("--max-response-tokens", default=192, show_default=True, type=int)
@click.option("--gen-batch", default=32, show_default=True, type=int, help="Prompts answered per batch.")
@click.option("--layers", default=None, type=int, help="Drafter layers (default: 1, or the --init/--resume drafter's).")
@click.option("--block-size", default=None, type=int, help="Default: 16, or the --init/--resume drafter's.")
@click.option("--target-features", default=None, type=int, help="Target layers tapped (default: one per layer).")
@click.option("--mask-token-id", default=None, type=int, help="Default: a reserved special token.")
@click.option("--steps", default=2000, show_default=True, type=int)
@click.option("--sequences", "sequences_per_step", default=4, show_default=True, type=int, help="Training sequences per step.")
@click.option("--anchors", default=64, show_default=True, type=int, help="Blocks per training sequence.")
@click.option("--lr", default=3e-4, show_default=True, type=float,
              help="Peak learning rate (the paper uses 6e-4 for large targets; from scratch on small ones it plateaus).")
@click.option("--eval-sequences", default=32, show_default=True, type=int, help="Held out from training.")
@click.option("--eval-every", default=200, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--resume", is_flag=True, help="Continue from the checkpoint in --out.")
@click.option("--init", "init_dir", default=None, type=click.Path(file_okay=False),
              help="Start from this drafter's weights (ours, a published one, a checkpoint) instead of random "
                   "ones; a new run with its own schedule. Its config sets the drafter's sizes.")
@click.option("--export", "export_dir", default=None, type=click.Path(file_okay=False),
              help="Then write the drafter alone (bfloat16, published layout, no trainer state) here.")
@click.option("--arch", type=click.Choice(["dflash", "dflash2"]), default="dflash", show_default=True,
              help="Drafter architecture; only DFlash v1 drafters train here.")
def main(model_path, prompt_file, data_file, out_dir, num_prompts, max_response_tokens, gen_batch, layers,
          block_size, target_features, mask_token_id, steps, sequences_per_step, anchors, lr, eval_sequences,
          eval_every, seed, resume, init_dir, export_dir, arch):
    """Train a DFlash drafter for a target on the target's own responses."""
    import mlx.core as mx
    from tqdm import tqdm

    from .tuner.data import generate_responses, iter_sequences, read_prompts, read_samples
    from .downloads import default_target
    from .models.loader import drafter_config_for, drafter_from_dir, init_drafter
    from .tuner.trainer import TrainConfig, export, pick_mask_token, train
    from .utils import load_target

    if arch == "dflash2":
        raise DFlashError(_NO_DFLASH2_TRAINING)
    out = Path(out_dir)
    if out.exists() and not resume:
        raise DFlashError(f"{out} exists: pass --resume to continue it, or choose another --out")
    if resume and not (out / "trainer_state.json").exists():
        raise DFlashError(f"--resume: {out} holds no training checkpoint (trainer_state.json)")
    if resume and init_dir:
        raise DFlashError("--resume continues the checkpoint in --out; --init starts a new run: pass one of them")
    start = out if resume else (Path(init_dir) if init_dir else None)
    if start is not None:  # the drafter's sizes come from the weights we start from
        drafter = drafter_from_dir(start)
        if drafter.config.is_dflash2:
            raise DFlashError(f"{start} holds a DFlash 2 drafter: {_NO_DFLASH2_TRAINING}")
        if drafter.config.raw.get("quantization"):
            raise DFlashError(f"{start} holds a quantized drafter, which cannot train: start from a float one")
        given = {"--layers": layers, "--block-size": block_size, "--target-features": target_features,
                 "--mask-token-id": mask_token_id}
        fixed = {"--layers": drafter.config.num_hidden_layers, "--block-size": drafter.config.block_size,
                 "--target-features": len(drafter.config.target_layer_ids),
                 "--mask-token-id": drafter.config.mask_token_id}
        for flag, value in given.items():
            if value is not None and value != fixed[flag]:
                raise DFlashError(f"{flag} {value} conflicts with the drafter in {start} ({flag} {fixed[flag]}): "
                                  f"drop {flag}, or train a new drafter of that size without --resume/--init")
        drafter.set_dtype(mx.float32)  # a bfloat16 export trains in float32
    target, tokenizer = load_target(default_target(model_path))
    prompts = read_prompts(prompt_file)[:num_prompts]
    generate_responses(target.model, tokenizer, prompts, data_file, max_tokens=max_response_tokens,
                       batch_size=gen_batch, log=lambda m: click.echo(m, err=True))
    samples = sorted((s for s in read_samples(data_file) if s["index"] < len(prompts)), key=lambda s: s["index"])
    sequences = list(iter_sequences(samples))
    held_out, sequences = sequences[:eval_sequences], sequences[eval_sequences:]
    if start is None:
        mask = pick_mask_token(tokenizer, target.vocab_size) if mask_token_id is None else mask_token_id
        config = drafter_config_for(target, layers or 1, block_size or 16, target_features, mask)
        drafter = init_drafter(config, seed=seed)
    drafter.bind(target)
    cfg = TrainConfig(steps=steps, sequences=sequences_per_step, anchors=anchors, learning_rate=lr,
                      eval_every=eval_every, checkpoint_every=eval_every, seed=seed)
    click.echo(f"training on {len(sequences)} sequences, {len(held_out)} held out", err=True)
    train(target, drafter, sequences, held_out, out, cfg, resume=resume,
                 log=lambda m: tqdm.write(m, file=sys.stderr))  # lines above the progress bar
    click.echo(f"wrote {out}")
    if export_dir:
        click.echo(f"wrote {export(out, export_dir)}")
