"""The drafter's context window (`--drafter-window N`) against acceptance and speed at long contexts.

    python bench/drafter_window.py                                   # ~2k, 4k and 6k tokens, windows all..64
    python bench/drafter_window.py --contexts 600 --windows all,64 --max-tokens 24 --repeats 1 --name quick

The long prompts of bench/long_context.py (held-out GSM8K problems as one document, then the next to solve;
the source of `inspect`, then a question on it) are read once each; then every window decodes `--max-tokens`
greedily from that read prompt at a fixed width (`--width`, default 16, so the window alone moves acceptance),
`--repeats` times in a shuffled order per repeat, with prompt lookup off (it drafts without the drafter).
Per window: tau (tokens per verify round) and decode tokens/s (after the first token), medians, and the
speed ratio to the drafter attending to the whole context ("all"). Outputs must all be the same (the window
changes drafts, never the text); the exit status is 1 if not. Writes drafter_window.json and a markdown
table into bench/results/<name>/.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

from harness import gsm8k_arg, held_out_gsm8k, lossless_status, name_arg, results_dir, run_record, write_results
from long_context import code_prompt, decode_rate, gsm8k_prompt, ours
from mlx_dflash import load
from mlx_dflash.errors import DFlashError
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import WidthOptions
from mlx_dflash.decoding.prompt_cache import PromptCache, pair_identity

SCHEMA = "mlx-dflash/bench-drafter-window/1"


def measure(pair, ids: list, windows: list, args, seed: int, log) -> dict:
    target, drafter, _ = pair
    cache = PromptCache(pair_identity(target, drafter), target.trimmable)
    ours(pair, ids, 1, build_policy(target, drafter, WidthOptions(args.width, prompt_lookup=False)), cache)  # read once
    runs, rng = [], random.Random(seed)
    for repeat in range(args.repeats):
        for window in rng.sample(windows, len(windows)):
            drafter.set_context_window(None if window == "all" else int(window))
            policy = build_policy(target, drafter, WidthOptions(args.width, prompt_lookup=False))
            tokens, _, seconds, stats = ours(pair, ids, args.max_tokens, policy, cache)
            runs.append({"window": window, "repeat": repeat, "tokens": tokens, "tau": stats.tau,
                         "decode_tps": decode_rate(tokens, seconds)})
            log(f"  repeat {repeat} window {window}: tau {stats.tau:.2f}, {runs[-1]['decode_tps']:.2f} tokens/s")
    drafter.set_context_window(None)
    return {"prompt_tokens": len(ids), "runs": runs}


def summary(prompt: dict, windows: list) -> dict:
    med = {w: {k: statistics.median(r[k] for r in prompt["runs"] if r["window"] == w) for k in ("tau", "decode_tps")}
           for w in windows}
    return {w: {**m, "speed_vs_all": m["decode_tps"] / med["all"]["decode_tps"]} for w, m in med.items()}


def table(prompts: list, windows: list) -> str:
    lines = ["| prompt | tokens | " + " | ".join(f"window {w}" for w in windows) + " |",
             "|---|---:|" + "---:|" * len(windows), ]
    for p in prompts:
        s = p["summary"]
        lines.append(f"| {p['kind']} | {p['prompt_tokens']} | " + " | ".join(
            f"tau {s[w]['tau']:.2f}, {s[w]['decode_tps']:.2f} tok/s ({s[w]['speed_vs_all']:.2f}x)" for w in windows)
            + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="2000,4000,6000")
    ap.add_argument("--kinds", default="gsm8k,code")
    ap.add_argument("--windows", default="all,2048,512,128,32", help="'all' (no window) and window sizes")
    gsm8k_arg(ap)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    name_arg(ap, "drafter-window-cpu")
    args = ap.parse_args(argv)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    windows = args.windows.split(",")
    try:
        if windows[0] != "all" or not all(w.isdigit() and int(w) > 0 for w in windows[1:]):
            raise DFlashError("--windows starts with 'all', then positive window sizes")
        rows = held_out_gsm8k(args.gsm8k)
        pair = load()
        prompts = []
        prompt_kinds = [(k, int(n)) for n in args.contexts.split(",") for k in args.kinds.split(",")]
        for i, (kind, length) in enumerate(prompt_kinds):
            ids = gsm8k_prompt(pair[2], rows, length) if kind == "gsm8k" else code_prompt(pair[2], length)
            log(f"{kind} prompt of {len(ids)} tokens")
            p = {"kind": kind, **measure(pair, ids, windows, args, i, log)}
            p["summary"] = summary(p, windows)
            prompts.append(p)
    except (DFlashError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mismatches = sum(r["tokens"] != p["runs"][0]["tokens"] for p in prompts for r in p["runs"])
    results = run_record(__file__, argv, schema=SCHEMA, settings={**vars(args), "gsm8k": "GSM8K train.jsonl"},
                         mismatches=mismatches, prompts=prompts)
    write_results(results_dir(args.name), "drafter_window", results, table(prompts, windows))
    log("\n" + table(prompts, windows))
    return lossless_status(mismatches, "generation(s) differ between windows")


if __name__ == "__main__":
    sys.exit(main())
