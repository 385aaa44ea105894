"""One rank of a sharded test run (started by mlx.launch): decode every case of a JSON case list with the
target sharded over the launched group, and write this rank's tokens to OUT/rank<r>.json.

usage: python sharded_worker.py MODEL DRAFTER tensor|pipeline CASES.json OUT
A case: {"name", "prompt" (token ids), "max_tokens", "block_size", "p_min", "auto", "tree", "temp", "seed",
"seed_per_rank" (seed + rank: the ranks' random states differ, as without a seed)}.
"""

import json
import sys
from pathlib import Path

from mlx_dflash.generate import generate
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import WidthOptions
from mlx_dflash.distributed import Ranks, load_sharded_pair


def main(model, drafter_dir, mode, cases_file, out):
    target, drafter, tokenizer, group = load_sharded_pair(model, drafter_dir, mode)
    results = {}
    for case in json.loads(Path(cases_file).read_text()):
        policy = build_policy(target, drafter, WidthOptions("auto" if case.get("auto") else case.get("block_size"),
                                                            p_min=case.get("p_min", 0.0), tree=case.get("tree")))
        ranks = Ranks(group, policy.block_size, mode == "pipeline")
        seed = case.get("seed")
        if seed is not None and case.get("seed_per_rank"):
            seed += group.rank()
        with ranks.watch():
            text = generate(target, drafter, tokenizer, case["prompt"], max_tokens=case["max_tokens"],
                            temp=case.get("temp", 0.0), policy=policy, seed=seed, ranks=ranks)
            tokens, stats = text.tokens, text.stats
        results[case["name"]] = dict(tokens=tokens, widths=dict(stats.widths), accepted=sum(
            (n - 1) * c for n, c in stats.accepted_lengths.items()), exchanges=ranks.exchanges, notes=stats.notes,
            routes=stats.routes, tree_rounds=stats.tree_rounds)
    Path(out, f"rank{group.rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
