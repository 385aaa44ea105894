"""Sharded-target benchmark: a 2-rank run (`mlx.launch --backend ring -n 2`) with drafting on vs off, and what
the ranks spend on communication per round.

    python bench/distributed.py                                  # pipeline, 2 ranks, 2 prompts x 48 tokens, 1 repeat
    python bench/distributed.py --num-prompts 1 --max-tokens 16 --repeats 1 --name quick   # a smoke run

Pair: SmolLM2-135M-Instruct with the shipped DFlash drafter. SmolLM2 cannot be tensor-sharded over 2 ranks
(9 query / 3 KV heads) and mlx-lm's `llama` has no pipeline stages, so the target is re-saved in the qwen2
layout (same weights, zero q/k/v biases, which qwen2 adds; the outputs are the llama model's) with a
model.safetensors.index.json, and split in 2 pipeline stages of 15 layers. The script checks that the
re-saved model's greedy output equals the llama model's before anything is timed.

Under one launch, both ranks load once, then for each repeat and prompt run, in a seeded random order:
* drafting off: `--width 1`, every round a plain target step (one collective forward per token);
* drafting on: the drafter's trained block size (16).
Each row: decode tokens/s (generated - 1 over the time from the first token to the last), tau, rounds, and
the wall time per round in the rank-agreement exchanges (`Ranks.comm_seconds`, which includes waiting for
the slower rank). Then, on the same group, the latency of the exchanges on their own: an all_sum of the
agreement payload, an all_sum of a kept-feature block, and the model's own per-forward traffic (pipeline:
one send/recv of [1, w, hidden] between the stages and one all_gather of it), each the median of 50.
Greedy outputs of both rows must be equal (a mismatch makes the exit status 1). Rank 0 writes
bench/results/<name>/distributed.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

from harness import RESULTS, name_arg, run_record, write_results
from mlx_dflash.decoding.prompt import encode_prompt
from mlx_dflash.generate import generate
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import WidthOptions
from mlx_dflash.downloads import cache_dir, shipped_drafter_dir, ensure_smollm2

PROMPTS = [
    "Janet has 3 apples and buys 5 more. She eats 2. How many are left?",
    "A train travels 60 miles per hour for 3 hours. How far does it go?",
    "Tom had 12 marbles and gave a third of them to his sister. How many does he have now?",
    "A shop sells pens at 2 dollars each. How much do 7 pens cost?",
]
LAUNCH = ["-c", "import sys; from importlib.metadata import entry_points; "
          "(ep,) = entry_points(group='console_scripts', name='mlx.launch'); sys.argv[0] = 'mlx.launch'; "
          "sys.exit(ep.load()())"]


def smollm2_as_qwen2() -> Path:
    """SmolLM2-135M re-saved in the qwen2 layout (zero q/k/v biases) with a weight index; cached."""
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.utils import save_config, save_model

    out = cache_dir() / "models" / "smollm2-135m-instruct-qwen2-layout-float32"
    if (out / "config.json").exists():
        return out
    source = ensure_smollm2("float32")
    config = json.loads((source / "config.json").read_text())
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    model, _ = load(str(source))
    weights = dict(tree_flatten(model.parameters()))
    for name, w in list(weights.items()):
        for proj in ("q_proj", "k_proj", "v_proj"):
            if name.endswith(f"self_attn.{proj}.weight"):
                weights[name.replace(".weight", ".bias")] = mx.zeros((w.shape[0],), dtype=w.dtype)
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    qwen = model_class(args_class.from_dict(config))
    qwen.load_weights(list(weights.items()), strict=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, qwen)
    save_config(config, tmp / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, tmp / name)
    os.replace(tmp, out)
    return out


def check_relayout(qwen_dir: Path, prompt: str, max_tokens: int = 24) -> None:
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    outputs = []
    for path in (ensure_smollm2("float32"), qwen_dir):
        model, tokenizer = load(str(path))
        ids = mx.array(encode_prompt(tokenizer, prompt, chat_template=None))
        outputs.append([int(t) for t, _ in generate_step(ids, model, max_tokens=max_tokens)])
    if outputs[0] != outputs[1]:
        sys.exit("the qwen2-layout SmolLM2 does not decode like the llama one; not benchmarking it")


def median_seconds(fn, repeats: int = 50) -> float:
    fn()
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def exchange_latencies(group, hidden: int, captured: int, block_size: int) -> dict:
    """Median seconds of each kind of message a round sends, on this group, on their own."""
    payload = mx.zeros((2 + 2 * block_size,))
    out = {"agreement all_sum (2 + 2 x block floats)": median_seconds(
        lambda: mx.eval(mx.distributed.all_sum(payload, group=group)))}
    for rows in (1, 4):
        kept = mx.zeros((1, rows, captured * hidden))
        out[f"kept features all_sum ({rows} x {captured} x {hidden} floats)"] = median_seconds(
            lambda: mx.eval(mx.distributed.all_sum(kept, group=group)))
    peer = (group.rank() + 1) % 2
    for width in (1, 16):
        h = mx.zeros((1, width, hidden))

        def stage_hop():  # rank 1 (first layers) sends to rank 0, as mlx-lm's pipeline does
            if group.rank() == 1:
                mx.eval(mx.distributed.send(h, peer, group=group))
            else:
                mx.eval(mx.distributed.recv_like(h, peer, group=group))
            mx.eval(mx.distributed.all_gather(h, group=group))

        out[f"model's own per forward: send/recv + all_gather of [1, {width}, {hidden}]"] = median_seconds(stage_hop)
    return out


def worker(args) -> int:
    from mlx_dflash.distributed import Ranks, load_sharded_pair
    from mlx_dflash.decoding.sampling import SamplingParams

    target, drafter, tokenizer, group = load_sharded_pair(args.model, args.drafter, "pipeline")
    rank = group.rank()
    rows = {"drafting off": 1, "drafting on": drafter.block_size}
    prompts = [encode_prompt(tokenizer, p, chat_template=None) for p in PROMPTS[: args.num_prompts]]

    def run(row, ids):
        policy = build_policy(target, drafter, WidthOptions(rows[row]))
        ranks = Ranks(group, policy.block_size, partial_features=True)
        with ranks.watch():
            out = generate(target, drafter, tokenizer, ids, max_tokens=args.max_tokens,
                           **SamplingParams().keywords(), policy=policy, ranks=ranks)
            tokens, stats = out.tokens, out.stats
        return dict(tokens=tokens, tps=stats.decode_tps, tau=stats.tau, rounds=stats.rounds,
                    comm_ms_per_round=ranks.comm_seconds / max(stats.rounds, 1) * 1e3)

    for row in rows:  # warm-up
        run(row, prompts[0])
    order = random.Random(0)
    measured = []
    for repeat in range(args.repeats):
        for p, ids in enumerate(prompts):
            for row in order.sample(list(rows), len(rows)):
                measured.append(dict(run(row, ids), row=row, prompt=p, repeat=repeat))
    latencies = exchange_latencies(group, target.hidden_size, len(target.layer_ids), drafter.block_size)
    if rank != 0:
        return 0

    mismatches = 0
    for m in measured:
        if m["row"] == "drafting on":
            twin = next(o for o in measured if o["row"] == "drafting off" and o["prompt"] == m["prompt"]
                        and o["repeat"] == m["repeat"])
            if twin["tokens"] != m["tokens"]:
                mismatches += 1
                print(f"MISMATCH: prompt {m['prompt']} repeat {m['repeat']}: drafting changed the greedy output")
    summary = {}
    for row in rows:
        ms = [m for m in measured if m["row"] == row]
        summary[row] = dict(median_tps=statistics.median(m["tps"] for m in ms),
                            mean_tau=statistics.mean(m["tau"] for m in ms),
                            rounds=sum(m["rounds"] for m in ms),
                            median_comm_ms_per_round=statistics.median(m["comm_ms_per_round"] for m in ms))
    ratio = summary["drafting on"]["median_tps"] / summary["drafting off"]["median_tps"]
    lines = ["| 2 ranks, pipeline | tokens/s (median) | tau | rounds | agreement exchanges, ms per round |",
             "|---|---|---|---|---|"]
    for row, s in summary.items():
        lines.append(f"| {row} | {s['median_tps']:.2f} | {s['mean_tau']:.2f} | {s['rounds']} | "
                     f"{s['median_comm_ms_per_round']:.2f} |")
    lines += ["", f"drafting on / off: {ratio:.2f}x; greedy outputs equal: {mismatches == 0}", "",
              "| message, on its own (median of 50) | ms |", "|---|---|"]
    lines += [f"| {k} | {v * 1e3:.3f} |" for k, v in latencies.items()]
    table = "\n".join(lines)
    print(table)
    user_flags = sys.argv[1:sys.argv.index("--worker")]  # main() puts the worker's own flags last
    report = run_record(__file__, user_flags, ranks=group.size(), backend=args.backend,
                        settings=dict(num_prompts=args.num_prompts, max_tokens=args.max_tokens, repeats=args.repeats),
                        summary=summary, ratio_on_off=ratio, latencies_seconds=latencies, mismatches=mismatches,
                        measured=[{k: v for k, v in m.items() if k != "tokens"} for m in measured], table=table)
    write_results(Path(args.out_root) / args.name, "distributed", report)
    return 1 if mismatches else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1)
    name_arg(parser, "distributed-pipeline-cpu")
    parser.add_argument("--backend", default="ring")
    parser.add_argument("--out-root", default=str(RESULTS))
    parser.add_argument("--model"), parser.add_argument("--drafter")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    model = smollm2_as_qwen2()
    check_relayout(model, PROMPTS[0])
    forward = ["--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens), "--repeats",
               str(args.repeats), "--name", args.name, "--backend", args.backend, "--out-root", args.out_root]
    cmd = [sys.executable, *LAUNCH, "--backend", args.backend, "-n", "2", "--env", "OPENBLAS_NUM_THREADS=1", "--",
           sys.executable, __file__, *forward, "--worker", "--model", str(model),
           "--drafter", str(shipped_drafter_dir())]
    started = time.time()
    done = subprocess.run(cmd)
    result = Path(args.out_root) / args.name / "distributed.json"
    fresh = result.exists() and result.stat().st_mtime >= started
    if done.returncode or not fresh or json.loads(result.read_text())["mismatches"]:
        return 1  # mlx.launch exits 0 when a rank fails: the result file is the proof
    return 0


if __name__ == "__main__":
    sys.exit(main())
