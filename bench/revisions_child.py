"""One measurement of bench/revisions.py: a configuration run on the revision this process imports (its
PYTHONPATH names that revision's tree), printed as JSON on the last line. It imports nothing else of bench/:
the harness stops a run whose package is not this tree's, and here another tree's package is the point.

    PYTHONPATH=TREE python bench/revisions_child.py '{"prompts": [[1, 2, 3]], "max_tokens": 8, "config": "width 4"}'
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

import mlx_dflash
from mlx_dflash.decoding.batch_decoder import batch_generate

TREES = ("tree, width 8", "tree, width auto")
WIDTHS = {"width auto": "auto", "width 4": 4, "width 16": 16, "tree, width 8": 8, "tree, width auto": "auto"}


def child(spec: dict) -> dict:
    """One configuration (spec: prompts as token ids, max_tokens, config): {"tokens": per prompt, "tps"}."""
    target, drafter, tokenizer = mlx_dflash.load()
    prompts, max_tokens, config = spec["prompts"], spec["max_tokens"], spec["config"]
    stop = set(tokenizer.eos_token_ids)

    def alone(ids: list, n: int) -> tuple:
        tokens, times = [], []
        for token, _ in generate_step(mx.array(ids), target.model, max_tokens=n):
            times.append(time.perf_counter())
            if token in stop:
                break
            tokens.append(int(token))
        return tokens, (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0

    def ours(ids: list, n: int) -> tuple:
        tree = {"tree": True} if config in TREES else {}
        out = mlx_dflash.generate(target, drafter, tokenizer, ids, max_tokens=n, width=WIDTHS[config], **tree)
        return [int(t) for t in out.tokens], out.stats.decode_tps

    if config == "batch, width auto":
        batch_generate(target, drafter, tokenizer, prompts, max_tokens=4, width="auto")  # warm-up
        tic = time.perf_counter()
        out = batch_generate(target, drafter, tokenizer, prompts, max_tokens=max_tokens, width="auto")
        tokens = [[int(t) for t in row] for row in out.token_ids]
        return {"tokens": tokens, "tps": sum(map(len, tokens)) / (time.perf_counter() - tic)}
    run = alone if config == "mlx-lm alone" else ours
    run(prompts[0], 8)  # warm-up (and, at width auto, the start-up probe)
    done = [run(ids, max_tokens) for ids in prompts]
    return {"tokens": [t for t, _ in done], "tps": statistics.mean(tps for _, tps in done)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("spec", help='JSON: {"prompts": token ids per prompt, "max_tokens": N, "config": NAME}')
    print(json.dumps(child(json.loads(ap.parse_args().spec))))
