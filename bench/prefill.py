"""Reading a long prompt cold: time to the first token against mlx-lm alone, and where ours goes.

    python bench/prefill.py --gsm8k ../shared/data/gsm8k/train.jsonl            # a ~6k-token prompt, 3 repeats
    python bench/prefill.py --tokens 600 --repeats 1 --name quick                 # a smoke run

The default pair; the prompt as bench/long_context.py builds it (held-out GSM8K problems with their solutions
as one document, then the next problem to solve, chat template applied). Each repeat times, from empty caches
and in an order that rotates from repeat to repeat:
* mlx-lm alone: `generate_step`'s time to its first token (it reads the prompt, then steps its last token),
  in its default 2048-token chunks and in this machine's chunks (`machine.prefill_step`: 128 on a CPU);
* ours: `stream_generate`'s time to its first token at width 4 (a fixed width: no probe on the clock), without
  a prefix cache, and with an empty one (a server's cold prompt: the state is kept after the first token), in
  its default chunks (this machine's);
* ours in parts: the target's read of the prompt (`Target.prefill`, the same chunks) and the drafter's read
  of the prompt's features into its cache (`DecodeState.hand_context_to`), timed apart.
Medians over the repeats, and each over mlx-lm's. Writes prefill.json into bench/results/<name>/ and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx

from harness import gsm8k_arg, held_out_gsm8k, name_arg, results_dir, run_record, write_results
from long_context import gsm8k_prompt
from mlx_dflash import load, stream_generate
from mlx_dflash.decoding.decoder import DecodeState
from mlx_dflash.decoding.prompt_cache import PromptCache, pair_identity
from mlx_dflash.errors import DFlashError
from mlx_dflash.machine import prefill_step
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import WidthOptions

SCHEMA = "mlx-dflash/bench-prefill/1"
MLX_LM_STEP = 2048  # prompt tokens per chunk: mlx-lm's generate_step default
HERE = f"mlx-lm alone, {prefill_step()}-token chunks"
SIDES = ("mlx-lm alone", HERE, "ours", "ours, empty prefix cache", "ours: the target's read",
         "ours: the drafter's read")


def mlx_lm_first(target, ids: list, step: int = MLX_LM_STEP) -> float:
    from mlx_lm.generate import generate_step

    tic = time.perf_counter()
    for _ in generate_step(mx.array(ids), target.model, max_tokens=1, prefill_step_size=step):
        return time.perf_counter() - tic


def ours_first(pair, ids: list, prompt_cache=None) -> float:
    target, drafter, tokenizer = pair
    policy = build_policy(target, drafter, WidthOptions(4))
    tic = time.perf_counter()
    for _ in stream_generate(target, drafter, tokenizer, ids, 1, policy=policy, prompt_cache=prompt_cache):
        return time.perf_counter() - tic


def ours_parts(pair, ids: list) -> tuple[float, float]:
    """(the target's read of the prompt with its last token's logits, the drafter's read of its features)."""
    target, drafter, _ = pair
    state = DecodeState.fresh(target, drafter)
    tic = time.perf_counter()
    logits, features = target.prefill(mx.array(ids), state.cache)
    mx.eval(logits, features)
    read = time.perf_counter() - tic
    state.extend(ids, features)
    tic = time.perf_counter()
    state.hand_context_to(drafter)
    mx.eval([c.state for c in state.draft_cache])
    return read, time.perf_counter() - tic


def measure(pair, ids: list, repeats: int, log) -> list:
    target, drafter, _ = pair
    runs = []
    for repeat in range(repeats):
        order = ["mlx-lm", "mlx-lm here", "ours", "cached", "parts"]
        shift = repeat % len(order)
        for side in order[shift:] + order[:shift]:
            if side == "mlx-lm":
                got = {"mlx-lm alone": mlx_lm_first(target, ids)}
            elif side == "mlx-lm here":
                got = {HERE: mlx_lm_first(target, ids, prefill_step())}
            elif side == "ours":
                got = {"ours": ours_first(pair, ids)}
            elif side == "cached":
                cache = PromptCache(pair_identity(target, drafter), target.trimmable)
                got = {"ours, empty prefix cache": ours_first(pair, ids, cache)}
            else:
                read, drafter_read = ours_parts(pair, ids)
                got = {"ours: the target's read": read, "ours: the drafter's read": drafter_read}
            for name, seconds in got.items():
                runs.append({"repeat": repeat, "side": name, "seconds": seconds})
                log(f"  repeat {repeat} {name}: {seconds:.2f} s")
            mx.clear_cache()
    return runs


def table(medians: dict) -> str:
    base = medians["mlx-lm alone"]
    lines = ["| what | seconds (median) | / mlx-lm alone |", "|---|---:|---:|"]
    lines += [f"| {name} | {medians[name]:.2f} | {medians[name] / base:.3f} |" for name in SIDES]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    gsm8k_arg(ap)
    ap.add_argument("--tokens", type=int, default=6000, help="the prompt's length in tokens (at least)")
    ap.add_argument("--repeats", type=int, default=3)
    name_arg(ap, "prefill-cpu")
    args = ap.parse_args(argv)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    try:
        if args.repeats < 1 or args.tokens < 2:
            raise DFlashError("--repeats must be at least 1 and --tokens at least 2")
        pair = load()
        ids = gsm8k_prompt(pair[2], held_out_gsm8k(args.gsm8k), args.tokens)
        log(f"a {len(ids)}-token prompt")
        mlx_lm_first(pair[0], ids[:64])  # warm-up of both sides, untimed
        ours_first(pair, ids[:64])
        runs = measure(pair, ids, args.repeats, log)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    medians = {name: statistics.median(r["seconds"] for r in runs if r["side"] == name) for name in SIDES}
    results = run_record(__file__, argv, schema=SCHEMA, prompt_tokens=len(ids),
                         settings={"tokens": args.tokens, "repeats": args.repeats, "prefill_step": prefill_step(),
                                   "mlx_lm_prefill_step": MLX_LM_STEP},
                         medians=medians, ratios={n: medians[n] / medians["mlx-lm alone"] for n in SIDES}, runs=runs)
    out = results_dir(args.name)
    write_results(out, "prefill", results)
    log(f"\n{len(ids)}-token prompt, {args.repeats} repeats, cold; time to the first token\n")
    log(table(medians))
    log(f"\nwrote {out / 'prefill.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
