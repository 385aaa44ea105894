"""Targets sharded over MLX's own distributed backend: `generate` and `serve --shard tensor|pipeline` under
mlx.launch.

The target is loaded with mlx-lm's `sharded_load` on the launched group; the drafter (small) runs whole
on every rank. Every rank runs the same decoding loop over the same rows (one request, or a server's batch),
and these keep them in step:

- `Ranks.agree` (before each verify): every rank verifies rank 0's drafts. The target forward is a
  collective, so the ranks must feed it the same tokens of the same length; rank 0's drafter and width
  policy decide, whatever the others computed (their timings differ, so `--width auto` could differ).
- `Ranks.agree_trees` (before a verify that may take a tree, `--tree`): every rank verifies rank 0's draft
  trees (decoding/tree.py), or the chain where rank 0 chose one.
- `Ranks.settle` (after each verify, and the prefill): every rank keeps rank 0's acceptance and next token
  (a sampled token depends on the rank's random state); after a tree's verify, the node its walk ended at.
- `Ranks.decide`: rank 0's choice where a server's scheduler chooses by the clock (read a prompt's chunk now,
  or decode); what requests join and leave travels apart (server/sharded.py).
- `Ranks.whole_features`: every rank gets the drafter's context features whole. With tensor sharding
  the captured layer outputs are already whole on every rank (each layer ends in an all-reduce). A
  pipeline stage runs only some layers, so each rank fills the captured layers it ran and leaves zeros
  in the others, and the kept rows are summed over the group.

All are `all_sum`s of rank 0's values with zeros from the others. Per round that is two messages of at most
3 + 2 * rows * block_size floats (with `--tree`, two more: 3 floats, then 6 * rows * nodes), plus, under
pipeline sharding, one sum of (accepted + 1) rows of n_captured * hidden values (e.g. 5 x 4096 bf16 x 4 rows =
160 KB), issued once the accepted count is known.

A rank that dies closes its sockets, and the ring backend raises in the others; one that hangs stops
the round heartbeat. Either way the survivors print one line and exit non-zero (`Ranks.watch`).
"""

import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from typing import Optional

import mlx.core as mx
import numpy as np

from .decoding.decoder import SingleProcess
from .decoding.tree import Trees
from .errors import DFlashError
from .models.target import Target

SHARD_MODES = ("tensor", "pipeline")
DEFAULT_RANK_TIMEOUT = 300.0  # seconds without a finished round before a rank gives up on the others


def launched_group(command: str = "generate") -> mx.distributed.Group:
    """The group this process was launched into; refuses a lone process (nothing to shard over)."""
    group = mx.distributed.init()
    if group.size() < 2:
        raise DFlashError("--shard needs several ranks: start the command with mlx.launch, e.g. "
                          f"`mlx.launch --backend ring -n 2 -- mlx-dflash {command} ... --shard tensor`")
    return group


def _text_config(config: dict) -> dict:
    return {**config, **config.get("text_config", {})}


def check_shardable(model_dir: Path, mode: str, ranks: int) -> None:
    """Refuse, before loading anything, a target that `mode` cannot split over `ranks` processes."""
    from mlx_lm.models.pipeline import PipelineMixin
    from mlx_lm.utils import _get_classes

    model_dir = Path(model_dir)
    config_file = model_dir / "config.json"
    if not config_file.exists():
        raise DFlashError(f"target model {model_dir} has no config.json: is it an mlx-lm model directory?")
    config = json.loads(config_file.read_text())
    kind = config.get("model_type", "?")
    try:
        model_class, _ = _get_classes(config)
    except ValueError as e:
        raise DFlashError(f"mlx-lm cannot load target model {model_dir}: {e}") from None
    text = _text_config(config)
    if mode == "tensor":
        if not hasattr(model_class, "shard"):
            raise DFlashError(f"--shard tensor: mlx-lm's '{kind}' models have no tensor parallelism (no shard()); "
                              "try --shard pipeline")
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = text.get(key, text.get("num_attention_heads") if key == "num_key_value_heads" else None)
            if value is not None and value % ranks:
                raise DFlashError(f"--shard tensor: {key} {value} of {model_dir.name} does not divide over "
                                  f"{ranks} ranks; launch a rank count that divides it, or use --shard pipeline")
        return
    module = sys.modules[model_class.__module__]
    stages = [c for c in vars(module).values()
              if isinstance(c, type) and issubclass(c, PipelineMixin) and c is not PipelineMixin]
    if not stages:
        raise DFlashError(f"--shard pipeline: mlx-lm's '{kind}' models have no pipeline support; "
                          "try --shard tensor")
    layers = text.get("num_hidden_layers", 0)
    if layers < ranks:
        raise DFlashError(f"--shard pipeline: {layers} layers cannot be split over {ranks} ranks")
    if not (Path(model_dir) / "model.safetensors.index.json").exists():
        raise DFlashError(f"--shard pipeline: {model_dir} has no model.safetensors.index.json (mlx-lm picks each "
                          "stage's weight files from it); re-save the model with mlx_lm.convert")


