"""Long contexts: decode speed and prompt reading against mlx-lm alone as the context grows, greedy, side by side.

    python bench/long_context.py                                  # ~2k, 4k and 6k tokens, two kinds of prompt
    python bench/long_context.py --contexts 600,1200 --max-tokens 24 --repeats 1 --name quick   # a smoke run

Prompts, each built up to a length in tokens (chat template applied):
* gsm8k: held-out GSM8K problems with their reference solutions (train.jsonl lines 7000 on, past the problems
  the shipped drafter was trained on; ../shared/data/gsm8k or --gsm8k) as one document, then the next problem
  to solve;
* code: the source of a Python standard library module (`inspect`, on every machine) cut to the length, then
  a question on it.

Per prompt: both sides read the whole prompt cold once, in alternating order (mlx-lm: `generate_step`'s time to
its first token; ours: `generate`'s prefill_seconds at width 4, which keeps the read state in a prefix cache).
Then each configuration decodes `--max-tokens` from that read prompt, `--repeats` times, in a shuffled order
per repeat: mlx-lm alone (`generate_step` from a copy of the same target cache), width 4, width 16 and width
auto (D-cut; a fresh policy per run, as one `generate --width auto` call; its start-up probe and the probes
its prompt asks for run before the clock, and their seconds are recorded). Decode tokens/s = (tokens - 1) /
seconds from the first token to the last. Every greedy output must equal mlx-lm's (a mismatch is printed
loudly and the exit status is 1). Writes long_context.json and long_context.png (speed-up over mlx-lm alone
against the context length) into bench/results/<name>/, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import inspect
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from harness import (alternate, gsm8k_arg, held_out_gsm8k, lossless_status, name_arg, pair_args, results_dir,
                     run_record, write_results)
from mlx_dflash import load, stream_generate
from mlx_dflash.errors import DFlashError
from mlx_dflash.decoding.prompt import encode_prompt
from mlx_dflash.plot import charts_available
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import WidthOptions
from mlx_dflash.decoding.prompt_cache import PromptCache, pair_identity
from mlx_dflash.utils import portable_path

SCHEMA = "mlx-dflash/bench-long-context/1"
CONFIGS = ("mlx-lm alone", "width 4", "width 16", "width auto")
WIDTHS = {"width 4": 4, "width 16": 16, "width auto": "auto"}


def gsm8k_prompt(tokenizer, rows: list, length: int) -> list:
    """Problems with their solutions as one document, then the next one to solve, just past `length` tokens."""
    doc = []
    for i, row in enumerate(rows[:-1]):
        doc.append(f"Problem {i + 1}: {row['question']}\nSolution: {row['answer']}\n")
        ask = f"\nProblem {i + 2}: {rows[i + 1]['question']}\nSolve problem {i + 2} step by step, as above."
        ids = encode_prompt(tokenizer, "\n".join(doc) + ask, chat_template=True)
        if len(ids) >= length:
            return ids
    raise DFlashError(f"the GSM8K file has too few problems for a {length}-token prompt")


def code_prompt(tokenizer, length: int) -> list:
    """The `inspect` module's source cut to about `length` tokens, then a question on it."""
    source = Path(inspect.__file__).read_text()[: 8 * length]  # enough characters, not the whole file
    ask = "\n```\nWhat does the last function above do, and what could go wrong in it?"
    body = tokenizer.encode(source)[: max(1, length - 40)]
    text = "Here is a Python module:\n```python\n" + tokenizer.decode(body) + ask
    return encode_prompt(tokenizer, text, chat_template=True)


def mlx_lm_tokens(model, prompt: list, cache, max_tokens: int, stop: set) -> tuple[list, float, float]:
    """(tokens, seconds to the first, seconds from the first to the last) of mlx-lm's greedy decoding; a stop
    token ends it and is left out, as the decoder leaves it out."""
    from mlx_lm.generate import generate_step

    tokens, tic, first = [], time.perf_counter(), None
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache):
        first = first or time.perf_counter()
        if token in stop:
            break
        tokens.append(int(token))
    return tokens, first - tic, time.perf_counter() - first


def ours(pair, ids: list, max_tokens: int, policy, prompt_cache) -> tuple[list, float, float, object]:
    target, drafter, tokenizer = pair
    tokens, tic, first, last = [], time.perf_counter(), None, None
    for r in stream_generate(target, drafter, tokenizer, ids, max_tokens, policy=policy, prompt_cache=prompt_cache):
        first = first or time.perf_counter()
        tokens += [] if r.token in tokenizer.eos_token_ids else [r.token]
        last = r
    return tokens, first - tic, time.perf_counter() - first, last.stats


def decode_rate(tokens: list, seconds: float) -> float:
    return (len(tokens) - 1) / seconds if seconds > 0 and len(tokens) > 1 else 0.0


