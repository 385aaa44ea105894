"""Oracle ceiling: the decoder's own loop fed the target's own greedy continuation as drafts.

    python bench/oracle.py                                   # 3 mt-bench prompts, 49 tokens, widths 1..16
    python bench/oracle.py --prompts FILE --prompt-offset 7000 --num-prompts 3 --repeats 2
    python bench/oracle.py --num-prompts 1 --max-tokens 17 --name oracle-quick   # a smoke run

Every draft is right, so every round of width w emits w tokens, and what is left between the measured
speed and the ideal one is the loop's own overhead (host syncs, acceptance, rollback, bookkeeping, the
features the target hands the drafter). Per prompt (the same chat-template ids as bench/e2e.py), before
anything is timed: the target's greedy continuation (mlx-lm `generate_step`, max tokens + the widest
width, no stop rule) and one warm-up of every task. Then, for each repeat, these tasks in a random
order (seeded):
* target alone: mlx-lm's `generate_step` with the decoder's stop rule, timed like bench/e2e.py; t(1) =
  its decode seconds / (generated tokens - 1), seconds per token;
* oracle width w (w in --widths, default 1 2 3 4 6 8 12 16): `mlx_dflash.generate` with the
  fixed-width policy `build_policy(target, oracle, WidthOptions(w, force_width=True))` and `OracleDrafter`,
  whose `draft` returns the next w - 1 tokens of the continuation (a list slice) at the position it
  reads from the context rows the decoder hands it. Decode tokens/s = (generated tokens - 1) / seconds
  from the first token to the last (the decoder's own stats). t_draft(w) = the oracle's own wall time
  inside `draft`, per call (0 at width 1: the loop never drafts);
* verify w: `target.forward` of w rows of the continuation on a cache holding the prompt and the first
  max-tokens // 2 continuation tokens (the mean context length of a generation), `mx.eval` of the
  logits and features, then `target.trim`; one untimed forward, then the median of --verify-repeats.
Per width, per prompt (median over repeats first), then the median over prompts:
  ideal tokens/s = w / (t_draft(w) + t_verify(w)), efficiency = measured tokens/s / ideal tokens/s,
  ideal speed-up = w * t(1) / t_verify(w), measured speed-up = oracle tokens/s / target alone tokens/s.
The oracle's output must equal the target alone's on every run (a mismatch is loud and makes the exit
status 1). A generation whose tokens after the first are not a multiple of w ends on a narrower round,
which the ideal (w tokens every round) does not model: the default 49 tokens gives 48 after the first,
a multiple of every default width, unless a stop token comes first (each run's finish is recorded).
Writes oracle.json (machine, versions, settings, every measurement) and oracle.md (the table) into
bench/results/<name>/ (default oracle-<device>), atomically.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from e2e import load_prompts, mark_identical, run_target_alone
from harness import device_tag, lossless_status, name_arg, prompt_args, results_dir, run_record, write_results
from mlx_dflash.policies.verify_costs import timed
from mlx_dflash.decoding.prompt import encode_prompt
from mlx_dflash.generate import generate
from mlx_dflash.policies.dcut import build_policy
from mlx_dflash.policies.width import WidthOptions
from mlx_dflash.downloads import shipped_drafter_dir, default_target
from mlx_dflash.models.base import Draft
from mlx_dflash.errors import DFlashError
from mlx_dflash.utils import portable_path

SCHEMA = "mlx-dflash/bench-oracle/1"
WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)


class OracleDrafter(nn.Module):
    """A drafter (the decoder's interface) that proposes the target's true greedy continuation.

    It tracks where the anchor is from the context rows it is given: after the prefill it has seen
    the prompt's rows and the anchor is generated token 0; each later call brings the rows of the
    previous round's anchor and accepted drafts. `config` is the real drafter's (its target layers
    make the target capture the same features as a real pair, so the verify costs the same).
    """

    def __init__(self, config, block_size: int):
        super().__init__()
        self.config = config
        self._block_size, self._bound = block_size, False
        self.set_continuation(0, [])

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def is_bound(self) -> bool:
        return self._bound

    def bind(self, target) -> "OracleDrafter":
        target.check_drafter(self.config)
        target.capture(self.config.target_layer_ids)  # the real drafter's features, so the verify costs the same
        self._bound = True
        return self

    def set_continuation(self, prompt_len: int, continuation: list):
        self._prompt_len, self._continuation = prompt_len, list(continuation)
        self.draft_seconds, self.draft_calls = 0.0, 0

    def make_cache(self) -> list:
        self._seen = 0
        return []

    def read_context(self, context, cache: list):
        self._seen += context.shape[1]

    def draft(self, anchors: list, contexts: list, cache: list, block_size: int, width: int, samplings,
              keys=None) -> Draft:
        tic = time.perf_counter()
        (context,) = contexts  # one request
        if context is not None:
            self._seen += context.shape[1]
        start = self._seen - self._prompt_len + 1  # generated index of block position 1
        tokens = self._continuation[start:start + width - 1]
        tokens += [0] * (width - 1 - len(tokens))  # past the continuation: never reached by a capped width
        draft = Draft(mx.array([tokens], dtype=mx.int32), mx.ones((1, width - 1)))
        self.draft_seconds += time.perf_counter() - tic
        self.draft_calls += 1
        return draft


def greedy_continuation(model, ids: list, n: int) -> list:
    """The target's n greedy tokens after `ids`, without a stop rule (mlx-lm's generate_step)."""
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(ids), model, max_tokens=n)
    out = [int(t) for t, _ in steps]
    steps.close()
    return out


def run_oracle(target, oracle, tokenizer, ids: list, continuation: list, width: int, max_tokens: int) -> dict:
    oracle.set_continuation(len(ids), continuation)
    policy = build_policy(target, oracle, WidthOptions(width, force_width=True, prompt_lookup=False))
    out = generate(target, oracle, tokenizer, ids, max_tokens=max_tokens, policy=policy)
    tokens, stats = out.tokens, out.stats
    return {"tokens": [int(t) for t in tokens], "generated_tokens": stats.generated_tokens,
            "finish_reason": stats.finish_reason, "decode_seconds": stats.decode_seconds,
            "decode_tps": stats.decode_tps, "tau": stats.tau, "rounds": stats.rounds, "plain_steps": stats.plain_steps,
            "widths": {str(k): v for k, v in sorted(stats.widths.items())},
            "draft_calls": oracle.draft_calls,
            "t_draft": oracle.draft_seconds / oracle.draft_calls if oracle.draft_calls else 0.0}


def verify_cache(target, ids: list, continuation: list, context_tokens: int):
    """A target cache holding the prompt and the first `context_tokens` continuation tokens."""
    cache = target.make_cache()
    logits, features = target.prefill(mx.array(ids + continuation[:context_tokens]), cache)
    mx.eval(logits, features, [c.state for c in cache])
    return cache


def time_verify(target, cache, rows: list, repeats: int) -> float:
    """Median seconds of target.forward of `rows` (logits and features evaluated), after one untimed."""
    ids = mx.array([rows])
    times = []
    for i in range(repeats + 1):
        seconds = timed(lambda: target.forward(ids, cache))[0]
        target.trim(cache, len(rows))
        if i:
            times.append(seconds)
    return statistics.median(times)


def summarize(runs: list[dict], widths) -> list[dict]:
    """One row per width from the run records (kinds 'target', 'oracle', 'verify'); see the docstring."""
    def per_prompt(kind, key, width=None):
        got = {}
        for r in runs:
            if r["kind"] == kind and (width is None or r["width"] == width):
                got.setdefault(r["prompt"], []).append(r[key])
        return {p: statistics.median(v) for p, v in got.items()}

    t1, base_tps = per_prompt("target", "t1"), per_prompt("target", "decode_tps")
    rows = []
    for w in widths:
        tps, t_draft = per_prompt("oracle", "decode_tps", w), per_prompt("oracle", "t_draft", w)
        t_verify = per_prompt("verify", "seconds", w)
        prompts = sorted(set(tps) & set(t_verify) & set(t1))
        ideal = {p: w / (t_draft[p] + t_verify[p]) for p in prompts}
        med = lambda d: statistics.median(d[p] for p in prompts) if prompts else None  # noqa: E731
        rows.append({
            "width": w, "prompts": len(prompts), "decode_tps": med(tps), "target_tps": med(base_tps),
            "t1": med(t1), "t_draft": med(t_draft), "t_verify": med(t_verify), "ideal_tps": med(ideal),
            "efficiency": med({p: tps[p] / ideal[p] for p in prompts}),
            "ideal_speedup": med({p: w * t1[p] / t_verify[p] for p in prompts}),
            "measured_speedup": med({p: tps[p] / base_tps[p] for p in prompts if base_tps.get(p)}),
        })
    return rows


def markdown_table(rows: list[dict]) -> str:
    f = lambda x, fmt: "-" if x is None else fmt.format(x)  # noqa: E731
    lines = ["| width | oracle tokens/s | ideal tokens/s | efficiency | t_draft ms | t_verify ms | "
             "ideal speed-up w*t(1)/t_verify | measured speed-up |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['width']} | {f(r['decode_tps'], '{:.1f}')} | {f(r['ideal_tps'], '{:.1f}')} | "
                     f"{f(r['efficiency'], '{:.2f}')} | {f(r['t_draft'] and r['t_draft'] * 1e3, '{:.3f}')} | "
                     f"{f(r['t_verify'] and r['t_verify'] * 1e3, '{:.1f}')} | {f(r['ideal_speedup'], '{:.2f}x')} | "
                     f"{f(r['measured_speedup'], '{:.2f}x')} |")
    return "\n".join(lines)


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="mlx-lm target directory (default: SmolLM2-135M-Instruct float32 from PyPI)")
    ap.add_argument("--drafter", help="drafter directory whose config (target layers) the oracle takes "
                                      "(default: the packaged drafter)")
    prompt_args(ap, "--prompt-offset", "first prompt to use")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=49, help="49: 48 tokens after the first, a multiple of "
                                                               "every default width")
    ap.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--verify-repeats", type=int, default=5, help="timed forwards per verify measurement")
    ap.add_argument("--quantize", type=int, choices=[0, 4, 8], default=0,
                    help="quantize the target in memory (bits, group 64) first")
    ap.add_argument("--seed", type=int, default=0, help="seed of the interleaving order")
    name_arg(ap, f"oracle-{device_tag()}")
    ap.add_argument("--out", type=Path, default=None, help="output directory (overrides --name)")
    return ap.parse_args(argv)


class Tasks:
    """The measured tasks of one run, on prepared prompts: the target alone, the oracle at each width, and the
    verify forward at each width (see the module docstring)."""

    def __init__(self, target, tokenizer, oracle, prompt_ids: list, widths: list, max_tokens: int):
        self.target, self.tokenizer, self.oracle, self.prompt_ids = target, tokenizer, oracle, prompt_ids
        self.continuations = [greedy_continuation(target.model, ids, max_tokens + max(widths)) for ids in prompt_ids]
        self.context_tokens = max_tokens // 2
        self.caches = [verify_cache(target, ids, c, self.context_tokens)
                       for ids, c in zip(prompt_ids, self.continuations)]
        self.tasks = [("target", None)] + [("oracle", w) for w in widths] + [("verify", w) for w in widths]

    def run(self, kind: str, w, i: int, max_tokens: int, repeats: int) -> dict:
        ids, cont = self.prompt_ids[i], self.continuations[i]
        if kind == "target":
            res = run_target_alone(self.target.model, self.tokenizer, ids, max_tokens)
            decoded = res["generated_tokens"] - 1
            return {"tokens": res["tokens"], "generated_tokens": res["generated_tokens"],
                    "finish_reason": res["finish_reason"], "decode_seconds": res["decode_seconds"],
                    "decode_tps": res["decode_tps"], "t1": res["decode_seconds"] / decoded if decoded > 0 else 0.0}
        if kind == "oracle":
            return run_oracle(self.target, self.oracle, self.tokenizer, ids, cont, w, max_tokens)
        rows = cont[self.context_tokens:self.context_tokens + w]
        return {"seconds": time_verify(self.target, self.caches[i], rows, repeats),
                "context": len(ids) + self.context_tokens}


def check_oracle_runs(done: list[dict], prompt_index: int, repeat: int, log) -> int:
    """Mark each oracle run of one prompt identical or not to the target alone's; the mismatches."""
    base = next(r for r in done if r["kind"] == "target")["tokens"]
    return sum(mark_identical(r, base, f"oracle width {r['width']} on prompt {prompt_index} (repeat {repeat + 1})", log)
               for r in done if r["kind"] == "oracle")


