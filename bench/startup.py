"""Start-up time of `mlx-dflash serve`: seconds from launching it to its first `/health` answer, this working
tree against another revision, alternated on the same machine.

    python bench/startup.py --base ee0c43b            # the default pair, 3 starts each
    python bench/startup.py --base HEAD~1 --repeats 1 --server-flag=--width=4

Each start is a fresh `mlx-dflash serve` process on a free loopback port (the revision checked out with `git
worktree`, as bench/revisions.py does), stopped once it answers. Prints the seconds of each start and the
medians, and writes startup.json into bench/results/<name>/.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, name_arg, results_dir, run_record, write_results
from revisions import checkout, commit_of
from servers import dflash_server

SCHEMA = "mlx-dflash/bench-startup/1"


def start_seconds(tree: Path | None, flags: list, log: Path) -> float:
    tic = time.perf_counter()
    server = dflash_server(flags, log, tree=tree)
    try:
        server.wait_ready()
        return time.perf_counter() - tic
    finally:
        server.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the revision to compare this working tree with")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--server-flag", action="append", default=[], help="an `mlx-dflash serve` flag (repeatable)")
    name_arg(ap, "startup-cpu")
    args = ap.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="mlx-dflash-bench-startup-"))
    trees = {f"base {commit_of(args.base)}": checkout(args.base, scratch), "working tree": None}
    seconds = {name: [] for name in trees}
    try:
        for _ in range(args.repeats):
            for name, tree in trees.items():
                seconds[name].append(start_seconds(tree, args.server_flag, scratch / "serve.log"))
                print(f"{name}: {seconds[name][-1]:.2f} s", flush=True)
    finally:
        for tree in trees.values():
            if tree is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    print("median seconds to the first /health answer: " + ", ".join(f"{n} {s:.2f}" for n, s in medians.items()))
    record = run_record(__file__, argv, schema=SCHEMA, flags=args.server_flag, seconds=seconds, median_seconds=medians)
    write_results(results_dir(args.name), "startup", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
