"""The `mlx-dflash` command line. User errors print as one line and exit with status 1."""

import sys

import click

from .errors import DFlashError


class _Group(click.Group):
    """Turns a DFlashError from any command into one line on stderr and exit status 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DFlashError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)


@click.group(cls=_Group)
@click.version_option(package_name="mlx-dflash")
def main():
    """DFlash block-diffusion speculative decoding on MLX."""


@main.command()
@click.option("--model", "model_path", help="Target: mlx-lm model directory or Hugging Face repo id.")
@click.option("--drafter", "drafter_path", help="DFlash drafter directory or Hugging Face repo id.")
@click.option("--prompt", required=True, help="Prompt text, or - to read it from stdin.")
@click.option("--max-tokens", default=256, show_default=True, type=int)
@click.option("--temp", default=0.0, show_default=True, type=float, help="0 means greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int, help="0 disables top-k.")
@click.option("--seed", default=None, type=int)
@click.option("--block-size", default=None, type=int, help="Verify width (default: the drafter's trained block).")
@click.option("--force-width", is_flag=True, help="Verify more than 5 rows on a quantized model anyway.")
@click.option("--chat-template/--no-chat-template", default=None, help="Default: on when the tokenizer has one.")
@click.option("--verbose", is_flag=True, help="Print per-round acceptance to stderr.")
def generate(model_path, drafter_path, prompt, max_tokens, temp, top_p, top_k, seed, block_size,
             force_width, chat_template, verbose):
    """Generate text with a target model and its DFlash drafter."""
    from .decoder import stream_generate
    from .load import load_pair
    from .sampling import SamplingParams

    if prompt == "-":
        prompt = sys.stdin.read()
    if not model_path or not drafter_path:
        raise DFlashError("give both --model and --drafter (a target model and a DFlash drafter for it)")
    sampling = SamplingParams(temp, top_p, top_k)
    target, drafter, tokenizer = load_pair(model_path, drafter_path)
    stats = None
    for response in stream_generate(
        target, drafter, tokenizer, prompt, max_tokens=max_tokens, sampling=sampling,
        block_size=block_size, force_width=force_width, seed=seed, chat_template=chat_template,
    ):
        if stats is None:
            for note in response.stats.notes:
                click.echo(note, err=True)
        stats = response.stats
        click.echo(response.text, nl=False)
        if verbose and response.round.drafted:
            click.echo(f" [{response.round.accepted}/{response.round.drafted}]", nl=False, err=True)
    click.echo()
    click.echo("=" * 10, err=True)
    click.echo(stats.summary(), err=True)


if __name__ == "__main__":
    main()
