"""Tiny random qwen2/qwen3-layout targets saved as mlx-lm directories (weights, index, tokenizer), with a
random drafter, and the launcher for multi-process tests (`mlx.launch --backend ring` over loopback)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.utils import _get_classes, save_config, save_model

from mlx_dflash.models.loader import drafter_config_for, init_drafter
from mlx_dflash.models.target import Target
from mlx_dflash.tuner.trainer import save_checkpoint

TINY = dict(hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=10000.0,
            max_position_embeddings=1024, eos_token_id=2)
FAMILIES = {"qwen2": {}, "qwen3": dict(head_dim=16)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# mlx.launch's entry point, whatever module holds it and wherever its script was installed.
LAUNCH = ["-c", "import sys; from importlib.metadata import entry_points; "
          "(ep,) = entry_points(group='console_scripts', name='mlx.launch'); sys.argv[0] = 'mlx.launch'; "
          "sys.exit(ep.load()())"]
CLI = ["-m", "mlx_dflash.cli"]


def save_tiny_target(out: Path, family: str, tokenizer_dir: Path, **overrides) -> Path:
    """A random `family` model with the vocabulary of the tokenizer in tokenizer_dir."""
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = dict(TINY, model_type=family, vocab_size=vocab, **{**FAMILIES[family], **overrides})
    model_class, args_class = _get_classes(config)
    mx.random.seed(sum(map(ord, family)))
    model = model_class(args_class.from_dict(config))
    # Larger weights than the default init, so the greedy continuation is not one repeated token.
    model.update(tree_map(lambda p: p * 3 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    save_model(out, model)  # model.safetensors + model.safetensors.index.json
    save_config(config, out / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def save_random_drafter(out: Path, target_dir: Path, block_size: int = 16, features: int = 3) -> Path:
    from mlx_lm import load

    model, _ = load(str(target_dir))
    config = drafter_config_for(Target(model), num_layers=1, block_size=block_size, num_target_features=features)
    save_checkpoint(init_drafter(config, seed=1), out, state=None)
    return out


def rank_env() -> dict:
    """One BLAS thread per rank (two ranks share this machine's cores)."""
    return dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")


def launch(args: list, ranks: int = 2, timeout: float = 300, env: dict | None = None, **kwargs):
    """`mlx.launch --backend ring -n ranks -- python args...` (env: more variables for the ranks); returns the
    CompletedProcess."""
    port_args = ["--starting-port", str(free_port())]
    cmd = [sys.executable, *LAUNCH, "--backend", "ring", "-n", str(ranks), *port_args,
           "--env", "OPENBLAS_NUM_THREADS=1", "--", sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(rank_env(), **(env or {})),
                          **kwargs)


def free_port(ranks: int = 2) -> int:
    """A port base for the ring backend, which listens on base .. base + ranks - 1: all of them free now, and
    below Linux's ephemeral range (where the previous run's connections may still hold ports)."""
    import random
    import socket

    for _ in range(50):
        base = random.randrange(20000, 30000)
        try:
            for port in range(base, base + ranks):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port pair for the ring backend")


def start_ranks(args: list, hostfile: Path, ranks: int = 2, env: dict | None = None) -> list:
    """Start the ranks of a ring run by hand, as mlx.launch does (MLX_RANK, MLX_HOSTFILE), so that a test
    holds every rank's process and can kill one. env: more variables for the ranks."""
    port = free_port()
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port + r}"] for r in range(ranks)]))
    return [subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(rank_env(), **(env or {}), MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile)))
            for r in range(ranks)]
