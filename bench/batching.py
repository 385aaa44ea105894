"""Serving under load: continuous batching with fixed widths and with D-cut, against `mlx_lm.server`.

    python bench/batching.py --prompts ../shared/data/gsm8k/train.jsonl --first 7000 --repeats 2
    python bench/batching.py --concurrency 1,2 --requests-per-client 1 --max-tokens 16 --name quick   # smoke run

Servers on loopback, side by side, all on the same target weights (the default pair unless --model/--drafter):
`mlx_lm.server` (its continuous batching, no drafter), `mlx-dflash serve --max-batch 1 --width auto` (one
request at a time), and `mlx-dflash serve --max-batch N` with fixed widths 4, 8, 16 and with `--width auto`
(D-cut). The servers start one after another, each once the one before answers (so that a start-up
probe times a quiet machine, as it would on a user's). For each concurrency level c, every server is
measured in an order that rotates from level to level and from repeat to repeat (drift on a shared
machine spreads over all): c client threads, each sending --requests-per-client streamed greedy chat
requests one after another through the `openai` client. Request j of client k gets prompt
k * requests + j of the set, so every server answers the same prompts; every answer must be the same on
every server (a difference prints a loud line and makes the exit status 1).

Per server and level, over --repeats runs of the level: aggregate tokens/s (all completion tokens / wall
time; the median of the repeats, each repeat kept in the JSON), tokens/s per request (median), time to
first token (median and 95th percentile over every request, queueing included). Writes batching.json,
batching.md and batching.png (aggregate tokens/s against concurrency, matplotlib when installed) into
bench/results/<name>/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servers import dflash_server, mlx_lm_server, stream_chat  # noqa: E402
from mlx_dflash.downloads import PROMPT_SETS, default_target, ensure_prompt_set  # noqa: E402
from mlx_dflash.machine import machine_info, versions  # noqa: E402
from mlx_dflash.tuner.data import read_prompts  # noqa: E402
from mlx_dflash.utils import write_atomic  # noqa: E402

SCHEMA = "mlx-dflash/bench-batching/1"
MLX_LM, SERIAL = "mlx_lm.server", "ours, one at a time (auto)"


def configurations(max_batch: int) -> dict:
    """name -> `mlx-dflash serve` flags (mlx_lm.server is added apart)."""
    rows = {SERIAL: ["--max-batch", "1", "--width", "auto"]}
    for width in (4, 8, 16):
        rows[f"ours batched, width {width}"] = ["--max-batch", str(max_batch), "--width", str(width)]
    rows["ours batched, D-cut"] = ["--max-batch", str(max_batch), "--width", "auto"]
    return rows


def run_level(server, model: str, prompts: list, clients: int, per_client: int, max_tokens: int) -> dict:
    records, errors = {}, []

    def client_loop(k):
        client = server.client()
        try:
            for j in range(per_client):
                i = k * per_client + j
                sent = time.perf_counter()
                r = stream_chat(client, model, [{"role": "user", "content": prompts[i % len(prompts)]}], max_tokens)
                records[i] = {"client": k, "prompt_index": i % len(prompts), "sent": sent, **r}
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
    return {"server": name, "clients": clients,
            "aggregate_tokens_per_s": statistics.median(r["aggregate_tokens_per_s"] for r in repeats),
            "aggregate_tokens_per_s_repeats": [r["aggregate_tokens_per_s"] for r in repeats],
            "tokens_per_s_per_request": statistics.median(decode) if decode else 0.0,
            "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))]}


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
    out += ["", "| server | " + " | ".join(f"c={c} / mlx_lm.server" for c in levels) + " |",
            "|---|" + "---:|" * len(levels)]
    for name in names:
        ratios = [by[name, c]["aggregate_tokens_per_s"] / by[MLX_LM, c]["aggregate_tokens_per_s"] for c in levels]
        out.append(f"| {name} | " + " | ".join(f"{x:.2f}x" for x in ratios) + " |")
    return "\n".join(out)


def chart(rows: list, levels: list, path: Path):
    from mlx_dflash.plot import charts_available

    if not charts_available():
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["server"] for r in rows):
        ax.plot(levels, [next(r for r in rows if r["server"] == name and r["clients"] == c)["aggregate_tokens_per_s"]
                         for c in levels], marker="o", label=name)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_xticks(levels)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="target (default: the default pair's)")
    ap.add_argument("--drafter", help="drafter (default: the shipped one)")
    ap.add_argument("--prompts", default="mt-bench", help=f"a prompt file or set ({', '.join(PROMPT_SETS)})")
    ap.add_argument("--first", type=int, default=0, help="the first prompt used (held-out GSM8K: 7000)")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="runs of every level for every server (the median counts)")
    ap.add_argument("--name", default="batching-cpu", help="results go to bench/results/<name>/")
    args = ap.parse_args(argv)

    levels = [int(c) for c in args.concurrency.split(",")]
    source = ensure_prompt_set(args.prompts) if args.prompts in PROMPT_SETS else args.prompts
    prompts = read_prompts(source)[args.first : args.first + max(levels) * args.requests_per_client]
    model = default_target(args.model)
    common = ["--model", model, "--max-tokens", str(args.max_tokens)] + (["--drafter", args.drafter] if args.drafter else [])
    logs = Path(tempfile.mkdtemp(prefix="mlx-dflash-bench-batching-"))  # kept only if something fails
    starts = {MLX_LM: lambda: mlx_lm_server(model, ["--max-tokens", str(args.max_tokens)], logs / "mlx-lm.log")}
    for i, (name, flags) in enumerate(configurations(args.max_batch).items()):
        starts[name] = lambda flags=flags, i=i: dflash_server(common + flags, logs / f"ours-{i}.log")
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
                                      args.max_tokens)
                    runs.append({"server": name, "repeat": repeat, **level})
                    print(f"{clients} clients, {name}: {level['aggregate_tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    finally:
        for s in servers.values():
            s.stop()
    shutil.rmtree(logs)
    rows = [summary(name, clients, [r for r in runs if r["server"] == name and r["clients"] == clients])
            for name in servers for clients in levels]

    identical = True
    for clients in levels:
        level = [r for r in runs if r["clients"] == clients]
        for i in range(len(level[0]["requests"])):
            if len({r["requests"][i]["text"] for r in level}) > 1:
                identical = False
                print(f"!!! {clients} clients, request {i}: the servers' answers differ", file=sys.stderr)
    out_dir = Path(__file__).resolve().parent / "results" / args.name
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"schema": SCHEMA, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "versions": versions(), "settings": {k: v for k, v in vars(args).items()
                                                                            if k != "model"},
              "command": "python bench/batching.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "identical": identical, "rows": rows, "runs": runs}
    write_atomic(out_dir / "batching.json", json.dumps(record, indent=1))
    table = markdown(rows, levels)
    write_atomic(out_dir / "batching.md", table + "\n")
    chart(rows, levels, out_dir / "batching.png")
    print(table)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
