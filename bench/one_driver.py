"""One request through each of the two drivers, side by side: what the batch's ragged caches cost one request.

    python bench/one_driver.py                          # GSM8K 7000-7002, 64 tokens, width auto and 4, 3 repeats
    python bench/one_driver.py --num-prompts 1 --repeats 1 --max-tokens 16 --name quick   # a smoke run

`generate` decodes one request on its own plain caches (decoding/decoder.py `speculative_rounds`); `serve` and
`batch_generate` decode through the scheduler on ragged batch caches (decoding/batch_decoder.py), one request
being the batch of one row. This times both on the same prompts with the default pair, greedy, beside mlx-lm
alone (`generate_step`): decode tokens/s as `GenerationStats.decode_tps` (first token to last), per prompt, in
an order that alternates by repeat. Every output must equal mlx-lm's. Writes one_driver.json and one_driver.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from e2e import run_target_alone
from harness import alternate, gsm8k_arg, held_out_gsm8k, lossless_status, name_arg, results_dir, run_record, \
    write_results
from mlx_dflash import generate, load
from mlx_dflash.decoding.batch_decoder import batch_generate
from mlx_dflash.decoding.prompt import encode_prompt

ALONE = "mlx-lm alone"


def drivers(widths: list) -> dict:
    """name -> run(target, drafter, tokenizer, ids, max_tokens) -> (tokens, decode tokens/s)."""
    runs = {}
    for width in widths:
        def one(t, d, tok, ids, n, width=width):
            out = generate(t, d, tok, ids, max_tokens=n, width=width)
            return [int(x) for x in out.tokens], out.stats.decode_tps

        def batch(t, d, tok, ids, n, width=width):
            out = batch_generate(t, d, tok, [ids], max_tokens=n, width=width)
            return [int(x) for x in out.token_ids[0]], out.stats[0].decode_tps

        runs[f"generate, width {width}"] = one
        runs[f"batch_generate of one, width {width}"] = batch
    return runs


def table(medians: dict, widths: list) -> str:
    alone = medians[ALONE]
    lines = ["| width | mlx-lm alone | `generate` (own caches) | `batch_generate` of one (ragged caches) | "
             "batch / generate |", "|---|---:|---:|---:|---:|"]
    for width in widths:
        one, batch = medians[f"generate, width {width}"], medians[f"batch_generate of one, width {width}"]
        lines.append(f"| {width} | {alone:.2f} | {one:.2f} ({one / alone:.2f}x) | {batch:.2f} ({batch / alone:.2f}x) "
                     f"| {batch / one:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gsm8k_arg(ap)
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--widths", default="auto,4", help="comma-separated verify widths (auto or a number)")
    ap.add_argument("--repeats", type=int, default=3)
    name_arg(ap, "one-driver-cpu")
    args = ap.parse_args(argv)
    widths = [w if w == "auto" else int(w) for w in args.widths.split(",")]
    target, drafter, tokenizer = load()
    prompts = [encode_prompt(tokenizer, r["question"], chat_template=True)
               for r in held_out_gsm8k(args.gsm8k)[: args.num_prompts]]
    runs = {ALONE: lambda t, d, tok, ids, n: (lambda r: (r["tokens"], r["decode_tps"]))(
        run_target_alone(t.model, tok, ids, n)), **drivers(widths)}
    for run in runs.values():  # warm-up: first calls compile, allocate, and (width auto) probe verify costs
        run(target, drafter, tokenizer, prompts[0], 8)
    speeds, mismatches = {name: [] for name in runs}, 0
    for repeat in range(args.repeats):
        for i, ids in enumerate(prompts):
            outputs = {}
            for name in alternate(runs, repeat + i):
                outputs[name], tps = runs[name](target, drafter, tokenizer, ids, args.max_tokens)
                speeds[name].append(tps)
                print(f"repeat {repeat} prompt {i} {name}: {tps:.2f} tokens/s", file=sys.stderr, flush=True)
            for name, tokens in outputs.items():
                if tokens != outputs[ALONE]:
                    mismatches += 1
                    print(f"!!! prompt {i}: {name}'s output differs from mlx-lm alone's", file=sys.stderr)
    medians = {name: statistics.median(v) for name, v in speeds.items()}
    md = table(medians, widths)
    settings = {**vars(args), "gsm8k": Path(args.gsm8k).name}  # no machine's path in results
    record = run_record(__file__, argv, settings=settings, speeds=speeds, medians=medians, mismatches=mismatches)
    write_results(results_dir(args.name), "one_driver", record, md)
    print(md)
    return lossless_status(mismatches, "generation(s) differ from mlx-lm alone's")


if __name__ == "__main__":
    sys.exit(main())
