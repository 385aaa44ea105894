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
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_dflash.downloads import shipped_drafter_dir  # noqa: E402
from mlx_dflash.machine import machine_info, versions  # noqa: E402
from mlx_dflash.plot import charts_available, line_chart_png  # noqa: E402
from mlx_dflash.utils import portable_path, write_atomic  # noqa: E402

SCHEMA = "mlx-dflash/bench-objectives/1"


def train(objective: str, args, out: Path) -> list:
    """One training run; returns its evaluations (trainer_state.json's history)."""
    command = [sys.executable, "-m", "mlx_dflash.cli", "train", "--prompts", args.prompts, "--data", args.data,
               "--out", str(out), "--objective", objective, "--steps", str(args.steps),
               "--sequences", str(args.sequences), "--anchors", str(args.anchors),
               "--eval-every", str(args.eval_every), "--eval-sequences", str(args.eval_sequences),
               "--seed", str(args.seed)]
    if args.num_prompts:
        command += ["--num-prompts", str(args.num_prompts)]
    if args.init != "none":
        command += ["--init", args.init or str(shipped_drafter_dir())]
    print(f"{objective}: {' '.join(command[3:])}", flush=True)
    subprocess.run(command, check=True)
    return json.loads((out / "trainer_state.json").read_text())["history"]


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
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-sequences", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="objectives-cpu", help="results go to bench/results/<name>/")
    args = ap.parse_args(argv)

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for objective in args.objectives.split(","):
            runs[objective] = train(objective, args, Path(tmp) / objective)
    out = Path(__file__).parent / "results" / args.name
    out.mkdir(parents=True, exist_ok=True)
    settings = {**vars(args), "prompts": portable_path(args.prompts), "data": portable_path(args.data)}
    shown = [portable_path(a) if Path(a).expanduser().exists() else a for a in (argv or sys.argv[1:])]
    result = {"schema": SCHEMA, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "versions": versions(), "settings": settings,
              "command": "python bench/objectives.py " + " ".join(shown),
              "runs": runs}
    write_atomic(out / "objectives.json", json.dumps(result, indent=1) + "\n")
    write_atomic(out / "objectives.md", table(runs))
    if charts_available():
        write_atomic(out / "objectives.png", chart(runs))
    print(table(runs))


if __name__ == "__main__":
    main()
