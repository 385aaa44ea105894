"""How fast the target reads a long prompt against the prefill chunk size, on this machine.

    python bench/prefill_chunks.py --gsm8k ../shared/data/gsm8k/train.jsonl --tokens 3000,6000
    python bench/prefill_chunks.py --model ~/.cache/mlx-dflash/models/qwen2.5-coder-0.5b-instruct-float32 \
        --tokens 3000 --name prefill-chunks-qwen-cpu
    python bench/prefill_chunks.py --tokens 300 --steps 64,256 --repeats 1 --name quick     # a smoke run

The prompt as bench/long_context.py builds it (held-out GSM8K problems with their solutions as one
document, then the next problem to solve), cut to each --tokens length. Each read is mlx-lm's
`generate_step` to its first token from an empty cache, in chunks of each --steps size (mlx-lm's default is
2048; `machine.prefill_step` picks ours), sizes in an order that reverses from repeat to repeat. Writes
prefill_chunks.json into bench/results/<name>/ and prints, per length, the fastest read's seconds and each
size's time over the 2048-token chunks' (or the largest size's).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

from harness import alternate, gsm8k_arg, held_out_gsm8k, name_arg, results_dir, run_record, write_results
from long_context import gsm8k_prompt
from mlx_dflash.downloads import default_target
from mlx_dflash.errors import DFlashError
from mlx_dflash.machine import prefill_step

SCHEMA = "mlx-dflash/bench-prefill-chunks/1"


def read_seconds(model, ids: list, step: int) -> float:
    from mlx_lm.generate import generate_step

    tic = time.perf_counter()
    for _ in generate_step(mx.array(ids), model, max_tokens=1, prefill_step_size=step):
        seconds = time.perf_counter() - tic
        mx.clear_cache()
        return seconds


def sizes(text: str, flag: str) -> list:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise DFlashError(f"{flag} takes positive whole numbers separated by commas, got {text!r}")
    return values


def main(argv=None) -> int:
    from mlx_lm import load

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="the target (default: the default target)")
    gsm8k_arg(ap)
    ap.add_argument("--tokens", default="3000,6000", help="prompt lengths, comma-separated")
    ap.add_argument("--steps", default="128,256,512,2048", help="chunk sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    name_arg(ap, "prefill-chunks-cpu")
    args = ap.parse_args(argv)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    try:
        lengths, steps = sizes(args.tokens, "--tokens"), sizes(args.steps, "--steps")
        if args.repeats < 1:
            raise DFlashError("--repeats must be at least 1")
        rows = held_out_gsm8k(args.gsm8k)
        model_path = default_target(args.model)
        try:
            model, tokenizer = load(model_path)
        except (OSError, ValueError) as e:
            raise DFlashError(f"--model {model_path}: {e}") from None
        prompt = gsm8k_prompt(tokenizer, rows, max(lengths))
        read_seconds(model, prompt[:64], steps[0])  # warm-up, untimed
        runs = []
        for length in lengths:
            for repeat in range(args.repeats):
                for step in alternate(steps, repeat):
                    seconds = read_seconds(model, prompt[:length], step)
                    runs.append({"tokens": length, "step": step, "repeat": repeat, "seconds": seconds})
                    log(f"  {length} tokens, {step}-token chunks, repeat {repeat}: {seconds:.2f} s")
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    best = {}
    for r in runs:
        key = (r["tokens"], r["step"])
        best[key] = min(best.get(key, r["seconds"]), r["seconds"])
    base = 2048 if 2048 in steps else max(steps)
    lines = ["| prompt tokens | chunk | seconds (fastest) | / " + f"{base}-token chunks |", "|---:|---:|---:|---:|"]
    lines += [f"| {n} | {s} | {best[n, s]:.2f} | {best[n, s] / best[n, base]:.3f} |" for n in lengths for s in steps]
    results = run_record(__file__, argv, schema=SCHEMA, model=Path(model_path).name,
                         settings={"tokens": lengths, "steps": steps, "repeats": args.repeats,
                                   "machine_prefill_step": prefill_step()},
                         fastest=[{"tokens": n, "step": s, "seconds": best[n, s]} for n in lengths for s in steps],
                         runs=runs)
    out = results_dir(args.name)
    write_results(out, "prefill_chunks", results)
    log(f"\n{Path(model_path).name}, {args.repeats} repeats, a cold read to the first token\n")
    log("\n".join(lines))
    log(f"\nwrote {out / 'prefill_chunks.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
