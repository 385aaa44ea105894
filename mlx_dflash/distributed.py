"""Targets sharded over MLX's own distributed backend: `generate --shard tensor|pipeline` under mlx.launch.

The target is loaded with mlx-lm's `sharded_load` on the launched group; the drafter (small) runs whole
on every rank. Every rank runs the same decoding loop, and two things keep them in step:

- `Ranks.agree` (before each verify): every rank verifies rank 0's drafts. The target forward is a
  collective, so the ranks must feed it the same tokens of the same length; rank 0's drafter and width
  policy decide, whatever the others computed (their timings differ, so `--width auto` could differ).
- `Ranks.settle` (after each verify, and the prefill): every rank keeps rank 0's acceptance and next token
  (a sampled token depends on the rank's random state).
- `Ranks.whole_features`: every rank gets the drafter's context features whole. With tensor sharding
  the captured layer outputs are already whole on every rank (each layer ends in an all-reduce). A
  pipeline stage runs only some layers, so each rank fills the captured layers it ran and leaves zeros
  in the others, and the kept rows are summed over the group.

Both are `all_sum`s of rank 0's values with zeros from the others. Per round that is two messages of
at most 2 + 2 * block_size floats, plus, under pipeline sharding, one sum of (accepted + 1) rows of
n_captured * hidden values (e.g. 5 x 4096 bf16 x 4 rows = 160 KB), issued once the accepted count is known.

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

import mlx.core as mx

from .decoding.decoder import SingleProcess
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
        if not self.layer_ids:
            return logits, None
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


def load_sharded_pair(target_path: str, drafter_path: str, mode: str, command: str = "generate"):
    """(Target shard, drafter bound to it, tokenizer, group) for this rank of an mlx.launch run."""
    from .pair import load_drafter, resolve

    group = launched_group(command)
    with said_once(group), lost_rank_errors(group.rank()):  # sharded_load ends in a collective
        model_dir = resolve(target_path, "target model")
        check_shardable(model_dir, mode, group.size())
        drafter = load_drafter(drafter_path)
        target, tokenizer = load_sharded_target(model_dir, mode, group)
        return target, drafter.bind(target), tokenizer, group


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


class GenerationStopped(Exception):
    """Rank 0 ended the current generation before the decoder did (serve: its client left, a stop string)."""


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


class Ranks(SingleProcess):
    """The ranks of one sharded run, kept in step at two points per round (see the module docstring)."""

    lockstep = True

    def __init__(self, group: mx.distributed.Group, block_size: int, partial_features: bool,
                 timeout: float = DEFAULT_RANK_TIMEOUT):
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.capacity = 2 + 2 * max(block_size, 1)
        self.partial_features = partial_features
        self.timeout = timeout
        self.comm_seconds = 0.0  # wall time spent in these exchanges (the model's own are not counted)
        self.exchanges = 0
        self._beat = time.monotonic()

    def _from_rank0(self, values: list) -> list:
        """Rank 0's values on every rank: an all_sum where the other ranks send zeros."""
        payload = [0.0] * self.capacity
        if self.rank == 0:
            payload[: len(values)] = values
        summed = self._timed(mx.distributed.all_sum(mx.array(payload, dtype=mx.float32), group=self.group))
        return summed.tolist()

    def _timed(self, array: mx.array) -> mx.array:
        tic = time.perf_counter()
        mx.eval(array)
        self.comm_seconds += time.perf_counter() - tic
        self.exchanges += 1
        self._beat = time.monotonic()
        return array

    def share(self, array: mx.array) -> mx.array:
        """Rank 0's `array` on every rank (the others pass zeros of the same shape and dtype)."""
        return self._timed(mx.distributed.all_sum(array, group=self.group))

    def agree(self, drafts: mx.array, confidence) -> tuple:
        """Rank 0's drafts [1, n] and the confidence it read (None: none), on every rank: the ranks decode one
        request in step, a row."""
        # Token ids travel as float32: exact up to 2**24, far past any vocabulary.
        (ids,) = drafts.tolist()
        read = confidence[0] if confidence is not None else []
        got = self._from_rank0([len(ids), len(read), *ids, *read])
        if got[0] < 0:  # rank 0 sent stop() in place of this round's drafts
            raise GenerationStopped()
        n, m = int(got[0]), int(got[1])
        return mx.array([[int(t) for t in got[2 : 2 + n]]], dtype=mx.int32), [got[2 + n : 2 + n + m]] if m else None

    def stop(self):
        """On rank 0, after a round, to end the generation early: the other ranks, which have gone on to
        the next round, get it in place of that round's drafts (`agree` raises GenerationStopped)."""
        self._from_rank0([-1])

    def settle(self, accepted: list, tokens: list) -> tuple:
        """Rank 0's number of kept drafts and next token of its one row (after the verify, or the prefill's
        token)."""
        got = self._from_rank0([accepted[0], tokens[0]])
        return [int(got[0])], [int(got[1])]

    def whole_features(self, rows: mx.array) -> mx.array:
        """The drafter's context rows with every captured layer filled: under pipeline sharding each rank
        computed only its own layers' (zeros elsewhere), so the rows are summed over the group."""
        if not self.partial_features:
            return rows
        mx.eval(rows)  # the forward that made them, so that only the exchange below is timed
        return self._timed(mx.distributed.all_sum(rows, group=self.group))

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
