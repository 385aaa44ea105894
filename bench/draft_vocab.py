"""Draft vocabulary sizes: acceptance and drafting time of one drafter over the N most frequent tokens.

    python bench/draft_vocab.py --vocab-data RESPONSES.jsonl --heldout FILE --first 7000 [--sizes 2048 4096 8192]

For each size N (and the whole vocabulary): the draft vocabulary is the N most frequent tokens of the
target's responses in --vocab-data (mlx_dflash.tuner.draft_vocab, as `mlx-dflash convert --draft-vocab N
--vocab-data FILE` chooses it), set on the drafter in memory. Measured:
* tau (tokens per round, bonus included) at each verify width, greedy decoding replayed exactly on the
  target's own answers to the held-out prompts (mlx_dflash.tuner.replay.decoding_acceptance; one held-out set
  per --heldout, answers cached like bench/acceptance.py's);
* coverage: the share of the held-out answers' tokens inside the draft vocabulary;
* the drafter's pass (`drafter.draft`, evaluated) at each width: median wall time over --repeats rounds,
  every size timed in one shuffled order per repeat, against a --context-token context.
Writes draft_vocab.json and a markdown table into --out (atomically); prints the table.
"""

import argparse
from collections import Counter
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from harness import pair_args, prompt_path, results_dir, run_record, write_results
from mlx_dflash.tuner.data import generate_responses, iter_sequences, read_prompts, read_samples
from mlx_dflash.downloads import cache_dir, shipped_drafter_dir, default_target
from mlx_dflash.tuner.draft_vocab import coverage, response_token_counts, select_draft_vocab
from mlx_dflash.models.loader import drafter_from_dir
from mlx_dflash.utils import portable_path
from mlx_dflash.pair import load_target
from mlx_dflash.tuner.replay import TargetFeatures, decoding_acceptance
from mlx_dflash.decoding.sampling import SamplingParams

FULL = "full"


def heldout_sequences(target, tokenizer, spec: str, first: int, count: int, max_tokens: int) -> list:
    """(ids, response start) of the target's greedy answers to prompts first..first+count of a set or file."""
    prompts = read_prompts(prompt_path(spec))[first : first + count]
    answers = cache_dir() / "data" / f"heldout-{Path(spec).stem}-{first}-{max_tokens}.jsonl"
    generate_responses(target.model, tokenizer, prompts, answers, max_tokens=max_tokens, batch_size=32,
                       log=lambda m: print(m, file=sys.stderr))
    samples = sorted(read_samples(answers), key=lambda s: s["index"])[: len(prompts)]
    return list(iter_sequences(samples))


def draft_seconds(drafter, target, ids: list, widths, repeats: int, sizes: dict, seed: int) -> dict:
    """{size: {width: median seconds of one evaluated drafter pass}}, sizes shuffled per repeat."""
    cache = target.make_cache()
    _, context = target.prefill(mx.array(ids), cache)
    greedy, rng = SamplingParams(), random.Random(seed)
    times = {name: {w: [] for w in widths} for name in sizes}
    anchor = ids[-1]
    for _ in range(repeats + 1):  # the first pass warms up
        order = list(sizes)
        rng.shuffle(order)
        for name in order:
            drafter.set_draft_vocab(sizes[name])
            for w in widths:
                draft_cache = drafter.make_cache()
                mx.eval(drafter.draft([anchor], [context], draft_cache, drafter.block_size, 2, [greedy]).confidence)
                one = context[:, -1:]
                tic = time.perf_counter()
                mx.eval(drafter.draft([anchor], [one], draft_cache, drafter.block_size, w, [greedy]).confidence)
                times[name][w].append(time.perf_counter() - tic)
    return {name: {w: statistics.median(t[1:]) for w, t in per.items()} for name, per in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pair_args(ap)
    ap.add_argument("--vocab-data", required=True, help="the target's responses that rank the tokens (train --data)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--heldout", nargs="+", default=["mt-bench"], help="prompt sets or files for the held-out tau")
    ap.add_argument("--first", type=int, nargs="+", default=[0], help="first prompt of each --heldout")
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--context-tokens", type=int, default=300)
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: bench/results/draft-vocab)")
    args = ap.parse_args(argv)
    firsts = args.first + [args.first[-1]] * (len(args.heldout) - len(args.first))

    target, tokenizer = load_target(default_target(args.model))
    drafter_dir = (args.drafter or shipped_drafter_dir())
    drafter = drafter_from_dir(drafter_dir).bind(target)
    counts = response_token_counts(args.vocab_data)
    vocab = drafter.config.vocab_size
    sizes = {str(n): select_draft_vocab(counts, n, vocab) for n in sorted(args.sizes) if n < vocab}
    sizes[FULL] = None

    heldout = {f"{Path(spec).stem}[{first}:{first + args.num_prompts}]":
               heldout_sequences(target, tokenizer, spec, first, args.num_prompts, args.max_tokens)
               for spec, first in zip(args.heldout, firsts)}
    acceptance, covered = {}, {}
    features = TargetFeatures(target)  # each answer's target pass once, for every size
    for set_name, sequences in heldout.items():
        held_counts = Counter(t for ids, start in sequences for t in ids[start:])
        for name, ids in sizes.items():
            drafter.set_draft_vocab(ids)
            result = decoding_acceptance(drafter, features, sequences, widths=tuple(args.widths))
            acceptance.setdefault(set_name, {})[name] = {str(w): r["tau"] for w, r in result.items()}
            covered.setdefault(set_name, {})[name] = 1.0 if ids is None else coverage(held_counts, ids.tolist())

    context_ids = [t for ids, _ in next(iter(heldout.values())) for t in ids][: args.context_tokens]
    seconds = draft_seconds(drafter, target, context_ids, args.widths, args.repeats, sizes, seed=0)

    results = run_record(__file__, argv, drafter=portable_path(drafter_dir), vocab_data=portable_path(args.vocab_data),
                         vocab_data_tokens=sum(counts.values()), distinct_tokens_seen=len(counts),
                         max_tokens=args.max_tokens, widths=args.widths, repeats=args.repeats,
                         context_tokens=len(context_ids), tau=acceptance, coverage=covered, draft_seconds=seconds)
    table = markdown(results, list(sizes))
    write_results(args.out or results_dir("draft-vocab"), "draft_vocab", results, table)
    print(table)
    return 0


def markdown(results: dict, names: list) -> str:
    widths = results["widths"]
    head = ["draft vocabulary"]
    for set_name in results["tau"]:
        head += [f"{set_name} coverage"] + [f"{set_name} tau w{w}" for w in widths]
    head += [f"draft ms w{w}" for w in widths]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name in names:
        row = [name]
        for set_name, per in results["tau"].items():
            row += [f"{results['coverage'][set_name][name]:.3f}"] + [f"{per[name][str(w)]:.2f}" for w in widths]
        row += [f"{results['draft_seconds'][name][w] * 1e3:.1f}" for w in widths]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
