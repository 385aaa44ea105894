"""Draft trees against chains: tau and tokens/s by rows verified, side by side in one run, on math, code and chat.

    python bench/trees.py --sets gsm8k-train.jsonl:7000,humaneval,mt-bench --num-prompts 3 --max-tokens 64
    python bench/trees.py --sets humaneval --num-prompts 1 --max-tokens 16 --rows 4,8 --name quick   # a smoke run
    python bench/trees.py --sets gsm8k-train.jsonl:7000 --quantize 4 --rows 5 --bare-rows 5   # a 4-bit target

For each prompt set (a named PyPI set or a file, `:N` its first prompt) and each number of rows verified, the
shipped pair (or --model / --drafter) decodes greedily at that fixed width as one path (`--no-tree`) and as a
tree of that many nodes (`--tree`), with prompt lookup (the default) and, at --bare-rows, without it (the
drafter alone, as ../shared research's offline estimate was made). mlx-lm's `generate_step` alone runs on the
same prompts: every output must equal it (a mismatch is printed and the exit status is 1). All configurations
of a prompt run in a random order (seeded), so machine drift spreads over them. Per configuration: tau (tokens
per verify round, bonus included) over all rounds, tokens/s (median over prompts), the tree over chain ratios
at each row count, and the accepted-length histograms. Writes trees.json and trees.png (tau by rows, chain
and tree, per set) into bench/results/<name>/, atomically; prints a markdown table. Timing as bench/e2e.py.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

from e2e import load_pairs, load_prompts, run_dflash, run_target_alone
from harness import name_arg, pair_args, results_dir, run_record, write_results
from mlx_dflash.decoding.prompt import encode_prompt
from mlx_dflash.downloads import default_target, shipped_drafter_dir
from mlx_dflash.plot import line_chart_png
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import WidthOptions
from mlx_dflash.utils import portable_path

SCHEMA = "mlx-dflash/bench-trees/1"


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    pair_args(ap)
    ap.add_argument("--sets", default="humaneval,mt-bench",
                    help="comma-separated prompt sets: mt-bench, humaneval, or a file; FILE:N starts at prompt N")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rows", default="4,5,8,12,16", help="rows verified (anchor included), comma-separated")
    ap.add_argument("--bare-rows", default="8,16", help="rows also run without prompt lookup ('' for none)")
    ap.add_argument("--quantize", type=int, choices=[0, 4, 8], default=0,
                    help="run on the target quantized in memory to this many bits (group 64), as bench/e2e.py does")
    ap.add_argument("--seed", type=int, default=0, help="seed of the interleaving order")
    name_arg(ap, "trees-cpu")
    return ap.parse_args(argv)


def configurations(rows: list, bare: list) -> list:
    out = [{"name": "target alone", "rows": 1}]
    for lookup, counts in ((True, rows), (False, bare)):
        for n in counts:
            for tree in (False, True):
                name = f"{'tree' if tree else 'chain'} {n}" + ("" if lookup else " (drafter only)")
                out.append({"name": name, "rows": n, "tree": tree, "lookup": lookup})
    return out


def run(pair: dict, cfg: dict, ids: list, max_tokens: int) -> dict:
    if cfg["rows"] == 1:
        return run_target_alone(pair["target"].model, pair["tokenizer"], ids, max_tokens)
    options = WidthOptions(cfg["rows"], force_width=True, prompt_lookup=cfg["lookup"], tree=cfg["tree"])
    return run_dflash(pair, build_policy(pair["target"], pair["drafter"], options), ids, max_tokens)


def summarize(configs: list, runs: list) -> list:
    out = []
    for name in dict.fromkeys(r["set"] for r in runs):
        for cfg in configs:
            mine = [r for r in runs if r["set"] == name and r["config"] == cfg["name"]]
            rounds = sum(r["rounds"] for r in mine)
            tokens = sum(r["generated_tokens"] - 1 for r in mine)
            hist = {}
            for r in mine:
                for k, n in r["accepted_lengths"].items():
                    hist[k] = hist.get(k, 0) + n
            out.append({"set": name, **cfg, "tau": tokens / rounds if rounds else 1.0,
                        "tps_median": statistics.median(r["decode_tps"] for r in mine),
                        "identical": sum(r["identical"] for r in mine), "runs": len(mine),
                        "tree_rounds": sum(r.get("tree_rounds", 0) for r in mine), "rounds": rounds,
                        "accepted_lengths": dict(sorted(hist.items(), key=lambda kv: int(kv[0])))})
    by = {(s["set"], s["name"]): s for s in out}
    for s in out:
        if s.get("tree"):
            chain = by[s["set"], s["name"].replace("tree", "chain")]
            s["tau_over_chain"] = s["tau"] / chain["tau"]
            s["tps_over_chain"] = s["tps_median"] / chain["tps_median"]
    return out


def markdown(summary: list) -> str:
    lines = ["| set | configuration | tau | tokens/s | tree / chain tau | tree / chain tokens/s | identical |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for s in summary:
        ratios = (f"{s['tau_over_chain']:.2f}x | {s['tps_over_chain']:.2f}x" if "tau_over_chain" in s else "- | -")
        lines.append(f"| {s['set']} | {s['name']} | {s['tau']:.2f} | {s['tps_median']:.1f} | {ratios} "
                     f"| {s['identical']}/{s['runs']} |")
    return "\n".join(lines)


def chart(summary: list) -> bytes:
    curves = {}
    for s in summary:
        if s["rows"] > 1 and s["lookup"]:
            xs, ys = curves.setdefault(f"{s['set']}: {'tree' if s['tree'] else 'chain'}", ([], []))
            xs.append(s["rows"])
            ys.append(s["tau"])
    return line_chart_png(curves, "rows verified (anchor included)", "tau (tokens per round)")


def main(argv=None) -> int:
    args = parse_args(argv)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    model, drafter = args.model or str(default_target()), args.drafter or str(shipped_drafter_dir())
    pairs = load_pairs(model, drafter, args.quantize, False)
    pair = pairs[f"q{args.quantize}"] if args.quantize else pairs["float"]
    rows = [int(n) for n in args.rows.split(",")]
    bare = [int(n) for n in args.bare_rows.split(",") if n]
    configs = configurations(rows, bare)
    sets = {}
    for spec in args.sets.split(","):
        path, _, start = spec.partition(":")
        _, prompts = load_prompts(path, int(start or 0), args.num_prompts)
        sets[Path(path).stem] = [encode_prompt(pair["tokenizer"], p, chat_template=None) for p in prompts]
    first = next(iter(sets.values()))[0]
    for cfg in configs:  # warm-up, untimed
        run(pair, cfg, first, 16)
    order, runs, mismatches = random.Random(args.seed), [], 0
    for name, prompts in sets.items():
        for i, ids in enumerate(prompts):
            batch = list(configs)
            order.shuffle(batch)
            done = {cfg["name"]: run(pair, cfg, ids, args.max_tokens) for cfg in batch}
            base = done["target alone"]["tokens"]
            for cfg in configs:
                r = done[cfg["name"]]
                r.update(set=name, prompt=i, config=cfg["name"], identical=r["tokens"] == base)
                if not r["identical"]:
                    mismatches += 1
                    log(f"!!!!! MISMATCH: {name} prompt {i} {cfg['name']} differs from the target alone !!!!!")
                runs.append(r)
            log(f"[{name} {i + 1}/{len(prompts)}] " + "  ".join(
                f"{c['name']} {done[c['name']]['tau']:.2f}/{done[c['name']]['decode_tps']:.0f}" for c in configs))
    summary = summarize(configs, runs)
    results = run_record(__file__, argv, schema=SCHEMA, model=portable_path(model), drafter=portable_path(drafter),
                         settings=vars(args), summary=summary,
                         runs=[{k: v for k, v in r.items() if k != "tokens"} for r in runs], mismatches=mismatches)
    out = results_dir(args.name)
    write_results(out, "trees", results, chart=lambda: chart(summary))
    print(markdown(summary))
    log(f"wrote {out}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
