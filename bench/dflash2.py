"""What a DFlash 2 draft step costs next to a v1 one of the same size, side by side in one run.

    python bench/dflash2.py                       # -> bench/results/dflash2-draft-<device>/dflash2.json
    python bench/dflash2.py --hidden 2048 --repeats 9

Both drafters get the real DFlash 2 checkpoint's layout (5 sliding non-causal layers, vocabulary 202048,
selector rank 256, top-16 candidates, 2-tap convolutions in groups of 16, block 16) at a smaller hidden
size, random weights, a random borrowed embedding and head, and the same context. Each repeat times, in
interleaved order: the v1 draft step (drafter pass + head + argmax), the DFlash 2 draft step (drafter
pass + head + selector walk, greedy and sampled at T = 0.7), the head + argmax alone, and the selector
alone on given logits (top-k, codebook gathers, the walk). Process CPU time on a CPU
(the machine may be shared), wall time on Metal; medians.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from harness import ROOT, device_tag, results_dir, run_record, write_results
from mlx_dflash.models.config import parse_config
from mlx_dflash.models.dflash import Borrowed
from mlx_dflash.models.loader import init_drafter
from mlx_dflash.kernels.wide_qmm import metal_available
from mlx_dflash.decoding.sampling import SamplingParams

FIXTURE = ROOT / "tests" / "fixtures" / "dflash2-config.json"


def configs(hidden: int) -> tuple:
    real = json.loads(FIXTURE.read_text())
    cfg = dict(real, hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=hidden // 128,
               num_key_value_heads=max(1, hidden // 512))
    v1 = dict(cfg, architectures=["DFlashDraftModel"])
    return parse_config(v1), parse_config(cfg)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--context", type=int, default=256, help="context rows already in the drafter's cache")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = device_tag()
    clock = time.perf_counter if metal_available() else time.process_time

    v1_config, d2_config = configs(args.hidden)
    H, V = args.hidden, d2_config.vocab_size
    embed = mx.random.normal((V, H), key=mx.random.key(1)) * 0.02
    head = mx.random.normal((V, H), key=mx.random.key(2)) * 0.02
    borrowed = Borrowed(embed=lambda ids: embed[ids], head=lambda h: h @ head.T, embed_scale=1.0)
    drafters = {}
    for name, config in (("v1", v1_config), ("dflash2", d2_config)):
        d = init_drafter(config, seed=0)
        d._borrowed = borrowed
        context = mx.random.normal((1, args.context, 5 * H), key=mx.random.key(3))
        cache = d.make_cache()
        mx.eval(d.hidden(mx.array([[0] * 16]), context, cache))  # the context enters the cache once
        drafters[name] = (d, cache)
    new_row = mx.random.normal((1, 1, 5 * H), key=mx.random.key(4))
    mx.eval(embed, head, new_row)

    def draft(name, sampling):
        d, cache = drafters[name]
        mx.random.seed(0)
        tic = clock()
        result = d.draft([5], [new_row], cache, 16, 16, [sampling])  # one new context row, as after a rejection
        mx.eval(result.confidence)
        return clock() - tic

    d2, d2_cache = drafters["dflash2"]
    hidden = d2.hidden(mx.array([[5] + [d2.mask_token_id] * 15]), new_row, d2_cache)[:, 1:]
    mx.eval(hidden)

    logits = d2.logits(hidden)
    mx.eval(logits)

    def head_argmax():
        tic = clock()
        mx.eval(mx.argmax(d2.logits(hidden), axis=-1))
        return clock() - tic

    def selector(temperature):
        mx.random.seed(0)
        tic = clock()
        w = d2.candidate_selector(hidden, logits, mx.array([5]), temperature)
        mx.eval(w.tokens, w.probs)
        return clock() - tic

    cases = {
        "v1 draft step (greedy)": lambda: draft("v1", SamplingParams()),
        "dflash2 draft step (greedy)": lambda: draft("dflash2", SamplingParams()),
        "dflash2 draft step (T=0.7)": lambda: draft("dflash2", SamplingParams(0.7)),
        "head + argmax, 15 rows": head_argmax,
        "selector on given logits (greedy)": lambda: selector(0.0),
        "selector on given logits (T=0.7)": lambda: selector(0.7),
    }
    for fn in cases.values():  # warm-up
        fn()
    times = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            times[name].append(fn())
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["v1 draft step (greedy)"]
    lines = [f"hidden {H}, vocabulary {V}, 5 layers, block 16, context {args.context}, "
             f"{'wall' if clock is time.perf_counter else 'process CPU'} time, median of {args.repeats}"]
    for name, m in medians.items():
        lines.append(f"{name:34s} {m * 1e3:9.1f} ms   x{m / base:.2f} of the v1 step")
    print("\n".join(lines))
    record = run_record(__file__, argv, hidden=H, vocab=V, context=args.context, repeats=args.repeats, device=device,
                        seconds=times, median_seconds=medians, summary=lines)
    write_results(args.out or results_dir(f"dflash2-draft-{device}"), "dflash2", record)


if __name__ == "__main__":
    main()
