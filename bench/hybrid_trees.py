"""A draft tree's verify against a chain's of as many rows, on a hybrid target and on its all-attention twin.

A hybrid target's recurrent layers run a tree as its paths from the anchor to each leaf, a path a batch row
(models/rollback.py), so a tree of n nodes costs those layers the tokens of all its paths, where attention layers
pay for n rows and a mask. This measures what that costs: bench/rollback.py's random-weight qwen3_5 (the published
hybrids' linear-attention sizes), and a qwen3 of the same width, depth, attention heads and MLP (every layer full
attention), each verifying n rows as a chain and as a tree of n nodes, then keeping a path of 3 (the anchor and two
drafts: off the tree's principal path where it has such a node), rollback included. The trees are what
decoding/tree.py `grow` ranks from candidates of probabilities --profile at every position; the table gives their
paths (leaves) and depth, on which a hybrid's cost depends (a tree that is one path runs here as a tree, where
decoding verifies it as a chain). Timed side by side in a shuffled order from the same
context; process-CPU medians (steadier on a shared machine) and wall-clock medians.

    python bench/hybrid_trees.py                 # -> bench/results/hybrid-trees-<device>/
    python bench/hybrid_trees.py --quick         # 2 repeats, smaller models
"""

import argparse
import random
import statistics
import sys

import mlx.core as mx
import mlx_lm
import numpy as np

from harness import command, device_tag, name_arg, results_dir, run_record, write_results
from mlx_dflash.decoding.tree import grow
from mlx_dflash.models.tree_verify import leaf_paths
from rollback import build_target, cache_arrays, hybrid_config, model_args, model_sizes, restore, saved, seconds

KEEP = 3  # the kept path: the anchor and two drafts


def tree_of(nodes: int, profile: list):
    """The TreeBlock of `nodes` nodes grown from candidates of these probabilities at every position, and the
    path it keeps (to a node at depth KEEP - 1, off the principal path where there is one)."""
    k, n = len(profile), nodes - 1
    ids = np.arange(n * k).reshape(1, n, k)
    probs = np.array([profile] * n)[None]
    block = grow(ids, probs, nodes, [n]).first(nodes, [0], [nodes])
    at_depth = [i for i in range(nodes) if block.depth[0, i] == KEEP - 1]
    return block, block.path(0, at_depth[-1])


def verify(target, cache, base, ids, block, kept):
    """(wall, CPU) seconds of one verify (a chain where block is None) and its rollback to `kept`."""
    def run():
        if block is None:
            mx.eval(target.forward(ids, cache), cache_arrays(cache))
        else:
            mx.eval(target.forward(ids, cache, block), cache_arrays(cache))
            target.keep_paths(cache, [kept], ids.shape[1])
        target.trim(cache, ids.shape[1] - len(kept))
        mx.eval(cache_arrays(cache))

    t = seconds(run)
    restore(cache, base)
    return t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_args(ap)
    ap.add_argument("--nodes", default="4,5,8,16", help="rows verified, comma-separated")
    ap.add_argument("--profile", default="0.6,0.2,0.1,0.05", help="candidate probabilities at every position")
    name_arg(ap, f"hybrid-trees-{device_tag()}")
    args = ap.parse_args(argv)
    model_sizes(args)
    sizes, profile = [int(n) for n in args.nodes.split(",")], [float(p) for p in args.profile.split(",")]

    models, trees = {}, {n: tree_of(n, profile) for n in sizes}
    hybrid = hybrid_config(args.hidden, args.layers, args.intermediate, args.vocab)
    dense = {k: hybrid[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                                    "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size",
                                    "tie_word_embeddings")}
    dense.update(model_type="qwen3", max_position_embeddings=4096, rope_theta=1e6)
    for name, config in (("hybrid", hybrid), ("attention only", dense)):
        target = build_target(config, 0)
        cache = target.make_cache()
        target.prefill(mx.random.randint(0, args.vocab, (args.context,)), cache)
        mx.eval(cache_arrays(cache))
        models[name] = (target, cache, saved(cache))
    ids = {n: mx.random.randint(0, args.vocab, (1, n)) for n in sizes}
    cases = [(m, n, shape) for m in models for n in sizes for shape in ("chain", "tree")]

    def run(case):
        m, n, shape = case
        block, kept = trees[n]
        return verify(*models[m], ids[n], block if shape == "tree" else None,
                      kept if shape == "tree" else list(range(KEEP)))

    times = {c: [] for c in cases}
    for c in cases:  # warm-up
        run(c)
    for r in range(args.repeats):
        order = list(cases)
        random.Random(r).shuffle(order)
        for c in order:
            times[c].append(run(c))
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)

    def ms(case, clock):
        return 1e3 * statistics.median(t[clock] for t in times[case])

    rows = []
    for m in models:
        for n in sizes:
            block = trees[n][0]
            paths = leaf_paths(block.depth, block.ancestors, block.alive).nodes.shape
            row = dict(model=m, nodes=n, leaves=paths[1], depth=paths[2] - 1)
            for clock, tag in ((0, "wall"), (1, "cpu")):
                row[f"chain_{tag}_ms"], row[f"tree_{tag}_ms"] = ms((m, n, "chain"), clock), ms((m, n, "tree"), clock)
                row[f"ratio_{tag}"] = row[f"tree_{tag}_ms"] / row[f"chain_{tag}_ms"]
            rows.append(row)

    meta = dict(config=hybrid, profile=profile,
                context=args.context, repeats=args.repeats, keep=KEEP, device=device_tag(), mlx=mx.__version__,
                mlx_lm=mlx_lm.__version__, command=command(__file__, argv))
    record = run_record(__file__, argv, meta=meta, rows=rows, raw={f"{m}:{n}:{s}": t for (m, n, s), t in times.items()})
    lines = ["| model | nodes | tree: leaves, depth | chain ms (CPU) | tree ms (CPU) | tree / chain, CPU "
             "| same, wall |", "|" + "---|" * 7]
    for r in rows:
        lines.append(f"| {r['model']} | {r['nodes']} | {r['leaves']}, {r['depth']} | {r['chain_cpu_ms']:.0f} | "
                     f"{r['tree_cpu_ms']:.0f} | {r['ratio_cpu']:.2f}x | {r['ratio_wall']:.2f}x |")
    table = "\n".join(lines)
    write_results(results_dir(args.name), "hybrid-trees", record,
                  f"context {args.context}, median of {args.repeats}; `{meta['command']}`\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
