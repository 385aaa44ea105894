"""Training data side by side: the target's own answers against its choices over text that exists.

    python bench/labels.py --gsm8k ../shared/data/gsm8k/train.jsonl --steps 60
    python bench/labels.py --gsm8k ../shared/data/gsm8k/train.jsonl --steps 2 --eval-every 1 \
        --eval-sequences 2 --answers 2 --variants answers,text-target --name quick        # smoke run

Every variant trains from the same start (`--init`, default the shipped drafter) for the same steps, seed
and learning rate, one `mlx-dflash train` run each; they differ only in their data:

- text-target: GSM8K's reference solutions (problems 0-6999), each row learning the target's own choice
  (`--labels target`); the data costs the forward the trainer runs anyway;
- text-text: the same text, each row learning the text's next token (`--labels text`): the control;
- answers: the target's greedy answers to `--answers` GSM8K training problems the shipped drafter never
  saw (from 1840 on); making them is charged to this variant's CPU time;
- text-chat-code: text-target plus chats (fastchat-identity), HumanEval's reference solutions and some of
  the Python standard library's source;
- mix: the answers and text-target together (charged the answers' CPU time).

Held-out tau is replayed on the target's own greedy answers (the evaluation that matches decoding) to
GSM8K problems 7000+, which nothing trains on, every `--eval-every` steps; at the end each drafter is also
scored with prompt lookup, and on a chat set (the target's answers to MT-Bench's first turns). Writes
labels.json, labels.md and labels.png (held-out tau against CPU-hours, data included) into
bench/results/<name>/.
"""

from __future__ import annotations

import argparse
import sysconfig
import tempfile
import time
from pathlib import Path

from harness import name_arg, results_dir, run_record, train, training_args, write_results
from mlx_dflash.downloads import cache_dir, default_target, shipped_drafter_dir
from mlx_dflash.plot import line_chart_png
from mlx_dflash.utils import portable_path

SCHEMA = "mlx-dflash/bench-labels/1"
VARIANTS = ("text-target", "text-text", "answers", "text-chat-code", "mix")
HELD_OUT_FIRST, ANSWERS_FIRST, TEXT_PROBLEMS = 7000, 1840, 7000
STDLIB_PACKAGES = ("json", "collections", "email")  # source text beside the chats and HumanEval


def slices(gsm8k: Path, work: Path, n_answers: int, n_held_out: int) -> dict:
    """The GSM8K files each variant reads, cut from the training split."""
    lines = gsm8k.read_text().splitlines()
    files = {"text": lines[:TEXT_PROBLEMS], "answer-prompts": lines[ANSWERS_FIRST : ANSWERS_FIRST + n_answers],
             "held-out": lines[HELD_OUT_FIRST : HELD_OUT_FIRST + n_held_out]}
    out = {}
    for name, chosen in files.items():
        out[name] = work / f"gsm8k-{name}.jsonl"
        out[name].write_text("\n".join(chosen) + "\n")
    return out


def answered(target, tokenizer, prompts, data: Path, max_tokens: int) -> tuple:
    """The target's answers to prompts, kept in data (resumed), and the CPU seconds making them took here."""
    from mlx_dflash.tuner.data import generate_responses, iter_sequences, read_prompts, read_samples

    cpu = time.process_time()
    prompts = read_prompts(prompts)
    generate_responses(target.model, tokenizer, prompts, data, max_tokens=max_tokens, log=print)
    samples = sorted((s for s in read_samples(data) if s["index"] < len(prompts)), key=lambda s: s["index"])
    return list(iter_sequences(samples)), time.process_time() - cpu


