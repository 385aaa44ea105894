"""Rollback cost on a hybrid target: rewinding the recurrent layers against the verify forward itself.

A random-weight qwen3_5 (mlx-lm's own class) with the layer sizes of the published hybrid targets
(Qwen3-Next / Qwen3.5 linear attention: 16 key heads and 32 value heads of 128, conv kernel 4, one full
attention layer in 4) and a dense MLP, small enough in depth and vocabulary for a 2-core CPU. Rollback
does no matmul, so its share of a verify only shrinks on deeper models with larger heads.

For each verify width w in 1..16, timed side by side in a shuffled order, from the same context:
  verify        Target.forward of w rows as the decoder runs it (taped), evaluated with the new caches
  untaped       the same forward without tapes: verify - untaped is what taping costs
  rollback      Target.trim after the target kept k of the w rows (k = 1: every draft rejected, a 1-step
                replay; k = w - 1: the longest replay), evaluated
The rejected alternative, re-running the target on the kept rows, costs a verify of width k.

    python bench/rollback.py                 # -> bench/results/rollback-<device>/
    python bench/rollback.py --quick         # 2 repeats, smaller model
    python bench/rollback.py --bits 4        # 4-bit target (the replay is unchanged, the verify cheaper)
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache
from mlx_lm.utils import _get_classes

from harness import command, device_tag, results_dir, run_record, write_results
from mlx_dflash.models.target import Target


def hybrid_config(hidden: int, layers: int, intermediate: int, vocab: int) -> dict:
    return dict(model_type="qwen3_5", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                num_attention_heads=16, num_key_value_heads=2, head_dim=256, rms_norm_eps=1e-6, vocab_size=vocab,
                linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                tie_word_embeddings=False)


def build_target(config: dict, bits: int) -> Target:
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
    mx.eval(model.parameters())
    layers = config["num_hidden_layers"]
    return Target(model, layer_ids=(1, layers // 2, layers - 2))  # captured features, as with a drafter


def cache_arrays(cache) -> list:
    out = []
    for c in cache:
        out += [a for a in c.cache if a is not None] if isinstance(c, ArraysCache) else [c.keys, c.values]
    return out


def saved(cache) -> list:
    return [list(c.cache) if isinstance(c, ArraysCache) else c.offset for c in cache]


def restore(cache, base: list):
    for c, b in zip(cache, base):
        if isinstance(c, ArraysCache):
            c.cache = list(b)
        else:
            c.trim(c.offset - b)


def seconds(fn) -> tuple:
    """(wall, process CPU) seconds of fn(); CPU time is steadier on a shared machine."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(target, cache, base, ids, keep) -> tuple:
    """((wall, cpu) of the verify, (wall, cpu) of the rollback) of one round that keeps `keep` rows;
    `keep` None: the forward without tapes."""
    if keep is None:
        t = seconds(lambda: mx.eval(target._run(ids, cache), cache_arrays(cache)))
        restore(cache, base)
        return t, (0.0, 0.0)
    verify = seconds(lambda: mx.eval(target.forward(ids, cache), cache_arrays(cache)))
    rollback = seconds(lambda: target.trim(cache, ids.shape[1] - keep))
    restore(cache, base)
    return verify, rollback


def model_args(ap: argparse.ArgumentParser):
    """The random-weight target's sizes, its context and the repeats (--quick: a smaller model, 2 repeats)."""
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=6144)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens prefilled before the rounds")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per case (default 5, quick 2)")
    ap.add_argument("--quick", action="store_true")


def model_sizes(args: argparse.Namespace):
    if args.quick:
        args.hidden, args.layers, args.intermediate, args.vocab = 1024, 4, 2048, 8000
    args.repeats = args.repeats or (2 if args.quick else 5)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_args(ap)
    ap.add_argument("--bits", type=int, default=0, help="quantize the target to these bits (0: float32)")
    ap.add_argument("--max-width", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    model_sizes(args)
    device = device_tag()

    config = hybrid_config(args.hidden, args.layers, args.intermediate, args.vocab)
    target = build_target(config, args.bits)
    cache = target.make_cache()
    target.prefill(mx.random.randint(0, args.vocab, (args.context,)), cache)
    mx.eval(cache_arrays(cache))
    base = saved(cache)
    widths = range(1, args.max_width + 1)
    ids = {w: mx.random.randint(0, args.vocab, (1, w)) for w in widths}
    cases = [(w, None) for w in widths] + [(w, k) for w in widths for k in sorted({1, max(1, w - 1), w})]

    times = {c: [] for c in cases}
    for c in cases[: len(cases) // 3]:  # warm-up
        measure(target, cache, base, ids[c[0]], c[1])
    for r in range(args.repeats):
        order = list(cases)
        random.Random(r).shuffle(order)
        for w, keep in order:
            times[(w, keep)].append(measure(target, cache, base, ids[w], keep))
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)

    def median(case, part, clock):  # part 0: verify, 1: rollback; clock 0: wall, 1: CPU
        return 1e3 * statistics.median(t[part][clock] for t in times[case])

    rows = []
    for w in widths:
        keeps, longest = sorted({1, max(1, w - 1), w}), max(1, w - 1)
        row = dict(width=w)
        for clock, tag in ((0, "wall"), (1, "cpu")):
            verify = statistics.median(t[0][clock] for k in keeps for t in times[(w, k)]) * 1e3
            row[f"verify_{tag}_ms"] = verify
            row[f"untaped_{tag}_ms"] = median((w, None), 0, clock)
            row[f"rollback_keep1_{tag}_ms"] = median((w, 1), 1, clock) if w > 1 else 0.0
            row[f"rollback_longest_{tag}_ms"] = median((w, longest), 1, clock) if w > 1 else 0.0
            row[f"keep_all_{tag}_ms"] = median((w, w), 1, clock)
            row[f"share_{tag}"] = row[f"rollback_longest_{tag}_ms"] / verify
        rows.append(row)

    params = sum(v.size for _, v in tree_flatten(target.model.parameters()))
    meta = dict(config=config, bits=args.bits, context=args.context, repeats=args.repeats, parameters=params,
                device=device, mlx=mx.__version__, mlx_lm=mlx_lm.__version__, command=command(__file__, argv))
    record = run_record(__file__, argv, meta=meta, rows=rows, raw={f"{w}:{k}": ts for (w, k), ts in times.items()})

    head = ("| width | verify ms (CPU) | untaped ms (CPU) | rollback keep 1 ms (CPU) | rollback keep w-1 ms (CPU) "
            "| keep all ms | keep w-1 / verify, CPU | same, wall |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['width']} | {r['verify_cpu_ms']:.0f} | {r['untaped_cpu_ms']:.0f} | "
                     f"{r['rollback_keep1_cpu_ms']:.1f} | {r['rollback_longest_cpu_ms']:.1f} | "
                     f"{r['keep_all_wall_ms']:.2f} | {100 * r['share_cpu']:.1f}% | {100 * r['share_wall']:.1f}% |")
    table = "\n".join(lines)
    out = args.out or results_dir(f"rollback-{device}{f'-q{args.bits}' if args.bits else ''}")
    write_results(out, "rollback", record, f"{params / 1e6:.0f}M parameters, {args.bits or 32}-bit, context "
                  f"{args.context}, median of {args.repeats}; `{meta['command']}`\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
