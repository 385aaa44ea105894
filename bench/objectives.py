"""Training objectives side by side: the same data, steps and start, one `mlx-dflash train` run each.

    python bench/objectives.py --prompts gsm8k-train.jsonl --data ANSWERS.jsonl --steps 150
    python bench/objectives.py --prompts gsm8k-train.jsonl --data ANSWERS.jsonl --steps 4 --eval-every 2 \
        --sequences 1 --anchors 4 --name quick                                     # smoke run

Each objective (`--objectives`, default decay, verified and variable-prefix) trains a drafter from the
same start (`--init`, default the shipped drafter; `--init none`: random weights) on the same answers
(`--data`, the target's own, made by `mlx-dflash train` when missing) for the same steps, with the same
seed, so the runs differ only in the loss. Every `--eval-every` steps the trainer measures held-out tau at
the drafter's block on the first `--eval-sequences` answers, which no run trains on. Writes
objectives.json (every evaluation: step, tau, P(draft k kept), training CPU seconds), objectives.md and
objectives.png (held-out tau against training CPU-hours, a line per objective) into bench/results/<name>/.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from harness import name_arg, results_dir, run_record, train, training_args, write_results
from mlx_dflash.downloads import shipped_drafter_dir
from mlx_dflash.plot import line_chart_png
from mlx_dflash.utils import portable_path

SCHEMA = "mlx-dflash/bench-objectives/1"


def objective_flags(objective: str, args) -> list:
    """`mlx-dflash train`'s flags for one objective: the data, the objective, the start drafter."""
    flags = ["--prompts", args.prompts, "--data", args.data, "--objective", objective]
    flags += ["--num-prompts", str(args.num_prompts)] if args.num_prompts else []
    return flags + (["--init", args.init or str(shipped_drafter_dir())] if args.init != "none" else [])


def table(runs: dict) -> str:
    lines = ["| objective | step | held-out tau | P(draft 1..4 kept) | training CPU s |", "|---|---:|---:|---|---:|"]
    for objective, history in runs.items():
        for h in history:
            kept = " ".join(f"{p:.2f}" for p in h["per_position"][:4])
            lines.append(f"| {objective} | {h['step']} | {h['tau']:.3f} | {kept} | {h['cpu_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def chart(runs: dict) -> bytes:
    curves = {objective: ([h["cpu_seconds"] / 3600 for h in history], [h["tau"] for h in history])
              for objective, history in runs.items()}
    return line_chart_png(curves, "training CPU-hours", "held-out tau")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True, help="the prompts the answers in --data belong to")
    ap.add_argument("--data", required=True, help="JSONL of the target's answers (made when missing)")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--objectives", default="decay,verified,variable-prefix")
    ap.add_argument("--init", default=None, help="start drafter (default: the shipped one; none: random weights)")
    # --lr 3e-4: `mlx-dflash train`'s own default
    training_args(ap, steps=150, sequences=2, anchors=32, lr=3e-4, eval_every=50, eval_sequences=32)
    name_arg(ap, "objectives-cpu")
    args = ap.parse_args(argv)

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for objective in args.objectives.split(","):
            runs[objective] = train(objective, objective_flags(objective, args), args, Path(tmp) / objective)
    settings = {**vars(args), "prompts": portable_path(args.prompts), "data": portable_path(args.data)}
    result = run_record(__file__, argv, schema=SCHEMA, settings=settings, runs=runs)
    write_results(results_dir(args.name), "objectives", result, table(runs), chart=lambda: chart(runs))
    print(table(runs))


if __name__ == "__main__":
    main()
