"""A short request sent during a long prompt's read: is it answered before that read finishes?

    python bench/head_of_line.py                                   # a ~6k-token document, a short question 5 s in
    python bench/head_of_line.py --long-tokens 1500 --max-tokens 8 --name quick   # a smoke run

Servers on loopback, one after another, on the default pair: `mlx-dflash serve` as it starts by default (continuous
batching: prompts being read take turns a chunk at a time beside the decoding rows) and `--max-batch 1` (one
request decodes at a time; one more prompt is read meanwhile, in turn with the others, so a short request arriving
during a long read is read beside it and decodes in the free row). For each, after one warm-up request: the long
request (held-out GSM8K problems with their solutions as one document, then "solve the next problem", as
bench/long_context.py builds it, sent as one user message), then `--delay` seconds later the short one (a GSM8K
question), both streamed, greedy, through the `openai` client. Times are from the long request's send: the long
request's first token (its read has ended by then) and the short request's send, first token and end. The short
request is "answered during the read" when it ends before the long one's first token. Every answer must be the same
on both servers (a difference prints a loud line and makes the exit status 1). Writes head_of_line.json and
head_of_line.md into bench/results/<name>/.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from harness import gsm8k_arg, held_out_gsm8k, name_arg, results_dir, run_record, write_results
from servers import dflash_server, stream_chat
from mlx_dflash.downloads import default_target

SERVERS = {"batched (default)": [], "one at a time (--max-batch 1)": ["--max-batch", "1"]}


def long_document(tokenizer, rows: list, length: int) -> str:
    """Problems with their solutions as one document, then the next one to solve: the first such text whose
    chat prompt reaches `length` tokens."""
    doc = []
    for i, row in enumerate(rows[:-1]):
        doc.append(f"Problem {i + 1}: {row['question']}\nSolution: {row['answer']}\n")
        text = "\n".join(doc) + f"\nProblem {i + 2}: {rows[i + 1]['question']}\nSolve problem {i + 2} step by step."
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        if len(chat) >= length:
            return text
    raise SystemExit(f"the GSM8K file has too few problems for a {length}-token prompt")


def measure(flags: list, long_text: str, short_text: str, args, log_dir: Path) -> dict:
    server = dflash_server(flags, log_dir / f"serve{'-'.join(flags) or '-default'}.log")
    try:
        model = server.wait_ready()
        client = server.client()
        stream_chat(client, model, [{"role": "user", "content": "Say hello."}], 8)  # warm-up
        results, start = {}, time.perf_counter()

        def send(name, text):
            sent = time.perf_counter() - start
            try:
                results[name] = {"sent": sent, **stream_chat(client, model, [{"role": "user", "content": text}],
                                                             args.max_tokens)}
            except Exception as e:  # said in the results and the exit status, not as a KeyError later
                results[name] = {"sent": sent, "error": f"{type(e).__name__}: {e}"}

        threads = [threading.Thread(target=send, args=("long", long_text))]
        threads[0].start()
        time.sleep(args.delay)
        threads.append(threading.Thread(target=send, args=("short", short_text)))
        threads[1].start()
        for t in threads:
            t.join()
        if errors := {k: r["error"] for k, r in results.items() if "error" in r}:
            raise SystemExit(f"a request failed on `mlx-dflash serve {' '.join(flags)}`: {errors}")
        return results
    finally:
        server.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    gsm8k_arg(ap)
    ap.add_argument("--long-tokens", type=int, default=6000)
    ap.add_argument("--delay", type=float, default=5.0, help="seconds between the long request and the short one")
    ap.add_argument("--max-tokens", type=int, default=32)
    name_arg(ap, "head-of-line-cpu")
    args = ap.parse_args(argv)
    rows = held_out_gsm8k(args.gsm8k)
    tokenizer = load_tokenizer(Path(default_target()))
    long_text = long_document(tokenizer, rows[1:], args.long_tokens)
    short_text = rows[0]["question"]

    measured = {}
    with tempfile.TemporaryDirectory() as logs:
        for name, flags in SERVERS.items():
            measured[name] = r = measure(flags, long_text, short_text, args, Path(logs))
            long, short = r["long"], r["short"]
            print(f"{name}: long read ended (first token) at {long['sent'] + long['ttft']:.1f} s, prompt "
                  f"{long['prompt_tokens']} tokens; short sent at {short['sent']:.1f} s, first token at "
                  f"{short['sent'] + short['ttft']:.1f} s, done at {short['sent'] + short['seconds']:.1f} s",
                  flush=True)

    mismatches = sum(len({measured[s][k]["text"] for s in measured}) > 1 for k in ("long", "short"))
    if mismatches:
        print("MISMATCH: the servers answered differently", file=sys.stderr)
    lines = ["| server | long prompt tokens | long: first token (read ended) s | short: sent s | short: first token s "
             "| short: done s | short answered during the read |", "|---|---:|---:|---:|---:|---:|---|"]
    for name, r in measured.items():
        long, short = r["long"], r["short"]
        done, read_end = short["sent"] + short["seconds"], long["sent"] + long["ttft"]
        lines.append(f"| {name} | {long['prompt_tokens']} | {read_end:.1f} | {short['sent']:.1f} | "
                     f"{short['sent'] + short['ttft']:.1f} | {done:.1f} | {'yes' if done < read_end else 'no'} |")
    table = "\n".join(lines)
    print(table)
    record = run_record(__file__, argv, schema="mlx-dflash/bench-head-of-line/1",
                        settings={"long_tokens": args.long_tokens, "delay": args.delay, "max_tokens": args.max_tokens},
                        servers={name: {"flags": SERVERS[name], **r} for name, r in measured.items()},
                        mismatches=mismatches)
    write_results(results_dir(args.name), "head_of_line", record, table)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
