"""Drafter shapes side by side, from random weights: trained block 16 against 8, one layer against two.

    python bench/drafter_shapes.py --gsm8k ../shared/data/gsm8k/train.jsonl --steps 300
    python bench/drafter_shapes.py --gsm8k ../shared/data/gsm8k/train.jsonl --num-prompts 4 --eval-sequences 2 \
        --steps 2 --eval-every 1 --sequences 1 --anchors 4 --shapes b16-l1,b8-l1 --name quick    # smoke run

Two questions about drafter shapes: does a drafter trained at block 16 and run at 8 draft about as well
as one trained at 8, as the DFlash paper's block-size ablation finds (../shared/seeds/draft-length-tuning.txt),
so that one drafter serves every width; and does a second layer pay for its cost at equal CPU time on a
small target. Each shape (`--shapes`, default b16-l1,
b8-l1, b16-l2: block size and layers) trains from random weights on the same answers (the target's own, to
`--num-prompts` GSM8K training problems from `--first`, kept in `--data`: the committed
bench/data/smollm2-gsm8k-train-from-1840-answers.jsonl by default, made where missing), with the same
steps, seed and learning rate, one `mlx-dflash train` run each; held-out tau is measured on the target's
own answers to problems 7000-7047 (kept in `--eval-data`) during training (at the drafter's own block, against training
CPU time) and at the end at every width up to the drafter's block. The table gives each run's final tau at
widths 4, 8 and 16 and, for every shape, its tau@16 interpolated at the CPU time of the cheapest run
(equal CPU time). Writes shapes.json, shapes.md and shapes.png into bench/results/<name>/.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from harness import name_arg, results_dir, run_record, train, training_args, write_results
from mlx_dflash.downloads import default_target
from mlx_dflash.plot import line_chart_png
from mlx_dflash.utils import portable_path

SCHEMA = "mlx-dflash/bench-drafter-shapes/1"
DATA = Path(__file__).parent / "data"  # the target's answers, committed once made
WIDTHS = (4, 8, 16)


def shape_of(name: str) -> tuple:
    """'b16-l1' -> (block size 16, 1 layer)."""
    try:
        block, layers = name.split("-")
        return int(block.removeprefix("b")), int(layers.removeprefix("l"))
    except ValueError:
        raise SystemExit(f"a shape is b<block>-l<layers> (b16-l1, say), not {name!r}") from None


HELD_OUT_FIRST = 7000


def slices(gsm8k: Path, work: Path, args) -> tuple:
    """The training and held-out prompt files, cut from GSM8K's training split."""
    lines = gsm8k.read_text().splitlines()
    prompts, held_out = work / "prompts.jsonl", work / "held-out.jsonl"
    prompts.write_text("\n".join(lines[args.first : args.first + args.num_prompts]) + "\n")
    held_out.write_text("\n".join(lines[HELD_OUT_FIRST : HELD_OUT_FIRST + args.eval_sequences]) + "\n")
    return prompts, held_out


def shape_flags(shape: str, args, files: tuple) -> list:
    """`mlx-dflash train`'s flags for one shape, from random weights (no --init)."""
    block, layers = shape_of(shape)
    return ["--prompts", str(files[0]), "--data", args.data, "--eval-prompts", str(files[1]), "--eval-data",
            args.eval_data, "--block-size", str(block), "--layers", str(layers), "--target-features",
            str(args.target_features)]


def final_taus(target, tokenizer, drafter_dir: Path, args) -> dict:
    """Held-out tau at each width up to the drafter's block, replayed on the target's answers."""
    from mlx_dflash.models.loader import drafter_from_dir
    from mlx_dflash.tuner.data import iter_sequences, read_samples
    from mlx_dflash.tuner.replay import decoding_acceptance

    drafter = drafter_from_dir(drafter_dir).bind(target)
    samples = sorted(read_samples(args.eval_data), key=lambda s: s["index"])[: args.eval_sequences]
    widths = tuple(w for w in WIDTHS if w <= drafter.block_size)
    scores = decoding_acceptance(drafter, target, list(iter_sequences(samples)), widths=widths)
    return {str(w): scores[w]["tau"] for w in widths}


def at_cpu(history: list, seconds: float) -> float:
    """tau at `seconds` of training CPU, linearly between the evaluations around it (the last past it)."""
    points = [(h["cpu_seconds"], h["tau"]) for h in history]
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if s0 <= seconds <= s1:
            return t0 + (t1 - t0) * (seconds - s0) / (s1 - s0)
    return points[0][1] if seconds < points[0][0] else points[-1][1]


def table(runs: dict) -> str:
    equal = min(run["history"][-1]["cpu_seconds"] for run in runs.values())
    lines = [f"| shape | steps | training CPU s | tau@4 | tau@8 | tau@16 | tau@own block at {equal:.0f} CPU s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for shape, run in runs.items():
        last, final = run["history"][-1], run["final"]
        cells = [f"{final[str(w)]:.3f}" if str(w) in final else "-" for w in WIDTHS]
        lines.append(f"| {shape} | {last['step']} | {last['cpu_seconds']:.0f} | {' | '.join(cells)} | "
                     f"{at_cpu(run['history'], equal):.3f} |")
    return "\n".join(lines) + "\n"


def chart(runs: dict) -> bytes:
    curves = {shape: ([h["cpu_seconds"] / 3600 for h in run["history"]], [h["tau"] for h in run["history"]])
              for shape, run in runs.items()}
    return line_chart_png(curves, "training CPU-hours", "held-out tau at the drafter's own block")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gsm8k", required=True, help="GSM8K's training split (JSONL of question/answer)")
    ap.add_argument("--first", type=int, default=1840, help="the first training problem")
    ap.add_argument("--num-prompts", type=int, default=960, help="training problems")
    ap.add_argument("--data", default=str(DATA / "smollm2-gsm8k-train-from-1840-answers.jsonl"),
                    help="JSONL of the target's answers to them (made where missing)")
    ap.add_argument("--eval-data", default=str(DATA / "smollm2-gsm8k-train-7000-7047-answers.jsonl"),
                    help="JSONL of the target's answers to the held-out problems (made where missing)")
    ap.add_argument("--shapes", default="b16-l1,b8-l1,b16-l2")
    ap.add_argument("--target-features", type=int, default=4)
    training_args(ap, steps=300, sequences=2, anchors=32, lr=3e-4, eval_every=100, eval_sequences=48)
    name_arg(ap, "drafter-shapes-cpu")
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    for shape in shapes:
        shape_of(shape)

    from mlx_dflash.pair import load_target

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        files = slices(Path(args.gsm8k), Path(tmp), args)
        for shape in shapes:
            runs[shape] = {"history": train(shape, shape_flags(shape, args, files), args, Path(tmp) / shape)}
        target, tokenizer = load_target(default_target(None))
        for shape in shapes:
            runs[shape]["final"] = final_taus(target, tokenizer, Path(tmp) / shape, args)
            print(f"{shape}: {runs[shape]['final']}", flush=True)
    paths = ("gsm8k", "data", "eval_data")
    settings = {**vars(args), **{p: portable_path(getattr(args, p)) for p in paths}}
    result = run_record(__file__, argv, schema=SCHEMA, settings=settings, runs=runs)
    write_results(results_dir(args.name), "shapes", result, table(runs), chart=lambda: chart(runs))
    print(table(runs))


if __name__ == "__main__":
    main()