def measure(tasks: Tasks, args, log) -> tuple[list[dict], int]:
    """One warm-up of every task, then per repeat and prompt every task in a seeded random order."""
    log(f"warm-up: {len(tasks.tasks)} tasks")
    for kind, w in tasks.tasks:
        tasks.run(kind, w, 0, min(args.max_tokens, 17), 1)
    rng = random.Random(args.seed)
    runs, mismatches = [], 0
    t_start = time.perf_counter()
    for rep in range(args.repeats):
        for i, ids in enumerate(tasks.prompt_ids):
            order = list(tasks.tasks)
            rng.shuffle(order)
            done = [{"repeat": rep, "prompt": i, "prompt_index": args.prompt_offset + i, "order": pos, "kind": kind,
                     "width": w, "prompt_tokens": len(ids),
                     **tasks.run(kind, w, i, args.max_tokens, args.verify_repeats)}
                    for pos, (kind, w) in enumerate(order)]
            mismatches += check_oracle_runs(done, args.prompt_offset + i, rep, log)
            runs += done
            line = "  ".join(f"w{r['width']} {r['decode_tps']:.0f}" for r in
                             sorted((r for r in done if r["kind"] == "oracle"), key=lambda r: r["width"]))
            base_tps = next(r for r in done if r["kind"] == "target")["decode_tps"]
            log(f"[repeat {rep + 1}/{args.repeats} prompt {i + 1}/{len(tasks.prompt_ids)} "
                f"{time.perf_counter() - t_start:.0f}s] tok/s: target {base_tps:.0f}; oracle {line}")
    return runs, mismatches