class PipelineStage(Target):
    """A target whose model runs only some decoder layers here (an mlx-lm pipeline stage).

    Its features hold the captured layers this stage ran and zeros for the others; `Ranks.settle` sums
    them over the group. Logits are whole on every rank (mlx-lm all-gathers the last stage's output).
    """

    @property
    def num_layers(self) -> int:
        # model.layers is cut short on every stage but the first-layer one; the count itself survives.
        return getattr(self._inner, "num_hidden_layers", None) or self._inner.args.num_hidden_layers

    def _run(self, ids: mx.array, cache: list):  # under both forward (verify) and prefill
        with self._recording() as sink:
            logits = self.model(ids, cache=cache)
        if not self.layer_ids:  # nothing captured (no drafter): zero-width features, as Target's
            return logits, mx.zeros((*ids.shape, 0), logits.dtype)
        # One dtype on every rank (the logits', the hidden states' in mlx-lm), or the sum over ranks fails.
        zeros = mx.zeros((*ids.shape, self.hidden_size), dtype=logits.dtype)
        parts = [sink[i].astype(logits.dtype) if i in sink else zeros for i in self.layer_ids]
        return logits, mx.concatenate(parts, axis=-1)


def load_sharded_target(model_dir: Path, mode: str, group: mx.distributed.Group):
    """(Target, tokenizer) with this rank's shard of the model, via mlx-lm's sharded_load."""
    from mlx_lm.utils import sharded_load

    try:
        if mode == "tensor":
            model, tokenizer = sharded_load(str(model_dir), tensor_group=group)
            return Target(model), tokenizer
        model, tokenizer = sharded_load(str(model_dir), pipeline_group=group)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise DFlashError(f"mlx-lm cannot load target model {model_dir} sharded ({mode}): {e}") from None
    return PipelineStage(model), tokenizer


def load_sharded_pair(target_path: str, drafter_path, mode: str, command: str = "generate"):
    """(Target shard, drafter bound to it, tokenizer, group) for this rank of an mlx.launch run; drafter_path as
    pair.bind_drafter takes it."""
    from .pair import bind_drafter, resolve

    group = launched_group(command)
    with said_once(group), lost_rank_errors(group.rank()):  # sharded_load ends in a collective
        model_dir = resolve(target_path, "target model")
        check_shardable(model_dir, mode, group.size())
        target, tokenizer = load_sharded_target(model_dir, mode, group)
        target.install_wide_kernels()  # on Metal, as one process does (pair.load): each rank races its own
        target.install_attention_kernel()
        return target, bind_drafter(drafter_path, target), tokenizer, group


@contextmanager
def said_once(group):
    """An error every rank reaches alike (a refusal, a mismatched pair) is printed by rank 0 only."""
    try:
        yield
    except DFlashError as e:
        if not hasattr(e, "quiet"):
            e.quiet = group.rank() != 0
        raise


class RankLost(DFlashError):
    """Another rank of the group has gone: this one cannot go on."""


@contextmanager
def lost_rank_errors(rank: int):
    """A backend's error about a lost peer (the ring's "[ring] connection to a peer was lost") as one line,
    which every rank prints."""
    try:
        yield
    except RuntimeError as e:
        message = str(e).splitlines()[0] if str(e) else ""
        if not message.startswith(("[ring]", "[jaccl]", "[mpi]", "[nccl]")):
            raise
        error = RankLost(f"rank {rank}: lost contact with the other ranks ({message}); "
                            "another rank has stopped: see its own output")
        error.quiet = False
        raise error from None


TREE_FIELDS = {"tokens": np.int64, "parents": np.int64, "depth": np.int64, "probs": np.float64, "alive": bool,
               "copied": bool}  # a `Trees` as the ranks exchange it


