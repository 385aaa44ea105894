"""Generation in one call or as a stream, as mlx-lm's `generate` and `stream_generate` offer it.

Tokenization, stop tokens, streaming text and statistics around one request's decoding (the scheduler's one-row
case, `decoding/batch_decoder.py` `Scheduler.alone`). The
signatures are mlx-lm's: a string prompt is used as given (apply the chat template first, or use
`encode_prompt`), the sampling keywords are `mlx_lm.sample_utils.make_sampler`'s, and `stream_generate`
yields one response per token with mlx-lm's fields, plus the round that produced it and the running
speculative statistics.
"""

import sys
from typing import Callable, Iterator, Optional

import click
import mlx.core as mx

from .decoding.batch_decoder import Request, Scheduler
from .decoding.decoder import SingleProcess
from .decoding.engine_report import Report, announce, silenced
from .decoding.generation_options import GenerationOptions, check_seed
from .decoding.prompt import check_context, encode_prompt
from .decoding.prompt_cache import PromptCache, check_prompt_cache_file, pair_identity
from .decoding.responses import GenerationResponse, GenerationStats, admitted_stream
from .errors import DFlashError
from .machine import prefill_step
from .models.base import DraftModel
from .models.target import Target
from .options import kv_options, pair_options, sampling_options, shard_options, width_options
from .policies.dcut import build_policy


class GeneratedText(str):
    """What `generate` returns: the text (a str, as mlx-lm's), with the token ids and statistics attached."""

    tokens: list
    stats: GenerationStats


