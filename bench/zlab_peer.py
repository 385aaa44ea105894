"""z-lab's MLX backend as a peer row in the benchmarks: `dflash/model_mlx.py` of the published
`dflash==0.1.0` wheel, fetched from PyPI, sha256-checked and imported from that file (the package is
never installed: its exact pins would fight ours).

What runs is z-lab's own code: its drafter class and config parsing (`load_draft`), and its speculative
loop (`stream_generate(model, draft, tokenizer, prompt, block_size=w, max_tokens=n)`, greedy at the
default temperature 0), which drafts `w - 1` tokens from a block of `w` rows and verifies `w` rows.
Two pieces of composition, nothing of mlx-lm patched:
* `load_draft` wants a hub id and calls `snapshot_download`; our private copy of the module gets a
  resolver in that name which accepts only a local directory (the hub is never reached). The directory
  it is given is a staged copy of our drafter (config.json + the published checkpoint's tensors: keys
  outside the published names, such as the target's borrowed embedding or head, are left out, as our
  own loader does), because z-lab loads strictly.
* its loop wraps the target's layers for good (`_patch_model`), so it gets its own mlx-lm instance of
  the target, loaded (and quantized, for a quantized row) apart from ours before its first call.
On a hybrid target its loop patches mlx-lm's GatedDeltaNet class while it runs; the peer is meant for
plain attention targets like the default pair.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from mlx_dflash.downloads import fetch_pypi_member
from mlx_dflash.errors import DFlashError
from mlx_dflash.utils import cache_dir, safetensors_files

PACKAGE, VERSION, MEMBER = "dflash", "0.1.0", "dflash/model_mlx.py"
MODEL_MLX_SHA256 = "2f8598eaca4cb814e63ea69e791c1bdf55ba82280bfd299f9141906356b7cb87"
# Tensor names of a published DFlash checkpoint (v1 and DFlash 2), the names z-lab's drafter has.
PUBLISHED_PREFIXES = ("fc.", "hidden_norm.", "layers.", "norm.", "candidate_selector.")


def fetch_model_mlx() -> Path:
    """The verified model_mlx.py in our cache, downloaded on first use (DFlashError when it cannot be)."""
    dest = cache_dir() / "downloads" / f"{PACKAGE}-{VERSION}" / Path(MEMBER).name
    if not dest.exists():
        fetch_pypi_member(PACKAGE, VERSION, MEMBER, MODEL_MLX_SHA256, dest)
    return dest


def import_model_mlx(path: Path | None = None):
    """z-lab's module, imported from its file under a private name (nothing joins sys.modules)."""
    path = path or fetch_model_mlx()
    spec = importlib.util.spec_from_file_location("zlab_dflash_model_mlx", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise DFlashError(f"z-lab's {MEMBER} does not import with this mlx-lm: {e}") from None

    def local_only(repo_id, **_):
        if not Path(repo_id).is_dir():
            raise DFlashError(f"the z-lab peer loads only local drafter directories, not {repo_id!r}")
        return repo_id

    module.snapshot_download = local_only
    return module


def load_zlab_drafter(module, drafter_dir: str | Path):
    """z-lab's drafter object for our drafter directory, through z-lab's own loader."""
    drafter_dir = Path(drafter_dir)
    config = json.loads((drafter_dir / "config.json").read_text())
    if config.get("quantization"):
        raise DFlashError(f"the z-lab peer loads float drafters only; {drafter_dir} is quantized")
    weights = {}
    for f in safetensors_files(drafter_dir):
        weights.update(mx.load(str(f)))
    kept = {k: v for k, v in weights.items() if k.startswith(PUBLISHED_PREFIXES)}
    with tempfile.TemporaryDirectory(prefix="zlab-drafter-") as staged:
        (Path(staged) / "config.json").write_text(json.dumps(config))
        mx.save_safetensors(str(Path(staged) / "model.safetensors"), kept)
        try:
            draft = module.load_draft(staged)
        except (ValueError, KeyError) as e:
            raise DFlashError(f"z-lab's load_draft cannot read {drafter_dir}: {e}") from None
    return draft, sorted(set(weights) - set(kept))


def load_zlab_target(model_dir: str | Path, quantize_bits: int = 0):
    """A separate mlx-lm instance of the target (z-lab's loop wraps its layers for good), quantized like
    ours (group 64) before z-lab's first call."""
    import mlx.nn as nn
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    if quantize_bits:
        nn.quantize(model, group_size=64, bits=quantize_bits)
        mx.eval(model.parameters())
    return model, tokenizer


def run_zlab(module, model, draft, tokenizer, ids: list, max_tokens: int, width: int) -> dict:
    """One greedy generation by z-lab's loop at block size `width`, timed like ours.

    Decode tokens/s = (generated tokens incl. a stop token - 1) / seconds from the response that
    carries the first token (the prefill's) to the last response that carries tokens. z-lab's loop
    yields a stop token as part of its output; it is counted and then dropped from `tokens`, as the
    decoder does. tau: the tokens each verify round yielded (z-lab's `accepted`), mean over rounds.
    """
    stop_ids = set(tokenizer.eos_token_ids)
    t0, c0 = time.perf_counter(), time.process_time()
    t_first = t_last = None
    tokens, per_round, widths, finish = [], [], {}, None
    for response in module.stream_generate(model, draft, tokenizer, mx.array(ids), block_size=width,
                                           max_tokens=max_tokens):
        if not response.tokens:
            finish = finish or response.finish_reason
            continue
        now = time.perf_counter()
        if t_first is None:
            t_first = now
        else:  # a verify round: z-lab's block size that round is min(width, tokens left + 1)
            per_round.append(response.accepted)
            w = min(width, max_tokens - len(tokens) + 1)
            widths[str(w)] = widths.get(str(w), 0) + 1
        t_last = now
        tokens.extend(int(t) for t in response.tokens)
        finish = response.finish_reason or finish
    generated = len(tokens)
    stop_at = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
    if stop_at is not None:
        tokens, finish = tokens[:stop_at], "stop"
    decode_s = (t_last - t_first) if t_first is not None else 0.0
    return {"tokens": tokens, "generated_tokens": generated, "finish_reason": finish or "length",
            "prefill_seconds": (t_first - t0) if t_first is not None else 0.0, "decode_seconds": decode_s,
            "decode_tps": (generated - 1) / decode_s if decode_s > 0 and generated > 1 else 0.0,
            "tau": sum(per_round) / len(per_round) if per_round else 0.0, "rounds": len(per_round),
            "widths": dict(sorted(widths.items(), key=lambda kv: int(kv[0]))),
            "accepted_lengths": {str(n): per_round.count(n) for n in sorted(set(per_round))},
            "wall_seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}