def variant_args(variant: str, files: dict, answers: Path) -> list:
    text = ["--text", str(files["text"])]
    if variant == "answers":
        return ["--prompts", str(files["answer-prompts"]), "--data", str(answers)]
    if variant == "text-target":
        return text
    if variant == "text-text":
        return text + ["--labels", "text"]
    if variant == "text-chat-code":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return text + ["--text", "fastchat-identity", "--text", "humaneval"] + \
            [a for p in STDLIB_PACKAGES for a in ("--text", str(stdlib / p))]
    if variant == "mix":
        return text + ["--prompts", str(files["answer-prompts"]), "--data", str(answers)]
    raise SystemExit(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


def variant_flags(variant: str, args, files: dict, answers: Path, held_out: Path) -> list:
    """`mlx-dflash train`'s flags for one variant: its data, the held-out set, the start drafter."""
    flags = [*variant_args(variant, files, answers), "--eval-prompts", str(files["held-out"]), "--eval-data",
             str(held_out), "--max-response-tokens", str(args.max_tokens)]
    return flags + (["--init", args.init or str(shipped_drafter_dir())] if args.init != "none" else [])


def final_scores(target, drafter_dir: Path, held_out: list, chat: list) -> dict:
    from mlx_dflash.models.loader import drafter_from_dir
    from mlx_dflash.tuner.replay import decoding_acceptance

    drafter = drafter_from_dir(drafter_dir).bind(target)
    tau = {}
    for name, sequences, lookup in (("gsm8k", held_out, False), ("gsm8k_lookup", held_out, True),
                                    ("chat", chat, False), ("chat_lookup", chat, True)):
        tau[name] = decoding_acceptance(drafter, target, sequences, widths=(16,), prompt_lookup=lookup)[16]["tau"]
    return tau


def table(runs: dict) -> str:
    lines = ["| data | steps | data CPU s | total CPU s | held-out tau@16 | + lookup | chat tau@16 | chat + lookup |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for variant, run in runs.items():
        last, final = run["history"][-1], run["final"]
        lines.append(f"| {variant} | {last['step']} | {run['data_cpu_seconds']:.0f} | "
                     f"{run['data_cpu_seconds'] + last['cpu_seconds']:.0f} | {final['gsm8k']:.3f} | "
                     f"{final['gsm8k_lookup']:.3f} | {final['chat']:.3f} | {final['chat_lookup']:.3f} |")
    start = next(iter(runs.values()))["start"]
    lines.append(f"| (start) | 0 | 0 | 0 | {start['gsm8k']:.3f} | {start['gsm8k_lookup']:.3f} | "
                 f"{start['chat']:.3f} | {start['chat_lookup']:.3f} |")
    return "\n".join(lines) + "\n"


def chart(runs: dict) -> bytes:
    curves = {}
    for variant, run in runs.items():
        start = run["data_cpu_seconds"] / 3600
        curves[variant] = ([start] + [start + h["cpu_seconds"] / 3600 for h in run["history"]],
                           [run["start"]["gsm8k"]] + [h["tau"] for h in run["history"]])
    return line_chart_png(curves, "CPU-hours (making the data + training)",
                          "held-out tau@16 (GSM8K, target's answers)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gsm8k", required=True, help="GSM8K's training split (JSONL of question/answer)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--answers", type=int, default=96, help="GSM8K problems the target answers for `answers`")
    ap.add_argument("--init", default=None, help="start drafter (default: the shipped one; none: random weights)")
    training_args(ap, steps=60, sequences=4, anchors=64, lr=3e-5, eval_every=20, eval_sequences=48)
    ap.add_argument("--chat-sequences", type=int, default=48, help="MT-Bench first turns for the chat tau")
    ap.add_argument("--max-tokens", type=int, default=192)
    name_arg(ap, "labels-cpu")
    args = ap.parse_args(argv)

    from mlx_dflash.downloads import ensure_prompt_set
    from mlx_dflash.models.loader import drafter_from_dir
    from mlx_dflash.pair import load_target

    target, tokenizer = load_target(default_target(None))
    drafter_from_dir(args.init or shipped_drafter_dir()).bind(target)  # the layers the features tap
    cache = cache_dir() / "data"
    answers = cache / f"smollm2-gsm8k-train-{ANSWERS_FIRST}-answers-{args.max_tokens}.jsonl"
    held_out_data = cache / f"smollm2-gsm8k-train-{HELD_OUT_FIRST}-held-out-{args.max_tokens}.jsonl"
    chat_data = cache / f"smollm2-mt-bench-answers-{args.max_tokens}.jsonl"
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        files = slices(Path(args.gsm8k), Path(tmp), args.answers, args.eval_sequences)
        held_out, _ = answered(target, tokenizer, files["held-out"], held_out_data, args.max_tokens)
        chat_prompts = Path(tmp) / "mt-bench.jsonl"
        chat_prompts.write_text("".join(Path(ensure_prompt_set("mt-bench")).read_text().splitlines(True)
                                        [: args.chat_sequences]))
        chat, _ = answered(target, tokenizer, chat_prompts, chat_data, args.max_tokens)
        start = final_scores(target, Path(args.init or shipped_drafter_dir()), held_out, chat)
        answers_cpu = None
        for variant in args.variants.split(","):
            data_cpu = 0.0
            if variant in ("answers", "mix"):
                if answers_cpu is None:  # made once, charged to both variants that read them
                    answers.unlink(missing_ok=True)
                    _, answers_cpu = answered(target, tokenizer, files["answer-prompts"], answers, args.max_tokens)
                data_cpu = answers_cpu
            out = Path(tmp) / variant
            history = train(variant, variant_flags(variant, args, files, answers, held_out_data), args, out)
            runs[variant] = {"history": history, "data_cpu_seconds": data_cpu, "start": start,
                             "final": final_scores(target, out, held_out, chat)}
            print(table(runs), flush=True)
    result = run_record(__file__, argv, schema=SCHEMA, settings={**vars(args), "gsm8k": portable_path(args.gsm8k)},
                        runs=runs)
    write_results(results_dir(args.name), "labels", result, table(runs), chart=lambda: chart(runs))
    print(table(runs))


if __name__ == "__main__":
    main()
