"""Soak: `mlx-dflash serve` under valid and hostile traffic from many clients at once, on loopback, bounded in time.

    python bench/serve_soak.py                         # default pair, 2 phases of 90 s
    python bench/serve_soak.py --seconds 20 --name soak-quick
    python bench/serve_soak.py --hostile malformed,slow\ body,slow\ head,oversized   # only what is refused
    python bench/serve_soak.py --hostile "kept responses,tool replies,many addresses,big prompts,big heads,other key"

One real `mlx-dflash serve` process (its log in a temporary directory, kept if anything is lost or leaked), started
with short timeouts (--header-timeout 2, --body-timeout 3, --max-body 1 MB) so that hostile requests resolve within
the run, two API keys (the clients send one; the other asks /health), and --max-kept-bytes 4 MiB, so that kept
Responses reach their bound. First every valid request is sent alone, one after another: its answer (greedy, or
sampled with a seed) is the reference and its time the idle latency. Then two phases of `--seconds` each, the same
valid clients in both:

1. valid only: `--valid-clients` threads sending the valid requests in turn (chat and completions, streamed
   and not, through the `openai` client);
2. soak: the same, plus hostile clients: malformed bodies (bad JSON, NaN, 10,000-deep nesting, wrong
   types, text/plain, a foreign Host, an unknown model, an Anthropic body without max_tokens), slow bodies
   and slow heads (held open until the server's timeouts), clients that leave (mid-stream, and while a
   non-streamed answer is generated), oversized requests (a body over --max-body, a prompt over the
   context), and the fourth turn's (kept Responses of a whole body each, tool replies a model writes from
   NaN and deep nesting, half-sent bodies from four loopback addresses, big prompts and count_tokens from
   clients that hang up, 30 KB paths and 1,000 headers, /health with the other key); bench/hostile.py
   says what each sends and should get. `--hostile` keeps some of these kinds only.

Every request is counted: sent, completed (a valid answer: a greedy one identical to its reference), refused (a
valid request answered 429 or 503 with Retry-After: the bounds that hostile clients fill, which real clients
retry), failed as expected (the status, or the close, the hostile request should get), lost (anything else: a wrong
status, a wrong answer, a 500, a timeout, a reset). Before and after the soak: the server's resident memory and
open file descriptors (after the server is idle again), its resident memory every 2 s during each phase (the most
in each quarter: levelling off, or growing), and the log lines it wrote per phase. Valid requests' latency in the
soak is compared with the valid-only phase's and with the idle latency. The exit status is 1 when a request was
lost, an answer differed, or descriptors leaked. Writes serve_soak.json into bench/results/<name>/, atomically, and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import openai

import hostile as h
from harness import name_arg, pair_args, results_dir, run_record, write_results
from servers import dflash_server

SCHEMA = "mlx-dflash/bench-serve-soak/1"
MAX_BODY = 1 << 20
TIMEOUTS = {"--header-timeout": 2, "--body-timeout": 3}
MAX_KEPT_BYTES = 4 << 20
SAMPLE_SECONDS = 2.0
QUESTIONS = ["What is 7 times 8?", "Name three colours of the rainbow.", "Write one sentence about the sea.",
             "What is the capital of Italy?"]


def valid_requests(max_tokens: int) -> list:
    """The valid requests: (api, stream, arguments); greedy chats and completions, and two chats sampled with
    a seed. A greedy answer must equal its reference; a sampled one must be a whole answer, not the same
    sample: under `--width auto` (the batched server's default) the widths a round verifies depend on its
    neighbours and on measured costs, and with them which random draws a seed's stream serves, so the same
    seed may give another (equally distributed) sample."""
    out = []
    for i, q in enumerate(QUESTIONS):
        chat = {"messages": [{"role": "user", "content": q}], "max_tokens": max_tokens}
        if i >= 2:
            chat.update(temperature=0.7, seed=100 + i)
        out.append(("chat", i % 2 == 1, chat))
    out.append(("completion", False, {"prompt": "Once upon a time", "max_tokens": max_tokens}))
    out.append(("completion", True, {"prompt": "The three primary colours are", "max_tokens": max_tokens}))
    return out


def send_valid(client, model: str, request) -> str:
    api, stream, kw = request
    call = client.chat.completions.create if api == "chat" else client.completions.create
    if not stream:
        r = call(model=model, **kw)
        return r.choices[0].message.content if api == "chat" else r.choices[0].text
    parts = [ch.choices[0] for ch in call(model=model, stream=True, **kw) if ch.choices]
    return "".join((p.delta.content or "") if api == "chat" else p.text for p in parts)


def answers_alike(request, text: str, reference: str) -> bool:
    """A greedy answer equals its reference; a sampled one is an answer (not empty)."""
    if request[2].get("temperature", 0) == 0:
        return text == reference
    return bool(text)


class Tally:
    """Thread-safe counts per kind of request, and what went wrong with the lost ones."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sent, self.completed, self.expected, self.lost = Counter(), Counter(), Counter(), Counter()
        self.refused = Counter()
        self.problems, self.latencies, self.wrong_answers = [], [], 0

    def count(self, kind: str, outcome: str, problem: str = ""):
        with self.lock:
            self.sent[kind] += 1
            {"completed": self.completed, "expected": self.expected, "lost": self.lost,
             "refused": self.refused}[outcome][kind] += 1
            if problem and len(self.problems) < 50:
                self.problems.append(f"{kind}: {problem}")

    def summary(self) -> dict:
        lat = sorted(self.latencies)
        return {"sent": sum(self.sent.values()), "completed": sum(self.completed.values()),
                "refused": sum(self.refused.values()),
                "failed_as_expected": sum(self.expected.values()), "lost": sum(self.lost.values()),
                "wrong_answers": self.wrong_answers,
                "by_kind": {k: {"sent": self.sent[k], "completed": self.completed[k],
                                "failed_as_expected": self.expected[k], "lost": self.lost[k]}
                            for k in sorted(self.sent)},
                "valid_latency_median_s": statistics.median(lat) if lat else None,
                "valid_latency_p90_s": lat[min(len(lat) - 1, round(0.9 * (len(lat) - 1)))] if lat else None,
                "problems": self.problems}


HOSTILE_CLIENTS = {"malformed": 3, "slow body": 4, "slow head": 2, "disconnecting": 2, "oversized": 1,
                   "kept responses": 1, "tool replies": 1, "many addresses": 2, "big prompts": 1, "big heads": 1,
                   "other key": 1}


def run_phase(url: str, model: str, requests: list, reference: dict, seconds: float, valid_clients: int,
              hostile: dict) -> dict:
    """`seconds` of the valid clients, with hostile clients beside them ({kind: threads}, maybe empty)."""
    port = int(url.rsplit(":", 1)[1])
    tally, deadline = Tally(), time.monotonic() + seconds

    def valid_loop(k):
        c = openai.OpenAI(base_url=url + "/v1", api_key=h.KEY, max_retries=0, timeout=600)
        i = k
        while time.monotonic() < deadline:
            request = requests[i % len(requests)]
            tic = time.perf_counter()
            try:
                text = send_valid(c, model, request)
            except openai.APIStatusError as e:
                refused = e.status_code in (429, 503) and "retry-after" in e.response.headers
                tally.count("valid", "refused" if refused else "lost", "" if refused else repr(e)[:200])
                if refused:  # as the official clients do: wait, then send it again
                    time.sleep(float(e.response.headers["retry-after"]))
                    continue
            except Exception as e:
                tally.count("valid", "lost", repr(e)[:200])
            else:
                right = answers_alike(request, text, reference[i % len(requests)])
                with tally.lock:
                    tally.latencies.append(time.perf_counter() - tic)
                    tally.wrong_answers += not right
                tally.count("valid", "completed" if right else "lost",
                            "" if right else "an answer differed from its reference")
            i += valid_clients

    def hostile_loop(kind, make, rng):
        while time.monotonic() < deadline:
            name, send, want = make(rng)
            try:
                got = send()
            except Exception as e:
                got = repr(e)[:120]
            tally.count(kind, "expected" if got == want else "lost",
                        "" if got == want else f"{name}: got {got}, want {want}")
            time.sleep(rng.uniform(0.0, 0.2))

    loops = [threading.Thread(target=valid_loop, args=(k,)) for k in range(valid_clients)]
    if hostile:
        kinds = {"malformed": h.malformed(port, model), "oversized": h.oversized(port, model, MAX_BODY),
                 "kept responses": h.kept_responses(port, model, MAX_BODY), "tool replies": h.tool_replies(port, model),
                 "many addresses": h.many_addresses(port, 12), "big prompts": h.big_prompts(port, model, MAX_BODY),
                 "other key": h.other_key(url)}
        makers = {
            **{kind: lambda rng, choices=choices: rng.choice(choices) for kind, choices in kinds.items()},
            "slow body": lambda rng: ("slow body", lambda: h.slow_body(port), "408"),
            "slow head": lambda rng: ("slow head", lambda: h.slow_head(port), "closed"),
            "disconnecting": lambda rng: rng.choice([
                ("leave mid-stream", lambda: h.leave_mid_stream(url, model), "left"),
                ("leave while generating", lambda: h.leave_while_generating(url, model), "left")]),
            "big heads": lambda rng: rng.choice(h.big_heads(port, rng)),
        }
        for kind, n in hostile.items():
            for j in range(n):
                loops.append(threading.Thread(target=hostile_loop,
                                              args=(kind, makers[kind], random.Random(f"{kind}{j}"))))
    tic = time.perf_counter()
    for t in loops:
        t.start()
    for t in loops:
        t.join()
    return {"seconds": time.perf_counter() - tic, "clients": len(loops), **tally.summary()}


def server_resources(pid: int) -> dict:
    """Resident memory (MB) and open file descriptors of the server process."""
    ps = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    rss = int(ps.stdout.strip()) / 1024
    if os.path.isdir(f"/proc/{pid}/fd"):
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    else:  # macOS
        lines = subprocess.run(["lsof", "-p", str(pid)], capture_output=True, text=True).stdout.splitlines()
        fds = sum(1 for line in lines[1:] if line.split()[3][:1].isdigit())
    return {"rss_mb": round(rss, 1), "open_fds": fds}


class RSSSampler:
    """The server's resident memory every SAMPLE_SECONDS while a phase runs: whether it levels off (bounded)
    or keeps growing (a leak)."""

    def __init__(self, pid: int):
        self.pid, self.samples, self.done = pid, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.done.wait(SAMPLE_SECONDS):
            self.samples.append(server_resources(self.pid)["rss_mb"])

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()

    def quarters(self) -> list:
        """The most resident memory in each quarter of the phase (MB)."""
        n = len(self.samples)
        return [max(self.samples[i * n // 4:(i + 1) * n // 4], default=None) for i in range(4)]


def health(url: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url + "/health", headers=h.AUTH), timeout=30) as r:
        return json.loads(r.read())


def wait_idle(url: str, seconds: float = 120):
    """Until nothing waits in the server's queue (twice in a row, a second apart)."""
    deadline, quiet = time.time() + seconds, 0
    while time.time() < deadline and quiet < 2:
        quiet = quiet + 1 if health(url)["waiting"] == 0 else 0
        time.sleep(1.0)


def engine_work(before: dict, after: dict) -> dict:
    """What the batch engine did between two /health answers: rounds and rows per round (empty when the
    server does not batch)."""
    if "batch" not in after:
        return {}
    rows = {int(k): v - before["batch"]["rows"].get(k, 0) for k, v in after["batch"]["rows"].items()}
    rounds = sum(rows.values())
    return {"rounds": rounds, "mean_rows_per_round": sum(k * v for k, v in rows.items()) / rounds if rounds else 0.0}


def log_lines(path: Path) -> int:
    return sum(1 for _ in open(path, errors="replace"))


def tracebacks(path: Path) -> int:
    return sum(line.startswith("Traceback") for line in open(path, errors="replace"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    pair_args(ap)
    ap.add_argument("--seconds", type=float, default=90, help="length of each phase (valid only, then soak)")
    ap.add_argument("--valid-clients", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--server-flag", action="append", default=[], help="extra `mlx-dflash serve` flag (repeatable)")
    ap.add_argument("--hostile", default=",".join(HOSTILE_CLIENTS),
                    help="the hostile kinds the soak sends, comma-separated (default all: "
                         f"{', '.join(HOSTILE_CLIENTS)})")
    name_arg(ap, "serve-soak-cpu-linux")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.hostile.split(",") if k.strip()]
    if not kinds or set(kinds) - set(HOSTILE_CLIENTS):
        ap.error(f"--hostile: choose among {', '.join(HOSTILE_CLIENTS)}")
    hostile = {k: HOSTILE_CLIENTS[k] for k in kinds}

    flags = ["--max-body", str(MAX_BODY), *[str(x) for kv in TIMEOUTS.items() for x in kv],
             "--api-key", f"{h.KEY},{h.OTHER_KEY}", "--max-kept-bytes", str(MAX_KEPT_BYTES), *args.server_flag]
    flags += ["--model", args.model] if args.model else []
    flags += ["--drafter", args.drafter] if args.drafter else []
    logs = Path(tempfile.mkdtemp(prefix="mlx-dflash-bench-soak-"))
    server = dflash_server(flags, logs / "server.log", api_key=h.KEY)
    try:
        model = server.wait_ready()
        requests = valid_requests(args.max_tokens)
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=h.KEY, max_retries=0, timeout=600)
        send_valid(c, model, requests[0])  # warm-up, untimed
        reference, idle = {}, []
        for i, request in enumerate(requests):  # each alone: the reference answer and the idle latency
            tic = time.perf_counter()
            reference[i] = send_valid(c, model, request)
            idle.append(time.perf_counter() - tic)
        phases, resources, lines = {}, {}, {}
        for name, others in (("valid only", {}), ("soak", hostile)):
            wait_idle(server.url)
            resources[name, "before"] = server_resources(server.proc.pid)
            lines_before, engine_before = log_lines(logs / "server.log"), health(server.url)
            print(f"{name}: {args.seconds:.0f} s ...", flush=True)
            with RSSSampler(server.proc.pid) as rss:
                phases[name] = run_phase(server.url, model, requests, reference, args.seconds, args.valid_clients,
                                         others)
            phases[name]["rss_mb_by_quarter"] = rss.quarters()
            phases[name]["engine"] = engine_work(engine_before, health(server.url))
            wait_idle(server.url)
            time.sleep(TIMEOUTS["--body-timeout"])  # the last slow connections' timeouts
            resources[name, "after"] = server_resources(server.proc.pid)
            lines[name] = log_lines(logs / "server.log") - lines_before
        after_ok = answers_alike(requests[0], send_valid(c, model, requests[0]), reference[0])
    finally:
        exit_status = server.stop()

    soak, calm = phases["soak"], phases["valid only"]
    idle_median = statistics.median(idle)
    fd_growth = resources["soak", "after"]["open_fds"] - resources["soak", "before"]["open_fds"]
    result = run_record(__file__, argv, **{
        "schema": SCHEMA,
        "settings": {"seconds_per_phase": args.seconds, "valid_clients": args.valid_clients, "hostile_clients": hostile,
                     "max_tokens": args.max_tokens, "server_flags": flags, "valid_requests": len(requests)},
        "idle_latency_s": idle, "phases": phases, "log_lines": lines,
        "resources": {f"{phase}, {when}": v for (phase, when), v in resources.items()},
        "ratios": {"soak_vs_valid_only_median": soak["valid_latency_median_s"] / calm["valid_latency_median_s"],
                   "soak_vs_valid_only_p90": soak["valid_latency_p90_s"] / calm["valid_latency_p90_s"],
                   "soak_vs_idle_median": soak["valid_latency_median_s"] / idle_median},
        "answer_after_soak_identical": after_ok, "exit_status_on_sigterm": exit_status,
        "server_log_tracebacks": tracebacks(logs / "server.log"),
    })
    out_dir = results_dir(args.name)
    write_results(out_dir, "serve_soak", result)
    print(report(result))
    failed = (soak["lost"] or calm["lost"] or not after_ok or fd_growth > 2 or exit_status != 0
              or result["server_log_tracebacks"])
    if failed:
        print(f"\nLOST, WRONG OR LEAKED: see {out_dir / 'serve_soak.json'}; the server's log is kept in {logs}")
    else:
        for f in logs.iterdir():
            f.unlink()
        logs.rmdir()
    return 1 if failed else 0


def report(r: dict) -> str:
    out = ["| phase | clients | sent | completed | refused (429/503) | failed as expected | lost | "
           "valid latency median / p90 (s) | log lines | batch rounds, rows per round |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in r["phases"].items():
        work = f"{p['engine']['rounds']}, {p['engine']['mean_rows_per_round']:.2f}" if p.get("engine") else "-"
        out.append(f"| {name} | {p['clients']} | {p['sent']} | {p['completed']} | {p.get('refused', 0)} | "
                   f"{p['failed_as_expected']} | {p['lost']} | "
                   f"{p['valid_latency_median_s']:.2f} / {p['valid_latency_p90_s']:.2f} | {r['log_lines'][name]} | "
                   f"{work} |")
    out.append("")
    out.append("| kind (soak) | sent | completed | failed as expected | lost |")
    out.append("|---|---|---|---|---|")
    for kind, k in r["phases"]["soak"]["by_kind"].items():
        out.append(f"| {kind} | {k['sent']} | {k['completed']} | {k['failed_as_expected']} | {k['lost']} |")
    out.append("")
    res = r["resources"]
    out.append("| server | RSS (MB) | open fds |")
    out.append("|---|---|---|")
    for key, v in res.items():
        out.append(f"| {key} | {v['rss_mb']} | {v['open_fds']} |")
    for name, p in r["phases"].items():
        out.append(f"RSS during {name}, most in each quarter (MB): {p.get('rss_mb_by_quarter')}")
    q = r["ratios"]
    out.append("")
    out.append(f"valid latency, soak / valid only: median {q['soak_vs_valid_only_median']:.2f}x, p90 "
               f"{q['soak_vs_valid_only_p90']:.2f}x; soak / idle (one request alone): median "
               f"{q['soak_vs_idle_median']:.2f}x (idle median {statistics.median(r['idle_latency_s']):.2f} s)")
    identical = r["phases"]["soak"]["wrong_answers"] == 0 and r["phases"]["valid only"]["wrong_answers"] == 0
    out.append(f"greedy answers identical to single-request output: {identical}"
               f"; after the soak: {r['answer_after_soak_identical']}; exit status on SIGTERM: "
               f"{r['exit_status_on_sigterm']}; tracebacks in the server's log: {r.get('server_log_tracebacks')}")
    for p in r["phases"]["soak"]["problems"][:10]:
        out.append(f"  lost: {p}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
