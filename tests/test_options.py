"""The shared command-line option groups (mlx_dflash/options.py): each reaches a command as one value,
checked before the command runs."""

import click
from click.testing import CliRunner

from mlx_dflash.cli import _Group
from mlx_dflash.decoding.sampling import SamplingParams
from mlx_dflash.options import KVOptions, ShardOptions, kv_options, sampling_options, shard_options, width_options
from mlx_dflash.policies.width import WidthOptions


def command_seeing(seen: list):
    @click.group(cls=_Group)
    def cli():
        pass

    @cli.command()
    @click.option("--other", default=1, type=int)
    @sampling_options
    @width_options
    @kv_options
    @shard_options
    def run(other, sampling, widths, kv, shard):
        seen.append((other, sampling, widths, kv, shard))

    return cli


def test_each_group_reaches_the_command_as_one_value():
    seen = []
    result = CliRunner().invoke(command_seeing(seen), ["run", "--other", "3", "--temp", "0.5", "--top-k", "4",
                                                       "--width", "auto", "--n-max", "5", "--no-prompt-lookup",
                                                       "--kv-bits", "4", "--shard", "pipeline"])
    assert result.exit_code == 0, result.output
    assert seen == [(3, SamplingParams(0.5, top_k=4), WidthOptions("auto", n_max=5, prompt_lookup=False),
                     KVOptions(4, 64, 5000), ShardOptions("pipeline", 300.0))]
    CliRunner().invoke(command_seeing(seen), ["run"])
    assert seen[-1] == (1, SamplingParams(), WidthOptions(), KVOptions(), ShardOptions())
    assert not seen[-1][4] and seen[-2][4]  # no --shard: not sharded


def test_a_contradiction_in_a_group_is_one_line_before_the_command_runs():
    seen = []
    for args, words in [(["--width", "3", "--n-max", "4"], "disagree"), (["--temp", "-1"], "--temp must be >= 0"),
                        (["--width", "4", "--cost-table", "t.json"], "leave one of them out"),
                        (["--shard", "tensor", "--rank-timeout", "0"], "--rank-timeout must be positive")]:
        result = CliRunner().invoke(command_seeing(seen), ["run", *args])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0]
    assert seen == []
    CliRunner().invoke(command_seeing(seen), ["run", "--rank-timeout", "0"])  # no --shard: the timeout is unused
    assert len(seen) == 1


def test_the_default_width_is_auto_unless_n_max_or_a_seeded_sample_fixes_it():
    assert WidthOptions().with_default() == WidthOptions("auto")
    assert WidthOptions(n_max=3).with_default() == WidthOptions(n_max=3)
    assert WidthOptions().with_default(seeded_sample=True) == WidthOptions()
    assert WidthOptions(4).with_default() == WidthOptions(4)
