"""Making training answers: mlx-lm's `batch_generate` against ours (the batched speculative engine), one run.

    python bench/answers.py --prompts ../shared/data/gsm8k/train.jsonl --first 1840 --num-prompts 32
    python bench/answers.py --prompts ../shared/data/gsm8k/train.jsonl --num-prompts 4 --max-tokens 16 \
        --batch 4 --name quick                                                             # smoke run

A drafter is trained on the target's own greedy answers (`mlx-dflash train --prompts ... --data ...`), and
making them is the costly part of its data. Each engine answers the same prompts, in batches of `--batch`
(prompts sorted by length within each batch, as `tuner.data.generate_responses` does), the engines taking
turns batch by batch so the machine's noise falls on both; tokens/s counts answer tokens over wall time,
prompts read included. Answers are compared with the target's own one-request greedy answers
(`mlx_lm.generate_step`) on the first `--check` prompts: a batch of ours must equal them token for token,
mlx-lm's batch is reported as it is (its batched arithmetic may round differently). Writes answers.json and
answers.md into bench/results/<name>/.
"""

from __future__ import annotations

import argparse
import time

from harness import name_arg, results_dir, run_record, write_results
from mlx_dflash.utils import portable_path

SCHEMA = "mlx-dflash/bench-answers/1"


def alone(target, ids: list, max_tokens: int, stop: set) -> list:
    """The target's one-request greedy answer (stop token excluded)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    tokens = []
    for token, _ in generate_step(mx.array(ids), target.model, max_tokens=max_tokens):
        if token in stop:
            break
        tokens.append(int(token))
    return tokens


def run(args) -> dict:
    import mlx_dflash
    from mlx_dflash.decoding.batch_decoder import batch_generate
    from mlx_dflash.decoding.prompt import encode_prompt
    from mlx_dflash.policies.dcut import build_policy
    from mlx_dflash.policies.width import WidthOptions
    from mlx_dflash.tuner.data import greedy_batch, read_prompts

    target, drafter, tokenizer = mlx_dflash.load()
    drafter.bind(target)
    prompts = read_prompts(args.prompts)[args.first : args.first + args.num_prompts]
    ids = [encode_prompt(tokenizer, p, chat_template=None) for p in prompts]
    engines = {"mlx-lm batch_generate": lambda batch: greedy_batch(target.model, tokenizer, batch, args.max_tokens)}
    for width in args.widths:
        policy = build_policy(target, drafter, WidthOptions(width).with_default(), args.batch)  # probed once
        engines[f"ours batch_generate (width {width})"] = lambda batch, policy=policy: batch_generate(
            target, drafter, tokenizer, batch, max_tokens=args.max_tokens, policy=policy).token_ids
    for engine in engines.values():  # warm-up: both compile their shapes once
        engine(ids[:2])
    seconds, tokens = {name: 0.0 for name in engines}, {name: 0 for name in engines}
    answers = {name: [None] * len(ids) for name in engines}
    for start in range(0, len(ids), args.batch):
        order = sorted(range(start, min(start + args.batch, len(ids))), key=lambda i: len(ids[i]))
        for name, engine in engines.items():
            tic = time.perf_counter()
            out = engine([ids[i] for i in order])
            seconds[name] += time.perf_counter() - tic
            for i, answer in zip(order, out):
                answers[name][i] = list(answer)
                tokens[name] += len(answer)
        print(f"{start + len(order)}/{len(ids)} prompts: " + ", ".join(
            f"{name} {tokens[name] / seconds[name]:.1f} tokens/s" for name in engines), flush=True)
    stop = set(tokenizer.eos_token_ids)
    reference = [alone(target, ids[i], args.max_tokens, stop) for i in range(min(args.check, len(ids)))]
    base = "mlx-lm batch_generate"
    rows = [{"engine": name, "tokens": tokens[name], "seconds": round(seconds[name], 2),
             "tokens_per_s": round(tokens[name] / seconds[name], 2),
             "vs_mlx_lm_batch": round(seconds[base] / seconds[name] * tokens[name] / tokens[base], 3),
             "equal_to_one_request": sum(a == r for a, r in zip(answers[name], reference))}
            for name in engines]
    return run_record(__file__, schema=SCHEMA, prompts=portable_path(args.prompts), first=args.first,
                      num_prompts=len(ids), batch=args.batch, max_tokens=args.max_tokens, checked=len(reference),
                      rows=rows)


def markdown(result: dict) -> str:
    lines = [f"`{result['command']}`", "",
             f"{result['num_prompts']} prompts from {result['prompts']} (from {result['first']}), batches of "
             f"{result['batch']}, greedy, at most {result['max_tokens']} tokens; equal: of the first "
             f"{result['checked']}, answers equal to the target's one-request greedy answer.", "",
             "| engine | answer tokens | seconds | tokens/s | vs mlx-lm's batch | equal |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['engine']} | {row['tokens']} | {row['seconds']} | {row['tokens_per_s']} | "
                     f"{row['vs_mlx_lm_batch']:.2f}x | {row['equal_to_one_request']}/{result['checked']} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True, help="A prompt file (GSM8K's training split, say).")
    parser.add_argument("--first", type=int, default=0, help="The first prompt used.")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--widths", default="auto", help="Our engine's widths, comma-separated (auto: D-cut).")
    parser.add_argument("--check", type=int, default=8, help="Prompts checked against one-request greedy.")
    name_arg(parser, "answers-cpu")
    args = parser.parse_args()
    args.widths = [w if w == "auto" else int(w) for w in args.widths.split(",")]
    result = run(args)
    write_results(results_dir(args.name), "answers", result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