class Ranks(SingleProcess):
    """The ranks of one sharded run, kept in step at two points per round (see the module docstring)."""

    lockstep = True

    def __init__(self, group: mx.distributed.Group, block_size: int, partial_features: bool,
                 timeout: float = DEFAULT_RANK_TIMEOUT, max_rows: int = 1):
        self.group, self.rank, self.size = group, group.rank(), group.size()
        # a round's drafts and confidence: row count, draft count, confidence count, then each row's
        self.capacity = 3 + 2 * max_rows * max(block_size, 1)
        self.partial_features = partial_features
        self.timeout = timeout
        self.comm_seconds = 0.0  # wall time spent in these exchanges (the model's own are not counted)
        self.exchanges = 0
        self._beat = time.monotonic()

    def _sum(self, array: mx.array) -> mx.array:
        """The group's sum of `array` (the one collective every exchange here is)."""
        return mx.distributed.all_sum(array, group=self.group)

    def _from_rank0(self, values: list) -> list:
        """Rank 0's values on every rank: an all_sum where the other ranks send zeros."""
        payload = [0.0] * self.capacity
        if self.rank == 0:
            payload[: len(values)] = values
        return self._timed(self._sum(mx.array(payload, dtype=mx.float32))).tolist()

    def _timed(self, array: mx.array) -> mx.array:
        tic = time.perf_counter()
        mx.eval(array)
        self.comm_seconds += time.perf_counter() - tic
        self.exchanges += 1
        self._beat = time.monotonic()
        return array

    def share(self, array: mx.array) -> mx.array:
        """Rank 0's `array` on every rank (the others pass zeros of the same shape and dtype)."""
        return self._timed(self._sum(array))

    def decide(self, choice: int) -> int:
        """Rank 0's choice (a scheduler's, made by the clock) on every rank."""
        return int(self._from_rank0([choice])[0])

    def agree(self, drafts: mx.array, confidence) -> tuple:
        """Rank 0's drafts [B, n] and the confidence it read (None: none), on every rank: the ranks decode the
        same rows in step."""
        # Token ids travel as float32: exact up to 2**24, far past any vocabulary.
        ids = drafts.tolist()
        read = confidence or []
        m = len(read[0]) if read else 0
        got = self._from_rank0([len(ids), drafts.shape[1], m, *(t for row in ids for t in row),
                                *(c for row in read for c in row)])
        B, n, m = int(got[0]), int(got[1]), int(got[2])
        agreed = mx.array(np.array(got[3 : 3 + B * n], dtype=np.int32).reshape(B, n))
        confidences = got[3 + B * n : 3 + B * n + B * m]
        return agreed, [confidences[b * m : (b + 1) * m] for b in range(B)] if m else None

    def agree_trees(self, trees: Optional[Trees]) -> Optional[Trees]:
        """Rank 0's draft trees (None: it verifies a chain this round) on every rank, rank 0's own included, so
        that every rank's policy learns from the same numbers."""
        shape = trees.tokens.shape if trees is not None else (0, 0)
        head = self._from_rank0([float(trees is not None), *shape])
        if not head[0]:
            return None
        B, M = int(head[1]), int(head[2])
        mine = np.zeros((len(TREE_FIELDS), B, M), np.float32)
        if self.rank == 0:  # token ids travel as float32: exact up to 2**24, far past any vocabulary
            mine[:] = [getattr(trees, name) for name in TREE_FIELDS]
        got = np.array(self.share(mx.array(mine)))
        return Trees(**{name: got[i].astype(dtype) for i, (name, dtype) in enumerate(TREE_FIELDS.items())})

    def settle(self, accepted: list, tokens: list) -> tuple:
        """Rank 0's number of kept drafts and next token of each row (after the verify, or the prefill's
        token)."""
        got = [int(v) for v in self._from_rank0([*accepted, *tokens])]
        B = len(accepted)
        return got[:B], got[B : 2 * B]

    def whole_features(self, rows: mx.array) -> mx.array:
        """The drafter's context vectors with every captured layer filled: under pipeline sharding each rank
        computed only its own layers' (zeros elsewhere), so the rows are summed over the group."""
        if not self.partial_features or rows is None or not rows.shape[-1]:  # (no drafter: no features)
            return rows
        mx.eval(rows)  # the forward that made them, so that only the exchange below is timed
        return self._timed(self._sum(rows))

    @contextmanager
    def watch(self):
        """Turn a lost rank into one line and a non-zero exit: the ring backend's error when a peer's
        socket closes, or the heartbeat going quiet for `timeout` seconds when a peer hangs."""
        self._beat = time.monotonic()
        done = threading.Event()

        def watchdog():
            while not done.wait(1.0):
                if time.monotonic() - self._beat > self.timeout:
                    sys.stderr.write(f"error: rank {self.rank}: no round finished in {self.timeout:.0f} s: another "
                                     "rank has stopped answering (see its own output); giving up\n")
                    sys.stderr.flush()
                    os._exit(1)

        threading.Thread(target=watchdog, daemon=True).start()
        try:
            with lost_rank_errors(self.rank):
                yield self
        finally:
            done.set()

    def summary(self, rounds: int) -> str:
        per_round = self.comm_seconds / rounds * 1e3 if rounds else 0.0
        return (f"ranks: {self.size}, rank-agreement exchanges {self.exchanges}, {self.comm_seconds * 1e3:.1f} ms "
                f"({per_round:.2f} ms per round; the model's own collectives not included)")