def measure_prompt(pair, ids: list, args, order_seed: int, log) -> dict:
    """Both sides' cold read once, then every configuration's decode from the read prompt, repeated."""
    target, drafter, tokenizer = pair
    stop = set(tokenizer.eos_token_ids)
    cache = PromptCache(pair_identity(target, drafter), target.trimmable)
    read = {}
    for side in alternate(["mlx-lm", "ours"], order_seed):  # cold reads, one each
        if side == "mlx-lm":
            read[side] = mlx_lm_tokens(target.model, ids, None, 1, stop)[1]
        else:
            read[side] = ours(pair, ids, 1, build_policy(target, drafter, WidthOptions(4)), cache)[3].prefill_seconds
        log(f"  {side} read {len(ids)} tokens in {read[side]:.1f} s")
    runs, rng = [], random.Random(order_seed)
    for repeat in range(args.repeats):
        for name in rng.sample(CONFIGS, len(CONFIGS)):
            run = {"config": name, "repeat": repeat}
            if name == "mlx-lm alone":
                state, _ = cache.fetch(ids)  # the same read prompt, but its last token, as ours starts from
                tokens, _, seconds = mlx_lm_tokens(target.model, ids[-1:], state.cache, args.max_tokens, stop)
            else:
                tic = time.perf_counter()
                policy = build_policy(target, drafter, WidthOptions(WIDTHS[name]))
                policy.prepare_context(len(ids))  # what stream_generate does first: the context's probes, if any
                run["policy_seconds"] = time.perf_counter() - tic
                tokens, _, seconds, stats = ours(pair, ids, args.max_tokens, policy, cache)
                run.update(rounds=stats.rounds, plain_steps=stats.plain_steps,
                           widths={str(w): n for w, n in sorted(stats.widths.items())})
            run.update(tokens=tokens, decode_seconds=seconds, decode_tps=decode_rate(tokens, seconds))
            runs.append(run)
            log(f"  repeat {repeat} {name}: {run['decode_tps']:.2f} tokens/s")
    return {"prompt_tokens": len(ids), "read_seconds": read, "runs": runs}


def summarize(prompts: list) -> tuple[list, int]:
    """A row per prompt: each configuration's median decode rate and its ratio to mlx-lm alone; mismatches."""
    rows, mismatches = [], 0
    for p in prompts:
        base = [r["tokens"] for r in p["runs"] if r["config"] == "mlx-lm alone"][0]
        mismatches += sum(r["tokens"] != base for r in p["runs"])
        tps = {c: statistics.median(r["decode_tps"] for r in p["runs"] if r["config"] == c) for c in CONFIGS}
        rows.append({"kind": p["kind"], "prompt_tokens": p["prompt_tokens"], "decode_tps": tps,
                     "speedup": {c: tps[c] / tps["mlx-lm alone"] for c in CONFIGS[1:]},
                     "auto_over_best_fixed": tps["width auto"] / max(tps["width 4"], tps["width 16"],
                                                                     tps["mlx-lm alone"]),
                     "read_ratio": p["read_seconds"]["ours"] / p["read_seconds"]["mlx-lm"]})
    return rows, mismatches


def markdown_table(rows: list) -> str:
    head = ("| prompt | tokens | mlx-lm alone tok/s | width 4 | width 16 | width auto "
            "| auto / best of the others | prompt read, ours / mlx-lm |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        tps, up = r["decode_tps"], r["speedup"]
        lines.append(f"| {r['kind']} | {r['prompt_tokens']} | {tps['mlx-lm alone']:.2f} | "
                     + " | ".join(f"{tps[c]:.2f} ({up[c]:.2f}x)" for c in CONFIGS[1:])
                     + f" | {r['auto_over_best_fixed']:.2f} | {r['read_ratio']:.2f} |")
    return "\n".join(lines)


def chart(rows: list) -> bytes:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["kind"] for r in rows})
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        mine = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["prompt_tokens"])
        for c in CONFIGS[1:]:
            ax.plot([r["prompt_tokens"] for r in mine], [r["speedup"][c] for r in mine], marker="o", label=c)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="mlx-lm alone")
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel("decode speed-up over mlx-lm alone")
        ax.set_title(f"{kind} prompts, greedy", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="2000,4000,6000", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--kinds", default="gsm8k,code", help="which prompts: gsm8k, code")
    gsm8k_arg(ap)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    pair_args(ap)
    name_arg(ap, "long-context-cpu")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    try:
        lengths = [int(c) for c in args.contexts.split(",")]
        kinds = args.kinds.split(",")
        if set(kinds) - {"gsm8k", "code"} or args.max_tokens < 2 or args.repeats < 1:
            raise DFlashError("--kinds takes gsm8k and code; --max-tokens must be at least 2, --repeats at least 1")
        rows = held_out_gsm8k(args.gsm8k) if "gsm8k" in kinds else []
        pair = load(args.model, args.drafter)
        prompts = []
        for i, (kind, length) in enumerate((k, n) for n in lengths for k in kinds):
            ids = gsm8k_prompt(pair[2], rows, length) if kind == "gsm8k" else code_prompt(pair[2], length)
            log(f"{kind} prompt of {len(ids)} tokens")
            prompts.append({"kind": kind, "asked_tokens": length, **measure_prompt(pair, ids, args, i, log)})
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary, mismatches = summarize(prompts)
    settings = {"contexts": lengths, "kinds": kinds, "max_tokens": args.max_tokens, "repeats": args.repeats,
                "model": portable_path(args.model) if args.model else None,
                "drafter": portable_path(args.drafter) if args.drafter else None, "sampling": "greedy"}
    results = run_record(__file__, argv, schema=SCHEMA, settings=settings, summary=summary, mismatches=mismatches,
                         prompts=prompts)
    out = results_dir(args.name)
    write_results(out, "long_context", results, chart=lambda: chart(summary))
    m = results["machine"]
    log(f"\n{m.get('chip')} ({m['device']}), mlx {results['versions']['mlx']}, {args.max_tokens} tokens, "
        f"{args.repeats} repeats, greedy; median decode tokens/s (speed-up over mlx-lm alone)\n")
    log(markdown_table(summary))
    log(f"\nwrote {out / 'long_context.json'}" + (" and long_context.png" if charts_available() else ""))
    return lossless_status(mismatches, "generation(s) differ from mlx-lm alone")


if __name__ == "__main__":
    sys.exit(main())
