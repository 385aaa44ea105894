"""Two revisions of this repository side by side in one run: the same greedy workload through each one's public
Python API, alternated, so that a change is measured against the commit before it on the same (noisy) machine.

    python bench/revisions.py --base HEAD~1 --prompts gsm8k-train.jsonl --first 7000 --num-prompts 3
    python bench/revisions.py --base HEAD~1 --num-prompts 1 --max-tokens 8 --repeats 1 --name quick  # a smoke run
    python bench/revisions.py --base HEAD~1 --prompts editing --trees --name quick-trees  # draft trees, editing

Each revision (`--base` and `--head`, default the working tree) is checked out into a temporary folder (`git
worktree`) and every measurement runs in a fresh process importing that revision alone (bench/revisions_child.py):
it loads the pair, runs one short warm-up of the same configuration, then times the workload. Configurations, each
as one call of that revision's API: mlx-lm alone (`generate_step`, the anchor both are divided by), `generate` at
width auto, 4 and 16 (one request at a time; decode tokens/s = (tokens - 1) / seconds from the first token to the
last, as `GenerationStats.decode_tps`), and `batch_generate` at width auto over all the prompts at once (tokens /
wall seconds, the prompts' reading included); with --trees also `generate(tree=True)` at width 8 and auto.
--prompts editing takes bench/editing.py's editing requests (whole HumanEval functions to change and return)
instead of GSM8K's questions. The order of revisions is alternated within every configuration and repeat. Every
greedy output must equal mlx-lm's (a mismatch is printed and the exit status is 1). Writes revisions.json and
revisions.md into bench/results/<name>/ and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx_dflash
from editing import editing_prompts, functions
from harness import GSM8K, ROOT, alternate, name_arg, results_dir, run_record, write_results
from mlx_dflash.decoding.prompt import encode_prompt
from revisions_child import TREES

CONFIGS = ("mlx-lm alone", "width auto", "width 4", "width 16", "batch, width auto")
CHILD = Path(__file__).resolve().with_name("revisions_child.py")


def commit_of(revision: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", revision], capture_output=True,
                          text=True).stdout.strip()


def checkout(revision: str, folder: Path) -> Path:
    """`revision` as a tree of its own under `folder` ("" : this working tree as it is)."""
    if not revision:
        return ROOT
    path = folder / revision.replace("/", "_").replace("~", "-")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), revision], check=True)
    return path


def measure(tree: Path, spec: dict) -> dict:
    """One configuration on `tree`'s revision: bench/revisions_child.py in a process importing that tree alone."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, str(CHILD), json.dumps(spec)], env=env,
                          cwd=tempfile.gettempdir(), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree}: {spec['config']} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def prompt_ids(path: str, first: int, count: int) -> list:
    """GSM8K questions `first`.. (or "editing": bench/editing.py's) as chat-template token ids of the default
    target."""
    _, _, tokenizer = mlx_dflash.load()
    if path == "editing":
        texts = editing_prompts(functions(), first + count)[first:]
    else:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()[first:first + count]]
        texts = [r.get("question") or r["prompt"] for r in rows]
    return [encode_prompt(tokenizer, text, chat_template=True) for text in texts]


def table(results: dict, revisions: list, configs: tuple) -> str:
    lines = ["| configuration | " + " | ".join(f"{r} tok/s (vs mlx-lm)" for r in revisions) + " | head / base |",
             "|---|" + "---:|" * (len(revisions) + 1)]
    anchor = {r: results[r]["mlx-lm alone"] for r in revisions}
    for config in configs:
        cells = [f"{results[r][config]:.2f} ({results[r][config] / anchor[r]:.2f}x)" for r in revisions]
        ratio = results[revisions[1]][config] / results[revisions[0]][config]
        lines.append(f"| {config} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD~1", help="the revision measured against (default HEAD~1)")
    ap.add_argument("--head", default="", help="the revision measured (default: this working tree)")
    ap.add_argument("--prompts", default=str(GSM8K),
                    help="GSM8K-style JSONL (question per line), or 'editing' (bench/editing.py's editing "
                    "requests); default ../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--first", type=int, default=None,
                    help="first prompt (default: GSM8K line 7000, never trained on; editing: 0)")
    ap.add_argument("--trees", action="store_true", help="also draft trees (tree=True) at width 8 and auto")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    name_arg(ap, "revisions-cpu")
    args = ap.parse_args(argv)
    args.first = args.first if args.first is not None else 0 if args.prompts == "editing" else 7000
    configs = CONFIGS + (TREES if args.trees else ())
    ids = prompt_ids(args.prompts, args.first, args.num_prompts)
    revisions = [args.base, args.head or "working tree"]
    # resolved now: HEAD may move while the revisions run
    commits = [commit_of(args.base), commit_of(args.head) if args.head else "working tree"]
    with tempfile.TemporaryDirectory() as folder:
        trees = [checkout(args.base, Path(folder)), checkout(args.head, Path(folder))]
        try:
            runs, bad, reference = {r: {c: [] for c in configs} for r in revisions}, 0, None
            for repeat in range(args.repeats):
                for i, config in enumerate(configs):  # mlx-lm alone first: its output is the reference
                    for k in alternate([0, 1], repeat + i):
                        got = measure(trees[k], {"prompts": ids, "max_tokens": args.max_tokens, "config": config})
                        runs[revisions[k]][config].append(got["tps"])
                        reference = reference or got["tokens"]
                        if got["tokens"] != reference:
                            bad += 1
                            print(f"MISMATCH: {revisions[k]} {config} differs from mlx-lm's output", file=sys.stderr)
                        print(f"{revisions[k]:>14} {config:>18}: {got['tps']:.2f} tok/s", file=sys.stderr)
        finally:
            for tree in trees:
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])
    medians = {r: {c: statistics.median(v) for c, v in runs[r].items()} for r in revisions}
    md = table(medians, revisions, configs)
    record = run_record(__file__, argv, base=args.base, base_commit=commits[0], head=args.head, head_commit=commits[1],
                        prompts=Path(args.prompts).name, first=args.first, num_prompts=args.num_prompts,
                        trees=args.trees, max_tokens=args.max_tokens, repeats=args.repeats, runs=runs,
                        medians=medians, mismatches=bad)
    write_results(results_dir(args.name), "revisions", record, md)
    print(md)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