def write_oracle(out_dir: Path, argv, args, model, drafter_dir, prompt_file, prompts, tasks: Tasks, widths, runs,
                 mismatches) -> dict:
    """oracle.json (machine, versions, settings, summary, every run) and oracle.md (the table)."""
    rows = summarize(runs, widths)
    settings = {"model": portable_path(model), "drafter_config": portable_path(drafter_dir),
                "prompts_file": portable_path(prompt_file), "prompt_offset": args.prompt_offset,
                "num_prompts": len(prompts), "max_tokens": args.max_tokens, "widths": widths,
                "repeats": args.repeats, "verify_repeats": args.verify_repeats, "quantize": args.quantize,
                "seed": args.seed, "sampling": "greedy", "verify_context_tokens": tasks.context_tokens,
                "prompts": prompts, "prompt_tokens": [len(p) for p in tasks.prompt_ids]}
    results = run_record(__file__, argv, schema=SCHEMA, settings=settings, summary=rows, mismatches=mismatches,
                         runs=runs)
    m = results["machine"]
    write_results(out_dir, "oracle", results,
                  f"Oracle ceiling, {m.get('chip')} ({m['device']}), mlx {results['versions']['mlx']}: "
                  f"{len(prompts)} prompts x {args.repeats} repeats, {args.max_tokens} max tokens, greedy, "
                  f"verify at {tasks.context_tokens} tokens past the prompt.\n\n{markdown_table(rows)}\n")
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    try:
        from mlx_dflash.pair import load_drafter, load_target

        widths = sorted(set(args.widths))
        if widths[0] < 1 or args.max_tokens < 2 or args.repeats < 1 or args.verify_repeats < 1:
            raise DFlashError("--widths must be >= 1, --max-tokens >= 2, --repeats and --verify-repeats >= 1")
        model, drafter_dir = default_target(args.model), (args.drafter or shipped_drafter_dir())
        prompt_file, prompts = load_prompts(args.prompts, args.prompt_offset, args.num_prompts)

        log(f"target {model}\ndrafter config {drafter_dir}")
        target, tokenizer = load_target(model)
        if args.quantize:
            nn.quantize(target.model, group_size=64, bits=args.quantize)
            mx.eval(target.model.parameters())
        oracle = OracleDrafter(load_drafter(drafter_dir).config, block_size=max(widths)).bind(target)
        prompt_ids = [encode_prompt(tokenizer, p, chat_template=None) for p in prompts]
        tasks = Tasks(target, tokenizer, oracle, prompt_ids, widths, args.max_tokens)
        runs, mismatches = measure(tasks, args, log)
        out_dir = args.out or results_dir(args.name)
        results = write_oracle(out_dir, argv, args, model, drafter_dir, prompt_file, prompts, tasks, widths, runs,
                               mismatches)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    log("\n" + markdown_table(results["summary"]))
    log(f"\nwrote {out_dir / 'oracle.json'} and {out_dir / 'oracle.md'}")
    return lossless_status(mismatches, "oracle generation(s) differ from the target alone")


if __name__ == "__main__":
    sys.exit(main())