def stream_generate(target: Target, drafter: Optional[DraftModel], tokenizer, prompt, max_tokens: int = 256, *,
                    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
                    ranks: SingleProcess = SingleProcess(), **options) -> Iterator[GenerationResponse]:
    """Stream the generation token by token. `prompt` is a string (used as given) or token ids. drafter: a
    DFlash drafter, or None for drafts copied from the context alone (models/no_drafter.py).

    options: temp, top_p, top_k, min_p (as `mlx_lm.sample_utils.make_sampler` takes them), seed, width, tree,
    policy, prefill_step_size, prompt_cache (decoding/generation_options.py `GenerationOptions`).
    prompt_progress_callback(processed, total) is called as the prompt is read; ranks: a sharded target's
    (distributed.py `Ranks`)."""
    options = GenerationOptions.of(options)
    if max_tokens < 1:
        raise DFlashError(f"max_tokens must be at least 1, got {max_tokens}")
    drafter, policy = options.drafter_and_policy(target, drafter)
    ids = encode_prompt(tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise DFlashError("the prompt is empty")
    max_tokens = check_context(target, len(ids), max_tokens)

    policy.prepare_context(len(ids))  # a long prompt's verify costs are measured now, not on the prefill's clock
    stream = report = None

    def admitted(*value):
        nonlocal stream, report
        stream = admitted_stream(tokenizer, policy, len(ids), max_tokens, value, options.prompt_cache)
        # the policy's notes and the fallbacks known already, on stderr (rank 0) and in the statistics
        report = Report(target, policy, stream.stats, quiet=ranks.rank != 0)

    mx.reset_peak_memory()
    # one request: the scheduler's one-row case (serve and batch_generate decode through it too)
    scheduler = Scheduler(target, drafter, policy, 1, tokenizer.eos_token_ids, options.prompt_cache,
                          options.prefill_step_size or prefill_step(), ranks)
    rounds = scheduler.alone(Request(0, ids, max_tokens, options.sampling, options.seed,
                                     progress=prompt_progress_callback), admitted)
    try:
        for rnd in rounds:
            responses = stream.feed(rnd)
            report.update()
            yield from responses
            if stream.finished:
                return
    finally:
        rounds.close()


def generate(target: Target, drafter: DraftModel, tokenizer, prompt, max_tokens: int = 256, verbose: bool = False,
             **kwargs) -> GeneratedText:
    """Generate in one call, as `mlx_lm.generate`: returns the text (its `.tokens` and `.stats` hold the
    token ids and the statistics). verbose: print the text as it comes, then the statistics. The other
    keywords are stream_generate's (`GenerationOptions`)."""
    text, tokens, stats = [], [], None
    if verbose:
        print("=" * 10)
    for response in stream_generate(target, drafter, tokenizer, prompt, max_tokens, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text.append(response.text)
        tokens.append(response.token)
        stats = response.stats
    if stats.finish_reason == "stop":
        tokens.pop()  # the stop token is counted, not returned
    if verbose:
        print()
        print("=" * 10)
        print(stats.summary(), file=sys.stdout)
    result = GeneratedText("".join(text))
    result.tokens, result.stats = tokens, stats
    return result


@click.command("generate")
@pair_options
@click.option("--prompt", required=True, help="Prompt text, or - to read it from stdin.")
@click.option("--max-tokens", default=256, show_default=True, type=int)
@sampling_options
@click.option("--seed", default=None, type=int)
@width_options
@click.option("--chat-template/--no-chat-template", default=None, help="Default: on when the tokenizer has one.")
@click.option("--verbose", is_flag=True, help="Print each round's kept/drafted count to stderr, and what served "
              "the verify (our kernels or MLX's, per shape), the drafter or plain steps, and every fallback.")
@click.option("--prompt-cache-file", type=click.Path(dir_okay=False), default=None,
              help="Start from the state kept in this file for the prompt's longest shared prefix, and keep this "
                   "prompt's state there for the next run (written atomically; ignored if made for another pair).")
@kv_options
@shard_options
def main(pair, prompt, max_tokens, sampling, seed, widths, chat_template, verbose,
         prompt_cache_file, kv, shard):
    """Generate text with a target model and its DFlash drafter (or none: drafts copied from the context)."""
    from tqdm import tqdm

    from .distributed import Ranks
    from .machine import slow_blas_warning
    from .pitfalls import pair_warnings

    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise DFlashError("--prompt is empty: give the text to answer (or - to read it from stdin)")
    # Bad settings are refused before anything loads, and before any work (the prompt cache file too).
    if max_tokens < 1:
        raise DFlashError(f"--max-tokens must be at least 1, got {max_tokens}")
    check_seed(seed)
    if prompt_cache_file:
        check_prompt_cache_file(prompt_cache_file)
    if shard and prompt_cache_file:
        raise DFlashError("--prompt-cache-file does not work with --shard (each rank holds its own shard's state)")
    target, drafter, tokenizer, group = pair.load(kv, shard, "generate")
    ids = encode_prompt(tokenizer, prompt, chat_template)
    check_context(target, len(ids), max_tokens)  # before the policy's start-up probe and the prefill
    policy = build_policy(target, drafter, widths.with_default(seeded_sample=seed is not None and not sampling.greedy))
    policy.notes[:0] = pair_warnings(target, drafter, tokenizer)  # the pair's problems first
    if blas := slow_blas_warning():  # once every input is taken: a refusal stands alone
        click.echo(blas, err=True)
    cache = None
    if prompt_cache_file:
        cache = PromptCache(pair_identity(target, drafter), target.trimmable, max_entries=8)
        cache.load_file(prompt_cache_file)
    ranks = Ranks(group, policy.block_size, shard.mode == "pipeline", shard.rank_timeout) if shard else SingleProcess()
    echo = click.echo if ranks.rank == 0 else (lambda *args, **kwargs: None)  # only rank 0 prints
    for note in policy.notes if ranks.rank == 0 else ():  # before any work; stream_generate keeps them in the stats
        announce(note)
    bar = tqdm(total=len(ids), desc="prompt", unit="tok", delay=2, leave=False, disable=ranks.rank != 0)
    stats, shown, said, line_open = None, None, set(policy.notes), False
    try:
        with ranks.watch(), silenced():  # notes new during the run are printed here, each on a line of its own
            for response in stream_generate(
                target, drafter, tokenizer, ids, max_tokens, **sampling.keywords(), seed=seed, policy=policy,
                ranks=ranks, prompt_progress_callback=lambda done, _: bar.update(done - bar.n), prompt_cache=cache,
            ):
                if stats is None:
                    bar.close()
                stats = response.stats
                if verbose and response.round is not shown:  # a new round: the one before has all its text
                    if shown is not None and shown.drafted:
                        echo(f" [{shown.accepted}/{shown.drafted}]", nl=False, err=True)
                        line_open = True
                    shown = response.round
                for note in [n for n in stats.notes if n not in said]:
                    echo(("\n" if line_open else "") + note, err=True)
                    said.add(note)
                    line_open = False
                echo(response.text, nl=False)
                line_open = not response.text.endswith("\n") if response.text else line_open
    except KeyboardInterrupt:
        bar.close()
        echo("\n" + "=" * 10, err=True)
        if stats is not None:
            stats.finish_reason = "interrupted"
            echo(stats.summary(verbose), err=True)
        sys.exit(130)
    echo()
    echo("=" * 10, err=True)
    echo(stats.summary(verbose), err=True)
    if shard:
        echo(ranks.summary(stats.rounds), err=True)
    if cache is not None and cache.save_file(prompt_cache_file, ids):
        echo(f"prompt cache: kept in {prompt_cache_file}", err=True)
