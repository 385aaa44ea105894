"""Serving under load: continuous batching with fixed widths and with D-cut, against `mlx_lm.server`.

    python bench/batching.py --prompts ../shared/data/gsm8k/train.jsonl --first 7000 --repeats 2
    python bench/batching.py --concurrency 1,2 --requests-per-client 1 --max-tokens 16 --name quick   # smoke run
    python bench/batching.py --prompts ../shared/data/gsm8k/train.jsonl --first 7000 --concurrency 4 \
        --long-clients 2 --long-tokens 3000 --max-tokens 64 --requests-per-client 1 --name batching-cpu-mixed

Servers on loopback, side by side, all on the same target weights (the default pair unless --model/--drafter):
`mlx_lm.server` (its continuous batching, no drafter), `mlx-dflash serve --max-batch 1 --width auto` (one request
at a time), and `mlx-dflash serve --max-batch N` with fixed widths 4, 8, 16 and with `--width auto` (D-cut), and
with draft trees at width 8 and with D-cut (`8-tree`, `dcut-tree`: `--tree`) (`--configs` picks some). `--base
REV` adds the same servers of another revision (a git worktree of it, imported alone), to measure a change against
the commit before it in the same run. The servers start one after another, each
once the one before answers (so that a start-up probe times a quiet machine, as it would on a user's). For each
concurrency level c, every server is measured in an order that rotates from level to level and from repeat to
repeat (drift on a shared machine spreads over all): c client threads, each sending --requests-per-client streamed
greedy chat requests one after another through the `openai` client. Request j of client k gets prompt k * requests
+ j of the set, so every server answers the same prompts; every answer must be the same on every server (a
difference prints a loud line and makes the exit status 1).

A mixed load (`--long-clients M`): the last M clients of every level send long prompts instead, each a
document of --long-tokens tokens made of the set's prompts as numbered problems (request i's document
starts at its own place in the set, another in each repeat, so no two share a prefix and no repeat finds
the one before in a server's prefix cache), then an instruction to solve the last one;
the others send the set's prompts as usual. Short and long requests' times to first token are summarized
apart (a short request waiting behind a long read shows there).

Per server and level, over --repeats runs of the level: aggregate tokens/s (all completion tokens / wall
time; the median of the repeats, each repeat kept in the JSON), tokens/s per request (median), time to
first token (median and 95th percentile over every request, queueing included). Writes batching.json,
batching.md and batching.png (aggregate tokens/s against concurrency, matplotlib when installed) into
bench/results/<name>/.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import ROOT, name_arg, pair_args, prompt_args, prompt_path, results_dir, run_record, write_results
from servers import dflash_server, mlx_lm_server, stream_chat
from mlx_dflash.downloads import default_target
from mlx_dflash.plot import line_chart_png
from mlx_dflash.tuner.data import read_prompts

SCHEMA = "mlx-dflash/bench-batching/1"
MLX_LM, SERIAL = "mlx_lm.server", "ours, one at a time (auto)"


def configurations(max_batch: int, keys: str = "serial,4,8,16,dcut") -> dict:
    """name -> `mlx-dflash serve` flags (mlx_lm.server is added apart), for the keys asked: serial (one at a
    time), a fixed width, dcut, and with trees (8-tree, dcut-tree)."""
    rows = {"serial": (SERIAL, ["--max-batch", "1", "--width", "auto"])}
    for width in (4, 8, 16):
        rows[str(width)] = (f"ours batched, width {width}", ["--max-batch", str(max_batch), "--width", str(width)])
    rows["dcut"] = ("ours batched, D-cut", ["--max-batch", str(max_batch), "--width", "auto"])
    rows["8-tree"] = ("ours batched, width 8, trees", ["--max-batch", str(max_batch), "--width", "8", "--tree"])
    rows["dcut-tree"] = ("ours batched, D-cut, trees", ["--max-batch", str(max_batch), "--width", "auto", "--tree"])
    wanted = [k.strip() for k in keys.split(",") if k.strip()]
    if unknown := [k for k in wanted if k not in rows]:
        raise SystemExit(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(rows)})")
    return dict(rows[k] for k in wanted)


def base_tree(revision: str) -> Path:
    """`revision` checked out into a temporary folder (git worktree), for its servers to run from."""
    path = Path(tempfile.mkdtemp(prefix="mlx-dflash-base-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), revision], check=True)
    return path


def long_document(tokenizer, texts: list, start: int, tokens: int) -> str:
    """The set's prompts from `start` on (wrapping) as numbered problems, just past `tokens` tokens, then the
    instruction to solve the last one."""
    parts, n = [], 0
    while n < tokens:
        if len(parts) >= len(texts):
            raise SystemExit(f"--long-tokens {tokens}: the prompt set is too short for a document that long")
        parts.append(f"Problem {len(parts) + 1}: {texts[(start + len(parts)) % len(texts)]}")
        n += len(tokenizer.encode(parts[-1])) + 1
    return "\n".join(parts) + f"\n\nSolve problem {len(parts)} step by step."


def long_prompt_sets(tokenizer, pool: list, requests: int, tokens: int, repeats: int) -> list:
    """Per repeat, {request index: its long document}: every document starts at its own place in the pool."""
    return [{i: long_document(tokenizer, pool, 97 * i + 1009 * repeat, tokens) for i in range(requests)}
            for repeat in range(repeats)]


def run_level(server, model: str, prompts: list, clients: int, per_client: int, max_tokens: int,
              long_prompts: dict) -> dict:
    """long_prompts: request index -> its long prompt, for the last clients of a mixed load (else empty)."""
    records, errors = {}, []
    long_from = clients - len(long_prompts) // per_client

    def client_loop(k):
        client = server.client()
        try:
            for j in range(per_client):
                i = k * per_client + j
                is_long = k >= long_from
                prompt = long_prompts[i - long_from * per_client] if is_long else prompts[i % len(prompts)]
                sent = time.perf_counter()
                # a prompt is a user message, or a conversation with its tools ({"messages", "tools"})
                messages, tools = ((prompt["messages"], prompt["tools"]) if isinstance(prompt, dict)
                                   else ([{"role": "user", "content": prompt}], None))
                r = stream_chat(client, model, messages, max_tokens, tools)
                records[i] = {"client": k, "prompt_index": None if is_long else i % len(prompts), "long": is_long,
                              "sent": sent, **r}
        except Exception as e:  # reported after the level
            errors.append(f"client {k}: {e!r}")

    tic = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    if errors:
        raise SystemExit("requests failed: " + "; ".join(errors))
    requests = [records[i] for i in sorted(records)]
    return {"clients": clients, "wall_seconds": wall, "requests": requests,
            "aggregate_tokens_per_s": sum(r["completion_tokens"] for r in requests) / wall}


def summary(name: str, clients: int, repeats: list) -> dict:
    """One server at one level over its repeats: the median aggregate, latencies over every request."""
    requests = [q for r in repeats for q in r["requests"]]
    ttft = sorted(q["ttft"] for q in requests)
    decode = [(q["completion_tokens"] - 1) / (q["seconds"] - q["ttft"]) for q in requests if q["seconds"] > q["ttft"]]
    apart = {}
    if any(q.get("long") for q in requests):
        for kind, is_long in (("short", False), ("long", True)):
            kept = [q["ttft"] for q in requests if q.get("long", False) == is_long]
            apart[f"{kind}_ttft_p50_s"] = statistics.median(kept) if kept else None
    return {"server": name, "clients": clients, **apart,
            "aggregate_tokens_per_s": statistics.median(r["aggregate_tokens_per_s"] for r in repeats),
            "aggregate_tokens_per_s_repeats": [r["aggregate_tokens_per_s"] for r in repeats],
            "tokens_per_s_per_request": statistics.median(decode) if decode else 0.0,
            "ttft_p50_s": statistics.median(ttft),
            "ttft_p95_s": ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))]}


def markdown(rows: list, levels: list) -> str:
    names = list(dict.fromkeys(r["server"] for r in rows))
    by = {(r["server"], r["clients"]): r for r in rows}
    out = ["| server | " + " | ".join(f"c={c} aggregate tok/s" for c in levels) + " | " +
           " | ".join(f"c={c} TTFT p50 / p95 (s)" for c in levels) + " |",
           "|---|" + "---:|" * (2 * len(levels))]
    for name in names:
        cells = [f"{by[name, c]['aggregate_tokens_per_s']:.1f}" for c in levels]
        cells += [f"{by[name, c]['ttft_p50_s']:.1f} / {by[name, c]['ttft_p95_s']:.1f}" for c in levels]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    if any("short_ttft_p50_s" in r for r in rows):
        out += ["", "| server | " + " | ".join(f"c={c} TTFT p50 short / long (s)" for c in levels) + " |",
                "|---|" + "---:|" * len(levels)]
        for name in names:
            cells = [f"{by[name, c].get('short_ttft_p50_s') or 0:.1f} / {by[name, c].get('long_ttft_p50_s') or 0:.1f}"
                     for c in levels]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += ["", "| server | " + " | ".join(f"c={c} / mlx_lm.server" for c in levels) + " |",
            "|---|" + "---:|" * len(levels)]
    for name in names:
        ratios = [by[name, c]["aggregate_tokens_per_s"] / by[MLX_LM, c]["aggregate_tokens_per_s"] for c in levels]
        out.append(f"| {name} | " + " | ".join(f"{x:.2f}x" for x in ratios) + " |")
    return "\n".join(out)


def chart(rows: list, levels: list) -> bytes:
    by = {(r["server"], r["clients"]): r["aggregate_tokens_per_s"] for r in rows}
    curves = {name: (levels, [by[name, c] for c in levels]) for name in dict.fromkeys(r["server"] for r in rows)}
    return line_chart_png(curves, "concurrent clients", "aggregate tokens/s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    pair_args(ap)
    prompt_args(ap, first_help="the first prompt used (held-out GSM8K: 7000)")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="runs of every level for every server (the median counts)")
    ap.add_argument("--long-clients", type=int, default=0, help="a mixed load: the last N clients send long prompts")
    ap.add_argument("--long-tokens", type=int, default=3000, help="tokens of each long prompt (with --long-clients)")
    ap.add_argument("--configs", default="serial,4,8,16,dcut",
                    help="our servers: serial (one at a time), 4, 8, 16 (fixed widths), dcut, 8-tree, dcut-tree")
    ap.add_argument("--base", help="also run our servers at this revision (a git worktree), side by side")
    name_arg(ap, "batching-cpu")
    args = ap.parse_args(argv)

    levels = [int(c) for c in args.concurrency.split(",")]
    if not 0 <= args.long_clients < min(levels):
        raise SystemExit(f"--long-clients {args.long_clients}: give fewer than the smallest level's clients "
                         f"({min(levels)}), so every level has short requests")
    texts = read_prompts(prompt_path(args.prompts))
    prompts = texts[args.first : args.first + max(levels) * args.requests_per_client]
    model = default_target(args.model)
    long_prompts = [{}] * args.repeats
    if args.long_clients:
        from mlx_lm.utils import load_tokenizer

        tokenizer, pool = load_tokenizer(Path(model)), texts[args.first + len(prompts):] or texts
        long_prompts = long_prompt_sets(tokenizer, pool, args.long_clients * args.requests_per_client,
                                        args.long_tokens, args.repeats)
    common = ["--model", model, "--max-tokens", str(args.max_tokens)]
    common += ["--drafter", args.drafter] if args.drafter else []
    logs = Path(tempfile.mkdtemp(prefix="mlx-dflash-bench-batching-"))  # kept only if something fails
    starts = {MLX_LM: lambda: mlx_lm_server(model, ["--max-tokens", str(args.max_tokens)], logs / "mlx-lm.log")}
    ours = configurations(args.max_batch, args.configs)
    for i, (name, flags) in enumerate(ours.items()):
        starts[name] = lambda flags=flags, i=i: dflash_server(common + flags, logs / f"ours-{i}.log")
    tree = base_tree(args.base) if args.base else None
    for i, (name, flags) in enumerate(ours.items() if tree else ()):
        starts[f"{name} @ {args.base}"] = lambda flags=flags, i=i: dflash_server(common + flags,
                                                                                 logs / f"base-{i}.log", tree)
    servers, models, runs = {}, {}, []
    try:
        for name, start in starts.items():  # one at a time: each start-up on a quiet machine
            servers[name] = start()
            models[name] = servers[name].wait_ready()
        for name, s in servers.items():  # warm-up, untimed
            stream_chat(s.client(), models[name], [{"role": "user", "content": prompts[0]}], args.max_tokens)
        names = list(servers)
        for repeat in range(args.repeats):
            for n, clients in enumerate(levels):
                shift = (n + repeat) % len(names)
                for name in names[shift:] + names[:shift]:
                    level = run_level(servers[name], models[name], prompts, clients, args.requests_per_client,
                                      args.max_tokens, long_prompts[repeat])
                    runs.append({"server": name, "repeat": repeat, **level})
                    print(f"{clients} clients, {name}: {level['aggregate_tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    finally:
        for s in servers.values():
            s.stop()
        if tree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])
    shutil.rmtree(logs)
    rows = [summary(name, clients, [r for r in runs if r["server"] == name and r["clients"] == clients])
            for name in servers for clients in levels]

    identical = True
    for clients in levels:
        for repeat in range(args.repeats):  # a mixed load's long documents differ from repeat to repeat
            level = [r for r in runs if r["clients"] == clients and r["repeat"] == repeat]
            for i in range(len(level[0]["requests"])):
                if len({r["requests"][i]["text"] for r in level}) > 1:
                    identical = False
                    print(f"!!! {clients} clients, request {i}: the servers' answers differ", file=sys.stderr)
    record = run_record(__file__, argv, schema=SCHEMA, settings={k: v for k, v in vars(args).items() if k != "model"},
                        identical=identical, rows=rows, runs=runs)
    table = markdown(rows, levels)
    write_results(results_dir(args.name), "batching", record, table, chart=lambda: chart(rows, levels))
    print(table)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
