"""Sharded serving benchmark: a 2-rank `mlx-dflash serve --shard` with drafting on vs off, through the `openai` client.

    python bench/serve_sharded.py                                  # pipeline, 2 prompts x 32 tokens, 2 rounds
    python bench/serve_sharded.py --num-prompts 1 --max-tokens 8 --rounds 1 --name quick   # a smoke run

Pair: bench/distributed.py's SmolLM2-135M re-saved in the qwen2 layout (its greedy output checked equal to
the llama model's) with the shipped drafter. Per round, two servers one after the other, in an order that
alternates from round to round: drafting on (the drafter's block, 16) and drafting off (`--width 1`).
Each is a real 2-rank server (ring backend over loopback, one BLAS thread per rank, the ranks started as
mlx.launch starts them), gets one untimed warm-up request, then the prompts one after another (chat,
greedy, not streamed), and is stopped with SIGINT to both ranks (both must exit 0). Per request: the
client's wall seconds, completion tokens, and the server's `dflash` statistics (tau, decode tokens/s).
Greedy answers must be equal with drafting on and off (a difference makes the exit status 1). Writes
bench/results/<name>/serve_sharded.json atomically and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

from distributed import PROMPTS, check_relayout, smollm2_as_qwen2
from harness import RESULTS, alternate, name_arg, run_record, write_results
from mlx_dflash.downloads import shipped_drafter_dir

SCHEMA = "mlx-dflash/bench-serve-sharded/1"
DRAFTING, PLAIN = "drafting on", "drafting off (--width 1)"


def free_ports(n: int) -> int:
    """A base port with n free ports after it (the ring backend's listeners, then the HTTP port)."""
    import random

    for _ in range(50):
        base = random.randrange(20000, 30000)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free ports")


def start_server(model: Path, drafter: Path, mode: str, extra: list, log_dir: Path, tag: str):
    base = free_ports(3)
    hostfile = log_dir / f"{tag}-hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(2)]))
    cmd = [sys.executable, "-m", "mlx_dflash.cli", "serve", "--model", str(model), "--drafter", str(drafter),
           "--model-name", "bench", "--port", str(base + 2), "--shard", mode, *extra]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MLX_HOSTFILE=str(hostfile))
    ranks = [subprocess.Popen(cmd, env=dict(env, MLX_RANK=str(r)), stdout=subprocess.DEVNULL,
                              stderr=open(log_dir / f"{tag}-rank{r}.log", "w")) for r in range(2)]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{base + 2}/v1", api_key="unused", max_retries=0, timeout=1800)
    deadline = time.monotonic() + 600
    while True:
        if any(p.poll() is not None for p in ranks) or time.monotonic() > deadline:
            stop(ranks)
            sys.exit(f"the {tag} server did not start; see {log_dir}")
        try:
            client.models.list()
            return ranks, client
        except openai.APIConnectionError:
            time.sleep(0.5)


def stop(ranks) -> list:
    for p in ranks:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    codes = []
    for p in ranks:
        try:
            codes.append(p.wait(timeout=120))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def ask(client, prompt: str, max_tokens: int) -> dict:
    tic = time.perf_counter()
    r = client.chat.completions.create(model="bench", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens)
    seconds = time.perf_counter() - tic
    stats = r.model_extra["dflash"]
    return dict(prompt=prompt, text=r.choices[0].message.content, seconds=seconds,
                completion_tokens=r.usage.completion_tokens, tau=stats["tau"], rounds=stats["rounds"],
                decode_tokens_per_s=stats["decode_tokens_per_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["tensor", "pipeline"], default="pipeline",
                        help="SmolLM2 has 9 / 3 heads, so only pipeline splits it over 2 ranks")
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    name_arg(parser, "serve-sharded-cpu")
    parser.add_argument("--out-root", default=str(RESULTS))
    args = parser.parse_args()
    model, drafter = smollm2_as_qwen2(), shipped_drafter_dir()
    check_relayout(model, PROMPTS[0])
    log_dir = Path(tempfile.mkdtemp(prefix="serve-sharded-"))  # the ranks' logs: kept (and named) on failure
    prompts = PROMPTS[: args.num_prompts]
    configs = {DRAFTING: [], PLAIN: ["--width", "1"]}
    requests, exits = {name: [] for name in configs}, []
    for rnd in range(args.rounds):
        for name in alternate(configs, rnd):
            tag = f"round{rnd}-{'on' if name == DRAFTING else 'off'}"
            ranks, client = start_server(model, drafter, args.mode, configs[name], log_dir, tag)
            try:
                ask(client, prompts[0], 4)  # warm-up, untimed
                for prompt in prompts:
                    requests[name].append(dict(ask(client, prompt, args.max_tokens), round=rnd))
            finally:
                exits.append(dict(server=tag, exit_codes=stop(ranks)))
            print(f"{tag}: done, exit codes {exits[-1]['exit_codes']}", file=sys.stderr)
    mismatches = sorted({r["prompt"] for r in requests[DRAFTING]
                         for p in requests[PLAIN] if p["prompt"] == r["prompt"] and p["text"] != r["text"]})
    rows = {}
    for name, reqs in requests.items():
        tokens, seconds = sum(r["completion_tokens"] for r in reqs), sum(r["seconds"] for r in reqs)
        rows[name] = dict(requests=len(reqs), completion_tokens=tokens, seconds=round(seconds, 3),
                          tokens_per_s=round(tokens / seconds, 3),
                          decode_tokens_per_s_median=statistics.median(r["decode_tokens_per_s"] for r in reqs),
                          tau=round(sum(r["tau"] * r["rounds"] for r in reqs) / sum(r["rounds"] for r in reqs), 3))
    result = run_record(__file__, schema=SCHEMA, settings={k: v for k, v in vars(args).items() if k != "out_root"},
                        load_average=os.getloadavg(), rows=rows,
                        ratio_on_over_off=round(rows[DRAFTING]["tokens_per_s"] / rows[PLAIN]["tokens_per_s"], 3),
                        exits=exits, mismatches=mismatches, requests=requests)
    write_results(Path(args.out_root) / args.name, "serve_sharded", result)
    print(f"| 2 ranks, {args.mode}, served | requests | tokens/s (client wall) | decode tokens/s (median) | tau |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['requests']} | {row['tokens_per_s']:.2f} | {row['decode_tokens_per_s_median']:.2f} "
              f"| {row['tau']:.2f} |")
    print(f"drafting on / off: {result['ratio_on_over_off']:.2f}x; load average {os.getloadavg()[0]:.1f}")
    bad_exit = any(code != 0 for e in exits for code in e["exit_codes"])
    if mismatches:
        print(f"GREEDY ANSWERS DIFFER with drafting on and off for {mismatches}", file=sys.stderr)
    if bad_exit:
        print(f"a rank did not exit 0; its log is in {log_dir}", file=sys.stderr)
    else:
        shutil.rmtree(log_dir)
    return 1 if mismatches or bad_exit else 0


if __name__ == "__main__":
    sys.exit(main())
